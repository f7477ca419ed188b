"""`lorafast.Index`: a persistent SQLite index whose `scan` reads only what changed and
returns the report a full scan gives; it survives a writer killed mid-update and serves concurrent readers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time

import lorafast
import pyarrow as pa
import pytest
from helpers.fleets import write_failed
from helpers.reports import rewrite_in_place, same_report
from lorafast import _core
from lorafast.sample import write_samples
from lorafast.scanning.index import SCHEMA_VERSION
from lorafast.testing import write_attention_adapter as peft


def named_classes(con) -> set[bytes]:
    """The classification ids the index's chunks name (their `classes` column: 32-byte ids, concatenated)."""
    return {ids[i : i + 32] for (ids,) in con.execute("SELECT classes FROM chunks") for i in range(0, len(ids), 32)}


def stored_paths(con) -> list[bytes]:
    return _core.index_paths([body for (body,) in con.execute("SELECT body FROM chunks")])


def _take(body: bytes, at: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<I", body, at)
    return body[at + 4 : at + 4 + n], at + 4 + n


def unsnappy(blob: bytes) -> bytes:
    """Raw snappy, decompressed (pyarrow's codec): the blob opens with its length as a varint."""
    size, shift, at = 0, 0, 0
    while True:
        size |= (blob[at] & 0x7F) << shift
        shift, at = shift + 7, at + 1
        if blob[at - 1] < 0x80:
            break
    return pa.decompress(blob, size, codec="snappy", asbytes=True)


def chunk_records(blob: bytes) -> list[tuple[bytes, bytes]]:
    """A chunk's (path, entry) records, as rust/report/index_chunks.rs lays them out: snappy-compressed, a
    4-byte tag, a count, then each record's path and entry, each a u32 length and the bytes."""
    body = unsnappy(blob)
    (count,) = struct.unpack_from("<I", body, 4)
    records, at = [], 8
    for _ in range(count):
        path, at = _take(body, at)
        entry, at = _take(body, at)
        records.append((path, entry))
    assert at == len(body)
    return records


#: A chunk's tag (rust/report/index_chunks.rs): "LFk" and the encoding's version.
CHUNK_TAG = b"LFk\x02"


def chunk_body(records: list[tuple[bytes, bytes]]) -> bytes:
    out = [CHUNK_TAG, struct.pack("<I", len(records))]
    for path, entry in records:
        out += [struct.pack("<I", len(path)), path, struct.pack("<I", len(entry)), entry]
    return pa.compress(b"".join(out), codec="snappy", asbytes=True)


def entry_class(entry: bytes) -> bytes:
    """The classification id in a row's entry: after the signature, a presence byte, then the id."""
    _, at = _take(entry, 0)
    assert entry[at] == 1
    return _take(entry, at + 1)[0]


def test_chunk_helpers_read_what_the_core_writes(tmp_path):
    for i in range(3):
        peft(tmp_path / "f" / f"a{i}", r=4 * (i + 1))
    lorafast.Index(tmp_path / "i.db").scan([tmp_path / "f"])
    with contextlib.closing(sqlite3.connect(tmp_path / "i.db")) as con:
        ((body, classes),) = con.execute("SELECT body, classes FROM chunks").fetchall()
        records = chunk_records(body)
        assert [p for p, _ in records] == [os.fsencode(tmp_path / "f" / f"a{i}") for i in range(3)]
        assert chunk_records(chunk_body(records)) == records and unsnappy(body)[:4] == CHUNK_TAG
        assert sorted(entry_class(e) for _, e in records) == sorted(classes[i : i + 32] for i in range(0, 96, 32))
        assert named_classes(con) == {cid for (cid,) in con.execute("SELECT id FROM classes")}


@pytest.fixture
def fleet(tmp_path):
    root = tmp_path / "fleet"
    write_samples(str(root), 60)
    write_failed(root, "tiny", "no_weights")  # a failed row is indexed too; a failed discovery
    return root


def test_first_scan_equals_a_full_scan_and_a_rescan_reads_nothing(tmp_path, fleet):
    db = tmp_path / "fleet.db"
    first = lorafast.Index(db).scan([fleet])
    same_report(first, lorafast.scan([fleet]))
    assert first.reads == len(first.added) == len(first) - 1  # all but the failed discovery
    assert first.changed == first.removed == []
    again = lorafast.Index(db).scan(fleet)
    same_report(again, lorafast.scan([fleet]))
    assert (again.added, again.changed, again.removed, again.reads) == ([], [], [], 0)


def test_unchanged_rescan_reads_no_header(tmp_path, fleet):
    """Proof without timing: the core's panic hook on one adapter's weights is never reached by an unchanged
    rescan, and is by the rescan that reads that adapter again."""
    db = tmp_path / "fleet.db"
    want = lorafast.Index(db).scan([fleet])
    first = next(iter(want))
    weights = first.weight_files[0]
    _core._debug_panic_on(weights)
    try:
        got = lorafast.Index(db).scan([fleet])
        os.utime(weights, ns=(0, 0))  # another mtime: read again
        again = lorafast.Index(db).scan([fleet])
    finally:
        _core._debug_panic_on(None)
    assert got.reads == 0
    same_report(got, want)
    assert again.reads == 1
    assert [(code, "debug hook" in message) for path, code, message in again.errors if path == first.path] == [
        ("internal", True)
    ]


def test_a_rewrite_that_keeps_size_and_mtime_is_read_again(tmp_path):
    root = tmp_path / "f"
    peft(root / "a", r=4)
    peft(root / "b", r=4)
    db = tmp_path / "i.db"
    assert {a.r for a in lorafast.Index(db).scan([root])} == {4}
    rewrite_in_place(root / "a" / "adapter_config.json", b'"r": 4', b'"r": 8')
    rewrite_in_place(root / "b" / "adapter_model.safetensors", b"[4,32]", b"[32,4]")  # a lora_A of rank 32
    report = lorafast.Index(db).scan([root])
    assert (report.reads, sorted(report.changed)) == (2, [str(root / "a"), str(root / "b")])
    same_report(report, lorafast.scan([root]))
    by_path = {a.path: a for a in report}
    assert by_path[str(root / "a")].r == 8
    assert lorafast.Index(db).scan([root]).reads == 0


def _schema_1_index(db, root) -> None:
    """An index as lorafast wrote it before schema 2: JSON signatures and rows, hex class ids. Its signatures
    are those of the files as they are, so only the schema tells that its rows are not to be trusted."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("PRAGMA journal_mode=WAL")
        con.executescript(
            """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema', '1');
            CREATE TABLE adapters (path BLOB PRIMARY KEY, signature TEXT NOT NULL, row BLOB NOT NULL, class TEXT);
            CREATE TABLE classes (id TEXT PRIMARY KEY, body BLOB NOT NULL);"""
        )
        for name in sorted(os.listdir(root)):
            files = [str(root / name / f) for f in ("adapter_model.safetensors", "adapter_config.json")]
            stats = [[s.st_size, s.st_mtime_ns, s.st_ino, s.st_dev, s.st_ctime_ns] for s in map(os.stat, files)]
            sig = json.dumps([files[0], stats[0], files[1], stats[1], {"content_hash": False, "v": 1}])
            row = json.dumps({"v": 1, "path": str(root / name), "weights": files[0], "config": files[1]})
            con.execute("INSERT INTO adapters VALUES (?, ?, ?, ?)", (os.fsencode(root / name), sig, row, "ab" * 32))
        con.execute("INSERT INTO classes VALUES (?, ?)", ("ab" * 32, b'{"format": "peft", "modules": []}'))
        con.commit()


def test_an_index_of_an_older_schema_is_read_again_once(tmp_path):
    root = tmp_path / "f"
    for name in ("a", "b", "c"):
        peft(root / name, r=4)
    db = tmp_path / "i.db"
    _schema_1_index(db, root)
    index = lorafast.Index(db)
    assert len(index) == 0  # emptied when opened, never misread
    report = index.scan([root])
    assert (report.reads, sorted(report.added)) == (3, [str(root / n) for n in ("a", "b", "c")])
    same_report(report, lorafast.scan([root]))
    with contextlib.closing(sqlite3.connect(db)) as con:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (str(SCHEMA_VERSION),)
    assert lorafast.Index(db).scan([root]).reads == 0


def _future_index(path, wal: bool) -> None:
    """An index as a newer lorafast might write it: a newer schema, tables of its own, its own journal mode."""
    with contextlib.closing(sqlite3.connect(path)) as con:
        con.execute(f"PRAGMA journal_mode={'WAL' if wal else 'DELETE'}")
        con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        con.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION + 1),))
        con.execute("CREATE TABLE rows_v2 (path BLOB PRIMARY KEY, body BLOB)")
        con.commit()


@pytest.mark.parametrize("wal", [False, True])
def test_an_index_of_a_newer_schema_is_refused_unchanged(tmp_path, wal):
    db = tmp_path / "new.db"
    _future_index(db, wal)
    before = db.read_bytes()
    newer = f"index schema {SCHEMA_VERSION + 1}, this lorafast writes {SCHEMA_VERSION}"
    with pytest.raises(ValueError, match=rf"new\.db: {newer}"):
        lorafast.Index(db)
    assert db.read_bytes() == before
    assert os.listdir(tmp_path) == ["new.db"]  # no -wal or -shm made either
    # while another program has it open (its -wal and -shm are there), the same
    with contextlib.closing(sqlite3.connect(db)) as other:
        other.execute("INSERT INTO rows_v2 VALUES (x'00', x'00')")
        other.commit()
        files = sorted(os.listdir(tmp_path))
        before = db.read_bytes()
        with pytest.raises(ValueError, match=newer):
            lorafast.Index(db)
        assert db.read_bytes() == before and sorted(os.listdir(tmp_path)) == files


def test_a_file_that_is_not_an_index_is_refused_unchanged(tmp_path):
    db = tmp_path / "notes.db"
    db.write_bytes(b"not a database, " * 64)
    with pytest.raises(ValueError, match="notes.db: not a lorafast index"):
        lorafast.Index(db)
    assert db.read_bytes() == b"not a database, " * 64 and os.listdir(tmp_path) == ["notes.db"]
    (tmp_path / "folder.db").mkdir()
    with pytest.raises(ValueError, match="folder.db: cannot read the index: unable to open database file"):
        lorafast.Index(tmp_path / "folder.db")


def test_add_change_delete_rename(tmp_path):
    root = tmp_path / "fleet"
    for i in range(5):
        peft(root / f"a{i}", r=2 if i == 1 else 4)  # a1's classification is its own
    db = tmp_path / "fleet.db"
    lorafast.Index(db).scan([root])

    peft(root / "new", r=8)  # add
    peft(root / "a1", r=16)  # change: new tensors and config
    shutil.rmtree(root / "a2")  # delete
    os.rename(root / "a3", root / "renamed")  # rename
    (root / "a4" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 32}))  # config only
    report = lorafast.Index(db).scan([root])
    same_report(report, lorafast.scan([root]))
    assert sorted(report.added) == [str(root / "new"), str(root / "renamed")]
    assert sorted(report.changed) == [str(root / "a1"), str(root / "a4")]
    assert report.removed == [str(root / "a2"), str(root / "a3")]
    assert report.reads == 3  # the renamed adapter's files are the same inodes: its row moves with them
    with contextlib.closing(sqlite3.connect(db)) as con:  # a1's old classification (r=2), named by no row, is gone
        stored = {cid for (cid,) in con.execute("SELECT id FROM classes")}
        assert stored == named_classes(con)
        assert len(stored) == 4  # a0 and renamed's, a1's, a4's, new's
    by_path = {a.path: a for a in report}
    assert by_path[str(root / "a1")].rank == 16 and by_path[str(root / "a4")].r == 32
    assert lorafast.Index(db).paths() == sorted(
        str(p) for p in (root / n for n in ("a0", "a1", "a4", "new", "renamed"))
    )
    assert lorafast.Index(db).scan([root]).reads == 0


def test_scans_of_other_roots_keep_each_others_rows(tmp_path):
    for i in range(3):
        peft(tmp_path / "x" / f"a{i}", r=4)
        peft(tmp_path / "y" / f"b{i}", r=8)
    index = lorafast.Index(tmp_path / "i.db")
    index.scan([tmp_path / "x"])
    assert index.scan([tmp_path / "y"]).removed == []
    assert len(index) == 6
    assert index.scan([tmp_path / "x", tmp_path / "y"]).reads == 0


def test_options_are_part_of_the_signature(tmp_path):
    peft(tmp_path / "f" / "a", r=4)
    index = lorafast.Index(tmp_path / "i.db")
    index.scan([tmp_path / "f"])
    hashed = index.scan([tmp_path / "f"], content_hash=True)
    assert hashed.reads == 1
    same_report(hashed, lorafast.scan([tmp_path / "f"], content_hash=True))


def test_relative_paths(tmp_path, monkeypatch):
    """Relative paths are indexed as absolute ones (URLs, in test_index_remote.py, stay as they are)."""
    peft(tmp_path / "f" / "a", r=4)
    monkeypatch.chdir(tmp_path)
    index = lorafast.Index("i.db")
    assert index.scan("f").paths == [str(tmp_path / "f" / "a")]
    assert index.scan(str(tmp_path / "f")).reads == 0


CHILD = """
import os, sys, time
import lorafast
index = lorafast.Index(sys.argv[1])
index.batch_size = 7
def pause(number):
    if number == int(sys.argv[3]):
        print("in-transaction", flush=True)
        time.sleep(120)
index._on_batch = pause
index.scan([sys.argv[2]])
"""


def start_child(db, root, pause_at):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(db), str(root), str(pause_at)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "in-transaction", line
    return proc


def test_writer_killed_mid_update_leaves_a_consistent_index(tmp_path, fleet):
    db = tmp_path / "fleet.db"
    proc = start_child(db, fleet, pause_at=3)  # 3 batches of 7 committed, the 4th open
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    with contextlib.closing(sqlite3.connect(db)) as con:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert len(stored_paths(con)) == 21  # 3 chunks of 7
        assert named_classes(con) <= {cid for (cid,) in con.execute("SELECT id FROM classes")}  # none dangling
    index = lorafast.Index(db)
    report = index.scan([fleet])
    assert report.reads == len(report) - 1 - 21  # only what the killed writer had not committed
    same_report(report, lorafast.scan([fleet]))
    assert index.scan([fleet]).reads == 0


def test_reader_during_a_write(tmp_path, fleet):
    db = tmp_path / "fleet.db"
    lorafast.Index(db).scan([fleet])
    shutil.rmtree(fleet / sorted(p for p in os.listdir(fleet) if (fleet / p).is_dir())[0])
    for i in range(30):
        peft(fleet / f"more-{i}", r=4)
    proc = start_child(db, fleet, pause_at=1)  # one batch committed, a second one open
    try:
        reader = lorafast.Index(db)
        # The reader is not blocked by the open transaction and sees a committed state.
        t0 = time.monotonic()
        n = len(reader)
        assert time.monotonic() - t0 < 30
        assert n in range(60, 100)
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(len(lorafast.Index(db).paths()))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [n] * 4
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    report = lorafast.Index(db).scan([fleet])
    same_report(report, lorafast.scan([fleet]))


def test_cli_scan_with_index(tmp_path, fleet):
    db = tmp_path / "fleet.db"
    cmd = [sys.executable, "-m", "lorafast", "scan", "--index", str(db), "--json", str(fleet)]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 1  # the broken files
    assert json.loads(first.stdout) == json.loads(lorafast.scan([fleet]).to_json())
    assert "removed, " in first.stderr
    second = subprocess.run(cmd, capture_output=True, text=True)
    assert second.stdout == first.stdout
    assert "0 added, 0 changed, 0 removed, 0 read" in second.stderr


def test_rows_of_another_build_are_read_again(tmp_path, monkeypatch):
    from lorafast.scanning import index as index_mod

    for i in range(3):
        peft(tmp_path / "f" / f"a{i}", r=4)
    index = lorafast.Index(tmp_path / "i.db")
    assert index.scan([tmp_path / "f"]).reads == 3
    assert index.scan([tmp_path / "f"]).reads == 0
    monkeypatch.setattr(index_mod, "_build", lambda: ["another", "build", 0, 0])
    again = index.scan([tmp_path / "f"])
    assert (again.reads, len(again.changed)) == (3, 3)
    same_report(again, lorafast.scan([tmp_path / "f"]))


def test_moved_files_keep_their_rows_unread(tmp_path):
    root = tmp_path / "fleet"
    peft(root / "team" / "a", r=4)
    tensors = {"lora_unet_x.lora_down.weight": ("F16", (4, 8)), "lora_unet_x.lora_up.weight": ("F16", (8, 4))}
    from lorafast.testing import write_safetensors

    os.makedirs(root / "loose")
    write_safetensors(str(root / "loose" / "k.safetensors"), tensors, metadata={"ss_seed": "1"})
    write_safetensors(str(root / "loose" / "j.safetensors"), tensors)
    write_safetensors(str(root / "loose" / "l.safetensors"), tensors, metadata={"ss_seed": "3"})
    name = os.fsdecode(b"moved-\xff")
    index = lorafast.Index(tmp_path / "i.db")
    index.scan([root])
    os.rename(root / "team", root / "other")
    os.makedirs(root / name)
    os.rename(root / "loose" / "k.safetensors", root / name / "k.safetensors")  # now a folder with one file
    report = index.scan([root])
    assert report.reads == 0
    assert sorted(report.added) == sorted([str(root / "other" / "a"), str(root / name)])
    same_report(report, lorafast.scan([root]))
    assert index.scan([root]).reads == 0


def test_a_damaged_row_chunk_or_classification_is_read_again(tmp_path):
    """An entry that does not parse is that one adapter read again; a chunk that does not parse is its adapters
    read again; a row or classification that does not decode is every adapter read again (and written over).
    Either way the report is a full scan's."""
    for i in range(3):
        peft(tmp_path / "f" / f"a{i}", r=4 * (i + 1))
    db = tmp_path / "i.db"
    want = lorafast.Index(db).scan([tmp_path / "f"])
    a1 = os.fsencode(tmp_path / "f" / "a1")

    def with_entry(change):
        def damage(con):
            ((cid, body),) = con.execute("SELECT id, body FROM chunks").fetchall()
            records = [(p, change(e) if p == a1 else e) for p, e in chunk_records(body)]
            con.execute("UPDATE chunks SET body = ? WHERE id = ?", (chunk_body(records), cid))

        return damage

    def a1_class(con):
        ((body,),) = con.execute("SELECT body FROM chunks").fetchall()
        return entry_class(dict(chunk_records(body))[a1])

    damages = [
        (with_entry(lambda e: b"{not json"), 1),
        (with_entry(lambda e: e[:-1]), 3),  # a row cut short
        (lambda con: con.execute("UPDATE chunks SET body = 'text'"), 3),  # not bytes
        (lambda con: con.execute("UPDATE chunks SET body = substr(body, 1, length(body) - 1)"), 3),  # cut short
        (lambda con: con.execute("UPDATE classes SET body = x'00' WHERE id = ?", (a1_class(con),)), 3),
        (lambda con: con.execute("DELETE FROM classes WHERE id = ?", (a1_class(con),)), 3),  # a classification gone
    ]
    for number, (damage, reads) in enumerate(damages):
        with contextlib.closing(sqlite3.connect(db)) as con:
            damage(con)
            con.commit()
        report = lorafast.Index(db).scan([tmp_path / "f"])
        assert report.reads == reads, number
        same_report(report, want)
        assert lorafast.Index(db).scan([tmp_path / "f"]).reads == 0
        assert lorafast.Index(db).paths() == [str(tmp_path / "f" / f"a{i}") for i in range(3)]


def test_a_row_two_writers_added_is_read_from_the_later_chunk_and_the_other_dropped(tmp_path):
    """Two writers that both add one adapter leave its row in two chunks: the later one's is read, and the
    rescan's rewrite of the other chunk drops the earlier copy."""
    for i in range(3):
        peft(tmp_path / "f" / f"a{i}", r=4)
    db = tmp_path / "i.db"
    index = lorafast.Index(db)
    index.batch_size = 2  # chunks [a0, a1], [a2]
    want = index.scan([tmp_path / "f"])
    a0 = os.fsencode(tmp_path / "f" / "a0")
    with contextlib.closing(sqlite3.connect(db)) as con:
        (body, classes) = con.execute("SELECT body, classes FROM chunks ORDER BY id").fetchone()
        copy = [r for r in chunk_records(body) if r[0] == a0]
        con.execute("INSERT INTO chunks VALUES (NULL, ?, ?)", (chunk_body(copy), classes))
        con.commit()
    peft(tmp_path / "f" / "a2", r=8)  # a change, so that the rescan writes
    report = index.scan([tmp_path / "f"])
    assert (report.reads, report.added, report.removed) == (1, [], [])
    same_report(report, lorafast.scan([tmp_path / "f"]))
    with contextlib.closing(sqlite3.connect(db)) as con:
        records = [p for (b,) in con.execute("SELECT body FROM chunks ORDER BY id") for p, _ in chunk_records(b)]
    assert sorted(records) == [os.fsencode(tmp_path / "f" / f"a{i}") for i in range(3)]
    assert index.scan([tmp_path / "f"]).reads == 0
    assert len(index) == 3 and len(want) == 3


def test_a_changed_row_is_appended_and_its_chunk_compacted_once_half_of_it_is_dead(tmp_path):
    """A rescan that changes a row in a full chunk appends the new row (a new chunk) and leaves the old one
    hidden, instead of rewriting the chunk; once half a chunk's rows are dead, the chunk is rewritten without
    them. Every report is a full scan's, and an unchanged rescan writes nothing."""
    root = tmp_path / "f"
    for i in range(8):
        peft(root / f"a{i}", r=4)
    db = tmp_path / "i.db"
    index = lorafast.Index(db)
    index.batch_size = 4  # chunks [a0..a3], [a4..a7]

    def chunks():
        with contextlib.closing(sqlite3.connect(db)) as con:
            found = con.execute("SELECT id, body FROM chunks ORDER BY id").fetchall()
        return [(cid, [os.path.basename(os.fsdecode(p)) for p, _ in chunk_records(body)]) for cid, body in found]

    index.scan([root])
    (c1, first), (c2, second) = chunks()
    assert (first, second) == (["a0", "a1", "a2", "a3"], ["a4", "a5", "a6", "a7"])
    peft(root / "a1", r=8)
    report = index.scan([root])
    assert (report.reads, report.changed) == (1, [str(root / "a1")])
    same_report(report, lorafast.scan([root]))
    after = chunks()
    assert after[:2] == [(c1, first), (c2, second)] and after[2][1] == ["a1"]  # appended; a0..a3 untouched
    assert index.scan([root]).reads == 0 and chunks() == after  # nothing written
    assert len(index) == 8
    peft(root / "a2", r=16)  # a1's old copy and a2: half of the first chunk is dead, so it is rewritten
    report = index.scan([root])
    same_report(report, lorafast.scan([root]))
    assert chunks() == [(c1, ["a0", "a2", "a3"]), (c2, second), after[2]]
    assert {p.name for p in (root / n for n in os.listdir(root))} == {os.path.basename(p) for p in index.paths()}
    assert index.scan([root]).reads == 0
