"""Writing a converted adapter: one safetensors file streamed tensor by tensor, inside a folder that is renamed
into place only when everything succeeded.

The header is known before any data is read (names, dtypes and shapes come from the plan), so it is written
first and each tensor follows as its producer yields it: a zero-copy view of the source map is written straight
from the map; a tensor that needs a permutation is made contiguous first, so peak memory is one tensor.
The source sha256 is computed while the data is written and patched into a fixed-width placeholder at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorafast.converting.errors import ConvertError
from lorafast.tensors import _ST_DTYPES, TensorFile

if TYPE_CHECKING:
    import torch

#: placeholder written in the header and replaced by the source's sha256 once it is known
SHA_PLACEHOLDER = "0" * 64


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the output: its header entry and a producer of its bytes, in row-major order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], Iterable[torch.Tensor]]
    #: (file, tensor name) when the bytes are one source tensor unchanged: copied file to file by the kernel
    verbatim: tuple[TensorFile, str] | None = None

    @property
    def nbytes(self) -> int:
        n = _ST_DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


def header_bytes(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for t in tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _chunks(t: OutTensor) -> Iterator[memoryview]:
    import torch

    for part in t.produce():
        if not part.is_contiguous():
            part = part.contiguous()  # a permuted view: one tensor's worth of memory, freed after the write
        if part.numel():
            yield part.reshape(-1).view(torch.uint8).numpy().data


def write_file(path: str, tensors: list[OutTensor], metadata: dict[str, str], sha: Callable[[], str]) -> int:
    """Write `path` (a new file inside the temporary folder); `sha()` gives the source hash after the data."""
    head = header_bytes(tensors, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(head)) + head))
        total = 0
        for t in tensors:
            written = 0
            if t.verbatim is not None:
                t.verbatim[0].copy_range_to(t.verbatim[1], fd)  # copy_file_range: no trip through user space
                total += t.nbytes
                continue
            for mv in _chunks(t):
                _write_all(fd, mv)
                written += len(mv)
            if written != t.nbytes:  # a producer bug would otherwise leave a file whose header lies
                raise ConvertError(
                    f"internal: tensor {t.name!r} produced {written} bytes, not {t.nbytes}", "bad_source"
                )
            total += written
        at = head.find(SHA_PLACEHOLDER.encode())
        if at >= 0:
            os.pwrite(fd, sha().encode(), 8 + at)
        os.fsync(fd)
        return total
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


class OutputFolder:
    """A temporary folder next to `out`, renamed to `out` by `commit()`; removed if never committed."""

    def __init__(self, out: str, overwrite: bool) -> None:
        self.out = os.path.abspath(out)
        if os.path.lexists(self.out) and not overwrite:
            raise ConvertError(f"{out} exists; pass overwrite=True (--overwrite) to replace it", "exists", out)
        parent = os.path.dirname(self.out)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=".lorafast-convert-", dir=parent)
        self.overwrite = overwrite

    def join(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def commit(self) -> None:
        old = None
        if os.path.lexists(self.out):
            if not self.overwrite:  # created meanwhile by someone else
                raise ConvertError(f"{self.out} exists; pass overwrite=True to replace it", "exists", self.out)
            old = tempfile.mkdtemp(prefix=".lorafast-old-", dir=os.path.dirname(self.out))
            os.rename(self.out, os.path.join(old, "x"))
        os.rename(self.tmp, self.out)
        self.tmp = ""
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = ""
