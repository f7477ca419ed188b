"""`preflight`: will the server that this launch command starts serve these adapters as they were trained?

The input is what a platform team has: the engine's launch command (`vllm serve MODEL --enable-lora ...`,
`python -m sglang.launch_server --model-path M --lora-paths ...`), the adapters it names, any adapters loaded
later through the engine's dynamic-load path, and the base model the command names. Each part is answered by the
piece of lorafast that owns it, all from headers:

- the command, with the engine's own flags, defaults and start-up validation (`compat.launch`);
- the engine's load path and start-up and first-use checks, with its exception types and texts
  (`compat.vllm.preflight`, `compat.sglang.preflight`, `validate_new_adapter`);
- which modules the engine wraps (`--lora-target-modules`: vLLM's `is_in_target_modules`, SGLang's normalized
  targets and the weights its memory pool takes) and which match the base model at all (`check`);
- the scale each module is served at (vLLM's `get_rank_and_scaling`, SGLang's one `lora_alpha / r` per adapter)
  against the scale PEFT trained it at (`LoraModule`: `lora_alpha / r`, rsLoRA's `/ sqrt(r)`, the patterns).

One verdict per adapter, from `VERDICTS`, each with its reasons and the way out. What cannot be decided (no
readable base, an engine version lorafast has not verified) is `unknown`, naming the input that would decide it;
it is never `serves`.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from .adapter import Adapter
    from .base import BaseModel
    from .compat.launch import LaunchCommand
    from .scanning import ScanReport

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
        return {
            "name": self.name,
            "path": self.path,
            "source": self.source,
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "stage": self.stage,
            "type": self.exc_type,
            "message": self.message,
            "modules": self.modules,
            "applied": self.applied,
            "dropped": [{"module": m, "why": w} for m, w in self.dropped],
            "scales": [{"module": s.module, "trained": s.trained, "served": s.served} for s in self.scales],
            "undecided": list(self.undecided),
            "fix": list(self.fix),
        }


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
# The base model the command names


def _hf_cache_snapshot(repo_id: str) -> str | None:
    """The local snapshot folder of a Hub repo id, as huggingface_hub lays out its cache (never downloads)."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub"
    )
    repo, _, revision = repo_id.partition("@")
    folder = os.path.join(hub, "models--" + repo.replace("/", "--"))
    ref = os.path.join(folder, "refs", revision or "main")
    snapshots = os.path.join(folder, "snapshots")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
        if os.path.isdir(os.path.join(snapshots, commit)):
            return os.path.join(snapshots, commit)
    if revision and os.path.isdir(os.path.join(snapshots, revision)):
        return os.path.join(snapshots, revision)
    if not revision and os.path.isdir(snapshots):
        found = sorted(os.scandir(snapshots), key=lambda e: e.stat().st_mtime, reverse=True)
        return found[0].path if found else None
    return None


def resolve_base(
    model: str | None, storage_options: Mapping[str, Any] | None = None, timeout: float | None = None
) -> tuple[BaseModel | None, str | None]:
    """(the base read from headers, None) or (None, why not and what would supply it)."""
    from .base import read_base
    from .errors import LorafastError

    if not model:
        return None, "the command names no model (vLLM: serve MODEL or --model; SGLang: --model-path)"
    path = model
    if "://" not in model and not os.path.exists(model):
        if model.count("/") == 1 and not model.startswith((".", "/")):
            path = _hf_cache_snapshot(model) or ""
            if not path:
                return None, (
                    f"{model!r} is a Hub repo id that is not in the local Hugging Face cache; download it, "
                    "or give its folder or an hf:// URL with --base"
                )
        else:
            return None, f"the model path {model!r} does not exist here; give the base with --base"
    try:
        return read_base(path, storage_options=storage_options, timeout=timeout), None
    except (LorafastError, OSError, ValueError) as e:
        return None, f"the base model {model!r} could not be read ({e}); give a readable one with --base"


# ---------------------------------------------------------------------------------------------------------------
# Trained and served scales


def trained_scale(module: Any) -> float:
    """PEFT's `LoraLayer.scaling` for the module: its `lora_alpha` (after `alpha_pattern`) over its `r` (after
    `rank_pattern`), or over `sqrt(r)` with rsLoRA; kohya's alpha / rank; 1.0 without an alpha."""
    r = module.config_rank or module.rank
    if module.alpha is None or not r:
        return 1.0
    return float(module.alpha) / (math.sqrt(r) if module.use_rslora else float(r))


def _differs(a: float, b: float) -> bool:
    return not math.isclose(a, b, rel_tol=_SCALE_TOLERANCE, abs_tol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def preflight(
    command: str | Sequence[str] | LaunchCommand,
    adapters: Iterable[str | os.PathLike[str]] | str | os.PathLike[str] | ScanReport = (),
    *,
    base: BaseModel | str | os.PathLike[str] | None = None,
    engine_version: str | None = None,
    strict_version: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    threads: int | None = None,
    progress: bool | None = False,
) -> PreflightReport:
    """Will the server `command` starts serve each adapter as trained? `adapters` are loaded later, through the
    engine's dynamic-load path (paths, folders and URLs expand as in `scan`, or a `ScanReport`, such as
    `lorafast.Index(...).scan(...)` of the fleet); those the
    command names are loaded at start-up. `base` overrides the model the command names (a `BaseModel`, a path or
    a URL read with `read_base`).

    Returns a `PreflightReport`: one verdict per adapter from `VERDICTS`, whether the server starts, and the way
    out of every verdict other than `serves`. `engine_version` / `strict_version` as for every compat answer.
    """
    from .compat.launch import LaunchCommand, parse_launch

    launch = (
        command
        if isinstance(command, LaunchCommand)
        else parse_launch(command, engine_version=engine_version, strict_version=strict_version)
    )
    if isinstance(base, (str, os.PathLike)):
        base_model, note = resolve_base(os.fspath(base), storage_options, timeout)
    elif base is not None:
        base_model, note = base, None
    else:
        base_model, note = resolve_base(launch.model, storage_options, timeout)
    fleet = _Fleet.read(launch, adapters, threads, storage_options, timeout, progress)
    from .serving_engines import judge

    return judge(launch, fleet, base_model, note)


def _name_of(path: str) -> str:
    """An adapter's name from its path: the folder, or the file's stem unless it is a standard weight-file name."""
    stem = os.path.basename(path.rstrip("/")).removesuffix(".safetensors")
    if stem in ("adapter_model", "pytorch_lora_weights") and os.path.dirname(path.rstrip("/")):
        return os.path.basename(os.path.dirname(path.rstrip("/")))
    return stem


@dataclass
class _Fleet:
    """The adapters to judge: (name, path, source) in order, their scanned `Adapter` (None when unreadable)."""

    entries: list[tuple[str, str, str]] = field(default_factory=list)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    errors: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def read(
        cls,
        launch: LaunchCommand,
        extra: Any,
        threads: int | None,
        storage_options: Mapping[str, Any] | None,
        timeout: float | None,
        progress: bool | None,
    ) -> _Fleet:
        from .scanning import ScanReport, scan

        fleet = cls()
        for name, path in launch.lora_adapters:
            fleet.entries.append((name, path, "command"))
        report: Any = None
        if isinstance(extra, ScanReport):  # a scan or an `Index.scan` of the fleet: nothing is read again
            report = extra
        else:
            items = [extra] if isinstance(extra, (str, os.PathLike)) else list(extra)
            if items:
                report = scan(
                    [os.fspath(p) for p in items],
                    threads=threads,
                    progress=progress,
                    storage_options=storage_options,
                    timeout=timeout,
                )
        named = {p for _, p, _ in fleet.entries}
        if report is not None:
            for path in report.paths:
                if path not in named:
                    fleet.entries.append((_name_of(path), path, "dynamic"))
            for adapter in report:
                fleet.adapters[adapter.path] = adapter
            for path, code, message in report.errors:
                fleet.errors[path] = (code, message)
        # The command's own adapters, read the way scan reads them (a Hub id that is not a path stays unread).
        local = [p for _, p, s in fleet.entries if s == "command" and p not in fleet.adapters]
        readable = [p for p in local if "://" in p or os.path.exists(p)]
        if readable:
            report = scan(readable, threads=threads, progress=False, storage_options=storage_options, timeout=timeout)
            by_input = {os.path.normpath(p): p for p in readable}
            for adapter in report:
                fleet.adapters[by_input.get(os.path.normpath(adapter.path), adapter.path)] = adapter
            for path, code, message in report.errors:
                fleet.errors[by_input.get(os.path.normpath(path), path)] = (code, message)
        return fleet
