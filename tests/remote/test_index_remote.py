"""`lorafast.Index` over URLs: remote adapters are keyed by their objects' ETag (or size and
last-modified), as the discovery's listing reports them, so an unchanged bucket costs the listing and nothing
else; added, changed and deleted objects are reported as for local paths. Requests are counted on the loopback
servers of tests/helpers/servers.py (no internet)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import lorafast
import pytest
from helpers.reports import same_report
from helpers.servers import LocalS3, RangeServer
from lorafast.sample import write_samples
from lorafast.testing import write_attention_adapter as peft

WEIGHTS = "adapter_model.safetensors"


def rewrite(path: str, **config: object) -> None:
    """A changed adapter: a new rank, so size, ETag and classification all change."""
    shutil.rmtree(path)
    peft(path, r=16, **config)


@pytest.fixture
def bucket(tmp_path):
    root = tmp_path / "buckets"
    write_samples(str(root / "fleet" / "samples"), 20, seed=5)
    (root / "fleet" / "broken.safetensors").write_bytes(b"\x01\x00")  # a failed row is indexed too
    os.makedirs(root / "fleet" / "no-weights")
    (root / "fleet" / "no-weights" / "adapter_config.json").write_text("{}")  # a failed discovery
    peft(str(root / "fleet" / "team" / "a"))
    server = LocalS3(str(root))
    try:
        yield server, root / "fleet"
    finally:
        server.stop()


def test_s3_rescan_of_an_unchanged_bucket_is_one_listing(tmp_path, bucket):
    server, _ = bucket
    opts = server.storage_options
    index = lorafast.Index(tmp_path / "fleet.db")
    first = index.scan("s3://fleet/", storage_options=opts)
    same_report(first, lorafast.scan("s3://fleet/", storage_options=opts))
    assert first.reads == len(first.added) == len(first) - 1  # all but the failed discovery
    assert any(method == "GET" and rng for method, _, rng in server.requests)  # headers were read

    server.clear()
    again = index.scan("s3://fleet/", storage_options=opts)
    assert server.requests == [("GET", "/fleet?list-type=2", None)]  # the listing, nothing else
    assert (again.added, again.changed, again.removed, again.reads) == ([], [], [], 0)
    same_report(again, first)


def test_s3_add_change_delete(tmp_path, bucket):
    server, fleet = bucket
    opts = server.storage_options
    index = lorafast.Index(tmp_path / "fleet.db")
    index.scan("s3://fleet/", storage_options=opts)
    samples = sorted(os.listdir(fleet / "samples"))
    peft(str(fleet / "team" / "b"))  # added
    rewrite(str(fleet / "team" / "a"))  # changed
    shutil.rmtree(fleet / "samples" / samples[0])  # deleted

    server.clear()
    got = index.scan("s3://fleet/", storage_options=opts)
    assert got.added == ["s3://fleet/team/b"]
    assert got.changed == ["s3://fleet/team/a"]
    assert got.removed == [f"s3://fleet/samples/{samples[0]}"]
    assert got.reads == 2
    # The listing, then the two adapters' configs and headers: no other object was asked for.
    reads = sorted({path for method, path, _ in server.requests if "list-type" not in path})
    assert reads == [f"/fleet/team/{x}/{name}" for x in "ab" for name in ("adapter_config.json", WEIGHTS)]
    same_report(got, lorafast.scan("s3://fleet/", storage_options=opts))
    assert got.record(got.paths.index("s3://fleet/team/a"))["rank"] == 16


def test_s3_same_size_rewrite_is_seen_by_its_etag(tmp_path, bucket):
    """A rewrite that keeps the size and the mtime leaves size and Last-Modified as they were: the ETag (the
    content's md5) tells it."""
    server, fleet = bucket
    opts = server.storage_options
    index = lorafast.Index(tmp_path / "fleet.db")
    index.scan("s3://fleet/team/", storage_options=opts)
    weights = fleet / "team" / "a" / WEIGHTS
    st = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of tensor data: the same header, the same size
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    got = index.scan("s3://fleet/team/", storage_options=opts)
    assert got.changed == ["s3://fleet/team/a"] and got.reads == 1
    same_report(got, lorafast.scan("s3://fleet/team/", storage_options=opts))


def test_s3_renamed_folder_keeps_its_row_unread(tmp_path, bucket):
    """Objects under a new key with the ETags of a gone adapter's objects are that adapter, moved."""
    server, fleet = bucket
    opts = server.storage_options
    index = lorafast.Index(tmp_path / "fleet.db")
    index.scan("s3://fleet/team/", storage_options=opts)
    os.rename(fleet / "team" / "a", fleet / "team" / "z")
    server.clear()
    got = index.scan("s3://fleet/team/", storage_options=opts)
    assert (got.added, got.removed, got.reads) == (["s3://fleet/team/z"], ["s3://fleet/team/a"], 0)
    assert len(server.requests) == 1
    same_report(got, lorafast.scan("s3://fleet/team/", storage_options=opts))


def test_local_and_remote_in_one_index(tmp_path, bucket):
    server, fleet = bucket
    opts = server.storage_options
    local = tmp_path / "local"
    peft(str(local / "x"))
    paths = [str(local), "s3://fleet/team/"]
    index = lorafast.Index(tmp_path / "fleet.db")
    first = index.scan(paths, storage_options=opts)
    assert sorted(first.added) == [str(local / "x"), "s3://fleet/team/a"]
    server.clear()
    again = index.scan(paths, storage_options=opts)
    assert again.reads == 0 and len(server.requests) == 1
    same_report(again, lorafast.scan(paths, storage_options=opts))
    # A rescan of one root leaves the other's rows alone.
    assert index.scan("s3://fleet/team/", storage_options=opts).removed == []
    assert sorted(index.paths()) == sorted(first.paths)


@pytest.fixture
def web(tmp_path):
    root = tmp_path / "web"
    for name in ("a", "b"):
        peft(str(root / name))
    peft(str(root / "solo"))
    os.replace(root / "solo" / WEIGHTS, root / "solo.safetensors")
    shutil.rmtree(root / "solo")
    server = RangeServer(str(root))
    try:
        yield server, root
    finally:
        server.stop()


def test_http_rescan_is_heads_only_and_sees_change_delete_and_add(tmp_path, web):
    """Web servers cannot be listed: a rescan asks for each file's ETag with a HEAD, and reads no header."""
    server, root = web
    urls = [f"{server.url}/ok/a", f"{server.url}/ok/b", f"{server.url}/ok/solo.safetensors"]
    index = lorafast.Index(tmp_path / "web.db")
    first = index.scan(urls)
    assert first.reads == 3 and not first.errors
    same_report(first, lorafast.scan(urls))

    server.clear()
    again = index.scan(urls)
    assert again.reads == 0
    assert sorted(m for m, _, _ in server.requests) == ["HEAD"] * 5  # two PEFT folders (2 files each), one file
    same_report(again, first)

    time.sleep(0.01)  # a new mtime, so a new ETag
    rewrite(str(root / "a"))
    os.remove(root / "solo.safetensors")
    server.clear()
    got = index.scan(urls)
    assert (got.added, got.changed, got.removed) == ([], [urls[0]], [urls[2]])
    assert [code for _, code, _ in got.errors] == ["not_found"]
    # HEADs of all, then the changed folder's files, and the gone file's GET that says why: nothing of b.
    assert {p for m, p, _ in server.requests if m == "GET"} == {
        "/ok/a/adapter_config.json",
        f"/ok/a/{WEIGHTS}",
        "/ok/solo.safetensors",
    }
    same_report(got, lorafast.scan(urls))
    assert index.paths() == sorted(urls[:2])

    # A URL new to the index is added: read, while the others cost a HEAD each.
    peft(str(root / "c"))
    server.clear()
    got = index.scan([*urls[:2], f"{server.url}/ok/c"])
    assert (got.added, got.changed, got.removed, got.reads) == ([f"{server.url}/ok/c"], [], [], 1)
    assert {p for m, p, _ in server.requests if m == "GET"} == {"/ok/c/adapter_config.json", f"/ok/c/{WEIGHTS}"}


def test_http_without_validators_is_read_every_time(tmp_path, web, monkeypatch):
    """A server that sends no ETag and no Last-Modified gives no signature: such adapters are read on every scan
    rather than trusted on their size alone."""
    server, _ = web
    from helpers import servers

    monkeypatch.setattr(servers._Handler, "send_header", _skip_validators(servers._Handler.send_header))
    url = f"{server.url}/ok/solo.safetensors"
    index = lorafast.Index(tmp_path / "web.db")
    assert index.scan(url).reads == 1
    again = index.scan(url)
    assert again.reads == 1 and again.changed == [url]


def _skip_validators(send_header):
    def send(self, key, value):
        if key not in ("ETag", "Last-Modified"):
            send_header(self, key, value)

    return send


def test_cli_scan_index_over_a_bucket(tmp_path, bucket):
    """`lorafast scan --index DB s3://...` with `--storage-option`: the second run reads nothing."""
    server, _ = bucket
    opts = [a for k, v in server.storage_options.items() for a in ("--storage-option", f"{k}={v}")]
    cmd = [sys.executable, "-m", "lorafast", "scan", "--index", str(tmp_path / "i.db"), *opts, "s3://fleet/"]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode in (0, 1), first.stderr  # 1: the fixture's broken adapters
    assert "Traceback" not in first.stderr
    assert ", 0 removed, 22 read" in first.stderr
    server.clear()
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert "0 added, 0 changed, 0 removed, 0 read" in again.stderr, again.stderr
    assert server.requests == [("GET", "/fleet?list-type=2", None)]
    assert again.stdout == first.stdout
