"""Distributed scan on a local Ray cluster (2 CPUs, loopback only) equals the local scan, errors included."""

from __future__ import annotations

import json
import os
import subprocess

# Keep Ray on 127.0.0.1 and quiet: set before Ray is imported (its constants read them then).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import lorafast
import pytest
import ray
from helpers.servers import RangeServer, build_fleet, normalized
from lorafast.cli import main as cli_main
from lorafast.scanning import distributed

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return build_fleet(str(tmp_path_factory.mktemp("ray") / "fleet"), samples=200)


def test_ray_scan_equals_local_scan(cluster, fleet):
    local = lorafast.scan(fleet)
    assert local.errors  # broken adapters are part of the comparison
    for shards in (None, 3, 1000):
        remote = distributed.scan(fleet, shards=shards)
        assert normalized(remote) == normalized(local)
        assert remote.to_json() == local.to_json()
    via_scan = lorafast.scan(fleet, backend="ray")
    assert normalized(via_scan) == normalized(local)
    # Iteration re-inspects the same adapters.
    some = os.path.join(fleet, "long")
    assert list(lorafast.scan(some, backend="ray")) == list(lorafast.scan(some))


def test_ray_scan_of_several_inputs_and_nothing(cluster, fleet, tmp_path):
    inputs = [os.path.join(fleet, "broken"), os.path.join(fleet, "long", "kohya.safetensors"), str(tmp_path / "nope")]
    assert normalized(lorafast.scan(inputs, backend="ray")) == normalized(lorafast.scan(inputs))
    empty = tmp_path / "empty"
    empty.mkdir()
    report = lorafast.scan(empty, backend="ray")
    assert len(report) == 0 and report.summary() == lorafast.scan(empty).summary()


def test_ray_scan_of_urls(cluster, fleet):
    server = RangeServer(fleet)
    try:
        urls = [f"{server.url}/ok/long/peft", f"{server.url}/ok/long/kohya.safetensors", f"{server.url}/ok/missing"]
        assert normalized(lorafast.scan(urls, backend="ray")) == normalized(lorafast.scan(urls))
    finally:
        server.stop()


def test_shard_count():
    assert distributed.shard_count(0, 2) == 1
    assert distributed.shard_count(20_000, 2) == 8
    assert distributed.shard_count(700, 16) == 2


def test_cli_backend_ray(cluster, fleet, capsys):
    code = cli_main(["scan", os.path.join(fleet, "long"), "--backend", "ray", "--json", "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["adapters"] == 2


def test_ray_listens_on_loopback_only(cluster):
    try:
        listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("ss is not available")
    ray_lines = [line for line in listing.splitlines() if any(n in line for n in ("raylet", "gcs_server", "ray::"))]
    assert ray_lines, listing
    for line in ray_lines:
        local = line.split()[3]
        assert local.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")), line
