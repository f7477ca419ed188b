"""Merge-mode planning: what `set_lora` would merge, keep dynamic, skip, unmerge or re-merge.

`plan(requests, engine_version=...)` replays the decisions of SGLang's diffusion `LoRAPipeline.set_lora` of that
release without touching a weight. SGLang's rules, names and texts live in `lorafast.compat.diffusion`; this
module imports them. tests/test_oracle_plan.py runs the released `set_lora` (0.5.23) on the same calls:

1. the merge mode is resolved (`merge_mode`, else `merge_weights`, else the server's `--lora-merge-mode`);
2. the parallel lists are normalized and the targets validated, with SGLang's exact error texts;
3. adapters are loaded or reloaded (a new or changed path, or a changed `lora_alpha`, sets `adapter_updated`);
4. per target, in first-seen order: the first module decides merge vs dynamic, several adapters on a dynamic
   target raise SGLang's exact `ValueError`, the "config matches" rule may skip, and every module is re-applied.
   From 0.5.23: quantized layers stay dynamic under "auto" (and refuse "merge"), and "auto" keeps a lone adapter
   unmerged where merging would round away more than half of its update, which needs weight values
   (`base_weights=`; without them the component is reported as undecided).

On top of SGLang it computes each adapter's effective scale per module (strength × alpha/r, or alpha/√r with
rsLoRA, honouring per-module alphas, rank_pattern and alpha_pattern), plans adapters that are not plain
B @ A sums (DoRA, LoHa, LoKr, OFT/BOFT, IA3, GLoRA) as separate steps against the current weight, and with
`resolve=True` turns the targets SGLang would reject into merges, saying why.

`Plan.next_state` is the pipeline state after the call, so a sequence of `set_lora` calls can be planned by
feeding it back as `current=` (or with `Plan.then`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from lorafast.adapter import peft_pattern_key
from lorafast.compat import _versions
from lorafast.compat import diffusion as _diffusion
from lorafast.compat.diffusion import LORA_MERGE_MODES, PIPELINE_MODULES, VALID_TARGETS
from lorafast.errors import LorafastError
from lorafast.scanner import inspect

if TYPE_CHECKING:
    import argparse

    from lorafast.adapter import Adapter, LoraModule

logger = logging.getLogger("lorafast.planner")

__all__ = [
    "DYNAMIC_MULTI_ADAPTER_ERROR",
    "LORA_MERGE_MODES",
    "VALID_TARGETS",
    "Action",
    "LoadEvent",
    "LoraRequest",
    "MergeStep",
    "PipelineState",
    "Plan",
    "PlanError",
    "PlannedAdapter",
    "TargetPlan",
    "module_scale",
    "normalize_lora_params",
    "plan",
    "plan_set_lora",
    "resolve_merge_mode",
    "should_merge",
]

# SGLang's rules, names and texts have one home, compat.diffusion (proven against the released set_lora):
# `LORA_MERGE_MODES` (a tuple in the invalid-mode error), `VALID_TARGETS` (a list in the invalid-target error),
# `PIPELINE_MODULES` (the order `_get_target_lora_layers("all")` lists components), and the messages.
DYNAMIC_MULTI_ADAPTER_ERROR = _diffusion.MSG_DYNAMIC_ONE_ADAPTER
CONFIG_MATCHES_MESSAGE = _diffusion.MSG_CONFIG_MATCHES
_MISSING_MODULE_MESSAGES = _diffusion.MSG_MISSING_MODULE

# Why each non-additive family cannot be summed with other deltas as plain LoRA.
_NON_ADDITIVE_WHY = {
    "dora": "DoRA rescales W + ΔW to a learned magnitude per output row, so its result depends on the weight "
    "it is applied to",
    "loha": "LoHa's delta is a Hadamard product (w1a·w1b) ⊙ (w2a·w2b), not B·A",
    "lokr": "LoKr's delta is a Kronecker product kron(w1, w2), not B·A",
    "oft": "OFT rotates the weight (W' = R·W): multiplicative, it depends on the current weight",
    "boft": "BOFT rotates the weight with butterfly factors: multiplicative, it depends on the current weight",
    "ia3": "IA3 rescales the weight elementwise: multiplicative, it depends on the current weight",
    "glora": "GLoRA's delta W·a1·a2 + b1·b2 depends on the current weight",
}
# Families whose delta reads W: applying two of them in a row is order-dependent.
_WEIGHT_DEPENDENT = frozenset({"dora", "oft", "boft", "ia3", "glora"})


class PlanError(LorafastError, ValueError):
    """A request lorafast refuses to plan (e.g. DoRA on a dynamic target). `.rejections` lists every reason."""

    def __init__(self, rejections: Sequence[str]) -> None:
        self.rejections = tuple(rejections)
        super().__init__("; ".join(self.rejections))


class Action(str, Enum):
    """What happens to a module's weights."""

    APPLY = "apply"  # nothing merged there: merge (or attach dynamically)
    SKIP = "skip"  # unchanged (SGLang's "config matches" rule), or the module does not exist
    UNMERGE_APPLY = "unmerge_apply"  # merged now: restore the snapshot, then apply the new set
    REMERGE = "remerge"  # merged with the same adapters in the same order: re-merge with new strengths

    @property
    def text(self) -> str:
        return {"apply": "apply", "skip": "skip", "unmerge_apply": "unmerge then apply", "remerge": "re-merge"}[
            self.value
        ]


# ---------------------------------------------------------------------------------------------------------------
# Requests and SGLang's argument handling


@dataclass(frozen=True)
class LoraRequest:
    """One adapter of a `set_lora` call: `nickname` (with `path` to load it) at `strength` on `target`."""

    nickname: str
    path: str | None = None
    strength: float = 1.0
    target: str = "all"
    alpha: float | None = None  # SGLang `lora_alpha`: overrides the adapter-level alpha


def resolve_merge_mode(
    merge_weights: bool | None,
    merge_mode: str | None,
    server_merge_mode: str = "auto",
    *,
    engine_version: str | None = None,
) -> str:
    """SGLang `_resolve_lora_merge_mode` (`compat.diffusion.resolve_lora_merge_mode`): explicit mode, else
    merge_weights, else the server's mode."""
    return _diffusion.resolve_lora_merge_mode(
        merge_mode, merge_weights, server_merge_mode, engine_version=engine_version
    )


def normalize_lora_params(
    lora_nickname: str | Sequence[str],
    lora_path: str | None | list[str | None] = None,
    strength: float | Sequence[float] = 1.0,
    target: str | Sequence[str] = "all",
    lora_alpha: float | None | list[float | None] = None,
    *,
    engine_version: str | None = None,
) -> tuple[list[str], list[str | None], list[float], list[str], list[float | None]]:
    """SGLang `_normalize_lora_params` + target validation (`compat.diffusion.normalize_lora_params` and
    `check_targets`), with the same broadcasting and error texts.

    Quirks kept on purpose: `lora_path` and `lora_alpha` count as lists only when they are `list`s (a tuple is
    one value), while `strength` and `target` broadcast only from a scalar.
    """
    nicknames = [lora_nickname] if isinstance(lora_nickname, str) else list(lora_nickname)
    targets_in = target if isinstance(target, str) else list(target)
    strength_in = strength if isinstance(strength, (int, float)) else list(strength)
    normalize: Any = _diffusion.normalize_lora_params  # takes float alphas too: SGLang only compares them to 0
    nicks, paths, strengths, targets, alphas = normalize(
        nicknames, lora_path, strength_in, targets_in, lora_alpha, engine_version=engine_version
    )
    _diffusion.check_targets(targets, engine_version=engine_version)
    return list(nicks), list(paths), strengths, list(targets), list(alphas)


def should_merge(
    module: str, sharded: bool, merge_mode: str, quantized: bool = False, *, engine_version: str | None = None
) -> tuple[bool, str | None, str | None]:
    """SGLang `_should_merge_lora_for_layers` (`compat.diffusion.should_merge_lora`): (merge?, info reason,
    warning). `sharded` = DTensor weights; `quantized` = layers whose weights cannot take a merged delta (0.5.23;
    "merge" on them raises SGLang's `ValueError`)."""
    merge = _diffusion.should_merge_lora(
        merge_mode, fsdp_sharded=sharded, quantized=quantized, module_name=module, engine_version=engine_version
    )
    log = _diffusion.merge_log(
        merge_mode, fsdp_sharded=sharded, quantized=quantized, module_name=module, engine_version=engine_version
    )
    if merge_mode == "dynamic":
        return False, "merge_mode='dynamic' never merges", None
    if merge_mode == "auto":
        if log is not None:
            return False, log, None
        return True, "merge_mode='auto' merges weights that are neither sharded nor quantized", None
    return merge, "merge_mode='merge' always merges", log


# ---------------------------------------------------------------------------------------------------------------
# Pipeline state


@dataclass(frozen=True)
class PipelineState:
    """What a diffusion pipeline holds before (or after) a `set_lora` call.

    Mirrors `LoRAPipeline`: `loaded_paths` / `loaded_alphas` are `loaded_adapter_paths` / `loaded_adapter_alphas`
    (nickname -> path / adapter-level alpha), `applied` is `cur_adapter_config` (module -> (nicknames,
    strengths)), `merged` is `is_lora_merged`. `modules` are the components present ("transformer" always;
    "transformer_2" for Wan2.2-style pipelines; "critic" with a fake-score transformer).
    """

    modules: tuple[str, ...] = ("transformer",)
    loaded_paths: Mapping[str, str] = field(default_factory=dict)
    loaded_alphas: Mapping[str, float | None] = field(default_factory=dict)
    applied: Mapping[str, tuple[tuple[str, ...], tuple[float, ...]]] = field(default_factory=dict)
    merged: Mapping[str, bool] = field(default_factory=dict)
    server_merge_mode: str = "auto"

    def __post_init__(self) -> None:
        modules = tuple(self.modules)
        unknown = [m for m in modules if m not in PIPELINE_MODULES]
        if unknown or "transformer" not in modules:
            raise ValueError(f"modules must include 'transformer' and be among {list(PIPELINE_MODULES)}: {modules}")
        object.__setattr__(self, "modules", tuple(m for m in PIPELINE_MODULES if m in modules))
        object.__setattr__(self, "loaded_paths", {str(k): str(v) for k, v in self.loaded_paths.items()})
        object.__setattr__(self, "loaded_alphas", dict(self.loaded_alphas))
        applied = {m: (tuple(cfg[0]), tuple(float(s) for s in cfg[1])) for m, cfg in self.applied.items()}
        object.__setattr__(self, "applied", applied)
        object.__setattr__(self, "merged", {m: bool(v) for m, v in self.merged.items()})

    @classmethod
    def from_pipeline(cls, pipeline: Any) -> PipelineState:
        """Read the state of a live SGLang `LoRAPipeline` (duck-typed: only its bookkeeping attributes)."""
        modules = ["transformer"]
        if getattr(pipeline, "lora_layers_transformer_2", None):
            modules.append("transformer_2")
        if getattr(pipeline, "lora_layers_critic", None):
            modules.append("critic")
        server_args = getattr(pipeline, "server_args", None)
        return cls(
            modules=tuple(modules),
            loaded_paths=dict(getattr(pipeline, "loaded_adapter_paths", {}) or {}),
            loaded_alphas=dict(getattr(pipeline, "loaded_adapter_alphas", {}) or {}),
            applied=dict(getattr(pipeline, "cur_adapter_config", {}) or {}),
            merged=dict(getattr(pipeline, "is_lora_merged", {}) or {}),
            server_merge_mode=getattr(server_args, "lora_merge_mode", None) or "auto",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "modules": list(self.modules),
            "loaded_paths": dict(self.loaded_paths),
            "loaded_alphas": dict(self.loaded_alphas),
            "applied": {m: {"nicknames": list(n), "strengths": list(s)} for m, (n, s) in self.applied.items()},
            "merged": dict(self.merged),
            "server_merge_mode": self.server_merge_mode,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineState:
        applied: dict[str, tuple[Sequence[str], Sequence[float]]] = {}
        for module, cfg in (data.get("applied") or {}).items():
            applied[module] = (cfg["nicknames"], cfg["strengths"]) if isinstance(cfg, Mapping) else (cfg[0], cfg[1])
        return cls(
            modules=tuple(data.get("modules") or ("transformer",)),
            loaded_paths=data.get("loaded_paths") or {},
            loaded_alphas=data.get("loaded_alphas") or {},
            applied=applied,  # type: ignore[arg-type]
            merged=data.get("merged") or {},
            server_merge_mode=data.get("server_merge_mode") or "auto",
        )

    def describe(self, module: str) -> str:
        cfg = self.applied.get(module)
        if cfg is None:
            return "nothing applied"
        state = "merged" if self.merged.get(module, False) else "dynamic"
        return f"{state} {_fmt_config(cfg[0], cfg[1])}"


# ---------------------------------------------------------------------------------------------------------------
# Effective scales


def module_scale(
    module: LoraModule, strength: float, adapter_alpha: float | None, alpha_pattern: Mapping[str, float] | None = None
) -> tuple[float, str]:
    """Effective scale of one module as SGLang's diffusion pipeline computes it, and where alpha came from.

    Alpha precedence (pipeline.py `_apply_lora_to_layers`): a per-module `.alpha` tensor (kohya; newer SGLang
    also turns `alpha_pattern` into those), then the adapter-level alpha (request `lora_alpha`, else the PEFT
    config), then the rank (scale 1). rsLoRA divides by √r instead of r.
    """
    if module.alpha_key is not None and module.alpha is not None:
        alpha, source = module.alpha, "tensor"
    elif alpha_pattern and module.alpha is not None and peft_pattern_key(alpha_pattern, module.name) is not None:
        alpha, source = module.alpha, "alpha_pattern"
    elif adapter_alpha is not None:
        alpha, source = adapter_alpha, "adapter"
    elif module.alpha is not None:
        alpha, source = module.alpha, "config"
    else:
        return float(strength), "rank"
    if not module.rank:
        return float(strength), source
    return strength * alpha / (math.sqrt(module.rank) if module.use_rslora else module.rank), source


# ---------------------------------------------------------------------------------------------------------------
# Plan objects


@dataclass(frozen=True)
class LoadEvent:
    """An adapter (re)loaded, or its alpha changed, by this call: each sets SGLang's `adapter_updated`."""

    nickname: str
    kind: str  # "load" | "reload" | "alpha"
    path: str
    previous_path: str | None = None
    alpha: float | None = None
    previous_alpha: float | None = None

    def text(self) -> str:
        if self.kind == "load":
            return f"load {self.nickname} from {self.path}" + (f" (alpha {_num(self.alpha)})" if self.alpha else "")
        if self.kind == "reload":
            return f"reload {self.nickname}: path {self.previous_path} -> {self.path}"
        return f"alpha of {self.nickname}: {_num(self.previous_alpha)} -> {_num(self.alpha)}"


@dataclass(frozen=True)
class PlannedAdapter:
    """One adapter of a target, in application order, with its effective scale per adapter module."""

    nickname: str
    path: str | None
    strength: float
    alpha: float | None  # adapter-level alpha as the pipeline holds it (request lora_alpha, else config)
    additive: bool | None  # None when the adapter could not be inspected
    variants: tuple[str, ...]
    scales: Mapping[str, float] | None  # adapter module name -> strength × alpha/r (None: not inspected)
    alpha_sources: Mapping[str, int]  # "tensor" / "alpha_pattern" / "adapter" / "config" / "rank" -> modules
    notes: tuple[str, ...] = ()

    def scale_summary(self) -> str:
        if self.scales is None:
            return "scales unknown (adapter not inspected)"
        if not self.scales:
            return "no LoRA modules"
        values = sorted(set(self.scales.values()))
        n = len(self.scales)
        if len(values) == 1:
            return f"scale {_num(values[0])} on {n} module{'s' if n != 1 else ''}"
        return f"scales {_num(values[0])}..{_num(values[-1])} on {n} modules ({len(values)} distinct)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "nickname": self.nickname,
            "path": self.path,
            "strength": self.strength,
            "alpha": self.alpha,
            "additive": self.additive,
            "variants": list(self.variants),
            "scales": None if self.scales is None else dict(self.scales),
            "alpha_sources": dict(self.alpha_sources),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class MergeStep:
    """One step against the current weight: a sum of plain LoRA deltas, one non-additive adapter, or dynamic."""

    kind: str  # "sum" | "sequential" | "dynamic"
    nicknames: tuple[str, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "nicknames": list(self.nicknames), "reason": self.reason}


@dataclass(frozen=True)
class TargetPlan:
    """The plan for one target of the call (targets are applied in the order they first appear)."""

    target: str
    modules: tuple[str, ...]  # pipeline components the target resolves to; empty when none exists
    adapters: tuple[PlannedAdapter, ...]
    mode: str  # "merge" | "dynamic": the first module's decision, as SGLang takes it
    module_modes: Mapping[str, str]
    action: Action  # the first module's action
    module_actions: Mapping[str, Action]
    steps: tuple[MergeStep, ...]
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    resolved: bool = False  # True when resolve=True turned an engine failure into a merge
    #: module -> the auto-merge rounding loss (0.5.23) where it was evaluated: the share of the update, by norm,
    #: that merging would round away (None: nothing to measure, so it merges)
    rounding_loss: Mapping[str, float | None] = field(default_factory=dict)
    #: modules whose merge SGLang decides from weight values the planner was not given (the rounding-loss rule):
    #: planned as merges, which is what SGLang does when merging loses at most half of the update
    undecided: tuple[str, ...] = ()

    @property
    def nicknames(self) -> tuple[str, ...]:
        return tuple(a.nickname for a in self.adapters)

    @property
    def strengths(self) -> tuple[float, ...]:
        return tuple(a.strength for a in self.adapters)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "modules": list(self.modules),
            "mode": self.mode,
            "module_modes": dict(self.module_modes),
            "action": self.action.value,
            "module_actions": {m: a.value for m, a in self.module_actions.items()},
            "adapters": [a.to_dict() for a in self.adapters],
            "steps": [s.to_dict() for s in self.steps],
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "resolved": self.resolved,
            "rounding_loss": dict(self.rounding_loss),
            "undecided": list(self.undecided),
        }


@dataclass(frozen=True)
class Plan:
    """Result of `plan()`. Iterate for `TargetPlan`s; `plan["transformer"]` looks one up by target."""

    merge_mode: str
    requests: tuple[LoraRequest, ...]
    targets: tuple[TargetPlan, ...]
    loads: tuple[LoadEvent, ...]
    adapter_updated: bool
    warnings: tuple[str, ...]
    current: PipelineState
    next_state: PipelineState
    weights_sharded: bool | Mapping[str, bool] = False
    resolve: bool = False
    tolerance: float = 0.0
    #: path -> error for adapters that could not be inspected (planned with unknown scales)
    unreadable: Mapping[str, str] = field(default_factory=dict)
    #: the SGLang version whose set_lora rules the plan follows
    engine_version: str = ""
    quantized: bool | Mapping[str, bool] = False
    _adapter_cache: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def undecided(self) -> list[tuple[str, str]]:
        """(target, module) pairs whose merge-or-dynamic choice needs weight values the planner was not given."""
        return [(t.target, m) for t in self.targets for m in t.undecided]

    def __iter__(self) -> Iterator[TargetPlan]:
        return iter(self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, target: str) -> TargetPlan:
        for t in self.targets:
            if t.target == target:
                return t
        raise KeyError(target)

    @property
    def actions(self) -> dict[str, str]:
        """Target -> action value (e.g. {"all": "apply"})."""
        return {t.target: t.action.value for t in self.targets}

    def then(self, requests: Any, **kwargs: Any) -> Plan:
        """Plan the next `set_lora` call against this plan's `next_state` (same options unless overridden)."""
        kwargs.setdefault("weights_sharded", self.weights_sharded)
        kwargs.setdefault("resolve", self.resolve)
        kwargs.setdefault("tolerance", self.tolerance)
        kwargs.setdefault("adapters", dict(self._adapter_cache))
        kwargs.setdefault("engine_version", self.engine_version or None)
        kwargs.setdefault("quantized", self.quantized)
        for key, value in self._options.items():
            kwargs.setdefault(key, value)
        return plan(requests, current=self.next_state, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "merge_mode": self.merge_mode,
            "requests": [
                {"nickname": r.nickname, "path": r.path, "strength": r.strength, "target": r.target, "alpha": r.alpha}
                for r in self.requests
            ],
            "loads": [
                {
                    "nickname": e.nickname,
                    "kind": e.kind,
                    "path": e.path,
                    "previous_path": e.previous_path,
                    "alpha": e.alpha,
                    "previous_alpha": e.previous_alpha,
                }
                for e in self.loads
            ],
            "adapter_updated": self.adapter_updated,
            "targets": [t.to_dict() for t in self.targets],
            "warnings": list(self.warnings),
            "weights_sharded": self.weights_sharded
            if isinstance(self.weights_sharded, bool)
            else dict(self.weights_sharded),
            "resolve": self.resolve,
            "tolerance": self.tolerance,
            "unreadable": dict(self.unreadable),
            "engine_version": self.engine_version,
            "quantized": self.quantized if isinstance(self.quantized, bool) else dict(self.quantized),
            "undecided": [list(u) for u in self.undecided],
            "current": self.current.to_dict(),
            "next_state": self.next_state.to_dict(),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def explain(self) -> str:
        """A readable account of the plan: loads, then per target the mode, action, adapters, steps and why."""
        sharded = self.weights_sharded
        sharded_text = (
            ("weights sharded (FSDP)" if sharded else "weights not sharded")
            if isinstance(sharded, bool)
            else "sharded: " + (", ".join(m for m, s in sharded.items() if s) or "none")
        )
        n = len(self.requests)
        lines = [
            f"lorafast plan: {n} adapter{'s' if n != 1 else ''} on {len(self.targets)} "
            f"target{'s' if len(self.targets) != 1 else ''}; merge_mode={self.merge_mode}; {sharded_text}"
            + (f"; SGLang {self.engine_version}" if self.engine_version else "")
            + ("; resolve=True" if self.resolve else "")
        ]
        if self.loads:
            lines.append("loads (each sets adapter_updated, so no target is skipped):")
            lines.extend(f"  - {e.text()}" for e in self.loads)
        for t in self.targets:
            where = ", ".join(t.modules) if t.modules else "no module"
            lines.append(f"target {t.target!r} -> {where}")
            modes = set(t.module_modes.values())
            mode_text = t.mode if len(modes) <= 1 else ", ".join(f"{m}: {v}" for m, v in t.module_modes.items())
            actions = set(t.module_actions.values())
            if len(actions) <= 1:
                action_text = t.action.text
            else:
                action_text = ", ".join(f"{m}: {a.text}" for m, a in t.module_actions.items())
            lines.append(f"  mode: {mode_text}; action: {action_text}" + (" (resolved)" if t.resolved else ""))
            for i, a in enumerate(t.adapters, 1):
                kind = "" if a.additive is None or a.additive else f" [{', '.join(a.variants) or 'non-additive'}]"
                lines.append(f"  {i}. {a.nickname}{kind}  strength {_num(a.strength)}  {a.scale_summary()}")
                lines.extend(f"       note: {note}" for note in a.notes)
            if t.action is not Action.SKIP and t.steps:
                lines.append("  steps:")
                lines.extend(
                    f"    {i}) {s.kind}: {', '.join(s.nicknames)} - {s.reason}" for i, s in enumerate(t.steps, 1)
                )
            lines.append("  why:")
            lines.extend(f"    - {r}" for r in t.reasons)
            lines.extend(f"  warning: {w}" for w in t.warnings)
            if t.undecided:
                lines.append(f"  undecided: {', '.join(t.undecided)} (needs weight values; planned as merge)")
        other = [w for w in self.warnings if not any(w in t.warnings for t in self.targets)]
        lines.extend(f"warning: {w}" for w in other)
        lines.append("next state: " + "; ".join(f"{m}: {self.next_state.describe(m)}" for m in self.next_state.modules))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Planning


def plan(
    requests: Any,
    *,
    merge_mode: str | None = None,
    current: PipelineState | None = None,
    weights_sharded: bool | Mapping[str, bool] = False,
    resolve: bool = False,
    merge_weights: bool | None = None,
    tolerance: float = 0.0,
    adapters: Mapping[str, Adapter] | Iterable[Adapter] | None = None,
    modules: Sequence[str] | None = None,
    engine_version: str | None = None,
    quantized: bool | Mapping[str, bool] = False,
    base_weights: Mapping[str, Any] | None = None,
    rounding_loss: Mapping[str, float | None] | None = None,
    cache_merged: bool = False,
) -> Plan:
    """Plan one `set_lora` call.

    `requests`: a `LoraRequest`, a sequence of them, or a mapping of `set_lora` keyword arguments
    (`lora_nickname`, `lora_path`, `strength`, `target`, `lora_alpha`, optionally `merge_mode`/`merge_weights`).
    `merge_mode=None` resolves like SGLang: `merge_weights`, then the server's mode (`current.server_merge_mode`,
    "auto" by default), so the default behaves as "auto". `weights_sharded` is a bool or a per-module mapping
    (FSDP DTensor weights). `tolerance` loosens the float equality of the skip rule (0: exact, like SGLang).
    `adapters` supplies already-inspected adapters keyed by nickname or path; others are read with
    `lorafast.inspect`. `modules` overrides the pipeline components of `current`.

    `engine_version` ("0.5.23"; default: the installed SGLang, else the newest supported) picks the `set_lora`
    rules, which live in `lorafast.compat.diffusion`. From 0.5.23 on:
    - `quantized` (a bool or a per-module mapping) marks components whose LoRA layers hold quantized weights
      that cannot take a merged delta: "auto" keeps them dynamic, "merge" raises SGLang's `ValueError`;
    - "auto" keeps a lone adapter unmerged on a component when merging it would round away more than half of
      its update (by norm). That needs values: with `base_weights` ({component: {layer: tensor}} or
      {component: safetensors file}, layer names as the adapter's after SGLang's format conversion) the loss
      is computed as SGLang computes it (`compat.diffusion.merge_rounding_loss`, torch); `rounding_loss`
      ({component: loss}) gives measured values. Without either the component is planned as a merge and
      listed in `TargetPlan.undecided` / `Plan.undecided`, with a warning;
    - `cache_merged=True` (SGLang's start-up adapter) notes the file-backed merge cache; it changes how a
      merge is done, not whether.
    Versions before 0.5.23 are planned without these three rules.

    Raises SGLang's exact `ValueError`s (invalid mode, list lengths, alpha, targets, unknown adapter, several
    adapters on a dynamic target unless `resolve=True`), and `PlanError` for non-additive adapters on a dynamic
    target (unless `resolve=True`).
    """
    state = current if current is not None else PipelineState()
    if modules is not None:
        state = replace(state, modules=tuple(modules))
    version = ".".join(str(p) for p in _versions.resolve("sglang", engine_version))
    params, merge_mode, merge_weights = _request_params(requests, merge_mode, merge_weights)
    mode = resolve_merge_mode(merge_weights, merge_mode, state.server_merge_mode, engine_version=version)
    nicknames, paths, strengths, targets, alphas = normalize_lora_params(*params, engine_version=version)
    planner = _Planner(state, mode, weights_sharded, resolve, tolerance, adapters)
    planner.engine_version = version
    planner.rules = _diffusion.has_merge_rules(version)
    planner.quantized = quantized
    planner.base_weights = dict(base_weights or {})
    planner.given_loss = dict(rounding_loss or {})
    planner.cache_merged = cache_merged
    return planner.run(nicknames, paths, strengths, targets, alphas)


def plan_set_lora(
    lora_nickname: str | Sequence[str],
    lora_path: str | None | list[str | None] = None,
    target: str | Sequence[str] = "all",
    strength: float | Sequence[float] = 1.0,
    merge_weights: bool | None = None,
    merge_mode: str | None = None,
    lora_alpha: float | None | list[float | None] = None,
    **kwargs: Any,
) -> Plan:
    """`plan()` with `LoRAPipeline.set_lora`'s exact signature (keyword options of `plan()` go in `kwargs`)."""
    return plan(
        {
            "lora_nickname": lora_nickname,
            "lora_path": lora_path,
            "target": target,
            "strength": strength,
            "lora_alpha": lora_alpha,
        },
        merge_mode=merge_mode,
        merge_weights=merge_weights,
        **kwargs,
    )


_SET_LORA_KEYS = frozenset(
    {"lora_nickname", "lora_path", "target", "strength", "lora_alpha", "merge_mode", "merge_weights"}
)


def _request_params(requests: Any, merge_mode: str | None, merge_weights: bool | None) -> tuple[tuple, Any, Any]:
    """Turn any accepted request form into `_normalize_lora_params` arguments."""
    if isinstance(requests, LoraRequest):
        requests = [requests]
    if isinstance(requests, Mapping):
        unknown = set(requests) - _SET_LORA_KEYS
        if unknown:
            raise TypeError(f"unknown set_lora argument(s): {sorted(unknown)}")
        if "lora_nickname" not in requests:
            raise TypeError("set_lora arguments need 'lora_nickname'")
        if merge_mode is None:
            merge_mode = requests.get("merge_mode")
        if merge_weights is None:
            merge_weights = requests.get("merge_weights")
        params = (
            requests["lora_nickname"],
            requests.get("lora_path"),
            requests.get("strength", 1.0),
            requests.get("target", "all"),
            requests.get("lora_alpha"),
        )
        return params, merge_mode, merge_weights
    items = list(requests)
    if not items:
        raise ValueError("plan() needs at least one LoraRequest")
    if not all(isinstance(r, LoraRequest) for r in items):
        raise TypeError("requests must be LoraRequest objects or a mapping of set_lora arguments")
    params = (
        [r.nickname for r in items],
        [r.path for r in items],
        [r.strength for r in items],
        [r.target for r in items],
        [r.alpha for r in items],
    )
    return params, merge_mode, merge_weights


def _resolve_target(target: str, modules: Sequence[str]) -> tuple[list[str], str | None]:
    """SGLang `_get_target_lora_layers`: components for a target, or the warning it logs."""
    if target == "all":
        return [m for m in PIPELINE_MODULES if m in modules], None
    if target in modules:
        return [target], None
    return [], _MISSING_MODULE_MESSAGES.get(target, f"Invalid target: {target}. Valid targets: {VALID_TARGETS}")


def _floats_equal(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    if len(a) != len(b):
        return False
    if tolerance <= 0:
        return list(a) == list(b)
    return all(math.isclose(x, y, rel_tol=0.0, abs_tol=tolerance) for x, y in zip(a, b, strict=True))


def _add_note(err: BaseException, note: str) -> None:
    """PEP 678 note (3.11+); on 3.10 the note is kept in `__notes__` where tracebacks ignore it."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:  # pragma: no cover - Python 3.10
        err.__notes__ = [*getattr(err, "__notes__", []), note]  # type: ignore[attr-defined]


def _num(x: float | None) -> str:
    if x is None:
        return "none"
    return f"{x:.6g}"


def _fmt_config(nicknames: Sequence[str], strengths: Sequence[float]) -> str:
    return "[" + ", ".join(f"{n}@{_num(s)}" for n, s in zip(nicknames, strengths, strict=False)) + "]"


def _adapter_variants(adapter: Adapter) -> tuple[str, ...]:
    variants = list(adapter.variants)
    if "dora" in adapter.flags and "dora" not in variants:
        variants.insert(0, "dora")
    return tuple(variants)


def _config_alpha(adapter: Adapter | None) -> float | None:
    """What `get_peft_lora_alpha` stores on load when no `lora_alpha` is requested."""
    if adapter is None or adapter.lora_alpha is None:
        return None
    a = adapter.lora_alpha
    return int(a) if float(a).is_integer() else a


def _measure_rounding_loss(base: Any, path: str, strength: float, adapter_alpha: float | None) -> float | None:
    """SGLang 0.5.23's rounding loss of one adapter on one component, from the adapter's values.

    The adapter is read as SGLang's diffusion loader reads it (`compat.diffusion.load_lora_adapter`); layer `X`
    takes `X.lora_A`/`X.lora_B` (names without `diffusion_model.` and `.weight`, as `load_lora_adapter` strips
    them), with `_apply_lora_to_layers`' alpha: the layer's `.alpha` tensor (as an int), else the adapter's
    alpha, else the rank. `base` maps layer names to base weights, or is a safetensors file of them.
    """
    loaded = _diffusion.load_lora_adapter(path)
    tensors: dict[str, Any] = {}
    for name, t in loaded.tensors.items():
        tensors[name.replace("diffusion_model.", "").replace(".weight", "")] = t
    if isinstance(base, (str, os.PathLike)):
        from safetensors.torch import load_file

        base = load_file(os.fspath(base))
    layers = []
    for name, weight in base.items():
        layer = name[: -len(".weight")] if name.endswith(".weight") else name
        a, b = tensors.get(layer + ".lora_A"), tensors.get(layer + ".lora_B")
        if a is None or b is None:
            continue
        rank = int(a.shape[-2])
        alpha_t = tensors.get(layer + ".alpha")
        if alpha_t is not None:
            value = alpha_t.value if alpha_t.value is not None else _diffusion._real(alpha_t).item()
            alpha: float | None = int(value)
        elif adapter_alpha is not None:
            alpha = adapter_alpha
        else:
            alpha = rank
        a_values, b_values = _diffusion._real(a), _diffusion._real(b)
        if a_values is None or b_values is None:
            raise ValueError(f"the values of {layer}'s LoRA weights are not readable after conversion")
        layers.append((weight, [(a_values, b_values, strength, rank, alpha)]))
    return _diffusion.merge_rounding_loss(layers)


class _Planner:
    """Replays one `set_lora` call over a copy of the pipeline state."""

    def __init__(
        self,
        state: PipelineState,
        mode: str,
        weights_sharded: bool | Mapping[str, bool],
        resolve: bool,
        tolerance: float,
        adapters: Mapping[str, Adapter] | Iterable[Adapter] | None,
    ) -> None:
        self.state = state
        self.mode = mode
        self.weights_sharded = weights_sharded
        self.resolve = resolve
        self.tolerance = float(tolerance)
        self.cache: dict[str, Any] = {}
        if isinstance(adapters, Mapping):
            self.cache.update(adapters)
        elif adapters is not None:
            for a in adapters:
                self.cache[a.path] = a
                self.cache.setdefault(a.name, a)
        self.read_errors: dict[str, str] = {}
        self.engine_version = ""
        self.rules = True
        self.quantized: bool | Mapping[str, bool] = False
        self.base_weights: dict[str, Any] = {}
        self.given_loss: dict[str, float | None] = {}
        self.cache_merged = False
        # SGLang's `auto_merge_rounding_loss`: (module, paths, strengths, alphas) -> loss, or why it is unknown
        self.losses: dict[tuple, tuple[bool, float | None, str]] = {}

    def is_quantized(self, module: str) -> bool:
        if isinstance(self.quantized, Mapping):
            return bool(self.quantized.get(module, False))
        return bool(self.quantized)

    def merge_decision(self, module: str) -> tuple[bool, str | None, str | None]:
        return should_merge(
            module, self.sharded(module), self.mode, self.is_quantized(module), engine_version=self.engine_version
        )

    def rounding_loss(
        self, module: str, nickname: str, path: str | None, strength: float, alpha: float | None
    ) -> tuple[bool, float | None, str]:
        """`_auto_merge_rounds_away`'s measurement for one adapter on one component: (known?, loss, why not)."""
        key = (module, path, strength, alpha)
        if key in self.losses:
            return self.losses[key]
        if module in self.given_loss:
            out: tuple[bool, float | None, str] = (True, self.given_loss[module], "")
        elif module not in self.base_weights:
            out = (False, None, f"no base weights for {module}")
        elif path is None:
            out = (False, None, f"no path for {nickname}")
        else:
            try:
                out = (True, _measure_rounding_loss(self.base_weights[module], path, strength, alpha), "")
            except Exception as e:  # unreadable file, no torch, ...: the rule stays undecided, with why
                out = (False, None, f"{type(e).__name__}: {e}")
        self.losses[key] = out
        return out

    def config_alpha(self, nickname: str, path: str) -> float | None:
        """The alpha SGLang's diffusion `load_lora_adapter` keeps when no `lora_alpha` is asked for:
        `get_peft_lora_alpha(load_peft_config(file))` (compat.diffusion: `adapter_config.json` next to the file,
        completed from its metadata), whose `ValueError`s are SGLang's. A path that is not a local file or
        folder (a Hub id SGLang would download) falls back to the inspected adapter's config."""
        try:
            weight = _diffusion._weight_file(path) if os.path.exists(path) else None
        except (OSError, ValueError):
            weight = None
        if weight is not None and os.path.isfile(weight):
            config = _diffusion.load_peft_config(weight, engine_version=self.engine_version or None)
            return _diffusion.get_peft_lora_alpha(config, engine_version=self.engine_version or None)
        return _config_alpha(self.adapter(nickname, path))

    def sharded(self, module: str) -> bool:
        if isinstance(self.weights_sharded, Mapping):
            return bool(self.weights_sharded.get(module, False))
        return bool(self.weights_sharded)

    def adapter(self, nickname: str, path: str | None) -> Adapter | None:
        """The inspected adapter for a request: supplied by the caller, cached, or read with lorafast.inspect."""
        for key in (path, os.path.abspath(path) if path else None):
            if key is not None and self.cache.get(key) is not None:
                return self.cache[key]
        by_name = self.cache.get(nickname)
        # a nickname entry only answers for the same file: a reload to a new path must read the new adapter
        if by_name is not None and (path is None or os.path.abspath(str(by_name.path)) == os.path.abspath(path)):
            return by_name
        if path is None:
            return None
        if path in self.read_errors:
            return None
        try:
            adapter = inspect(path)
        except Exception as e:
            self.read_errors[path] = f"{type(e).__name__}: {e}"
            return None
        self.cache[path] = adapter
        return adapter

    def run(
        self,
        nicknames: list[str],
        paths: list[str | None],
        strengths: list[float],
        targets: list[str],
        alphas: list[float | None],
    ) -> Plan:
        st = self.state
        loaded_paths = dict(st.loaded_paths)
        loaded_alphas = dict(st.loaded_alphas)
        applied = dict(st.applied)
        merged = dict(st.merged)
        warnings: list[str] = []
        rejections: list[str] = []

        # Step 6 of set_lora: load or reload adapters, update alphas.
        loads: list[LoadEvent] = []
        adapter_updated = False
        for nickname, path, alpha in zip(nicknames, paths, alphas, strict=True):
            if nickname not in loaded_paths and path is None:
                raise ValueError(f"Adapter {nickname} not found in the pipeline. Please provide lora_path to load it.")
            if path is not None and loaded_paths.get(nickname) != path:
                previous = loaded_paths.get(nickname)
                new_alpha = alpha if alpha is not None else self.config_alpha(nickname, path)
                loads.append(
                    LoadEvent(
                        nickname,
                        "load" if previous is None else "reload",
                        path,
                        previous_path=previous,
                        alpha=new_alpha,
                        previous_alpha=loaded_alphas.get(nickname),
                    )
                )
                loaded_paths[nickname] = path
                loaded_alphas[nickname] = new_alpha
                adapter_updated = True
            elif alpha is not None and loaded_alphas.get(nickname) != alpha:
                loads.append(
                    LoadEvent(
                        nickname,
                        "alpha",
                        loaded_paths[nickname],
                        alpha=alpha,
                        previous_alpha=loaded_alphas.get(nickname),
                    )
                )
                loaded_alphas[nickname] = alpha
                adapter_updated = True
        updated_names = list(dict.fromkeys(e.nickname for e in loads))

        # Step 7: group by target, in first-seen order.
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(targets):
            groups.setdefault(t, []).append(i)

        touched: dict[str, str] = {}  # module -> target that applied to it earlier in this call
        target_plans: list[TargetPlan] = []
        for target, idx in groups.items():
            tgt_nicks = [nicknames[i] for i in idx]
            tgt_strengths = [strengths[i] for i in idx]
            tgt_paths = [paths[i] or loaded_paths.get(nicknames[i]) for i in idx]
            t_modules, missing = _resolve_target(target, st.modules)
            planned = [
                self.planned_adapter(n, p, s, loaded_alphas.get(n))
                for n, p, s in zip(tgt_nicks, tgt_paths, tgt_strengths, strict=True)
            ]
            if missing is not None:
                logger.info("set_lora: %s", missing)
                warnings.append(missing)
            if not t_modules:
                target_plans.append(
                    TargetPlan(
                        target=target,
                        modules=(),
                        adapters=tuple(planned),
                        mode="none",
                        module_modes={},
                        action=Action.SKIP,
                        module_actions={},
                        steps=(),
                        reasons=(f"{missing}: SGLang logs a warning and applies nothing",),
                        warnings=(missing,) if missing else (),
                    )
                )
                continue

            reasons: list[str] = []
            t_warnings: list[str] = []
            resolved = False
            first = t_modules[0]
            first_merge, why, warn = self.merge_decision(first)
            reasons.append(why or "")
            if warn:
                t_warnings.append(warn)
            if not first_merge and len(tgt_nicks) > 1:
                cannot_merge = self.rules and self.is_quantized(first)
                if not self.resolve or cannot_merge:
                    err = ValueError(DYNAMIC_MULTI_ADAPTER_ERROR)
                    _add_note(
                        err,
                        f"lorafast: target {target!r} resolves to dynamic LoRA on {first} with {len(tgt_nicks)} "
                        "adapters; "
                        + (
                            "its quantized weights cannot take a merged delta, so only one adapter can go there."
                            if cannot_merge
                            else "plan(..., resolve=True) plans it as a merge, or pass merge_mode='merge'."
                        ),
                    )
                    raise err
                first_merge, resolved = True, True
                reasons.append(
                    f"resolved: {len(tgt_nicks)} adapters on a dynamic target would raise SGLang's "
                    f'"{DYNAMIC_MULTI_ADAPTER_ERROR}"; planned as a merge instead'
                )

            module_merge: dict[str, bool] = {first: first_merge}
            for m in t_modules[1:]:
                m_merge, m_why, m_warn = self.merge_decision(m)
                if m_warn:
                    t_warnings.append(m_warn)
                if not m_merge and len(tgt_nicks) > 1:
                    if self.resolve and not (self.rules and self.is_quantized(m)):
                        m_merge, resolved = True, True
                        reasons.append(
                            f"resolved: {m} would be dynamic ({m_why}) with {len(tgt_nicks)} adapters, and dynamic "
                            "LoRA keeps only the last one per layer; planned as a merge instead"
                        )
                    else:
                        t_warnings.append(
                            f"{m}: {m_why} SGLang applies all {len(tgt_nicks)} adapters dynamically there, and its "
                            "dynamic layer uses only the last one; plan with resolve=True to merge instead"
                        )
                elif m_why and m_merge != first_merge:
                    reasons.append(f"{m}: {m_why}")
                module_merge[m] = m_merge

            # Non-additive adapters need the weight: they cannot ride a dynamic LoRA layer.
            non_additive = [a for a in planned if a.additive is False]
            for m in t_modules:
                if module_merge[m] or not non_additive:
                    continue
                names = ", ".join(f"{a.nickname} ({'/'.join(a.variants)})" for a in non_additive)
                if self.resolve:
                    module_merge[m], resolved = True, True
                    reasons.append(
                        f"resolved: {names} cannot be applied dynamically on {m} (the dynamic layer computes only "
                        "x·Aᵀ·Bᵀ); planned as a merge instead"
                    )
                else:
                    rejections.append(
                        f"target {target!r}: {names} cannot be applied as dynamic LoRA on {m}: the dynamic layer "
                        "computes only x·Aᵀ·Bᵀ, and these adapters need the weight itself. Use merge_mode='merge', "
                        "or plan(..., resolve=True)"
                    )
            first_merge = module_merge[first]

            # Skip rule (SGLang `_check_lora_config_matches`), on the first module only.
            skip, skip_why = self.config_matches(
                applied, merged, first, tgt_nicks, tgt_strengths, first_merge, adapter_updated, updated_names
            )
            module_actions: dict[str, Action] = {}
            losses: dict[str, float | None] = {}
            undecided: list[str] = []
            if skip:
                reasons.append(CONFIG_MATCHES_MESSAGE + (f" ({skip_why})" if skip_why else ""))
                module_actions = {m: Action.SKIP for m in t_modules}
            else:
                reasons.append(skip_why)
                if self.rules and self.mode == "auto" and len(tgt_nicks) == 1:
                    # 0.5.23 `_auto_merge_rounds_away`, per component that would merge, after the skip rule
                    for m in t_modules:
                        if not module_merge[m]:
                            continue
                        known, loss, why_not = self.rounding_loss(
                            m, tgt_nicks[0], tgt_paths[0], tgt_strengths[0], loaded_alphas.get(tgt_nicks[0])
                        )
                        if not known:
                            undecided.append(m)
                            t_warnings.append(
                                f"{m}: merge_mode='auto' keeps {tgt_nicks[0]} unmerged when merging it would round "
                                f"away more than {_diffusion.AUTO_MERGE_MAX_ROUNDING_LOSS:.0%} of its update; "
                                f"that needs the base weights' values ({why_not}): planned as a merge, undecided. "
                                "Pass base_weights= or rounding_loss=, or merge_mode='merge' or 'dynamic'"
                            )
                            continue
                        losses[m] = loss
                        if _diffusion.auto_merge_rounds_away(loss):
                            module_merge[m] = False
                            reasons.append(
                                _diffusion.MSG_STAYS_UNMERGED.format(
                                    paths=str(tgt_paths[0]), module=m, percent=100 * (loss or 0.0)
                                )
                            )
                        else:
                            reasons.append(
                                f"{m}: merging rounds away "
                                + ("nothing measurable" if loss is None else f"{100 * loss:.0f}% of the update")
                                + f" (at most {_diffusion.AUTO_MERGE_MAX_ROUNDING_LOSS:.0%}): merged"
                            )
                if self.rules and self.cache_merged and any(module_merge.values()):
                    reasons.append(
                        "cache_merged: SGLang writes the merged weights to its file-backed merge cache (or adopts "
                        "a complete one of the same base, adapters and strengths) when the weights are on CPU, "
                        "the process is one rank and SGLANG_DIFFUSION_DISABLE_LORA_MERGE_CACHE is unset; the "
                        "decision is the same"
                    )
                for m in t_modules:
                    action, why = self.module_action(
                        applied, merged, m, tgt_nicks, tgt_strengths, module_merge[m], adapter_updated
                    )
                    module_actions[m] = action
                    if why:
                        reasons.append(f"{m}: {why}")
                    if m in touched:
                        prev = applied.get(m, ((), ()))
                        new = _fmt_config(tgt_nicks, tgt_strengths)
                        t_warnings.append(
                            f"target {target!r} re-applies {m} with clear_existing=True after target {touched[m]!r} in "
                            f"the same call: {_fmt_config(*prev)} is replaced by {new}"
                        )
                for m in t_modules:
                    applied[m] = (tuple(tgt_nicks), tuple(tgt_strengths))
                    merged[m] = module_merge[m]
                    touched[m] = target

            first_merge = module_merge[first]
            steps = self.steps(planned, first_merge, t_warnings if not skip else [])
            for w in t_warnings:
                logger.info("%s", w)
            warnings.extend(w for w in t_warnings if w not in warnings)
            target_plans.append(
                TargetPlan(
                    target=target,
                    modules=tuple(t_modules),
                    adapters=tuple(planned),
                    mode="merge" if first_merge else "dynamic",
                    module_modes={m: "merge" if v else "dynamic" for m, v in module_merge.items()},
                    action=module_actions[first],
                    module_actions=module_actions,
                    steps=steps,
                    reasons=tuple(r for r in reasons if r),
                    warnings=tuple(t_warnings),
                    resolved=resolved,
                    rounding_loss=losses,
                    undecided=tuple(undecided),
                )
            )

        if rejections:
            raise PlanError(rejections)
        for path, error in self.read_errors.items():
            warnings.append(f"could not inspect {path}: {error}; its scales are unknown")

        requests = tuple(
            LoraRequest(n, p, s, t, a)
            for n, p, s, t, a in zip(nicknames, paths, strengths, targets, alphas, strict=True)
        )
        next_state = PipelineState(
            modules=st.modules,
            loaded_paths=loaded_paths,
            loaded_alphas=loaded_alphas,
            applied=applied,
            merged=merged,
            server_merge_mode=st.server_merge_mode,
        )
        return Plan(
            merge_mode=self.mode,
            requests=requests,
            targets=tuple(target_plans),
            loads=tuple(loads),
            adapter_updated=adapter_updated,
            warnings=tuple(warnings),
            current=st,
            next_state=next_state,
            weights_sharded=self.weights_sharded,
            resolve=self.resolve,
            tolerance=self.tolerance,
            unreadable=dict(self.read_errors),
            engine_version=self.engine_version,
            quantized=self.quantized,
            _adapter_cache={k: v for k, v in self.cache.items() if v is not None},
            _options={"base_weights": self.base_weights, "cache_merged": self.cache_merged},
        )

    def config_matches(
        self,
        applied: Mapping[str, tuple[tuple[str, ...], tuple[float, ...]]],
        merged: Mapping[str, bool],
        module: str,
        nicknames: list[str],
        strengths: list[float],
        target_merge: bool,
        adapter_updated: bool,
        updated_names: list[str],
    ) -> tuple[bool, str]:
        """SGLang `_check_lora_config_matches` on `module`: (skip?, why not / how it matched)."""
        if adapter_updated:
            several = len(updated_names) > 1
            return False, (
                f"adapter{'s' if several else ''} {', '.join(updated_names)} {'were' if several else 'was'} (re)loaded "
                f"or had {'their' if several else 'its'} alpha changed in this call, so SGLang re-applies every target "
                "(adapter_updated)"
            )
        cur_merge = merged.get(module, False)
        if cur_merge != target_merge:
            was = "merged" if cur_merge else "not merged"
            now = "merge" if target_merge else "dynamic"
            return False, f"merge state changes on {module}: {was} now, {now} requested"
        stored = applied.get(module)
        if stored is None:
            return False, f"nothing applied to {module} yet"
        stored_nicks, stored_strengths = stored
        if list(stored_nicks) != nicknames:
            if sorted(stored_nicks) == sorted(nicknames):
                return False, (
                    f"same adapters in a different order on {module}: {list(stored_nicks)} -> {nicknames} "
                    "(the comparison is order-sensitive)"
                )
            return False, f"adapters change on {module}: {list(stored_nicks)} -> {nicknames}"
        if list(stored_strengths) == strengths:
            return True, ""
        if _floats_equal(stored_strengths, strengths, self.tolerance):
            return True, (
                f"strengths {list(stored_strengths)} and {strengths} are equal within tolerance {self.tolerance}; "
                "SGLang compares exactly and would re-apply"
            )
        return False, f"strengths change on {module}: {list(stored_strengths)} -> {strengths}"

    def module_action(
        self,
        applied: Mapping[str, tuple[tuple[str, ...], tuple[float, ...]]],
        merged: Mapping[str, bool],
        module: str,
        nicknames: list[str],
        strengths: list[float],
        target_merge: bool,
        adapter_updated: bool,
    ) -> tuple[Action, str]:
        if not merged.get(module, False):
            if module in applied and not target_merge:
                return Action.APPLY, "the dynamic LoRA there is replaced (clear_existing)"
            return Action.APPLY, ""
        stored = applied.get(module)
        if not target_merge:
            return Action.UNMERGE_APPLY, "merged now and dynamic requested: restore the snapshot, then attach"
        if stored is not None and list(stored[0]) == nicknames and not adapter_updated:
            if not _floats_equal(stored[1], strengths, 0.0):
                return Action.REMERGE, (
                    f"merged with the same adapters in the same order; restore the snapshot and merge again with "
                    f"strengths {strengths} (was {list(stored[1])})"
                )
            return Action.UNMERGE_APPLY, "unchanged here, but re-applied with the rest of the target"
        return Action.UNMERGE_APPLY, "merged now with a different set: restore the snapshot, then merge"

    def planned_adapter(self, nickname: str, path: str | None, strength: float, alpha: float | None) -> PlannedAdapter:
        adapter = self.adapter(nickname, path)
        if adapter is None:
            note = self.read_errors.get(path or "", "not inspected")
            return PlannedAdapter(nickname, path, strength, alpha, None, (), None, {}, (f"not inspected: {note}",))
        variants = _adapter_variants(adapter)
        notes: list[str] = []
        scales: dict[str, float] = {}
        sources: dict[str, int] = {}
        truncated: set[float] = set()
        for m in adapter.modules:
            scale, source = module_scale(m, strength, alpha, adapter.alpha_pattern)
            scales[m.name] = scale
            sources[source] = sources.get(source, 0) + 1
            if source == "tensor" and m.alpha is not None and not float(m.alpha).is_integer():
                truncated.add(m.alpha)
        if truncated:
            vals = ", ".join(_num(a) for a in sorted(truncated))
            notes.append(
                f"SGLang reads per-module alpha tensors with int(alpha.item()): alpha {vals} would become "
                f"{', '.join(str(int(a)) for a in sorted(truncated))} there; lorafast uses the exact value"
            )
        if adapter.rank_pattern or adapter.alpha_pattern:
            notes.append(
                "per-module ranks/alphas from "
                + " and ".join(
                    p
                    for p, v in (("rank_pattern", adapter.rank_pattern), ("alpha_pattern", adapter.alpha_pattern))
                    if v
                )
            )
        if any(m.use_rslora for m in adapter.modules):
            notes.append("rsLoRA: scale = strength × alpha/√r")
        for v in variants:
            if v in _NON_ADDITIVE_WHY:
                notes.append(_NON_ADDITIVE_WHY[v])
        if "dora" in variants:
            notes.append(
                'SGLang itself rejects it: "DoRA adapters are not supported by the native diffusion LoRA layers"'
            )
        elif variants and not adapter.is_additive:
            notes.append("SGLang's diffusion loader reads only lora_A/lora_B pairs; lorafast.merge applies these")
        if "modules_to_save" in adapter.flags or "full_weights" in adapter.flags:
            notes.append("carries whole weights (modules_to_save / saved base weights) that replace, not add")
        return PlannedAdapter(
            nickname=nickname,
            path=path,
            strength=strength,
            alpha=alpha,
            additive=adapter.is_additive,
            variants=variants,
            scales=scales,
            alpha_sources=sources,
            notes=tuple(notes),
        )

    def steps(self, planned: list[PlannedAdapter], merge: bool, warnings: list[str]) -> tuple[MergeStep, ...]:
        """Merge order: runs of plain LoRA are summed; each non-additive adapter is its own step."""
        if not merge:
            return (MergeStep("dynamic", tuple(a.nickname for a in planned), "computed per forward: x·Aᵀ·Bᵀ·scale"),)
        steps: list[MergeStep] = []
        run: list[str] = []
        for a in planned:
            if a.additive is False:
                if run:
                    steps.append(MergeStep("sum", tuple(run), "W += Σ scale·B·A (order-free)"))
                    run = []
                why = next((_NON_ADDITIVE_WHY[v] for v in a.variants if v in _NON_ADDITIVE_WHY), "not a B·A sum")
                steps.append(MergeStep("sequential", (a.nickname,), f"applied to the current W on its own: {why}"))
            else:
                run.append(a.nickname)
        if run:
            steps.append(MergeStep("sum", tuple(run), "W += Σ scale·B·A (order-free)"))
        dependent = [a.nickname for a in planned if _WEIGHT_DEPENDENT & set(a.variants)]
        if len(planned) > 1 and dependent:
            verb = "read the weight they are" if len(dependent) > 1 else "reads the weight it is"
            warnings.append(
                f"{', '.join(dependent)} {verb} applied to, so the result depends on the order "
                f"{[a.nickname for a in planned]}: each step sees the weight left by the steps before it"
            )
        return tuple(steps)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _parse_adapter_spec(spec: str) -> LoraRequest:
    """`NICK[=PATH][:STRENGTH][@TARGET]`, parsed from the right so paths may hold ':' or '@'."""
    target = "all"
    head, sep, tail = spec.rpartition("@")
    if sep and tail in VALID_TARGETS:
        spec, target = head, tail
    strength = 1.0
    head, sep, tail = spec.rpartition(":")
    if sep:
        try:
            strength = float(tail)
            spec = head
        except ValueError:
            pass
    nickname, sep, path = spec.partition("=")
    if not nickname:
        raise ValueError(f"bad --adapter {spec!r}: expected NICK=PATH[:STRENGTH][@TARGET]")
    return LoraRequest(nickname, path or None, strength, target)


def _parse_alpha(spec: str) -> tuple[str, float]:
    nickname, sep, value = spec.partition("=")
    if not sep:
        raise ValueError(f"bad --alpha {spec!r}: expected NICK=ALPHA")
    return nickname, float(value)


def _parse_base_weights(spec: str) -> tuple[str, str]:
    module, sep, path = spec.partition("=")
    if not sep or module not in PIPELINE_MODULES or not path:
        raise ValueError(
            f"bad --base-weights {spec!r}: expected MODULE=FILE.safetensors, MODULE one of {PIPELINE_MODULES}"
        )
    return module, path


def _sharded_arg(value: list[str] | None) -> bool | dict[str, bool]:
    """`--sharded` alone: every module; `--sharded transformer_2`: only those; absent: none."""
    if value is None:
        return False
    return True if not value else dict.fromkeys(value, True)


def _run_cli(args: argparse.Namespace) -> int:

    try:
        requests = [_parse_adapter_spec(s) for s in args.adapter]
        alphas = dict(_parse_alpha(s) for s in args.alpha or [])
        requests = [replace(r, alpha=alphas.get(r.nickname, r.alpha)) for r in requests]
        current = None
        if args.state:
            with open(args.state, encoding="utf-8") as f:
                data = json.load(f)
            current = PipelineState.from_dict(data.get("next_state", data))
        p = plan(
            requests,
            merge_mode=args.merge_mode,
            current=current,
            weights_sharded=_sharded_arg(args.sharded),
            resolve=args.resolve,
            tolerance=args.tolerance,
            modules=args.modules,
            engine_version=args.engine_version,
            quantized=_sharded_arg(args.quantized),
            base_weights=dict(_parse_base_weights(s) for s in args.base_weights or []),
        )
        if p.unreadable and not args.allow_unreadable:  # a plan for files that are not there would mislead
            path, error = next(iter(p.unreadable.items()))
            raise ValueError(
                f"cannot read adapter {path!r}: {error} ({len(p.unreadable)} unreadable; "
                "--allow-unreadable plans them with unknown scales)"
            )
    except ValueError as e:  # SGLang's own errors and PlanError: say why, exit 1
        if args.json:
            print(json.dumps({"error": str(e), "type": type(e).__name__, "notes": getattr(e, "__notes__", [])}))
        else:
            print(f"error: {e}", file=sys.stderr)
            for note in getattr(e, "__notes__", []):
                print(note, file=sys.stderr)
        return 1
    print(p.to_json(indent=2) if args.json else p.explain())
    return 0


def register_cli(subparsers: Any) -> None:
    """Add `lorafast plan` to the lorafast CLI."""
    p = subparsers.add_parser(
        "plan",
        help="plan a set_lora call: what is merged, dynamic, skipped or unmerged",
        description="Plan an SGLang diffusion set_lora call without touching weights.",
    )
    p.add_argument(
        "--adapter",
        "-a",
        action="append",
        required=True,
        metavar="NICK=PATH[:STRENGTH][@TARGET]",
        help="an adapter to apply (repeat, in order); NICK alone reuses an adapter loaded in --state",
    )
    p.add_argument("--alpha", action="append", metavar="NICK=ALPHA", help="lora_alpha override for one adapter")
    p.add_argument(
        "--merge-mode", choices=LORA_MERGE_MODES, default=None, help="default: the state's server mode (auto)"
    )
    p.add_argument(
        "--sharded",
        nargs="*",
        choices=PIPELINE_MODULES,
        metavar="MODULE",
        help="weights are FSDP-sharded (DTensor): all modules, or only those named",
    )
    p.add_argument(
        "--quantized",
        nargs="*",
        choices=PIPELINE_MODULES,
        metavar="MODULE",
        help="weights are quantized and cannot take a merged delta (SGLang 0.5.23): all modules, or those named",
    )
    p.add_argument(
        "--base-weights",
        action="append",
        metavar="MODULE=FILE",
        help="a component's base weights (safetensors), for SGLang 0.5.23's auto-merge rounding-loss rule",
    )
    p.add_argument(
        "--engine-version",
        metavar="VERSION",
        help="the SGLang version whose set_lora rules to follow (default: the installed one, else the newest)",
    )
    p.add_argument("--resolve", action="store_true", help="plan targets SGLang would reject as merges")
    p.add_argument("--tolerance", type=float, default=0.0, help="float tolerance for the skip rule (default: exact)")
    p.add_argument("--modules", nargs="+", choices=PIPELINE_MODULES, help="pipeline components (default: transformer)")
    p.add_argument("--state", metavar="JSON", help="current pipeline state (a PipelineState or a previous plan --json)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--allow-unreadable",
        action="store_true",
        help="plan adapters that cannot be read here (e.g. Hub ids SGLang downloads) with unknown scales",
    )
    p.set_defaults(func=_run_cli)
