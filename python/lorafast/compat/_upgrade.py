"""What an engine upgrade does to a fleet: every adapter whose outcome changes between two engine versions.

Each side is the engine's own preflight (`compat.vllm.preflight` or `compat.sglang.preflight`, `collect=True`)
under that version's rules, so a change is one of the rule changes that lorafast implements behind a version:
the outcome, the exception type, the text, the stage, the modules that are applied or the scale they are served
at. Both versions should be verified ones (`lorafast engines`); an unverified one warns as everywhere else.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast._records import record
from lorafast.compat import _versions

#: The kinds of change, in the order they are reported.
CHANGE_KINDS = ("outcome", "exception", "text", "stage", "modules", "scale")


@dataclass(frozen=True)
class AdapterOutcome:
    """One adapter under one engine version: `loads` or `fails`, and if it fails, the engine's first error."""

    name: str
    path: str
    outcome: str
    exc_type: str = ""
    message: str = ""
    stage: str = ""
    modules: tuple[str, ...] = ()
    """The adapter's modules the engine applies (vLLM: `LoRAModel.loras`; SGLang: the weights it keeps)."""
    scales: Mapping[str, float] = field(default_factory=dict)
    """Module -> the scale it is served at."""

    def to_dict(self) -> dict[str, Any]:
        return record(self, {"exc_type": "type"})


@dataclass(frozen=True)
class VersionChange:
    """An adapter whose outcome differs between the two versions, both sides in full."""

    name: str
    kinds: tuple[str, ...]
    old: AdapterOutcome
    new: AdapterOutcome

    def to_dict(self) -> dict[str, Any]:
        return record(self)


@dataclass(frozen=True)
class VersionDiff:
    """`diff_versions`' answer: both versions' rules, every adapter's two outcomes, and what changed."""

    engine: str
    old: _versions.EngineRules
    new: _versions.EngineRules
    changes: tuple[VersionChange, ...]
    adapters: int

    def summary(self) -> dict[str, Any]:
        kinds = Counter(k for c in self.changes for k in c.kinds)
        return {
            "engine": self.engine,
            "from": self.old.to_dict(),
            "to": self.new.to_dict(),
            "adapters": self.adapters,
            "changed": len(self.changes),
            "unchanged": self.adapters - len(self.changes),
            "kinds": {k: kinds[k] for k in CHANGE_KINDS if kinds[k]},
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "changes": [c.to_dict() for c in self.changes]}


def _sglang_outcomes(plan: Any) -> list[AdapterOutcome]:
    from lorafast.compat._inputs import resolve_adapters

    out = []
    for ref in plan.adapters:
        first = next((p for p in plan.errors if p.adapter_id in (ref.lora_id, None)), None)
        weights = plan.loaded_weights.get(ref.lora_id)
        modules: tuple[str, ...] = ()
        scales: dict[str, float] = {}
        if first is None and weights is not None:
            modules = tuple(sorted({f"layers.{i}.{n}" for i, n, _ in weights.iter_layer_weights()}))
            (view,) = resolve_adapters([ref.path])
            config = view.config or {}
            r, alpha = config.get("r"), config.get("lora_alpha")
            if isinstance(r, (int, float)) and r and isinstance(alpha, (int, float)):
                scales = dict.fromkeys(modules, float(alpha) / float(r))  # SGLang: one lora_alpha / r per adapter
        out.append(_outcome(ref.name, ref.path, first, modules, scales))
    return out


def _vllm_outcomes(plan: Any, names: list[tuple[str, str]]) -> list[AdapterOutcome]:
    out = []
    for name, path in names:
        first = next((p for p in plan.problems if p.fatal and p.adapter_name in (name, None)), None)
        lora = plan.loras.get(name)
        modules = tuple(sorted(lora.loras)) if first is None and lora is not None else ()
        scales = {m: float(lora.loras[m].scaling) for m in modules} if lora is not None else {}
        out.append(_outcome(name, path, first, modules, scales))
    return out


def _outcome(
    name: str, path: str, problem: Any, modules: tuple[str, ...], scales: Mapping[str, float]
) -> AdapterOutcome:
    if problem is None:
        return AdapterOutcome(name, path, "loads", modules=modules, scales=scales)
    return AdapterOutcome(name, path, "fails", problem.exc_type, problem.message, problem.stage)


def _kinds(a: AdapterOutcome, b: AdapterOutcome) -> tuple[str, ...]:
    kinds = []
    if a.outcome != b.outcome:
        kinds.append("outcome")
    if a.exc_type != b.exc_type:
        kinds.append("exception")
    if a.message != b.message:
        kinds.append("text")
    if a.stage != b.stage:
        kinds.append("stage")
    if a.modules != b.modules:
        kinds.append("modules")
    shared = set(a.scales) & set(b.scales)
    if any(not math.isclose(a.scales[m], b.scales[m], rel_tol=1e-12) for m in shared):
        kinds.append("scale")
    return tuple(kinds)


def _run(engine: str, version: str, refs: list[Any], options: Mapping[str, Any]) -> list[AdapterOutcome]:
    if engine == "sglang":
        from lorafast.compat import sglang

        return _sglang_outcomes(sglang.preflight(refs, collect=True, engine_version=version, **options))
    from lorafast.compat import vllm

    plan = vllm.preflight(refs, collect=True, engine_version=version, **options)
    return _vllm_outcomes(plan, [(r.name, r.path) for r in refs])


def diff_versions(
    engine: str,
    from_version: str,
    to_version: str,
    adapters: Any,
    *,
    strict_version: bool = False,
    **options: Any,
) -> VersionDiff:
    """Every adapter of `adapters` whose outcome changes from `from_version` to `to_version` of `engine`
    ("vllm" or "sglang"): outcome, exception type, text, stage, applied modules or served scale, old and new side
    by side. `adapters` are paths or `NAME=PATH` strings (as `--lora-paths` / `--lora-modules`), or `LoraRef`s;
    `options` are the server's settings, passed to both sides' preflight (`max_lora_rank=64`,
    `expected_lora_modules=[...]`, `base_config={...}`, ...). Raises `ValueError` for an unknown engine or a
    string that is not a version, `UnverifiedEngineVersionError` for an unverified one with `strict_version`.
    """
    from lorafast.compat._common import LoraRef
    from lorafast.compat.sglang import parse_lora_paths

    if engine not in ("sglang", "vllm"):
        raise ValueError(f"engine must be 'sglang' or 'vllm', not {engine!r}")
    old = _versions.rules_for(engine, from_version, strict=strict_version)
    new = _versions.rules_for(engine, to_version, strict=strict_version)
    items = [adapters] if isinstance(adapters, (str, LoraRef)) else list(adapters)
    strings = [a for a in items if not isinstance(a, LoraRef)]
    refs = [a for a in items if isinstance(a, LoraRef)] + (
        parse_lora_paths([str(s) for s in strings]) if strings else []
    )
    before = _run(engine, from_version, refs, options)
    after = _run(engine, to_version, refs, options)
    changes = tuple(
        VersionChange(a.name, kinds, a, b) for a, b in zip(before, after, strict=True) if (kinds := _kinds(a, b))
    )
    return VersionDiff(engine, old, new, changes, len(refs))
