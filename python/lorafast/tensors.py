"""Reading tensor data out of safetensors files, zero-copy where it can be.

Everything else in lorafast reads headers only; this module is where tensor bytes are touched, for merging.

- `TensorFile.view(name)` is a read-only torch tensor over the memory-mapped file (`torch.frombuffer`), with no
  copy. The map comes from `lorafast._core.map_file`.
- `TensorFile.load(name, device=..., dtype=...)` copies a tensor out of the map straight away (on CUDA through
  pinned memory with `non_blocking=True`). Adapter factors are small, so they are copied out promptly and the map
  is touched for as short a time as possible.
- `TensorFile.read_into(name, out, start)` reads with `os.preadv`, never through the map: used for the large base
  weights of a streaming merge, where a truncated file must give an error and not a signal.

SIGBUS: touching a page of a mapping whose file has been truncated under it raises SIGBUS, which kills the
process. Two guards: every tensor's end offset is checked against `os.fstat` of the open file just before the
map is touched (`TruncatedFileError` instead of a signal), and data is copied out at once, so the window between
the check and the last touch is a few microseconds per tensor. A truncation inside that window cannot be caught
from Python; docs/merge.md says so, and the tests show that it then ends the process with a reported signal.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorafast import _core
from lorafast.errors import LorafastError
from lorafast.formats.safetensors import DTYPES, itemsize

if TYPE_CHECKING:
    import torch

    from lorafast._core import MappedFile


class TensorReadError(LorafastError, OSError):
    """A tensor's bytes could not be read: an unsupported dtype, or a file that changed under us. A bad header is
    the core's `HeaderError`, the same as in a scan."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class TruncatedFileError(TensorReadError):
    """The file is shorter than its header says: it was truncated, possibly after it was opened or mapped."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its header describes it; `begin`/`end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name; `TensorReadError` when torch has none."""
    import torch

    entry = DTYPES.get(st_dtype)
    dt = getattr(torch, entry.torch, None) if entry is not None and entry.torch else None
    if dt is None:
        raise TensorReadError(f"unsupported tensor dtype {st_dtype!r}")
    return dt


def read_entries(path: str, fd: int) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """The header of the file open as `fd`, validated by the core (`_core.read_header`, the validator of every
    scan): (tensors, metadata, data_start). A bad header raises `HeaderError`; a path that names another file
    than `fd` by now, `TensorReadError`."""
    raw = _core.read_header(path)
    opened, now = os.fstat(fd), os.stat(path)
    if (opened.st_ino, opened.st_dev) != (now.st_ino, now.st_dev):
        raise TensorReadError(f"{path}: file was replaced while it was being opened", path)
    data_start = 8 + raw["header_size"]
    size = opened.st_size
    tensors: dict[str, TensorEntry] = {}
    for name, dtype, shape, (begin, end) in raw["tensors"]:
        if data_start + end > size:
            raise TruncatedFileError(
                f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes", path
            )
        tensors[name] = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
    return tensors, dict(raw["metadata"] or {}), data_start


def _map(path: str, fd: int) -> tuple[MappedFile, memoryview]:
    """A read-only view of the whole file, through the compiled core's map (`lorafast._core.map_file`).
    Returns (owner, memoryview); the owner keeps the map alive."""
    ino = os.fstat(fd).st_ino
    try:
        mapped = _core.map_file(path)
    except LorafastError as exc:
        raise TensorReadError(f"{path}: {exc}", path) from exc
    if os.stat(path).st_ino != ino:  # the path now names another file than the one we opened
        raise TensorReadError(f"{path}: file was replaced while it was being opened", path)
    arr = mapped.array()
    arr.flags.writeable = False  # a private read-only map: writing through it must be impossible
    return mapped, arr.data


class TensorFile:
    """An open safetensors file: header parsed, data memory-mapped lazily. Use as a context manager."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.tensors, self.metadata, self.data_start = read_entries(self.path, self._fd)
        except BaseException:
            os.close(self._fd)
            raise
        self._map: MappedFile | None = None
        self._mv: memoryview | None = None

    # -- lifetime -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the map and the file descriptor. Views handed out keep the map alive until they are freed."""
        self._mv = None
        self._map = None  # unmapped once no view handed out holds it
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def fileno(self) -> int:
        """The open file's descriptor, for kernel-side copies (`os.sendfile`); valid until `close()`."""
        if self._fd < 0:
            raise ValueError(f"{self.path}: TensorFile is closed")
        return self._fd

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise TensorReadError(f"{self.path}: no tensor named {name!r}", self.path) from None

    # -- guards -------------------------------------------------------------------------------------------------
    def check_size(self, end: int) -> None:
        """Raise `TruncatedFileError` unless the open file still reaches byte `end` (the SIGBUS guard)."""
        if self._fd < 0:
            raise TensorReadError(f"{self.path}: file is closed", self.path)
        size = os.fstat(self._fd).st_size
        if size < end:
            raise TruncatedFileError(
                f"{self.path}: file was truncated to {size} bytes while open; its header needs {end}", self.path
            )

    def _buffer(self) -> memoryview:
        if self._mv is None:
            self._map, self._mv = _map(self.path, self._fd)
            if len(self._mv) < max((e.end for e in self.tensors.values()), default=0):
                raise TruncatedFileError(f"{self.path}: the mapped file is shorter than its header says", self.path)
        return self._mv

    # -- reading ------------------------------------------------------------------------------------------------
    def view(self, name: str) -> torch.Tensor:
        """The tensor as a read-only, zero-copy view of the map. Copy it before the file can change."""
        import torch

        e = self.entry(name)
        dtype = torch_dtype(e.dtype)
        if e.numel == 0:
            return torch.empty(e.shape, dtype=dtype)
        self.check_size(e.end)
        buf = self._buffer()
        with warnings.catch_warnings():
            # the map is read-only on purpose; torch warns that writing through the tensor would be undefined
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(buf, dtype=dtype, count=e.numel, offset=e.begin)
        return flat.view(e.shape)

    def load(
        self, name: str, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A private copy of the tensor on `device` (default CPU), converted to `dtype` when given."""
        import torch

        dev = torch.device(device) if device is not None else torch.device("cpu")
        src = self.view(name)
        if dev.type == "cpu":
            out = src.to(dtype) if dtype is not None and dtype != src.dtype else src.clone()
            return out
        # Off the CPU: stage through pinned memory so the host->device copy is a real async DMA; torch's caching
        # host allocator keeps the pinned block alive until the copy has run, so it can be dropped here.
        pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        pinned.copy_(src)
        del src
        out = pinned.to(dev, non_blocking=True)
        return out.to(dtype) if dtype is not None and dtype != out.dtype else out

    def load_scalar(self, name: str) -> float:
        """The value of a one-element tensor (kohya `.alpha`)."""
        t = self.view(name)
        if t.numel() != 1:
            raise TensorReadError(f"{self.path}: tensor {name!r} should hold one value, it has {t.numel()}", self.path)
        return float(t.reshape(()).item())

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Fill the contiguous CPU tensor `out` with elements `start ..` of tensor `name`, with `preadv`.

        No map is touched, so a file truncated meanwhile gives `TruncatedFileError`, never SIGBUS.
        """
        e = self.entry(name)
        width = itemsize(e.dtype)
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("read_into needs a contiguous CPU tensor")
        nbytes = out.numel() * out.element_size()
        begin = e.begin + start * width
        if begin + nbytes > e.end:
            raise ValueError(f"read past the end of tensor {name!r}")
        if nbytes == 0:
            return
        import torch

        dst = out.view(-1).view(torch.uint8).numpy().data
        done = 0
        while done < nbytes:
            n = os.preadv(self._fd, [dst[done:]], begin + done)
            if n <= 0:
                raise TruncatedFileError(
                    f"{self.path}: file ended at byte {begin + done} while reading tensor {name!r}", self.path
                )
            done += n

    def copy_range_to(self, name: str, out_fd: int) -> None:
        """Append the raw bytes of tensor `name` to `out_fd` (kernel-side copy where the OS offers one)."""
        e = self.entry(name)
        self.check_size(e.end)
        pos, remaining = e.begin, e.end - e.begin
        while remaining:
            try:
                n = os.copy_file_range(self._fd, out_fd, remaining, pos)
            except (AttributeError, OSError):
                n = _copy_with_pread(self._fd, out_fd, remaining, pos)
            if n <= 0:
                raise TruncatedFileError(f"{self.path}: file ended while copying tensor {name!r}", self.path)
            pos += n
            remaining -= n


def _copy_with_pread(src: int, dst: int, count: int, pos: int) -> int:
    data = os.pread(src, min(count, 8 << 20), pos)
    view = memoryview(data)
    while view:
        written = os.write(dst, view)
        view = view[written:]
    return len(data)
