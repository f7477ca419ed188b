"""Reports at column speed and incremental rescans, measured in one run.

For each fleet, in a fresh process, times against `lorafast.scan` of the same fleet, in --repeat interleaved rounds
(the scan, every step, the scan again; each figure the best of its rounds):
  to_json (returned, and streamed to a file), to_arrow (adapter + module tables), to_pandas, to_polars,
  to_parquet, iterating the report (modules are built when first read), iterating it reading every module, and
  as baselines the re-read iteration of before (`inspect_many` in batches of 512), `json.dumps` of every
  `record()` and pyarrow's own Parquet writer over `to_arrow()`'s tables;
and the peak memory each step adds (VmHWM, reset through /proc/self/clear_refs) against the size of the
report's columns (the Arrow tables' bytes, adapter + module table), each step in a fresh process that has
only scanned: "cold" as it is, "warm" after the step ran once on a one-adapter report, so that what does not grow
with the report (lazy imports, an allocator's arenas) is left out. The warm peak is the median of --memory-runs
such processes: one process's figure moves by about 2 MB with what the allocators (polars' jemalloc among them)
keep, which on the small fleet's 5.4 MB of columns is 0.4x. Then an `Index` over the fleet: the first
scan and a rescan of the unchanged fleet.

Targets, each printed as a same-run ratio with pass/fail: every export at most 1x the scan,
iteration at most 3x the scan, and the warm peak memory of every export and of iteration under 2x the columns.
The 1-minute load average is printed with each fleet: the machine may be shared, and load moves the ratios.

The ratios are only meaningful against the build that is installed: `lorafast._core.build_profile` is printed.

Fleets: "small", 20,000 single-file two-tensor adapters (rank and module name cycle, so headers repeat as in a
fleet of few recipes); "dense", 1,000 PEFT adapters of 448 tensors with four distinct headers; "unique", 1,000
of them whose headers all differ (bench_scan.make_dense).
`--before DIR` also times the scan and every step with the build installed in DIR (`make baseline`: 255a378, the
fixed reference build) and with this one, alternated, each in a fresh process per pass, for --passes passes
(default 5; benches/_compare.py; each pass the best of --compare-repeat calls): the median and spread of each,
its ratio to the reference and to the baselines above, and the load average at the start and end. 255a378 has no
to_arrow, to_pandas, to_polars, to_parquet nor a streaming to_json: those steps print no reference ratio.
Usage: python benches/bench_report.py [--small N] [--dense N] [--repeat N] [--memory-runs N]
[--fleets small,dense,unique] [--before DIR] [--passes N] [--compare-repeat N] [--no-targets]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compare import CHILD_PRELUDE, add_options, compare, report

# The steps both children time that are not one call: the baselines, and to_json streamed to a file. Only public
# names, so that the --before child runs them on another build too.
STEPS_CODE = r"""
def old_json(report):
    rows = []
    for i in range(len(report)):
        rec = report.record(i)
        if rec is not None:
            rec.pop("config_json", None)
            rows.append(rec)
    return json.dumps({"summary": report.summary(), "adapters": rows})

def old_iter(report):
    paths = report.ok_paths
    for s in range(0, len(paths), 512):
        for _ in lorafast.inspect_many(paths[s : s + 512]):
            pass

def stream(report, tmp):
    with open(os.path.join(tmp, "r.json"), "w") as f:
        report.to_json(f)

def pyarrow_parquet(report, tmp):
    import pyarrow.parquet
    pyarrow.parquet.write_table(report.to_arrow(), os.path.join(tmp, "pa.pq"))
    pyarrow.parquet.write_table(report.to_arrow("modules"), os.path.join(tmp, "pm.pq"))
"""

FLEET_CODE = (
    r"""
import atexit, io, json, os, shutil, sys, time, tempfile
import lorafast
import pyarrow, pyarrow.parquet, pandas, polars  # imported before any measurement
"""
    + STEPS_CODE
    + r"""

root, repeat, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def hwm_reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def best(fn):
    times = []
    for _ in range(repeat):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)

def peak(fn):
    hwm_reset(); base = status("VmRSS"); fn(); return status("VmHWM") - base

if what == "scan-memory":
    hwm_reset(); base = status("VmRSS")
    report = lorafast.scan([root], progress=False)
    print(json.dumps({"scan_peak": status("VmHWM") - base, "scan_held": status("VmRSS") - base}))
    sys.exit(0)

report = lorafast.scan([root], progress=False)
tmp = tempfile.mkdtemp()
atexit.register(shutil.rmtree, tmp, True)  # the files the steps write (and the index)

def make_steps(report):
    return {
        "to_json (str)": report.to_json,
        "to_json (stream to file)": lambda: stream(report, tmp),
        "to_arrow (both tables)": lambda: (report.to_arrow(), report.to_arrow("modules")),
        "to_pandas (both tables)": lambda: (report.to_pandas(), report.to_pandas("modules")),
        "to_polars (both tables)": lambda: (report.to_polars(), report.to_polars("modules")),
        "to_parquet (both tables)": lambda: report.to_parquet(os.path.join(tmp, "a.pq"), os.path.join(tmp, "m.pq")),
        "iterate (Adapters)": lambda: sum(1 for _ in report),
        "iterate, reading every module": lambda: sum(len(a.modules) for a in report),
        "baseline: json.dumps of record()s": lambda: old_json(report),
        "baseline: iterate by re-reading": lambda: old_iter(report),
        # What a user of pyarrow writes: the same tables through pyarrow's own writer (its defaults).
        "baseline: pyarrow write_table of to_arrow()": lambda: pyarrow_parquet(report, tmp),
    }

steps = make_steps(report)
if what == "index":  # its own process: the persistent Index, reported beside these targets
    db = os.path.join(tmp, "fleet.db")
    t = time.perf_counter(); first = lorafast.Index(db).scan([root], progress=False); t_first = time.perf_counter() - t
    t_again = best(lambda: lorafast.Index(db).scan([root], progress=False))
    again = lorafast.Index(db).scan([root], progress=False)
    t_scan = best(lambda: lorafast.scan([root], progress=False))
    print(json.dumps({"scan": t_scan, "index: first scan": (t_first, first.reads),
                      "index: rescan, unchanged": (t_again, again.reads)}))
    sys.exit(0)
if what.startswith("cold:"):  # the peak memory one step adds, in a process that has done nothing else since its scan
    print(json.dumps({"peak": peak(steps[what[5:]])}))
    sys.exit(0)
if what.startswith("warm:"):  # the same, after the step ran once on a one-adapter report: what grows with the
    # report, without the libraries' first-use costs (lazy imports, allocator arenas), which do not
    first = os.path.join(root, sorted(os.listdir(root))[0])
    make_steps(lorafast.scan([first], progress=False))[what[5:]]()
    print(json.dumps({"peak": peak(steps[what[5:]])}))
    sys.exit(0)

out = {"adapters": len(report), "steps": list(steps)}
adapters_t, modules_t = report.to_arrow(), report.to_arrow("modules")
out["modules"] = modules_t.num_rows
out["columns_bytes"] = adapters_t.nbytes + modules_t.nbytes
out["numpy_columns_bytes"] = sum(a.nbytes for a in report.columns().values())
del adapters_t, modules_t
# Rounds: the scan, every step, the scan again; each figure is the best of its rounds. Interleaved, so a slow
# spell of this VM (the same call here runs 2 ms or 9 ms for a few hundred milliseconds at a time) falls on the
# scan and the steps alike, rather than on all five tries of one step.
scan = lambda: lorafast.scan([root], progress=False)
timed = [("scan", scan), *steps.items(), ("scan_after", scan)]
times = {name: [] for name, _ in timed}
for _ in range(repeat):
    for name, fn in timed:
        t = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t)
out.update({name: min(ts) for name, ts in times.items()})
print(json.dumps(out))
"""
)


# --before: one build's scan and steps on one fleet in a fresh process (benches/_compare.py), each the best of
# `repeat` calls after a warm-up; only public names. A step the build lacks is named in `missing`; the baselines
# are timed in this build's process only.
COMPARE_CODE = (
    CHILD_PRELUDE
    + STEPS_CODE
    + r"""
import inspect, shutil, tempfile
root, repeat = ARGS[0], int(ARGS[1])
report = lorafast.scan([root], progress=False)
tmp = tempfile.mkdtemp()

steps = {
    "scan": (lambda: lorafast.scan([root], progress=False), None),
    "to_json (str)": (report.to_json, None),
    "to_json (stream to file)": (lambda: stream(report, tmp), "ScanReport.to_json(fp)"),
    "to_arrow (both tables)": (lambda: (report.to_arrow(), report.to_arrow("modules")), "ScanReport.to_arrow"),
    "to_pandas (both tables)": (lambda: (report.to_pandas(), report.to_pandas("modules")), "ScanReport.to_pandas"),
    "to_polars (both tables)": (lambda: (report.to_polars(), report.to_polars("modules")), "ScanReport.to_polars"),
    "to_parquet (both tables)": (lambda: report.to_parquet(os.path.join(tmp, "a.pq"), os.path.join(tmp, "m.pq")),
                                 "ScanReport.to_parquet"),
    "iterate (Adapters)": (lambda: sum(1 for _ in report), None),
    "iterate, reading every module": (lambda: sum(len(a.modules) for a in report), None),
}
if ROLE == "this":
    steps.update({"baseline: json.dumps of record()s": (lambda: old_json(report), None),
                  "baseline: iterate by re-reading": (lambda: old_iter(report), None),
                  "baseline: pyarrow write_table of to_arrow()": (lambda: pyarrow_parquet(report, tmp), None)})
def lacks(needs):
    if needs == "ScanReport.to_json(fp)":  # 255a378's to_json returns a str only
        return None if "fp" in inspect.signature(report.to_json).parameters else "lorafast." + needs
    return missing_api(needs) if needs else None

claims, missing = {}, {}
for name, (fn, needs) in steps.items():
    gone = lacks(needs)
    if gone:
        missing[name] = gone
    else:
        claims[name] = best_of(fn, repeat)
shutil.rmtree(tmp, True)
child_result(claims, missing)
"""
)

#: Each step of --before, and the baselines it is a ratio to.
COMPARE_BASELINES = {
    "scan": [],
    "to_json (str)": ["baseline: json.dumps of record()s"],
    "to_json (stream to file)": ["baseline: json.dumps of record()s"],
    "to_arrow (both tables)": [],
    "to_pandas (both tables)": [],
    "to_polars (both tables)": [],
    "to_parquet (both tables)": ["baseline: pyarrow write_table of to_arrow()"],
    "iterate (Adapters)": ["baseline: iterate by re-reading"],
    "iterate, reading every module": ["baseline: iterate by re-reading"],
}


def compare_fleet(label: str, root: str, before: str, passes: int, repeat: int) -> None:
    """The scan and every step, this build against the one in `before`, alternated in fresh processes."""
    comp = compare(COMPARE_CODE, [root, repeat], before, passes, label=f"\n{label}, against {before}: ")
    report(comp, COMPARE_BASELINES, baselines=COMPARE_BASELINES)


def make_small(root: str, n: int) -> None:
    from lorafast.testing import write_safetensors

    mods = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]
    for i in range(n):
        r = (4, 8, 16, 32)[i % 4]
        key = f"base_model.model.model.layers.{i % 7}.self_attn.{mods[i % 5]}"
        tensors = {f"{key}.lora_A.weight": ("BF16", (r, 64)), f"{key}.lora_B.weight": ("BF16", (64, r))}
        write_safetensors(os.path.join(root, f"a{i:06d}.safetensors"), tensors)


def fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


#: The targets: step time / scan time at most this (exports 1x, iteration 3x); peak memory a step adds /
#: the columns' bytes under MEMORY_TARGET.
TIME_TARGETS = {
    "to_json (str)": 1.0,
    "to_json (stream to file)": 1.0,
    "to_arrow (both tables)": 1.0,
    "to_pandas (both tables)": 1.0,
    "to_polars (both tables)": 1.0,
    "to_parquet (both tables)": 1.0,
    "iterate (Adapters)": 3.0,
    "iterate, reading every module": 3.0,
}
MEMORY_TARGET = 2.0


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def child(root: str, repeat: int, what: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FLEET_CODE, root, str(repeat), what], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{what} on {root} failed:\n{out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def verdict(ratio: float, target: float, strict: bool = False) -> str:
    ok = ratio < target if strict else ratio <= target
    return ("pass" if ok else "FAIL") + f" (<{'' if strict else '='} {target:g})"


def warm_peak(root: str, step: str, runs: int) -> float:
    """The median of `runs` fresh processes' warm peaks for `step`."""
    peaks = sorted(child(root, 1, "warm:" + step)["peak"] for _ in range(runs))
    return peaks[len(peaks) // 2]


def run_fleet(label: str, root: str, repeat: int, memory_runs: int) -> list[str]:
    """Prints the fleet's table; returns the targets it missed."""
    before = load()
    r = child(root, repeat, "time")
    mem = child(root, repeat, "scan-memory")
    # Ratios are against the faster of the scans at the start and the end of the rounds: a scan slowed by other
    # load would flatter them.
    scan, cols = min(r["scan"], r["scan_after"]), r["columns_bytes"]
    print(f"\n{label}: {r['adapters']:,} adapters, {r['modules']:,} modules; scan {r['scan'] * 1e3:.0f} ms at the "
          f"start of each round, {r['scan_after'] * 1e3:.0f} ms at the end; {before} at the start")  # fmt: skip
    print(f"  columns (Arrow tables, adapters + modules): {fmt_bytes(cols)}; numpy columns(): "
          f"{fmt_bytes(r['numpy_columns_bytes'])}")  # fmt: skip
    print(f"  a scan's peak RSS: {fmt_bytes(mem['scan_peak'])}, held by its report: {fmt_bytes(mem['scan_held'])}")
    print("  peak added: in a fresh process that has only scanned (cold), and after the step ran once on a one-adapter")
    print("  report (warm: without the libraries' first-use costs; the median of "
          f"{memory_runs} processes); the memory target is checked on the warm peak")  # fmt: skip
    print(f"  {'step':<36} {'ms':>7} {'time/scan':>9} {'time target':>16} {'peak, cold':>11} {'warm':>8} "
          f"{'warm/columns':>12} {'memory target':>15}")  # fmt: skip
    missed = []
    for name in r["steps"]:
        secs, cold, extra = r[name], child(root, 1, "cold:" + name)["peak"], warm_peak(root, name, memory_runs)
        line = f"  {name:<36} {secs * 1e3:>7.0f} {secs / scan:>9.2f}"
        if name in TIME_TARGETS:
            t_verdict, m_verdict = verdict(secs / scan, TIME_TARGETS[name]), verdict(extra / cols, MEMORY_TARGET, True)
            missed += [
                f"{label}: {name} {what}" for what, v in (("time", t_verdict), ("memory", m_verdict)) if "FAIL" in v
            ]
        else:
            t_verdict = m_verdict = "(baseline)"
        print(
            f"{line} {t_verdict:>16} {fmt_bytes(cold):>11} {fmt_bytes(extra):>8} {extra / cols:>12.2f} {m_verdict:>15}"
        )
    try:
        ix = child(root, repeat, "index")
    except RuntimeError as e:  # the Index is measured here but is not one of these targets
        print(f"  index: not measured: {str(e).splitlines()[-1]}")
    else:
        for name in ("index: first scan", "index: rescan, unchanged"):
            secs, reads = ix[name]
            print(f"  {name:<36} {secs * 1e3:>7.0f} {secs / ix['scan']:>9.2f}   adapters read: {reads}")
    print(f"  {load()} at the end")
    return missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=20000)
    ap.add_argument("--dense", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--memory-runs", type=int, default=3, help="fresh processes per warm peak (the median is shown)")
    ap.add_argument("--fleets", default="small,dense,unique", help="comma-separated: small, dense, unique")
    add_options(ap)
    ap.add_argument("--compare-repeat", type=int, default=3, help="calls per step in each --before pass (the best)")
    ap.add_argument("--no-targets", action="store_true", help="only the --before comparison, not the targets' table")
    args = ap.parse_args()
    fleets = args.fleets.split(",")
    if not set(fleets) <= {"small", "dense", "unique"}:
        ap.error(f"unknown fleet in --fleets {args.fleets!r}")
    import lorafast._core
    from bench_scan import make_dense

    print(f"cores: {os.cpu_count()}; lorafast build: {lorafast._core.build_profile}")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        makers = {
            "small": lambda root: make_small(root, args.small),
            "dense": lambda root: make_dense(root, args.dense),
            "unique": lambda root: make_dense(root, args.dense, unique=True),
        }
        for name in fleets:
            os.makedirs(os.path.join(tmp, name))
            makers[name](os.path.join(tmp, name))
        print(f"fleets written in {time.perf_counter() - t:.1f} s")
        missed = []
        for name in fleets:
            if not args.no_targets:
                missed += run_fleet(name, os.path.join(tmp, name), args.repeat, args.memory_runs)
            if args.before:
                compare_fleet(name, os.path.join(tmp, name), args.before, args.passes, args.compare_repeat)
    if args.no_targets:
        return 0
    print("\nall targets met" if not missed else f"\ntargets missed: {len(missed)}\n  " + "\n  ".join(missed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
