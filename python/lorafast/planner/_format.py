"""How the planner writes numbers and adapter sets in its texts."""

from __future__ import annotations

from collections.abc import Sequence


def fmt_number(x: float | None) -> str:
    if x is None:
        return "none"
    return f"{x:.6g}"


def fmt_config(nicknames: Sequence[str], strengths: Sequence[float]) -> str:
    """`[a@1, b@0.5]`: the adapters of a module with their strengths, in order."""
    return "[" + ", ".join(f"{n}@{fmt_number(s)}" for n, s in zip(nicknames, strengths, strict=False)) + "]"
