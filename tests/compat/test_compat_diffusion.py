"""lorafast.compat.diffusion: SGLang's diffusion LoRA format detection and PEFT checks, from headers."""

from __future__ import annotations

from pathlib import Path

import pytest
from lorafast.compat import AdapterView
from lorafast.compat import diffusion as df
from lorafast.testing import write_peft_adapter, write_safetensors

F = df.LoRAFormat


def keys(*names: str) -> dict[str, tuple[int, ...]]:
    return {n: (4, 4) for n in names}


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        # The shapes of SGLang's own before/after table (test_lora_format_adapter.py), as key patterns.
        (keys("double_blocks.0.processor.proj_lora1.down.weight", "double_blocks.0.processor.proj_lora1.up.weight"),
         F.XLABS_FLUX),
        (keys("diffusion_model.double_blocks.0.processor.qkv_lora2.down.weight"), F.XLABS_FLUX),
        (keys("lora_unet_double_blocks_0_img_attn_proj.lora_down.weight", "lora_unet_double_blocks_0_img_attn_proj.alpha",
              "lora_te1_text_model_encoder.lora_down.weight"), F.KOHYA_FLUX),
        (keys("double_blocks.0.img_attn.qkv.lora_A.weight", "single_blocks.1.linear1.lora_B.weight"), F.AI_TOOLKIT_FLUX),
        (keys("base_model.model.single_blocks.1.linear1.lora_A.weight"), F.AI_TOOLKIT_FLUX),
        (keys("lora_unet_down_blocks_0_attentions_0.lora_down.weight", "lora_te_text_model.lora_up.weight",
              "lora_unet_down_blocks_0_attentions_0.alpha"), F.NON_DIFFUSERS_SD),
        (keys("diffusion_model.blocks.0.cross_attn.k.lora_down.weight", "diffusion_model.blocks.0.cross_attn.k.lora_up.weight"),
         F.WAN),
        (keys("transformer.transformer_blocks.0.attn.to_q.lora.down.weight"), F.STANDARD),  # Qwen-Image
        (keys("transformer_blocks.0.attn.to_q.lora_down.weight", "transformer_blocks.0.attn.to_q.lora_up.weight"),
         F.NON_DIFFUSERS_SD),  # Qwen-Image-Lightning style
        (keys("transformer.transformer_blocks.0.attn.to_q.lora_A.weight"), F.STANDARD),
        (keys("diffusion_model.blocks.0.self_attn.q.diff"), F.STANDARD),
        ({}, F.STANDARD),
    ],
)  # fmt: skip
def test_detect_lora_format(state: dict[str, tuple[int, ...]], expected: df.LoRAFormat) -> None:
    assert df.detect_lora_format(state) is expected


def test_detect_lora_format_order() -> None:
    # ai-toolkit wins over standard; any lora_A/B wins over XLabs-looking keys; Wan needs a block part.
    mixed = keys("double_blocks.0.processor.proj_lora1.down.weight", "x.lora_A.weight")
    assert df.detect_lora_format(mixed) is F.AI_TOOLKIT_FLUX  # the two tests need not hit the same key
    mixed = keys("diffusion_model.double_blocks.0.processor.proj_lora1.down.weight", "x.lora_A.weight")
    assert df.detect_lora_format(mixed) is F.STANDARD
    assert df.detect_lora_format(keys("diffusion_model.blocks.0.norm1.lora_down.weight")) is F.STANDARD
    assert F.XLABS_FLUX.value == "xlabs-ai" and F.NON_DIFFUSERS_SD.value == "non-diffusers-sd"


def test_detect_from_file(tmp_path: Path) -> None:
    path = tmp_path / "flux_kohya.safetensors"
    write_safetensors(path, {"lora_unet_single_blocks_0_linear1.lora_down.weight": ("BF16", (4, 16)),
                             "lora_unet_single_blocks_0_linear1.lora_up.weight": ("BF16", (16, 4))})  # fmt: skip
    assert df.detect_lora_format(str(path)) is F.KOHYA_FLUX


def test_normalize_peft_keys() -> None:
    state = keys("base_model.model.a.lora_A.default.weight", "base_model.model.a.lora_B.default.weight")
    assert df.normalize_peft_keys(state) == {"a.lora_A.weight": (4, 4), "a.lora_B.weight": (4, 4)}
    # The prefix is only stripped when every key has it.
    partial = keys("base_model.model.a.lora_A.weight", "b.lora_A.weight")
    assert list(df.normalize_peft_keys(partial)) == ["base_model.model.a.lora_A.weight", "b.lora_A.weight"]
    assert list(df.normalize_peft_keys(keys("peft_model.base_model.model.x.lora_B.weight"))) == ["x.lora_B.weight"]

    with pytest.raises(ValueError) as info:
        df.normalize_peft_keys(keys("a.lora_A.default.weight", "a.lora_A.weight"))
    assert (
        str(info.value) == "LoRA checkpoint contains multiple PEFT adapter slots for the same tensor: 'a.lora_A.weight'"
    )
    with pytest.raises(ValueError) as info:
        df.normalize_peft_keys(keys("a.lora_A.one.weight", "b.lora_A.two.weight"))
    assert str(info.value) == "LoRA checkpoint contains multiple PEFT adapter slots: ['one', 'two']"
    with pytest.raises(ValueError) as info:
        df.normalize_peft_keys(keys("a.lora_A.one.weight", "b.lora_A.weight"))
    assert str(info.value) == "LoRA checkpoint mixes named and unnamed PEFT adapter slots"


def test_validate_peft_features_messages() -> None:
    state = keys("a.lora_A.weight", "a.lora_B.weight")
    df.validate_peft_features(state, {"r": 4, "bias": "none", "use_dora": False})
    with pytest.raises(ValueError) as info:
        df.validate_peft_features(state, {"modules_to_save": ["head"], "bias": "all", "fan_in_fan_out": True,
                                          "use_qalora": False, "target_parameters": ["experts"]})  # fmt: skip
    assert str(info.value) == (
        "PEFT adapter requires unsupported auxiliary/runtime features: ['bias', 'fan_in_fan_out', 'modules_to_save', "
        "'target_parameters']"
    )
    with pytest.raises(ValueError) as info:
        df.validate_peft_features(state, {"use_dora": True})
    assert str(info.value) == "DoRA adapters are not supported by the native diffusion LoRA layers"
    with pytest.raises(ValueError) as info:
        df.validate_peft_features({**state, "a.lora_magnitude_vector": (4,)}, {})
    assert str(info.value) == "DoRA adapters are not supported by the native diffusion LoRA layers"
    aux = keys(*[f"emb{i}.lora_embedding_A" for i in range(10)])
    with pytest.raises(ValueError) as info:
        df.validate_peft_features(aux, {})
    assert str(info.value) == (
        "PEFT adapter contains unsupported auxiliary tensors: ['emb0.lora_embedding_A', 'emb1.lora_embedding_A', "
        "'emb2.lora_embedding_A', 'emb3.lora_embedding_A', 'emb4.lora_embedding_A', 'emb5.lora_embedding_A', "
        "'emb6.lora_embedding_A', 'emb7.lora_embedding_A']"
    )


def test_validate_peft_features_reads_the_adapter_config(tmp_path: Path) -> None:
    tensors = {"base_model.model.x.lora_A.weight": (4, 8), "base_model.model.x.lora_B.weight": (8, 4)}
    folder = write_peft_adapter(tmp_path / "dit", tensors, r=4, lora_alpha=4, target_modules=["x"], lora_bias=True)
    with pytest.raises(ValueError) as info:
        df.validate_peft_features(str(folder))
    assert str(info.value) == "PEFT adapter requires unsupported auxiliary/runtime features: ['lora_bias']"


def test_check_peft_config() -> None:
    state = keys("a.lora_A.weight", "a.lora_B.weight")
    df.check_peft_config(state, {"alpha_pattern": {"a": 8}, "use_rslora": True})
    cases = [
        ({"alpha_pattern": ["a"]}, "PEFT alpha_pattern must be an object"),
        ({"alpha_pattern": {"a": 0}}, "PEFT lora_alpha must be a positive integer"),
        ({"alpha_pattern": {"a": None}}, "PEFT alpha_pattern value for 'a' must be a positive integer"),
        ({"alpha_pattern": {"(": 4}}, "Invalid PEFT alpha_pattern expression '(': missing ), unterminated subpattern at position 7"),
        ({"use_rslora": "yes"}, "PEFT use_rslora must be boolean"),
    ]  # fmt: skip
    for config, message in cases:
        with pytest.raises(ValueError) as info:
            df.check_peft_config(state, config)
        assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        df.check_peft_config(keys("a.lora_A.weight"), {"use_rslora": True})
    assert str(info.value) == "PEFT use_rslora is true, but no LoRA A/B pairs were found"
    with pytest.raises(ValueError) as info:
        df.check_peft_config(keys("a.lora_B.weight"), {"use_rslora": True})
    assert str(info.value) == "RSLoRA weight 'a.lora_B.weight' has no valid rank-bearing A"


def test_merge_mode_and_one_adapter_per_target() -> None:
    assert df.resolve_lora_merge_mode() == "auto"
    assert df.resolve_lora_merge_mode(merge_weights=False) == "dynamic"
    assert df.resolve_lora_merge_mode(False, "merge") == "merge"
    with pytest.raises(ValueError) as info:
        df.resolve_lora_merge_mode(merge_mode="fast")
    assert str(info.value) == "Invalid LoRA merge mode: fast. Valid modes: ('auto', 'merge', 'dynamic')"
    assert df.check_adapters_per_target(2, "auto") is True
    assert df.check_adapters_per_target(1, "dynamic") is False
    for mode, fsdp in (("dynamic", False), ("auto", True)):
        with pytest.raises(ValueError) as info:
            df.check_adapters_per_target(2, mode, fsdp_sharded=fsdp)
        assert str(info.value) == (
            "Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple adapters."
        )


def test_view_input() -> None:
    v = AdapterView.from_tensors(keys("lora_te_x.lora_down.weight"), {"r": 1})
    assert df.detect_lora_format(v) is F.NON_DIFFUSERS_SD
