"""lorafast.convert (package lorafast.converting): every row of the layout table is exact (merged deltas bit-identical in fp32), bad input is
refused with a `ConvertError` code and leaves nothing behind, and a converted mixed fleet fits one SGLang server."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import lorafast
import safetensors.torch as safetensors_torch
import torch
from helpers.bits import same_bits
from lorafast import ConvertError, convert
from lorafast.converting import CONVERT_ERROR_CODES

H, IM, E, R = 16, 8, 4, 2
LAYERS = 2
PEFT = "base_model.model.model.layers"


def _rnd(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def _config(targets: list[str], r: int = R, **extra: object) -> dict:
    return {"peft_type": "LORA", "r": r, "lora_alpha": 3 * r, "target_modules": targets, **extra}


def _attn(t: dict, gen: torch.Generator, layer: int, r: int = R) -> None:
    t[f"{PEFT}.{layer}.self_attn.q_proj.lora_A.weight"] = _rnd(gen, r, H)
    t[f"{PEFT}.{layer}.self_attn.q_proj.lora_B.weight"] = _rnd(gen, H, r)


# The adapter writers take the expert count `e`, rank `r`, `layers` and `config` entries over the defaults (the
# fuzz pass, test_convert_fuzz.py, varies them).


def stacked_adapter(
    folder: Path,
    seed: int,
    shared_outer: bool,
    identical_outer: bool = False,
    attn: bool = True,
    *,
    e: int = E,
    r: int = R,
    layers: int = LAYERS,
    config: dict | None = None,
) -> str:
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        if attn:
            _attn(t, gen, layer, r)
        pre = f"{PEFT}.{layer}.mlp.experts"
        outer_a, outer_b = _rnd(gen, 1, r, H), _rnd(gen, 1, H, r)
        if not shared_outer:
            outer_a = outer_a.repeat(e, 1, 1) if identical_outer else _rnd(gen, e, r, H)
            outer_b = outer_b.repeat(e, 1, 1) if identical_outer else _rnd(gen, e, H, r)
        t[f"{pre}.gate_up_proj.lora_A.weight"] = outer_a
        t[f"{pre}.gate_up_proj.lora_B.weight"] = _rnd(gen, e, 2 * IM, r)
        t[f"{pre}.down_proj.lora_A.weight"] = _rnd(gen, e, r, IM)
        t[f"{pre}.down_proj.lora_B.weight"] = outer_b
    return _write(folder, t, _config(["q_proj", "gate_up_proj", "down_proj"], r, **(config or {})))


def target_parameters_adapter(
    folder: Path, seed: int, *, e: int = E, r: int = R, layers: int = LAYERS, config: dict | None = None
) -> str:
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        _attn(t, gen, layer, r)
        pre = f"{PEFT}.{layer}.mlp.experts"
        t[f"{pre}.base_layer.lora_A.weight"] = _rnd(gen, r * e, H)
        t[f"{pre}.base_layer.lora_B.weight"] = _rnd(gen, 2 * IM, r * e)
        t[f"{pre}.lora_A.weight"] = _rnd(gen, r * e, IM)
        t[f"{pre}.lora_B.weight"] = _rnd(gen, H, r * e)
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return _write(folder, t, _config(["q_proj"], r, target_parameters=params, **(config or {})))


def numbered_adapter(
    folder: Path,
    seed: int,
    mixtral: bool = False,
    attn: bool = True,
    *,
    e: int = E,
    r: int = R,
    layers: int = LAYERS,
    config: dict | None = None,
) -> str:
    gen = torch.Generator().manual_seed(seed)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if mixtral else "mlp"
    t: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        if attn:
            _attn(t, gen, layer, r)
        for expert in range(e):
            pre = f"{PEFT}.{layer}.{block}.experts.{expert}"
            for leaf, (fin, fout) in zip(names, ((H, IM), (H, IM), (IM, H)), strict=True):
                t[f"{pre}.{leaf}.lora_A.weight"] = _rnd(gen, r, fin)
                t[f"{pre}.{leaf}.lora_B.weight"] = _rnd(gen, fout, r)
    return _write(folder, t, _config(["q_proj", *names], r, **(config or {})))


# -- bases and a layout-free view of them ----------------------------------------------------------------------


def fused_base(seed: int = 99, *, e: int = E, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """transformers-5 experts: gate_up_proj (E, 2·I, H) with gate rows first, down_proj (E, H, I)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(layers):
        sd[f"model.layers.{layer}.self_attn.q_proj.weight"] = _rnd(gen, H, H)
        sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = _rnd(gen, e, 2 * IM, H)
        sd[f"model.layers.{layer}.mlp.experts.down_proj"] = _rnd(gen, e, H, IM)
    return sd


def numbered_base(seed: int = 99, *, e: int = E, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """The same weights as `fused_base`, as transformers 4 keeps them: one Linear per expert and projection."""
    fb = fused_base(seed, e=e, layers=layers)
    sd = {}
    for layer in range(layers):
        sd[f"model.layers.{layer}.self_attn.q_proj.weight"] = fb[f"model.layers.{layer}.self_attn.q_proj.weight"]
        for expert in range(e):
            gu = fb[f"model.layers.{layer}.mlp.experts.gate_up_proj"][expert]
            pre = f"model.layers.{layer}.mlp.experts.{expert}"
            sd[f"{pre}.gate_proj.weight"] = gu[:IM].clone()
            sd[f"{pre}.up_proj.weight"] = gu[IM:].clone()
            sd[f"{pre}.down_proj.weight"] = fb[f"model.layers.{layer}.mlp.experts.down_proj"][expert].clone()
    return sd


def merged(base: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    sd = {k: v.clone() for k, v in base.items()}
    lorafast.merge(sd, [adapter]).commit()
    changed = [k for k in sd if not torch.equal(sd[k], base[k])]
    assert changed, "the adapter changed nothing"
    return sd


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == torch.float32
        assert same_bits(a[k], b[k]), k


def _conversion_meta(out: str) -> dict:
    with lorafast.tensors.TensorFile(os.path.join(out, "adapter_model.safetensors")) as tf:
        return json.loads(tf.metadata["lorafast.converted"])


# -- the table, row by row -------------------------------------------------------------------------------------


def test_shared_outer_to_stacked_is_exact(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "shared", 1, shared_outer=True)
    res = convert(src, "stacked_3d", tmp_path / "out")
    conv = lorafast.inspect(res.out)
    assert conv.moe_layout.value == "stacked_3d" and not conv.problems
    mod = next(m for m in conv.modules if m.leaf == "gate_up_proj")
    assert mod.a_shape == (E, R, H)
    assert_bit_identical(merged(fused_base(), src), merged(fused_base(), res.out))
    meta = _conversion_meta(res.out)
    assert meta["from"] == "shared_outer" and meta["to"] == "stacked_3d"
    assert meta["lorafast_version"] == lorafast.__version__
    assert meta["source_sha256"] == res.source_sha256 == lorafast.inspect(src, content_hash=True).content_hash


def test_stacked_with_identical_outer_factors_to_shared_outer_is_exact(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "stacked", 2, shared_outer=False, identical_outer=True)
    res = convert(src, "shared_outer", tmp_path / "out")
    conv = lorafast.inspect(res.out)
    assert conv.moe_layout.value == "shared_outer"
    assert_bit_identical(merged(fused_base(), src), merged(fused_base(), res.out))
    # and back again gives the original bytes
    back = convert(res.out, "stacked_3d", tmp_path / "back")
    with lorafast.tensors.TensorFile(os.path.join(src, "adapter_model.safetensors")) as a, \
            lorafast.tensors.TensorFile(os.path.join(back.out, "adapter_model.safetensors")) as b:  # fmt: skip
        assert set(a.tensors) == set(b.tensors)
        for name in a.tensors:
            assert torch.equal(a.view(name), b.view(name)), name


def test_stacked_with_different_outer_factors_is_refused_as_lossy(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "stacked", 3, shared_outer=False)
    with pytest.raises(ConvertError, match="max difference") as info:
        convert(src, "shared_outer", tmp_path / "out")
    assert info.value.code == "lossy"
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["stacked"]  # no temporary folder left either


@pytest.mark.parametrize("shared", [False, True])
def test_target_parameters_and_stacked_both_ways_are_exact(tmp_path: Path, shared: bool) -> None:
    tp = target_parameters_adapter(tmp_path / "tp", 4)
    st = convert(tp, "stacked_3d", tmp_path / "st")
    assert lorafast.inspect(st.out).moe_layout.value == "stacked_3d"
    assert_bit_identical(merged(fused_base(), tp), merged(fused_base(), st.out))
    src = stacked_adapter(tmp_path / "s", 5, shared_outer=shared)
    back = convert(src, "peft_target_parameters", tmp_path / "back")
    conv = lorafast.inspect(back.out)
    assert conv.moe_layout.value == "peft_target_parameters" and not conv.problems
    assert_bit_identical(merged(fused_base(), src), merged(fused_base(), back.out))


def test_numbered_to_stacked_and_back_is_exact(tmp_path: Path) -> None:
    src = numbered_adapter(tmp_path / "numbered", 6)
    st = convert(src, "stacked_3d", tmp_path / "st")
    conv = lorafast.inspect(st.out)
    assert conv.moe_layout.value == "stacked_3d" and not conv.problems
    # stacked per projection at rank r, the form SGLang fuses on load like numbered experts; the config is unchanged
    gate = next(m for m in conv.modules if m.name == "model.layers.1.mlp.experts.up_proj")
    assert (gate.a_shape, gate.b_shape, gate.scale) == ((E, R, H), (E, IM, R), 3.0)
    assert json.loads(Path(st.out, "adapter_config.json").read_text())["r"] == R
    # numbered experts merge into transformers-5 fused weights the way PEFT fuses them, so the bits agree
    assert_bit_identical(merged(fused_base(), src), merged(fused_base(), st.out))
    back = convert(st.out, "per_expert_2d", tmp_path / "back")
    assert lorafast.inspect(back.out).moe_layout.value == "per_expert_2d"
    assert_bit_identical(merged(numbered_base(), src), merged(numbered_base(), back.out))


def test_transformers4_expert_names_to_transformers5_is_exact(tmp_path: Path) -> None:
    src = numbered_adapter(tmp_path / "mixtral", 17, mixtral=True)
    res = convert(src, "transformers5", tmp_path / "v5")
    conv = lorafast.inspect(res.out)
    assert conv.moe_layout.value == "peft_target_parameters" and not conv.problems
    keys = set(lorafast.read_header(os.path.join(res.out, "adapter_model.safetensors")).tensors)
    assert f"{PEFT}.1.mlp.experts.base_layer.lora_A.weight" in keys  # block_sparse_moe -> mlp, as transformers 5
    assert not any("block_sparse_moe" in k for k in keys)
    cfg = json.loads(Path(res.out, "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    # the fused gate_up has rank 2r; it is the config's r (SGLang sizes buffers by r and scales by one alpha / r),
    # and the other modules keep rank r and alpha through patterns
    assert (cfg["r"], cfg["lora_alpha"]) == (2 * R, 6 * R)
    assert cfg["rank_pattern"] == {"q_proj": R, "down_proj": R}
    assert cfg["alpha_pattern"] == {"q_proj": 3 * R, "down_proj": 3 * R}
    assert_bit_identical(merged(fused_base(), src), merged(fused_base(), res.out))


def test_numbered_experts_merge_into_fused_weights(tmp_path: Path) -> None:
    """The merge engine's side: a transformers-4 adapter into a transformers-5 model gives the transformers-4 result."""
    src = numbered_adapter(tmp_path / "qwen", 18)
    v4 = merged(numbered_base(), src)
    v5 = merged(fused_base(), src)
    for layer in range(LAYERS):
        gu, down = (
            v5[f"model.layers.{layer}.mlp.experts.gate_up_proj"],
            v5[f"model.layers.{layer}.mlp.experts.down_proj"],
        )
        for e in range(E):
            pre = f"model.layers.{layer}.mlp.experts.{e}"
            torch.testing.assert_close(gu[e, :IM], v4[f"{pre}.gate_proj.weight"], rtol=0, atol=1e-5)
            torch.testing.assert_close(gu[e, IM:], v4[f"{pre}.up_proj.weight"], rtol=0, atol=1e-5)
            torch.testing.assert_close(down[e], v4[f"{pre}.down_proj.weight"], rtol=0, atol=1e-5)


def test_stacked_to_numbered_splits_gate_up(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "s", 7, shared_outer=False)
    res = convert(src, "per_expert_2d", tmp_path / "out")
    conv = lorafast.inspect(res.out)
    assert conv.moe_layout.value == "per_expert_2d" and not conv.problems
    names = {m.name for m in conv.modules}
    assert {f"model.layers.0.mlp.experts.{E - 1}.{p}" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    with lorafast.tensors.TensorFile(os.path.join(src, "adapter_model.safetensors")) as a, \
            lorafast.tensors.TensorFile(os.path.join(res.out, "adapter_model.safetensors")) as b:  # fmt: skip
        gu = a.view(f"{PEFT}.1.mlp.experts.gate_up_proj.lora_B.weight")
        assert torch.equal(b.view(f"{PEFT}.1.mlp.experts.2.up_proj.lora_B.weight"), gu[2, IM:])
        assert torch.equal(b.view(f"{PEFT}.1.mlp.experts.2.gate_proj.lora_A.weight"),
                           a.view(f"{PEFT}.1.mlp.experts.gate_up_proj.lora_A.weight")[2])  # fmt: skip


def write_kohya(
    folder: Path, modules: dict[str, tuple[tuple[int, ...], tuple[int, ...], float | None]], seed: int
) -> str:
    """A kohya file: {module key: (lora_down shape, lora_up shape, alpha or None)}."""
    gen = torch.Generator().manual_seed(seed)
    t = {}
    for key, (down, up, alpha) in modules.items():
        t[f"{key}.lora_down.weight"] = _rnd(gen, *down)
        t[f"{key}.lora_up.weight"] = _rnd(gen, *up)
        if alpha is not None:
            t[f"{key}.alpha"] = torch.tensor(alpha)
    folder.mkdir()
    path = folder / "kohya.safetensors"
    safetensors_torch.save_file(t, str(path))
    return str(path)


def _kohya(folder: Path) -> str:
    # (module, rank, alpha): alpha 0 and a missing alpha both mean alpha = rank
    modules = {}
    for name, r, alpha in (("down_blocks_0_attentions_0_proj_in", 4, 1.5), ("mid_block_attentions_0_proj_out", 2, 0.0),
                           ("up_blocks_1_attentions_0_proj_in", 4, None), ("down_blocks_1_resnets_0_conv1", 3, 7.0)):  # fmt: skip
        conv = name.endswith("conv1")
        modules[f"lora_unet_{name}"] = ((r, H, 3, 3) if conv else (r, H), (H, r, 1, 1) if conv else (H, r), alpha)
    return write_kohya(folder, modules, 8)


def _unet_base() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(98)
    return {"down_blocks.0.attentions.0.proj_in.weight": _rnd(gen, H, H),
            "mid_block.attentions.0.proj_out.weight": _rnd(gen, H, H),
            "up_blocks.1.attentions.0.proj_in.weight": _rnd(gen, H, H),
            "down_blocks.1.resnets.0.conv1.weight": _rnd(gen, H, H, 3, 3),
            "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight": _rnd(gen, H, H),
            "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.weight": _rnd(gen, H, H)}  # fmt: skip


def test_kohya_to_peft_folder_keeps_every_scale(tmp_path: Path) -> None:
    src = _kohya(tmp_path / "k")
    res = convert(src, "peft", tmp_path / "peft")
    assert sorted(os.listdir(res.out)) == ["adapter_config.json", "adapter_model.safetensors"]
    conv = lorafast.inspect(res.out)
    assert conv.format.value in ("peft", "diffusers") and conv.config is not None
    # the dots come back as diffusers' kohya converter puts them (names written out by hand)
    dotted = {"down_blocks_0_attentions_0_proj_in": "down_blocks.0.attentions.0.proj_in",
              "mid_block_attentions_0_proj_out": "mid_block.attentions.0.proj_out",
              "up_blocks_1_attentions_0_proj_in": "up_blocks.1.attentions.0.proj_in",
              "down_blocks_1_resnets_0_conv1": "down_blocks.1.resnets.0.conv1"}  # fmt: skip
    before = {dotted[m.name.removeprefix("lora_unet_")]: m.scale for m in lorafast.inspect(src).modules}
    assert {m.name: m.scale for m in conv.modules} == before
    keys = set(lorafast.read_header(os.path.join(res.out, "adapter_model.safetensors")).tensors)
    assert keys == {f"unet.{d}.lora_{ab}.weight" for d in dotted.values() for ab in "AB"}
    assert res.notes == ()
    assert_bit_identical(merged(_unet_base(), src), merged(_unet_base(), res.out))


def test_diffusers_legacy_to_peft_folder_is_exact(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(9)
    pre = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor"
    t = {f"{pre}.to_q_lora.down.weight": _rnd(gen, R, H), f"{pre}.to_q_lora.up.weight": _rnd(gen, H, R),
         f"{pre}.to_out_lora.down.weight": _rnd(gen, R, H), f"{pre}.to_out_lora.up.weight": _rnd(gen, H, R)}  # fmt: skip
    (tmp_path / "legacy").mkdir()
    src = str(tmp_path / "legacy" / "pytorch_lora_weights.safetensors")
    safetensors_torch.save_file(t, src)
    assert lorafast.inspect(src).format.value == "diffusers_legacy"
    res = convert(src, "peft", tmp_path / "peft")
    keys = set(lorafast.read_header(os.path.join(res.out, "adapter_model.safetensors")).tensors)
    assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora_B.weight" in keys
    # The merge engine does not read attention-processor names, so the reference is the adapter diffusers' loader
    # makes of them (`processor.to_q_lora.down` -> `to_q.lora_A`, `to_out_lora` -> `to_out.0`), written by hand.
    ref = {k.replace(".processor", "").replace("to_out_lora", "to_out.0_lora").replace("_lora.down", ".lora_A")
           .replace("_lora.up", ".lora_B"): v for k, v in t.items()}  # fmt: skip
    assert set(ref) == keys
    ref_path = _write(tmp_path / "ref", ref, _config(["to_q", "to_out.0"], lora_alpha=R))
    assert_bit_identical(merged(_unet_base(), ref_path), merged(_unet_base(), res.out))


# -- one server for a mixed fleet ------------------------------------------------------------------------------


def test_converted_mixed_fleet_fits_one_sglang_server(tmp_path: Path) -> None:
    from lorafast.compat import sglang

    # expert modules only: SGLang wants q, k and v together, which has nothing to do with the layouts
    shared = stacked_adapter(tmp_path / "shared", 10, shared_outer=True, attn=False)
    stacked = stacked_adapter(tmp_path / "stacked", 11, shared_outer=False, attn=False)
    with pytest.raises(RuntimeError, match="Mixed shared-outer LoRA formats"):
        sglang.preflight([shared, stacked])
    assert len(lorafast.plan_groups([shared, stacked]).groups) == 2
    fixed = convert(shared, "stacked_3d", tmp_path / "shared-stacked").out
    plan = sglang.preflight([fixed, stacked])
    assert plan.experts_shared_outer is False
    assert len(lorafast.plan_groups([fixed, stacked]).groups) == 1
    # numbered experts converted to stacked 3-D load in the same server too
    numbered = numbered_adapter(tmp_path / "numbered", 12, attn=False)
    restacked = convert(numbered, "stacked_3d", tmp_path / "numbered-stacked").out
    assert sglang.preflight([fixed, stacked, restacked]).experts_shared_outer is False
    assert len(lorafast.plan_groups([fixed, stacked, restacked]).groups) == 1


# -- bad input -------------------------------------------------------------------------------------------------


def _left(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_layout_mismatch(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "shared", 12, shared_outer=True)
    with pytest.raises(ConvertError) as info:
        convert(src, "per_expert_2d", tmp_path / "out", source_layout="stacked_3d")
    assert info.value.code == "layout_mismatch" and "shared_outer" in str(info.value)
    with pytest.raises(ConvertError) as info:
        convert(src, "shared_outer", tmp_path / "out")  # already there
    assert info.value.code == "layout_mismatch"
    dense = tmp_path / "dense"
    gen = torch.Generator().manual_seed(0)
    t: dict[str, torch.Tensor] = {}
    _attn(t, gen, 0)
    with pytest.raises(ConvertError) as info:
        convert(_write(dense, t, _config(["q_proj"])), "stacked_3d", tmp_path / "out")
    assert info.value.code == "layout_mismatch"
    assert _left(tmp_path) == ["dense", "shared"]


def test_mixed_layouts_inside_one_adapter(tmp_path: Path) -> None:
    a = stacked_adapter(tmp_path / "a", 13, shared_outer=True)
    tensors = safetensors_torch.load_file(os.path.join(a, "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    tensors[f"{PEFT}.1.mlp.experts.gate_up_proj.lora_A.weight"] = _rnd(gen, E, R, H)  # layer 1 per-expert
    src = _write(tmp_path / "mixed", tensors, _config(["q_proj", "gate_up_proj", "down_proj"]))
    assert lorafast.inspect(src).moe_layout.value == "mixed"
    with pytest.raises(ConvertError) as info:
        convert(src, "stacked_3d", tmp_path / "out")
    assert info.value.code == "mixed_layout"
    assert _left(tmp_path) == ["a", "mixed"]


def test_existing_output_needs_overwrite(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "shared", 14, shared_outer=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError) as info:
        convert(src, "stacked_3d", out)
    assert info.value.code == "exists" and (out / "keep.txt").read_text() == "mine"
    res = convert(src, "stacked_3d", out, overwrite=True)
    assert sorted(os.listdir(res.out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert _left(tmp_path) == ["out", "shared"]


def test_truncated_source(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "shared", 15, shared_outer=True)
    weights = os.path.join(src, "adapter_model.safetensors")
    adapter = lorafast.inspect(src)  # read before the file is cut: the header still promises every byte
    os.truncate(weights, os.path.getsize(weights) - 100)
    for given in (src, adapter):
        with pytest.raises(ConvertError) as info:
            convert(given, "stacked_3d", tmp_path / "out")
        assert info.value.code == "truncated"
    assert _left(tmp_path) == ["shared"]


def test_error_codes_are_listed_and_pickle() -> None:
    import pickle

    err = ConvertError("x", "lossy", "/a")
    again = pickle.loads(pickle.dumps(err))
    assert (again.code, again.path, str(again)) == ("lossy", "/a", "x")
    assert isinstance(err, lorafast.LorafastError)
    assert {"layout_mismatch", "mixed_layout", "lossy", "exists", "truncated"} <= set(CONVERT_ERROR_CODES)


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    src = stacked_adapter(tmp_path / "shared", 16, shared_outer=True)
    assert main(["convert", src, "--to", "stacked_3d", "--out", str(tmp_path / "out"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["from_layout"] == "shared_outer" and got["to_layout"] == "stacked_3d"
    assert main(["convert", src, "--to", "stacked_3d", "--out", str(tmp_path / "out")]) == 1
    assert "[exists]" in capsys.readouterr().err


def test_transformers4_adapter_merges_into_transformers5_mixtral_like_peft(tmp_path: Path) -> None:
    """PEFT converts a transformers-4 Mixtral adapter (`block_sparse_moe.experts.N.w1/w3/w2`) on load into a
    transformers-5 model (fused `mlp.experts.gate_up_proj` / `down_proj`); `lorafast.merge` gives its result."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=H, intermediate_size=IM, num_hidden_layers=LAYERS,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=E,
                                     num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).float().eval()
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert base["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * IM, H)
    gen = torch.Generator().manual_seed(19)
    t = {}
    for layer in range(LAYERS):
        for e in range(E):
            for leaf, (fin, fout) in (("w1", (H, IM)), ("w3", (H, IM)), ("w2", (IM, H))):
                key = f"{PEFT}.{layer}.block_sparse_moe.experts.{e}.{leaf}"
                t[f"{key}.lora_A.weight"] = _rnd(gen, R, fin)
                t[f"{key}.lora_B.weight"] = _rnd(gen, fout, R)
    src = _write(tmp_path / "v4", t, _config(["w1", "w2", "w3"], task_type="CAUSAL_LM"))
    with warnings.catch_warnings():  # PEFT warns that its own fused-rank patterns match no module here
        warnings.simplefilter("ignore")
        reference = peft.PeftModel.from_pretrained(model, src).merge_and_unload().state_dict()
    ours = merged(base, src)
    changed = [k for k in base if not torch.equal(base[k], reference[k])]
    assert sorted(changed) == sorted(k for k in base if ".experts." in k)
    for k in base:
        torch.testing.assert_close(ours[k], reference[k], rtol=0, atol=1e-5)


# -- the way out, as `lorafast preflight sglang` prints it -------------------------------------------------------


def test_preflight_groups_consequential_problems() -> None:
    from lorafast.cli._way_out import grouped_lines

    dim = {"code": "sglang_expert_dim", "type": "ValueError", "fatal": True, "adapter_name": "b",
           "message": "experts_shared_outer_loras is enabled but gate_up_proj_moe lora_A has expert_dim=4 (expected 1)."}  # fmt: skip
    mixed = {"code": "sglang_mixed_shared_outer", "type": "RuntimeError", "fatal": True, "message": "Mixed ..."}
    lines = grouped_lines([mixed, *[dim] * 48, {**dim, "adapter_name": "c"}])
    assert lines == [
        "error [-] RuntimeError: Mixed ...",
        f"error [b] ValueError: {dim['message']} (48 times; --json lists each)",
        f"error [c] ValueError: {dim['message']}",
    ]


def test_preflight_prints_the_way_out_and_it_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from lorafast.cli import main

    shared = stacked_adapter(tmp_path / "shared", 20, shared_outer=True, attn=False)
    stacked = stacked_adapter(tmp_path / "stacked", 21, shared_outer=False, attn=False)
    assert main(["preflight", "sglang", f"a={shared}", stacked]) == 1
    out = capsys.readouterr().out
    assert "Mixed shared-outer LoRA formats" in out
    way = out[out.index("way out:") :].splitlines()
    assert f"split the set across 2 servers:  lorafast groups {shared} {stacked}" in way[1]
    commands = [shlex.split(line.strip()) for line in way[3:]]
    assert [c[:2] for c in commands] == [["lorafast", "convert"], ["lorafast", "preflight"]]
    convert, recheck = commands  # the printed commands, run as printed
    assert main(convert[1:]) == 0
    capsys.readouterr()
    # the re-check passes every start-up check; without --base-config the first-use ones are undecided (exit 1)
    assert main(recheck[1:]) == 1
    out = capsys.readouterr().out
    assert "Mixed shared-outer" not in out and out.splitlines()[-1].startswith("unknown: the start-up checks pass")


def test_plan_groups_converts_only_when_it_saves_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = stacked_adapter(tmp_path / "in" / "shared", 22, shared_outer=True, attn=False)
    stacked = stacked_adapter(tmp_path / "in" / "stacked", 23, shared_outer=False, attn=False)
    plan = lorafast.plan_groups([shared, stacked], convert=True, convert_out=tmp_path / "converted")
    assert len(plan.groups) == 1 and plan.groups[0].preflight == "passed (start-up only)"
    (step,) = plan.conversions
    assert (step.adapter, step.from_layout, step.to_layout) == (shared, "shared_outer", "stacked_3d")
    assert step.cost_bytes > 0 and os.path.isdir(step.out)
    assert step.out in plan.groups[0].command() and shared not in plan.groups[0].command()
    # two per-expert adapters already share a server: nothing to convert, nothing written
    other = stacked_adapter(tmp_path / "in" / "other", 24, shared_outer=False, attn=False)
    plain = lorafast.plan_groups([stacked, other], convert=True, convert_out=tmp_path / "none")
    assert len(plain.groups) == 1 and plain.conversions == ()
    assert not (tmp_path / "none").exists()
    # one adapter per server: converting saves nothing, so it is undone
    capped = lorafast.plan_groups([shared, stacked], convert=True, convert_out=tmp_path / "capped", max_per_group=1)
    assert len(capped.groups) == 2 and capped.conversions == ()
    assert not (tmp_path / "capped").exists()
    # the CLI: lorafast groups --convert --out DIR
    from lorafast.cli import main

    assert main(["groups", shared, stacked, "--convert", "--out", str(tmp_path / "cli"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["groups"]) == 1 and got["conversions"][0]["out"].startswith(str(tmp_path / "cli"))


def test_failure_while_writing_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafast.converting import bits
    from lorafast.tensors import TensorFile, TruncatedFileError

    src = stacked_adapter(tmp_path / "shared", 25, shared_outer=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("kept")
    calls = [0]
    real_array = bits.array

    def failing_array(tf: TensorFile, name: str) -> object:
        calls[0] += 1
        if calls[0] == 3:  # the file shrinks under us half-way through the output
            raise TruncatedFileError(f"{tf.path}: file was truncated", tf.path)
        return real_array(tf, name)

    monkeypatch.setattr(bits, "array", failing_array)
    with pytest.raises(ConvertError) as info:
        convert(src, "stacked_3d", out, overwrite=True)
    assert info.value.code == "truncated" and calls[0] == 3
    assert _left(tmp_path) == ["out", "shared"] and (out / "old.txt").read_text() == "kept"


def test_failure_in_the_writer_thread_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unchanged bytes are sent by the writer thread while the next tensor is produced: its failure (the source
    truncated between two sends) is raised to the caller, and nothing is left."""
    from lorafast.tensors import TensorFile, TruncatedFileError

    src = target_parameters_adapter(tmp_path / "tp", 26)
    calls = [0]
    threads: list[str] = []
    real = TensorFile.check_size

    def failing_check(self: TensorFile, end: int) -> None:
        calls[0] += 1
        if calls[0] == 4:
            threads.append(threading.current_thread().name)
            raise TruncatedFileError(f"{self.path}: file was truncated", self.path)
        real(self, end)

    monkeypatch.setattr(TensorFile, "check_size", failing_check)
    with pytest.raises(ConvertError) as info:
        convert(src, "stacked_3d", tmp_path / "out")
    assert info.value.code == "truncated" and threads[0].startswith("lorafast-convert-writer")
    assert _left(tmp_path) == ["tp"]
