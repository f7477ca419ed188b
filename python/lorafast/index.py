"""`lorafast.Index`: a persistent scan index in SQLite, so a rescan reads only the adapters that changed.

Each adapter row is stored with the signature of its files: `(size, mtime_ns, inode, device, ctime_ns)` of the
weights file and of `adapter_config.json`, the options it was read with and the lorafast build that read it. The
ctime is there because any write sets it and no caller can set it back: a rewrite that keeps the size and puts the
mtime back (`os.utime`, `touch -d`) still changes it. A row stored without one (an index of an older lorafast)
is read again once. A rescan walks the paths once (the same discovery as `scan`), `stat`s each adapter's files,
reads only those whose signature differs or that are new, and drops the rows of adapters that are gone. A renamed
or moved adapter (its files' inode, device, size and mtime under a new path; a rename sets the ctime, so it is
not compared there) keeps its row, unread. The report it returns equals a full `scan` of the same paths:
unchanged rows come back as the scan stored them (`rust/store.rs`).

The database is in WAL mode and each batch of updates is one transaction, so a process killed mid-update
leaves the index as of its last committed batch (every row still matches the signature stored with it), and
readers are never blocked by a writer. Classifications are stored once per distinct content (adapters trained
from one recipe share theirs).

URLs are indexed too. A remote adapter's signature is its objects' ETag (with the size), or their size and
last-modified time where the server sends no ETag, as the discovery's own listing reports them, so a rescan of
an unchanged bucket costs the listing and no other request. Stores that cannot be listed (`http(s)://`,
`hf://`) are asked with one `HEAD` per file instead of a header read. A server that sends neither an ETag
nor a last-modified time gives no signature: its adapters are read on every scan.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from . import _core
from .scanner import PathLike, ScanReport, _check_threads, _storage_items, _want_progress

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS adapters (
    path BLOB PRIMARY KEY,      -- the adapter's path, as the file system's bytes
    signature TEXT NOT NULL,    -- stat of its files and the read options (JSON)
    row BLOB NOT NULL,          -- the scan row (rust/store.rs)
    class TEXT                  -- id of its classification in `classes` (NULL for a failed row)
);
CREATE INDEX IF NOT EXISTS adapters_class ON adapters (class);
CREATE TABLE IF NOT EXISTS classes (id TEXT PRIMARY KEY, body BLOB NOT NULL);
"""


def _is_url(path: str) -> bool:
    return "://" in path


def _build() -> list[Any]:
    """Which lorafast classified a stored row: its version and the core library file's size and mtime. Rows of
    another build are read again, since a new build may classify differently (or encode rows differently)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("lorafast")
    except PackageNotFoundError:
        v = "unknown"
    st = os.stat(_core.__file__) if getattr(_core, "__file__", None) else None
    return [v, _core.build_profile, st.st_size if st else 0, st.st_mtime_ns if st else 0]


def _stat(path: str | None) -> list[int] | None:
    if path is None:
        return None
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns]


def _remote_stat(stat: tuple[int, str | None, int | None] | None) -> list[Any] | None:
    """A remote object's signature: `[size, ETag]`, else `[size, last-modified ns]`; None when the store said
    neither (its size alone cannot tell a rewrite)."""
    if stat is None:
        return None
    size, etag, modified = stat
    if etag:
        return [size, etag]
    if modified is not None:
        return [size, modified]
    return None


def _signature(item: Any, weights_stat: Any, config_stat: Any, options: Mapping[str, Any]) -> str:
    """The signature of a discovered adapter's files, "" when it cannot be had (then it is read)."""
    _, weights, config, _, _ = item
    try:
        if not _is_url(weights):
            return json.dumps([weights, _stat(weights), config, _stat(config), options])
    except OSError:
        return ""  # gone or unreadable since the walk: read it, and the read says why
    w, c = _remote_stat(weights_stat), _remote_stat(config_stat)
    if w is None or (config is not None and c is None):
        return ""
    return json.dumps([weights, w, config, c, options])


class _Unreadable(Exception):
    """A stored row or classification that does not decode."""


class IndexScanReport(ScanReport):
    """A `ScanReport` (equal to a full scan's) that also says what changed since the index last saw the paths:
    `added`, `changed` and `removed` adapter paths, and `reads`, the number of adapters read from disk."""

    added: list[str]
    changed: list[str]
    removed: list[str]
    reads: int


class Index:
    """A persistent scan index at `path` (an SQLite file, created when missing). `scan(paths)` returns the
    report a full `lorafast.scan` would, reading only what changed since the last `scan` of those paths."""

    #: Rows written per transaction.
    batch_size = 1000

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        self._check_schema()  # before anything is written: a newer lorafast's index is left as it is
        self._db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        found = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if found is None:
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif found[0] != str(SCHEMA_VERSION):  # written by another lorafast since the check
            self._db.close()
            raise ValueError(f"{self.path}: index schema {found[0]}, this lorafast writes {SCHEMA_VERSION}")
        #: Test hook: called inside each batch's transaction, after its writes and before its commit.
        self._on_batch: Callable[[int], None] | None = None

    def _check_schema(self) -> None:
        """Refuse an existing index of another schema, reading it only: no WAL switch, no tables, no file made. An
        index with no `-wal` file has no open connection, so it is read as `immutable` (a read-only connection to a
        WAL database would leave a `-wal` and `-shm` behind); with one, `mode=ro` uses the files that are there."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return  # a new index
        how = "mode=ro" if os.path.exists(self.path + "-wal") else "immutable=1"
        uri = f"file:{urllib.parse.quote(os.path.abspath(self.path))}?{how}"
        try:
            with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=60.0)) as db:
                has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
                found = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() if has_meta else None
        except sqlite3.OperationalError as exc:  # cannot open or read it (permissions, a lock held past the timeout)
            raise ValueError(f"{self.path}: cannot read the index: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{self.path}: not a lorafast index: {exc}") from exc
        if found is not None and found[0] != str(SCHEMA_VERSION):
            raise ValueError(f"{self.path}: index schema {found[0]}, this lorafast writes {SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM adapters").fetchone()[0])

    def paths(self) -> list[str]:
        """The adapter paths the index holds, sorted."""
        return sorted(os.fsdecode(p) for (p,) in self._db.execute("SELECT path FROM adapters"))

    def scan(
        self,
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
    ) -> IndexScanReport:
        """`lorafast.scan(paths, ...)` through the index: the same report, with only new and changed adapters
        read. Local paths are made absolute, so the index means the same files from any working directory;
        URLs take `storage_options`, `timeout` and `concurrency` as `lorafast.scan` does."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        plist = [p if _is_url(p) else os.path.abspath(p) for p in (os.fsdecode(p) for p in paths)]
        threads = _check_threads(threads)
        remote = {"storage_options": storage_options, "timeout": timeout, "concurrency": concurrency}
        args = (plist, recursive, threads, progress, content_hash, mode, remote)
        try:
            return self._scan(*args, trust=True)
        except _Unreadable:
            # A stored row or classification that does not decode (a damaged file, a foreign writer): read
            # everything under these paths again, and overwrite what was stored.
            return self._scan(*args, trust=False)

    def _scan(
        self,
        plist: list[str],
        recursive: bool,
        threads: int | None,
        progress: bool | None,
        content_hash: bool,
        mode: str,
        remote: dict[str, Any],
        *,
        trust: bool,
    ) -> IndexScanReport:
        options = {"content_hash": content_hash, "v": SCHEMA_VERSION, "build": _build()}
        how = (_storage_items(remote["storage_options"]), remote["timeout"], remote["concurrency"])

        # The walk: the same discovery a scan does (for URLs, with what the listing says of each object).
        walked = _core.discover_target_stats(plist, recursive, threads, *how)
        stored: dict[bytes, tuple[str, bytes, str | None]] = {}
        for p, sig, row, cls in self._db.execute("SELECT path, signature, row, class FROM adapters"):
            stored[bytes(p)] = (sig, bytes(row), cls)

        # Signatures of everything the walk found. An object the store says is gone (a URL named directly)
        # is read, so that its row says why, and counts as removed, as a local path that is gone does.
        found: list[tuple[Any, bytes, str | None]] = []
        seen: set[bytes] = set()
        for item, weights_stat, config_stat, missing in walked:
            key = os.fsencode(item[0])
            signature: str | None = None if missing else ""
            if item[3] is None and item[1] is not None and not missing:
                seen.add(key)
                signature = _signature(item, weights_stat, config_stat, options)
            found.append((item, key, signature))
        gone = [p for p in stored if p not in seen and any(_under(os.fsdecode(p), root) for root in plist)]
        # A renamed or moved adapter: its files (same inode, device, size and mtime) under a path that is new,
        # while the stored row of the old path is gone. Its row is kept, with the new paths in it.
        moved_from: dict[str, bytes] = {}
        for p in gone:
            sig, _, cls = stored[p]
            if sig and cls is not None and _strong(sig):
                moved_from.setdefault(_content(sig), p)

        slots: list[tuple[str, Any]] = []  # ("row", stored) | ("read", index into `to_read`) | ("item", item)
        to_read: list[tuple[str, str | None, str | None, str | None, str | None]] = []
        signatures: list[str | None] = []
        moved: list[tuple[bytes, str, bytes, str | None]] = []
        added: list[str] = []
        changed: list[str] = []
        for item, key, signature in found:
            path, weights, config, code, _ = item
            if code is not None or weights is None:
                # Failed discoveries are part of the walk: the same row every time, nothing to read.
                slots.append(("item", item))
                continue
            old = stored.get(key)
            if signature is None:  # gone: read for its error row, neither stored nor added
                slots.append(("read", len(to_read)))
                to_read.append(item)
                signatures.append(None)
                continue
            if trust and old is not None and signature and old[0] == signature:
                slots.append(("row", old))
                continue
            (changed if old is not None else added).append(path)
            origin = moved_from.get(_content(signature)) if trust and old is None and signature else None
            if origin is not None:
                row = _moved_row(stored[origin][1], path, weights, config)
                slots.append(("row", (signature, row, stored[origin][2])))
                moved.append((key, signature, row, stored[origin][2]))
                continue
            slots.append(("read", len(to_read)))
            to_read.append(item)
            signatures.append(signature)

        show = _want_progress(progress, len(to_read))
        fresh_rows: list[bytes] = []
        fresh_ids: list[str | None] = []
        fresh_classes: dict[str, bytes] = {}
        if to_read:
            result = _core.scan_targets(to_read, threads, mode, content_hash, show, *how)
            fresh_rows, row_classes, bodies = result.encode()
            ids = [hashlib.sha256(body).hexdigest() for body in bodies]
            fresh_classes = dict(zip(ids, bodies, strict=True))
            fresh_ids = [None if k is None else ids[k] for k in row_classes]
        # Failed discoveries go through the same encoding as scanned rows.
        failed = [s[1] for s in slots if s[0] == "item"]
        failed_rows = (
            _core.scan_targets(failed, threads, mode, False, False, None, None, None).encode()[0] if failed else []
        )

        removed = sorted(os.fsdecode(p) for p in gone)
        self._write(
            [
                (os.fsencode(item[0]), sig, fresh_rows[i], fresh_ids[i])
                for i, (item, sig) in enumerate(zip(to_read, signatures, strict=True))
                if sig is not None
            ]
            + moved,
            # A moved row's classification is written again with it, in case another writer dropped it meanwhile.
            {**fresh_classes, **self._classes({cls for *_, cls in moved if cls is not None})},
            [os.fsencode(p) for p in removed],
        )

        rows: list[bytes] = []
        class_ids: list[str | None] = []
        classes: dict[str, bytes] = dict(fresh_classes)
        need: set[str] = set()
        failed_iter = iter(failed_rows)
        for kind, value in slots:
            if kind == "row":
                rows.append(value[1])
                class_ids.append(value[2])
                if value[2] is not None and value[2] not in classes:
                    need.add(value[2])
            elif kind == "read":
                rows.append(fresh_rows[value])
                class_ids.append(fresh_ids[value])
            else:
                rows.append(next(failed_iter))
                class_ids.append(None)
        try:
            classes.update(self._classes(need))
            result = _core.assemble(rows, class_ids, classes)
        except (ValueError, RuntimeError) as e:
            raise _Unreadable(str(e)) from e
        report = IndexScanReport(result, remote=remote)
        report.added, report.changed, report.removed, report.reads = added, changed, removed, len(to_read)
        return report

    def _classes(self, ids: set[str]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        pending = list(ids)
        for start in range(0, len(pending), 500):
            chunk = pending[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for cid, body in self._db.execute(f"SELECT id, body FROM classes WHERE id IN ({marks})", chunk):
                out[cid] = bytes(body)
        missing = ids - out.keys()
        if missing:
            raise RuntimeError(f"{self.path}: index lost classifications {sorted(missing)[:3]}")
        return out

    def _write(
        self, upserts: list[tuple[bytes, str, bytes, str | None]], classes: Mapping[str, bytes], removed: list[bytes]
    ) -> None:
        """Upserts `(path, signature, row, class id)` and deletions, `batch_size` rows per transaction. A row and
        the classification it names are written in the same transaction, so every committed state is
        consistent."""
        db = self._db
        removed_at = len(upserts)
        ops = len(upserts) + len(removed)
        for number, start in enumerate(range(0, ops, self.batch_size)):
            stop = start + self.batch_size
            puts = upserts[start:stop]
            dels = removed[max(start - removed_at, 0) : max(stop - removed_at, 0)]
            db.execute("BEGIN IMMEDIATE")
            try:
                ids = {cid for *_, cid in puts if cid is not None}
                db.executemany("INSERT OR IGNORE INTO classes VALUES (?, ?)", [(cid, classes[cid]) for cid in ids])
                db.executemany("INSERT OR REPLACE INTO adapters VALUES (?, ?, ?, ?)", puts)
                db.executemany("DELETE FROM adapters WHERE path = ?", [(p,) for p in dels])
                if self._on_batch is not None:
                    self._on_batch(number)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        if ops:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM classes WHERE id NOT IN (SELECT class FROM adapters WHERE class IS NOT NULL)")
            db.execute("COMMIT")


def _strong(signature: str) -> bool:
    """Does the signature tell these files from others of the same size? A local stat (inode, mtime) or an ETag
    does; a remote size and last-modified time (to the second) may not, so those rows are not moved."""
    weights, stat = json.loads(signature)[:2]
    return not _is_url(weights) or isinstance(stat[1], str)


def _content(signature: str) -> str:
    """A signature without its paths, nor a local file's ctime (a rename sets it): what identifies the same files
    under another name. A local stat is `[size, mtime_ns, inode, device]` then the ctime (absent in old rows)."""
    path, weights, _, config, options = json.loads(signature)
    if not _is_url(path):
        weights, config = weights[:4], config and config[:4]
    return json.dumps([weights, config, options])


def _path_value(path: str | None) -> Any:
    """A path as `rust/store.rs` writes it: a string when it is UTF-8, else its bytes."""
    if path is None:
        return None
    try:
        path.encode()
        return path
    except UnicodeEncodeError:
        return list(os.fsencode(path))


def _moved_row(row: bytes, path: str, weights: str | None, config: str | None) -> bytes:
    """A stored row with the paths of the place its files moved to (nothing else in a row names a path)."""
    fields = json.loads(row)
    fields.update(path=_path_value(path), weights=_path_value(weights), config=_path_value(config))
    return json.dumps(fields).encode()


def _under(path: str, root: str) -> bool:
    sep = "/" if _is_url(root) else os.sep
    return path == root or path.startswith(root.rstrip(sep) + sep)
