"""Turning what the caller passed (a `Plan`, `LoraRequest`s, `(path, strength)` pairs, paths, `Adapter`s)
into an ordered list of `Source`s: one adapter, at one strength, for one model component.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lorafast.adapter import Adapter, LoraModule
from lorafast.formats.peft import peft_pattern_value
from lorafast.merging.errors import MergeError

#: pipeline components a request target covers (SGLang diffusion targets; "all" covers every component)
_TARGET_COMPONENTS = {
    "all": None,
    "transformer": ("transformer",),
    "transformer_2": ("transformer_2",),
    "critic": ("critic",),
}


@dataclass(frozen=True)
class Source:
    """One adapter to merge: `strength` times its own scale, into `components` (None: the whole model)."""

    nickname: str
    adapter: Adapter
    strength: float = 1.0
    alpha: float | None = None
    """Request-level alpha override (SGLang `lora_alpha`)."""
    components: tuple[str, ...] | None = None

    def module_alpha(self, module: LoraModule) -> float | None:
        """Alpha for one module. Precedence as SGLang's pipeline: a per-module `.alpha` tensor, then a PEFT
        `alpha_pattern` hit, then the request alpha, then the config alpha; None means alpha = rank."""
        if module.alpha_key is not None and module.alpha is not None:
            # sd-scripts: an `.alpha` of 0 means "no alpha", i.e. alpha = rank and scale 1
            return module.alpha if module.alpha != 0 else None
        if self.alpha is not None:
            patterns = self.adapter.alpha_pattern or {}
            if not (patterns and module.alpha is not None and peft_pattern_value(patterns, module.name) is not None):
                return float(self.alpha)
        return module.alpha

    def coefficient(self, module: LoraModule, rank: int | None = None) -> float:
        """strength × alpha / r (alpha / √r with rsLoRA), with r = `rank` when given (MoE target_parameters)."""
        r = rank if rank is not None else module.rank
        alpha = self.module_alpha(module)
        if alpha is None or not r:
            return float(self.strength)
        return self.strength * alpha / (math.sqrt(r) if module.use_rslora else r)


def describe_adapter(path: str | os.PathLike[str]) -> Adapter:
    """`lorafast.inspect(path)`, with its failures turned into a `MergeError` that names the path."""
    from lorafast import scanning
    from lorafast.errors import LorafastError

    try:
        return scanning.inspect(os.fspath(path))
    except (LorafastError, OSError) as exc:
        raise MergeError(f"cannot read adapter {os.fspath(path)}: {exc}", "read_error", adapter=str(path)) from exc


def _adapter_of(item: Any) -> Adapter:
    if isinstance(item, Adapter):
        return item
    if isinstance(item, (str, os.PathLike)):
        return describe_adapter(item)
    raise MergeError(f"cannot use {item!r} as an adapter (expected a path or an Adapter)", "bad_request")


def _from_request(req: Any, cache: dict[str, Adapter]) -> Source:
    """A `LoraRequest`-like object: `.nickname`, `.path`, `.strength`, `.target`, `.alpha`."""
    nickname = getattr(req, "nickname", None)
    path = getattr(req, "path", None)
    adapter = getattr(req, "adapter", None)
    if adapter is None:
        if path is None:
            raise MergeError(f"request {nickname!r} has no path to load the adapter from", "bad_request")
        adapter = cache.get(os.fspath(path)) or _adapter_of(path)
    target = getattr(req, "target", "all") or "all"
    if target not in _TARGET_COMPONENTS:
        raise MergeError(f"request {nickname!r}: unknown target {target!r}", "bad_request", adapter=nickname)
    return Source(
        nickname=nickname or adapter.name,
        adapter=adapter,
        strength=float(getattr(req, "strength", 1.0)),
        alpha=getattr(req, "alpha", None),
        components=_TARGET_COMPONENTS[target],
    )


def _from_plan(plan: Any) -> list[Source]:
    """A `lorafast.Plan`: every target planned as a merge, its adapters in application order."""
    cache: dict[str, Adapter] = {}
    for key, value in dict(getattr(plan, "_adapter_cache", {}) or {}).items():
        if isinstance(value, Adapter):
            cache[os.fspath(key)] = value
    out: list[Source] = []
    for tp in plan.targets:
        action = getattr(getattr(tp, "action", None), "value", getattr(tp, "action", None))
        if getattr(tp, "mode", "merge") != "merge" or action == "skip":
            continue
        components = tuple(getattr(tp, "modules", ()) or ()) or None
        for pa in tp.adapters:
            path = pa.path
            if path is None:
                raise MergeError(f"plan adapter {pa.nickname!r} has no path", "bad_request", adapter=pa.nickname)
            adapter = cache.get(os.fspath(path)) or _adapter_of(path)
            out.append(Source(pa.nickname, adapter, float(pa.strength), pa.alpha, components))
    return out


def normalize(plan_or_requests: Any) -> list[Source]:
    """Sources in application order from a Plan, a request list, pairs, paths or Adapters (or a single one)."""
    if plan_or_requests is None:
        raise MergeError("nothing to merge: no plan or requests given", "bad_request")
    if hasattr(plan_or_requests, "targets") and hasattr(plan_or_requests, "requests"):
        return _from_plan(plan_or_requests)
    if isinstance(plan_or_requests, (str, os.PathLike, Adapter, Source)) or hasattr(plan_or_requests, "nickname"):
        items: Iterable[Any] = [plan_or_requests]
    elif isinstance(plan_or_requests, tuple) and len(plan_or_requests) == 2 and _is_number(plan_or_requests[1]):
        items = [plan_or_requests]
    else:
        items = plan_or_requests
    cache: dict[str, Adapter] = {}
    out: list[Source] = []
    for item in items:
        if isinstance(item, Source):
            out.append(item)
        elif hasattr(item, "nickname") and (hasattr(item, "path") or hasattr(item, "adapter")):
            out.append(_from_request(item, cache))
        elif isinstance(item, tuple) and len(item) == 2 and _is_number(item[1]):
            adapter = _adapter_of(item[0])
            out.append(Source(adapter.name, adapter, float(item[1])))
        else:
            adapter = _adapter_of(item)
            out.append(Source(adapter.name, adapter))
    if not out:
        raise MergeError("nothing to merge: the request list is empty", "bad_request")
    names = [s.nickname for s in out]
    for i, s in enumerate(out):  # nicknames label errors and records, so make them unique
        if names.count(s.nickname) > 1:
            out[i] = Source(f"{s.nickname}#{i}", s.adapter, s.strength, s.alpha, s.components)
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
