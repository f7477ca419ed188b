"""Differential fuzz of `lorafast.Index.scan` against a fresh `lorafast.scan`.

A random fleet (PEFT folders, loose kohya files) goes through random steps: additions, deletions, renames,
rewrites of a config or a header in place with the same length and the mtime put back, ordinary rewrites,
truncations, and scans of one index by two threads or two processes at once, or by one while the fleet changes.
After every step the fleet is still and the index's report must equal a fresh scan's, row for row.

The suite runs a short pass with a fixed seed; `LORAFAST_FUZZ_CASES=N` runs N inputs (`LORAFAST_FUZZ_SEED` picks
the seed), as in test_convert_fuzz.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import lorafast
import pytest
from helpers.fuzzing import fuzz
from helpers.reports import rewrite_in_place, same_report
from hypothesis import given
from hypothesis import strategies as st
from lorafast.testing import write_attention_adapter, write_safetensors

pytestmark = pytest.mark.fuzz

_NAMES = ["a", "b", "c", "d"]
_OPS = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(_NAMES), st.integers(1, 16)),
    st.tuples(st.just("kohya"), st.sampled_from(_NAMES), st.integers(1, 16)),
    st.tuples(st.just("delete"), st.sampled_from(_NAMES)),
    st.tuples(st.just("rename"), st.sampled_from(_NAMES), st.sampled_from(_NAMES)),
    st.tuples(st.just("config_in_place"), st.sampled_from(_NAMES)),
    st.tuples(st.just("header_in_place"), st.sampled_from(_NAMES)),
    st.tuples(st.just("truncate"), st.sampled_from(_NAMES), st.floats(0, 1)),
    st.tuples(st.just("threads")),
    st.tuples(st.just("scan_while_changing"), st.sampled_from(_NAMES), st.integers(1, 16)),
)


def _weights(root: Path, name: str) -> Path | None:
    for p in (root / name / "adapter_model.safetensors", root / "loose" / f"{name}.safetensors"):
        if p.exists():
            return p
    return None


def _remove(root: Path, name: str) -> None:
    shutil.rmtree(root / name, ignore_errors=True)
    (root / "loose" / f"{name}.safetensors").unlink(missing_ok=True)


def _apply(root: Path, op: tuple[Any, ...], stats: Counter[str]) -> None:
    kind, name = op[0], op[1] if len(op) > 1 else None
    if kind == "add":
        _remove(root, name)
        write_attention_adapter(root / name, r=op[2])
    elif kind == "kohya":
        _remove(root, name)
        os.makedirs(root / "loose", exist_ok=True)
        tensors = {
            "lora_unet_x.lora_down.weight": ("F16", (op[2], 8)),
            "lora_unet_x.lora_up.weight": ("F16", (8, op[2])),
        }
        write_safetensors(str(root / "loose" / f"{name}.safetensors"), tensors)
    elif kind == "delete":
        _remove(root, name)
    elif kind == "rename":
        if (root / name).is_dir() and not (root / op[2]).exists() and not _weights(root, op[2]):
            os.rename(root / name, root / op[2])
    elif kind == "config_in_place":
        cfg = root / name / "adapter_config.json"
        if cfg.exists():
            r = re.search(rb'"r": (\d+)', cfg.read_bytes())
            if r:  # another rank of the same width
                old = r.group(1)
                new = str((int(old) % 9) + 1 if len(old) == 1 else 10 + (int(old) + 1) % 90).encode()
                rewrite_in_place(cfg, b'"r": ' + old, b'"r": ' + new)
    elif kind == "header_in_place":
        w = _weights(root, name)
        hit = re.search(rb"\[(\d),(\d\d?)\]", w.read_bytes()) if w else None
        if w and hit and hit.group(1) != hit.group(2):  # a shape's two sizes swapped: same length, same bytes
            rewrite_in_place(w, hit.group(0), b"[%s,%s]" % (hit.group(2), hit.group(1)))
    elif kind == "truncate":
        w = _weights(root, name)
        if w:
            os.truncate(w, int(os.path.getsize(w) * op[2]))
    else:
        return
    stats[kind] += 1


def _same_as_fresh(report: lorafast.ScanReport, root: Path) -> None:
    same_report(report, lorafast.scan([root]))


_CHILD = """
import sys, lorafast
report = lorafast.Index(sys.argv[1]).scan([sys.argv[2]])
sys.stdout.write(report.to_json())
"""


def _check_step(db: Path, root: Path, op: tuple[Any, ...], stats: Counter[str]) -> None:
    if op[0] == "threads":  # two scanners, one index: each report is a full scan's
        reports: list[Any] = [None, None]

        def run(i: int) -> None:
            with lorafast.Index(db) as index:
                reports[i] = index.scan([root])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in reports:
            _same_as_fresh(r, root)
        stats["threads"] += 1
    elif op[0] == "scan_while_changing":  # its report may be either fleet's; the next scan must be right
        with lorafast.Index(db) as index:
            t = threading.Thread(target=index.scan, args=([root],))
            t.start()
            _apply(root, ("add", op[1], op[2]), stats)
            t.join()
        stats["scan_while_changing"] += 1
    with lorafast.Index(db) as index:
        _same_as_fresh(index.scan([root]), root)
    stats["scans compared"] += 1


def test_index_scan_equals_a_fresh_scan_under_rewrites_and_concurrent_scans() -> None:
    stats: Counter[str] = Counter()

    @fuzz(20)
    @given(st.lists(st.tuples(st.sampled_from(_NAMES), st.integers(1, 16)), min_size=1, max_size=4, unique_by=lambda x: x[0]),
           st.lists(_OPS, min_size=1, max_size=10))  # fmt: skip
    def one(first: list[tuple[str, int]], ops: list[tuple[Any, ...]]) -> None:
        stats["inputs"] += 1
        with tempfile.TemporaryDirectory() as tmp:
            root, db = Path(tmp) / "fleet", Path(tmp) / "i.db"
            for name, r in first:
                write_attention_adapter(root / name, r=r)
            with lorafast.Index(db) as index:
                _same_as_fresh(index.scan([root]), root)
            for op in ops:
                _apply(root, op, stats)
                _check_step(db, root, op, stats)

    one()
    print(f"\nindex fuzz: {dict(stats)}")
    assert stats["scans compared"] > stats["inputs"]


def test_two_processes_scanning_one_index_each_get_a_full_scan() -> None:
    """Rounds of changes, each followed by two processes scanning the same index at once."""
    stats: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        root, db = Path(tmp) / "fleet", Path(tmp) / "i.db"
        for i, name in enumerate(_NAMES):
            write_attention_adapter(root / name, r=i + 1)
        rounds = [[], [("config_in_place", "a"), ("delete", "b")], [("header_in_place", "c"), ("add", "b", 3)],
                  [("truncate", "d", 0.5), ("rename", "a", "d")]]  # fmt: skip
        for ops in rounds:
            for op in ops:
                _apply(root, op, stats)
            children = [
                subprocess.Popen([sys.executable, "-c", _CHILD, str(db), str(root)], stdout=subprocess.PIPE, text=True)
                for _ in range(2)
            ]
            outs = [c.communicate(timeout=300)[0] for c in children]
            assert [c.returncode for c in children] == [0, 0]
            fresh = lorafast.scan([root]).to_json()
            assert [json.loads(o) for o in outs] == [json.loads(fresh)] * 2
            stats["rounds"] += 1
    assert stats["rounds"] == len(rounds)
