"""How subcommands print: JSON on stdout, and plain-text tables."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def table(rows: Sequence[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    cells = [tuple(str(c) for c in header), *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
