"""The merge engine on plain torch: math against fp64, exact unmerge, transactions, errors, MoE layouts, DoRA.

Adapters are written as real files (PEFT folders, kohya files, stacked-MoE files) and read back through
`lorafast.inspect`; reference results are computed here in float64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lorafast
import pytest
import torch
from helpers.bits import bits, same_bits
from lorafast.merging import MergeError, MergeHandle, merge
from lorafast.merging import kernel as merge_kernel
from lorafast.planner import LoraRequest
from lorafast.testing import write_peft_adapter
from safetensors.torch import save_file

torch.manual_seed(0)

HIDDEN, INTER, LAYERS = 48, 80, 2
PROJ = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (16, HIDDEN),
    "self_attn.v_proj": (16, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}


# ---------------------------------------------------------------------------------------------------------------
# helpers


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |ref| (float64), for 'at most one ulp' checks."""
    mant, min_exp = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}[dtype]
    e = torch.floor(torch.log2(ref.abs().clamp_min(2.0**min_exp)))
    return torch.pow(2.0, e - mant)


def within_ulps(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, n: float = 1.0) -> bool:
    """|got - ref| <= n ulps of the result plus the fp32 accumulation bound, everywhere."""
    return bool(((got.double() - ref).abs() <= n * ulp(ref, got.dtype) + bound).all())


def state_dict(dtype: torch.dtype = torch.bfloat16, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": torch.randn(64, HIDDEN).to(dtype)}
    for i in range(layers):
        for proj, shape in PROJ.items():
            sd[f"model.layers.{i}.{proj}.weight"] = (torch.randn(shape) * 0.05).to(dtype)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=dtype)
    return sd


def write_peft(
    folder: Path,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    r: int,
    alpha: float,
    extra: dict[str, torch.Tensor] | None = None,
    **config: object,
) -> Path:
    """A PEFT adapter folder: `factors` maps module path -> (lora_A, lora_B)."""
    tensors = {}
    for name, (a, b) in factors.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    tensors.update(extra or {})
    targets = sorted({n.rsplit(".", 1)[-1] for n in factors})
    return Path(
        write_peft_adapter(folder, tensors, **{"r": r, "lora_alpha": alpha, "target_modules": targets, **config})
    )


def random_factors(
    sd: dict[str, torch.Tensor], rank: int, names: list[str] | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for key, w in sd.items():
        name = key.removesuffix(".weight")
        if names is not None and not any(name.endswith(n) for n in names):
            continue
        if w.dim() != 2 or "embed" in key:
            continue
        out[name] = ((torch.randn(rank, w.shape[1]) * 0.3).to(dtype), (torch.randn(w.shape[0], rank) * 0.3).to(dtype))
    return out


def reference(
    sd: dict[str, torch.Tensor], adapters: list[tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]]
) -> dict[str, torch.Tensor]:
    """fp64 W + Σ coef·B@A per weight (`coef` already includes strength and scale)."""
    out = {k: v.double() for k, v in sd.items()}
    for factors, coef in adapters:
        for name, (a, b) in factors.items():
            out[name + ".weight"] += coef * (b.double() @ a.double())
    return out


# ---------------------------------------------------------------------------------------------------------------
# math


def fp32_bound(sd: dict[str, torch.Tensor], adapters: list[tuple[dict, float]]) -> dict[str, torch.Tensor]:
    """The standard forward-error bound of fp32 accumulation: (k + 2)·2⁻²⁴·(|W| + Σ|coef|·|B|@|A|) per element."""
    mag = {k: v.double().abs() for k, v in sd.items()}
    ks = {k: 2 for k in sd}
    for factors, coef in adapters:
        for name, (a, b) in factors.items():
            mag[name + ".weight"] += abs(coef) * (b.double().abs() @ a.double().abs())
            ks[name + ".weight"] += a.shape[0]
    return {k: ks[k] * 2.0**-24 * m for k, m in mag.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_several_adapters_within_one_ulp_of_fp64(tmp_path: Path, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    sd = state_dict(dtype)
    f1 = random_factors(sd, 4)
    f2 = random_factors(sd, 8, ["q_proj", "v_proj", "down_proj"], dtype=torch.bfloat16)
    f3 = random_factors(sd, 2, ["o_proj"])
    a1 = write_peft(tmp_path / "a1", f1, r=4, alpha=8)  # scale 2
    a2 = write_peft(tmp_path / "a2", f2, r=8, alpha=16, use_rslora=True)  # scale 16/sqrt(8)
    a3 = write_peft(tmp_path / "a3", f3, r=2, alpha=1)  # scale 0.5
    adapters = [(f1, 0.7 * 2), (f2, -0.3 * 16 / math.sqrt(8)), (f3, 1.5 * 0.5)]
    ref = reference(sd, adapters)
    bound = fp32_bound(sd, adapters)
    original = {k: v.clone() for k, v in sd.items()}

    handle = merge(sd, [(a1, 0.7), (a2, -0.3), (a3, 1.5)])

    changed = checked = total = 0
    for key, w in sd.items():
        err = (w.double() - ref[key]).abs()
        u = ulp(ref[key], dtype)
        # Where fp32 accumulation error cannot reach half an ulp of the result (all but heavy cancellation),
        # the result is within one ulp of the fp64 reference; everywhere, within an ulp plus that error.
        clear = bound[key] < 0.5 * u
        assert bool((err[clear] <= u[clear]).all()), f"{key}: {(err / u)[clear].max().item()} ulp"
        assert bool((err <= u + bound[key]).all()), key
        checked += int(clear.sum())
        total += err.numel()
        changed += not same_bits(w, original[key])
    assert checked > 0.99 * total
    assert changed == LAYERS * len(PROJ)
    assert same_bits(sd["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert isinstance(handle, MergeHandle) and handle.merged

    handle.unmerge()
    for key, w in sd.items():
        assert same_bits(w, original[key]), key


def test_accumulates_in_fp32_and_rounds_once(tmp_path: Path) -> None:
    # Two deltas of 0.4 ulp each: rounding after each adapter (PEFT) leaves W unchanged, one final rounding moves it.
    w = torch.ones(4, 4, dtype=torch.bfloat16)
    tiny = 0.4 * 2.0**-7  # bf16 ulp at 1.0 is 2**-7
    a = torch.zeros(1, 4)
    a[0] = 1.0
    b = torch.full((4, 1), tiny)
    f = {"m": (a, b)}
    sd = {"m.weight": w}
    merge(sd, [(write_peft(tmp_path / "x", f, r=1, alpha=1), 1.0), (write_peft(tmp_path / "y", f, r=1, alpha=1), 1.0)])
    assert torch.all(sd["m.weight"] == 1.0 + 2.0**-7)


def test_fp32_and_fp64_weights_keep_their_precision(tmp_path: Path) -> None:
    sd = {"m.weight": torch.randn(8, 6, dtype=torch.float64), "n.weight": torch.randn(8, 6, dtype=torch.float32)}
    f = {
        "m": (torch.randn(2, 6, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)),
        "n": (torch.randn(2, 6), torch.randn(8, 2)),
    }
    ref = reference(sd, [(f, 0.5)])
    merge(sd, [(write_peft(tmp_path / "a", f, r=2, alpha=1), 1.0)])
    assert torch.allclose(sd["m.weight"], ref["m.weight"], rtol=1e-13, atol=1e-13)  # fp64 accumulation
    assert torch.allclose(sd["n.weight"].double(), ref["n.weight"], rtol=1e-6, atol=1e-6)


def test_rank_and_alpha_patterns_and_request_alpha(tmp_path: Path) -> None:
    sd = state_dict(torch.float32, layers=1)
    f = random_factors(sd, 4)
    f["model.layers.0.self_attn.q_proj"] = (torch.randn(8, HIDDEN), torch.randn(HIDDEN, 8))
    path = write_peft(
        tmp_path / "a", f, r=4, alpha=8, rank_pattern={"q_proj": 8}, alpha_pattern={"v_proj": 2, "q_proj": 32}
    )
    coef = {name: 8 / 4 for name in f}
    coef["model.layers.0.self_attn.q_proj"] = 32 / 8
    coef["model.layers.0.self_attn.v_proj"] = 2 / 4
    ref = {k: v.double() for k, v in sd.items()}
    for name, (a, b) in f.items():
        ref[name + ".weight"] += coef[name] * (b.double() @ a.double())
    original = {k: v.clone() for k, v in sd.items()}
    h = merge(sd, path)
    for key in ref:
        assert torch.allclose(sd[key].double(), ref[key], atol=1e-5), key
    h.unmerge()
    # a request alpha replaces the config alpha, but not alpha_pattern hits (SGLang's precedence)
    h = merge(sd, [LoraRequest("a", str(path), strength=2.0, alpha=1.0)])
    k_coef = {t.name: t.terms[0].coefficient for t in h.targets}
    assert k_coef["model.layers.0.self_attn.k_proj.weight"] == pytest.approx(2.0 * 1 / 4)
    assert k_coef["model.layers.0.self_attn.v_proj.weight"] == pytest.approx(2.0 * 2 / 4)
    h.unmerge()
    assert all(same_bits(sd[k], original[k]) for k in sd)


def test_fan_in_fan_out_embedding_and_lora_bias(tmp_path: Path) -> None:
    sd = {
        "h.0.attn.c_attn.weight": torch.randn(12, 36),  # GPT-2 Conv1D stores (in, out)
        "h.0.attn.c_attn.bias": torch.randn(36),
        "wte.weight": torch.randn(50, 12),
    }
    a, b = torch.randn(3, 12), torch.randn(36, 3)
    ea, eb = torch.randn(3, 50), torch.randn(12, 3)  # PEFT: lora_embedding_A (r, num_embeddings), B (dim, r)
    bias = torch.randn(36)
    folder = tmp_path / "gpt2"
    write_peft_adapter(
        folder,
        {
            "base_model.model.h.0.attn.c_attn.lora_A.weight": a,
            "base_model.model.h.0.attn.c_attn.lora_B.weight": b,
            "base_model.model.h.0.attn.c_attn.lora_B.bias": bias,
            "base_model.model.wte.lora_embedding_A": ea,
            "base_model.model.wte.lora_embedding_B": eb,
        },
        r=3,
        lora_alpha=6,
        target_modules=["c_attn", "wte"],
        fan_in_fan_out=True,
        lora_bias=True,
    )
    before = {k: v.double() for k, v in sd.items()}
    merge(sd, [(folder, 0.5)])
    s = 0.5 * 2
    assert torch.allclose(
        sd["h.0.attn.c_attn.weight"].double(), before["h.0.attn.c_attn.weight"] + s * (b @ a).T.double(), atol=1e-5
    )
    assert torch.allclose(
        sd["h.0.attn.c_attn.bias"].double(), before["h.0.attn.c_attn.bias"] + s * bias.double(), atol=1e-5
    )
    assert torch.allclose(sd["wte.weight"].double(), before["wte.weight"] + s * (eb @ ea).T.double(), atol=1e-5)


def test_kohya_conv_1x1_3x3_and_linear(tmp_path: Path) -> None:
    sd = {
        "down_blocks.0.attentions.0.proj_in.weight": torch.randn(16, 8, 1, 1),
        "down_blocks.0.resnets.0.conv1.weight": torch.randn(16, 8, 3, 3),
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight": torch.randn(16, 16),
    }
    t = {
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.randn(4, 8, 1, 1),
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.randn(16, 4, 1, 1),
        "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(2.0),
        "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight": torch.randn(4, 8, 3, 3),
        "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight": torch.randn(16, 4, 1, 1),
        "lora_unet_down_blocks_0_resnets_0_conv1.alpha": torch.tensor(0.0),  # 0 means "no alpha": scale 1
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight": torch.randn(4, 16),
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight": torch.randn(16, 4),
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha": torch.tensor(1.0),
    }
    path = tmp_path / "kohya.safetensors"
    save_file(t, str(path))
    before = {k: v.double() for k, v in sd.items()}
    merge(sd, [(path, 0.8)])

    def kohya(prefix: str, scale: float, conv: bool) -> torch.Tensor:
        down, up = t[prefix + ".lora_down.weight"].double(), t[prefix + ".lora_up.weight"].double()
        if not conv:
            return 0.8 * scale * (up @ down)
        if down.shape[2:] == (1, 1):  # sd-scripts merge_to: squeeze, matmul, unsqueeze
            return 0.8 * scale * (up.squeeze(3).squeeze(2) @ down.squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3)
        return 0.8 * scale * torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)

    p = "lora_unet_down_blocks_0_"
    exp = {
        "down_blocks.0.attentions.0.proj_in.weight": kohya(p + "attentions_0_proj_in", 2 / 4, True),
        "down_blocks.0.resnets.0.conv1.weight": kohya(p + "resnets_0_conv1", 1.0, True),
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight": kohya(
            p + "attentions_0_transformer_blocks_0_attn1_to_q", 1 / 4, False
        ),
    }
    for key, delta in exp.items():
        assert torch.allclose(sd[key].double(), before[key] + delta, atol=1e-4), key


# ---------------------------------------------------------------------------------------------------------------
# MoE


def _moe_sd(e: int, h: int, im: int) -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(e, 2 * im, h).bfloat16(),  # (E, out, in)
        "model.layers.0.mlp.experts.down_proj": torch.randn(e, h, im).bfloat16(),
    }


@pytest.mark.parametrize("shared_outer", [False, True])
def test_stacked_3d_and_shared_outer(tmp_path: Path, shared_outer: bool) -> None:
    e, h, im, r = 4, 24, 20, 3
    sd = _moe_sd(e, h, im)
    outer = 1 if shared_outer else e
    pre = "base_model.model.model.layers.0.mlp.experts"
    t = {
        f"{pre}.gate_up_proj.lora_A.weight": torch.randn(outer, r, h),
        f"{pre}.gate_up_proj.lora_B.weight": torch.randn(e, 2 * im, r),
        f"{pre}.down_proj.lora_A.weight": torch.randn(e, r, im),
        f"{pre}.down_proj.lora_B.weight": torch.randn(outer, h, r),
    }
    path = tmp_path / "moe3d.safetensors"
    save_file(t, str(path))
    original = {k: v.clone() for k, v in sd.items()}
    h_ = merge(sd, [(path, 0.5)], chunk_bytes=2 * im * h * 4 * 2)  # two experts per block
    for proj in ("gate_up_proj", "down_proj"):
        a = t[f"{pre}.{proj}.lora_A.weight"].double().expand(e, -1, -1)
        b = t[f"{pre}.{proj}.lora_B.weight"].double().expand(e, -1, -1)
        ref = original[f"model.layers.0.mlp.experts.{proj}"].double() + 0.5 * torch.bmm(b, a)
        got = sd[f"model.layers.0.mlp.experts.{proj}"].double()
        assert bool(((got - ref).abs() <= ulp(ref, torch.bfloat16)).all()), proj
    assert {t.terms[0].form for t in h_.targets} == {"stacked"}
    h_.unmerge()
    assert all(same_bits(sd[k], original[k]) for k in sd)


def test_per_expert_2d(tmp_path: Path) -> None:
    sd = {f"model.layers.0.mlp.experts.{i}.w1.weight": torch.randn(12, 8) for i in range(3)}
    f = {f"model.layers.0.mlp.experts.{i}.w1": (torch.randn(2, 8), torch.randn(12, 2)) for i in range(3)}
    ref = reference(sd, [(f, 0.25 * 1.0)])
    h = merge(sd, [(write_peft(tmp_path / "e", f, r=2, alpha=2), 0.25)])
    assert {m.kind for s in h.sources for m in s.adapter.modules} == {"expert_2d"}
    for k in sd:
        assert torch.allclose(sd[k].double(), ref[k], atol=1e-5)


def test_target_parameters_reshape(tmp_path: Path) -> None:
    """PEFT ParamWrapper layout: A (r·E, in) rows expert-major, B (out, r·E) columns rank-major."""
    e, h, im, r = 3, 10, 6, 2
    sd = _moe_sd(e, h, im)
    sd = {k: v.float() for k, v in sd.items()}
    a_gu, b_gu = torch.randn(r * e, h), torch.randn(2 * im, r * e)
    a_dn, b_dn = torch.randn(r * e, im), torch.randn(h, r * e)
    folder = tmp_path / "tp"
    pre = "base_model.model.model.layers.0.mlp.experts"
    write_peft_adapter(
        folder,
        {
            f"{pre}.base_layer.lora_A.weight": a_gu,
            f"{pre}.base_layer.lora_B.weight": b_gu,
            f"{pre}.lora_A.weight": a_dn,
            f"{pre}.lora_B.weight": b_dn,
        },
        r=r,
        lora_alpha=4,
        target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    before = {k: v.double() for k, v in sd.items()}
    merge(sd, folder)
    for proj, a, b in (("gate_up_proj", a_gu, b_gu), ("down_proj", a_dn, b_dn)):
        delta = torch.zeros_like(before[f"model.layers.0.mlp.experts.{proj}"])
        for x in range(e):  # expert x uses A rows x*r..x*r+r and B columns j*E + x
            delta[x] = b.double()[:, [j * e + x for j in range(r)]] @ a.double()[x * r : (x + 1) * r]
        exp = before[f"model.layers.0.mlp.experts.{proj}"] + (4 / r) * delta
        assert torch.allclose(sd[f"model.layers.0.mlp.experts.{proj}"].double(), exp, atol=1e-5), proj


# ---------------------------------------------------------------------------------------------------------------
# DoRA


def test_dora_follows_peft_formula_after_a_plain_adapter(tmp_path: Path) -> None:
    sd = {"l.weight": torch.randn(10, 8, dtype=torch.float64)}
    w0 = sd["l.weight"].clone()
    a1, b1 = torch.randn(2, 8, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    a2, b2 = torch.randn(2, 8, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    mag = torch.rand(10, dtype=torch.float64) + 0.5
    plain = write_peft(tmp_path / "p", {"l": (a1, b1)}, r=2, alpha=2)
    dora = write_peft(
        tmp_path / "d",
        {"l": (a2, b2)},
        r=2,
        alpha=4,
        use_dora=True,
        extra={"base_model.model.l.lora_magnitude_vector": mag},
    )
    merge(sd, [(plain, 0.5), (dora, 1.0)], chunk_bytes=3 * 8 * 8 * 3)  # 3 rows per block
    d1 = 0.5 * (b1 @ a1)
    d2 = 2.0 * (b2 @ a2)
    norm = torch.linalg.vector_norm(w0 + d2, dim=1, keepdim=True)  # norm of the *unmerged* base + this delta
    expected = (mag.view(-1, 1) / norm) * (w0 + d1 + d2)
    assert torch.allclose(sd["l.weight"], expected, rtol=1e-12, atol=1e-12)


def test_dora_refused_in_subtract_mode_and_kohya_dora_refused(tmp_path: Path) -> None:
    sd = {"l.weight": torch.randn(4, 4)}
    before = sd["l.weight"].clone()
    dora = write_peft(
        tmp_path / "d",
        {"l": (torch.randn(1, 4), torch.randn(4, 1))},
        r=1,
        alpha=1,
        extra={"base_model.model.l.lora_magnitude_vector": torch.ones(4)},
    )
    with pytest.raises(MergeError, match="subtraction") as ei:
        merge(sd, dora, snapshot="subtract")
    assert ei.value.code == "unsupported"
    path = tmp_path / "k.safetensors"
    save_file(
        {
            "lora_unet_l.lora_down.weight": torch.randn(1, 4),
            "lora_unet_l.lora_up.weight": torch.randn(4, 1),
            "lora_unet_l.dora_scale": torch.ones(1, 4),
        },
        str(path),
    )
    with pytest.raises(MergeError, match="dora_scale"):
        merge(sd, path)
    assert same_bits(sd["l.weight"], before)


# ---------------------------------------------------------------------------------------------------------------
# transactions and errors


def test_failure_half_way_restores_every_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = state_dict(torch.bfloat16)
    original = {k: v.clone() for k, v in sd.items()}
    path = write_peft(tmp_path / "a", random_factors(sd, 4), r=4, alpha=4)
    real_run = merge_kernel.run
    calls = {"n": 0}

    def failing_run(*args, **kwargs):  # fail inside the 9th weight, after some of its blocks were written
        calls["n"] += 1
        if calls["n"] == 9:
            kwargs["budget"] = 4 * HIDDEN * 4  # small blocks, so the failure lands mid-weight
            done = kwargs["done"]
            real_run(*args, **{**kwargs, "progress": None})
            assert len(done) > 1
            raise RuntimeError("injected failure")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(merge_kernel, "run", failing_run)
    with pytest.raises(MergeError) as ei:
        merge(sd, [(path, 1.0)])
    err = ei.value
    assert err.code == "failed" and err.restored
    assert err.module is not None and err.module in str(err) and "'a'" in str(err)
    assert "injected failure" in str(err) and "bit for bit" in str(err)
    assert calls["n"] == 9
    for key in sd:
        assert same_bits(sd[key], original[key]), key


def test_nan_half_way_restores_and_names_module_and_adapter(tmp_path: Path) -> None:
    sd = state_dict(torch.bfloat16)
    original = {k: v.clone() for k, v in sd.items()}
    good = write_peft(tmp_path / "good", random_factors(sd, 2), r=2, alpha=2)
    f = random_factors(sd, 2, ["layers.1.mlp.down_proj"])
    f["model.layers.1.mlp.down_proj"][1][3, 0] = float("nan")
    bad = write_peft(tmp_path / "bad", f, r=2, alpha=2)
    with pytest.raises(MergeError) as ei:
        merge(sd, [(good, 1.0), (bad, 1.0)])
    assert ei.value.code == "non_finite"
    assert ei.value.module == "model.layers.1.mlp.down_proj" and ei.value.adapter == "bad"
    assert all(same_bits(sd[k], original[k]) for k in sd)


def test_overflow_to_inf_is_caught_after_the_cast(tmp_path: Path) -> None:
    sd = {"a.weight": torch.randn(8, 8).half(), "b.weight": torch.randn(8, 8).half()}
    original = {k: v.clone() for k, v in sd.items()}
    f = {"a": (torch.ones(1, 8), torch.ones(8, 1)), "b": (torch.ones(1, 8), torch.full((8, 1), 1e5))}  # > fp16 max
    with pytest.raises(MergeError) as ei:
        merge(sd, write_peft(tmp_path / "x", f, r=1, alpha=1))
    assert ei.value.code == "non_finite" and ei.value.module == "b.weight"
    assert all(same_bits(sd[k], original[k]) for k in sd)
    # safe=False lets it through (PEFT's unsafe merge does the same)
    h = merge(sd, write_peft(tmp_path / "y", f, r=1, alpha=1), safe=False)
    assert torch.isinf(sd["b.weight"]).all()
    h.unmerge()
    assert all(same_bits(sd[k], original[k]) for k in sd)


def test_keyboard_interrupt_restores_and_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = state_dict(torch.float16, layers=1)
    original = {k: v.clone() for k, v in sd.items()}
    path = write_peft(tmp_path / "a", random_factors(sd, 2), r=2, alpha=2)
    real_run = merge_kernel.run
    calls = {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)

    monkeypatch.setattr(merge_kernel, "run", interrupting)
    with pytest.raises(KeyboardInterrupt):
        merge(sd, path)
    assert all(same_bits(sd[k], original[k]) for k in sd)


def test_preflight_errors_touch_nothing(tmp_path: Path) -> None:
    sd = state_dict(torch.bfloat16, layers=1)
    original = {k: v.clone() for k, v in sd.items()}
    f = random_factors(sd, 2)
    f["model.layers.0.mlp.nonexistent"] = (torch.randn(2, 4), torch.randn(4, 2))
    with pytest.raises(MergeError) as ei:
        merge(sd, [(write_peft(tmp_path / "m", f, r=2, alpha=2), 1.0)])
    assert ei.value.code == "missing_module"
    assert ei.value.module == "model.layers.0.mlp.nonexistent" and ei.value.adapter == "m"
    assert "no weight was changed" in str(ei.value)

    g = random_factors(sd, 2)
    g["model.layers.0.self_attn.k_proj"] = (torch.randn(2, HIDDEN), torch.randn(HIDDEN, 2))  # k_proj has 16 rows
    with pytest.raises(MergeError) as ei:
        merge(sd, [(write_peft(tmp_path / "s", g, r=2, alpha=2), 1.0)])
    assert ei.value.code == "shape_mismatch" and ei.value.module == "model.layers.0.self_attn.k_proj"
    assert "[16, 48]" in str(ei.value)
    assert all(same_bits(sd[k], original[k]) for k in sd)


def test_meta_device_and_wrong_dtypes(tmp_path: Path) -> None:
    f = {"lin": (torch.randn(2, 4), torch.randn(4, 2))}
    path = write_peft(tmp_path / "a", f, r=2, alpha=2)
    with torch.device("meta"):
        model = torch.nn.Module()
        model.lin = torch.nn.Linear(4, 4)
    with pytest.raises(MergeError, match="meta device") as ei:
        merge(model, path)
    assert ei.value.code == "meta_device"

    with pytest.raises(MergeError, match=r"dtype torch\.int8") as ei:
        merge({"lin.weight": torch.zeros(4, 4, dtype=torch.int8)}, path)
    assert ei.value.code == "dtype"

    int_folder = tmp_path / "int"
    int_folder.mkdir()
    save_file(
        {
            "base_model.model.lin.lora_A.weight": torch.zeros(2, 4, dtype=torch.int32),
            "base_model.model.lin.lora_B.weight": torch.zeros(4, 2, dtype=torch.int32),
        },
        str(int_folder / "adapter_model.safetensors"),
    )
    w = torch.randn(4, 4)
    with pytest.raises(MergeError, match="I32") as ei:
        merge({"lin.weight": w}, int_folder)
    assert ei.value.code == "dtype"


def test_unsupported_variants_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "loha.safetensors"
    save_file(
        {
            "lora_unet_l.hada_w1_a": torch.randn(4, 2),
            "lora_unet_l.hada_w1_b": torch.randn(2, 4),
            "lora_unet_l.hada_w2_a": torch.randn(4, 2),
            "lora_unet_l.hada_w2_b": torch.randn(2, 4),
            "lora_unet_l.alpha": torch.tensor(2.0),
        },
        str(path),
    )
    with pytest.raises(MergeError, match="loha") as ei:
        merge({"l.weight": torch.randn(4, 4)}, path)
    assert ei.value.code == "unsupported"


# ---------------------------------------------------------------------------------------------------------------
# modules, handles, requests, memory


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"q_proj": torch.nn.Linear(HIDDEN, HIDDEN)})])


def test_module_prefixes_are_matched_only_when_allowed(tmp_path: Path) -> None:
    # adapter made on a CausalLM ("model.layers.0.q_proj"), merged into the inner model ("layers.0.q_proj"):
    # no weight has the adapter's exact path, so it is refused unless allow_prefix=True, as check reports it
    inner = _Tiny().to(torch.bfloat16)
    f = {"model.layers.0.q_proj": (torch.randn(2, HIDDEN), torch.randn(HIDDEN, 2))}
    before = inner.layers[0]["q_proj"].weight.detach().clone()
    path = write_peft(tmp_path / "a", f, r=2, alpha=2)
    with pytest.raises(MergeError) as err:
        merge(inner, [(path, 1.0)])
    assert err.value.code == "prefix_only" and err.value.module == "model.layers.0.q_proj"
    assert "'layers.0.q_proj.weight'" in str(err.value) and "start with 'model.' where the base has no prefix" in str(
        err.value
    )
    assert same_bits(inner.layers[0]["q_proj"].weight.detach(), before)
    h = merge(inner, [(path, 1.0)], allow_prefix=True)
    assert h.prefixes == [{"adapter": "a", "adapter_prefix": "model", "base_prefix": "", "modules": 1}]
    assert [t.name for t in h.targets] == ["layers.0.q_proj.weight"]
    assert not same_bits(inner.layers[0]["q_proj"].weight.detach(), before)
    assert inner.layers[0]["q_proj"].weight.requires_grad  # still a trainable Parameter
    h.unmerge()
    assert same_bits(inner.layers[0]["q_proj"].weight.detach(), before)


def test_handle_records_context_manager_and_stale_guard(tmp_path: Path) -> None:
    model = _Tiny()
    f = {"layers.0.q_proj": (torch.randn(2, HIDDEN), torch.randn(HIDDEN, 2))}
    path = write_peft(tmp_path / "rec", f, r=2, alpha=4)
    w = model.layers[0]["q_proj"].weight
    before = w.detach().clone()
    with merge(model, [(path, 0.25)]) as h:
        (t,) = h.targets
        assert t.name == "layers.0.q_proj.weight" and t.shape == (HIDDEN, HIDDEN) and t.dtype == "float32"
        assert t.terms[0].adapter == "rec" and t.terms[0].strength == 0.25
        assert t.terms[0].coefficient == pytest.approx(0.25 * 4 / 2)
        info = json.loads(json.dumps(h.to_dict()))
        assert info["merged"] and info["adapters"][0]["strength"] == 0.25
        assert h.snapshot_bytes == HIDDEN * HIDDEN * 4
    assert not h.merged and same_bits(w.detach(), before)

    h = merge(model, [(path, 1.0)])
    with torch.no_grad():
        w[0, 0] += 1.0  # someone trains on, after the merge
    with pytest.raises(MergeError) as ei:
        h.unmerge()
    assert ei.value.code == "stale" and not ei.value.restored
    h.unmerge(force=True)
    assert same_bits(w.detach(), before)
    with pytest.raises(MergeError) as ei:
        h.unmerge()
    assert ei.value.code == "not_merged"

    h = merge(model, [(path, 1.0)])
    h.commit()
    assert h.snapshot_bytes == 0 and not same_bits(w.detach(), before)


def test_snapshot_modes(tmp_path: Path) -> None:
    sd = state_dict(torch.bfloat16, layers=1)
    original = {k: v.clone() for k, v in sd.items()}
    f = random_factors(sd, 4)
    path = write_peft(tmp_path / "a", f, r=4, alpha=8)
    h = merge(sd, path, snapshot="device")
    h.unmerge()
    assert all(same_bits(sd[k], original[k]) for k in sd)

    h = merge(sd, path, snapshot="subtract")
    assert h.snapshot_bytes == 0
    merged = {k: v.clone() for k, v in sd.items()}
    h.unmerge()
    # lossy: two roundings, each within half an ulp of the merged / restored value, plus fp32 accumulation error
    bound = fp32_bound(original, [(f, 2.0)])
    for k in sd:
        slack = ulp(merged[k].double(), torch.bfloat16) + 2 * bound[k]
        assert within_ulps(sd[k], original[k].double(), slack), k
    assert sum(not same_bits(sd[k], original[k]) for k in sd) <= len(sd)
    with pytest.raises(MergeError, match="snapshot must be"):
        merge(sd, path, snapshot="gpu")


def test_workspace_is_bounded_by_chunk_bytes(tmp_path: Path) -> None:
    sd = {"big.weight": torch.randn(512, 256).bfloat16()}
    f = {"big": (torch.randn(8, 256), torch.randn(512, 8))}
    path = write_peft(tmp_path / "a", f, r=8, alpha=8)
    ref, bound = reference(sd, [(f, 1.0)]), fp32_bound(sd, [(f, 1.0)])
    h = merge(sd, path, chunk_bytes=16 * 256 * 4)  # 16 fp32 rows of the 512-row weight
    assert 0 < h.peak_workspace_bytes <= 16 * 256 * 4
    assert within_ulps(sd["big.weight"], ref["big.weight"], bound["big.weight"])


def test_requests_plans_and_adapter_objects(tmp_path: Path) -> None:
    sd = state_dict(torch.float32, layers=1)
    original = {k: v.clone() for k, v in sd.items()}
    f1, f2 = random_factors(sd, 2), random_factors(sd, 2, ["q_proj"])
    p1, p2 = write_peft(tmp_path / "one", f1, r=2, alpha=2), write_peft(tmp_path / "two", f2, r=2, alpha=4)
    ref = reference(sd, [(f1, 0.5), (f2, 2.0 * 2)])

    def check() -> None:
        for k in sd:
            assert torch.allclose(sd[k].double(), ref[k], atol=1e-5), k

    forms = [
        [(str(p1), 0.5), (p2, 2.0)],
        [LoraRequest("one", str(p1), 0.5), LoraRequest("two", str(p2), 2.0)],
        [(lorafast.inspect(str(p1)), 0.5), (lorafast.inspect(str(p2)), 2.0)],
        lorafast.plan([LoraRequest("one", str(p1), 0.5), LoraRequest("two", str(p2), 2.0)], merge_mode="merge"),
    ]
    for form in forms:
        h = merge(sd, form)
        check()
        assert [s.nickname for s in h.sources] == ["one", "two"]
        h.unmerge()
        assert all(same_bits(sd[k], original[k]) for k in sd)
    # a single path (strength 1) works too; nonsense does not
    merge(sd, p1).unmerge()
    with pytest.raises(MergeError) as ei:
        merge(sd, [])
    assert ei.value.code == "bad_request"
    with pytest.raises(MergeError):
        merge(object(), p1)


def test_lorafast_merge_is_the_function_after_importing_the_package(tmp_path: Path) -> None:
    import lorafast.merging as pkg

    sd = {"lin.weight": torch.randn(4, 4)}
    path = write_peft(tmp_path / "a", {"lin": (torch.randn(1, 4), torch.randn(4, 1))}, r=1, alpha=1)
    assert lorafast.merge is pkg.merge
    h = lorafast.merge(sd, path)
    assert isinstance(h, MergeHandle)
    h.unmerge()


def test_fused_bf16_gemm_path_matches_the_fp32_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path (one bf16 GEMM per block, factors split in three bf16 parts, fp32 accumulation), run
    on CPU here: same results as the fp32 kernel within the same bound, exact unmerge, NaN rollback."""
    torch.manual_seed(3)
    sd = state_dict(torch.bfloat16)
    f1, f2 = random_factors(sd, 4), random_factors(sd, 8, dtype=torch.bfloat16)
    a1 = write_peft(tmp_path / "a1", f1, r=4, alpha=8)
    a2 = write_peft(tmp_path / "a2", f2, r=8, alpha=16, use_rslora=True)
    adapters = [(f1, 0.7 * 2), (f2, -0.3 * 16 / math.sqrt(8))]
    ref, bound = reference(sd, adapters), fp32_bound(sd, adapters)
    original = {k: v.clone() for k, v in sd.items()}
    plain = {k: v.clone() for k, v in sd.items()}
    merge(plain, [(a1, 0.7), (a2, -0.3)])

    monkeypatch.setattr(merge_kernel, "FUSED_DEVICES", {"cpu"})
    calls = {"fused": 0}
    real = merge_kernel.run_fused

    def counting(*args, **kwargs):
        calls["fused"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_kernel, "run_fused", counting)
    h = merge(sd, [(a1, 0.7), (a2, -0.3)], chunk_bytes=8 * HIDDEN * 2)
    assert calls["fused"] == LAYERS * len(PROJ)
    differing = 0
    for k in sd:
        assert within_ulps(sd[k], ref[k], bound[k]), k
        differing += int((bits(sd[k]) != bits(plain[k])).sum())
    assert differing < 1e-3 * sum(v.numel() for v in sd.values())
    h.unmerge()
    assert all(same_bits(sd[k], original[k]) for k in sd)

    bad = random_factors(sd, 2, ["layers.1.mlp.up_proj"])
    bad["model.layers.1.mlp.up_proj"][1][0, 0] = 1e38  # finite factors, infinite product
    bad["model.layers.1.mlp.up_proj"][0][0, :] = 1e3
    with pytest.raises(MergeError) as ei:
        merge(sd, [(a1, 1.0), (write_peft(tmp_path / "bad", bad, r=2, alpha=2), 1.0)])
    assert ei.value.code == "non_finite" and ei.value.module == "model.layers.1.mlp.up_proj.weight"
    assert all(same_bits(sd[k], original[k]) for k in sd)


def test_pipeline_components_follow_request_targets(tmp_path: Path) -> None:
    t1, t2 = _Tiny(), _Tiny()
    w1, w2 = t1.layers[0]["q_proj"].weight, t2.layers[0]["q_proj"].weight
    before1, before2 = w1.detach().clone(), w2.detach().clone()
    path = write_peft(
        tmp_path / "a", {"layers.0.q_proj": (torch.randn(2, HIDDEN), torch.randn(HIDDEN, 2))}, r=2, alpha=2
    )
    h = merge({"transformer": t1, "transformer_2": t2}, [LoraRequest("a", str(path), 1.0, target="transformer_2")])
    assert [t.name for t in h.targets] == ["transformer_2:layers.0.q_proj.weight"]
    assert same_bits(w1.detach(), before1) and not same_bits(w2.detach(), before2)
    h.unmerge()
    h = merge({"transformer": t1, "transformer_2": t2}, [LoraRequest("a", str(path), 1.0, target="all")])
    assert len(h.targets) == 2
    h.unmerge()
    assert same_bits(w1.detach(), before1) and same_bits(w2.detach(), before2)
    with pytest.raises(MergeError, match="none of the components"):
        merge(t1, [LoraRequest("a", str(path), 1.0, target="critic")])
