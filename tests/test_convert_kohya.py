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
from test_convert import H, write_kohya  # noqa: E402


def _kohya(folder: Path, modules: dict[str, tuple[int, float | None]]) -> str:
    """A kohya file: {kohya module key: (rank, alpha or None)}, linear modules of width H."""
    return write_kohya(folder, {k: ((r, H), (H, r), alpha) for k, (r, alpha) in modules.items()}, 11)


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
    assert unflatten("double_blocks_0_img_attn_qkv") is None  # Flux BFL names: a fused qkv, not a rename


# SDXL's sgm names (kohya's SDXL files) and the diffusers SDXL UNet's names for them
SDXL = {
    "input_blocks_4_1_transformer_blocks_0_attn1_to_q": "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "input_blocks_1_0_emb_layers_1": "down_blocks.0.resnets.0.time_emb_proj",
    "middle_block_1_proj_in": "mid_block.attentions.0.proj_in",
    "output_blocks_2_1_transformer_blocks_1_ff_net_2": "up_blocks.0.attentions.2.transformer_blocks.1.ff.net.2",
    "output_blocks_8_0_skip_connection": "up_blocks.2.resnets.2.conv_shortcut",
}  # fmt: skip


def test_names_match_diffusers_own_kohya_conversion() -> None:
    """diffusers' loader (sgm block mapping with SDXL's 2 layers per block, kohya key conversion, then its PEFT
    renaming) and lorafast name every module alike."""
    import types

    lcu = pytest.importorskip("diffusers.loaders.lora_conversion_utils")
    from diffusers.utils import convert_state_dict_to_peft, convert_unet_state_dict_to_peft
    from diffusers.utils.state_dict_utils import StateDictType
    from lorafast.converting.kohya import kohya_names

    keys = [*SD, *(f"lora_unet_{n}" for n in SDXL), "lora_unet_input_blocks_3_0_op", "lora_unet_out_2"]
    for group in ([k for k in keys if "_blocks_" in k and "lora_unet_" in k and not k.startswith("lora_unet_input")
                   and not k.startswith("lora_unet_output") and "middle_block" not in k] + [k for k in keys if "lora_te" in k],
                  [k for k in keys if k.startswith(("lora_unet_input", "lora_unet_output", "lora_unet_middle", "lora_unet_out_"))]):  # fmt: skip
        sd = {}
        for k in group:
            sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = torch.zeros(2, 4), torch.zeros(4, 2)
        sd = lcu._maybe_map_sgm_blocks_to_diffusers(sd, types.SimpleNamespace(layers_per_block=2))
        out, _ = lcu._convert_non_diffusers_lora_to_diffusers(sd)
        # the kohya converter's text-encoder names are diffusers' old ones (`to_q_lora`, `lora_linear_layer`)
        old = StateDictType.DIFFUSERS_OLD
        te = convert_state_dict_to_peft({k: v for k, v in out.items() if k.startswith("text_encoder")}, old)
        unet = convert_unet_state_dict_to_peft({k: v for k, v in out.items() if k.startswith("unet")})
        theirs = {k.removesuffix(".lora_A.weight") for k in {**te, **unet} if k.endswith(".lora_A.weight")}
        assert set(kohya_names(group).values()) == theirs


def test_sdxl_sgm_names_map_to_diffusers_blocks_exactly(tmp_path: Path) -> None:
    src = _kohya(tmp_path / "k", {f"lora_unet_{n}": (2, 3.0) for n in SDXL})
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == ()
    assert _keys(res.out) == {f"unet.{d}.lora_{ab}.weight" for d in SDXL.values() for ab in "AB"}
    # one set of weights under diffusers' names and under sgm's (the kohya file merges by those)
    diffusers_base = _base(list(SDXL.values()))
    sgm_base = {f"{_sgm_dotted(k)}.weight": diffusers_base[f"{v}.weight"] for k, v in SDXL.items()}
    a, b = _merged(sgm_base, src), _merged(diffusers_base, res.out)
    for sgm, dotted in SDXL.items():
        assert torch.equal(a[f"{_sgm_dotted(sgm)}.weight"], b[f"{dotted}.weight"])
    assert not torch.equal(a[f"{_sgm_dotted(sgm)}.weight"], sgm_base[f"{_sgm_dotted(sgm)}.weight"])


#: the sgm UNet's own module paths for the SDXL names above (written out by hand)
SGM_PATHS = {
    "input_blocks_4_1_transformer_blocks_0_attn1_to_q": "input_blocks.4.1.transformer_blocks.0.attn1.to_q",
    "input_blocks_1_0_emb_layers_1": "input_blocks.1.0.emb_layers.1",
    "middle_block_1_proj_in": "middle_block.1.proj_in",
    "output_blocks_2_1_transformer_blocks_1_ff_net_2": "output_blocks.2.1.transformer_blocks.1.ff.net.2",
    "output_blocks_8_0_skip_connection": "output_blocks.8.0.skip_connection",
}


def _sgm_dotted(flat: str) -> str:
    return SGM_PATHS[flat]


def test_unknown_architecture_keeps_flattened_names_and_says_so(tmp_path: Path) -> None:
    bfl = ["double_blocks_0_img_attn_qkv", "single_blocks_1_linear2"]
    src = _kohya(tmp_path / "k", {f"lora_transformer_{n}": (2, 3.0) for n in bfl})
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == (FLATTENED_NOTE,)
    assert _keys(res.out) == {f"transformer.{n}.lora_{ab}.weight" for n in bfl for ab in "AB"}
    base = _base(["double_blocks.0.img_attn.qkv", "single_blocks.1.linear2"])
    a, b = _merged(base, src), _merged(base, res.out)
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], base[k]) for k in a)
    meta = lorafast.read_header(os.path.join(res.out, "adapter_model.safetensors")).metadata
    assert FLATTENED_NOTE in meta["lorafast.converted"]


def test_cli_prints_the_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    src = _kohya(tmp_path / "k", {"lora_transformer_double_blocks_0_img_attn_qkv": (2, 3.0)})
    assert main(["convert", src, "--to", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert f"note: {FLATTENED_NOTE}" in capsys.readouterr().out


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
