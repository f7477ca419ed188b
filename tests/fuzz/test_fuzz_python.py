"""A short seeded pass of the Python fuzz harness (tests/fuzz/fuzz_python.py); `make fuzz-python` runs a long one.

The harness runs in a child process (libFuzzer ends the process when it is done), from the seeds (fixtures,
`lorafast sample` output, inputs that once broke the Python surface) and the kept corpus in tests/fuzz-corpus/python/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.fuzzing import probe, seeded_pass

pytest.importorskip("atheris")


def test_seeded_fuzz_pass_finds_nothing(tmp_path: Path) -> None:
    n_seeds, _, runs = seeded_pass("python", tmp_path, 30)
    assert n_seeds >= 30
    assert runs > n_seeds  # every seed ran, then mutations


#: After `f = fuzz_python` and `h = f.Harness(tmp_path)` (helpers.fuzzing.probe).
PROBE = """
import time
import lorafast

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
    proc = probe("python", PROBE, tmp_path, timeout=120)
    assert proc.returncode == 70, proc.stderr[-2000:]
    assert "CLEAN" in proc.stdout and "FINDING inspect: undocumented RuntimeError: boom" in proc.stdout
    assert re.search(r"FINDING peak memory rose (29\d|30\d) MiB", proc.stdout)  # over 10x the file + 64 MiB
    assert "NOT REACHED" not in proc.stdout
    (hang,) = tmp_path.glob("hang-*")
    assert "case ran over 5.0 s" in proc.stderr
    assert hang.read_bytes()[:1] == b"\x00"  # the saved input is the case's container (a bare file: flags 0)
