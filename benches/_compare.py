"""Same-run comparison of two lorafast builds, shared by the benchmarks' `--before DIR --passes N` (the fixed reference build, docs/benchmarks.md).

A benchmark hands `compare` the source of a child program. Each pass runs it once per build, each in a fresh
interpreter: the reference build (the folder `--before` names, put first on `PYTHONPATH`) and this build (the
lorafast this process imports), in alternated order (the reference first on even passes, this build first on odd
ones), so that a slow spell of a shared machine falls on both. The child is run as
`python -c CODE ROLE ARG...`, with ROLE `reference` or `this` and the benchmarks folder on `sys.path`; it prints
one JSON object as its last line of output:

    {"claims": {name: seconds}, "missing": {name: "why"}}

Where the reference build lacks an API a claim needs, the child leaves the claim out and names what is missing
(`missing_api` helps): the report then says "255a378 has no X: no reference ratio" rather than failing. The child
uses only public `lorafast.*` names in what it times. The Python baselines a benchmark already has are timed by
the `this` child (the `reference` one skips them) or passed in measured once (`fixed`).

`report` prints each claim as the median of its passes with the spread (min-max), its ratio to the reference
(reference time / this build's time, per pass: above 1x this build is faster) and to each of its baselines, with
the load average at the start and end of the passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: The commit `make baseline` builds; the benchmarks' --before is meant to point at its build.
REFERENCE = "255a378"
#: Where `make bench-build` installs this tree's release build.
BENCH_DIR = ".cache/bench-head"

#: Code a child program can start with: the imports and the `missing_api` / `best_of` helpers.
CHILD_PRELUDE = r"""
import json, os, sys, time
import lorafast
from _compare import best_of, missing_api, child_result
ROLE, ARGS = sys.argv[1], sys.argv[2:]
"""


def best_of(fn: Callable[[], object], repeat: int, keep: bool = False) -> float:
    """The best of `repeat` timed calls after a warm-up. What `fn` returns is freed inside the timed window (as
    a caller that drops it pays), or with `keep` only after the clock stops (the call alone)."""
    fn()  # warm-up pass (page cache, imports)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        if keep:
            result = fn()
            times.append(time.perf_counter() - t)
            del result  # after the clock stops, not when the next call's result replaces it
        else:
            fn()  # its result is freed before the clock stops
            times.append(time.perf_counter() - t)
    return min(times)


def missing_api(*names: str) -> str | None:
    """The first of the dotted public names (`"Index"`, `"compat.sglang.preflight"`, `"ScanReport.to_arrow"`)
    the imported lorafast lacks, as `lorafast.X`; None when it has them all."""
    import importlib

    import lorafast

    for name in names:
        obj: Any = lorafast
        for part in name.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{part}")
                except (ImportError, AttributeError):
                    return f"lorafast.{name}"
    return None


def child_result(claims: Mapping[str, float], missing: Mapping[str, str] | None = None) -> None:
    """Print what a child measured, as `compare` reads it."""
    import lorafast

    core = getattr(lorafast, "_core", None)
    out = {
        "file": lorafast.__file__,
        "build": getattr(core, "build_profile", "?"),
        "claims": dict(claims),
        "missing": dict(missing or {}),
    }
    print(json.dumps(out), flush=True)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def this_build() -> str:
    """The folder the lorafast this process imports lives in (what `PYTHONPATH` names for a child)."""
    import lorafast

    return os.path.dirname(os.path.dirname(os.path.abspath(lorafast.__file__)))


@dataclass
class Comparison:
    """Every pass's figures of both builds: `runs[build]` is a list, one dict of claim -> seconds per pass."""

    before: str | None
    runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    missing: dict[str, dict[str, str]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    load_start: str = ""
    load_end: str = ""

    def times(self, build: str, claim: str) -> list[float]:
        return [r[claim] for r in self.runs.get(build, []) if claim in r]


def run_child(code: str, role: str, args: Iterable[str], path: str) -> dict[str, Any]:
    """`code` in a fresh interpreter with `path` first on `PYTHONPATH`; its last output line, as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, HERE])}
    cmd = [sys.executable, "-c", code, role, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {role} build's child failed ({path}):\n{done.stderr.strip()[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def compare(code: str, args: Iterable[object], before: str | None, passes: int, label: str = "") -> Comparison:
    """`passes` alternated passes of `code`, each build in a fresh process per pass (see the module docstring).
    Without `before`, only this build is run."""
    argv = [str(a) for a in args]
    builds = {"this": this_build()}
    if before:
        if not os.path.isdir(os.path.join(before, "lorafast")):
            raise SystemExit(f"--before {before}: no lorafast there (make baseline builds {REFERENCE} into .cache/)")
        builds = {"reference": os.path.abspath(before), **builds}
    comp = Comparison(before=before, load_start=load())
    comp.runs = {b: [] for b in builds}
    print(f"{label}{passes} alternated passes, each build in a fresh process; load average {comp.load_start}")
    for p in range(passes):
        order = list(builds) if p % 2 == 0 else list(reversed(builds))
        for build in order:
            out = run_child(code, build, argv, builds[build])
            comp.runs[build].append(out["claims"])
            comp.missing.setdefault(build, {}).update(out["missing"])
            comp.files.setdefault(build, f"{out['file']} ({out['build']} build)")
        print(f"  pass {p + 1}/{passes} done, load {os.getloadavg()[0]:.2f}", flush=True)
    comp.load_end = load()
    return comp


def add_options(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' `--before DIR` and `--passes N`."""
    parser.add_argument("--before", help="a folder another lorafast build is installed in (make baseline), timed alike")
    parser.add_argument("--passes", type=int, default=5, help="passes, each build in a fresh process per pass")


def reference_name(before: str | None) -> str:
    """The commit a `make baseline` folder (`.cache/baseline-<commit>`) holds, or "the reference"."""
    base = os.path.basename(os.path.normpath(before or ""))
    return base.removeprefix("baseline-") if base.startswith("baseline-") else "the reference"


def spread(xs: list[float], fmt: str = ".3f") -> str:
    """median (min-max)"""
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def ratios(num: list[float], den: list[float]) -> list[float]:
    """Per-pass ratios num[i] / den[i]."""
    return [a / b for a, b in zip(num, den, strict=False) if b > 0]


def report(
    comp: Comparison,
    claims: Iterable[str],
    baselines: Mapping[str, Iterable[str]] | None = None,
    fixed: Mapping[str, float] | None = None,
    per: float | None = None,
    unit: str = "adapters",
    rate_fmt: str = ",.0f",
) -> None:
    """Print each claim: this build's median (spread) in ms, or as `per` `unit`/s; the ratio to the reference;
    the ratio to each baseline of `baselines[claim]` (a claim of the `this` child, per pass, or a number of
    seconds in `fixed`, measured once)."""
    baselines, fixed = baselines or {}, fixed or {}
    ref = "reference" if "reference" in comp.runs else None
    for build, where in comp.files.items():
        print(f"  {build}: {where}")
        if not where.endswith("(release build)"):
            print(
                f"  warning: {build} is not a release build: no claim (make bench-build, then PYTHONPATH={BENCH_DIR})"
            )
    for claim in claims:
        mine = comp.times("this", claim)
        if not mine:
            why = comp.missing.get("this", {}).get(claim, "not measured")
            print(f"  {claim}: this build: {why}")
            continue
        if per:
            value = spread([per / t for t in mine], rate_fmt) + f" {unit}/s"
        else:
            value = spread([t * 1e3 for t in mine], ".1f") + " ms"
        parts = [f"  {claim}: {value}"]
        if ref:
            theirs = comp.times(ref, claim)
            if theirs:
                parts.append(f"{spread(ratios(theirs, mine), '.2f')}x the reference")
            else:
                why = comp.missing.get(ref, {}).get(claim, "figure for it")
                parts.append(f"{reference_name(comp.before)} has no {why}: no reference ratio")
        for base in baselines.get(claim, ()):
            if base in fixed:
                parts.append(f"{fixed[base] / statistics.median(mine):.2f}x {base}")
            elif comp.times("this", base):
                parts.append(f"{spread(ratios(comp.times('this', base), mine), '.2f')}x {base}")
        print("; ".join(parts))
    print(f"  load average at the start {comp.load_start}, at the end {comp.load_end}")
