"""A short seeded pass of the Python fuzz harness (tests/fuzz/fuzz_python.py); `make fuzz-python` runs a long one.

The harness runs in a child process (libFuzzer ends the process when it is done), from the seeds (fixtures,
`lorafast sample` output, inputs that once broke the Python surface) and the kept corpus in tests/fuzz-corpus/python/.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HERE = Path(__file__).parent
HARNESS = HERE / "fuzz_python.py"
KEPT = HERE.parent / "fuzz-corpus" / "python"
SECONDS = 30


def test_seeded_fuzz_pass_finds_nothing(tmp_path: Path) -> None:
    seeds = tmp_path / "seeds"
    subprocess.run([sys.executable, str(HARNESS), "--seeds", str(seeds)], check=True, timeout=300)
    n_seeds = len(list(seeds.iterdir()))
    assert n_seeds >= 30
    new = tmp_path / "new"  # libFuzzer writes new inputs into the first folder: keep the committed one as it is
    new.mkdir()
    argv = [sys.executable, str(HARNESS), "-seed=1", f"-max_total_time={SECONDS}", "-timeout=60",
            "-rss_limit_mb=4096", f"-artifact_prefix={tmp_path}/", str(new), str(seeds), str(KEPT)]  # fmt: skip
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=SECONDS + 240,
        env={**os.environ, "LORAFAST_FUZZ_OUT": str(tmp_path)},
    )
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    found = [p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "hang-", "timeout-", "oom-"))]
    assert not found, tail
    runs = re.search(r"Done (\d+) runs", proc.stderr)
    assert runs is not None, tail
    assert int(runs.group(1)) > n_seeds  # every seed ran, then mutations


PROBE = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import fuzz_python as f
import lorafast

h = f.Harness(Path({out!r}))
seed = f.regression_inputs()[2]
h.one(seed)
print("CLEAN")
lorafast.inspect = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
try:
    h.one(seed)
except f.Finding as e:
    print("FINDING", e)
real = f.check_case
f.check_case = lambda *a: b"x" * (300 << 20)  # touched pages: the peak RSS rises by 300 MiB
try:
    h.one(seed)
except f.Finding as e:
    print("FINDING", e)
f.check_case = real
lorafast.inspect = lambda *a, **k: time.sleep(60)
h.one(seed)
print("NOT REACHED")
"""


def test_harness_reports_undocumented_exceptions_and_hangs(tmp_path: Path) -> None:
    # The checks can fail: an inspect that raises RuntimeError is a finding, so is a case that takes 300 MiB,
    # and one that blocks is a hang whose input is saved, ending the process.
    code = PROBE.format(tests=str(HERE), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 70, proc.stderr[-2000:]
    assert "CLEAN" in proc.stdout and "FINDING inspect: undocumented RuntimeError: boom" in proc.stdout
    assert re.search(r"FINDING peak memory rose (29\d|30\d) MiB", proc.stdout)  # over 10x the file + 64 MiB
    assert "NOT REACHED" not in proc.stdout
    (hang,) = tmp_path.glob("hang-*")
    assert "case ran over 5.0 s" in proc.stderr
    assert hang.read_bytes()[:1] == b"\x00"  # the saved input is the case's container (a bare file: flags 0)
