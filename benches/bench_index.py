"""`lorafast.Index` against a full `lorafast.scan` of the same tree, in one run.

Fleets: "dense", 2,000 PEFT folders of 448 tensors with four distinct headers (bench_scan.make_dense); "small",
20,000 single-file two-tensor adapters (bench_report.make_small); "sample" (not run by default), 20,000 adapters
of every format and layout from `lorafast sample` (lorafast.sample.write_samples, a few thousand distinct headers).

Each pass is a fresh process (benches/_compare.py) that times, after a warm-up scan, a full scan, then each step
right after a full scan of the same tree: the build of a new index (its first scan, the file made), an unchanged
rescan, and a rescan after 1% of the adapters changed (their weights' mtime set anew: read again, encoded and
written, as a rewrite would be). The index is open in the process (`Index.scan` on it), reports are freed outside
the clock, as the scan's are. A step's ratio is its time over the scan's just before it; the median of --passes
passes (default 5) is shown with the spread (min-max), against the targets: an unchanged rescan at most
0.25x a full scan, a 1%-changed one at most 0.25x + 1%, the build at most 2x. Two floors are shown: the
discovery alone (`_core.discover`, the walk a rescan cannot avoid), and the walk with each adapter's files
stated and signed (`_core.IndexScan`, the first step of every `Index.scan`, before anything stored is read).
The load average is printed at the start and the end of each fleet's passes: the machine may be shared, and
load moves the ratios.

`--before DIR` runs the same passes with the build installed in DIR (`make baseline`: 255a378, the fixed
reference build), alternated with this one, and prints each step's ratio to it; 255a378 has no
`lorafast.Index`, so against it only the full scan has a reference ratio.

The ratios mean something only for a release build: `lorafast._core.build_profile` is printed.
Usage: python benches/bench_index.py [--dense N] [--small N] [--sample N] [--passes N] [--fleets dense,small]
[--dir DIR] [--before DIR] (--dir keeps the generated fleets for later runs; default: a temporary folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import lorafast
from _compare import CHILD_PRELUDE, add_options, compare, ratios, report
from bench_report import make_small
from bench_scan import make_dense
from lorafast import _core
from lorafast.sample import write_samples

#: The targets, as step time / full scan time.
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
        elif label == "small":
            make_small(path, n)
        else:
            write_samples(path, n)
        os.sync()  # written back now, not while steps are timed
        open(done, "w").close()
        print(f"{label}: {n} adapters written in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


#: The steps after the full scan, in the order each pass runs them.
STEPS = ("build", "rescan, unchanged", "rescan, 1% changed")

# One pass over one fleet in a fresh process (benches/_compare.py): a warm-up scan, the full scan, the discovery
# floor (this build only: `_core.discover` is not public), then each step right after a full scan of its own.
PASS_CODE = (
    CHILD_PRELUDE
    + r"""
import gc, tempfile
root = ARGS[0]
STEPS = ("build", "rescan, unchanged", "rescan, 1% changed")

def timed(fn):
    # seconds `fn` takes; what it returns is freed after the clock stops
    gc.collect()
    t = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t
    del out
    gc.collect()
    return secs

scan = lambda: lorafast.scan([root], progress=False)
timed(scan)  # warm-up: page cache, imports, allocator
claims, missing = {"full scan": timed(scan)}, {}
if ROLE == "this":
    from lorafast import _core
    claims["discovery only"] = timed(lambda: _core.discover([root], True))
    # The walk a rescan does, each adapter's files stated and signed: its floor, before anything stored is read.
    claims["walk + stats"] = timed(lambda: _core.IndexScan([os.path.abspath(root)], True, None, b"", None, None, None))
gone = missing_api("Index")
if gone:
    missing = {step: gone for step in STEPS}
else:
    with tempfile.TemporaryDirectory(prefix="lorafast-bench-index-") as tmp:
        db = os.path.join(tmp, "fleet.db")
        weights = [a.weight_files[0] for a in lorafast.scan([root], progress=False)]
        state = {"touched": 0}

        def build():
            state["index"] = lorafast.Index(db)
            return state["index"].scan([root])

        def rescan():
            report = state["index"].scan([root])
            assert report.reads == state["touched"], (report.reads, state["touched"])
            return report

        for step, fn in zip(STEPS, (build, rescan, rescan)):
            if step == "rescan, 1% changed":  # a new mtime on every hundredth adapter's weights
                ns = time.time_ns()
                touched = weights[::100]
                for k, w in enumerate(touched):
                    os.utime(w, ns=(ns + k, ns + k))
                state["touched"] = len(touched)
            claims["full scan before " + step] = timed(scan)
            claims[step] = timed(fn)
        state["index"].close()
child_result(claims, missing)
"""
)


def bench_fleet(
    label: str, root: str, passes: int, before: str | None
) -> list[tuple[str, str, list[float], list[float]]]:
    """(fleet, step, this build's times, its ratios to the full scan before it) for each step; with `before`,
    also prints the ratios to the reference build."""
    n = sum(1 for _ in lorafast.scan([root], progress=False))
    comp = compare(PASS_CODE, [root], before, passes, label=f"{label}: {n} adapters; ")
    rows = [(label, "full scan", comp.times("this", "full scan"), [1.0] * passes)]
    for floor in ("discovery only", "walk + stats"):
        ts = comp.times("this", floor)
        rows.append((label, floor, ts, ratios(ts, comp.times("this", "full scan"))))
    for step in STEPS:
        ts = comp.times("this", step)
        rows.append((label, step, ts, ratios(ts, comp.times("this", "full scan before " + step))))
    if before:
        print(f"{label}: this build against the reference in {before} (ratio: reference time / this build's)")
        report(comp, ("full scan", *STEPS), per=n)
    else:
        print(f"  load average at the start {comp.load_start}, at the end {comp.load_end}")
    return rows


def spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}–{format(max(xs), fmt)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dense", type=int, default=2000)
    ap.add_argument("--small", type=int, default=20000)
    ap.add_argument("--sample", type=int, default=20000)
    add_options(ap)
    ap.add_argument("--fleets", default="dense,small", help="comma-separated: dense, small, sample")
    ap.add_argument("--dir", help="write the fleets here and reuse them in later runs")
    args = ap.parse_args()
    print(f"lorafast {lorafast.__version__}, core build: {_core.build_profile}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="lorafast-bench-index-") as tmp:
        root = args.dir or tmp
        counts = {"dense": args.dense, "small": args.small, "sample": args.sample}
        rows = []
        for label in args.fleets.split(","):
            rows += bench_fleet(label, make_fleet(root, label, counts[label]), args.passes, args.before)
    print(f"\nthis build, median of {args.passes} passes (min–max); ratio: step / the full scan just before it")
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
