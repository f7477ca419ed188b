"""kohya -> PEFT folder: the flattened names get their dots back where the architecture is known from the names
(diffusers-spelled UNet, CLIP text encoders, diffusers-named transformers), the merge is bit-identical either
way, and SGLang 0.5.23's own diffusion LoRA code reads the converted folder as a standard PEFT adapter."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import lorafast  # noqa: E402
from lorafast import convert  # noqa: E402
from lorafast.converting.kohya import FLATTENED_NOTE, unflatten  # noqa: E402
from oracle import engines  # noqa: E402

H = 16


def _kohya(folder: Path, modules: dict[str, tuple[int, float | None]]) -> str:
    """A kohya file: {kohya module key: (rank, alpha or None)}, linear modules of width H."""
    gen = torch.Generator().manual_seed(11)
    t = {}
    for key, (r, alpha) in modules.items():
        t[f"{key}.lora_down.weight"] = torch.randn(r, H, generator=gen)
        t[f"{key}.lora_up.weight"] = torch.randn(H, r, generator=gen)
        if alpha is not None:
            t[f"{key}.alpha"] = torch.tensor(alpha)
    folder.mkdir()
    path = folder / "lora.safetensors"
    safetensors_torch.save_file(t, str(path))
    return str(path)


def _base(names: list[str]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    return {f"{n}.weight": torch.randn(H, H, generator=gen) for n in names}


def _merged(base: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    sd = {k: v.clone() for k, v in base.items()}
    lorafast.merge(sd, [adapter]).commit()
    return sd


def _keys(folder: str) -> set[str]:
    return set(lorafast.read_header(os.path.join(folder, "adapter_model.safetensors")).tensors)


# kohya key -> the dotted name diffusers' kohya converter gives the same module (written out by hand)
SD = {
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q":
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
    "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_out_0":
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_out.0",
    "lora_unet_mid_block_attentions_0_transformer_blocks_0_ff_net_0_proj":
        "unet.mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj",
    "lora_unet_up_blocks_1_resnets_2_time_emb_proj": "unet.up_blocks.1.resnets.2.time_emb_proj",
    "lora_te1_text_model_encoder_layers_0_self_attn_q_proj": "text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
    "lora_te2_text_model_encoder_layers_11_mlp_fc2": "text_encoder_2.text_model.encoder.layers.11.mlp.fc2",
}  # fmt: skip


def test_sd_unet_and_clip_names_get_their_dots_back_exactly(tmp_path: Path) -> None:
    scales = [(4, 2.0), (2, None), (4, 0.0), (3, 6.0), (2, 1.0), (4, 4.0)]
    src = _kohya(tmp_path / "k", dict(zip(SD, scales, strict=True)))
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == ()
    assert _keys(res.out) == {f"{d}.lora_{ab}.weight" for d in SD.values() for ab in "AB"}
    by_dotted = {m.name: m.scale for m in lorafast.inspect(res.out).modules}
    expected = {SD[m.key].split(".", 1)[1]: m.scale for m in lorafast.inspect(src).modules}
    assert by_dotted == expected
    # the unet and both text encoders' weights in one base: their module paths do not collide
    base = _base([d.split(".", 1)[1] for d in SD.values()])
    a, b = _merged(base, src), _merged(base, res.out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], base[k]) for k in a), "the merge must change the base for this to mean much"


def test_unflatten_takes_the_longest_known_name_and_refuses_unknown_pieces() -> None:
    assert unflatten("transformer_blocks_3_attn_to_out_0") == "transformer_blocks.3.attn.to_out.0"
    assert unflatten("single_transformer_blocks_0_proj_mlp") == "single_transformer_blocks.0.proj_mlp"
    assert unflatten("down_blocks_1_resnets_0_conv_shortcut") == "down_blocks.1.resnets.0.conv_shortcut"
    assert unflatten("input_blocks_4_1_transformer_blocks_0_attn1_to_q") is None  # SDXL sgm: needs the UNet config
    assert unflatten("double_blocks_0_img_attn_qkv") is None  # Flux BFL names: a fused qkv, not a rename


def test_unknown_architecture_keeps_flattened_names_and_says_so(tmp_path: Path) -> None:
    sgm = ["input_blocks_4_1_transformer_blocks_0_attn1_to_q", "output_blocks_2_1_proj_in"]
    src = _kohya(tmp_path / "k", {f"lora_unet_{n}": (2, 3.0) for n in sgm})
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == (FLATTENED_NOTE,)
    assert _keys(res.out) == {f"unet.{n}.lora_{ab}.weight" for n in sgm for ab in "AB"}
    base = _base(["input_blocks.4.1.transformer_blocks.0.attn1.to_q", "output_blocks.2.1.proj_in"])
    a, b = _merged(base, src), _merged(base, res.out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = lorafast.read_header(os.path.join(res.out, "adapter_model.safetensors")).metadata
    assert FLATTENED_NOTE in meta["lorafast.converted"]


def test_sglang_diffusion_reads_the_converted_folder_as_standard_peft(tmp_path: Path) -> None:
    """SGLang 0.5.23's diffusion code, from the released wheel: the kohya file stays in kohya's flattened names
    (lora_down/lora_up only renamed), the converted folder is a standard PEFT adapter with dotted names."""
    flux = {"lora_transformer_transformer_blocks_0_attn_to_q": (4, 2.0),
            "lora_transformer_single_transformer_blocks_1_proj_mlp": (4, 2.0),
            "lora_transformer_transformer_blocks_0_attn_add_k_proj": (4, 2.0)}  # fmt: skip
    src = _kohya(tmp_path / "k", flux)
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == ()
    out_file = os.path.join(res.out, "adapter_model.safetensors")
    got = engines.run("sglang_diffusion_runner", "sglang", engines.PINNED["sglang"][0],
                      [{"id": "kohya", "kind": "file", "path": src}, {"id": "peft", "kind": "file", "path": out_file}])  # fmt: skip
    before, after = got["kohya"], got["peft"]
    assert before["detect"] == {"ok": "non-diffusers-sd"}
    assert all(k.startswith("lora_transformer_") for k in before["normalize"]["ok"]["keys"])  # still flattened
    assert after["detect"] == {"ok": "standard"}
    keys = after["normalize"]["ok"]["keys"]
    assert sorted(k.removeprefix("transformer.") for k in keys) == sorted(
        f"{n}.lora_{ab}.weight" for n in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.1.proj_mlp",
                                         "transformer_blocks.0.attn.add_k_proj") for ab in "AB"
    )  # fmt: skip
    assert after["alpha"] == {"ok": 2.0}
