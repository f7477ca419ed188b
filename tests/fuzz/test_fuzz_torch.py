"""A short seeded pass of the torch reader's differential fuzz harness (tests/fuzz/fuzz_torch.py, against
`torch.load(weights_only=True)`); `make fuzz-torch` runs a long one.

The harness runs in a child process (libFuzzer ends the process when it is done), from its seeds (torch.save output
and hand-written pickles of the reader's past defects: storages declared twice, a tensor listed under many keys) and
the kept corpus in tests/fuzz-corpus/torch/.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.fuzzing import probe, seeded_pass

pytest.importorskip("atheris")
pytest.importorskip("torch")


def test_seeded_torch_fuzz_pass_finds_nothing(tmp_path: Path) -> None:
    n_seeds, kept, runs = seeded_pass("torch", tmp_path, 20)
    assert n_seeds >= 10
    assert runs > n_seeds + kept  # every input ran, then mutations


#: After `f = fuzz_torch` and `h = f.Harness(tmp_path)` (helpers.fuzzing.probe).
PROBE = """
from lorafast import _core

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
    proc = probe("torch", PROBE, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CLEAN" in proc.stdout
    assert "FINDING tensors differ: lorafast [('renamed'" in proc.stdout
    assert "FINDING lorafast accepts a file torch.load refuses: RuntimeError: cannot load" in proc.stdout
    assert len(list(tmp_path.glob("finding-*"))) == 1  # the same input both times
