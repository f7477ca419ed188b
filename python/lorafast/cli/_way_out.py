"""What `lorafast preflight sglang` prints after a start-up failure: consequential problems grouped, and the way out.

One refused set can give hundreds of problems that all follow from one cause (the same `expert_dim` error for
every layer of an adapter). The text output keeps one line per (level, adapter, kind), with a count; `--json`
keeps every problem. When the cause is a mix of MoE layouts, the output ends with both ways out and their exact
commands: `lorafast groups` (one server per layout) or `lorafast convert` (one server for all).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

#: the problem that a layout conversion resolves
MIXED_LAYOUT_CODES = frozenset({"sglang_mixed_shared_outer"})


def grouped_lines(problems: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per (level, adapter, kind), in first-seen order, the first message standing for the rest."""
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for p in problems:
        level = "error" if p.get("fatal") else "warning"
        who = p.get("adapter_name") or p.get("adapter") or "-"
        kind = p.get("type") or p.get("code") or "?"
        key = (level, str(who), f"{kind}:{p.get('code')}")
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [p, 1]
    lines = []
    for (level, who, _), (p, n) in groups.items():
        more = f" ({n} times; --json lists each)" if n > 1 else ""
        where = f" (at {p['adapter_path']})" if p.get("adapter_path") else ""
        lines.append(f"{level} [{who}{where}] {p.get('type') or p.get('code')}: {_cut(str(p.get('message')))}{more}")
    return lines


def _cut(text: str, width: int = 400) -> str:
    """A message as long as one screen line or two: a warning that lists 192 weight names is cut, with a count
    of what was left out (`--json` keeps the whole text)."""
    if len(text) <= width:
        return text
    return f"{text[:width]}... ({len(text) - width} more characters; --json has the whole message)"


def way_out(
    adapters: Sequence[tuple[str, str]], problems: Sequence[Mapping[str, Any]], flags: Sequence[str] = ()
) -> list[str]:
    """The commands that get a mixed-layout set served: split it, or convert the shared-outer adapters.
    `adapters`: (name, path) as the set was given (`NAME=PATH` or `PATH`); `flags`: the server flags of the
    check, carried over to the re-check (`--base-config FILE`, ...)."""
    paths = [path for _, path in adapters]
    if not any(p.get("code") in MIXED_LAYOUT_CODES for p in problems):
        return []
    from lorafast.errors import LorafastError
    from lorafast.groups import plan_groups
    from lorafast.scanning import inspect

    try:
        layouts = {path: inspect(path).moe_layout.value for path in paths}
        servers = len(plan_groups(list(paths)).groups)
    except (LorafastError, OSError):
        return []
    shared = [p for p, layout in layouts.items() if layout == "shared_outer"]
    if not shared:
        return []
    q = shlex.quote
    lines = [
        "",
        "way out:",
        f"  split the set across {servers} servers:  lorafast groups {' '.join(q(p) for p in paths)}",
        "  or convert the shared-outer adapters to per-expert weights (exact) and serve all on 1 server:",
    ]
    converted = {p: p.rstrip("/") + "-stacked_3d" for p in shared}
    for src, out in converted.items():
        lines.append(f"    lorafast convert {q(src)} --to stacked_3d --out {q(out)}")
    items = [converted.get(p, p) if n == p else f"{n}={converted.get(p, p)}" for n, p in adapters]
    lines.append(f"    lorafast preflight sglang {' '.join(q(i) for i in [*items, *flags])}")
    return lines
