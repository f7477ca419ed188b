"""Distributed scan overhead: lorafast.scan(backend="ray") on a 2-worker local Ray cluster vs the local scan.

Writes 20,000 sample adapters (every kind, mostly dense PEFT), starts Ray on 127.0.0.1 with
2 CPUs, then times, in this one run and on the same inputs: the local scan (all cores), and the
Ray scan (discovery on the driver, shards scanned by Ray tasks, columns and records merged back).
Checks that both reports are equal and prints adapters/s and the Ray overhead.
Usage: python benches/bench_ray.py [-n 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # listen on 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import lorafast
from lorafast.sample import write_samples
from lorafast.scanning import distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import ray

    print(f"lorafast {lorafast.__version__}, core build: {lorafast._core.build_profile}, cpus: {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        write_samples(tmp, args.n)
        print(f"wrote {args.n} adapters in {time.perf_counter() - t:.1f}s")
        t = time.perf_counter()
        ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
        print(f"ray.init (2 CPUs, 127.0.0.1): {time.perf_counter() - t:.1f}s (not counted below)")
        try:
            distributed.scan(os.path.join(tmp, "00000-peft_dense"))  # warm the workers up
            timings: dict[str, float] = {}
            reports = {}
            for name, fn in (
                ("local scan", lambda: lorafast.scan(tmp, progress=False)),
                ("ray scan, 2 workers", lambda: lorafast.scan(tmp, backend="ray")),
            ):
                best = float("inf")
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    reports[name] = fn()
                    best = min(best, time.perf_counter() - t0)
                timings[name] = best
        finally:
            ray.shutdown()
    local, remote = reports["local scan"], reports["ray scan, 2 workers"]
    same = (
        local.paths == remote.paths
        and local.errors == remote.errors
        and all((local.columns()[k] == remote.columns()[k]).all() for k in local.columns())
        and local.to_json() == remote.to_json()
    )
    print(f"reports identical: {same}\n")
    print(f"{'method':24} {'adapters/s':>11} {'seconds':>8}")
    for name, secs in timings.items():
        print(f"{name:24} {args.n / secs:11.0f} {secs:8.2f}")
    overhead = timings["ray scan, 2 workers"] - timings["local scan"]
    print(
        f"\nray overhead: {overhead:+.2f}s ({timings['ray scan, 2 workers'] / timings['local scan']:.2f}x the local scan)"
    )
    if not same:
        raise SystemExit("the Ray report differs from the local one")


if __name__ == "__main__":
    main()
