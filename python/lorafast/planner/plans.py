"""Plan objects: what `plan()` returns, per call, per target and per adapter, with their JSON and text forms."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lorafast._records import record
from lorafast.errors import LorafastError
from lorafast.planner._format import fmt_number
from lorafast.planner.requests import LoraRequest
from lorafast.planner.state import PipelineState


class PlanError(LorafastError, ValueError):
    """A request lorafast refuses to plan (e.g. DoRA on a dynamic target). `.rejections` lists every reason."""

    def __init__(self, rejections: Sequence[str]) -> None:
        self.rejections = tuple(rejections)
        super().__init__("; ".join(self.rejections))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as its rejections: the joined message would be split again
        return (type(self), (self.rejections,))


class Action(str, Enum):
    """What happens to a module's weights."""

    APPLY = "apply"
    """Nothing merged there: merge (or attach dynamically)."""
    SKIP = "skip"
    """Unchanged (SGLang's "config matches" rule), or the module does not exist."""
    UNMERGE_APPLY = "unmerge_apply"
    """Merged now: restore the snapshot, then apply the new set."""
    REMERGE = "remerge"
    """Merged with the same adapters in the same order: re-merge with new strengths."""

    @property
    def text(self) -> str:
        return {"apply": "apply", "skip": "skip", "unmerge_apply": "unmerge then apply", "remerge": "re-merge"}[
            self.value
        ]


@dataclass(frozen=True)
class LoadEvent:
    """An adapter (re)loaded, or its alpha changed, by this call: each sets SGLang's `adapter_updated`."""

    nickname: str
    kind: str
    """"load", "reload" or "alpha"."""
    path: str
    previous_path: str | None = None
    alpha: float | None = None
    previous_alpha: float | None = None

    def text(self) -> str:
        if self.kind == "load":
            return f"load {self.nickname} from {self.path}" + (
                f" (alpha {fmt_number(self.alpha)})" if self.alpha else ""
            )
        if self.kind == "reload":
            return f"reload {self.nickname}: path {self.previous_path} -> {self.path}"
        return f"alpha of {self.nickname}: {fmt_number(self.previous_alpha)} -> {fmt_number(self.alpha)}"


@dataclass(frozen=True)
class MergeStep:
    """One step against the current weight: a sum of plain LoRA deltas, one non-additive adapter, or dynamic."""

    kind: str
    """"sum", "sequential" or "dynamic"."""
    nicknames: tuple[str, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "nicknames": list(self.nicknames), "reason": self.reason}


@dataclass(frozen=True)
class PlannedAdapter:
    """One adapter of a target, in application order, with its effective scale per adapter module."""

    nickname: str
    path: str | None
    strength: float
    alpha: float | None
    """The adapter-level alpha as the pipeline holds it (request `lora_alpha`, else the config)."""
    additive: bool | None
    """None when the adapter could not be inspected."""
    variants: tuple[str, ...]
    scales: Mapping[str, float] | None
    """Adapter module name -> strength × alpha/r (None: not inspected)."""
    alpha_sources: Mapping[str, int]
    """Where alphas came from ("tensor", "alpha_pattern", "adapter", "config", "rank") -> how many modules."""
    notes: tuple[str, ...] = ()

    def scale_summary(self) -> str:
        if self.scales is None:
            return "scales unknown (adapter not inspected)"
        if not self.scales:
            return "no LoRA modules"
        values = sorted(set(self.scales.values()))
        n = len(self.scales)
        if len(values) == 1:
            return f"scale {fmt_number(values[0])} on {n} module{'s' if n != 1 else ''}"
        return f"scales {fmt_number(values[0])}..{fmt_number(values[-1])} on {n} modules ({len(values)} distinct)"

    def to_dict(self) -> dict[str, Any]:
        return record(self)


@dataclass(frozen=True)
class TargetPlan:
    """The plan for one target of the call (targets are applied in the order they first appear)."""

    target: str
    modules: tuple[str, ...]
    """The pipeline components the target resolves to; empty when none exists."""
    adapters: tuple[PlannedAdapter, ...]
    mode: str
    """"merge" or "dynamic": the first module's decision, as SGLang takes it."""
    module_modes: Mapping[str, str]
    action: Action
    """The first module's action."""
    module_actions: Mapping[str, Action]
    steps: tuple[MergeStep, ...]
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    resolved: bool = False
    """True when `resolve=True` turned an engine failure into a merge."""
    rounding_loss: Mapping[str, float | None] = field(default_factory=dict)
    """Module -> the auto-merge rounding loss (0.5.23) where it was evaluated: the share of the update, by norm,
    that merging would round away (None: nothing to measure, so it merges)."""
    undecided: tuple[str, ...] = ()
    """Modules whose merge SGLang decides from weight values the planner was not given (the rounding-loss rule):
    planned as merges, which is what SGLang does when merging loses at most half of the update."""

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

    @property
    def nicknames(self) -> tuple[str, ...]:
        return tuple(a.nickname for a in self.adapters)

    @property
    def strengths(self) -> tuple[float, ...]:
        return tuple(a.strength for a in self.adapters)


@dataclass(frozen=True)
class Plan:
    """Result of `plan()`. Iterate for `TargetPlan`s; `plan["transformer"]` looks one up by target."""

    merge_mode: str
    """The mode the call resolved to: its `merge_mode`, else `merge_weights`, else the server's."""
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
    unreadable: Mapping[str, str] = field(default_factory=dict)
    """Path -> error for adapters that could not be inspected (planned with unknown scales)."""
    engine_version: str = ""
    """The SGLang version whose `set_lora` rules the plan follows."""
    version_status: str = "verified"
    """"verified", or how an unverified version was answered ("nearest: 0.5.23", "older than 0.5.23")."""
    quantized: bool | Mapping[str, bool] = False
    _adapter_cache: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: the planner that built this plan (`replay.plan`), which `then` calls again: plans sit below the replay
    _planner: Callable[..., Plan] | None = field(default=None, repr=False, compare=False)

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
        assert self._planner is not None, "a Plan is built by lorafast.plan"
        return self._planner(requests, current=self.next_state, **kwargs)

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
            "version_status": self.version_status,
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
            + (f" (not verified by lorafast: {self.version_status})" if self.version_status != "verified" else "")
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
                lines.append(f"  {i}. {a.nickname}{kind}  strength {fmt_number(a.strength)}  {a.scale_summary()}")
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
