"""Typed results of a header-only scan: `Adapter`, `LoraModule`, `Problem`.

The Rust core classifies an adapter and hands back plain dicts; this module turns them into frozen,
typed objects. Nothing here reads tensor data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

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


def peft_pattern_key(patterns: Iterable[str], name: str) -> str | None:
    """PEFT `get_pattern_key`: the first `rank_pattern`/`alpha_pattern` key, in saved order, for which
    `re.match(rf"(.*\\.)?({key})$", name)` holds on the prefix-free module name; None when none does."""
    import re

    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return key
        except re.error:  # PEFT would fail on it too; it matches nothing here
            continue
    return None


#: SGLang renames `.w1.`/`.w3.`/`.w2.` tensors to gate/up/down before anything else (sglang-lora.md §4.2).
_SGLANG_W_RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


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
            from .scanner import _ADAPTER_TYPES

            report, row, cache = pending
            # Also gives the adapter its instance dict as `__init__` leaves it: every field, in field order
            # (`modules` among them), and nothing else.
            return report.adapter_modules(self, row, _ADAPTER_TYPES, cache)

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
    def sglang_target_modules(self) -> tuple[str, ...]:
        """`target_modules` as SGLang names them after loading (`.w1/.w3/.w2` renamed, q/k/v -> qkv_proj, ...)."""
        from .compat.sglang import get_normalized_target_modules

        renamed = [_SGLANG_W_RENAMES.get(t, t) for t in self.target_modules]
        return tuple(sorted(get_normalized_target_modules(renamed))) if renamed else ()

    @property
    def fingerprint(self) -> dict[str, int]:
        """Base-model dimensions visible in the shapes (hidden/intermediate size, layers, attention widths, experts,
        vocab, UNet/DiT layout); `lorafast.identify` ranks known families by them."""
        from .families import fingerprint

        return fingerprint(self)

    @property
    def is_additive(self) -> bool:
        """True when the delta is a plain sum of B @ A terms (safe to merge with others)."""
        return not (NON_ADDITIVE_VARIANTS & (set(self.variants) | ({"dora"} if "dora" in self.flags else set())))

    @property
    def ok(self) -> bool:
        return not self.problems


#: `Adapter`'s field names, in order.
_ADAPTER_FIELDS = tuple(f.name for f in fields(Adapter))
