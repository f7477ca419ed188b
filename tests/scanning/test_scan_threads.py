"""A huge `threads` gives the same report, on a pool of at most 256 threads (one per file when the paths
are files only), instead of making and ending thousands of OS threads for the call (3,000 took 23-30 s for one
file). The cap itself is tested in rust/scan/pool.rs (`a_pool_has_at_most_max_threads`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lorafast
from lorafast.testing import write_attention_adapter


def rows(report: lorafast.ScanReport) -> list[tuple[str, str, int, tuple[str, ...]]]:
    return [(a.path, a.format, a.rank, tuple(a.target_modules)) for a in report]


def test_huge_thread_counts_give_the_same_report(tmp_path: Path) -> None:
    for i in range(5):
        write_attention_adapter(tmp_path / f"a{i}")
    (one,) = [str(p) for p in (tmp_path / "a0").glob("*.safetensors")]
    want = rows(lorafast.scan([one], threads=1))
    assert len(want) == 1
    assert rows(lorafast.scan([one], threads=3000)) == want
    assert rows(lorafast.scan([one, one], threads=10**6)) == want * 2
    folder = rows(lorafast.scan([tmp_path], threads=1))
    assert len(folder) == 5
    assert rows(lorafast.scan([tmp_path], threads=100_000)) == folder
    assert [a.path for a in lorafast.inspect_many([one] * 3, threads=50_000)] == [one] * 3


def test_a_huge_thread_variable_is_capped_too(tmp_path: Path) -> None:
    write_attention_adapter(tmp_path / "a")
    code = "import sys, lorafast; print(len(lorafast.scan([sys.argv[1]])))"
    env = {**os.environ, "LORAFAST_NUM_THREADS": "100000"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]
