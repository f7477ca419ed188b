"""`lorafast.Index`: a persistent scan index in SQLite, so a rescan reads only the adapters that changed.

Each adapter row is stored with the signature of its files: `(size, mtime, inode, device, ctime)` of the weights
file and of `adapter_config.json`, the options it was read with and the lorafast build that read it. The ctime
is there because any write sets it and no caller can set it back: a rewrite that keeps the size and puts the
mtime back (`os.utime`, `touch -d`) still changes it. A rescan walks the paths once (the same discovery as
`scan`), `stat`s each adapter's files, reads only those whose signature differs or that are new, and drops the
rows of adapters that are gone. A renamed or moved adapter (its files' inode, device, size and mtime under a new
path; a rename sets the ctime, so it is not compared there) keeps its row, unread. The report it returns equals
a full `scan` of the same paths: unchanged rows come back as the scan stored them.

What a report is made of is stored as the core encodes it (`rust/report/index.rs`), so a rescan loads it at memory
speed: per row its own fields, and per distinct classification (adapters trained from one recipe share theirs)
its fields and module records as they are, compressed. Rows are stored in chunks of up to `batch_size`
(`rust/report/index_chunks.rs`): SQLite and Python handle a value per chunk, not per adapter, and a rescan
rewrites only the chunks that hold a changed or removed row. Everything per row (the stats, the comparison, the
decoding, the chunks) runs in the core (`_core.IndexScan`), in parallel; this module holds the SQLite file.

The database is in WAL mode and each chunk written is one transaction, with the classifications its rows name,
so a process killed mid-update leaves the index as of its last committed chunk (every row still matches the
signature stored with it), and readers are never blocked by a writer.

URLs are indexed too. A remote adapter's signature is its objects' ETag (with the size), or their size and
last-modified time where the server sends no ETag, as the discovery's own listing reports them, so a rescan of
an unchanged bucket costs the listing and no other request. Stores that cannot be listed (`http(s)://`,
`hf://`) are asked with one `HEAD` per file instead of a header read. A server that sends neither an ETag
nor a last-modified time gives no signature: its adapters are read on every scan.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from lorafast import _core
from lorafast.scanning._common import PathLike, check_threads, storage_items, want_progress
from lorafast.scanning.results import ScanReport

#: 3: rows in chunks; 2: a row per adapter, in the core's binary encodings; 1: JSON. An index of an older
#: schema is emptied when opened, and read again by its next scan.
SCHEMA_VERSION = 3

#: Seconds to wait for another connection's lock.
_TIMEOUT = 60.0
#: WAL pages past which a commit checkpoints (SQLite's default).
_WAL_PAGES = 1000

_TABLES = [
    # AUTOINCREMENT: a chunk's id is never reused, so a writer that replaces the chunk it read cannot overwrite
    # a newer one that another writer made after deleting it.
    """CREATE TABLE IF NOT EXISTS chunks (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        body BLOB NOT NULL,         -- rows: each adapter's path, signature, class id and scan row (index_chunks.rs)
        classes BLOB NOT NULL       -- the 32-byte ids of the classifications its rows name, concatenated
    )""",
    "CREATE TABLE IF NOT EXISTS classes (id BLOB PRIMARY KEY, body BLOB NOT NULL)",
]

#: Bytes of a classification id (a sha256).
_ID_BYTES = 32


def _older(schema: str) -> bool:
    return schema.isdigit() and int(schema) < SCHEMA_VERSION


def _build() -> list[Any]:
    """Which lorafast classified a stored row: its version and the core library file's size and mtime. Rows of
    another build are read again, since a new build may classify differently (or encode rows differently). The
    version is the core's own (Cargo.toml's, as the package's): asking the installed metadata for it took 16 ms,
    a tenth of a first scan of 20,000 small adapters."""
    st = os.stat(_core.__file__) if getattr(_core, "__file__", None) else None
    return [_core.__version__, _core.build_profile, st.st_size if st else 0, st.st_mtime_ns if st else 0]


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

    #: Rows per chunk, each chunk written in a transaction of its own.
    batch_size = 1000

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        self._check_schema()  # before anything is written: a newer lorafast's index is left as it is
        self._db = sqlite3.connect(self.path, timeout=_TIMEOUT, isolation_level=None, check_same_thread=False)
        try:
            self._wal()
            self._db.execute("PRAGMA synchronous=NORMAL")
            if self._schema() != str(SCHEMA_VERSION):
                self._create()
        except BaseException:
            self._db.close()
            raise
        #: Test hook: called inside each batch's transaction, after its writes and before its commit.
        self._on_batch: Callable[[int], None] | None = None

    def _wal_pages(self) -> int:
        try:
            return os.path.getsize(self.path + "-wal") // int(self._db.execute("PRAGMA page_size").fetchone()[0])
        except OSError:
            return 0

    def _wal(self) -> None:
        """WAL mode. Two processes opening a new index at once: SQLite refuses one's switch at once, without
        waiting for the lock, so it is tried again, as long as the connection waits for any other lock."""
        deadline = time.monotonic() + _TIMEOUT
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _schema(self) -> str | None:
        db = self._db
        if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
            return None
        found = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        return None if found is None else str(found[0])

    def _create(self) -> None:
        """Makes the tables of a new index, or empties one of an older schema, in one transaction (only then:
        opening a current index writes nothing, so it never waits for a writer)."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            found = self._schema()  # again, under the lock: another process may have made it meanwhile
            if found is not None and found != str(SCHEMA_VERSION):
                if not _older(found):
                    raise ValueError(f"{self.path}: index schema {found}, this lorafast writes {SCHEMA_VERSION}")
                for table in ("adapters", "chunks", "classes"):
                    db.execute(f"DROP TABLE IF EXISTS {table}")
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            for table in _TABLES:
                db.execute(table)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _check_schema(self) -> None:
        """Refuse an existing index of a newer schema, reading it only: no WAL switch, no tables, no file made. An
        index with no `-wal` file has no open connection, so it is read as `immutable` (a read-only connection to a
        WAL database would leave a `-wal` and `-shm` behind); with one, `mode=ro` uses the files that are there."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return  # a new index
        how = "mode=ro" if os.path.exists(self.path + "-wal") else "immutable=1"
        uri = f"file:{urllib.parse.quote(os.path.abspath(self.path))}?{how}"
        try:
            with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=_TIMEOUT)) as db:
                has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
                found = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() if has_meta else None
        except sqlite3.OperationalError as exc:  # cannot open or read it (permissions, a lock held past the timeout)
            raise ValueError(f"{self.path}: cannot read the index: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{self.path}: not a lorafast index: {exc}") from exc
        if found is not None and str(found[0]) != str(SCHEMA_VERSION) and not _older(str(found[0])):
            raise ValueError(f"{self.path}: index schema {found[0]}, this lorafast writes {SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._paths())

    def paths(self) -> list[str]:
        """The adapter paths the index holds, sorted."""
        return sorted(os.fsdecode(p) for p in self._paths())

    def _paths(self) -> list[bytes]:
        return _core.index_paths([body for (body,) in self._db.execute("SELECT body FROM chunks")])

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
        plist = [p if "://" in p else os.path.abspath(p) for p in (os.fsdecode(p) for p in paths)]
        threads = check_threads(threads)
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
        # What else a row depends on: the read options, the encoding and the build.
        context = json.dumps({"content_hash": content_hash, "v": SCHEMA_VERSION, "build": _build()}).encode()
        how = (storage_items(remote["storage_options"]), remote["timeout"], remote["concurrency"])
        # The walk (the discovery a scan does; for URLs, with what the listing says of each object), each
        # adapter's files stated and signed.
        scan = _core.IndexScan(plist, recursive, threads, context, *how)
        db = self._db
        db.execute("BEGIN")  # one snapshot: the rows, and the classifications they name
        try:
            scan.plan(db.execute("SELECT id, body FROM chunks ORDER BY id").fetchall(), trust)
            bodies = self._classes(scan.class_ids())
        except (ValueError, RuntimeError) as e:
            raise _Unreadable(str(e)) from e
        finally:
            db.execute("COMMIT")

        added, changed, removed, reads = scan.added, scan.changed, sorted(scan.removed), scan.reads
        classes = scan.read(mode, content_hash, want_progress(progress, reads))
        # A moved row's classification is written again with it, in case another writer dropped it meanwhile.
        # Read again for want of trust, a classification is written over the stored one, which may be what did
        # not decode.
        self._write(scan.writes(self.batch_size), {**bodies, **dict(classes)}, replace=not trust)
        try:
            result = scan.result(bodies)
        except ValueError as e:
            raise _Unreadable(str(e)) from e
        report = IndexScanReport(result, remote=remote)
        report.added, report.changed, report.removed, report.reads = added, changed, removed, reads
        return report

    def _classes(self, ids: list[bytes]) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            out.update(self._db.execute(f"SELECT id, body FROM classes WHERE id IN ({marks})", chunk).fetchall())
        if len(out) < len(ids):
            missing = sorted(set(ids) - out.keys())
            raise RuntimeError(f"{self.path}: index lost classifications {[m.hex() for m in missing[:3]]}")
        return out

    def _write(
        self,
        writes: list[tuple[int | None, bytes | None, bytes, list[bytes]]],
        classes: Mapping[bytes, bytes],
        *,
        replace: bool = False,
    ) -> None:
        """Writes each chunk `(id or None for a new one, body or None to delete it, the class ids its rows name,
        those of its new rows)` in a transaction of its own, with the classifications of its new rows, so every
        committed state is consistent. A stored classification of the same id is kept, or with `replace`,
        written over. Then every classification no chunk names any more is deleted (those of rows written over
        or removed, and what a writer killed before this step left): the chunks' `classes` column, a few bytes
        per chunk, says which are named."""
        if not writes:
            return
        db = self._db
        put_class = f"INSERT OR {'REPLACE' if replace else 'IGNORE'} INTO classes VALUES (?, ?)"
        # Many chunks: one checkpoint of the WAL at the end, and only if it has grown past SQLite's own
        # threshold, not one each 1,000 pages.
        many = len(writes) > 1
        if many:
            db.execute("PRAGMA wal_autocheckpoint=0")
        try:
            for number, (chunk_id, body, _, new_classes) in enumerate(writes):
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.executemany(put_class, [(cid, classes[cid]) for cid in new_classes])
                    if body is None:
                        db.execute("DELETE FROM chunks WHERE id = ?", (chunk_id,))
                    else:
                        db.execute(
                            "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?)", (chunk_id, body, writes[number][2])
                        )
                    if self._on_batch is not None:
                        self._on_batch(number)
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            db.execute("BEGIN IMMEDIATE")
            try:
                named = {
                    ids[i : i + _ID_BYTES]
                    for (ids,) in db.execute("SELECT classes FROM chunks")
                    for i in range(0, len(ids), _ID_BYTES)
                }
                unnamed = [(cid,) for (cid,) in db.execute("SELECT id FROM classes") if cid not in named]
                db.executemany("DELETE FROM classes WHERE id = ?", unnamed)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            if many and self._wal_pages() > _WAL_PAGES:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            if many:
                db.execute(f"PRAGMA wal_autocheckpoint={_WAL_PAGES}")
