"""read_base and check on bases in an object store (moto's S3 server on 127.0.0.1), through the Rust remote layer
(`_core.read_url_range`): a sharded checkpoint (index, shards, config.json), a single file, a pipeline folder, and
the bad inputs, each naming the object."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from lorafast.base import BaseModelError, read_base
from lorafast.checker import check
from lorafast.errors import HeaderError
from lorafast.testing import write_safetensors

pytestmark = pytest.mark.slow

servers = pytest.importorskip("helpers.servers")
pytest.importorskip("moto")
pytest.importorskip("boto3")
cf = pytest.importorskip("helpers.check_fixtures")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

BUCKET = "bases"


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("bases")
    torch.manual_seed(0)
    site = root / "site"
    llama = cf.make_llama(site / "llama")
    cf.make_llava(site / "llava")
    adapter = cf.peft_adapter(llama, root / "a_llama", ["q_proj", "v_proj"])
    (site / "single").mkdir()
    write_safetensors(site / "single" / "model.safetensors", {"lin.weight": ("F32", (8, 8))})
    # the adapter's module paths, at widths it does not fit: a shape mismatch
    (site / "wide").mkdir()
    write_safetensors(site / "wide" / "model.safetensors",
                      {f"model.layers.{i}.self_attn.{m}.weight": ("F32", (48, 48)) for i in (0, 1)
                       for m in ("q_proj", "v_proj")})  # fmt: skip
    # bad bases: a missing shard, a shard with a broken header, a folder without config.json
    shutil.copytree(site / "llama", site / "no_shard")
    index = json.loads((site / "no_shard" / "model.safetensors.index.json").read_text())
    os.unlink(site / "no_shard" / sorted(set(index["weight_map"].values()))[0])
    shutil.copytree(site / "llama", site / "bad_shard")
    shard = site / "bad_shard" / sorted(set(index["weight_map"].values()))[-1]
    shard.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    shutil.copytree(site / "llama", site / "no_config")
    os.unlink(site / "no_config" / "config.json")
    server = servers.MotoS3()
    try:
        server.upload(BUCKET, str(site))
        yield {"server": server, "site": site, "adapter": adapter}
    finally:
        server.stop()


def _same(remote: Any, local: Any) -> None:
    assert remote.kind == local.kind
    assert list(remote.weights) == list(local.weights)
    assert [(w.dtype, w.shape, w.quantized) for w in remote.weights.values()] == [
        (w.dtype, w.shape, w.quantized) for w in local.weights.values()
    ]
    assert remote.config == local.config and remote.architecture == local.architecture


def test_sharded_bases_read_from_s3_equal_local(bucket: Any) -> None:
    opts, site = bucket["server"].storage_options, bucket["site"]
    for name in ("llama", "llava"):
        remote = read_base(f"s3://{BUCKET}/{name}", storage_options=opts, timeout=10)
        assert remote.kind == "sharded" and len(remote.files) > 1  # the index and several shards, over s3
        assert all(f.startswith(f"s3://{BUCKET}/{name}/") for f in remote.files)
        _same(remote, read_base(site / name))
    # the index file named directly, and a single file
    idx = read_base(f"s3://{BUCKET}/llama/model.safetensors.index.json", storage_options=opts)
    _same(idx, read_base(site / "llama"))
    one = read_base(f"s3://{BUCKET}/single/model.safetensors", storage_options=opts)
    assert one.kind == "checkpoint" and one.weights["lin.weight"].shape == (8, 8) and one.config is None


def test_check_against_s3_bases(bucket: Any) -> None:
    opts = bucket["server"].storage_options
    bases = [f"s3://{BUCKET}/llama", f"s3://{BUCKET}/llava"]
    report = check(bucket["adapter"], bases, storage_options=opts)
    ok, wrapper = list(report)
    assert ok.verdict == "ok" and ok.matched == 4
    assert wrapper.verdict == "no_match" and "'model.language_model.'" in (wrapper.hint or "")  # the prefix case


def test_cli_check_against_s3_bases(bucket: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    opts = [f"--storage-option={k}={v}" for k, v in bucket["server"].storage_options.items()]
    adapter = str(bucket["adapter"])
    assert main(["check", "--base", f"s3://{BUCKET}/llama", adapter, *opts, "--timeout", "10"]) == 0
    assert capsys.readouterr().out.startswith("ok ")
    rc = main(["check", "--base", f"s3://{BUCKET}/wide/model.safetensors", adapter, *opts, "--json"])
    cap = capsys.readouterr()
    assert rc == 1, cap
    assert json.loads(cap.out)["pairs"][0]["verdict"] == "shape_mismatch", cap
    assert main(["check", "--base", f"s3://{BUCKET}/llava", adapter, *opts]) == 1
    assert capsys.readouterr().out.startswith("no_match ")
    # a store that cannot be reached (the last endpoint given wins): the remote code, naming the object, exit 1
    assert main(["check", "--base", f"s3://{BUCKET}/llama", adapter, *opts,
                 "--storage-option", "endpoint=http://127.0.0.1:9", "--timeout", "2"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "[connection_error]" in err and f"s3://{BUCKET}/llama/" in err
    # malformed options and timeouts are usage errors, exit 2, parsed as `scan` parses them
    for bad in (["--storage-option", "endpoint"], ["--storage-option", "=x"], ["--timeout", "0"],
                ["--timeout", "nan"]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(["check", "--base", f"s3://{BUCKET}/llama", adapter, *bad])
        assert e.value.code == 2
        assert "expected KEY=VALUE" in capsys.readouterr().err or bad[0] == "--timeout"


def test_bad_s3_bases_name_the_object(bucket: Any) -> None:
    opts = bucket["server"].storage_options
    url = f"s3://{BUCKET}"
    with pytest.raises(FileNotFoundError):
        read_base(f"{url}/nothing-here.safetensors", storage_options=opts)
    with pytest.raises(BaseModelError) as e:
        read_base(f"{url}/no_shard", storage_options=opts)
    assert e.value.code == "missing_shard" and str(e.value.path).startswith(f"{url}/no_shard/")
    with pytest.raises(HeaderError) as h:
        read_base(f"{url}/bad_shard", storage_options=opts)
    assert f"{url}/bad_shard/" in str(h.value)
    with pytest.raises(BaseModelError) as e:
        read_base(f"{url}/no_config", storage_options=opts)
    assert e.value.code == "missing_config" and f"{url}/no_config" in str(e.value)
    # a store that cannot be reached: the remote layer's code, naming the object
    with pytest.raises(BaseModelError) as e:
        read_base(f"{url}/llama", storage_options={**opts, "endpoint": "http://127.0.0.1:9"}, timeout=2)
    assert e.value.code == "connection_error" and f"{url}/llama/" in str(e.value)


def test_unknown_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BaseModelError) as e:
        read_base("ftp://host/model.safetensors")
    assert e.value.code == "unsupported_url" and "s3://" in str(e.value)
