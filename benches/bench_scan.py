"""Scan throughput: lorafast.scan against the Python ways people read adapter headers today.

Generates 2,000 dense PEFT adapters (32 layers x 7 modules x A/B = 448 tensors, BF16, four ranks),
the same 2,000 again with tensors in a different order each, and 500 MoE adapters in a temp folder, then times,
in this one run:
  lorafast.scan (full validation + classification, all cores),
  B1 safetensors.torch.load_file + shapes (dense subset only: it reads every tensor),
  B2 safe_open + get_slice().get_shape(), B3 struct + json.loads, B4 orjson,
  and the floor: an open/read/close loop of the header bytes.
Each method computes the max lora_A rank and whether any gate_up_proj lora_A is 3D with shape[0] == 1.
A scan thread reuses the classification of a header whose tensor entries are byte-identical to
one it has seen (same names, shapes, offsets, data size and config; see rust/scan/memo.rs): the "dense"
set has four distinct headers, as a fleet trained from a few recipes does; in "unique" every
adapter is parsed and classified anew.
Prints adapters/s and the ratio to lorafast. Usage: python benches/bench_scan.py [--dense N] [--moe N]
[--sets dense,unique,MoE] [--dir DIR] [--before DIR] [--passes N] (DIR keeps the generated sets for later runs).

`--before DIR` times another build of lorafast in the same run: DIR is a folder that build was installed into
(`make baseline` builds the fixed reference, 255a378, into .cache/baseline-255a378). Each set is scanned by both
builds in turn, each in a fresh process, for --passes passes (default 5; benches/_compare.py): with the report
freed inside the timed call, as the table above times it, and with the report kept until after the clock stops
(the scan alone). Each way prints the median of the passes and the spread (min-max), the ratio to the reference
and to the Python baselines B3, B4 and the floor (timed in this build's process of the same pass), and the load
average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import lorafast
from _compare import CHILD_PRELUDE, add_options, best_of, compare, report
from lorafast.testing import write_safetensors

LLAMA = {"q_proj": (64, 64), "k_proj": (64, 16), "v_proj": (64, 16), "o_proj": (64, 64),
         "gate_proj": (64, 172), "up_proj": (64, 172), "down_proj": (172, 64)}  # fmt: skip


def make_dense(root: str, n: int, unique: bool = False) -> list[str]:
    """`unique`: the tensors of adapter i are written starting from module i % 224, so neighbouring
    adapters never share their tensor entries and none reuses a remembered classification
    (rust/scan/memo.rs): every header is parsed and classified anew. (Run ids in `__metadata__` would not
    do: the memo key leaves out run-specific metadata.)"""
    paths = []
    for i in range(n):
        r = (8, 16, 32, 64)[i % 4]
        d = os.path.join(root, f"dense-{i:05d}")
        os.makedirs(d)
        tensors = {}
        for layer in range(32):
            for m, (fin, fout) in LLAMA.items():
                kind = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                key = f"base_model.model.model.layers.{layer}.{kind}.{m}"
                tensors[f"{key}.lora_A.weight"] = ("BF16", (r, fin))
                tensors[f"{key}.lora_B.weight"] = ("BF16", (fout, r))
        if unique:
            items = list(tensors.items())
            start = 2 * (i % (len(items) // 2))
            tensors = dict(items[start:] + items[:start])
        write_safetensors(os.path.join(d, "adapter_model.safetensors"), tensors)
        cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(LLAMA),
               "base_model_name_or_path": "meta-llama/Llama-2-7b-hf", "task_type": "CAUSAL_LM"}  # fmt: skip
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        paths.append(d)
    return paths


def make_moe(root: str, n: int) -> list[str]:
    paths = []
    for i in range(n):
        r, e, h, inter = 16, 8, 64, 32
        d = os.path.join(root, f"moe-{i:05d}")
        os.makedirs(d)
        tensors = {}
        layout = i % 3
        for layer in range(16):
            p = f"base_model.model.model.layers.{layer}.mlp.experts"
            if layout == 0:  # per-expert 2D
                for x in range(e):
                    for m, (fin, fout) in {
                        "gate_proj": (h, inter),
                        "up_proj": (h, inter),
                        "down_proj": (inter, h),
                    }.items():
                        tensors[f"{p}.{x}.{m}.lora_A.weight"] = ("BF16", (r, fin))
                        tensors[f"{p}.{x}.{m}.lora_B.weight"] = ("BF16", (fout, r))
            else:  # stacked 3D (1) or shared-outer (2)
                outer = 1 if layout == 2 else e
                tensors[f"{p}.gate_up_proj.lora_A.weight"] = ("BF16", (outer, r, h))
                tensors[f"{p}.gate_up_proj.lora_B.weight"] = ("BF16", (e, 2 * inter, r))
                tensors[f"{p}.down_proj.lora_A.weight"] = ("BF16", (e, r, inter))
                tensors[f"{p}.down_proj.lora_B.weight"] = ("BF16", (outer, h, r))
        write_safetensors(os.path.join(d, "adapter_model.safetensors"), tensors)
        cfg = {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": ["gate_proj", "up_proj", "down_proj",
               "gate_up_proj"]}  # fmt: skip
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
        paths.append(d)
    return paths


def _digest(header: dict) -> tuple[int, bool]:
    rank, shared = 0, False
    for name, info in header.items():
        if name == "__metadata__" or ".lora_A." not in name:
            continue
        shape = info["shape"] if isinstance(info, dict) else info
        rank = max(rank, shape[-2] if len(shape) == 3 else shape[0])
        if "gate_up_proj" in name and len(shape) == 3 and shape[0] == 1:
            shared = True
    return rank, shared


def b1_load_file(dirs: list[str]) -> None:
    from safetensors.torch import load_file

    for d in dirs:
        sd = load_file(os.path.join(d, "adapter_model.safetensors"))
        _digest({k: list(v.shape) for k, v in sd.items()})


def b2_safe_open(dirs: list[str]) -> None:
    from safetensors import safe_open

    for d in dirs:
        with safe_open(os.path.join(d, "adapter_model.safetensors"), "pt") as f:
            _digest({k: f.get_slice(k).get_shape() for k in f.keys()})


def _read_header(path: str) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def b3_json(dirs: list[str]) -> None:
    for d in dirs:
        _digest(json.loads(_read_header(os.path.join(d, "adapter_model.safetensors"))))


def b4_orjson(dirs: list[str]) -> None:
    import orjson

    for d in dirs:
        _digest(orjson.loads(_read_header(os.path.join(d, "adapter_model.safetensors"))))


def floor_read(dirs: list[str]) -> None:
    for d in dirs:
        _read_header(os.path.join(d, "adapter_model.safetensors"))


# One build's lorafast.scan of one set in a fresh process, timed both ways (see the docstring's `--before`); the
# `this` child also times the Python baselines on the same set.
BUILD_CODE = (
    CHILD_PRELUDE
    + r"""
root, repeat = ARGS[0], int(ARGS[1])
n = len(os.listdir(root))
claims = {}
for threads in (1, None):
    key = "1 thread" if threads == 1 else "all cores"
    scan = lambda: lorafast.scan([root], threads=threads, progress=False)
    claims[key] = best_of(scan, repeat)
    claims[key + ", report kept"] = best_of(scan, repeat, keep=True)
if ROLE == "this":
    import bench_scan
    dirs = sorted(os.path.join(root, d) for d in os.listdir(root))
    for name, fn in bench_scan.BASELINES.items():
        claims[name] = best_of(lambda: getattr(bench_scan, fn)(dirs), repeat)
child_result(claims)
"""
)

#: The Python baselines each claim of --before is also a ratio to (name -> function of this module).
BASELINES = {"B3 struct + json.loads": "b3_json", "B4 orjson": "b4_orjson", "floor: open/read/close": "floor_read"}
WAYS = ("1 thread", "1 thread, report kept", "all cores", "all cores, report kept")


def time_builds(sroot: str, before: str, passes: int, repeat: int) -> None:
    """Each way of timing for the build in `before` and this one, alternated in fresh processes: the median of
    `passes` passes, the spread, and the ratios to the reference and to the Python baselines."""
    comp = compare(BUILD_CODE, [sroot, repeat], before, passes, label="  ")
    report(comp, WAYS, baselines={w: list(BASELINES) for w in WAYS}, per=len(os.listdir(sroot)))


def make_set(root: str, label: str, args: argparse.Namespace) -> list[str]:
    """The adapters of one set under `root/label`: written there, or the ones a previous run with the
    same counts left (`--dir`)."""
    sroot = os.path.join(root, label)
    n = args.moe if label == "MoE" else args.dense
    if os.path.isdir(sroot) and len(os.listdir(sroot)) == n:
        return sorted(os.path.join(sroot, d) for d in os.listdir(sroot))
    shutil.rmtree(sroot, ignore_errors=True)
    os.makedirs(sroot)
    if label == "MoE":
        return make_moe(sroot, n)
    return make_dense(sroot, n, unique=label == "unique")


def time_set(label: str, dirs: list[str], sroot: str, args: argparse.Namespace) -> list[tuple[str, str, float, float]]:
    """(set, method, adapters/s, lorafast all cores / method) for every method on one set."""
    t_lf = best_of(lambda: lorafast.scan([sroot], progress=False), args.repeat)
    t_lf1 = best_of(lambda: lorafast.scan([sroot], threads=1, progress=False), args.repeat)
    sub = dirs[: args.b1_subset]
    results = {
        "lorafast.scan (all cores)": (t_lf, len(dirs)),
        "lorafast.scan (1 thread)": (t_lf1, len(dirs)),
        "B1 load_file + shapes": (best_of(lambda: b1_load_file(sub), 1), len(sub)),
        "B2 safe_open + get_shape": (best_of(lambda: b2_safe_open(dirs), 2), len(dirs)),
        "B3 struct + json.loads": (best_of(lambda: b3_json(dirs), args.repeat), len(dirs)),
        "B4 orjson": (best_of(lambda: b4_orjson(dirs), args.repeat), len(dirs)),
        "floor: open/read/close": (best_of(lambda: floor_read(dirs), args.repeat), len(dirs)),
    }
    lf_rate = len(dirs) / t_lf
    return [(label, name, n / secs, lf_rate / (n / secs)) for name, (secs, n) in results.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dense", type=int, default=2000)
    ap.add_argument("--moe", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--b1-subset", type=int, default=200, help="B1 reads all data; time it on this many")
    ap.add_argument("--sets", default="dense,unique,MoE", help="the sets to time, comma-separated")
    ap.add_argument("--dir", help="write the sets here and reuse them in later runs (default: a temporary folder)")
    add_options(ap)
    args = ap.parse_args()
    labels = [s for s in ("dense", "unique", "MoE") if s in args.sets.split(",")]
    with tempfile.TemporaryDirectory(prefix="lorafast-bench-") as tmp:
        root = args.dir or tmp
        t = time.perf_counter()
        sets = {label: make_set(root, label, args) for label in labels}
        counts = ", ".join(f"{len(dirs)} {label}" for label, dirs in sets.items())
        print(f"sets ready ({counts}) in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        os.sync()  # write the new files back now, not while the methods are being timed

        for label, dirs in sets.items():
            report = lorafast.scan([os.path.join(root, label)])
            assert len(report) == len(dirs) and not report.errors, report.errors[:3]
            cols = report.columns()
            if label != "MoE":  # MoE adapters carry problems (status 1) on purpose
                assert int(cols["rank"].max()) == 64 and int((cols["status"] != 0).sum()) == 0

        rows = []
        for label, dirs in sets.items():
            rows += time_set(label, dirs, os.path.join(root, label), args)
        print(f"\n{'set':<6} {'method':<28} {'adapters/s':>12} {'lorafast is x faster':>22}")
        for label, name, rate, ratio in rows:
            print(f"{label:<6} {name:<28} {rate:>12,.0f} {ratio:>22.1f}")
        if args.before:
            for label in sets:
                print(f"\n{label}: lorafast.scan, the build in {args.before} (before) and this one, alternated")
                time_builds(os.path.join(root, label), args.before, args.passes, args.repeat)
        if "dense" not in sets:
            print(f"\ncores: {os.cpu_count()}")
            return 0
        # Memory: a 10,000-adapter scan (the dense set five times over) in a fresh process.
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec from this (large) parent.
        code = (
            "import sys, lorafast\n"
            "r = lorafast.scan([sys.argv[1]] * 5, progress=False)\n"
            "cols = r.columns(); s = r.summary()\n"
            "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
            "print(len(r), int(hwm.split()[1]) / 1024)\n"
        )
        dense_root = os.path.join(root, "dense")
        out = subprocess.run([sys.executable, "-c", code, dense_root], capture_output=True, text=True, check=True)
        n, rss = out.stdout.split()
        print(f"\npeak RSS of a fresh process scanning {n} adapters: {float(rss):.0f} MB; cores: {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
