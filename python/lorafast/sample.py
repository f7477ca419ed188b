"""Realistic sample adapters for tests and benchmarks, in every format and MoE layout lorafast classifies.

`write_samples(out_dir, n)` writes `n` adapters whose headers look like the real thing: the tensor names,
counts, ranks, dtypes and configs that PEFT, diffusers, kohya sd-scripts, LyCORIS, xlabs and ai-toolkit
write, on models scaled down to a small hidden size. Only headers matter to a scan, so the data sections are
zero (written as sparse files), except the 0-d kohya/LyCORIS `.alpha` tensors, whose values the scale needs.

Writing 2,000 samples takes a few seconds: each distinct (kind, rank, targets, ...) choice is rendered to
header bytes once and reused.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from lorafast.adapter import AdapterFormat, MoeLayout
from lorafast.formats.peft import peft_pattern_key
from lorafast.formats.safetensors import encode_header, nbytes
from lorafast.testing import DTYPE_BITS

__all__ = [
    "KINDS",
    "KIND_FLAGS",
    "KIND_FORMAT",
    "KIND_MOE_LAYOUT",
    "KIND_VARIANTS",
    "sample_kind_of",
    "write_samples",
]


class Value(NamedTuple):
    """A tensor whose bytes matter (kohya `.alpha`): dtype, shape and little-endian data."""

    dtype: str
    shape: tuple[int, ...]
    raw: bytes


Spec = tuple[str, tuple[int, ...]] | Value
Tensors = dict[str, Spec]

#: Every sample kind, in the order `write_samples` first cycles through them.
KINDS: list[str] = [
    "peft_dense",
    "peft_dora",
    "peft_embeddings",
    "peft_modules_to_save",
    "peft_lora_bias",
    "peft_moe_2d_qwen",
    "peft_moe_2d_mixtral",
    "peft_moe_stacked_3d",
    "peft_moe_shared_outer",
    "peft_moe_target_parameters",
    "diffusers_peft",
    "diffusers_legacy",
    "kohya_sd",
    "kohya_flux",
    "lycoris_loha",
    "lycoris_lokr",
    "xlabs_flux",
    "ai_toolkit_flux",
]

#: The format a correct classifier reports for each kind.
KIND_FORMAT: dict[str, AdapterFormat] = {
    **{k: AdapterFormat.PEFT for k in KINDS if k.startswith("peft_")},
    "diffusers_peft": AdapterFormat.DIFFUSERS,
    "diffusers_legacy": AdapterFormat.DIFFUSERS_LEGACY,
    "kohya_sd": AdapterFormat.KOHYA,
    "kohya_flux": AdapterFormat.KOHYA,
    "lycoris_loha": AdapterFormat.LYCORIS,
    "lycoris_lokr": AdapterFormat.LYCORIS,
    "xlabs_flux": AdapterFormat.XLABS,
    "ai_toolkit_flux": AdapterFormat.AI_TOOLKIT,
}

#: The MoE layout of each kind (dense unless it has expert tensors).
KIND_MOE_LAYOUT: dict[str, MoeLayout] = {
    **{k: MoeLayout.DENSE for k in KINDS},
    "peft_moe_2d_qwen": MoeLayout.PER_EXPERT_2D,
    "peft_moe_2d_mixtral": MoeLayout.PER_EXPERT_2D,
    "peft_moe_stacked_3d": MoeLayout.STACKED_3D,
    "peft_moe_shared_outer": MoeLayout.SHARED_OUTER,
    "peft_moe_target_parameters": MoeLayout.PEFT_TARGET_PARAMETERS,
}

#: Flags every sample of the kind carries (a sample may carry more, e.g. `conv` when conv layers are adapted).
KIND_FLAGS: dict[str, frozenset[str]] = {
    **{k: frozenset() for k in KINDS},
    "peft_dora": frozenset({"dora"}),
    "peft_embeddings": frozenset({"embeddings", "full_weights"}),
    "peft_modules_to_save": frozenset({"modules_to_save", "full_weights"}),
    "peft_lora_bias": frozenset({"lora_bias"}),
    "kohya_sd": frozenset({"kohya_alpha", "conv"}),  # SD1.5 proj_in/proj_out are 1x1 convs
    "kohya_flux": frozenset({"kohya_alpha"}),
}

#: Non-LoRA families present in each kind.
KIND_VARIANTS: dict[str, tuple[str, ...]] = {
    **{k: () for k in KINDS},
    "lycoris_loha": ("loha",),
    "lycoris_lokr": ("lokr",),
}

# Later entries of the cycle weight the mix towards what fleets mostly hold: dense PEFT adapters.
_CYCLE: list[str] = [*KINDS, *(["peft_dense"] * 20), "kohya_sd", "kohya_flux", "diffusers_peft", "peft_dora"]

RANKS = (8, 16, 32, 64)
_NAME_RE = re.compile(r"^\d{5}-([a-z0-9_]+?)(\.safetensors)?$")


def sample_kind_of(path: str | os.PathLike[str]) -> str:
    """The kind of a sample from its path (the folder, the single file, or a file inside the folder)."""
    p = os.fspath(path).rstrip("/")
    for name in (os.path.basename(p), os.path.basename(os.path.dirname(p))):
        m = _NAME_RE.match(name)
        if m and m.group(1) in KINDS:
            return m.group(1)
    raise ValueError(f"not a sample path: {p}")


# ---------------------------------------------------------------------------------------------------------------
# Rendering and writing


def _scalar(dtype: str, value: float) -> Value:
    """A 0-d tensor holding `value` (kohya stores `.alpha` like this)."""
    if dtype == "F32":
        raw = struct.pack("<f", value)
    elif dtype == "F16":
        raw = struct.pack("<e", value)
    elif dtype == "BF16":
        raw = struct.pack("<f", value)[2:]  # bf16 is the high half of the f32 (exact for the values used here)
    else:
        raise ValueError(f"unsupported scalar dtype {dtype}")
    return Value(dtype, (), raw)


class _Rendered(NamedTuple):
    head: bytes
    """8-byte length + header JSON."""
    pieces: tuple[tuple[int, bytes], ...]
    """(offset in the data section, bytes) of tensors with real values."""
    data_len: int


def _render(tensors: Mapping[str, Spec], metadata: Mapping[str, str] | None) -> _Rendered:
    """Lay tensors out as safetensors does (largest dtype first, then by name) and serialize the header."""
    names = sorted(tensors)
    if len({spec[0] for spec in tensors.values()}) > 1:
        names.sort(key=lambda name: -DTYPE_BITS[tensors[name][0]])  # stable: names stay sorted within a dtype
    entries = [(name, tensors[name][0], tensors[name][1], nbytes(tensors[name][0], tensors[name][1])) for name in names]
    head, data_len = encode_header(entries, metadata)
    pieces: list[tuple[int, bytes]] = []
    offset = 0
    for name, _, _, size in entries:
        spec = tensors[name]
        if isinstance(spec, Value):
            pieces.append((offset, spec.raw))
        offset += size
    return _Rendered(head, tuple(pieces), data_len)


def _write_rendered(path: str, r: _Rendered) -> None:
    with open(path, "wb") as f:
        f.write(r.head)
        base = len(r.head)
        for off, raw in r.pieces:
            f.seek(base + off)
            f.write(raw)
        f.truncate(base + r.data_len)  # zero data as a sparse tail: cheap to write, cheap on disk


@dataclass(frozen=True)
class _Sample:
    """What to write for one sample. `key` identifies the (tensors, metadata) pair so it renders once."""

    key: tuple[Any, ...]
    build: Callable[[], Tensors]
    metadata: Mapping[str, str] | None
    config: Mapping[str, Any] | None
    """adapter_config.json, for PEFT folders."""
    weight_name: str | None
    """File name inside the sample folder; None: the sample is a single .safetensors file."""


def _peft_sample(key: tuple[Any, ...], build: Callable[[], Tensors], config: Mapping[str, Any]) -> _Sample:
    """A PEFT folder: adapter_model.safetensors (metadata `format: pt`, as PEFT saves it) and its config."""
    return _Sample(key, build, {"format": "pt"}, config, "adapter_model.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# Model shapes (scaled down) and PEFT config helpers


@dataclass(frozen=True)
class _Dims:
    hidden: int

    @property
    def inter(self) -> int:  # Llama: 14336 / 4096 = 3.5 for 3.x; 11008 / 4096 ~ 2.6875 for Llama-2
        return round(self.hidden * 2.6875)

    @property
    def kv(self) -> int:  # grouped-query attention: fewer kv heads
        return max(self.hidden // 4, 1)

    @property
    def vocab(self) -> int:
        return self.hidden * 8

    @property
    def moe_inter(self) -> int:
        return max(self.hidden // 2, 1)

    def llama(self) -> dict[str, tuple[str, int, int]]:
        """Leaf -> (parent, in_features, out_features) of a Llama decoder layer."""
        h, kv, i = self.hidden, self.kv, self.inter
        return {
            "q_proj": ("self_attn", h, h),
            "k_proj": ("self_attn", h, kv),
            "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", h, h),
            "gate_proj": ("mlp", h, i),
            "up_proj": ("mlp", h, i),
            "down_proj": ("mlp", i, h),
        }


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_ALL_LINEAR = (*_ATTN, "gate_proj", "up_proj", "down_proj")
_LLAMA_TARGETS = (
    _ALL_LINEAR,
    _ALL_LINEAR,
    _ATTN,
    ("q_proj", "v_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"),
)
_LLAMA_BASES = (
    "meta-llama/Llama-3.1-8B-Instruct",
    "meta-llama/Llama-2-7b-hf",
    "mistralai/Mistral-7B-Instruct-v0.3",
    "Qwen/Qwen2.5-7B-Instruct",
    None,
)

# LoraConfig.to_dict() of PEFT 0.21 with its defaults; samples override what they set.
_PEFT_DEFAULTS: dict[str, Any] = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "base_model_name_or_path": None,
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": 8,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "peft_version": "0.21.2",
    "qalora_group_size": 16,
    "r": 8,
    "rank_pattern": {},
    "revision": None,
    "target_modules": None,
    "target_parameters": None,
    "task_type": None,
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
    "velora_config": None,
}


def _peft_config(**fields: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(_PEFT_DEFAULTS)
    cfg.update(fields)
    # PEFT sorts the patterns when it saves (json.dumps(sort_keys=True)); keep them sorted in memory too.
    cfg["rank_pattern"] = dict(sorted(cfg["rank_pattern"].items()))
    cfg["alpha_pattern"] = dict(sorted(cfg["alpha_pattern"].items()))
    return cfg


def pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: the first key (in saved order) matching the module's suffix."""
    key = peft_pattern_key(patterns, module)
    return default if key is None else patterns[key]


def _pick_dtype(rng: random.Random) -> str:
    x = rng.random()
    return "BF16" if x < 0.6 else ("F32" if x < 0.85 else "F16")


def _pick_alpha(rng: random.Random, r: int) -> int:
    return rng.choice((r, r, 2 * r, 16, 32))


def _pair(t: Tensors, key: str, dtype: str, rank: int, fin: int, fout: int) -> None:
    t[key + ".lora_A.weight"] = (dtype, (rank, fin))
    t[key + ".lora_B.weight"] = (dtype, (fout, rank))


# ---------------------------------------------------------------------------------------------------------------
# PEFT on Llama-like models (dense variants)


def _llama_tensors(
    d: _Dims,
    layers: int,
    targets: Sequence[str],
    r: int,
    rank_pattern: Mapping[str, int],
    dtype: str,
    *,
    dora: bool = False,
    lora_bias: bool = False,
    embed_rank: int = 0,
    score_labels: int = 0,
) -> Tensors:
    shapes = d.llama()
    t: Tensors = {}
    for layer in range(layers):
        for leaf in targets:
            parent, fin, fout = shapes[leaf]
            module = f"model.layers.{layer}.{parent}.{leaf}"
            rank = pattern_value(rank_pattern, module, r)
            key = "base_model.model." + module
            _pair(t, key, dtype, rank, fin, fout)
            if lora_bias:
                t[key + ".lora_B.bias"] = (dtype, (fout,))
            if dora:
                t[key + ".lora_magnitude_vector"] = (dtype, (fout,))
    if embed_rank:
        key = "base_model.model.model.embed_tokens"
        t[key + ".lora_embedding_A"] = (dtype, (embed_rank, d.vocab))
        t[key + ".lora_embedding_B"] = (dtype, (d.hidden, embed_rank))
        t[key + ".base_layer.weight"] = (dtype, (d.vocab, d.hidden))  # saved because embeddings are targeted
    if score_labels:
        t["base_model.model.score.weight"] = (dtype, (score_labels, d.hidden))
    return t


def _rank_pattern(rng: random.Random, r: int, targets: Sequence[str], layers: int) -> dict[str, int]:
    x = rng.random()
    other = rng.choice([q for q in RANKS if q != r])
    if x < 0.7:
        return {}
    if x < 0.85:
        return {rng.choice(targets): other}
    # a layer-specific entry plus a leaf-wide one: order matters for first-match
    layer = rng.choice((0, 1, layers - 1))
    return {f"model.layers.{layer}.self_attn.q_proj": other, targets[-1]: rng.choice(RANKS)}


def _peft_llama(rng: random.Random, d: _Dims, variant: str) -> _Sample:
    layers = 32
    r = rng.choice(RANKS)
    targets = rng.choice(_LLAMA_TARGETS)
    dtype = _pick_dtype(rng)
    alpha = _pick_alpha(rng, r)
    rank_pattern = _rank_pattern(rng, r, targets, layers) if variant == "dense" else {}
    alpha_pattern = {targets[0]: 2 * alpha} if variant == "dense" and rng.random() < 0.15 else {}
    use_rslora = rng.random() < 0.15
    fields: dict[str, Any] = {
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "use_rslora": use_rslora,
        "base_model_name_or_path": rng.choice(_LLAMA_BASES),
        "task_type": "CAUSAL_LM",
    }
    opts: dict[str, Any] = {}
    if variant == "dora":
        fields["use_dora"] = True
        opts["dora"] = True
    elif variant == "lora_bias":
        fields["lora_bias"] = True
        opts["lora_bias"] = True
    elif variant == "embeddings":
        fields["target_modules"] = sorted([*targets, "embed_tokens"])
        opts["embed_rank"] = r
    elif variant == "modules_to_save":
        fields["task_type"] = "SEQ_CLS"
        fields["modules_to_save"] = ["classifier", "score"]  # PEFT adds both for SEQ_CLS; only `score` exists
        opts["score_labels"] = rng.choice((2, 3, 5))
    cfg = _peft_config(**fields)
    key = ("llama", variant, d.hidden, layers, targets, r, tuple(cfg["rank_pattern"].items()), dtype, *opts.items())
    rp = cfg["rank_pattern"]
    return _peft_sample(key, lambda: _llama_tensors(d, layers, targets, r, rp, dtype, **opts), cfg)


# ---------------------------------------------------------------------------------------------------------------
# PEFT on MoE models


def _attn_tensors(t: Tensors, d: _Dims, layer: int, r: int, dtype: str) -> None:
    shapes = d.llama()
    for leaf in _ATTN:
        parent, fin, fout = shapes[leaf]
        _pair(t, f"base_model.model.model.layers.{layer}.{parent}.{leaf}", dtype, r, fin, fout)


def _moe_2d_tensors(d: _Dims, style: str, layers: int, experts: int, r: int, dtype: str) -> Tensors:
    h, im = d.hidden, d.moe_inter
    t: Tensors = {}
    for layer in range(layers):
        _attn_tensors(t, d, layer, r, dtype)
        pre = f"base_model.model.model.layers.{layer}"
        for e in range(experts):
            if style == "qwen":
                base = f"{pre}.mlp.experts.{e}"
                _pair(t, f"{base}.gate_proj", dtype, r, h, im)
                _pair(t, f"{base}.up_proj", dtype, r, h, im)
                _pair(t, f"{base}.down_proj", dtype, r, im, h)
            else:
                base = f"{pre}.block_sparse_moe.experts.{e}"
                _pair(t, f"{base}.w1", dtype, r, h, im)
                _pair(t, f"{base}.w2", dtype, r, im, h)
                _pair(t, f"{base}.w3", dtype, r, h, im)
        if style == "qwen":  # Qwen2-MoE's always-on shared expert is a plain MLP that `gate_proj` etc. also match
            sh = 4 * im
            _pair(t, f"{pre}.mlp.shared_expert.gate_proj", dtype, r, h, sh)
            _pair(t, f"{pre}.mlp.shared_expert.up_proj", dtype, r, h, sh)
            _pair(t, f"{pre}.mlp.shared_expert.down_proj", dtype, r, sh, h)
    return t


def _peft_moe_2d(rng: random.Random, d: _Dims, style: str) -> _Sample:
    r = rng.choice(RANKS)
    dtype = _pick_dtype(rng)
    if style == "qwen":
        layers, experts, base = 24, rng.choice((8, 16)), "Qwen/Qwen1.5-MoE-A2.7B"
        targets = [*_ATTN, "gate_proj", "up_proj", "down_proj"]
    else:
        layers, experts, base = 32, 8, "mistralai/Mixtral-8x7B-v0.1"
        targets = [*_ATTN, "w1", "w2", "w3"]
    cfg = _peft_config(
        r=r,
        lora_alpha=_pick_alpha(rng, r),
        target_modules=sorted(targets),
        base_model_name_or_path=base,
        task_type="CAUSAL_LM",
    )
    key = ("moe2d", style, d.hidden, layers, experts, r, dtype)
    return _peft_sample(key, lambda: _moe_2d_tensors(d, style, layers, experts, r, dtype), cfg)


def _moe_3d_tensors(d: _Dims, layers: int, experts: int, r: int, dtype: str, shared_outer: bool) -> Tensors:
    h, im = d.hidden, d.moe_inter
    outer = 1 if shared_outer else experts  # shared-outer: gate_up A and down B are one factor for all experts
    t: Tensors = {}
    for layer in range(layers):
        _attn_tensors(t, d, layer, r, dtype)
        pre = f"base_model.model.model.layers.{layer}.mlp.experts"
        t[f"{pre}.gate_up_proj.lora_A.weight"] = (dtype, (outer, r, h))
        t[f"{pre}.gate_up_proj.lora_B.weight"] = (dtype, (experts, 2 * im, r))
        t[f"{pre}.down_proj.lora_A.weight"] = (dtype, (experts, r, im))
        t[f"{pre}.down_proj.lora_B.weight"] = (dtype, (outer, h, r))
    return t


def _peft_moe_3d(rng: random.Random, d: _Dims, shared_outer: bool) -> _Sample:
    r = rng.choice(RANKS)
    dtype = rng.choice(("BF16", "BF16", "F32"))
    layers, experts = 48, rng.choice((8, 16, 32))
    cfg = _peft_config(
        r=r,
        lora_alpha=_pick_alpha(rng, r),
        target_modules=sorted([*_ATTN, "gate_up_proj", "down_proj"]),
        base_model_name_or_path="Qwen/Qwen3-30B-A3B",
        task_type="CAUSAL_LM",
    )
    key = ("moe3d", shared_outer, d.hidden, layers, experts, r, dtype)
    return _peft_sample(key, lambda: _moe_3d_tensors(d, layers, experts, r, dtype, shared_outer), cfg)


def _target_parameters_tensors(d: _Dims, layers: int, experts: int, r: int, dtype: str) -> Tensors:
    h, im = d.hidden, d.moe_inter
    t: Tensors = {}
    for layer in range(layers):
        _attn_tensors(t, d, layer, r, dtype)
        pre = f"base_model.model.model.layers.{layer}.mlp.experts"
        # PEFT nests two ParamWrappers: the inner one (gate_up_proj [E, 2I, H]) ends up at experts.base_layer
        _pair(t, f"{pre}.base_layer", dtype, r * experts, h, 2 * im)
        _pair(t, pre, dtype, r * experts, im, h)  # outer wrapper: down_proj [E, H, I]
    return t


def _peft_moe_target_parameters(rng: random.Random, d: _Dims) -> _Sample:
    r = rng.choice((8, 16, 32))
    dtype = rng.choice(("BF16", "F32"))
    layers, experts = 48, rng.choice((8, 16))
    cfg = _peft_config(
        r=r,
        lora_alpha=_pick_alpha(rng, r),
        target_modules=sorted(_ATTN),
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        base_model_name_or_path="Qwen/Qwen3-30B-A3B",
        task_type="CAUSAL_LM",
    )
    key = ("moetp", d.hidden, layers, experts, r, dtype)
    return _peft_sample(key, lambda: _target_parameters_tensors(d, layers, experts, r, dtype), cfg)


# ---------------------------------------------------------------------------------------------------------------
# Stable Diffusion 1.5 UNet / CLIP and Flux module trees (diffusers names), scaled down


def _sd_attentions(d: _Dims) -> list[tuple[str, int]]:
    """(diffusers path of a Transformer2DModel, channels) for SD1.5's 16 attention blocks."""
    c = (d.hidden // 2, d.hidden, 2 * d.hidden)
    out = [(f"down_blocks.{b}.attentions.{a}", c[b]) for b in range(3) for a in range(2)]
    out.append(("mid_block.attentions.0", c[2]))
    out += [(f"up_blocks.{b}.attentions.{a}", c[3 - b]) for b in (1, 2, 3) for a in range(3)]
    return out


def _sd_attention_linears(d: _Dims, attn_only: bool) -> list[tuple[str, int, int]]:
    """(module path, in, out) of every Linear inside SD1.5's attention blocks."""
    cross = d.hidden * 3 // 2  # CLIP-L width, scaled
    mods: list[tuple[str, int, int]] = []
    for path, ch in _sd_attentions(d):
        tb = f"{path}.transformer_blocks.0"
        for attn in ("attn1", "attn2"):
            kv_in = ch if attn == "attn1" else cross
            mods += [
                (f"{tb}.{attn}.to_q", ch, ch),
                (f"{tb}.{attn}.to_k", kv_in, ch),
                (f"{tb}.{attn}.to_v", kv_in, ch),
                (f"{tb}.{attn}.to_out.0", ch, ch),
            ]
        if not attn_only:
            mods += [(f"{tb}.ff.net.0.proj", ch, 8 * ch), (f"{tb}.ff.net.2", 4 * ch, ch)]
    return mods


def _sd_resnet_convs(d: _Dims) -> list[tuple[str, int, int, int]]:
    """(module path, in, out, kernel) of SD1.5's resnet / sampler convolutions."""
    c = (d.hidden // 2, d.hidden, 2 * d.hidden, 2 * d.hidden)
    mods: list[tuple[str, int, int, int]] = []
    prev = c[0]
    for b in range(4):
        for j in range(2):
            cin = prev if j == 0 else c[b]
            mods += [
                (f"down_blocks.{b}.resnets.{j}.conv1", cin, c[b], 3),
                (f"down_blocks.{b}.resnets.{j}.conv2", c[b], c[b], 3),
            ]
            if cin != c[b]:
                mods.append((f"down_blocks.{b}.resnets.{j}.conv_shortcut", cin, c[b], 1))
        if b < 3:
            mods.append((f"down_blocks.{b}.downsamplers.0.conv", c[b], c[b], 3))
        prev = c[b]
    mods += [(f"mid_block.resnets.{j}.conv{k}", c[3], c[3], 3) for j in range(2) for k in (1, 2)]
    rc = c[::-1]
    for b in range(4):
        for j in range(3):
            cin = rc[b] + (rc[b] if j < 2 else rc[min(b + 1, 3)])  # concatenated skip connection
            mods += [
                (f"up_blocks.{b}.resnets.{j}.conv1", cin, rc[b], 3),
                (f"up_blocks.{b}.resnets.{j}.conv2", rc[b], rc[b], 3),
                (f"up_blocks.{b}.resnets.{j}.conv_shortcut", cin, rc[b], 1),
            ]
        if b < 3:
            mods.append((f"up_blocks.{b}.upsamplers.0.conv", rc[b], rc[b], 3))
    return mods


def _clip_linears(d: _Dims, layers: int = 12) -> list[tuple[str, int, int]]:
    w = d.hidden * 3 // 2
    mods: list[tuple[str, int, int]] = []
    for i in range(layers):
        p = f"text_model.encoder.layers.{i}"
        mods += [(f"{p}.self_attn.{x}_proj", w, w) for x in ("q", "k", "v", "out")]
        mods += [(f"{p}.mlp.fc1", w, 4 * w), (f"{p}.mlp.fc2", 4 * w, w)]
    return mods


def _flux_diffusers_linears(d: _Dims) -> list[tuple[str, int, int]]:
    """The attention projections PEFT-style Flux LoRAs usually target (`to_q`, `to_k`, `to_v`, `to_out.0`)."""
    h = d.hidden
    mods = [(f"transformer_blocks.{i}.attn.{m}", h, h) for i in range(19) for m in ("to_q", "to_k", "to_v", "to_out.0")]
    mods += [(f"single_transformer_blocks.{i}.attn.{m}", h, h) for i in range(38) for m in ("to_q", "to_k", "to_v")]
    return mods


def _flux_bfl_linears(d: _Dims, with_mod: bool) -> list[tuple[str, int, int]]:
    """Flux modules in the original BFL naming (`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`)."""
    h = d.hidden
    mods: list[tuple[str, int, int]] = []
    for i in range(19):
        for s in ("img", "txt"):
            mods += [
                (f"double_blocks.{i}.{s}_attn.qkv", h, 3 * h),
                (f"double_blocks.{i}.{s}_attn.proj", h, h),
                (f"double_blocks.{i}.{s}_mlp.0", h, 4 * h),
                (f"double_blocks.{i}.{s}_mlp.2", 4 * h, h),
            ]
            if with_mod:
                mods.append((f"double_blocks.{i}.{s}_mod.lin", h, 6 * h))
    for i in range(38):
        mods += [(f"single_blocks.{i}.linear1", h, 7 * h), (f"single_blocks.{i}.linear2", 5 * h, h)]
        if with_mod:
            mods.append((f"single_blocks.{i}.modulation.lin", h, 3 * h))
    return mods


# ---------------------------------------------------------------------------------------------------------------
# diffusers


def _diffusers_peft(rng: random.Random, d: _Dims) -> _Sample:
    r = rng.choice(RANKS)
    alpha = _pick_alpha(rng, r)
    dtype = rng.choice(("BF16", "F32", "F16"))
    component = rng.choice(("transformer", "unet"))
    with_te = component == "unet" and rng.random() < 0.3
    targets = ["to_k", "to_out.0", "to_q", "to_v"]
    meta_cfg: dict[str, Any] = {}
    for comp, tm in (
        (component, targets),
        *((("text_encoder", ["k_proj", "out_proj", "q_proj", "v_proj"]),) if with_te else ()),
    ):
        cfg = _peft_config(r=r, lora_alpha=alpha, target_modules=tm, init_lora_weights="gaussian", inference_mode=False)
        meta_cfg.update({f"{comp}.{k}": v for k, v in cfg.items()})
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(meta_cfg, indent=2, sort_keys=True)}

    def build() -> Tensors:
        t: Tensors = {}
        mods = _flux_diffusers_linears(d) if component == "transformer" else _sd_attention_linears(d, attn_only=True)
        for path, fin, fout in mods:
            _pair(t, f"{component}.{path}", dtype, r, fin, fout)
        if with_te:
            for path, fin, fout in _clip_linears(d):
                if ".self_attn." in path:
                    _pair(t, f"text_encoder.{path}", dtype, r, fin, fout)
        return t

    in_folder = rng.random() < 0.5
    key = ("diffusers", component, with_te, d.hidden, r, alpha, dtype)
    return _Sample(key, build, metadata, None, "pytorch_lora_weights.safetensors" if in_folder else None)


def _diffusers_legacy(rng: random.Random, d: _Dims) -> _Sample:
    r = rng.choice((4, 8, 16, 32))  # the old training scripts defaulted to rank 4
    dtype = rng.choice(("F32", "F16"))
    with_te = rng.random() < 0.3

    def build() -> Tensors:
        t: Tensors = {}
        for path, fin, fout in _sd_attention_linears(d, attn_only=True):
            # `...attn1.to_out.0` -> `...attn1.processor.to_out_lora`
            parent, leaf = path.rsplit(".to_", 1)
            leaf = "to_" + leaf.split(".")[0]
            pre = f"unet.{parent}.processor.{leaf}_lora"
            t[pre + ".down.weight"] = (dtype, (r, fin))
            t[pre + ".up.weight"] = (dtype, (fout, r))
        if with_te:
            for path, fin, fout in _clip_linears(d):
                if ".self_attn." in path:
                    pre = f"text_encoder.{path}.lora_linear_layer"
                    t[pre + ".down.weight"] = (dtype, (r, fin))
                    t[pre + ".up.weight"] = (dtype, (fout, r))
        return t

    key = ("diffusers_legacy", d.hidden, r, dtype, with_te)
    return _Sample(key, build, {"format": "pt"}, None, "pytorch_lora_weights.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# kohya sd-scripts and LyCORIS


def _kohya_name(prefix: str, path: str) -> str:
    return f"{prefix}_{path.replace('.', '_')}"


def _kohya_meta(module: str, r: int, alpha: float, base: str, args: Mapping[str, str] | None) -> dict[str, str]:
    meta = {
        "ss_network_module": module,
        "ss_network_dim": str(r),
        "ss_network_alpha": str(alpha),
        "ss_base_model_version": base,
        "ss_output_name": "my_lora",
        "ss_training_comment": "None",
        "modelspec.architecture": "stable-diffusion-v1/lora" if base == "sd_v1" else "flux-1-dev/lora",
        "modelspec.implementation": "diffusers" if base == "sd_v1" else "https://github.com/black-forest-labs/flux",
        "modelspec.title": "my_lora",
        "modelspec.sai_model_spec": "1.0.0",
    }
    if args:
        meta["ss_network_args"] = json.dumps(dict(args))
    return meta


def _kohya_sd(rng: random.Random, d: _Dims) -> _Sample:
    r = rng.choice(RANKS)
    alpha = rng.choice((1.0, r / 2, float(r)))
    conv_dim = rng.choice((0, 0, 8, 16))
    conv_alpha = 1.0
    with_te = rng.random() < 0.7
    dtype = rng.choice(("F16", "F16", "BF16", "F32"))
    args = {"conv_dim": str(conv_dim), "conv_alpha": str(conv_alpha)} if conv_dim else None
    metadata = _kohya_meta("networks.lora", r, alpha, "sd_v1", args)

    def build() -> Tensors:
        t: Tensors = {}

        def add(name: str, rank: int, a: float, down: tuple[int, ...], up: tuple[int, ...]) -> None:
            t[name + ".lora_down.weight"] = (dtype, down)
            t[name + ".lora_up.weight"] = (dtype, up)
            t[name + ".alpha"] = _scalar(dtype, a)

        for path, ch in _sd_attentions(d):  # SD1.5 proj_in / proj_out are 1x1 convolutions
            for p in ("proj_in", "proj_out"):
                add(_kohya_name("lora_unet", f"{path}.{p}"), r, alpha, (r, ch, 1, 1), (ch, r, 1, 1))
        for path, fin, fout in _sd_attention_linears(d, attn_only=False):
            add(_kohya_name("lora_unet", path), r, alpha, (r, fin), (fout, r))
        if conv_dim:
            for path, fin, fout, k in _sd_resnet_convs(d):
                add(_kohya_name("lora_unet", path), conv_dim, conv_alpha, (conv_dim, fin, k, k), (fout, conv_dim, 1, 1))
        if with_te:
            for path, fin, fout in _clip_linears(d):
                add(_kohya_name("lora_te", path), r, alpha, (r, fin), (fout, r))
        return t

    key = ("kohya_sd", d.hidden, r, alpha, conv_dim, with_te, dtype)
    return _Sample(key, build, metadata, None, None)


def _kohya_flux(rng: random.Random, d: _Dims) -> _Sample:
    r = rng.choice(RANKS)
    alpha = rng.choice((1.0, r / 2, float(r)))
    dtype = rng.choice(("BF16", "BF16", "F16", "F32"))
    with_mod = rng.random() < 0.5
    metadata = _kohya_meta("networks.lora_flux", r, alpha, "flux1", None)

    def build() -> Tensors:
        t: Tensors = {}
        for path, fin, fout in _flux_bfl_linears(d, with_mod):
            name = _kohya_name("lora_unet", path)
            t[name + ".lora_down.weight"] = (dtype, (r, fin))
            t[name + ".lora_up.weight"] = (dtype, (fout, r))
            t[name + ".alpha"] = _scalar(dtype, alpha)
        return t

    key = ("kohya_flux", d.hidden, r, alpha, with_mod, dtype)
    return _Sample(key, build, metadata, None, None)


def _factor(dim: int, factor: int) -> tuple[int, int]:
    """LyCORIS-style split of `dim` into (m, dim // m) with m <= factor and m dividing dim."""
    m = max(k for k in range(1, factor + 1) if dim % k == 0)
    return m, dim // m


def _lycoris(rng: random.Random, d: _Dims, algo: str) -> _Sample:
    r = rng.choice((8, 16, 32)) if algo == "loha" else rng.choice((8, 16))
    alpha = rng.choice((1.0, r / 2, float(r)))
    dtype = rng.choice(("F16", "BF16", "F32"))
    args = {"algo": algo, "conv_dim": "0", "conv_alpha": "1"}
    if algo == "lokr":
        args["factor"] = "4"
    metadata = _kohya_meta("lycoris.kohya", r, alpha, "sd_v1", args)

    def build() -> Tensors:
        t: Tensors = {}
        for path, fin, fout in _sd_attention_linears(d, attn_only=False):
            name = _kohya_name("lora_unet", path)
            if algo == "loha":
                t[name + ".hada_w1_a"] = (dtype, (fout, r))
                t[name + ".hada_w1_b"] = (dtype, (r, fin))
                t[name + ".hada_w2_a"] = (dtype, (fout, r))
                t[name + ".hada_w2_b"] = (dtype, (r, fin))
            else:
                (om, on), (im, in_) = _factor(fout, 4), _factor(fin, 4)
                t[name + ".lokr_w1"] = (dtype, (om, im))
                t[name + ".lokr_w2_a"] = (dtype, (on, r))
                t[name + ".lokr_w2_b"] = (dtype, (r, in_))
            t[name + ".alpha"] = _scalar(dtype, alpha)
        return t

    key = ("lycoris", algo, d.hidden, r, alpha, dtype)
    return _Sample(key, build, metadata, None, None)


# ---------------------------------------------------------------------------------------------------------------
# Flux trainers: xlabs, ai-toolkit


def _xlabs_flux(rng: random.Random, d: _Dims) -> _Sample:
    r = rng.choice((16, 32, 64))
    dtype = rng.choice(("BF16", "F32"))
    blocks = rng.choice((19, 19, 8))  # some xlabs LoRAs only train the first blocks
    h = d.hidden

    def build() -> Tensors:
        t: Tensors = {}
        for i in range(blocks):
            for j in ("1", "2"):  # 1: image stream, 2: text stream
                for proj, fout in (("qkv", 3 * h), ("proj", h)):
                    pre = f"double_blocks.{i}.processor.{proj}_lora{j}"
                    t[pre + ".down.weight"] = (dtype, (r, h))
                    t[pre + ".up.weight"] = (dtype, (fout, r))
        return t

    key = ("xlabs", d.hidden, r, dtype, blocks)
    return _Sample(key, build, None, None, None)


def _ai_toolkit_flux(rng: random.Random, d: _Dims) -> _Sample:
    r = rng.choice((16, 32, 64))
    dtype = rng.choice(("BF16", "F32"))
    prefix = rng.choice(("", "transformer."))
    metadata = {"format": "pt", "name": "my_flux_lora", "version": "1.0", "software": '{"name": "ai-toolkit"}'}

    def build() -> Tensors:
        t: Tensors = {}
        for path, fin, fout in _flux_bfl_linears(d, with_mod=False):
            _pair(t, prefix + path, dtype, r, fin, fout)
        return t

    key = ("ai_toolkit", d.hidden, r, dtype, prefix)
    return _Sample(key, build, metadata, None, None)


_BUILDERS: dict[str, Callable[[random.Random, _Dims], _Sample]] = {
    "peft_dense": lambda rng, d: _peft_llama(rng, d, "dense"),
    "peft_dora": lambda rng, d: _peft_llama(rng, d, "dora"),
    "peft_embeddings": lambda rng, d: _peft_llama(rng, d, "embeddings"),
    "peft_modules_to_save": lambda rng, d: _peft_llama(rng, d, "modules_to_save"),
    "peft_lora_bias": lambda rng, d: _peft_llama(rng, d, "lora_bias"),
    "peft_moe_2d_qwen": lambda rng, d: _peft_moe_2d(rng, d, "qwen"),
    "peft_moe_2d_mixtral": lambda rng, d: _peft_moe_2d(rng, d, "mixtral"),
    "peft_moe_stacked_3d": lambda rng, d: _peft_moe_3d(rng, d, shared_outer=False),
    "peft_moe_shared_outer": lambda rng, d: _peft_moe_3d(rng, d, shared_outer=True),
    "peft_moe_target_parameters": _peft_moe_target_parameters,
    "diffusers_peft": _diffusers_peft,
    "diffusers_legacy": _diffusers_legacy,
    "kohya_sd": _kohya_sd,
    "kohya_flux": _kohya_flux,
    "lycoris_loha": lambda rng, d: _lycoris(rng, d, "loha"),
    "lycoris_lokr": lambda rng, d: _lycoris(rng, d, "lokr"),
    "xlabs_flux": _xlabs_flux,
    "ai_toolkit_flux": _ai_toolkit_flux,
}
assert set(_BUILDERS) == set(KINDS)


def write_samples(out_dir: str | os.PathLike[str], n: int, seed: int = 0, hidden: int = 64) -> list[str]:
    """Write `n` sample adapters into `out_dir`, cycling through every kind in `KINDS`; return their paths.

    PEFT kinds become folders `NNNNN-<kind>/` (adapter_config.json + adapter_model.safetensors); the others
    are single files `NNNNN-<kind>.safetensors` or folders holding one `pytorch_lora_weights.safetensors`.
    The first `len(KINDS)` samples are one of each kind; later ones lean towards dense PEFT adapters.
    """
    if hidden < 8 or hidden % 8:
        raise ValueError("hidden must be a positive multiple of 8")
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    rng = random.Random(seed)
    dims = _Dims(hidden)
    rendered: dict[tuple[Any, ...], _Rendered] = {}
    paths: list[str] = []
    for i in range(n):
        kind = _CYCLE[i % len(_CYCLE)]
        s = _BUILDERS[kind](rng, dims)
        cache_key = (s.key, tuple(sorted((s.metadata or {}).items())) if s.metadata is not None else None)
        r = rendered.get(cache_key)
        if r is None:
            r = rendered[cache_key] = _render(s.build(), s.metadata)
        stem = os.path.join(out, f"{i:05d}-{kind}")
        if s.weight_name is None:
            path = stem + ".safetensors"
            _write_rendered(path, r)
        else:
            path = stem
            os.makedirs(path, exist_ok=True)
            _write_rendered(os.path.join(path, s.weight_name), r)
            if s.config is not None:
                with open(os.path.join(path, "adapter_config.json"), "w") as f:
                    f.write(json.dumps(s.config, sort_keys=True, indent=2))
        paths.append(path)
    return paths
