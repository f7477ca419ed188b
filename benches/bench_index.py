"""`lorafast.Index` against a full `lorafast.scan` of the same tree (issue 32, parts 3 and 4), in one run.

Fleets: "dense", 2,000 PEFT folders of 448 tensors with four distinct headers (bench_scan.make_dense); "sample",
20,000 adapters of every format and layout from `lorafast sample` (lorafast.sample.write_samples, which writes a
few thousand distinct headers).

Each pass times, alternated, each step right after a full scan of the same tree: the build of a new index (its
first scan, the file made), an unchanged rescan, and a rescan after 1% of the adapters changed (their weights'
mtime set anew: read again, encoded and written, as a rewrite would be). The index is open in the process
(`Index.scan` on it), reports are freed outside the clock, as the scan's are. A step's ratio is its time over
the scan's just before it; the median of --passes passes is shown with the spread (min-max), against issue 32's
targets: an unchanged rescan at most 0.25x a full scan, a 1%-changed one at most 0.25x + 1%, the build at most
2x. The discovery alone (`_core.discover`, the walk a rescan cannot avoid) is shown as a floor. The 1-minute load
average is printed before and after each fleet: the machine may be shared, and load moves the ratios.

The ratios mean something only for a release build: `lorafast._core.build_profile` is printed.
Usage: python benches/bench_index.py [--dense N] [--sample N] [--passes N] [--fleets dense,sample] [--dir DIR]
(DIR keeps the generated fleets for later runs; default: a temporary folder).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lorafast
from bench_scan import make_dense
from lorafast import _core
from lorafast.sample import write_samples

#: Issue 32's targets, as step time / full scan time.
TARGETS = {"build": 2.0, "rescan, unchanged": 0.25, "rescan, 1% changed": 0.26}


def make_fleet(root: str, label: str, n: int) -> str:
    """The fleet `label` of `n` adapters under `root`: written there, or the one a previous run left (`--dir`)."""
    path = os.path.join(root, f"{label}-{n}")
    done = path + ".done"
    if not os.path.exists(done):
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        t = time.perf_counter()
        if label == "dense":
            make_dense(path, n)
        else:
            write_samples(path, n)
        os.sync()  # written back now, not while steps are timed
        open(done, "w").close()
        print(f"{label}: {n} adapters written in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` takes; what it returns is freed after the clock stops."""
    gc.collect()
    t = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t
    del out
    gc.collect()
    return secs


def drop(db: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.remove(db + suffix)


def bench_fleet(label: str, root: str, passes: int, work: str) -> list[tuple[str, str, list[float], list[float]]]:
    """(fleet, step, its times, its ratios to the scan before it) for each step."""
    db = os.path.join(work, f"{label}.db")
    report = lorafast.scan([root], progress=False)
    n, weights = len(report), [a.weight_files[0] for a in report]
    del report
    state: dict[str, Any] = {"index": None, "touched": 0}

    def scan() -> lorafast.ScanReport:
        return lorafast.scan([root], progress=False)

    def build() -> lorafast.ScanReport:
        state["index"] = lorafast.Index(db)
        return state["index"].scan([root])

    def rescan() -> lorafast.ScanReport:
        report = state["index"].scan([root])
        assert report.reads == state["touched"], (report.reads, state["touched"])
        return report

    steps: dict[str, Callable[[], object]] = {"discovery only": lambda: _core.discover([root], True), "build": build}
    steps.update({"rescan, unchanged": rescan, "rescan, 1% changed": rescan})
    times: dict[str, list[float]] = {k: [] for k in ("full scan", *steps)}
    ratios: dict[str, list[float]] = {k: [] for k in times}
    print(f"{label}: {n} adapters, load {os.getloadavg()[0]:.1f}", flush=True)
    for p in range(passes + 1):  # pass 0 warms the page cache and the allocator
        drop(db)
        for name, fn in steps.items():
            if name == "rescan, 1% changed":  # a new mtime on every hundredth adapter's weights
                ns = time.time_ns()
                touched = weights[p % 100 :: 100]
                for k, w in enumerate(touched):
                    os.utime(w, ns=(ns + k, ns + k))
                state["touched"] = len(touched)
            before = timed(scan)
            t = timed(fn)
            if p:
                times["full scan"].append(before)
                times[name].append(t)
                ratios[name].append(t / before)
        state["touched"] = 0
        assert len(rescan()) == n
        state["index"].close()
        print(f"  pass {p}{' (warm-up)' if not p else ''}, load {os.getloadavg()[0]:.1f}", flush=True)
    drop(db)
    return [(label, name, times[name], ratios[name]) for name in times]


def spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}–{format(max(xs), fmt)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dense", type=int, default=2000)
    ap.add_argument("--sample", type=int, default=20000)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--fleets", default="dense,sample")
    ap.add_argument("--dir", help="write the fleets here and reuse them in later runs")
    args = ap.parse_args()
    print(f"lorafast {lorafast.__version__}, core build: {_core.build_profile}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="lorafast-bench-index-") as tmp:
        root = args.dir or tmp
        counts = {"dense": args.dense, "sample": args.sample}
        rows = []
        for label in args.fleets.split(","):
            rows += bench_fleet(label, make_fleet(root, label, counts[label]), args.passes, tmp)
    print(f"\nmedian of {args.passes} passes (min–max); ratio: step / the full scan just before it")
    print("| fleet | step | time (ms) | ratio to a full scan | target | verdict |")
    print("|---|---|---|---|---|---|")
    for label, name, ts, rs in rows:
        ms = [t * 1e3 for t in ts]
        target = TARGETS.get(name)
        ratio = spread(rs, ".3f") + "x" if name != "full scan" else "1x"
        verdict = "" if target is None else ("pass" if statistics.median(rs) <= target else "FAIL")
        print(
            f"| {label} | {name} | {spread(ms, '.1f')} | {ratio} | {f'≤ {target:g}x' if target else ''} | {verdict} |"
        )
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
