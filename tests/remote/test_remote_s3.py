"""Scanning an S3 bucket (moto's S3 server on 127.0.0.1) gives what scanning the same files locally gives."""

from __future__ import annotations

import dataclasses
import os

import lorafast
import pytest
from helpers.servers import MotoS3, build_fleet, normalized
from lorafast.errors import AdapterError

BUCKET = "fleet"
URL = f"s3://{BUCKET}"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    root = build_fleet(str(tmp_path_factory.mktemp("s3") / "fleet"), samples=150)
    server = MotoS3()
    try:
        server.upload(BUCKET, root)
        yield server, root
    finally:
        server.stop()


def test_bucket_scan_equals_local_scan(s3):
    server, root = s3
    local = lorafast.scan(root)
    remote = lorafast.scan(URL + "/", storage_options=server.storage_options)
    assert len(local) > 150
    codes = {code for _, code, _ in local.errors}
    assert {"header_too_large", "invalid_json", "header_too_small", "missing_weights", "invalid_config"} <= codes
    assert normalized(remote) == normalized(local, root, URL)
    # Headers longer than the first range request, and kohya alphas fetched by range, read right.
    long_rows = [remote.record(remote.paths.index(f"{URL}/long/{name}")) for name in ("peft", "kohya.safetensors")]
    assert all(rec["header_size"] > 64 << 10 for rec in long_rows)
    kohya = lorafast.inspect(URL + "/long/kohya.safetensors", storage_options=server.storage_options)
    assert sorted({m.alpha for m in kohya.modules}) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def _mapped(adapter, root):
    """A locally inspected adapter with its paths rewritten to bucket URLs."""
    return dataclasses.replace(
        adapter,
        path=URL + adapter.path[len(root) :],
        weight_files=tuple(URL + w[len(root) :] for w in adapter.weight_files),
        config_path=None if adapter.config_path is None else URL + adapter.config_path[len(root) :],
        modules=tuple(dataclasses.replace(m, weight_file=URL + m.weight_file[len(root) :]) for m in adapter.modules),
    )


def test_iterating_a_remote_report_reinspects_urls(s3):
    server, root = s3
    opts = server.storage_options
    remote = lorafast.scan(f"{URL}/long", storage_options=opts)
    local = lorafast.scan(os.path.join(root, "long"))
    assert list(remote) == [_mapped(a, root) for a in local]
    # inspect_many over one sample of every kind, twice over: full records with modules.
    paths = lorafast.scan(os.path.join(root, "samples")).ok_paths[:36]
    urls = [URL + p[len(root) :] for p in paths]
    got = lorafast.inspect_many(urls, storage_options=opts)
    assert got == [_mapped(a, root) for a in lorafast.inspect_many(paths)]


def test_sub_prefix_and_non_recursive(s3):
    server, root = s3
    opts = server.storage_options
    assert normalized(lorafast.scan(f"{URL}/broken", storage_options=opts)) == normalized(
        lorafast.scan(os.path.join(root, "broken")), root, URL
    )
    flat = lorafast.scan(f"{URL}/broken/headers/", recursive=False, storage_options=opts)
    assert normalized(flat) == normalized(
        lorafast.scan(os.path.join(root, "broken", "headers") + "/", recursive=False), root, URL
    )


def test_inspect_urls_follow_the_local_rules(s3):
    server, root = s3
    opts = server.storage_options
    peft = lorafast.inspect(f"{URL}/long/peft", storage_options=opts)
    local = lorafast.inspect(os.path.join(root, "long", "peft"))
    assert peft.config_path == f"{URL}/long/peft/adapter_config.json"
    assert peft.modules == tuple(
        dataclasses.replace(m, weight_file=URL + m.weight_file[len(root) :]) for m in local.modules
    )
    with pytest.raises(AdapterError) as e:
        lorafast.inspect(f"{URL}/broken/headers", storage_options=opts)
    assert e.value.code == "ambiguous_adapter"
    with pytest.raises(FileNotFoundError):
        lorafast.inspect(f"{URL}/nothing/here", storage_options=opts)
    with pytest.raises(lorafast.HeaderError) as h:
        lorafast.inspect(f"{URL}/broken/headers/empty.safetensors", storage_options=opts)
    assert h.value.code == "header_too_small"


def test_pickle_weights_are_named_not_read(s3, tmp_path):
    """Remote stores are read for safetensors only; a pickle-only PEFT folder says so (locally it is read)."""
    server, _ = s3
    folder = tmp_path / "pickle-only"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.bin").write_bytes(b"x")
    server.upload("pickles", str(tmp_path))
    remote = lorafast.scan("s3://pickles/", storage_options=server.storage_options)
    assert remote.errors == [
        (
            "s3://pickles/pickle-only",
            "missing_weights",
            "adapter_model.bin is a torch pickle; remote stores are read for safetensors weights only",
        )
    ]
    assert lorafast.scan(str(tmp_path)).errors == [
        (str(folder / "adapter_model.bin"), "invalid_zip", "not a zip archive (torch.save's format)")
    ]


def test_content_hash_matches_local(s3):
    server, root = s3
    remote = lorafast.scan(f"{URL}/long", content_hash=True, storage_options=server.storage_options)
    local = lorafast.scan(os.path.join(root, "long"), content_hash=True)
    hashes = [remote.record(i)["content_hash"] for i in range(len(remote))]
    assert all(h and len(h) == 64 for h in hashes)
    assert hashes == [local.record(i)["content_hash"] for i in range(len(local))]


def test_store_failures_are_rows_with_codes(s3):
    server, _ = s3
    opts = server.storage_options
    report = lorafast.scan(
        ["s3://no-such-bucket/x/", f"{URL}/long/peft"],
        storage_options={**opts, "not_an_option": "1"},
    )
    assert [code for _, code, _ in report.errors] == ["store_config", "store_config"]
    report = lorafast.scan(["s3://no-such-bucket/x/", f"{URL}/long/peft"], storage_options=opts)
    assert len(report) == 2
    assert [p for p, _, _ in report.errors] == ["s3://no-such-bucket/x/"]
    assert report.errors[0][1] in {"not_found", "remote_error"}


def test_mixed_local_and_remote_inputs_keep_order(s3):
    server, root = s3
    inputs = [os.path.join(root, "long", "peft"), f"{URL}/long/kohya.safetensors", os.path.join(root, "broken")]
    report = lorafast.scan(inputs, storage_options=server.storage_options)
    assert report.paths[0] == inputs[0]
    assert report.paths[1] == inputs[1]
    assert report.paths[2:] == lorafast.scan(os.path.join(root, "broken")).paths


def test_index_follows_moto_etags(s3, tmp_path):
    """`lorafast.Index` on a real S3 API: rows keyed by moto's ETags; an unchanged bucket reads nothing, and a
    put, an overwrite and a delete come back as added, changed and removed (test_index_remote.py counts
    the requests on a server that logs them)."""
    from lorafast.testing import write_attention_adapter
    from test_index import same_report

    server, _ = s3
    opts = server.storage_options
    src = tmp_path / "src"
    for name in ("a", "b"):
        write_attention_adapter(src / name)
    server.upload("indexed", str(src))
    index = lorafast.Index(tmp_path / "fleet.db")
    first = index.scan("s3://indexed/", storage_options=opts)
    assert sorted(first.added) == ["s3://indexed/a", "s3://indexed/b"] and first.reads == 2
    again = index.scan("s3://indexed/", storage_options=opts)
    assert (again.added, again.changed, again.removed, again.reads) == ([], [], [], 0)

    client = server.client()
    write_attention_adapter(tmp_path / "c", r=16)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        body = (tmp_path / "c" / name).read_bytes()
        client.put_object(Bucket="indexed", Key=f"c/{name}", Body=body)  # added
        client.put_object(Bucket="indexed", Key=f"a/{name}", Body=body)  # changed
        client.delete_object(Bucket="indexed", Key=f"b/{name}")  # deleted
    got = index.scan("s3://indexed/", storage_options=opts)
    assert (got.added, got.changed, got.removed) == (["s3://indexed/c"], ["s3://indexed/a"], ["s3://indexed/b"])
    assert got.reads == 2
    same_report(got, lorafast.scan("s3://indexed/", storage_options=opts))


def test_listing_and_header_reads_share_connections(tmp_path):
    """One session per scan: the connection that listed the bucket carries the header reads after it."""
    from helpers.servers import LocalS3
    from lorafast.testing import write_attention_adapter

    for i in range(4):
        write_attention_adapter(tmp_path / "pool" / f"a{i}")
    server = LocalS3(str(tmp_path), keep_alive=True)
    try:
        report = lorafast.scan("s3://pool/", storage_options=server.storage_options, concurrency=1)
        assert not report.errors and len(report) == 4
        assert len(server.requests) == 9  # the listing, then a config and a header each
        assert "list-type" in server.requests[0][1]
        conns = server.request_connections
        # The listing's connection carries reads after it: a session of its own for the listing would never
        # send another request on it. (Not necessarily the first read: the client's pool may take the
        # listing's connection back a moment after that read has opened another one, as under load.)
        assert conns[0] in conns[1:], conns
    finally:
        server.stop()
