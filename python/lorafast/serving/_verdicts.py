"""What `lorafast.preflight` answers: a verdict per adapter (`AdapterVerdict`), the whole report
(`PreflightReport`), and the trained scale each served scale is compared with."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorafast._records import record

if TYPE_CHECKING:
    import numpy as np

    from lorafast.compat.launch import LaunchCommand

#: The closed set of verdicts, most severe first (a table's order).
VERDICTS: tuple[str, ...] = ("fails", "silent_noop", "partial", "scale_differs", "unknown", "serves")
#: Relative difference below which two scales are the same (float32 configs, sqrt).
_SCALE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class ModuleScale:
    """One module served at another scale than trained."""

    module: str
    trained: float
    served: float


@dataclass(frozen=True)
class AdapterVerdict:
    """What the server does with one adapter."""

    name: str
    path: str
    source: str
    """`command` (named in the launch command, loaded at start-up) or `dynamic` (loaded later)."""
    verdict: str
    reasons: tuple[str, ...] = ()
    stage: str = ""
    """For `fails`: `startup`, `load` or `first_use`."""
    exc_type: str = ""
    """For `fails`: the engine's exception type ("" where lorafast knows the failure but not the engine's text)."""
    message: str = ""
    """For `fails`: the engine's exact text."""
    modules: int = 0
    applied: int = 0
    dropped: tuple[tuple[str, str], ...] = ()
    """(module, why) for each trained module the server does not apply."""
    scales: tuple[ModuleScale, ...] = ()
    """The modules served at another scale than trained."""
    undecided: tuple[str, ...] = ()
    """What could not be decided, and which input would decide it."""
    fix: tuple[str, ...] = ()
    """The way out: a flag value, server groups, a conversion or a merge."""

    def to_dict(self) -> dict[str, Any]:
        return record(
            self,
            {"exc_type": "type"},
            dropped=[{"module": m, "why": w} for m, w in self.dropped],
            scales=[{"module": s.module, "trained": s.trained, "served": s.served} for s in self.scales],
        )


@dataclass(frozen=True)
class PreflightReport:
    """`preflight`'s answer: one `AdapterVerdict` per adapter, whether the server starts, and the inputs used."""

    launch: LaunchCommand
    adapters: tuple[AdapterVerdict, ...]
    server_starts: bool | None
    """False when the engine refuses to start (a bad flag value, a set conflict); None when undecided."""
    startup: tuple[dict[str, Any], ...] = ()
    """The start-up problems of the whole set, each with the engine's type and text and, for a set conflict, the
    adapter's name and path."""
    base: str | None = None
    """The base model read (its path), or None."""
    base_note: str | None = None
    """Why no base was read, and what would supply it."""
    errors: tuple[tuple[str, str, str], ...] = field(default=())
    """(path, code, message) of adapter paths that could not be read at all (they also get a `fails` row)."""

    def __iter__(self) -> Any:
        return iter(self.adapters)

    def __len__(self) -> int:
        return len(self.adapters)

    @property
    def ok(self) -> bool:
        """True when the server starts and serves every adapter as trained."""
        return self.server_starts is True and all(a.verdict == "serves" for a in self.adapters)

    def counts(self) -> dict[str, int]:
        c = Counter(a.verdict for a in self.adapters)
        return {v: c[v] for v in VERDICTS}

    def columns(self) -> dict[str, np.ndarray]:
        """One numpy array per field, one row per adapter (strings as object arrays)."""
        import numpy as np

        rows = self.adapters
        return {
            "name": np.array([a.name for a in rows], dtype=object),
            "path": np.array([a.path for a in rows], dtype=object),
            "source": np.array([a.source for a in rows], dtype=object),
            "verdict": np.array([a.verdict for a in rows], dtype=object),
            "stage": np.array([a.stage or None for a in rows], dtype=object),
            "exc_type": np.array([a.exc_type or None for a in rows], dtype=object),
            "message": np.array([a.message or None for a in rows], dtype=object),
            "modules": np.array([a.modules for a in rows], dtype=np.int64),
            "applied": np.array([a.applied for a in rows], dtype=np.int64),
            "dropped": np.array([len(a.dropped) for a in rows], dtype=np.int64),
            "scale_differs": np.array([len(a.scales) for a in rows], dtype=np.int64),
            "reason": np.array([a.reasons[0] if a.reasons else None for a in rows], dtype=object),
            "fix": np.array([a.fix[0] if a.fix else None for a in rows], dtype=object),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.launch.rules.to_dict(),
            "model": self.launch.model,
            "base": self.base,
            "base_note": self.base_note,
            "server_starts": self.server_starts,
            "startup": list(self.startup),
            "counts": self.counts(),
            "adapters": [a.to_dict() for a in self.adapters],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_arrow(self) -> Any:
        import pyarrow as pa

        return pa.table({k: list(v) for k, v in self.columns().items()})

    def to_pandas(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.columns())

    def to_polars(self) -> Any:
        import polars as pl

        return pl.DataFrame({k: list(v) for k, v in self.columns().items()})

    def to_parquet(self, path: str | os.PathLike[str]) -> None:
        import pyarrow.parquet as pq

        pq.write_table(self.to_arrow(), os.fspath(path))

    def summary(self, limit: int = 20) -> str:
        """The text report: counts per verdict, the top causes with one example each, then the adapters that do
        not serve (at most `limit`, with a count of the rest)."""
        rules = self.launch.rules
        lines = [f"{rules.note()}; model {self.launch.model or '(none in the command)'}"]
        lines.append(f"base: {self.base}" if self.base else f"base: none read ({self.base_note})")
        for p in self.startup:
            who = f" (adapter {p['adapter_name']!r} at {p['adapter_path']})" if p.get("adapter_path") else ""
            lines.append(f"startup: {p['type']}: {p['message']}{who}")
        starts = {True: "the server starts", False: "the server does not start", None: "start-up undecided"}
        counts = self.counts()
        lines.append(
            f"{len(self.adapters)} adapters, {starts[self.server_starts]}: "
            + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
        )
        causes: Counter[str] = Counter()
        example: dict[str, AdapterVerdict] = {}
        for a in self.adapters:
            if a.verdict != "serves" and a.reasons:
                key = f"{a.verdict}: {_short(a.reasons[0], 160)}"
                causes[key] += 1
                example.setdefault(key, a)
        if causes:
            lines.append("top causes:")
            for key, n in causes.most_common(5):
                a = example[key]
                fix = f"; fix: {a.fix[0]}" if a.fix else ""
                lines.append(f"  {n:>5} x {key}  (e.g. {a.name}{fix})")
        bad = [a for a in self.adapters if a.verdict != "serves"]
        bad.sort(key=lambda a: VERDICTS.index(a.verdict))
        if bad:
            lines.append(f"{'verdict':<14} {'adapter':<28} reason")
            for a in bad[:limit]:
                lines.append(
                    f"{a.verdict:<14} {_short(a.name, 28):<28} {_short(a.reasons[0] if a.reasons else '', 110)}"
                )
            if len(bad) > limit:
                lines.append(f"... and {len(bad) - limit} more that do not serve (--all, or --json for every adapter)")
        return "\n".join(lines)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Trained and served scales


def trained_scale(module: Any) -> float:
    """PEFT's `LoraLayer.scaling` for the module: its `lora_alpha` (after `alpha_pattern`) over its `r` (after
    `rank_pattern`), or over `sqrt(r)` with rsLoRA; kohya's alpha / rank; 1.0 without an alpha."""
    r = module.config_rank or module.rank
    if module.alpha is None or not r:
        return 1.0
    return float(module.alpha) / (math.sqrt(r) if module.use_rslora else float(r))


def differs(a: float, b: float) -> bool:
    return not math.isclose(a, b, rel_tol=_SCALE_TOLERANCE, abs_tol=1e-12)
