"""`read_header`: the validated header of one safetensors file, read without touching tensor data.
`read_torch_header`: the same for a `torch.save` file (`.bin`, `.pt`), read without unpickling it."""

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
    """`tensors` keeps file order. `warnings` are (code, message) pairs for non-fatal findings.

    For a torch file (`format == "torch"`), `data_offsets` are file offsets of each tensor's bytes (its
    extent in its storage record), `header_size` is the size of the pickle (`data.pkl`) and `metadata` is None.
    """

    tensors: Mapping[str, TensorInfo]
    metadata: dict[str, str] | None
    header_size: int
    file_size: int
    warnings: tuple[tuple[str, str], ...] = ()
    format: Literal["safetensors", "torch"] = "safetensors"

    @property
    def data_start(self) -> int:
        """File offset that `data_offsets` count from: 8 + header_size, or 0 for a torch file."""
        return 0 if self.format == "torch" else 8 + self.header_size


def read_header(path: str | os.PathLike[str], *, mode: Literal["pread", "mmap"] = "pread") -> Header:
    """Read and validate the header of `path`.

    Raises `HeaderError` (with `.code`) for a malformed file, `FileNotFoundError`,
    `PermissionError` or `OSError` for I/O failures. `mode="mmap"` maps the file instead of
    reading it; `pread` (the default) cannot be crashed by a file truncated underneath.
    """
    raw = _core.read_header(os.fsdecode(path), mode)
    tensors = {name: TensorInfo(dtype, shape, offsets) for name, dtype, shape, offsets in raw["tensors"]}
    return Header(tensors, raw["metadata"], raw["header_size"], raw["file_size"], tuple(raw["warnings"]))


def read_torch_header(path: str | os.PathLike[str]) -> Header:
    """Read the tensor names, dtypes and shapes of a `torch.save` file without running its pickle.

    Only the opcodes and globals of torch's tensor rebuild are interpreted; anything else is refused
    with `AdapterError` and a code from `TORCH_ERROR_CODES` (`unsafe_pickle`, `invalid_pickle`,
    `invalid_zip`, `legacy_torch_format`, ...). Nothing in the file is ever executed.
    """
    raw = _core.read_torch_header(os.fsdecode(path))
    tensors = {name: TensorInfo(dtype, shape, offsets) for name, dtype, shape, offsets in raw["tensors"]}
    return Header(tensors, None, raw["header_size"], raw["file_size"], tuple(raw["warnings"]), "torch")
