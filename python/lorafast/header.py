"""`read_header`: the validated header of one safetensors file, read without touching tensor data."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from . import _core


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


@dataclass(frozen=True)
class Header:
    """`tensors` keeps file order. `warnings` are (code, message) pairs for non-fatal findings."""

    tensors: Mapping[str, TensorInfo]
    metadata: dict[str, str] | None
    header_size: int
    file_size: int
    warnings: tuple[tuple[str, str], ...] = ()

    @property
    def data_start(self) -> int:
        """File offset of the data section (8 + header_size)."""
        return 8 + self.header_size


def read_header(path: str | os.PathLike[str], *, mode: Literal["pread", "mmap"] = "pread") -> Header:
    """Read and validate the header of `path`.

    Raises `HeaderError` (with `.code`) for a malformed file, `FileNotFoundError`,
    `PermissionError` or `OSError` for I/O failures. `mode="mmap"` maps the file instead of
    reading it; `pread` (the default) cannot be crashed by a file truncated underneath.
    """
    raw = _core.read_header(os.fspath(path), mode)
    tensors = {name: TensorInfo(dtype, shape, offsets) for name, dtype, shape, offsets in raw["tensors"]}
    return Header(tensors, raw["metadata"], raw["header_size"], raw["file_size"], tuple(raw["warnings"]))
