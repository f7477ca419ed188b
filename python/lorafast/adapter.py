"""Typed results of a header-only scan: `Adapter`, `LoraModule`, `Problem`.

The Rust core classifies an adapter and hands back plain dicts; this module turns them into frozen,
typed objects. Nothing here reads tensor data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from lorafast import _core
from lorafast.formats.moe import SGLANG_W_RENAMES

if TYPE_CHECKING:
    from lorafast.codes import ModuleKind, ProblemCode


class AdapterFormat(str, Enum):
    """Which tool wrote the file, told from tensor names (and `adapter_config.json` when present)."""

    PEFT = "peft"  # adapter_config.json + `base_model.model.*.lora_A.weight`
    DIFFUSERS = "diffusers"  # PEFT-style keys under `unet.` / `transformer.` / `text_encoder.`
    DIFFUSERS_LEGACY = "diffusers_legacy"  # attention-processor keys: `to_q_lora.down.weight`, `lora_linear_layer`
    KOHYA = "kohya"  # `lora_unet_*` / `lora_te_*` with `.lora_down.weight` / `.lora_up.weight` / `.alpha`
    LYCORIS = "lycoris"  # LoHa / LoKr / OFT / GLoRA / full-diff keys
    XLABS = "xlabs"  # Flux `double_blocks.N.processor.qkv_lora1.down.weight`
    AI_TOOLKIT = "ai_toolkit"  # Flux `double_blocks.` / `single_blocks.` with `.lora_A` / `.lora_B`
    UNKNOWN = "unknown"


class MoeLayout(str, Enum):
    """How mixture-of-experts LoRA factors are stored (SGLang reference §10)."""

    DENSE = "dense"  # no expert tensors
    PER_EXPERT_2D = "per_expert_2d"  # `experts.N.<proj>.lora_A.weight`, one 2D pair per expert
    STACKED_3D = "stacked_3d"  # `experts.<proj>.lora_A.weight` shaped [E, r, in] with E > 1
    SHARED_OUTER = "shared_outer"  # gate_up lora_A (outer factor) shaped [1, r, in]
    PEFT_TARGET_PARAMETERS = "peft_target_parameters"  # `experts.base_layer.lora_A.weight` shaped (r*E, in)
    MIXED = "mixed"  # more than one of the above inside one adapter


#: Variants whose delta depends on W or is not a plain B @ A sum; they must never be merged as LoRA.
NON_ADDITIVE_VARIANTS = frozenset({"dora", "loha", "lokr", "oft", "boft", "ia3", "glora"})


@dataclass(frozen=True)
class Problem:
    """One inconsistency found in an adapter. `code` is stable; `message` is for people."""

    code: ProblemCode
    message: str
    tensor: str | None = None


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapted module: a lora_A/lora_B pair (or the factors of a LyCORIS variant).

    `key` is the module path exactly as in the file (wrapper prefixes kept), so the tensors are
    `a_key` / `b_key`; `name` is the same path without `base_model.model.` or a diffusers component
    prefix, the form PEFT matches `rank_pattern` against.
    """

    name: str
    key: str
    kind: ModuleKind  # one of `lorafast.codes.MODULE_KINDS`
    leaf: str  # last name component, e.g. "q_proj" (for target_parameters: "gate_up_proj" / "down_proj")
    layer: int | None
    expert: int | None
    num_experts: int | None
    rank: int | None
    in_features: int | None
    out_features: int | None
    dtype: str | None
    a_key: str | None
    b_key: str | None
    a_shape: tuple[int, ...] | None
    b_shape: tuple[int, ...] | None
    alpha: float | None  # None: no alpha anywhere, so alpha = rank and scale = 1
    alpha_key: str | None  # kohya `.alpha` 0-d tensor, when the file has one
    bias_key: str | None  # PEFT `lora_B.bias` (lora_bias=True)
    magnitude_key: str | None  # DoRA `lora_magnitude_vector` / `dora_scale`
    extra_keys: tuple[str, ...]  # other factor tensors (LoHa/LoKr/Tucker mid)
    config_rank: int | None  # rank that `r` / `rank_pattern` resolve to for this module (PEFT)
    use_rslora: bool
    weight_file: str

    @property
    def scale(self) -> float:
        """PEFT/kohya scaling: alpha / r (alpha / sqrt(r) with rsLoRA); 1.0 when alpha is unknown."""
        if self.alpha is None or not self.rank:
            return 1.0
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class Adapter:
    """Everything a header-only scan knows about one adapter."""

    path: str
    weight_files: tuple[str, ...]
    config_path: str | None
    format: AdapterFormat
    peft_type: str | None
    num_tensors: int
    dtypes: tuple[str, ...]
    layers: tuple[int, ...]
    base_model_name_or_path: str | None
    target_modules: tuple[str, ...]  # leaf names found in the tensors
    config: Mapping[str, Any] | None  # adapter_config.json as parsed (or diffusers `lora_adapter_metadata`)
    r: int | None
    lora_alpha: float | None
    use_rslora: bool
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    modules: tuple[LoraModule, ...]
    rank: int  # max over modules (0 when none)
    moe_layout: MoeLayout
    num_experts: int
    flags: frozenset[
        str
    ]  # dora, embeddings, modules_to_save, lora_bias, trainable_tokens, full_weights, conv, kohya_alpha
    variants: tuple[str, ...]  # non-LoRA families present: loha, lokr, oft, boft, ia3, glora, diff
    full_weight_tensors: tuple[
        str, ...
    ]  # tensors that are whole weights, not factors (modules_to_save, saved embeddings)
    problems: tuple[Problem, ...]
    content_hash: str | None = None
    metadata: Mapping[str, str] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    if not TYPE_CHECKING:  # to type checkers, an Adapter has only its declared attributes

        def __getattr__(self, name: str) -> Any:
            # Reached only for a name not in the instance dict: an adapter from iterating a report builds its
            # `modules` on first access (`_modules_pending` holds what to build them from; see rust/py/adapters.rs).
            pending = self.__dict__.get("_modules_pending") if name == "modules" else None
            if pending is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            report, row, cache = pending
            # Also gives the adapter its instance dict as `__init__` leaves it: every field, in field order
            # (`modules` among them), and nothing else.
            return report.adapter_modules(self, row, ADAPTER_TYPES, cache)

        def __getstate__(self) -> dict[str, Any]:
            # Copies and pickles hold the modules, not a reference to the report they would be built from.
            if "_modules_pending" in self.__dict__:
                self.modules  # noqa: B018 (builds them)
            return self.__dict__

    @property
    def ranks(self) -> dict[str, int]:
        """Rank per module name, read from the tensor shapes."""
        return {m.name: m.rank for m in self.modules if m.rank is not None}

    @property
    def name(self) -> str:
        """A short name: the folder (or file stem) the adapter lives in."""
        import os

        base = os.path.basename(self.path.rstrip("/"))
        return base[: -len(".safetensors")] if base.endswith(".safetensors") else base

    @property
    def fingerprint(self) -> dict[str, int]:
        """Base-model dimensions visible in the shapes (hidden/intermediate size, layers, attention widths, experts,
        vocab, UNet/DiT layout); `lorafast.identify` ranks known families by them."""
        rows = []
        for m in self.modules:
            name = m.key if m.key.startswith("lora_") else m.name  # kohya: underscores throughout
            rows.append((name, m.leaf, m.layer, m.in_features, m.out_features, m.num_experts))
        fp = module_dimensions(rows)
        if self.num_experts and "experts" not in fp:
            fp["experts"] = self.num_experts
        return fp

    @property
    def is_additive(self) -> bool:
        """True when the delta is a plain sum of B @ A terms (safe to merge with others)."""
        return not (NON_ADDITIVE_VARIANTS & (set(self.variants) | ({"dora"} if "dora" in self.flags else set())))

    @property
    def ok(self) -> bool:
        return not self.problems


#: `Adapter`'s field names, in order.
ADAPTER_FIELDS = tuple(f.name for f in fields(Adapter))

#: What the core builds report iteration's objects from (`ScanResult.adapter_objects`): the classes, the enum
#: members in column-code order, and `Adapter`'s field names in order.
ADAPTER_TYPES = (
    Adapter,
    LoraModule,
    Problem,
    tuple(AdapterFormat(name) for name in _core.FORMATS),
    tuple(MoeLayout(name) for name in _core.MOE_LAYOUTS),
    ADAPTER_FIELDS,
)


_BLOCK = re.compile(
    r"(?:^|[._])(transformer_blocks|single_transformer_blocks|double_blocks|single_blocks|joint_blocks|blocks)"
    r"[._](\d+)[._]"
)
_DOWN_ATTN = re.compile(r"down_blocks[._](\d+)[._]attentions")


def module_dimensions(
    items: Iterable[tuple[str, str, int | None, int | None, int | None, int | None]],
) -> dict[str, int]:
    """Fingerprint from (path, leaf, layer, in_features, out_features, experts) rows."""
    fp: dict[str, int] = {}
    blocks: dict[str, int] = {}
    down_attn: set[int] = set()

    def put(k: str, v: int | None) -> None:
        if v:
            fp.setdefault(k, v)

    for path, name, layer, fin, fout, experts in items:
        expert = experts or ".experts." in path
        leaf = SGLANG_W_RENAMES.get(name, name)  # Mixtral's w1/w3/w2 are gate/up/down
        if leaf == "q_proj":
            put("hidden", fin)
            put("q_out", fout)
        elif leaf in ("k_proj", "v_proj"):
            put("hidden", fin)
            put("kv_out", fout)
        elif leaf in ("o_proj",):
            put("hidden", fout)
        elif leaf in ("gate_proj", "up_proj"):
            put("hidden", fin)
            put("expert_intermediate" if expert else "intermediate", fout)
        elif leaf == "down_proj":
            put("hidden", fout)
            put("expert_intermediate" if expert else "intermediate", fin)
        elif leaf == "q_a_proj":
            put("hidden", fin)
            put("q_lora_rank", fout)
        elif leaf == "kv_a_proj_with_mqa":
            put("hidden", fin)
            put("kv_a_out", fout)
        elif leaf in ("embed_tokens",):
            put("vocab", fin)
        elif leaf == "lm_head":
            put("vocab", fout)
        elif leaf in ("to_k", "to_v") and "attn2" in path:
            put("cross_attention", fin)
        if experts:
            put("experts", experts)
        if layer is not None and leaf not in ("to_k", "to_q", "to_v", "to_out"):
            fp["layers"] = max(fp.get("layers", 0), layer + 1)
        m = _BLOCK.search(path)
        if m:
            kind = "dit_single_blocks" if m.group(1).startswith("single") else "dit_blocks"
            blocks[kind] = max(blocks.get(kind, 0), int(m.group(2)) + 1)
            if leaf in ("to_q", "qkv", "linear1", "img_attn_qkv", "to_k") and fin:
                put("dit_hidden", fin)
            if (leaf in ("proj", "0") or path.endswith(("ff.net.0.proj", "ffn.0", "img_mlp.0", "ff.net.0"))) and fout:
                put("dit_ff", fout)
        d = _DOWN_ATTN.search(path)
        if d:
            down_attn.add(int(d.group(1)))
        if ("up_blocks" in path or "down_blocks" in path or "mid_block" in path) and leaf == "proj_in" and fout:
            fp["unet_channels"] = max(fp.get("unet_channels", 0), fout)
    if blocks and "cross_attention" not in fp and not down_attn:
        fp.update(blocks)
        fp.pop("layers", None)
    if down_attn:
        fp["unet_attn_down_blocks"] = len(down_attn)
        fp.pop("layers", None)
    return fp
