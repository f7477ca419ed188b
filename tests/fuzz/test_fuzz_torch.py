"""A short seeded pass of the torch reader's differential fuzz harness (tests/fuzz/fuzz_torch.py, against
`torch.load(weights_only=True)`); `make fuzz-torch` runs a long one.

The harness runs in a child process (libFuzzer ends the process when it is done), from its seeds (torch.save output
and hand-written pickles of the reader's past defects: storages declared twice, a tensor listed under many keys) and
the kept corpus in tests/fuzz-corpus/torch/.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fuzzing import seeded_pass

pytest.importorskip("atheris")
pytest.importorskip("torch")

HERE = Path(__file__).parent
HARNESS = HERE / "fuzz_torch.py"
KEPT = HERE.parent / "fuzz-corpus" / "torch"
SECONDS = 20


def test_seeded_torch_fuzz_pass_finds_nothing(tmp_path: Path) -> None:
    n_seeds, runs = seeded_pass(HARNESS, KEPT, tmp_path, SECONDS)
    assert n_seeds >= 10
    assert runs > n_seeds + len(list(KEPT.iterdir()))  # every input ran, then mutations


PROBE = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import fuzz_torch as f
from lorafast import _core

h = f.Harness(Path({out!r}))
seed = f.seed_inputs()[0]
h.one(seed)
print("CLEAN")
real = _core.read_torch_header
def wrong(path):
    header = real(path)
    header["tensors"][0] = ("renamed",) + tuple(header["tensors"][0][1:])
    return header
_core.read_torch_header = wrong
try:
    h.one(seed)
except f.Finding as e:
    print("FINDING", e)
_core.read_torch_header = real
f.torch_load = lambda path: RuntimeError("cannot load")
try:
    h.one(seed)
except f.Finding as e:
    print("FINDING", e)
"""


def test_harness_reports_disagreements_with_torch(tmp_path: Path) -> None:
    # The checks can fail: lorafast naming a tensor otherwise than torch is a finding, and so is lorafast
    # accepting a file torch cannot load; each finding's input is saved.
    code = PROBE.format(tests=str(HERE), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CLEAN" in proc.stdout
    assert "FINDING tensors differ: lorafast [('renamed'" in proc.stdout
    assert "FINDING lorafast accepts a file torch.load refuses: RuntimeError: cannot load" in proc.stdout
    assert len(list(tmp_path.glob("finding-*"))) == 1  # the same input both times
