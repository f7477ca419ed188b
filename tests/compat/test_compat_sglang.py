"""lorafast.compat.sglang: SGLang's LoRA checks from headers, with SGLang's exact messages.

Every expected message is spelled out as a literal string, as SGLang prints it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lorafast.compat import AdapterView, LoraRef, lora_id
from lorafast.compat import sglang as sg
from lorafast.testing import write_safetensors

P = "base_model.model.model.layers."
MIXED = (
    "Mixed shared-outer LoRA formats detected across loaded adapters (conflict in adapter '{}'). "
    "All MoE adapters must either all use shared outer experts (expert_dim=1) or all use per-expert weights."
)


def view(tensors: dict[str, tuple[int, ...]], name: str = "a", **config: Any) -> AdapterView:
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **config}
    return AdapterView.from_tensors(tensors, cfg, name=name, path=f"/adapters/{name}", adapter_id=name)


def attn(layer: int = 0, r: int = 4, h: int = 16) -> dict[str, tuple[int, ...]]:
    base = f"{P}{layer}.self_attn."
    return {
        base + "q_proj.lora_A.weight": (r, h), base + "q_proj.lora_B.weight": (h, r),
        base + "v_proj.lora_A.weight": (r, h), base + "v_proj.lora_B.weight": (8, r),
    }  # fmt: skip


def moe_shared(layer: int = 0, e: int = 4, r: int = 4, h: int = 16, i: int = 8) -> dict[str, tuple[int, ...]]:
    base = f"{P}{layer}.mlp.experts."
    return {
        base + "gate_up_proj.lora_A.weight": (1, r, h), base + "gate_up_proj.lora_B.weight": (e, 2 * i, r),
        base + "down_proj.lora_A.weight": (e, r, i), base + "down_proj.lora_B.weight": (1, h, r),
    }  # fmt: skip


def moe_numbered(layer: int = 0, e: int = 2, r: int = 4, h: int = 16, i: int = 8, w: bool = False) -> dict:
    out = {}
    for x in range(e):
        base = f"{P}{layer}.block_sparse_moe.experts.{x}." if w else f"{P}{layer}.mlp.experts.{x}."
        names = ("w1", "w3", "w2") if w else ("gate_proj", "up_proj", "down_proj")
        out[base + f"{names[0]}.lora_A.weight"] = (r, h)
        out[base + f"{names[0]}.lora_B.weight"] = (i, r)
        out[base + f"{names[1]}.lora_A.weight"] = (r, h)
        out[base + f"{names[1]}.lora_B.weight"] = (i, r)
        out[base + f"{names[2]}.lora_A.weight"] = (r, i)
        out[base + f"{names[2]}.lora_B.weight"] = (h, r)
    return out


MOE_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


# --- SGLang's own detection unit cases (test_outer_factor_detection_bool_and_mixed_rejected) --------------


def test_sglang_detection_unit_cases() -> None:
    shared = AdapterView.from_tensors({"model.layers.0.mlp.experts.gate_up_proj.lora_A.weight": (1, 8, 4)})
    per_expert = AdapterView.from_tensors({"model.layers.0.mlp.experts.0.gate_up_proj.lora_A.weight": (4, 4)})
    assert sg.detect_shared_outer_loras({"shared": shared}) is True
    assert sg.detect_shared_outer_loras({"per-expert": per_expert}) is False
    with pytest.raises(RuntimeError, match="Mixed shared-outer LoRA formats") as info:
        sg.detect_shared_outer_loras({"shared": shared, "per-expert": per_expert})
    assert str(info.value) == MIXED.format("per-expert")


def test_detection_from_files_uses_lora_id(peft: Callable[..., str]) -> None:
    a = peft("shared", moe_shared(), target_modules=MOE_TARGETS)
    b = peft("numbered", moe_numbered(), target_modules=MOE_TARGETS)
    assert sg.detect_shared_outer_loras([a]) is True
    assert sg.detect_shared_outer_loras([b]) is False
    with pytest.raises(RuntimeError) as info:
        sg.detect_shared_outer_loras([a, b])
    # A bare list is keyed as `--lora-paths NAME=PATH` with NAME = folder name: the id is uuid5, not the name.
    expected_id = uuid.uuid5(uuid.NAMESPACE_URL, f"numbered\0{b}").hex
    assert str(info.value) == MIXED.format(expected_id)
    # Order decides which adapter is named.
    with pytest.raises(RuntimeError) as info:
        sg.detect_shared_outer_loras({"first": b, "second": a})
    assert str(info.value) == MIXED.format("second")


def test_detection_mixed_inside_one_adapter_names_that_adapter() -> None:
    tensors = {**moe_shared(layer=0), **moe_numbered(layer=1)}
    with pytest.raises(RuntimeError) as info:
        sg.detect_shared_outer_loras({"dense": view(attn()), "mixed": view(tensors)})
    assert str(info.value) == MIXED.format("mixed")


def test_detection_rules() -> None:
    # dense gate_up lora_A (no experts) is ignored; 3D with E > 1 is per-expert; .w1/.w3 are renamed then fused.
    dense = {f"{P}0.mlp.gate_proj.lora_A.weight": (4, 16), f"{P}0.mlp.up_proj.lora_A.weight": (4, 16)}
    stacked = {f"{P}0.mlp.experts.gate_up_proj.lora_A.weight": (4, 4, 16)}
    assert sg.detect_shared_outer_loras({"d": view(dense)}) is False
    assert sg.detect_shared_outer_loras({"d": view(dense), "s": view(moe_shared())}) is True
    assert sg.detect_shared_outer_loras({"s": view(stacked)}) is False
    with pytest.raises(RuntimeError):
        sg.detect_shared_outer_loras({"w": view(moe_numbered(w=True)), "s": view(moe_shared())})
    # down_proj and lora_B tensors never count.
    only_down = {f"{P}0.mlp.experts.down_proj.lora_B.weight": (1, 16, 4)}
    assert sg.detect_shared_outer_loras({"a": view(only_down), "b": view(stacked)}) is False


def test_detection_legacy_mode() -> None:
    # Before SGLang PR #31681 numbered 2D adapters were invisible: the mix silently turned shared mode on.
    sets = {"n": view(moe_numbered()), "s": view(moe_shared())}
    assert sg.detect_shared_outer_loras(sets, legacy=True) is True
    with pytest.raises(RuntimeError):
        sg.detect_shared_outer_loras(sets)
    # Legacy looks at the first 3D match per adapter only: a later disagreeing layer goes unnoticed.
    inner_mix = {**moe_shared(layer=0), f"{P}1.mlp.experts.gate_up_proj.lora_A.weight": (4, 4, 16)}
    assert sg.detect_shared_outer_loras({"m": view(inner_mix)}, legacy=True) is True
    with pytest.raises(RuntimeError) as info:
        sg.detect_shared_outer_loras({"m": view(inner_mix)})
    assert str(info.value) == MIXED.format("m")


# --- target-module names --------------------------------------------------------------------------------


def test_get_normalized_target_modules() -> None:
    assert sg.get_normalized_target_modules(["self_attn.q_proj", "k_proj", "v_proj", "o_proj"]) == {
        "qkv_proj",
        "o_proj",
    }
    assert sg.get_normalized_target_modules(["gate_proj", "up_proj", "w1", "c_attn", "gate"]) == {
        "gate_up_proj",
        "w1",
        "c_attn",
        "gate",
    }
    assert sg.get_normalized_target_modules(["unembed_tokens", "output", "word_embeddings", "vocab_emb"]) == {
        "lm_head",
        "embed_tokens",
    }
    assert sg.get_normalized_target_modules(["q_a_proj", "kv_a_proj_with_mqa", "wq_b", "wk", "weights_proj"]) == {
        "fused_qkv_a_proj_with_mqa",
        "indexer.wq_b",
        "indexer.wk",
        "indexer.weights_proj",
    }
    assert sg.get_normalized_target_modules("all") == {"all"}
    assert sg.get_normalized_target_modules("all-linear") == {"all"}
    with pytest.raises(ValueError) as info:
        sg.get_normalized_target_modules(r".*\.(q|v)_proj")
    assert str(info.value) == "Only 'all' or 'all-linear' can be used as the string for target module"


def test_get_stacked_multiply_and_target_module_name() -> None:
    assert [sg.get_stacked_multiply(n) for n in ("qkv_proj", "gate_up_proj_moe", "in_proj_qkvz", "o_proj")] == [
        3,
        2,
        4,
        1,
    ]
    assert sg.get_stacked_multiply("gate_up_proj_moe", {"gate_up_proj_moe": 1}) == 1

    class Model:
        def get_stacked_multiply(self, name: str) -> int:
            return 7

    assert sg.get_stacked_multiply("qkv_proj", Model()) == 7
    name = "base_model.model.model.layers.0.mlp.shared_experts.gate_up_proj.lora_A.weight"
    assert sg.get_target_module_name(name, ["gate_up_proj", "up_proj", "shared_experts.gate_up_proj"]) == (
        "shared_experts.gate_up_proj"
    )
    with pytest.raises(ValueError) as info:
        sg.get_target_module_name("model.layers.0.mlp.c_fc.lora_A.weight", ["qkv_proj"])
    assert str(info.value) == "Cannot find target module name for model.layers.0.mlp.c_fc.lora_A.weight in ['qkv_proj']"


def test_auto_detect_target_modules() -> None:
    qwen3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert sg.auto_detect_lora_target_modules(qwen3) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    found = sg.auto_detect_lora_target_modules(["model.layers.0.self_attn.indexer.wk", "model.wk", "rotary", "gate"])
    assert found == {"indexer.wk"}
    # sglang 0.5.23: a model's supported_lora_modules count only when SGLang knows them, found in the walk or not.
    assert sg.auto_detect_lora_target_modules(["gate"], supported_lora_modules=["gate"]) == set()
    assert sg.auto_detect_lora_target_modules(["gate"], supported_lora_modules=["up_proj"]) == {"up_proj"}


# --- init_lora_shapes -------------------------------------------------------------------------------------


def test_init_lora_shapes_infers_union_and_max_rank() -> None:
    a = view(attn(), "a", r=8, target_modules=["q_proj", "v_proj"])
    b = view(attn(), "b", r=16, target_modules=["o_proj", "gate_proj"])
    assert sg.init_lora_shapes([a, b]) == ({"qkv_proj", "o_proj", "gate_up_proj"}, 16, 0)
    modules = ["qkv_proj", "o_proj", "gate_up_proj"]
    assert sg.init_lora_shapes([a, b], max_lora_rank=64, target_modules=["all"], base_model_modules=modules) == (
        {"qkv_proj", "o_proj", "gate_up_proj", "embed_tokens", "lm_head"},
        64,
        0,
    )
    with pytest.raises(ValueError, match="'b' contains target modules \\['gate_up_proj'\\]"):
        sg.init_lora_shapes([a, b], target_modules=["all"], base_model_modules=["qkv_proj", "o_proj"])
    assert sg.init_lora_shapes([]) == (set(), 0, 0)


def test_init_lora_shapes_all_linear() -> None:
    a = view(attn(), "a", target_modules="all-linear")
    assert sg.init_lora_shapes([a], base_model_modules=["qkv_proj", "o_proj"]) == ({"qkv_proj", "o_proj"}, 4, 0)
    # With --lora-target-modules given, the adapter's "all-linear" is skipped.
    assert sg.init_lora_shapes([a], target_modules=["q_proj"]) == ({"qkv_proj"}, 4, 0)


def test_init_lora_shapes_errors() -> None:
    regex = view(attn(), "rx", target_modules=r".*\.(q|v)_proj")
    with pytest.raises(ValueError) as info:
        sg.init_lora_shapes([regex])
    assert str(info.value) == (
        "SGLang does not recognize target_modules='.*\\.(q|v)_proj'. Please use a list of module name suffixes in "
        "the adapter's PEFT config, or explicitly specify --lora-target-modules during server startup."
    )
    as_dict = view(attn(), "d", target_modules={"q_proj": 1})
    with pytest.raises(ValueError) as info:
        sg.init_lora_shapes([as_dict])
    assert str(info.value) == (
        "SGLang currently only supports inferring LoRA target modules when a list of suffixes is provided in "
        "`target_modules` field of PEFT config. Please explicitly specify `--lora-target-modules` during server "
        "startup. You can specify `all` to enable all support modules types. "
    )
    wide = view(attn(), "my-lora", target_modules=["q_proj", "v_proj", "down_proj", "gate_proj"])
    with pytest.raises(ValueError) as info:
        sg.init_lora_shapes([wide], target_modules=["q_proj", "o_proj"])
    assert str(info.value) == (
        "LoRA adapter 'my-lora' contains target modules ['down_proj', 'gate_up_proj'] that are not included in "
        "the specified --lora-target-modules ['o_proj', 'qkv_proj']. Please update --lora-target-modules to "
        "include all required modules: ['down_proj', 'gate_up_proj', 'o_proj', 'qkv_proj'], or use 'all' to "
        "enable all supported modules."
    )
    indexer = view(attn(), "ix", target_modules=["wq_b", "wk"])
    with pytest.raises(ValueError) as info:
        sg.init_lora_shapes([indexer], dsa_indexer_fusion=True)
    assert str(info.value) == (
        "LoRA targets the DSA indexer (['indexer.wk', 'indexer.wq_b']), which is incompatible with DSA indexer Q/K "
        "fusion. Set SGLANG_DISABLE_DSA_INDEXER_FUSION=1 to disable fusion and use indexer LoRA."
    )
    assert sg.init_lora_shapes([indexer])[0] == {"indexer.wq_b", "indexer.wk"}


def test_lora_config_missing_keys_raise_plain_key_error(tmp_path: Path, peft: Callable[..., str]) -> None:
    for missing in ("target_modules", "r", "lora_alpha"):
        path = peft(f"no-{missing}", attn(), **{missing: None})
        with pytest.raises(KeyError) as info:
            sg.init_lora_shapes([path])
        assert str(info.value) == f"'{missing}'"
    (tmp_path / "bare").mkdir()
    write_safetensors(tmp_path / "bare" / "adapter_model.safetensors", {k: ("BF16", s) for k, s in attn().items()})
    with pytest.raises(FileNotFoundError) as info:
        sg.init_lora_shapes([str(tmp_path / "bare")])
    assert str(info.value) == f"[Errno 2] No such file or directory: '{tmp_path / 'bare' / 'adapter_config.json'}'"


# --- validate_new_adapter / can_support ---------------------------------------------------------------------


def test_validate_new_adapter_messages(peft: Callable[..., str]) -> None:
    dora = view(attn(), "dora-lora", use_dora=True)
    with pytest.raises(ValueError) as info:
        sg.validate_new_adapter(dora)
    assert str(info.value) == "Failed to load dora-lora because LoRA serving currently doesn't support DoRA adapters"

    added = peft("tok", attn())
    Path(added, "added_tokens.json").write_text(json.dumps({"<x>": 100, "<y>": 5}))
    with pytest.raises(ValueError) as info:
        sg.validate_new_adapter(LoraRef("tok-lora", added))
    assert str(info.value) == (
        "Failed to load tok-lora because LoRA serving currently doesn't support adapters that add tokens to the "
        "vocabulary"
    )
    # Ids below the base vocabulary are "fake" added tokens.
    assert sg.validate_new_adapter(LoraRef("tok-lora", added), base_vocab_size=1000) == []
    # can_support sees the same filtered count: from base_vocab_size, or from a plan's base_config.
    pool = sg.MemoryPool(max_lora_rank=8, target_modules=frozenset({"qkv_proj"}))
    assert not sg.can_support(pool, [added])
    assert sg.can_support(pool, [added], base_vocab_size=1000)

    first = view(attn(), "same")
    with pytest.raises(ValueError) as info:
        sg.validate_new_adapter(view(attn(), "same"), loaded=[first])
    assert str(info.value) == "Failed to load LoRA adapter same because it is already loaded"

    pool = sg.MemoryPool(max_lora_rank=8, target_modules=frozenset({"qkv_proj"}))
    big = view(attn(), "big", r=16)
    with pytest.raises(ValueError) as info:
        sg.validate_new_adapter(big, memory_pool=pool)
    assert str(info.value) == (
        "LoRA adapter big with rank 16 is incompatible with the current LoRA memory pool configuration. Please "
        "ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the target modules "
        "are included in `--lora-target-modules`."
    )
    pinned = [LoraRef(f"p{i}", f"/p{i}", pinned=True, adapter=view(attn(), f"p{i}")) for i in range(7)]
    with pytest.raises(ValueError) as info:
        sg.validate_new_adapter(LoraRef("last", "/last", pinned=True, adapter=view(attn(), "x")), loaded=pinned)
    assert str(info.value) == (
        "Failed to load LoRA adapter last as a pinned adapter. It is not allowed to pin all slots in the LoRA memory "
        "pool to avoid starvation for unpinned adapters and base models. Please increase your `--max-loras-per-batch` "
        "or load it as unpinned LoRA adapters."
    )
    assert (
        sg.validate_new_adapter(LoraRef("last", "/last", pinned=True, adapter=view(attn(), "x")), loaded=pinned[:6])
        == []
    )


def test_validate_new_adapter_same_path_warns(caplog: pytest.LogCaptureFixture) -> None:
    old = LoraRef("old", "/shared/path", adapter=view(attn(), "old"))
    new = LoraRef("new", "/shared/path", adapter=view(attn(), "new"))
    with caplog.at_level(logging.WARNING, logger="lorafast.compat.sglang"):
        warnings = sg.validate_new_adapter(new, loaded=[old])
    expected = "/shared/path is already loaded with name: old, but another copy is being loaded with name: new"
    assert warnings == [expected]
    assert expected in caplog.messages


def test_can_support() -> None:
    pool = sg.MemoryPool(max_lora_rank=8, target_modules=frozenset({"qkv_proj", "o_proj"}))
    assert sg.can_support(pool, [view(attn(), "a", r=8)]) is True
    assert sg.can_support(pool, [view(attn(), "a", r=8), view(attn(), "b", r=9)]) is False
    assert sg.can_support(pool, [view(attn(), "a", target_modules=["gate_proj"])]) is False
    assert sg.can_support(pool, [view(attn(), "a", target_modules="all-linear")]) is True
    with pytest.raises(ValueError) as info:
        sg.can_support(pool, [view(attn(), "a", target_modules="q.*")])
    assert str(info.value) == "Only 'all' or 'all-linear' can be used as the string for target module"


# --- §9.3 checks at first use -----------------------------------------------------------------------------


def test_skipped_weights_strict_and_warning(caplog: pytest.LogCaptureFixture) -> None:
    tensors = {**attn(), f"{P}0.mlp.down_proj.lora_A.weight": (4, 8), f"{P}0.mlp.down_proj.lora_B.weight": (16, 4)}
    adapter = view(tensors, "skip")
    expected = (
        "LoRA adapter 'skip': 2 weight(s) skipped because they did not match any target module in ['o_proj', "
        "'qkv_proj']. Skipped weights: ['base_model.model.model.layers.0.mlp.down_proj.lora_A.weight', "
        "'base_model.model.model.layers.0.mlp.down_proj.lora_B.weight']. This likely indicates a mismatch between "
        "the adapter's target modules and the base model architecture."
    )
    with pytest.raises(ValueError) as info:
        sg.check_skipped_weights(adapter, {"qkv_proj", "o_proj"}, strict=True)
    assert str(info.value) == expected
    with caplog.at_level(logging.WARNING, logger="lorafast.compat.sglang"):
        skipped = sg.check_skipped_weights(adapter, {"qkv_proj", "o_proj"})
    assert skipped == [f"{P}0.mlp.down_proj.lora_A.weight", f"{P}0.mlp.down_proj.lora_B.weight"]
    assert expected in caplog.messages
    assert sg.check_skipped_weights(adapter, {"qkv_proj", "down_proj"}, strict=True) == []


def test_shared_outer_expert_dim_checks() -> None:
    targets = ("gate_up_proj", "down_proj")
    stacked = {
        f"{P}0.mlp.experts.gate_up_proj.lora_A.weight": (4, 4, 16),
        f"{P}0.mlp.experts.down_proj.lora_B.weight": (4, 16, 4),
    }
    with pytest.raises(ValueError) as info:
        sg.check_expert_layout(view(stacked), experts_shared_outer=True, target_modules=targets)
    assert (
        str(info.value)
        == "experts_shared_outer_loras is enabled but gate_up_proj_moe lora_A has expert_dim=4 (expected 1)."
    )
    down_only = {f"{P}0.mlp.experts.down_proj.lora_B.weight": (4, 16, 4)}
    with pytest.raises(ValueError) as info:
        sg.check_expert_layout(view(down_only), experts_shared_outer=True, target_modules=targets)
    assert (
        str(info.value)
        == "experts_shared_outer_loras is enabled but down_proj_moe lora_B has expert_dim=4 (expected 1)."
    )
    with pytest.raises(ValueError) as info:
        sg.check_expert_layout(view(moe_numbered(e=3)), experts_shared_outer=True, target_modules=targets)
    assert (
        str(info.value)
        == "experts_shared_outer_loras is enabled but gate_up_proj_moe lora_A dict has 3 entries (expected 1)."
    )
    numbered_down = {k: v for k, v in moe_numbered(e=2).items() if "down_proj" in k}
    with pytest.raises(ValueError) as info:
        sg.check_expert_layout(view(numbered_down), experts_shared_outer=True, target_modules=targets)
    assert (
        str(info.value)
        == "experts_shared_outer_loras is enabled but down_proj_moe lora_B dict has 2 entries (expected 1)."
    )
    assert sg.check_expert_layout(view(moe_shared()), experts_shared_outer=True, target_modules=targets) == []
    problems = sg.check_expert_layout(view(stacked), experts_shared_outer=True, target_modules=targets, collect=True)
    assert [p.exc_type for p in problems] == ["ValueError", "ValueError"]


def test_shared_factor_in_per_expert_pool_is_reported() -> None:
    """What SGLang misses: a [1, ...] factor in a per-expert pool fills expert 0 only."""
    problems = sg.check_expert_layout(
        view(moe_shared()), experts_shared_outer=False, base_config={"num_experts": 4, "hidden_size": 16}
    )
    assert [p.code for p in problems] == ["sglang_shared_factor_in_per_expert_pool"] * 2
    assert all(not p.fatal for p in problems)
    assert "gate_up_proj.lora_A.weight has expert_dim=1" in problems[1].message
    assert "down_proj.lora_B.weight has expert_dim=1" in problems[0].message
    assert "expert 0 only" in problems[0].message
    # Shared-outer pool: outer factors are expected to be shared; an inner [1, ...] factor is still a problem.
    inner = {**moe_shared(), f"{P}0.mlp.experts.down_proj.lora_A.weight": (1, 4, 8)}
    problems = sg.check_expert_layout(view(inner), experts_shared_outer=True, base_config={"num_experts": 4})
    assert len(problems) == 1 and "down_proj_moe lora_A buffer is per-expert (expert_dim=4" in problems[0].message
    assert sg.check_expert_layout(view(moe_numbered()), experts_shared_outer=False) == []


# --- predicted weights after normalization ------------------------------------------------------------------


def test_predict_loaded_weights_fuses_and_renames() -> None:
    tensors = {
        f"{P}0.self_attn.q_proj.lora_A.weight": (4, 16),
        f"{P}0.self_attn.q_proj.lora_B.weight": (16, 4),
        f"{P}0.self_attn.v_proj.lora_A.weight": (4, 16),
        f"{P}0.self_attn.v_proj.lora_B.weight": (8, 4),
        f"{P}0.block_sparse_moe.experts.1.w1.lora_A.weight": (4, 16),
        f"{P}0.block_sparse_moe.experts.1.w3.lora_A.weight": (4, 16),
        f"{P}0.mlp.experts.gate_up_proj.lora_A.weight": (3, 4, 16),
        f"{P}1.mlp.gate_proj.lora_B.weight": (8, 4),
        "base_model.model.lm_head.lora_A.weight": (4, 16),
        "base_model.model.model.norm.weight": (16,),
    }
    loaded = sg.predict_loaded_weights(view(tensors, target_modules=["q_proj", "v_proj", "lm_head"]))
    assert loaded.layers[0] == {
        f"{P}0.mlp.experts.gate_up_proj.lora_A.weight": (3, 8, 16),  # repeated x2 along the rank axis
        f"{P}0.self_attn.qkv_proj.lora_A.weight": (12, 16),  # k missing: zeros_like(v)
        f"{P}0.self_attn.qkv_proj.lora_B.weight": (32, 4),  # 16 + 8 (zeros) + 8
        f"{P}0.block_sparse_moe.experts.1.gate_up_proj.lora_A.weight": (8, 16),
    }
    assert loaded.layers[1] == {f"{P}1.mlp.gate_up_proj.lora_B.weight": (16, 4)}  # up missing: zeros
    assert loaded.embedding == {"base_model.model.lm_head.lora_A.weight": (4, 16)}


def test_normalization_errors_are_sglangs() -> None:
    no_v = {f"{P}0.self_attn.q_proj.lora_A.weight": (4, 16), f"{P}0.self_attn.k_proj.lora_A.weight": (4, 16)}
    with pytest.raises(KeyError) as info:
        sg.predict_loaded_weights(view(no_v))
    assert str(info.value) == f"'{P}0.self_attn.v_proj.lora_A.weight'"
    mismatch = {
        f"{P}0.mlp.experts.gate_proj.lora_A.weight": (1, 4, 16),
        f"{P}0.mlp.experts.up_proj.lora_A.weight": (4, 4, 16),
    }
    with pytest.raises(RuntimeError) as info:
        sg.predict_loaded_weights(view(mismatch))
    assert str(info.value) == (
        "Sizes of tensors must match except in dimension 1. Expected size 1 but got size 4 for tensor number 1 in "
        "the list."
    )
    fused_3d_qkv = {f"{P}0.self_attn.qkv_proj.lora_A.weight": (2, 4, 16)}
    with pytest.raises(RuntimeError) as info:
        sg.predict_loaded_weights(view(fused_3d_qkv))
    assert (
        str(info.value) == "Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor"
    )
    with pytest.raises(IndexError) as info:
        sg.predict_loaded_weights(view(attn(layer=5)), base_config={"num_hidden_layers": 2})
    assert str(info.value) == "index 5 is out of range"


# --- --lora-paths and ids -----------------------------------------------------------------------------------


def test_lora_id_and_parse_lora_paths() -> None:
    assert lora_id("a", "/p") == uuid.uuid5(uuid.NAMESPACE_URL, "a\0/p").hex
    refs = sg.parse_lora_paths(["a=/p/a", "/p/b", {"lora_name": "c", "lora_path": "/p/c", "pinned": True}])
    assert [(r.name, r.path, r.pinned) for r in refs] == [
        ("a", "/p/a", False),
        ("/p/b", "/p/b", False),
        ("c", "/p/c", True),
    ]
    assert refs[0].lora_id == lora_id("a", "/p/a")
    assert [(r.name, r.path) for r in sg.parse_lora_paths({"x": "/p/x"})] == [("x", "/p/x")]
    with pytest.raises(AssertionError) as info:
        sg.parse_lora_paths([{"lora_name": "c"}])
    assert str(info.value) == (
        "When providing LoRA paths as a list of dict, each dict should contain 'lora_name' and 'lora_path' keys. "
        "Got: {'lora_name': 'c'}"
    )
    with pytest.raises(ValueError) as info:
        sg.parse_lora_paths([3])
    assert (
        str(info.value)
        == "Invalid type for item in --lora-paths list: <class 'int'>. Expected a string or a dictionary."
    )
    with pytest.raises(ValueError) as info:
        sg.parse_lora_paths("a=/p")
    assert str(info.value) == "Invalid type for --lora-paths: <class 'str'>. Expected a list or a dictionary."


# --- preflight --------------------------------------------------------------------------------------------

QWEN_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 2, "num_experts": 4,
    "vocab_size": 100, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_preflight_decides_like_a_server(peft: Callable[..., str]) -> None:
    a = peft("a", {**attn(), **moe_shared()}, r=4, target_modules=MOE_TARGETS)
    b = peft("b", {**attn(layer=1, r=8), **moe_shared(layer=1, r=8)}, r=8, target_modules=MOE_TARGETS)
    plan = sg.preflight({"a": a, "b": b}, base_config=QWEN_MOE, max_loras_per_batch=4)
    assert plan.ok
    assert plan.target_modules == {"qkv_proj", "gate_up_proj", "down_proj"}
    assert plan.max_lora_rank == 8
    assert plan.experts_shared_outer is True and plan.shared_outer_source == "detected"
    shapes = {b.name: (b.a_shape, b.b_shape) for b in plan.buffers or ()}
    assert shapes == {
        "qkv_proj": ((4, 24, 16), (4, 32, 8)),
        "gate_up_proj_moe": ((4, 1, 16, 16), (4, 4, 16, 8)),
        "down_proj_moe": ((4, 4, 8, 8), (4, 1, 16, 8)),
    }
    assert plan.buffer_bytes == 2 * 2 * (
        4 * 24 * 16 + 4 * 32 * 8 + 4 * 16 * 16 + 4 * 4 * 16 * 8 + 4 * 4 * 8 * 8 + 4 * 16 * 8
    )
    assert plan.can_support([a]) and not plan.can_support([peft("c", attn(), r=16)])
    assert json.loads(json.dumps(plan.to_dict()))["experts_shared_outer"] is True


def test_preflight_raises_sglangs_first_error_in_order(peft: Callable[..., str]) -> None:
    good = peft("good", attn())
    dora = peft("dora", attn(), use_dora=True)
    no_r = peft("no-r", attn(), r=None)
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"good": good, "dora": dora, "no-r": no_r})
    assert str(info.value) == (
        "Failed to load LoRA adapter dora: Failed to load dora because LoRA serving currently doesn't support DoRA "
        "adapters"
    )
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"no-r": no_r, "dora": dora})
    assert str(info.value) == "Failed to load LoRA adapter no-r: 'r'"
    assert isinstance(info.value.__cause__, KeyError)
    not_lora = peft("ia3", attn(), peft_type="IA3")
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"ia3": not_lora})
    assert str(info.value) == "Failed to load LoRA adapter ia3: "
    regex = peft("rx", attn(), target_modules="q.*")
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"rx": regex})
    assert str(info.value) == (
        "Failed to load LoRA adapter rx: Only 'all' or 'all-linear' can be used as the string for target module"
    )
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"a": good, "a2": peft("s", moe_shared(), target_modules=MOE_TARGETS),
                      "n": peft("n", moe_numbered(), target_modules=MOE_TARGETS)})  # fmt: skip
    assert str(info.value) == MIXED.format("n")
    # Start-up passes, first use fails: strict loading and skipped weights.
    with pytest.raises(ValueError, match="1 weight\\(s\\) skipped"):
        sg.preflight({"x": peft("x", {**attn(), f"{P}0.mlp.c_fc.lora_A.weight": (4, 16)})}, strict_loading=True)


def test_preflight_server_args() -> None:
    with pytest.raises(AssertionError) as info:
        sg.preflight([])
    assert str(info.value) == (
        "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and --lora-target-modules "
        "for LoRA initialization."
    )
    plan = sg.preflight([], max_lora_rank=16, target_modules=["q_proj", "v_proj"])
    assert (plan.target_modules, plan.max_lora_rank, plan.experts_shared_outer) == ({"qkv_proj"}, 16, False)
    with pytest.raises(AssertionError) as info:
        sg.preflight([], max_lora_rank=16, target_modules=["all", "q_proj"])
    assert str(info.value) == "If 'all' is specified in --lora-target-modules, it should be the only module specified."
    with pytest.raises(AssertionError) as info:
        sg.preflight([], max_lora_rank=16, target_modules=["q_proj"], max_loras_per_batch=0)
    assert str(info.value) == "max_loras_per_batch must be positive"
    same = view(attn(), "same")
    with pytest.raises(AssertionError) as info:
        sg.preflight([same, same])
    assert str(info.value) == (
        "LoRA adapter with ID same is already loaded. This should have been verified before request is sent to the "
        "backend."
    )


def test_preflight_collects_every_problem(peft: Callable[..., str]) -> None:
    adapters = {
        "dora": peft("dora", attn(), use_dora=True),
        "no-alpha": peft("no-alpha", attn(), lora_alpha=None),
        "shared": peft("shared", moe_shared(), target_modules=MOE_TARGETS),
        "numbered": peft("numbered", moe_numbered(), target_modules=MOE_TARGETS),
        "numbered2": peft("numbered2", moe_numbered(layer=1), target_modules=MOE_TARGETS),
        "wide": peft("wide", attn(), target_modules=["q_proj", "o_proj"]),
    }
    plan = sg.preflight(adapters, collect=True, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                        max_lora_rank=8, base_config=QWEN_MOE)  # fmt: skip
    errors = [(p.adapter_id, p.code, p.exc_type) for p in plan.errors]
    assert errors == [
        ("dora", "sglang_load", "RuntimeError"),
        ("no-alpha", "sglang_load", "RuntimeError"),
        ("wide", "sglang_target_modules_not_included", "ValueError"),
        ("numbered", "sglang_mixed_shared_outer", "RuntimeError"),
        ("numbered2", "sglang_mixed_shared_outer", "RuntimeError"),
        # First use stops at the first failing buffer of each adapter, as SGLang's copy loop does.
        ("numbered", "sglang_first_use", "ValueError"),
        ("numbered2", "sglang_first_use", "ValueError"),
    ]
    assert plan.errors[-1].stage == "first_use"
    assert plan.errors[-1].message == (
        "experts_shared_outer_loras is enabled but gate_up_proj_moe lora_A dict has 2 entries (expected 1)."
    )
    assert [p.message for p in plan.errors][:2] == [
        "Failed to load LoRA adapter dora: Failed to load dora because LoRA serving currently doesn't support DoRA adapters",
        "Failed to load LoRA adapter no-alpha: 'lora_alpha'",
    ]
    assert not plan.ok and plan.experts_shared_outer is True
    # Without collect, the same set raises the first of them.
    with pytest.raises(RuntimeError) as info:
        sg.preflight(adapters, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], max_lora_rank=8)
    assert str(info.value) == plan.errors[0].message


def test_preflight_cli_override_and_expert0_problem(peft: Callable[..., str]) -> None:
    shared = peft("shared", moe_shared(), target_modules=MOE_TARGETS)
    plan = sg.preflight({"s": shared}, experts_shared_outer=False, base_config=QWEN_MOE)
    assert plan.ok and plan.shared_outer_source == "cli" and plan.experts_shared_outer is False
    assert [p.code for p in plan.warnings] == ["sglang_shared_factor_in_per_expert_pool"] * 2
    buffers = {b.name: b for b in plan.buffers or ()}
    assert buffers["gate_up_proj_moe"].a_shape == (8, 4, 8, 16)


def test_preflight_unknown_module_fails_in_pool(peft: Callable[..., str]) -> None:
    a = peft("g", attn(), target_modules=["q_proj", "gate"])
    with pytest.raises(NotImplementedError) as info:
        sg.preflight({"g": a}, base_config=QWEN_MOE)
    assert str(info.value) == "get_hidden_dim not implemented for gate"


def test_plan_buffers_dense_and_mla() -> None:
    llama = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
             "num_hidden_layers": 3, "vocab_size": 1000, "torch_dtype": "float16"}  # fmt: skip
    plans = sg.plan_buffers(llama, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "embed_tokens"}, 16)
    shapes = {p.name: (p.a_shape, p.b_shape, p.layers) for p in plans}
    assert shapes == {
        "down_proj": ((8, 16, 128), (8, 64, 16), (0, 1, 2)),
        "embed_tokens": ((8, 16, 1000), (8, 64, 16), ()),
        "gate_up_proj": ((8, 32, 64), (8, 256, 16), (0, 1, 2)),
        "lm_head": ((8, 16, 64), (8, 1000, 16), ()),
        "o_proj": ((8, 16, 64), (8, 64, 16), (0, 1, 2)),
        "qkv_proj": ((8, 48, 64), (8, 96, 16), (0, 1, 2)),
    }
    deepseek = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "n_shared_experts": 2,
                "n_routed_experts": 8, "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_attention_heads": 4,
                "q_lora_rank": 24, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                "v_head_dim": 16, "vocab_size": 50}  # fmt: skip
    plans = sg.plan_buffers(deepseek, {"fused_qkv_a_proj_with_mqa", "kv_b_proj", "gate_up_proj"}, 4,
                            experts_shared_outer=True)  # fmt: skip
    got = sorted((p.name, p.a_shape, p.b_shape, p.layers) for p in plans)
    assert got == [
        ("fused_qkv_a_proj_with_mqa", (8, 8, 64), (8, 64, 4), (0, 1, 2)),
        ("gate_up_proj", (8, 8, 64), (8, 64, 4), (1, 2)),  # MoE layers: shared experts, I = 16 * 2
        ("gate_up_proj", (8, 8, 64), (8, 192, 4), (0,)),  # the first dense layer
        ("gate_up_proj_moe", (8, 1, 8, 64), (8, 8, 32, 4), (0, 1, 2)),
        ("kv_b_proj", (8, 4, 32), (8, 128, 4), (0, 1, 2)),
    ]
    assert sg.predict_base_model_modules(deepseek) == {
        "fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens",
        "lm_head",
    }  # fmt: skip


def test_preflight_buffer_fit_warning(peft: Callable[..., str]) -> None:
    # An adapter trained for another model: v_proj output 12 instead of 8 (two KV heads of 4).
    wrong = {**attn(), f"{P}0.self_attn.v_proj.lora_B.weight": (12, 4)}
    plan = sg.preflight({"w": peft("w", wrong)}, base_config=QWEN_MOE)
    # SGLang's QKV slice keeps v rows 24:32 of the 40, so its copy passes: lorafast warns, SGLang says nothing.
    assert plan.ok
    assert [p.code for p in plan.warnings] == ["sglang_buffer_shape"]
    assert "LoRA buffer shape torch.Size([32, 4]), weight shape torch.Size([40, 4])" in plan.warnings[0].message


def test_scan_report_and_adapter_inputs(peft: Callable[..., str]) -> None:
    import lorafast

    a = peft("a", attn())
    adapter = lorafast.inspect(a)
    from_adapter = sg.preflight([adapter])
    from_path = sg.preflight(a)
    assert from_adapter.adapters == from_path.adapters
    assert from_adapter.adapters[0].lora_id == lora_id("a", a)
    report = lorafast.scan([a])
    assert sg.preflight(report).adapters[0].name == "a"


def test_paths_are_read_like_sglangs_loader(
    tmp_path: Path, peft: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    # Every *.safetensors of the folder, filtered by an index when there is one.
    a = Path(peft("multi", attn()))
    write_safetensors(a / "extra.safetensors", {f"{P}1.self_attn.o_proj.lora_A.weight": ("BF16", (4, 16))})
    assert sorted(sg.predict_loaded_weights(str(a)).layers) == [0, 1]
    (a / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "adapter_model.safetensors"}}))
    assert sorted(sg.predict_loaded_weights(str(a)).layers) == [0]

    # Only .bin weights: the config is checked, the tensors cannot be (reported, not raised).
    b = tmp_path / "bin"
    b.mkdir()
    (b / "adapter_model.bin").write_bytes(b"\0")
    (b / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"]}))  # fmt: skip
    plan = sg.preflight({"b": str(b)})
    assert [p.code for p in plan.warnings] == ["lorafast_unreadable_weights"]

    # No weights at all; a broken header; a config that is not JSON: SGLang's load errors, wrapped.
    c = tmp_path / "empty"
    c.mkdir()
    (c / "adapter_config.json").write_text((b / "adapter_config.json").read_text())
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"c": str(c)})
    assert str(info.value) == f"Failed to load LoRA adapter c: Cannot find any model weights with `{c}`"
    d = Path(peft("broken", attn()))
    (d / "adapter_model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json}      ")
    plan = sg.preflight({"d": str(d)}, collect=True)
    assert [p.code for p in plan.errors] == ["sglang_load"] and "Failed to load LoRA adapter d: " in plan.errors[
        0
    ].message
    e = Path(peft("badjson", attn()))
    (e / "adapter_config.json").write_text("{")
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"e": str(e)})
    assert (
        str(info.value)
        == "Failed to load LoRA adapter e: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    )


def test_added_token_embeddings_shape_assert() -> None:
    tensors = {**attn(), "base_model.model.model.input_embeddings": (3, 16)}
    with pytest.raises(AssertionError) as info:
        sg.predict_loaded_weights(view(tensors, "tok"))
    assert str(info.value) == (
        "LoRA adapter tok has lora_added_tokens_size 0 specified in the config, but the loaded weight "
        "'base_model.model.model.input_embeddings' has shape 3 in first dimension"
    )


def test_dynamic_load_into_a_frozen_pool(peft: Callable[..., str]) -> None:
    numbered = peft("numbered", moe_numbered(e=4), target_modules=MOE_TARGETS)
    shared = peft("shared", moe_shared(), target_modules=MOE_TARGETS)
    per_expert_pool = sg.preflight({"n": numbered}, base_config=QWEN_MOE)
    assert per_expert_pool.experts_shared_outer is False
    # Detection is not re-run for a dynamic load: the shared adapter goes into a per-expert pool, silently.
    problems = per_expert_pool.check_new_adapter(LoraRef("s", shared))
    assert [(p.code, p.fatal) for p in problems] == [("sglang_shared_factor_in_per_expert_pool", False)] * 2
    shared_pool = sg.preflight({"s": shared}, base_config=QWEN_MOE)
    with pytest.raises(ValueError) as info:
        shared_pool.check_new_adapter(LoraRef("n", numbered))
    assert (
        str(info.value)
        == "experts_shared_outer_loras is enabled but gate_up_proj_moe lora_A dict has 4 entries (expected 1)."
    )
    big = peft("big", moe_shared(r=8), r=8, target_modules=MOE_TARGETS)
    with pytest.raises(ValueError) as info:
        shared_pool.check_new_adapter(LoraRef("big", big))
    assert str(info.value).startswith("LoRA adapter big with rank 8 is incompatible with the current LoRA memory pool")
    again = shared_pool.check_new_adapter(LoraRef("s", shared), collect=True)
    assert [p.message for p in again] == ["Failed to load LoRA adapter s because it is already loaded"]


def test_structure_cache_keeps_names_and_errors() -> None:
    # Layers (and adapters) with one structure are normalized once; names and errors stay each one's own.
    tensors = {k: v for layer in range(3) for k, v in attn(layer=layer).items()}
    loaded = sg.predict_loaded_weights(view(tensors, "x"))
    for layer in range(3):
        assert list(loaded.layers[layer]) == [
            f"{P}{layer}.self_attn.qkv_proj.lora_A.weight",
            f"{P}{layer}.self_attn.qkv_proj.lora_B.weight",
        ]
    for layer in (4, 7):
        broken = {f"{P}{layer}.self_attn.q_proj.lora_A.weight": (4, 16)}
        with pytest.raises(KeyError) as info:
            sg.predict_loaded_weights(view(broken, f"b{layer}"))
        assert str(info.value) == f"'{P}{layer}.self_attn.v_proj.lora_A.weight'"
    # A cached result handed out is a private copy.
    loaded.layers[0].clear()
    assert sg.predict_loaded_weights(view(tensors, "y")).layers[0]


def test_cli_preflight(tmp_path: Path, peft: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    shared = peft("shared", moe_shared(), target_modules=MOE_TARGETS)
    numbered = peft("numbered", moe_numbered(), target_modules=MOE_TARGETS)
    assert main(["preflight", "sglang", f"s={shared}", f"n={numbered}", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["message"] for p in report["problems"] if p["fatal"]][0] == MIXED.format(lora_id("n", numbered))
    assert main(["preflight", "sglang", f"s={shared}", "--base-config", str(_write(tmp_path, QWEN_MOE))]) == 0
    assert "experts_shared_outer: True" in capsys.readouterr().out
    assert main(["preflight", "vllm", shared, "--max-lora-rank", "8"]) == 0


def test_cli_engine_version(tmp_path: Path, peft: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    shared = peft("shared", moe_shared(), target_modules=MOE_TARGETS)
    config = str(_write(tmp_path, QWEN_MOE))
    assert main(["preflight", "sglang", f"s={shared}", "--engine-version", "0.5.23", "--json",
                              "--base-config", config]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["passed"] == ["s"]
    # without the base's config the first-use checks cannot run: never a silent ok
    assert main(["preflight", "sglang", f"s={shared}", "--engine-version", "0.5.23"]) == 1
    out = capsys.readouterr().out
    assert "skipped (no --base-config)" in out and out.splitlines()[-1].startswith("unknown: ")
    with pytest.raises(SystemExit) as exit_:  # a string that is not a version is a usage error
        main(["preflight", "sglang", f"s={shared}", "--engine-version", "next", "--json"])
    assert exit_.value.code == 2 and "not an engine version: 'next'" in capsys.readouterr().err


def _write(root: Path, obj: Any) -> Path:
    path = root / "config.json"
    path.write_text(json.dumps(obj))
    return path


def test_torch_weights_as_sglangs_loader_reads_them(tmp_path: Path, peft: Callable[..., str]) -> None:
    torch = pytest.importorskip("torch")
    cfg = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})

    def folder(name: str, files: dict[str, dict[str, tuple[int, ...]]]) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(cfg)
        for file, tensors in files.items():
            torch.save({k: torch.zeros(shape) for k, shape in tensors.items()}, path / file)
        return str(path)

    # No .safetensors: the *.bin files are SGLang's weights, read here header-only (the pickle never runs).
    st = sg.predict_loaded_weights(peft("st", attn(), target_modules=["q_proj", "v_proj"]))
    only_bin = folder("bin", {"adapter_model.bin": attn(), "adapter_model.pt": attn(layer=1)})
    assert sg.predict_loaded_weights(only_bin).layers == st.layers  # *.bin wins over *.pt
    assert sg.preflight({"b": only_bin}).warnings == []
    # *.bin matched, then training_args.bin is dropped: the .pt beside it is never looked at.
    training = folder("training", {"training_args.bin": {}, "adapter_model.pt": attn()})
    with pytest.raises(RuntimeError) as info:
        sg.preflight({"t": training})
    assert str(info.value) == f"Failed to load LoRA adapter t: Cannot find any model weights with `{training}`"
    with pytest.raises(RuntimeError) as info:
        sg.predict_loaded_weights(folder("args", {"training_args.bin": {}}))
    assert str(info.value) == f"Cannot find any model weights with `{tmp_path / 'args'}`"


def test_inkling_shared_experts_in_a_shared_outer_pool_lose_nothing() -> None:
    # Inkling's flat shared-expert factors become [1, ...] factors; a shared-outer pool takes them whole.
    inkling = {"architectures": ["InklingForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4,
               "n_shared_experts": 2, "hidden_size": 16, "num_hidden_layers": 1}  # fmt: skip
    shared = f"{P}0.mlp.shared_experts."
    tensors = {shared + "gate_proj.lora_A.weight": (4, 16), shared + "gate_proj.lora_B.weight": (16, 4),
               shared + "up_proj.lora_A.weight": (4, 16), shared + "up_proj.lora_B.weight": (16, 4),
               shared + "down_proj.lora_A.weight": (4, 16), shared + "down_proj.lora_B.weight": (16, 4)}  # fmt: skip
    weights = sg.predict_loaded_weights(view(tensors), base_config=inkling)
    assert weights.layers[0][shared + "down_proj.lora_B.weight"] == (1, 16, 4)
    for outer in (True, False):
        problems = sg.check_expert_layout(view(tensors), experts_shared_outer=outer, base_config=inkling)
        assert [p.code for p in problems] == []
