"""The sample-adapter generator: valid safetensors, the names and shapes each tool writes, and (once the
extension is built) the classification lorafast gives each kind."""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from lorafast.sample import (
    KIND_FLAGS,
    KIND_FORMAT,
    KIND_MOE_LAYOUT,
    KIND_VARIANTS,
    KINDS,
    sample_kind_of,
    write_samples,
)

try:
    import lorafast
except ImportError:  # pragma: no cover - lorafast.sample imported, so the package is there
    lorafast = None  # type: ignore[assignment]

needs_inspect = pytest.mark.skipif(
    lorafast is None or not hasattr(lorafast, "inspect"),
    reason="lorafast.inspect is not available (extension not built)",
)

HIDDEN = 64
INTER = 172  # round(64 * 2.6875), the Llama-2 ratio
KV = 16
MOE_INTER = 32
RANKS = {4, 8, 16, 32, 64}


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_samples(tmp_path_factory.mktemp("samples"), 2 * len(KINDS), seed=0, hidden=HIDDEN)


def weight_file(path: str) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    files = sorted(p.glob("*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def header(path: str) -> tuple[dict[str, Any], dict[str, str] | None]:
    """Stdlib reader, independent of the generator's writer."""
    with open(weight_file(path), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    return h, h.pop("__metadata__", None)


def config(path: str) -> dict[str, Any]:
    return json.loads((Path(path) / "adapter_config.json").read_text())


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():  # PEFT's get_pattern_key: first match in saved order
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_pairs(h: dict[str, Any], a_suffix: str, b_suffix: str) -> dict[str, tuple[list[int], list[int]]]:
    """module key -> (A shape, B shape) for every A/B pair; fails on an A without its B."""
    out = {}
    for name, t in h.items():
        if name.endswith(a_suffix):
            key = name[: -len(a_suffix)]
            assert key + b_suffix in h, name
            out[key] = (t["shape"], h[key + b_suffix]["shape"])
    return out


# ---------------------------------------------------------------------------------------------------------------


def test_layout_and_kinds(samples: list[str]) -> None:
    assert [sample_kind_of(p) for p in samples[: len(KINDS)]] == KINDS
    assert set(Counter(sample_kind_of(p) for p in samples)) == set(KINDS)
    for p in samples:
        kind = sample_kind_of(p)
        assert re.fullmatch(r"\d{5}-" + kind + r"(\.safetensors)?", os.path.basename(p)), p
        if kind.startswith("peft_"):
            assert sorted(os.listdir(p)) == ["adapter_config.json", "adapter_model.safetensors"]
        elif os.path.isdir(p):
            assert os.listdir(p) == ["pytorch_lora_weights.safetensors"]
        else:
            assert p.endswith(".safetensors")
        assert sample_kind_of(weight_file(p)) == kind  # a file inside the folder names the kind too


def test_files_are_valid_safetensors(samples: list[str]) -> None:
    from safetensors import safe_open

    for p in samples:
        h, meta = header(p)
        with safe_open(str(weight_file(p)), "np") as f:  # "np" avoids importing torch; shapes need no data
            assert sorted(f.keys()) == sorted(h)
            assert (f.metadata() or None) == meta
            for name in list(h)[:50]:
                assert list(f.get_slice(name).get_shape()) == h[name]["shape"]
        # offsets tile the data section and every tensor is aligned to its dtype, as safetensors lays them out
        spans = sorted(t["data_offsets"] for t in h.values())
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        width = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}
        assert all(t["data_offsets"][0] % width[t["dtype"]] == 0 for t in h.values())


def test_deterministic(tmp_path: Path) -> None:
    a = write_samples(tmp_path / "a", 6, seed=3)
    b = write_samples(tmp_path / "b", 6, seed=3)
    c = write_samples(tmp_path / "c", 6, seed=4)

    def blob(paths: list[str]) -> list[bytes]:
        return [weight_file(p).read_bytes() for p in paths]

    assert blob(a) == blob(b)
    assert blob(a) != blob(c)


def test_sample_kind_of_rejects_other_paths() -> None:
    with pytest.raises(ValueError):
        sample_kind_of("/tmp/adapter_model.safetensors")
    with pytest.raises(ValueError):
        write_samples("/tmp/unused", 1, hidden=12)


# ---------------------------------------------------------------------------------------------------------------
# Per-kind names and shapes


def _check_peft_llama(p: str, kind: str, h: dict[str, Any]) -> None:
    cfg = config(p)
    assert cfg["peft_type"] == "LORA" and list(cfg) == sorted(cfg)
    assert list(cfg["rank_pattern"]) == sorted(cfg["rank_pattern"])
    dims = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
            "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}  # fmt: skip
    pairs = lora_pairs(h, ".lora_A.weight", ".lora_B.weight")
    targets = [t for t in cfg["target_modules"] if t != "embed_tokens"]
    assert len(pairs) == 32 * len(targets)
    for key, (a, b) in pairs.items():
        m = re.fullmatch(r"base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))", key)
        assert m and m.group(4) in targets, key
        rank = pattern_value(cfg["rank_pattern"], m.group(1), cfg["r"])
        assert a == [rank, dims[m.group(4)][0]] and b == [dims[m.group(4)][1], rank], key
        if kind == "peft_dora":
            assert h[key + ".lora_magnitude_vector"]["shape"] == [b[0]]
        if kind == "peft_lora_bias":
            assert h[key + ".lora_B.bias"]["shape"] == [b[0]]
    extra = set(h) - {f"{k}.lora_{x}.weight" for k in pairs for x in "AB"}
    if kind == "peft_embeddings":
        e = "base_model.model.model.embed_tokens"
        r = h[e + ".lora_embedding_A"]["shape"][0]
        assert h[e + ".lora_embedding_A"]["shape"] == [r, 8 * HIDDEN] and h[e + ".lora_embedding_B"]["shape"] == [
            HIDDEN,
            r,
        ]
        assert h[e + ".base_layer.weight"]["shape"] == [8 * HIDDEN, HIDDEN]
        assert extra == {e + ".lora_embedding_A", e + ".lora_embedding_B", e + ".base_layer.weight"}
    elif kind == "peft_modules_to_save":
        assert cfg["task_type"] == "SEQ_CLS" and "score" in cfg["modules_to_save"]
        assert extra == {"base_model.model.score.weight"} and h["base_model.model.score.weight"]["shape"][1] == HIDDEN
    elif kind == "peft_dora":
        assert cfg["use_dora"] and all(x.endswith(".lora_magnitude_vector") for x in extra) and len(extra) == len(pairs)
    elif kind == "peft_lora_bias":
        assert cfg["lora_bias"] and all(x.endswith(".lora_B.bias") for x in extra) and len(extra) == len(pairs)
    else:
        assert extra == set()


def _check_peft_moe(p: str, kind: str, h: dict[str, Any]) -> None:
    cfg = config(p)
    r = cfg["r"]
    pairs = lora_pairs(h, ".lora_A.weight", ".lora_B.weight")
    assert set(h) == {f"{k}.lora_{x}.weight" for k in pairs for x in "AB"}
    experts = {k: v for k, v in pairs.items() if ".experts" in k}
    assert experts
    if kind in ("peft_moe_2d_qwen", "peft_moe_2d_mixtral"):
        pat = (
            r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
            if kind.endswith("qwen")
            else r"block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)"
        )
        ids = set()
        for key, (a, b) in experts.items():
            m = re.search(pat + "$", key)
            assert m, key
            ids.add(int(m.group(1)))
            down = m.group(2) in ("down_proj", "w2")
            assert a == [r, MOE_INTER if down else HIDDEN] and b == [HIDDEN if down else MOE_INTER, r], key
        assert len(ids) in (8, 16) and ids == set(range(len(ids)))
        if kind.endswith("qwen"):
            assert any(".mlp.shared_expert.gate_proj" in k for k in pairs)
    elif kind in ("peft_moe_stacked_3d", "peft_moe_shared_outer"):
        outer = kind == "peft_moe_shared_outer"
        for key, (a, b) in experts.items():
            if key.endswith("gate_up_proj"):
                assert a[1:] == [r, HIDDEN] and b[1:] == [2 * MOE_INTER, r] and (a[0] == 1) is outer and b[0] > 1
            else:
                assert key.endswith("experts.down_proj"), key
                assert a[1:] == [r, MOE_INTER] and b[1:] == [HIDDEN, r] and (b[0] == 1) is outer and a[0] > 1
    else:  # target_parameters
        assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        for key, (a, b) in experts.items():
            assert a[0] == b[1] and a[0] % r == 0 and a[0] // r in (8, 16)
            if key.endswith("experts.base_layer"):
                assert a[1] == HIDDEN and b[0] == 2 * MOE_INTER
            else:
                assert key.endswith(".mlp.experts") and a[1] == MOE_INTER and b[0] == HIDDEN


def _check_single_file(p: str, kind: str, h: dict[str, Any], meta: dict[str, str] | None) -> None:
    names = list(h)
    if kind == "diffusers_peft":
        assert meta is not None
        cfg = json.loads(meta["lora_adapter_metadata"])
        pairs = lora_pairs(h, ".lora_A.weight", ".lora_B.weight")
        assert set(h) == {f"{k}.lora_{x}.weight" for k in pairs for x in "AB"}
        for key, (a, _) in pairs.items():
            comp = key.split(".", 1)[0]
            assert comp in ("unet", "transformer", "text_encoder"), key
            assert a[0] == cfg[f"{comp}.r"]
    elif kind == "diffusers_legacy":
        assert all(
            re.search(r"(\.processor\.to_(q|k|v|out)_lora|\.lora_linear_layer)\.(down|up)\.weight$", n) for n in names
        )
        assert all(n.startswith(("unet.", "text_encoder.")) for n in names)
    elif kind in ("kohya_sd", "kohya_flux", "lycoris_loha", "lycoris_lokr"):
        assert meta is not None and int(meta["ss_network_dim"]) in RANKS
        suffixes = {"kohya_sd": {"lora_down.weight", "lora_up.weight", "alpha"}, "kohya_flux": {"lora_down.weight", "lora_up.weight", "alpha"},
                    "lycoris_loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
                    "lycoris_lokr": {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"}}[kind]  # fmt: skip
        modules: dict[str, set[str]] = {}
        for n in names:
            key, suffix = n.split(".", 1)
            modules.setdefault(key, set()).add(suffix)
            assert re.fullmatch(r"lora_(unet|te)_[a-z0-9_]+", key), n
        assert all(s == suffixes for s in modules.values())
        assert all(h[k + ".alpha"]["shape"] == [] for k in modules)
        if kind == "kohya_flux":
            assert all(re.match(r"lora_unet_(double|single)_blocks_\d+_", k) for k in modules)
        if kind == "kohya_sd":
            conv = [k for k in modules if len(h[k + ".lora_down.weight"]["shape"]) == 4]
            assert any(k.endswith("_proj_in") for k in conv)
            for k in modules:
                down, up = h[k + ".lora_down.weight"]["shape"], h[k + ".lora_up.weight"]["shape"]
                assert down[0] == up[1] and len(down) == len(up)
    elif kind == "xlabs_flux":
        assert all(
            re.fullmatch(r"double_blocks\.\d+\.processor\.(qkv|proj)_lora[12]\.(down|up)\.weight", n) for n in names
        )
    elif kind == "ai_toolkit_flux":
        pairs = lora_pairs(h, ".lora_A.weight", ".lora_B.weight")
        assert len(pairs) * 2 == len(names)
        assert all(re.fullmatch(r"(transformer\.)?(double|single)_blocks\.\d+\.[a-z_.0-9]+", k) for k in pairs)
    else:  # pragma: no cover
        raise AssertionError(kind)


def test_names_and_shapes(samples: list[str]) -> None:
    for p in samples:
        kind = sample_kind_of(p)
        h, meta = header(p)
        if kind.startswith("peft_moe"):
            _check_peft_moe(p, kind, h)
        elif kind.startswith("peft_"):
            _check_peft_llama(p, kind, h)
        else:
            _check_single_file(p, kind, h, meta)


def read_scalar(path: Path, h: dict[str, Any], name: str) -> float:
    """Decode a 0-d F32/F16/BF16 tensor straight from the file."""
    t = h[name]
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + t["data_offsets"][0])
        raw = f.read(t["data_offsets"][1] - t["data_offsets"][0])
    if t["dtype"] == "BF16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    return struct.unpack({"F32": "<f", "F16": "<e"}[t["dtype"]], raw)[0]


def test_kohya_alpha_values_are_real(samples: list[str]) -> None:
    seen = set()
    for p in samples:
        kind = sample_kind_of(p)
        if kind not in ("kohya_sd", "kohya_flux", "lycoris_loha", "lycoris_lokr"):
            continue
        h, meta = header(p)
        alphas = {read_scalar(weight_file(p), h, k) for k in h if k.endswith(".alpha")}
        # linear modules carry the network alpha; kohya SD conv modules carry conv_alpha (1.0)
        assert float(meta["ss_network_alpha"]) in alphas
        assert alphas <= {float(meta["ss_network_alpha"]), 1.0}
        seen.add(kind)
    assert seen == {"kohya_sd", "kohya_flux", "lycoris_loha", "lycoris_lokr"}


# ---------------------------------------------------------------------------------------------------------------


@needs_inspect
def test_inspect_classifies_every_kind(samples: list[str]) -> None:
    wrong = []
    for p in samples:
        kind = sample_kind_of(p)
        ad = lorafast.inspect(p)
        h, _ = header(p)
        got = (ad.format, ad.moe_layout, set(ad.variants), ad.num_tensors)
        want = (KIND_FORMAT[kind], KIND_MOE_LAYOUT[kind], set(KIND_VARIANTS[kind]), len(h))
        if got != want or not KIND_FLAGS[kind] <= set(ad.flags):
            wrong.append(
                f"{os.path.basename(p)}: got {got} flags {sorted(ad.flags)}, want {want} flags >= {sorted(KIND_FLAGS[kind])}"
            )
    assert not wrong, "\n".join(wrong)


@needs_inspect
def test_inspect_problems_free(samples: list[str]) -> None:
    """The samples are consistent by construction, so lorafast should find nothing wrong with them."""
    bad = {}
    for p in samples:
        ad = lorafast.inspect(p)
        if ad.problems:
            bad[os.path.basename(p)] = [(x.code, x.message[:120]) for x in ad.problems[:3]]
    assert not bad, bad


@needs_inspect
def test_inspect_ranks_match_config(samples: list[str]) -> None:
    for p in samples:
        if sample_kind_of(p) not in ("peft_dense", "peft_dora", "peft_lora_bias"):
            continue
        cfg = config(p)
        ad = lorafast.inspect(p)
        assert ad.ranks == {m: pattern_value(cfg["rank_pattern"], m, cfg["r"]) for m in ad.ranks}
        for m in ad.modules:
            want_alpha = pattern_value(cfg["alpha_pattern"], m.name, cfg["lora_alpha"])
            assert m.alpha == want_alpha and m.use_rslora is cfg["use_rslora"], m.name
