"""Classification of adapters written by the real libraries (tests/fixtures/real, made by make_fixtures.py).

The expected facts in MANIFEST.json come from PEFT's layer objects and the saved files, not from lorafast, so
a failure in the `inspect` tests below is a disagreement between lorafast and PEFT/diffusers/kohya: report it,
don't relax the assertion.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import pytest

try:
    import lorafast
except ImportError:  # the extension is not built in this environment
    lorafast = None  # type: ignore[assignment]

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
MANIFEST = json.loads((REAL / "MANIFEST.json").read_text())
FIXTURES: dict[str, dict[str, Any]] = MANIFEST["fixtures"]
NAMES = sorted(FIXTURES)

needs_inspect = pytest.mark.skipif(
    lorafast is None or not hasattr(lorafast, "inspect"),
    reason="lorafast.inspect is not available (extension not built)",
)


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, str] | None]:
    """Stdlib safetensors header reader: name -> {dtype, shape, data_offsets}, and the metadata."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None)
    return header, meta


def fixture_path(name: str) -> Path:
    return REAL / FIXTURES[name]["path"]


# ---------------------------------------------------------------------------------------------------------------
# The fixtures themselves (no lorafast needed): what the manifest claims is what is on disk


def test_manifest_covers_required_kinds() -> None:
    fmts = {f["format"] for f in FIXTURES.values()}
    layouts = {f["moe_layout"] for f in FIXTURES.values()}
    flags = set().union(*(f["flags"] for f in FIXTURES.values()))
    assert {"peft", "diffusers", "kohya"} <= fmts
    assert {"dense", "per_expert_2d", "peft_target_parameters"} <= layouts
    assert {"dora", "embeddings", "full_weights", "modules_to_save", "lora_bias", "kohya_alpha"} <= flags
    assert set(MANIFEST["versions"]) >= {"torch", "transformers", "peft", "diffusers", "safetensors"}


def test_fixture_sizes_stay_small() -> None:
    files = [p for p in REAL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 3 * 1024 * 1024
    for p in files:
        if p.suffix == ".safetensors":
            assert p.stat().st_size < 200 * 1024, p


@pytest.mark.parametrize("name", NAMES)
def test_manifest_matches_files(name: str) -> None:
    fx = FIXTURES[name]
    weight = REAL / fx["weight_file"]
    header, meta = read_header(weight)
    assert len(header) == fx["num_tensors"]
    assert sorted({t["dtype"] for t in header.values()}) == fx["dtypes"]
    assert sorted((meta or {}).keys()) == fx["metadata_keys"]
    owned: set[str] = set()
    for key, m in fx["modules"].items():
        assert m["tensors"], key
        for t in m["tensors"]:
            assert t in header, t
            assert t.startswith(key + "."), t
        owned.update(m["tensors"])
        a = next(
            t
            for t in m["tensors"]
            if re.search(r"\.(lora_A\.weight|lora_embedding_A|lora_down\.weight|hada_w1_b|lokr_w2_b)$", t)
        )
        rows = header[a]["shape"][0]
        expected_rows = m["rank"] * (m["num_experts"] if m["kind"] == "target_parameters" else 1)
        assert rows == expected_rows, (key, header[a]["shape"], m["rank"])
    # every tensor is a module factor, a listed full weight, or a trainable-tokens delta
    rest = set(header) - owned - set(fx["full_weight_tensors"])
    assert all(t.endswith(".trainable_tokens_delta") for t in rest), sorted(rest)
    assert fx["rank"] == max(m["rank"] for m in fx["modules"].values())


@pytest.mark.parametrize("name", [n for n in NAMES if FIXTURES[n]["format"] == "peft"])
def test_peft_config_matches_manifest(name: str) -> None:
    fx = FIXTURES[name]
    raw = (REAL / fx["path"] / "adapter_config.json").read_text()
    cfg = json.loads(raw)
    assert cfg["peft_type"] == fx["peft_type"]
    assert cfg["r"] == fx["r"]
    assert cfg.get("lora_alpha", cfg.get("alpha")) == fx["lora_alpha"]
    assert cfg.get("rank_pattern", {}) == fx["rank_pattern"]
    assert cfg.get("alpha_pattern", {}) == fx["alpha_pattern"]
    # PEFT saves with sort_keys=True: the saved pattern order is sorted, whatever order training used
    assert list(cfg.get("rank_pattern", {})) == sorted(cfg.get("rank_pattern", {}))
    assert list(cfg) == sorted(cfg)


def test_unsorted_patterns_fixture_really_mismatches() -> None:
    mods = FIXTURES["peft_llama_unsorted_patterns"]["modules"]
    bad = {k: (m["rank"], m["config_rank"]) for k, m in mods.items() if m["rank"] != m["config_rank"]}
    assert bad == {"base_model.model.model.layers.1.self_attn.q_proj": (4, 12)}


def test_kohya_alpha_tensors() -> None:
    header, _ = read_header(REAL / FIXTURES["kohya_from_diffusers"]["weight_file"])
    alphas = {k: v for k, v in header.items() if k.endswith(".alpha")}
    assert alphas and all(v["dtype"] == "I64" and v["shape"] == [] for v in alphas.values())
    header, meta = read_header(REAL / FIXTURES["kohya_sdscripts_style"]["weight_file"])
    assert all(v["dtype"] == "F16" and v["shape"] == [] for k, v in header.items() if k.endswith(".alpha"))
    assert meta and meta["ss_network_module"] == "networks.lora"


# ---------------------------------------------------------------------------------------------------------------
# lorafast.inspect against the real libraries


def expected_flags(fx: dict[str, Any]) -> set[str]:
    """The library-derived flags plus lorafast's own summary flags (rust/classify/ `flags::NAMES`):
    `has_config` when a config was read (adapter_config.json or diffusers' lora_adapter_metadata),
    `non_additive` for DoRA / LyCORIS variants, `unsupported_features` for PEFT options that are not plain LoRA
    (here: trainable_token_indices)."""
    flags = set(fx["flags"])
    if fx["format"] == "peft" or "lora_adapter_metadata" in fx["metadata_keys"]:
        flags.add("has_config")
    if "dora" in flags or fx["variants"]:
        flags.add("non_additive")
    if "trainable_tokens" in flags:
        flags.add("unsupported_features")
    return flags


def _module_tensors(m: Any) -> set[str]:
    keys = {m.a_key, m.b_key, m.alpha_key, m.bias_key, m.magnitude_key, *m.extra_keys}
    return {k for k in keys if k is not None}


@needs_inspect
@pytest.mark.parametrize("name", NAMES)
def test_inspect_adapter_level(name: str) -> None:
    fx = FIXTURES[name]
    ad = lorafast.inspect(str(fixture_path(name)))
    weight = REAL / fx["weight_file"]

    assert ad.format.value == fx["format"]
    assert ad.moe_layout.value == fx["moe_layout"]
    assert ad.num_experts == fx["num_experts"]
    assert set(ad.flags) == expected_flags(fx)
    assert set(ad.variants) == set(fx["variants"])
    assert set(ad.full_weight_tensors) == set(fx["full_weight_tensors"])
    assert ad.num_tensors == fx["num_tensors"]
    assert set(ad.dtypes) == set(fx["dtypes"])
    assert ad.rank == fx["rank"]
    assert [Path(p).name for p in ad.weight_files] == [weight.name]
    additive = not ({"dora"} & set(fx["flags"]) or fx["variants"])
    assert ad.is_additive is additive

    if fx["format"] == "peft":
        assert ad.config_path is not None and Path(ad.config_path).name == "adapter_config.json"
        assert ad.peft_type == fx["peft_type"]
        assert ad.r == fx["r"]
        assert ad.lora_alpha == fx["lora_alpha"]
        assert ad.use_rslora is fx["use_rslora"]
        assert dict(ad.rank_pattern) == fx["rank_pattern"]
        assert dict(ad.alpha_pattern) == fx["alpha_pattern"]
        assert ad.base_model_name_or_path == fx["base_model_name_or_path"]
        assert set(ad.target_modules) == set(fx["target_modules"])
        assert tuple(ad.layers) == tuple(fx["layers"])
    else:
        assert ad.config_path is None
    if fx["format"] == "diffusers":
        assert {"to_q", "to_k", "to_v"} <= set(ad.target_modules)

    if fx["problems"]:
        # the unsorted-pattern fixture: exactly one problem, naming the module whose saved pattern disagrees
        assert len(ad.problems) == len(fx["problems"]), ad.problems
        for want, got in zip(fx["problems"], ad.problems, strict=True):
            text = f"{got.tensor or ''} {got.message}"
            assert want["module"] in text, got
    else:
        assert ad.problems == (), ad.problems


@needs_inspect
@pytest.mark.parametrize("name", NAMES)
def test_inspect_modules(name: str) -> None:
    """Per-module facts: kind, rank, alpha, scale, features, experts and tensor ownership, keyed by `key`."""
    fx = FIXTURES[name]
    ad = lorafast.inspect(str(fixture_path(name)))
    got = {m.key: m for m in ad.modules}
    assert set(got) == set(fx["modules"])
    for key, want in fx["modules"].items():
        m = got[key]
        where = f"{name}: {key}"
        assert m.kind == want["kind"], where
        assert m.rank == want["rank"], where
        assert m.in_features == want["in_features"], where
        assert m.out_features == want["out_features"], where
        assert m.num_experts == want["num_experts"], where
        assert m.use_rslora is want["use_rslora"], where
        assert _module_tensors(m) == set(want["tensors"]), where
        assert Path(m.weight_file).name == Path(fx["weight_file"]).name, where
        # alpha: None means "alpha = rank"; compare through the resolved value and the scale
        alpha = m.alpha if m.alpha is not None else float(m.rank)
        want_alpha = want["alpha"] if want["alpha"] is not None else float(want["rank"])
        assert alpha == pytest.approx(want_alpha), where
        assert m.scale == pytest.approx(want["scale"], rel=1e-6), where
        if "name" in want:
            assert m.name == want["name"], where
        if "leaf" in want and not want["leaf"].isdigit():  # `to_out.0`: the contract's leaf is ambiguous
            assert m.leaf == want["leaf"], where
        if "config_rank" in want:
            assert m.config_rank == want["config_rank"], where
        if any(t.endswith(".lora_magnitude_vector") for t in want["tensors"]):
            assert m.magnitude_key is not None and m.magnitude_key.endswith(".lora_magnitude_vector"), where
        if any(t.endswith(".lora_B.bias") for t in want["tensors"]):
            assert m.bias_key is not None and m.bias_key.endswith(".lora_B.bias"), where
        if m.kind in ("linear", "expert_2d", "embedding", "target_parameters"):
            assert m.a_key in want["tensors"] and m.b_key in want["tensors"], where
            assert re.search(r"(lora_A\.weight|lora_embedding_A|lora_down\.weight)$", m.a_key), where


@needs_inspect
def test_inspect_rank_pattern_and_rslora_scale() -> None:
    """The rank_pattern / alpha_pattern / rsLoRA fixture, spelled out."""
    ad = lorafast.inspect(str(fixture_path("peft_llama_patterns")))
    ranks = ad.ranks
    assert ranks["model.layers.1.self_attn.q_proj"] == 12
    assert ranks["model.layers.0.self_attn.q_proj"] == 8
    assert ranks["model.layers.0.mlp.down_proj"] == 4 and ranks["model.layers.1.mlp.down_proj"] == 4
    by_name = {m.name: m for m in ad.modules}
    assert by_name["model.layers.0.self_attn.o_proj"].alpha == 4
    assert by_name["model.layers.0.self_attn.v_proj"].alpha == 32
    assert by_name["model.layers.0.self_attn.k_proj"].alpha == 16
    assert by_name["model.layers.1.self_attn.q_proj"].scale == pytest.approx(16 / math.sqrt(12))


@needs_inspect
def test_inspect_diffusers_component_alphas() -> None:
    """diffusers stores one PEFT config per component in lora_adapter_metadata: unet alpha 8, text encoder 4."""
    ad = lorafast.inspect(str(fixture_path("diffusers_sd_unet_te")))
    alphas = {(m.key.split(".", 1)[0], m.rank, m.alpha) for m in ad.modules}
    assert alphas == {("unet", 4, 8.0), ("text_encoder", 2, 4.0)}


@needs_inspect
def test_inspect_kohya_int64_alpha() -> None:
    """diffusers' kohya converter writes .alpha as an int64 0-d tensor equal to the rank: scale 1."""
    ad = lorafast.inspect(str(fixture_path("kohya_from_diffusers")))
    assert all(m.alpha_key is not None and m.alpha == m.rank and m.scale == 1.0 for m in ad.modules)
    ad = lorafast.inspect(str(fixture_path("kohya_sdscripts_style")))
    assert {(m.rank, m.alpha) for m in ad.modules} == {(4, 8.0), (2, 4.0)}
