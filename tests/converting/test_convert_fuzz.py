"""Differential fuzz of `lorafast.convert` against merge equality.

Random kohya files (modules of every component, SDXL's two text encoders on one module path, ranks, alphas of
every kind, names of unknown architectures) go to PEFT folders, and PEFT itself loads each folder: every module
must have kohya's rank, scale and delta weight, bit for bit. Random PEFT MoE adapters (every layout, expert
counts, ranks, layers, `lora_alpha`, `alpha_pattern`, rsLoRA) go to every layout they convert to, and the source
and the output merged with `lorafast.merge` into one tiny base must give the same bits. A refusal is allowed (a
`ConvertError` with a listed code, nothing left behind); a wrong result or any other exception is not.

The suite runs a short pass with a fixed seed; `LORAFAST_FUZZ_CASES=N` runs N inputs per harness (and
`LORAFAST_FUZZ_SEED` picks the seed; without it the pass is derandomized): tests/helpers/fuzzing.py.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("peft")

import lorafast  # noqa: E402
from helpers.fuzzing import fuzz  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from lorafast import ConvertError, convert  # noqa: E402
from lorafast.converting import CONVERT_ERROR_CODES  # noqa: E402
from lorafast.converting.api import _FROM  # noqa: E402
from lorafast.naming import strip_prefixes  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_convert import (  # noqa: E402
    H,
    assert_bit_identical,
    fused_base,
    merged,
    numbered_adapter,
    stacked_adapter,
    target_parameters_adapter,
    write_kohya,
)
from test_convert_kohya import kohya_deltas, peft_deltas  # noqa: E402

pytestmark = pytest.mark.fuzz


def _refused(exc: ConvertError, work: Path, stats: Counter[str]) -> None:
    assert exc.code in CONVERT_ERROR_CODES, exc
    assert not (work / "out").exists() and not [p for p in os.listdir(work) if p.startswith(".lorafast")]
    stats[f"refused {exc.code}"] += 1


# -- kohya -> PEFT, checked by PEFT --------------------------------------------------------------------------

#: kohya module paths without their component: CLIP layers, SD and SDXL (sgm) UNet blocks, diffusers-named
#: transformers, and an architecture in no table (kept flattened)
_TE = [
    f"text_model_encoder_layers_{i}_{m}" for i in (0, 1) for m in ("self_attn_q_proj", "self_attn_out_proj", "mlp_fc1")
]
_UNET = ["down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q", "mid_block_attentions_0_proj_in",
         "up_blocks_1_resnets_0_time_emb_proj", "input_blocks_4_1_transformer_blocks_0_attn2_to_k",
         "middle_block_1_proj_out", "output_blocks_2_1_transformer_blocks_1_ff_net_2"]  # fmt: skip
_TRANSFORMER = ["transformer_blocks_0_attn_to_q", "single_transformer_blocks_1_proj_mlp", "layers_0_attention_qkv"]
#: kohya module key -> its path without the component (what a kohya file merges by)
_FLAT = {
    **{f"lora_{te}_{m}": m for te in ("te", "te1", "te2") for m in _TE},
    **{f"lora_unet_{m}": m for m in _UNET},
    **{f"lora_transformer_{m}": m for m in _TRANSFORMER},
}
_KOHYA_MODULES = list(_FLAT)
_ALPHA = st.one_of(
    st.none(),  # no `.alpha`: alpha = rank
    st.just(0.0),  # sd-scripts: alpha = rank
    st.floats(0.125, 64, width=32),
    st.integers(1, 16).map(float),
)


@st.composite
def kohya_files(draw: st.DrawFn) -> dict[str, tuple[int, float | None]]:
    # `te` and `te1` both name the first text encoder: a file with both on one module path is refused
    names = draw(st.lists(st.sampled_from(_KOHYA_MODULES), min_size=1, max_size=8, unique=True))
    return {n: (draw(st.integers(1, 8)), draw(_ALPHA)) for n in names}


def test_kohya_to_peft_matches_peft_and_merges_exactly() -> None:
    stats: Counter[str] = Counter()

    @fuzz(50)
    @given(kohya_files(), st.integers(0, 2**31 - 1))
    def one(modules: dict[str, tuple[int, float | None]], data_seed: int) -> None:
        stats["inputs"] += 1
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            src = write_kohya(work / "k", {k: ((r, H), (H, r), a) for k, (r, a) in modules.items()}, data_seed % 1000)
            shared = {_FLAT[k] for k in modules if k.startswith("lora_te_")} & {
                _FLAT[k] for k in modules if k.startswith("lora_te1_")
            }
            try:
                res = convert(src, "peft", work / "out")
            except ConvertError as exc:
                _refused(exc, work, stats)
                assert shared and "would both be written" in str(exc), exc  # the one refusal expected here
                return
            assert not shared
            theirs, ours = peft_deltas(res.out), kohya_deltas(src)
            assert len(theirs) == len(ours)
            a_of, down_of = load_file(res.files[0]), load_file(src)
            pairs = {}  # kohya module -> the output module holding its lora_down (random data: exactly one)
            for key, (rank, scale, delta) in ours.items():
                down = down_of[f"{key}.lora_down.weight"]
                [name] = [n for n in theirs if torch.equal(a_of[f"{n}.lora_A.weight"], down)]
                assert theirs[name][:2] == (rank, scale), (key, name)
                assert torch.equal(theirs[name][2], delta), (key, name)
                pairs[key] = strip_prefixes(name)
            stats["converted"] += 1
            # lorafast.merge of each into one set of weights, named as each resolves (kohya by its flattened
            # path, the folder by the dotted one). lorafast reads patterns on the prefix-free name, so only where
            # no two modules share one (SDXL's encoders can; PEFT, above, tells them apart)
            if len(set(pairs.values())) < len(pairs) or len({_FLAT[k] for k in pairs}) < len(pairs):
                return
            gen = torch.Generator().manual_seed(data_seed)
            weights = {k: torch.randn(H, H, generator=gen) for k in pairs}
            a = merged({f"{_FLAT[k]}.weight": w for k, w in weights.items()}, src)
            b = merged({f"{pairs[k]}.weight": w for k, w in weights.items()}, res.out)
            for k in pairs:
                assert torch.equal(a[f"{_FLAT[k]}.weight"], b[f"{pairs[k]}.weight"]), k
            stats["merged"] += 1

    one()
    print(f"\nkohya -> peft fuzz: {dict(stats)}")
    assert stats["converted"] > 0


# -- MoE layouts, checked by merging ---------------------------------------------------------------------------

_PATTERN_KEYS = ["q_proj", "gate_up_proj", "down_proj", "layers.0.self_attn.q_proj", "mlp.experts.gate_up_proj",
                 "mlp.experts.down_proj", "gate_proj", "up_proj", "layers.1.mlp.experts.down_proj"]  # fmt: skip
_LAYOUTS = ["shared_outer", "stacked_3d", "stacked_identical", "per_expert_2d", "per_expert_2d_mixtral",
            "peft_target_parameters"]  # fmt: skip


@st.composite
def moe_adapters(draw: st.DrawFn) -> dict[str, Any]:
    alpha = st.one_of(st.integers(1, 32), st.floats(0.25, 32, width=32))
    config: dict[str, Any] = {"lora_alpha": draw(alpha), "use_rslora": draw(st.booleans())}
    keys = draw(st.lists(st.sampled_from(_PATTERN_KEYS), max_size=3, unique=True))
    if keys:
        config["alpha_pattern"] = {k: draw(alpha) for k in keys}
    return {
        "layout": draw(st.sampled_from(_LAYOUTS)),
        "e": draw(st.integers(2, 4)),
        "r": draw(st.integers(1, 4)),
        "layers": draw(st.integers(1, 2)),
        "attn": draw(st.booleans()),
        "config": config,
        "seed": draw(st.integers(0, 1000)),
    }


def _write_moe(folder: Path, a: dict[str, Any]) -> str:
    shape = {"e": a["e"], "r": a["r"], "layers": a["layers"], "config": a["config"]}
    layout = a["layout"]
    if layout == "peft_target_parameters":
        return target_parameters_adapter(folder, a["seed"], **shape)
    if layout.startswith("per_expert_2d"):
        return numbered_adapter(folder, a["seed"], layout.endswith("mixtral"), a["attn"], **shape)
    return stacked_adapter(
        folder, a["seed"], layout == "shared_outer", layout == "stacked_identical", a["attn"], **shape
    )


def test_moe_layouts_convert_to_every_target_and_merge_exactly() -> None:
    stats: Counter[str] = Counter()

    @fuzz(30)
    @given(moe_adapters())
    def one(a: dict[str, Any]) -> None:
        stats["inputs"] += 1
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            src = _write_moe(work / "src", a)
            found = lorafast.converting.detect_layout(lorafast.inspect(src))
            v5 = fused_base(a["seed"], e=a["e"], layers=a["layers"])
            # Mixtral's transformers-4 names keep `block_sparse_moe` in every layout but transformers5's
            mixtral = {k.replace(".mlp.", ".block_sparse_moe."): w for k, w in v5.items()}
            for to in [t for t, sources in _FROM.items() if found in sources]:
                out = work / "out"
                try:
                    res = convert(src, to, out)
                except ConvertError as exc:
                    _refused(exc, work, stats)
                    continue
                base = mixtral if a["layout"].endswith("mixtral") and to != "transformers5" else v5
                assert_bit_identical(merged(base, src), merged(base, res.out))
                stats[f"{found} -> {to}"] += 1
                os.rename(out, work / f"done-{to}")

    one()
    print(f"\nMoE convert fuzz: {dict(stats)}")
    assert sum(v for k, v in stats.items() if "->" in k) > 0
