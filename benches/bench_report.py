"""Reports at column speed (issue 16, part 2) and incremental rescans (part 4), measured in one run.

For each fleet, in a fresh process, times against `lorafast.scan` of the same fleet (best of --repeat):
  to_json (returned, and streamed to a file), to_arrow (adapter + module tables), to_pandas, to_polars,
  to_parquet, iterating the report, and as baselines the re-read iteration of before
  (`inspect_many` in batches of 512) and `json.dumps` of every `record()`;
and the peak memory each step adds (VmHWM, reset through /proc/self/clear_refs) against the size of the
report's columns (the Arrow tables' bytes, adapter + module table), each step in a fresh process that has
only scanned. Then an `Index` over the fleet: the first scan and a rescan of the unchanged fleet.

The ratios are only meaningful against the build that is installed: `lorafast._core.build_profile` is printed.

Fleets: "small", 20,000 single-file two-tensor adapters (rank and module name cycle, so headers repeat as in a
fleet of few recipes); "dense", 1,000 PEFT adapters of 448 tensors with four distinct headers; "unique", 1,000
of them whose headers all differ (bench_scan.make_dense). Usage: python benches/bench_report.py [--small N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

FLEET_CODE = r"""
import io, json, os, sys, time, tempfile
import lorafast
from lorafast.scanner import inspect_many
import pyarrow, pyarrow.parquet, pandas, polars  # imported before any measurement

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

def old_json():
    rows = []
    for i in range(len(report)):
        rec = report.record(i)
        if rec is not None:
            rec.pop("config_json", None)
            rows.append(rec)
    return json.dumps({"summary": report.summary(), "adapters": rows})

def old_iter():
    paths = report.ok_paths
    for s in range(0, len(paths), 512):
        for _ in inspect_many(paths[s : s + 512]):
            pass

def stream():
    with open(os.path.join(tmp, "r.json"), "w") as f:
        report.to_json(f)

steps = {
    "to_json (str)": report.to_json,
    "to_json (stream to file)": stream,
    "to_arrow (both tables)": lambda: (report.to_arrow(), report.to_arrow("modules")),
    "to_pandas (both tables)": lambda: (report.to_pandas(), report.to_pandas("modules")),
    "to_polars (both tables)": lambda: (report.to_polars(), report.to_polars("modules")),
    "to_parquet (both tables)": lambda: report.to_parquet(os.path.join(tmp, "a.pq"), os.path.join(tmp, "m.pq")),
    "iterate (Adapters)": lambda: sum(1 for _ in report),
    "baseline: json.dumps of record()s": old_json,
    "baseline: iterate by re-reading": old_iter,
}
if what != "time":  # the peak memory one step adds, in a process that has done nothing else since its scan
    print(json.dumps({what: peak(steps[what])}))
    sys.exit(0)

t_scan = best(lambda: lorafast.scan([root], progress=False))
out = {"adapters": len(report), "scan": t_scan, "steps": list(steps)}
adapters_t, modules_t = report.to_arrow(), report.to_arrow("modules")
out["modules"] = modules_t.num_rows
out["columns_bytes"] = adapters_t.nbytes + modules_t.nbytes
out["numpy_columns_bytes"] = sum(a.nbytes for a in report.columns().values())
del adapters_t, modules_t
for name, fn in steps.items():
    out[name] = best(fn)

db = os.path.join(tmp, "fleet.db")
t = time.perf_counter(); first = lorafast.Index(db).scan([root], progress=False); t_first = time.perf_counter() - t
t_again = best(lambda: lorafast.Index(db).scan([root], progress=False))
again = lorafast.Index(db).scan([root], progress=False)
out["index: first scan"] = (t_first, first.reads)
out["index: rescan, unchanged"] = (t_again, again.reads)
print(json.dumps(out))
"""


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


def child(root: str, repeat: int, what: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", FLEET_CODE, root, str(repeat), what], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_fleet(label: str, root: str, repeat: int) -> None:
    r = child(root, repeat, "time")
    mem = child(root, repeat, "scan-memory")
    scan, cols = r["scan"], r["columns_bytes"]
    print(f"\n{label}: {r['adapters']:,} adapters, {r['modules']:,} modules; scan {scan * 1e3:.0f} ms")
    print(f"  columns (Arrow tables, adapters + modules): {fmt_bytes(cols)}; numpy columns(): "
          f"{fmt_bytes(r['numpy_columns_bytes'])}")  # fmt: skip
    print(f"  a scan's peak RSS: {fmt_bytes(mem['scan_peak'])}, held by its report: {fmt_bytes(mem['scan_held'])}")
    print(f"  {'step':<36} {'ms':>9} {'x scan':>8} {'peak added':>12} {'x columns':>10}")
    for name in r["steps"]:
        secs, extra = r[name], child(root, 1, name)[name]
        print(f"  {name:<36} {secs * 1e3:>9.0f} {secs / scan:>8.2f} {fmt_bytes(extra):>12} {extra / cols:>10.2f}")
    for name in ("index: first scan", "index: rescan, unchanged"):
        secs, reads = r[name]
        print(f"  {name:<36} {secs * 1e3:>9.0f} {secs / scan:>8.2f}   adapters read: {reads}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=20000)
    ap.add_argument("--dense", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    import lorafast._core
    from bench_scan import make_dense

    print(f"cores: {os.cpu_count()}; lorafast build: {lorafast._core.build_profile}")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        os.makedirs(os.path.join(tmp, "small"))
        make_small(os.path.join(tmp, "small"), args.small)
        os.makedirs(os.path.join(tmp, "dense"))
        make_dense(os.path.join(tmp, "dense"), args.dense)
        os.makedirs(os.path.join(tmp, "unique"))
        make_dense(os.path.join(tmp, "unique"), args.dense, unique=True)
        print(f"fleets written in {time.perf_counter() - t:.1f} s")
        run_fleet("small", os.path.join(tmp, "small"), args.repeat)
        run_fleet("dense", os.path.join(tmp, "dense"), args.repeat)
        run_fleet("unique", os.path.join(tmp, "unique"), args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
