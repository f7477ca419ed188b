"""Comparing scan reports, and rewriting a file so that only its ctime tells (the index tests)."""

from __future__ import annotations

import dataclasses
import os

import lorafast
import numpy as np


def same_report(got: lorafast.ScanReport, want: lorafast.ScanReport) -> None:
    """`got` equals `want` in paths, errors, every column, the JSON text and every adapter."""
    assert got.paths == want.paths
    assert got.errors == want.errors
    gc, wc = got.columns(), want.columns()
    assert gc.keys() == wc.keys()
    for k in wc:
        assert np.array_equal(gc[k], wc[k]), k
    assert got.to_json() == want.to_json()
    assert [dataclasses.astuple(a) for a in got] == [dataclasses.astuple(a) for a in want]


def rewrite_in_place(path: str | os.PathLike[str], old: bytes, new: bytes) -> None:
    """Replace the first `old` by `new` (same length) inside the file, then put its mtime back: size, mtime,
    inode and device are as they were; only the ctime tells."""
    assert len(old) == len(new)
    st = os.stat(path)
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(data.index(old))
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
