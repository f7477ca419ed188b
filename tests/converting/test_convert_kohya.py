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
from lorafast import ConvertError, convert  # noqa: E402
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
    assert unflatten("double_blocks_0_img_attn_qkv") is None  # Flux BFL names: split by bfl_split, not renamed


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
    from lorafast.converting.kohya import kohya_targets

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
        assert _names(kohya_targets(group)) == theirs


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


def _names(targets: dict | None) -> set[str]:
    assert targets is not None
    return {name for _, parts in targets.values() for name, _ in parts}


def peft_deltas(folder: str) -> dict[str, tuple[int, float, torch.Tensor]]:
    """PEFT's own reading of a converted folder: every module put on a tiny model of plain Linears named as the
    folder's keys (`inject_adapter_in_model` with the folder's `LoraConfig`, then its tensors), and per module
    the rank, scaling and delta weight PEFT has for it."""
    peft = pytest.importorskip("peft")
    tensors = safetensors_torch.load_file(os.path.join(folder, "adapter_model.safetensors"))
    root = torch.nn.Module()
    names = sorted(k.removesuffix(".lora_A.weight") for k in tensors if k.endswith(".lora_A.weight"))
    for name in names:
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
        parent.add_module(leaf, torch.nn.Linear(a.shape[1], b.shape[0], bias=False))
    model = peft.inject_adapter_in_model(peft.LoraConfig.from_pretrained(folder), root)
    loaded = peft.set_peft_model_state_dict(model, tensors)
    assert not loaded.unexpected_keys
    out = {}
    for name in names:
        m = model.get_submodule(name)
        out[name] = (m.r["default"], m.scaling["default"], m.get_delta_weight("default"))
    return out


def kohya_deltas(path: str) -> dict[str, tuple[int, float, torch.Tensor]]:
    """sd-scripts' reading of a kohya file: per module, rank, scale alpha / rank (0 or no alpha: 1) and delta."""
    tensors = safetensors_torch.load_file(path)
    out = {}
    for key in (k.removesuffix(".lora_down.weight") for k in tensors if k.endswith(".lora_down.weight")):
        down, up = tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"]
        rank = down.shape[0]
        alpha = float(tensors[f"{key}.alpha"]) if f"{key}.alpha" in tensors else 0.0
        scale = (alpha or rank) / rank
        out[key] = (rank, scale, (up @ down) * scale)
    return out


def test_sdxl_text_encoders_with_one_module_path_keep_their_own_rank_and_alpha_in_peft(tmp_path: Path) -> None:
    """SDXL's two CLIP encoders share module paths: a pattern keyed on the shared prefix-free name gave one of
    them the other's rank and alpha. PEFT, loading the folder, gives each module the kohya file's rank and scale."""
    q = "text_model_encoder_layers_0_self_attn_q_proj"
    modules = {f"lora_te1_{q}": (4, 4.0), f"lora_te2_{q}": (8, 1.0), "lora_te2_text_model_encoder_layers_0_mlp_fc1": (4, 4.0),
               "lora_unet_mid_block_attentions_0_proj_in": (8, 1.0)}  # fmt: skip
    src = _kohya(tmp_path / "k", modules)
    res = convert(src, "peft", tmp_path / "peft")
    theirs = peft_deltas(res.out)
    ours = kohya_deltas(src)
    names = {"lora_te1_": "text_encoder.", "lora_te2_": "text_encoder_2.", "lora_unet_": "unet."}
    for key, (rank, scale, delta) in ours.items():
        prefix = next(p for p in names if key.startswith(p))
        dotted = names[prefix] + str(unflatten(key.removeprefix(prefix)))
        r, scaling, peft_delta = theirs[dotted]
        assert (r, scaling) == (rank, scale), dotted
        assert torch.equal(peft_delta, delta), dotted
    assert len(theirs) == len(ours)
    assert theirs[f"text_encoder.{unflatten(q)}"][1] == 1.0 and theirs[f"text_encoder_2.{unflatten(q)}"][1] == 0.125


def test_a_config_that_would_change_a_scale_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The written config is checked module by module under PEFT's pattern rule before the folder is kept."""
    from lorafast.converting import api

    real = api.build

    def forgetful(*args: object, **kw: object) -> dict:
        return {**real(*args, **kw), "alpha_pattern": {}}  # type: ignore[arg-type]

    monkeypatch.setattr(api, "build", forgetful)
    src = _kohya(tmp_path / "k", {"lora_unet_mid_block_attentions_0_proj_in": (4, 4.0),
                                  "lora_unet_mid_block_attentions_0_proj_out": (4, 1.0)})  # fmt: skip
    with pytest.raises(ConvertError) as info:
        convert(src, "peft", tmp_path / "peft")
    assert info.value.code == "lossy"
    assert "unet.mid_block.attentions.0.proj_out: rank 4 alpha 4, the source has 4 and 1" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


def test_two_kohya_modules_for_one_peft_module_are_refused(tmp_path: Path) -> None:
    """`lora_te_` and `lora_te1_` both name the first text encoder: one file with both on one module path would
    hold two tensors under one name (a header that lists one of them). Refused, nothing left."""
    q = "text_model_encoder_layers_0_self_attn_q_proj"
    src = _kohya(tmp_path / "k", {f"lora_te_{q}": (4, 4.0), f"lora_te1_{q}": (4, 4.0)})
    with pytest.raises(ConvertError, match="two modules would both be written as") as info:
        convert(src, "peft", tmp_path / "peft")
    assert info.value.code == "unsupported"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


#: a transformer whose names are in no table (Lumina-like `attention`, `feed_forward`)
UNKNOWN = ["layers_0_attention_qkv", "layers_1_feed_forward_w2"]


def test_unknown_architecture_keeps_flattened_names_and_says_so(tmp_path: Path) -> None:
    src = _kohya(tmp_path / "k", {f"lora_transformer_{n}": (2, 3.0) for n in UNKNOWN})
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == (FLATTENED_NOTE,)
    assert _keys(res.out) == {f"transformer.{n}.lora_{ab}.weight" for n in UNKNOWN for ab in "AB"}
    base = _base(["layers.0.attention.qkv", "layers.1.feed_forward.w2"])
    a, b = _merged(base, src), _merged(base, res.out)
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], base[k]) for k in a)
    meta = lorafast.read_header(os.path.join(res.out, "adapter_model.safetensors")).metadata
    assert FLATTENED_NOTE in meta["lorafast.converted"]


def test_cli_prints_the_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    src = _kohya(tmp_path / "k", {f"lora_transformer_{UNKNOWN[0]}": (2, 3.0)})
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


#: Flux in BFL's names, as sd-scripts writes it under `lora_unet_`: module -> lora_up rows (inputs: H)
FLUX_BFL = {
    **{f"double_blocks_0_{side}_{m}": rows for side in ("img", "txt")
       for m, rows in (("attn_qkv", 3 * H), ("attn_proj", H), ("mlp_0", 4 * H), ("mlp_2", H), ("mod_lin", 6 * H))},
    "single_blocks_1_linear1": 7 * H, "single_blocks_1_linear2": H, "single_blocks_1_modulation_lin": 3 * H,
    **{n: H for n in ("img_in", "txt_in", "time_in_in_layer", "time_in_out_layer", "vector_in_in_layer",
                      "vector_in_out_layer", "guidance_in_in_layer", "guidance_in_out_layer", "final_layer_linear")},
    "final_layer_adaLN_modulation_1": 2 * H,
}  # fmt: skip
#: alphas other than the rank (2): a scale of 4 on fused and plain modules, none (alpha = rank) on one
FLUX_ALPHAS = {"double_blocks_0_img_attn_qkv": 8.0, "single_blocks_1_linear1": 8.0, "img_in": 8.0,
               "double_blocks_0_txt_mod_lin": None}  # fmt: skip


def _flux_bfl(folder: Path, rows: dict[str, int]) -> str:
    return write_kohya(
        folder, {f"lora_unet_{n}": ((2, H), (r, 2), FLUX_ALPHAS.get(n, 2.0)) for n, r in rows.items()}, 13
    )


def test_flux_bfl_names_and_tensors_match_diffusers_own_conversion(tmp_path: Path) -> None:
    """diffusers' `_convert_kohya_flux_lora_to_diffusers` on the same file gives the same modules and tensors, its
    alpha/rank scale baked into lora_A where lorafast keeps it in the config (diffusers' single-block split
    sizes are Flux's own, 3072 x (1, 1, 1, 4), so linear1 has Flux's 21504 rows here)."""
    lcu = pytest.importorskip("diffusers.loaders.lora_conversion_utils")
    from diffusers.utils import convert_state_dict_to_peft
    from diffusers.utils.state_dict_utils import StateDictType
    from lorafast.naming import strip_prefixes

    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    src = _flux_bfl(tmp_path / "k", {**FLUX_BFL, "single_blocks_1_linear1": 7 * 3072})
    with_te = tmp_path / "k" / "with_te.safetensors"
    sd = safetensors_torch.load_file(src)
    sd[f"{te}.lora_down.weight"], sd[f"{te}.lora_up.weight"] = torch.randn(2, H), torch.randn(H, 2)
    sd[f"{te}.alpha"] = torch.tensor(8.0)
    safetensors_torch.save_file(sd, str(with_te))
    res = convert(str(with_te), "peft", tmp_path / "peft")
    assert res.notes == ()
    ours = safetensors_torch.load_file(os.path.join(res.out, "adapter_model.safetensors"))
    scales = {m.name: m.scale for m in lorafast.inspect(res.out).modules}

    theirs = lcu._convert_kohya_flux_lora_to_diffusers(dict(sd))
    # its text-encoder names are diffusers' old ones; its top-level Flux modules come without `transformer.`
    theirs = {**{k: v for k, v in theirs.items() if not k.startswith("text_encoder.")},
              **convert_state_dict_to_peft({k: v for k, v in theirs.items() if k.startswith("text_encoder.")},
                                           StateDictType.DIFFUSERS_OLD)}  # fmt: skip
    theirs = {
        k if k.startswith(("transformer.", "text_encoder.")) else f"transformer.{k}": v for k, v in theirs.items()
    }
    assert ours.keys() == theirs.keys()
    assert len(ours) == 2 * (len(FLUX_BFL) + 1 + 2 * 2 + 3)  # + the text encoder, 2 more per qkv, 3 of linear1
    for key, t in ours.items():
        module = strip_prefixes(key.rsplit(".lora_", 1)[0])
        scale = scales[module] if ".lora_A." in key else 1.0
        assert torch.equal(theirs[key], t * scale), key
    assert {scales["transformer_blocks.0.attn.to_k"], scales["single_transformer_blocks.1.proj_mlp"],
            scales["x_embedder"], scales["transformer_blocks.0.norm1_context.linear"]} == {4.0, 1.0}  # fmt: skip


def _bfl_as_diffusers(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL-named Flux state dict under diffusers' module names, split as diffusers' Flux checkpoint
    conversion splits it (written out by hand)."""
    out = {}
    for side, attn, ff, norm in (("img", ("to_q", "to_k", "to_v", "to_out.0"), "ff", "norm1"),
                                 ("txt", ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"), "ff_context",
                                  "norm1_context")):  # fmt: skip
        bfl, dif = f"double_blocks.0.{side}_", "transformer_blocks.0."
        for name, part in zip(attn[:3], w[f"{bfl}attn.qkv.weight"].chunk(3), strict=True):
            out[f"{dif}attn.{name}.weight"] = part
        out[f"{dif}attn.{attn[3]}.weight"] = w[f"{bfl}attn.proj.weight"]
        out[f"{dif}{ff}.net.0.proj.weight"] = w[f"{bfl}mlp.0.weight"]
        out[f"{dif}{ff}.net.2.weight"] = w[f"{bfl}mlp.2.weight"]
        out[f"{dif}{norm}.linear.weight"] = w[f"{bfl}mod.lin.weight"]
    q, k, v, mlp = w["single_blocks.1.linear1.weight"].split([H, H, H, 4 * H])
    out |= {f"single_transformer_blocks.1.{n}.weight": t for n, t in
            (("attn.to_q", q), ("attn.to_k", k), ("attn.to_v", v), ("proj_mlp", mlp))}  # fmt: skip
    out["single_transformer_blocks.1.proj_out.weight"] = w["single_blocks.1.linear2.weight"]
    out["single_transformer_blocks.1.norm.linear.weight"] = w["single_blocks.1.modulation.lin.weight"]
    for bfl, dif in (("img_in", "x_embedder"), ("txt_in", "context_embedder"), ("final_layer.linear", "proj_out"),
                     ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
                     ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
                     ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
                     ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
                     ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
                     ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")):  # fmt: skip
        out[f"{dif}.weight"] = w[f"{bfl}.weight"]
    shift, scale = w["final_layer.adaLN_modulation.1.weight"].chunk(2)  # diffusers' norm_out: scale, then shift
    out["norm_out.linear.weight"] = torch.cat([scale, shift])
    return out


#: BFL module paths of FLUX_BFL: the flattened names with their dots (written out by hand)
BFL_PATHS = {
    **{f"double_blocks_0_{side}_{m}": f"double_blocks.0.{side}_{p}" for side in ("img", "txt")
       for m, p in (("attn_qkv", "attn.qkv"), ("attn_proj", "attn.proj"), ("mlp_0", "mlp.0"), ("mlp_2", "mlp.2"),
                    ("mod_lin", "mod.lin"))},
    "single_blocks_1_linear1": "single_blocks.1.linear1", "single_blocks_1_linear2": "single_blocks.1.linear2",
    "single_blocks_1_modulation_lin": "single_blocks.1.modulation.lin", "img_in": "img_in", "txt_in": "txt_in",
    "time_in_in_layer": "time_in.in_layer", "time_in_out_layer": "time_in.out_layer",
    "vector_in_in_layer": "vector_in.in_layer", "vector_in_out_layer": "vector_in.out_layer",
    "guidance_in_in_layer": "guidance_in.in_layer", "guidance_in_out_layer": "guidance_in.out_layer",
    "final_layer_linear": "final_layer.linear", "final_layer_adaLN_modulation_1": "final_layer.adaLN_modulation.1",
}  # fmt: skip


def test_flux_bfl_split_merges_bit_identically(tmp_path: Path) -> None:
    """The kohya file merged into a fused BFL base and the converted folder merged into the same weights split
    into diffusers' modules give the same bits."""
    src = _flux_bfl(tmp_path / "k", FLUX_BFL)
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == ()
    gen = torch.Generator().manual_seed(14)
    bfl_base = {f"{BFL_PATHS[n]}.weight": torch.randn(rows, H, generator=gen) for n, rows in FLUX_BFL.items()}
    diffusers_base = _bfl_as_diffusers(bfl_base)
    assert all(t.shape[0] == H or t.shape[0] % H == 0 for t in diffusers_base.values())
    a, b = _bfl_as_diffusers(_merged(bfl_base, src)), _merged(diffusers_base, res.out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(b[k], diffusers_base[k]) for k in b), "every module must be changed by the merge"


def test_flux_bfl_fused_rows_that_do_not_split_are_refused(tmp_path: Path) -> None:
    src = _flux_bfl(tmp_path / "k", {"single_blocks_1_linear1": 7 * H + 1})
    with pytest.raises(lorafast.ConvertError, match=r"single_blocks_1_linear1\.lora_up\.weight has 113 rows") as e:
        convert(src, "peft", tmp_path / "peft")
    assert e.value.code == "unsupported" and not (tmp_path / "peft").exists()


def test_a_file_mixing_bfl_and_other_unet_names_keeps_them_flattened(tmp_path: Path) -> None:
    src = _kohya(tmp_path / "k", {"lora_unet_double_blocks_0_img_attn_proj": (2, 2.0),
                                  "lora_unet_down_blocks_0_attentions_0_proj_in": (2, 2.0)})  # fmt: skip
    res = convert(src, "peft", tmp_path / "peft")
    assert res.notes == (FLATTENED_NOTE,)
    assert _keys(res.out) == {f"unet.{n}.lora_{ab}.weight" for n in ("double_blocks_0_img_attn_proj",
                              "down_blocks_0_attentions_0_proj_in") for ab in "AB"}  # fmt: skip


def test_sglang_diffusion_reads_the_converted_flux_bfl_folder_with_each_modules_alpha(tmp_path: Path) -> None:
    """SGLang 0.5.23's diffusion code, from the released wheel: it takes the BFL kohya file as `kohya-flux` and
    keeps BFL's fused names (lora_down/lora_up only renamed); the converted folder is a standard PEFT adapter
    in diffusers' Flux modules, and the per-module alpha it reads (`lora_alpha`, or the `alpha_pattern` entry
    it turns into a `.alpha` tensor) is each source module's."""
    bfl = {n: FLUX_BFL[n] for n in ("double_blocks_0_img_attn_qkv", "single_blocks_1_linear1", "img_in",
                                    "final_layer_adaLN_modulation_1")}  # fmt: skip
    src = _flux_bfl(tmp_path / "k", bfl)
    res = convert(src, "peft", tmp_path / "peft")
    out_file = os.path.join(res.out, "adapter_model.safetensors")
    got = engines.run("sglang_diffusion_runner", "sglang", engines.PINNED["sglang"][0],
                      [{"id": "kohya", "kind": "file", "path": src}, {"id": "peft", "kind": "file", "path": out_file}])  # fmt: skip
    before, after = got["kohya"], got["peft"]
    assert before["detect"] == {"ok": "kohya-flux"}
    assert {k.split(".")[0] for k in before["normalize"]["ok"]["keys"]} == {f"lora_unet_{n}" for n in bfl}
    assert after["detect"] == {"ok": "standard"}
    # the source's alphas (FLUX_ALPHAS): 8 on the qkv, linear1 and img_in, 2 on the final layer's modulation
    alpha = {"transformer_blocks.0.attn.to_q": 8.0, "transformer_blocks.0.attn.to_k": 8.0,
             "transformer_blocks.0.attn.to_v": 8.0, "single_transformer_blocks.1.attn.to_q": 8.0,
             "single_transformer_blocks.1.attn.to_k": 8.0, "single_transformer_blocks.1.attn.to_v": 8.0,
             "single_transformer_blocks.1.proj_mlp": 8.0, "x_embedder": 8.0, "norm_out.linear": 2.0}  # fmt: skip
    keys = after["normalize"]["ok"]["keys"]
    assert sorted(k for k in keys if not k.endswith(".alpha")) == sorted(
        f"transformer.{n}.lora_{ab}.weight" for n in alpha for ab in "AB"
    )
    per_module = after["normalize"]["ok"]["alphas"]
    assert {n: per_module.get(f"transformer.{n}.alpha", after["alpha"]["ok"]) for n in alpha} == alpha
