"""Header reads: pread vs mmap, and `import lorafast` time, measured in this run.

Writes N dense PEFT-sized adapter files (448 tensors, ~57 KB headers) and times `read_header` with
each mode (best of 5, warm page cache), plus the import of lorafast in fresh processes.
Usage: python benches/bench_header.py [--files N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from lorafast import _core
from lorafast.testing import write_safetensors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        paths = []
        for i in range(args.files):
            p = os.path.join(root, f"{i}.safetensors")
            write_safetensors(p, {f"base_model.model.model.layers.{L}.self_attn.m{m}.lora_{ab}.weight": ("BF16", (8, 64))
                                  for L in range(32) for m in range(7) for ab in "AB"})  # fmt: skip
            paths.append(p)
        # scan() is the bulk path (no Python object per tensor); threads=1 isolates the read cost.
        for mode in ("pread", "mmap"):
            _core.scan(paths, True, 1, mode, False, False)
            best = min(_timed(lambda mode=mode: _core.scan(paths, True, 1, mode, False, False)) for _ in range(5))
            print(f"{mode:5s}: {best / len(paths) * 1e6:7.1f} us per file (read + validate + classify, 1 thread), "
                  f"{len(paths) / best:,.0f} files/s")  # fmt: skip
    code = "import time; t = time.perf_counter(); import lorafast; print(time.perf_counter() - t)"
    runs = [float(subprocess.check_output([sys.executable, "-c", code])) for _ in range(7)]
    print(f"import lorafast: median {sorted(runs)[3] * 1000:.1f} ms over 7 fresh processes")
    return 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    raise SystemExit(main())
