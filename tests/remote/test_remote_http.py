"""http(s):// and hf:// inputs against a loopback server: range requests, and servers that misbehave."""

from __future__ import annotations

import json
import os

import lorafast
import lorafast.testing
import pytest
from helpers.servers import (
    FIRST_GUESS_BYTES,
    SPECULATIVE_BYTES,
    RangeServer,
    build_fleet,
    long_kohya,
    long_peft,
    normalized,
)
from lorafast.errors import AdapterError
from lorafast.testing import write_attention_adapter


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("http") / "site")
    build_fleet(root, samples=40)
    hf_repo = os.path.join(root, "org", "repo")
    long_peft(os.path.join(hf_repo, "peft"))
    long_kohya(os.path.join(hf_repo, "kohya.safetensors"))
    server = RangeServer(root, delay=2.0)
    try:
        yield server, root
    finally:
        server.stop()


def _inputs(root: str) -> list[str]:
    """The fleet's files and PEFT folders (web servers cannot be listed, so one-file folders are left out)."""
    paths = lorafast.scan(root).paths
    return [p for p in paths if p.endswith(".safetensors") or os.path.exists(os.path.join(p, "adapter_config.json"))]


def test_http_scan_equals_local_scan_with_range_requests_only(site):
    server, root = site
    inputs = _inputs(root)
    urls = [f"{server.url}/ok" + p[len(root) :] for p in inputs]
    server.clear()
    remote = lorafast.scan(urls)  # plain http:// needs no options
    local = lorafast.scan(inputs)
    assert len(local) > 40
    assert normalized(remote) == normalized(local, root, f"{server.url}/ok")
    gets = [(path, rng) for method, path, rng in server.requests if method == "GET"]
    assert gets and all(rng is not None for _, rng in gets)  # never a whole object
    by_path: dict[str, list[str]] = {}
    for path, rng in gets:
        by_path.setdefault(path, []).append(rng)

    # One speculative range per weights file, from its start and at most 64 KiB (fewer once the store's
    # headers are known to be short); a second one, from where it ended, only for a header longer than it.
    def first_then_rest(ranges: list[str]) -> bool:
        first_end = int(ranges[0].removeprefix("bytes=0-"))
        rest_ok = all(r.startswith(f"bytes={first_end + 1}-") for r in ranges[1:])
        return first_end < SPECULATIVE_BYTES and len(ranges) <= 2 and rest_ok

    long_file = "/ok/long/peft/adapter_model.safetensors"
    assert len(by_path[long_file]) == 2 and first_then_rest(by_path[long_file])
    dense = [p for p in by_path if "peft_dense" in p and p.endswith(".safetensors")]
    assert len(dense) > 5 and all(first_then_rest(by_path[p]) for p in dense)
    # kohya alphas: range requests past the header (two requests) for the scalars' bytes.
    assert len(by_path["/ok/long/kohya.safetensors"]) >= 3


def test_first_read_shrinks_to_the_headers_seen(tmp_path):
    """After the first answer, a store of short headers is read in small first ranges, one request each."""
    for i in range(6):
        lorafast.testing.write_safetensors(
            tmp_path / f"a{i}.safetensors",
            {f"m.layers.{j}.q_proj.lora_{ab}.weight": ("F32", (4, 4096)) for j in range(3) for ab in "AB"},
        )
    server = RangeServer(str(tmp_path))
    try:
        urls = [f"{server.url}/ok/a{i}.safetensors" for i in range(6)]
        report = lorafast.scan(urls, concurrency=1)
        assert not report.errors and len(report) == 6
        assert normalized(report, f"{server.url}/ok", str(tmp_path)) == normalized(lorafast.scan(
            [str(tmp_path / f"a{i}.safetensors") for i in range(6)]))  # fmt: skip
        ranges = [rng for method, _, rng in server.requests if method == "GET"]
        assert ranges == [f"bytes=0-{FIRST_GUESS_BYTES - 1}"] + ["bytes=0-4095"] * 5
    finally:
        server.stop()


def test_server_that_ignores_range_still_gives_the_same_result(site):
    server, root = site
    inputs = [os.path.join(root, "long", "peft"), os.path.join(root, "long", "kohya.safetensors")]
    remote = lorafast.scan([f"{server.url}/norange" + p[len(root) :] for p in inputs])
    assert normalized(remote) == normalized(lorafast.scan(inputs), root, f"{server.url}/norange")


def test_requests_fill_the_concurrency_from_the_start(tmp_path):
    """Every slot is used at once, on one server, with no serialisation per folder: with each answer held
    0.3 s, the server sees exactly `concurrency` requests at a time (PEFT folders' configs and headers both)."""
    root = tmp_path / "site"
    for i in range(6):
        write_attention_adapter(root / f"a{i}")
    server = RangeServer(str(root), delay=0.3)
    try:
        report = lorafast.scan([f"{server.url}/slow/a{i}" for i in range(6)], concurrency=5)
        assert not report.errors and len(report) == 6
        assert server.peak == 5
        assert len(server.requests) == 12  # one config and one header read each
    finally:
        server.stop()


def test_truncated_short_and_lying_bodies_give_clear_errors(site):
    server, root = site
    path = "/long/kohya.safetensors"
    report = lorafast.scan([f"{server.url}/{mode}{path}" for mode in ("truncate", "short", "lie")])
    assert [code for _, code, _ in report.errors] == ["short_read", "short_read", "invalid_header_length"]
    assert "16-byte file" in report.errors[2][2]
    with pytest.raises(AdapterError) as e:
        lorafast.inspect(f"{server.url}/short{path}")
    assert e.value.code == "short_read"


def test_stalled_server_times_out_and_is_given_up(site):
    server, root = site
    files = sorted(p for p in os.listdir(os.path.join(root, "broken", "headers")))[:8]
    urls = [f"{server.url}/slow/broken/headers/{name}" for name in files]
    report = lorafast.scan(urls, timeout=0.3, concurrency=1)
    assert [code for _, code, _ in report.errors] == ["timeout"] * len(urls)
    messages = [m for _, _, m in report.errors]
    assert "timeout" in messages[0]
    # After a few timeouts in a row the server is skipped instead of waited for.
    assert messages[-1].startswith("skipped: this server timed out")


def test_transient_failures_are_retried(site):
    server, root = site
    inputs = [os.path.join(root, "long", "peft"), os.path.join(root, "long", "kohya.safetensors")]
    server.clear()
    remote = lorafast.scan([f"{server.url}/flaky" + p[len(root) :] for p in inputs])
    assert remote.errors == []
    assert normalized(remote) == normalized(lorafast.scan(inputs), root, f"{server.url}/flaky")
    statuses = [path for method, path, _ in server.requests if path.endswith("kohya.safetensors")]
    assert len(statuses) >= 3  # 503, dropped connection, then the answer


def test_hf_urls_map_to_resolve_urls(site, monkeypatch):
    server, root = site
    monkeypatch.setenv("HF_ENDPOINT", f"{server.url}/hf")
    repo = os.path.join(root, "org", "repo")
    remote = lorafast.scan(["hf://org/repo/peft", "hf://org/repo@main/kohya.safetensors"])
    local = lorafast.scan([os.path.join(repo, "peft"), os.path.join(repo, "kohya.safetensors")])
    assert normalized(remote, "hf://org/repo@main", "hf://org/repo") == normalized(local, repo, "hf://org/repo")
    adapter = lorafast.inspect("hf://org/repo/kohya.safetensors")
    assert adapter.format == lorafast.inspect(os.path.join(repo, "kohya.safetensors")).format
    # Web folders cannot be listed: a folder without adapter_config.json is reported clearly.
    with pytest.raises(FileNotFoundError, match="cannot be listed"):
        lorafast.inspect("hf://org/repo")


def test_hub_repos_share_one_connection_pool(tmp_path, monkeypatch):
    """hf:// URLs of many repos go through one store: with one request at a time on a keep-alive server, a
    fleet spread over six repos reuses connections across repos (a store per repo would open six)."""
    root = tmp_path / "hub"
    for i in range(6):
        write_attention_adapter(root / "org" / f"repo{i}")
    server = RangeServer(str(root), keep_alive=True)
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"{server.url}/hf")
        report = lorafast.scan([f"hf://org/repo{i}" for i in range(6)], concurrency=1)
        assert not report.errors and len(report) == 6
        assert len(server.requests) == 24  # config and header, each a redirect and its answer
        assert server.connections < 6
    finally:
        server.stop()


def test_bad_urls_and_options(site):
    server, _ = site
    report = lorafast.scan(["hf://only-org", f"{server.url}/ok/x.safetensors?sig=1", f"{server.url}/ok/missing"])
    assert [code for _, code, _ in report.errors] == ["invalid_url", "invalid_url", "not_found"]
    with pytest.raises(ValueError, match="timeout"):
        lorafast.scan([f"{server.url}/ok/x.safetensors"], timeout=0)


def test_cli_scan_takes_urls_timeout_and_storage_options(site, capsys):
    from lorafast.cli import main as cli_main

    server, _ = site
    url = f"{server.url}/ok/long/peft"
    assert cli_main(["scan", url, "--json", "--quiet", "--timeout", "5", "--storage-option", "allow_http=true"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["adapters"][0]["path"] == url and out["summary"]["ok"] == 1
    assert cli_main(["scan", f"{server.url}/slow/long/peft", "--timeout", "0.2", "--quiet"]) == 1
    assert "timeout" in capsys.readouterr().out
