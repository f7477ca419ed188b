"""Writing a converted adapter: one safetensors file streamed tensor by tensor, inside a folder that is renamed
into place only when everything succeeded.

The header is known before any data is read (names, dtypes and shapes come from the plan), so it is written
first and each tensor follows as its producer yields its parts:
- `SourceBytes`, a byte range of the source that passes through unchanged, is sent file to file by the kernel
  (`sendfile`): no page faults on a map, no copy through user space;
- an in-memory tensor is written with `writev`, consecutive parts batched into one call; a part repeated (one
  shared factor written once per expert) is one buffer listed E times, so the repeat costs no copy at all;
- a permuted view is made contiguous first, so peak memory is about one tensor.
Writeback to disk is started after each tensor (`sync_file_range`, Linux), so the final `fsync` waits for
little. The source sha256 is computed meanwhile and patched into a fixed-width placeholder at the end.
In-memory parts are numpy arrays of the tensor's bits (`bits`): no torch here.

The output's modes follow the umask, as `cp` makes them: the folder is created 0777 and the files 0666, both
less the umask, so a server running as another user reads them when the umask lets it.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from lorafast.converting.errors import ConvertError
from lorafast.formats.safetensors import encode_header, nbytes
from lorafast.tensors import TensorFile, TensorReadError, TruncatedFileError

#: placeholder written in the header and replaced by the source's sha256 once it is known
SHA_PLACEHOLDER = "0" * 64
#: iovecs per writev call (IOV_MAX on Linux and macOS)
_IOV_MAX = 1024
#: start writeback once this much data is dirty
_WRITEBACK_EVERY = 32 << 20


@contextmanager
def writing(path: str) -> Iterator[None]:
    """OS errors of writing `path` (a read-only folder, a full disk, a file-size limit) as a `ConvertError` that
    names it. Only output calls run inside, so a source's read errors are never blamed on the output."""
    try:
        yield
    except TensorReadError:
        raise
    except OSError as exc:
        raise ConvertError(f"cannot write {path}: {exc.strerror or exc}", "write_error", path) from exc


@dataclass(frozen=True)
class SourceBytes:
    """`length` bytes of source tensor `name` from byte `start`, unchanged (`length` None: to its end)."""

    tf: TensorFile
    name: str
    start: int = 0
    length: int | None = None


Part = np.ndarray | SourceBytes


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the output: its header entry and a producer of its bytes, in row-major order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], Iterable[Part]]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def _start_writeback() -> Callable[[int, int, int], Any] | None:
    """libc's sync_file_range (Linux), which starts writeback of a range without waiting for it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, pos, n: fn(fd, pos, n, 2)  # SYNC_FILE_RANGE_WRITE


_WRITEBACK = _start_writeback()


class _Sink:
    """The output file's descriptor and what is queued for the next `writev`."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.pos = 0  # bytes written so far
        self.flushed = 0  # writeback started up to here
        self.iov: list[memoryview] = []
        self.queued = 0

    def add(self, mv: memoryview) -> None:
        self.iov.append(mv)
        self.queued += len(mv)
        if len(self.iov) == _IOV_MAX:
            self.flush()

    def flush(self) -> None:
        iov, left = self.iov, self.queued
        self.iov, self.queued = [], 0
        while left:
            with writing(self.path):
                n = os.writev(self.fd, iov)
            self.pos += n
            left -= n
            if left:  # a short write: drop what went out, keep the rest
                while n >= len(iov[0]):
                    n -= len(iov[0])
                    iov = iov[1:]
                iov = [iov[0][n:], *iov[1:]]

    def send(self, part: SourceBytes) -> int:
        self.flush()
        tf = part.tf
        e = tf.entry(part.name)
        begin = e.begin + part.start
        count = (e.end - begin) if part.length is None else part.length
        if begin + count > e.end:
            raise ConvertError(f"internal: {part.name!r} has no bytes {part.start}..{part.start + count}", "bad_source")
        tf.check_size(begin + count)
        src = tf.fileno()
        done = 0
        while done < count:
            try:
                n = os.sendfile(self.fd, src, begin + done, count - done)
                self.pos += n
            except OSError:  # no sendfile between these files (or it failed): through user space, which tells
                try:  # a read error from a write error
                    data = os.pread(src, min(count - done, 8 << 20), begin + done)
                except OSError as exc:
                    raise TensorReadError(f"{tf.path}: {exc.strerror or exc}", tf.path) from exc
                n = len(data)
                self.add(memoryview(data))
                self.flush()
            if n <= 0:
                raise TruncatedFileError(f"{tf.path}: file ended while copying tensor {part.name!r}", tf.path)
            done += n
        return count

    def writeback(self) -> None:
        if _WRITEBACK is not None and self.pos - self.flushed >= _WRITEBACK_EVERY:
            _WRITEBACK(self.fd, self.flushed, self.pos - self.flushed)
            self.flushed = self.pos


def _prepared(t: OutTensor) -> list[Part]:
    """The tensor's parts, made contiguous in the calling thread, for the writer thread. A part the producer
    repeats (one shared factor written once per expert) stays one object, listed again."""
    parts: list[Part] = []
    last: object = None
    ready: Part | None = None
    for part in t.produce():
        if isinstance(part, SourceBytes):
            parts.append(part)
            continue
        if part is not last:
            last = part
            ready = np.ascontiguousarray(part)  # a permuted view: one tensor's memory
        assert ready is not None
        parts.append(ready)
    return parts


def _write_parts(sink: _Sink, t: OutTensor, parts: list[Part]) -> int:
    written = 0
    last: object = None
    last_mv = memoryview(b"")
    for part in parts:
        if isinstance(part, SourceBytes):
            written += sink.send(part)
            continue
        if part is not last:  # the same part again: the same buffer, listed again in the writev, no copy
            last = part
            last_mv = part.reshape(-1).view(np.uint8).data if part.size else memoryview(b"")
        if len(last_mv):
            sink.add(last_mv)
            written += len(last_mv)
    sink.flush()
    if written != t.nbytes:  # a producer bug would otherwise leave a file whose header lies
        raise ConvertError(f"internal: tensor {t.name!r} produced {written} bytes, not {t.nbytes}", "bad_source")
    sink.writeback()
    return written


def write_file(
    path: str, tensors: list[OutTensor], metadata: dict[str, str], sha: Callable[[], str], shown: str | None = None
) -> int:
    """Write `path` (a new file inside the temporary folder); `sha()` gives the source hash after the data.
    `shown`: the name errors give the file (where it was to end up, not the temporary folder).

    Two stages: this thread produces tensor i+1 (reads, transposes) while a writer thread writes tensor i, so
    the copies into the page cache overlap the computing. A producer may reuse a buffer every other tensor
    (`moe.transposed`): tensor i's write has finished before tensor i+2 is produced."""
    head, _ = encode_header([(t.name, t.dtype, t.shape, t.nbytes) for t in tensors], metadata)
    shown = shown or path
    with writing(shown):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        sink = _Sink(fd, shown)
        sink.add(memoryview(head))
        total = 0
        with ThreadPoolExecutor(1, thread_name_prefix="lorafast-convert-writer") as pool:
            pending: Future[int] | None = None
            try:
                for t in tensors:
                    parts = _prepared(t)
                    if pending is not None:
                        total += pending.result()
                    pending = pool.submit(_write_parts, sink, t, parts)
                if pending is not None:
                    total += pending.result()
            finally:
                if pending is not None:
                    pending.cancel()
                    wait([pending])  # never leave the writer running on a descriptor about to be closed
        at = head.find(SHA_PLACEHOLDER.encode())
        digest = sha().encode() if at >= 0 else b""
        with writing(shown):
            if digest:
                os.pwrite(fd, digest, at)  # `head` starts with the 8-byte length
            os.fsync(fd)
        return total
    finally:
        os.close(fd)


def _exists(out: str) -> ConvertError:
    return ConvertError(
        f"{out} exists; pass overwrite=True to replace it",
        "exists",
        out,
        cli=f"{out} exists; pass --overwrite to replace it",
    )


def _make_folder(parent: str) -> str:
    """A new folder in `parent` with mode 0777 less the umask (`tempfile.mkdtemp` makes it 0700, which another
    user cannot read once it is renamed into place)."""
    while True:
        path = os.path.join(parent, f".lorafast-convert-{secrets.token_hex(6)}")
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue


class OutputFolder:
    """A temporary folder next to `out`, renamed to `out` by `commit()`; removed if never committed."""

    def __init__(self, out: str, overwrite: bool) -> None:
        self.out = os.path.abspath(out)
        if os.path.lexists(self.out) and not overwrite:
            raise _exists(out)
        parent = os.path.dirname(self.out)
        #: the folders above `out` this call makes, removed again when it fails
        self.made: list[str] = []
        up = parent
        while not os.path.lexists(up):
            self.made.append(up)
            up = os.path.dirname(up)
        self.tmp = ""
        self.overwrite = overwrite
        try:
            with writing(self.out):
                os.makedirs(parent, exist_ok=True)
                self.tmp = _make_folder(parent)
        except BaseException:
            self.discard()
            raise

    def join(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def shown(self, name: str) -> str:
        """Where file `name` ends up: the name errors give it."""
        return os.path.join(self.out, name)

    def commit(self) -> None:
        with writing(self.out):
            old = None
            if os.path.lexists(self.out):
                if not self.overwrite:  # created meanwhile by someone else
                    raise _exists(self.out)
                old = tempfile.mkdtemp(prefix=".lorafast-old-", dir=os.path.dirname(self.out))
                try:
                    os.rename(self.out, os.path.join(old, "x"))
                except BaseException:
                    os.rmdir(old)
                    raise
            try:
                os.rename(self.tmp, self.out)
            except BaseException:
                if old is not None:  # the old output goes back where it was
                    os.rename(os.path.join(old, "x"), self.out)
                    os.rmdir(old)
                raise
        self.tmp, self.made = "", []
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = ""
        for folder in self.made:  # deepest first; one that is no longer empty stays
            try:
                os.rmdir(folder)
            except OSError:
                break
        self.made = []
