"""Distributed scan on Ray: discover once, scan shards in Ray tasks, merge into one `ScanReport`.

`lorafast.scan(paths, backend="ray")` lands here. The driver finds the adapters (listing a bucket
or walking folders), splits them into contiguous shards, and each Ray task runs the normal Rust
scan on its shard. A task sends back numpy columns, the per-row summary records, the errors and
the target-module table through Ray's object store; the driver concatenates them in shard order,
so the report equals what a local scan of the same inputs gives, failed rows included.

Ray is an optional extra (`pip install 'lorafast[ray]'`), imported only when this backend is used.
Without `address`, an already initialised Ray is used, else `ray.init()` connects to `RAY_ADDRESS`
or starts a local cluster.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lorafast import _core
from lorafast.scanning._common import storage_items
from lorafast.scanning.results import ScanReport

if TYPE_CHECKING:
    import numpy as np

#: Adapters per shard aimed at; fewer, larger shards when the cluster is small.
SHARD_TARGET = 500
#: Shards per CPU of the cluster at most (a few per worker keep them all busy to the end).
SHARDS_PER_CPU = 4

#: One discovered adapter: (path, weights, config, error code, error message).
Item = tuple[str, "str | None", "str | None", "str | None", "str | None"]


def _scan_shard(
    items: list[Item],
    mode: str,
    content_hash: bool,
    storage_options: list[tuple[str, str]] | None,
    timeout: float | None,
    concurrency: int | None,
    threads: int | None,
) -> dict[str, Any]:
    """Scans one shard with the Rust core and returns it as plain data (runs in a Ray task)."""
    result = _core.scan_targets(items, threads, mode, content_hash, False, storage_options, timeout, concurrency)
    return {
        "paths": result.paths(),
        "errors": result.errors(),
        "columns": result.columns(),
        "records": [result.record(i) for i in range(len(result))],
        "adapters": result.adapters(0, len(result)),
        "target_modules": result.target_modules(),
        "table": result.table(),
        "module_table": result.module_table(),
    }


def _concat_column(parts: list[Any], row_offsets: list[int] | None = None) -> Any:
    """Concatenates one column of `_core.ScanResult.table()`/`module_table()` from several shards: arrays,
    lists, `(values, valid)` pairs, or `(codes, names)` pairs (codes remapped to one dictionary)."""
    import numpy as np

    first = parts[0]
    if isinstance(first, list):
        return [v for p in parts for v in p]
    if not isinstance(first, tuple):
        if row_offsets is not None:
            return np.concatenate([p + off for p, off in zip(parts, row_offsets, strict=True)]).astype(first.dtype)
        return np.concatenate(parts)
    if isinstance(first[1], list):
        index: dict[str, int] = {}
        codes = []
        for p_codes, names in parts:
            remap = np.array([index.setdefault(n, len(index)) for n in names] + [-1], dtype=np.int32)
            codes.append(remap[p_codes])  # code -1 picks the trailing -1
        return (np.concatenate(codes).astype(np.int32), list(index))
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


class MergedResult:
    """The interface of `_core.ScanResult` over the concatenated results of several shards."""

    def __init__(self, parts: Sequence[Mapping[str, Any]]) -> None:
        import numpy as np

        self._paths: list[str] = []
        self._errors: list[tuple[int, str, str, str]] = []
        self._records: list[dict[str, Any] | None] = []
        self._adapters: list[dict[str, Any]] = []
        self._row_of_adapter: list[int] = []
        self._names: list[str] = []
        self._rows: list[list[int]] = []
        index: dict[str, int] = {}
        for part in parts:
            offset = len(self._paths)
            self._paths.extend(part["paths"])
            self._errors.extend((row + offset, path, code, msg) for row, path, code, msg in part["errors"])
            self._records.extend(part["records"])
            self._adapters.extend(part["adapters"])
            self._row_of_adapter.extend(i + offset for i, r in enumerate(part["records"]) if r is not None)
            names, rows = part["target_modules"]
            remap = [index.setdefault(name, len(index)) for name in names]
            self._rows.extend([remap[i] for i in row] for row in rows)
        self._names = list(index)
        keys = list(parts[0]["columns"]) if parts else []
        self._columns: dict[str, np.ndarray] = {k: np.concatenate([p["columns"][k] for p in parts]) for k in keys}
        self._table = {k: _concat_column([p["table"][k] for p in parts]) for k in (parts[0]["table"] if parts else [])}
        offsets = list(np.cumsum([0] + [len(p["paths"]) for p in parts[:-1]]))
        self._module_table = {
            k: _concat_column([p["module_table"][k] for p in parts], offsets if k == "row" else None)
            for k in (parts[0]["module_table"] if parts else [])
        }
        if "path_index" in self._columns:
            self._columns["path_index"] = np.arange(len(self._paths), dtype=self._columns["path_index"].dtype)

    def __len__(self) -> int:
        return len(self._paths)

    def paths(self) -> list[str]:
        return list(self._paths)

    def errors(self) -> list[tuple[int, str, str, str]]:
        return list(self._errors)

    def columns(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._columns.items()}

    def record(self, i: int) -> dict[str, Any] | None:
        rec = self._records[i]  # IndexError past the end, as the Rust result
        return None if rec is None else dict(rec)

    def target_modules(self, per_row: bool = True) -> tuple[list[str], list[list[int]]]:
        return list(self._names), [list(r) for r in self._rows] if per_row else []

    def _successful(self, start: int, stop: int) -> list[int]:
        import bisect

        lo = bisect.bisect_left(self._row_of_adapter, start)
        hi = bisect.bisect_left(self._row_of_adapter, stop)
        return list(range(lo, hi))

    def adapters(self, start: int, stop: int) -> list[dict[str, Any]]:
        import copy

        return [copy.deepcopy(self._adapters[i]) for i in self._successful(start, stop)]

    def records(self, start: int, stop: int) -> list[dict[str, Any]]:
        return [dict(self._records[self._row_of_adapter[i]] or {}) for i in self._successful(start, stop)]

    def table(self) -> dict[str, Any]:
        return dict(self._table)

    def module_table(self) -> dict[str, Any]:
        return dict(self._module_table)


def _ray(address: str | None) -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("backend='ray' needs Ray: pip install 'lorafast[ray]'") from e
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"))
    return ray


def _shards(items: list[Item], count: int) -> list[list[Item]]:
    """`count` contiguous, nearly equal slices (order kept, so merging is concatenation)."""
    size = math.ceil(len(items) / max(count, 1))
    return [items[i : i + size] for i in range(0, len(items), size)] if items else []


def shard_count(n_items: int, cpus: float) -> int:
    """Shards for `n_items` adapters on a cluster with `cpus` CPUs."""
    by_size = math.ceil(n_items / SHARD_TARGET)
    return max(1, min(by_size, int(max(cpus, 1) * SHARDS_PER_CPU)))


def scan(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    recursive: bool = True,
    content_hash: bool = False,
    mode: str = "pread",
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    concurrency: int | None = None,
    address: str | None = None,
    shards: int | None = None,
    cpus_per_task: float = 1,
) -> ScanReport:
    """`lorafast.scan` over a Ray cluster: the same inputs and the same report, work spread over tasks.

    `shards` defaults to about one per 500 adapters, at most 4 per cluster CPU. Each task asks for
    `cpus_per_task` CPUs and scans with that many threads. Paths must be reachable from every
    node: URLs, or folders on a shared file system.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    plist = [os.fsdecode(p) for p in paths]
    store = storage_items(storage_options)
    remote: dict[str, Any] = {"storage_options": storage_options, "timeout": timeout, "concurrency": concurrency}
    items: list[Item] = _core.discover_targets(plist, recursive, None, store, timeout, concurrency)
    ray = _ray(address)
    count = shards or shard_count(len(items), ray.cluster_resources().get("CPU", 1))
    task = ray.remote(num_cpus=cpus_per_task)(_scan_shard)
    threads = max(1, int(cpus_per_task))
    refs = [
        task.remote(shard, mode, content_hash, store, timeout, concurrency, threads) for shard in _shards(items, count)
    ]
    parts = ray.get(refs)
    if not parts:  # nothing found: an empty report with the right column types
        parts = [_scan_shard([], mode, content_hash, store, timeout, concurrency, 1)]
    return ScanReport(MergedResult(parts), remote=remote)


__all__ = ["MergedResult", "scan", "shard_count"]
