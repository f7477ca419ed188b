"""`plan_groups(..., convert=True)`: convert where it lets adapters share a server, and only there.

SGLang refuses shared-outer and per-expert MoE adapters in one server. Converting the shared-outer adapters to
stacked 3-D (exact, `lorafast.convert`) lets them join the per-expert servers of the same base model. The
conversions are planned first from the groups (shared-outer groups whose base model also has a per-expert group),
written, and the fleet is grouped again with the converted paths, so each group's command uses them and passes
preflight. When that does not give fewer servers, the converted files are removed and the plain plan is returned.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ConversionStep:
    """One conversion a group plan relies on: the adapter, its layout before and after, bytes to write."""

    adapter: str  # source path
    name: str
    from_layout: str
    to_layout: str
    cost_bytes: int  # tensor data written
    out: str  # the converted adapter, which the group commands use

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_with_conversions(adapters_or_report: Any, out: str | os.PathLike[str], **kwargs: Any) -> Any:
    from lorafast.converting.api import convert
    from lorafast.groups import OuterLayout, _collect_adapters, plan_groups

    plain = plan_groups(adapters_or_report, **kwargs)
    per_expert_bases = {g.base_model for g in plain.groups if g.layout is OuterLayout.PER_EXPERT}
    movable = [
        (g, a, n)
        for g in plain.groups
        if g.layout is OuterLayout.SHARED and g.base_model in per_expert_bases
        for a, n in zip(g.adapters, g.names, strict=True)
    ]
    if not movable:
        return plain
    folder = os.fspath(out)
    created = not os.path.exists(folder)
    os.makedirs(folder, exist_ok=True)
    steps: list[ConversionStep] = []
    converted: dict[str, str] = {}
    for _g, adapter, name in movable:
        dest = os.path.join(folder, f"{name}-stacked_3d")
        res = convert(adapter, "stacked_3d", dest, overwrite=True)
        steps.append(ConversionStep(str(adapter.path), name, res.from_layout, res.to_layout, res.bytes, res.out))
        converted[str(adapter.path)] = res.out
    entries, _ = _collect_adapters(adapters_or_report)
    fleet = {}
    for given, adapter in entries:
        name = given or adapter.name
        fleet[name if name not in fleet else str(adapter.path)] = converted.get(str(adapter.path), adapter)
    better = plan_groups(fleet, **kwargs)
    if len(better.groups) >= len(plain.groups):  # no server saved: leave nothing converted behind
        for step in steps:
            shutil.rmtree(step.out, ignore_errors=True)
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        return plain
    return replace(
        better, conversions=tuple(steps), unservable=plain.unservable if not better.unservable else better.unservable
    )
