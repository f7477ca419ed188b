"""`inspect` (one adapter) and `scan` (many, in parallel) with their typed results."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from lorafast import _core
from lorafast.adapter import Adapter
from lorafast.scanning._common import PROGRESS_THRESHOLD, PathLike, check_threads, storage_items, want_progress
from lorafast.scanning.results import ScanReport, adapter_from_raw


def inspect(
    path: PathLike,
    *,
    content_hash: bool = False,
    mode: Literal["pread", "mmap"] = "pread",
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Adapter:
    """Classify one adapter: a PEFT folder, a folder holding one `.safetensors`, or a `.safetensors` file.

    Reads `adapter_config.json` and the safetensors header (plus kohya's few-byte `.alpha`
    scalars); never the tensor data, unless `content_hash=True` asks for the sha256 of the data
    section. `path` may be a URL (s3://, gs://, az://, http(s)://, hf://; see `scan`).
    Raises `HeaderError`, `AdapterError` or an `OSError` subclass.
    """
    raw = _core.inspect(os.fsdecode(path), mode, content_hash, storage_items(storage_options), timeout)
    return adapter_from_raw(raw)


def inspect_many(
    paths: PathLike | bytes | Sequence[PathLike],
    *,
    content_hash: bool = False,
    threads: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> list[Adapter | Exception]:
    """`inspect` for many paths or URLs in parallel; a failure comes back as its exception, in place.

    A single path (str, bytes or os.PathLike) is one adapter, as in `scan`, not a sequence of characters.
    """
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [os.fsdecode(paths)]
    elif not isinstance(paths, Iterable):
        raise TypeError(f"paths must be a path or a sequence of paths, not {type(paths).__name__}")
    plist = [os.fsdecode(p) for p in paths]
    raw = _core.inspect_many(
        plist, "pread", content_hash, check_threads(threads), storage_items(storage_options), timeout, concurrency
    )
    return [r if isinstance(r, Exception) else adapter_from_raw(r) for r in raw]


def scan(
    paths: PathLike | Iterable[PathLike],
    *,
    recursive: bool = True,
    threads: int | None = None,
    progress: bool | None = None,
    content_hash: bool = False,
    mode: Literal["pread", "mmap"] = "pread",
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    concurrency: int | None = None,
    backend: Literal["local", "ray"] = "local",
    ray_address: str | None = None,
) -> ScanReport:
    """Find and classify every adapter under `paths` in parallel, with the GIL released.

    One bad adapter never stops the scan: it becomes a row with status `STATUS_ERROR` and an
    entry in `.errors`. `threads` defaults to `LORAFAST_NUM_THREADS` or the available cores. A scan uses at
    most 256 threads, whatever is asked, and no more than the paths given when none of them is a folder.
    `progress=None` shows a bar on stderr for long scans when stderr is a terminal. `threads` must be a positive
    int (`TypeError` for a bool or float, `ValueError` for 0 or less).

    Paths may be URLs: `s3://bucket/prefix/`, `gs://`, `az://`, `http(s)://` and
    `hf://org/repo[@revision]/path`. Only headers and configs are fetched, with range requests,
    `concurrency` (default 64) at a time. `storage_options` go to the store (`endpoint`, `region`,
    `allow_http`, ...); credentials come from each store's usual environment. `timeout` (seconds,
    default 10) bounds each request; transient failures are retried with backoff.

    `backend="ray"` splits the adapters into shards scanned by Ray tasks (`lorafast[ray]`,
    see `lorafast.scanning.distributed`); the report is identical to a local scan's.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    plist = [os.fsdecode(p) for p in paths]
    threads = check_threads(threads)
    remote: dict[str, Any] = {"storage_options": storage_options, "timeout": timeout, "concurrency": concurrency}
    if backend == "ray":
        from lorafast.scanning.distributed import scan as ray_scan

        return ray_scan(
            plist,
            recursive=recursive,
            content_hash=content_hash,
            mode=mode,
            address=ray_address,
            storage_options=storage_options,
            timeout=timeout,
            concurrency=concurrency,
        )
    if backend != "local":
        raise ValueError(f"backend must be 'local' or 'ray', not {backend!r}")
    show = want_progress(progress, PROGRESS_THRESHOLD if progress is None and sys.stderr.isatty() else 0)
    result = _core.scan(
        plist, recursive, threads, mode, content_hash, show, storage_items(storage_options), timeout, concurrency
    )
    return ScanReport(result, remote=remote)
