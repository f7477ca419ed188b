"""read_base (and check, and scan where it shares the case) against servers that misbehave, on loopback: response
headers or bodies that never end, answers dripped a byte at a time, lying `Content-Range`s, redirects to another
host (127.0.0.2) that must not get the credentials, JSON nested 100,000 deep, and indexes naming shards outside the
model folder. Each ends, within the timeout, in an error that names the URL and the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lorafast
import pytest
from helpers.servers import HostileServer
from lorafast.base import BaseModelError, read_base
from lorafast.errors import HeaderError
from lorafast.testing import write_attention_adapter, write_safetensors

NESTED = "[" * 100_000
#: The linear weight every test base holds.
WEIGHTS = {"model.layers.0.self_attn.q_proj.weight": ("F32", (32, 32))}


def _checkpoint(folder: Path, config: str = '{"architectures": ["LlamaForCausalLM"]}') -> None:
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", WEIGHTS)
    (folder / "config.json").write_text(config)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("hostile")
    _checkpoint(root / "base")
    _checkpoint(root / "org" / "repo")
    _checkpoint(root / "nested", config=NESTED)
    (root / "nested_index").mkdir()
    (root / "nested_index" / "model.safetensors.index.json").write_text('{"weight_map": ' + NESTED)
    (root / "nested_pipeline").mkdir()
    (root / "nested_pipeline" / "model_index.json").write_text(NESTED)
    # a shard whose safetensors header nests deeply in its metadata
    (root / "nested_header").mkdir()
    header = b'{"__metadata__": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    (root / "nested_header" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (root / "nested_header" / "config.json").write_text("{}")
    write_attention_adapter(root / "adapter")
    (root / "org" / "repo" / "peft").symlink_to(root / "adapter")  # an adapter in the Hub repo
    far = HostileServer(str(root), host="127.0.0.2")  # another host, for a client
    near = HostileServer(str(root), redirect_to=far.url)
    try:
        yield {"root": root, "near": near, "far": far}
    finally:
        near.stop()
        far.stop()


def _in_child(site: Any, mode: str) -> dict[str, Any]:
    """read_base and scan of `/{mode}/...` in a fresh process held to 3 GiB of address space: the error each ends
    with, and the process's peak resident memory (a client that buffers an endless body would run out)."""
    code = textwrap.dedent(f"""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        import lorafast
        from lorafast.base import read_base
        out = {{}}
        try:
            read_base({site["near"].url + "/" + mode + "/base"!r}, timeout=3)
            out["base"] = None
        except Exception as e:
            out["base"] = [type(e).__name__, getattr(e, "code", None), str(e)]
        report = lorafast.scan([{site["near"].url + "/" + mode + "/adapter"!r}], timeout=3)
        out["scan"] = [list(e) for e in report.errors]
        # VmHWM is this process's own peak: ru_maxrss keeps the parent's at fork across exec (here the whole
        # test session's, about 1 GB once every test module is imported).
        hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        out["peak_mb"] = int(hwm.split()[1]) >> 10
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["endless_headers", "endless_body", "endless_range", "overlong"])
def test_endless_answers_end_in_bounded_memory(site: Any, mode: str) -> None:
    """Response headers that never end, a 200 of zeros with no length, a 206 with no length, and a 206 whose
    Content-Length (2**40) runs past its Content-Range: each is a `remote_error`, for read_base and scan alike,
    and the client never holds the flood (the scan path buffered ~2 GB in 3 s of an overlong body)."""
    out = _in_child(site, mode)
    kind, code, message = out["base"]
    assert (kind, code) == ("BaseModelError", "remote_error")
    assert f"{site['near'].url}/{mode}/base/" in message
    [(path, scan_code, _)] = out["scan"]
    assert scan_code == "remote_error" and path.startswith(f"{site['near'].url}/{mode}/adapter")
    assert out["peak_mb"] < 1024, out


@pytest.mark.timeout(60)
def test_dripped_answer_times_out(site: Any) -> None:
    """One byte every 0.5 s keeps every socket read short: the timeout bounds the whole request."""
    url = f"{site['near'].url}/drip/base"
    with pytest.raises(BaseModelError) as e:
        read_base(url, timeout=1)
    assert e.value.code == "timeout" and url in str(e.value) and "timeout" in str(e.value)
    report = lorafast.scan([f"{site['near'].url}/drip/adapter"], timeout=1)
    assert [code for _, code, _ in report.errors] == ["timeout"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "error", "code", "says"),
    [
        ("star", BaseModelError, "remote_error", "bytes 0-0/*"),  # of unknown size
        ("shifted", BaseModelError, "remote_error", "Requested 0..1, got 1..2"),  # another range than asked for
        ("huge", HeaderError, "incomplete_buffer", "1152921504606846"),  # a total of 2**60: no temporary file
    ],
)
def test_lying_content_range_is_a_clear_error(site: Any, mode: str, error: Any, code: str, says: str) -> None:
    url = f"{site['near'].url}/{mode}/base"
    with pytest.raises(error) as e:
        read_base(url, timeout=5)
    assert e.value.code == code and says in str(e.value)
    assert str(e.value).startswith(f"{url}/model.safetensors") and e.value.path == f"{url}/model.safetensors"
    # scan's reading of a weights file: the same answer
    report = lorafast.scan([f"{site['near'].url}/{mode}/adapter/adapter_model.safetensors"], timeout=5)
    assert len(report.errors) == 1 and report.errors[0][1] in ("remote_error", "incomplete_buffer")


def _credentials(server: HostileServer) -> list[tuple[str, str, str]]:
    """(path, header, value) of every credential header the server received."""
    names = ("authorization", "x-api-key", "cookie")
    return [(p, k.lower(), v) for p, h in server.seen_headers for k, v in h.items() if k.lower() in names]


@pytest.mark.timeout(60)
def test_hub_token_never_reaches_the_host_a_redirect_names(site: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub answers resolve URLs with redirects to other hosts. Here the redirect goes to 127.0.0.2, which
    redirects again within itself (the chain that made reqwest re-send the token there): the token goes to the
    endpoint only, for read_base, check and scan, from `storage_options` and from HF_TOKEN."""
    near, far = site["near"], site["far"]
    near.clear(), far.clear()
    monkeypatch.setenv("HF_ENDPOINT", f"{near.url}/redirect/hf")
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    base = read_base("hf://org/repo@v2", storage_options={"token": "hf_from_options"}, timeout=5)
    assert base.kind == "checkpoint" and list(base.weights) == list(WEIGHTS)
    assert base.files == ("hf://org/repo@v2/model.safetensors",)
    assert all("/resolve/v2/" in p for p, _ in near.seen_headers)  # the revision is kept
    assert read_base("hf://org/repo", timeout=5).kind == "checkpoint"  # the token from HF_TOKEN
    report = lorafast.check(str(site["root"] / "adapter"), "hf://org/repo", timeout=5)
    assert len(list(report)) == 1
    assert not lorafast.scan(["hf://org/repo/peft"], timeout=5).errors
    sent = {v for _, _, v in _credentials(near)}
    assert sent == {"Bearer hf_from_options", "Bearer hf_from_env"}  # sent where they belong ...
    assert _credentials(far) == [] and len(far.seen_headers) > 10  # ... and nowhere else


@pytest.mark.timeout(60)
def test_storage_option_headers_stay_on_their_origin(site: Any) -> None:
    near, far = site["near"], site["far"]
    near.clear(), far.clear()
    headers = {"Authorization": "Bearer secret", "X-Api-Key": "k", "Cookie": "session=1"}
    base = read_base(f"{near.url}/redirect/base", storage_options={"headers": headers}, timeout=5)
    assert base.kind == "checkpoint" and base.config == {"architectures": ["LlamaForCausalLM"]}
    got = {(k, v) for p, k, v in _credentials(near) if p.startswith("/redirect/base/")}
    assert got == {(k.lower(), v) for k, v in headers.items()}
    report = lorafast.scan([f"{near.url}/redirect/adapter"], storage_options={"headers": headers}, timeout=5)
    assert not report.errors
    assert _credentials(far) == [] and any(p.startswith("/ok/adapter/") for p, _ in far.seen_headers)


@pytest.mark.timeout(60)
def test_redirect_loops_end(site: Any) -> None:
    url = f"{site['near'].url}/loop/base"
    for options, says in [(None, "too many redirects"), ({"token": "t", "headers": {"X-A": "1"}}, "more than 10")]:
        with pytest.raises(BaseModelError) as e:
            read_base(url, storage_options=options, timeout=5)
        assert e.value.code == "remote_error" and says in str(e.value) and url in str(e.value)


def test_bad_credential_options_are_store_config_errors(site: Any) -> None:
    url = f"{site['near'].url}/ok/base"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"headers": "not json"}, "expected a JSON object"),
        ({"headers": {"bad name": "x"}}, "bad header name"),
        ({"headers": {"X-A": "x"}, "pool_max_idle_per_host": "2"}, "pool_max_idle_per_host is not supported"),
    ]
    for options, says in cases:
        with pytest.raises(BaseModelError) as e:
            read_base(url, storage_options=options, timeout=5)
        assert e.value.code == "store_config" and says in str(e.value) and url in str(e.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("folder", "code", "file"),
    [
        ("nested", "bad_config", "config.json"),
        ("nested_index", "bad_index", "model.safetensors.index.json"),
        ("nested_pipeline", "bad_config", "model_index.json"),
    ],
)
def test_deeply_nested_json_is_a_base_model_error(site: Any, folder: str, code: str, file: str) -> None:
    """`[` x 100,000 overflowed json's recursion (a raw RecursionError): now the file's error, local and remote."""
    for where in (str(site["root"] / folder), f"{site['near'].url}/ok/{folder}"):
        with pytest.raises(BaseModelError) as e:
            read_base(where, timeout=5)
        assert e.value.code == code and str(e.value).startswith(f"{where}/{file} is not valid JSON")
    with pytest.raises(BaseModelError):
        lorafast.check(str(site["root"] / "adapter"), str(site["root"] / folder))


def test_deeply_nested_header_json_is_a_header_error(site: Any) -> None:
    for where in (str(site["root"] / "nested_header"), f"{site['near'].url}/ok/nested_header"):
        with pytest.raises(HeaderError) as e:
            read_base(where, timeout=5)
        assert e.value.path == f"{where}/model.safetensors"


def test_cli_check_reports_a_nested_config(site: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    assert main(["check", "--base", f"{site['near'].url}/ok/nested", str(site["root"] / "adapter")]) == 1
    assert "config.json is not valid JSON" in capsys.readouterr().err


@pytest.fixture(scope="module")
def outside(site: Any) -> Path:
    """A sharded base whose index names a shard beside its folder and one by absolute path, and a pipeline with a
    component outside its folder."""
    root = site["root"] / "outside"
    (root / "model").mkdir(parents=True)
    write_safetensors(root / "beside.safetensors", {"a.weight": ("F32", (4, 4))})
    write_safetensors(root / "model" / "inside.safetensors", {"b.weight": ("F32", (4, 4))})
    (root / "model" / "config.json").write_text("{}")
    weight_map = {"a.weight": "../beside.safetensors", "b.weight": "inside.safetensors"}
    (root / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / "absolute").mkdir()
    (root / "absolute" / "config.json").write_text("{}")
    index = {"weight_map": {"a.weight": str(root / "beside.safetensors")}}
    (root / "absolute" / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "pipe").mkdir()
    (root / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "P", "../model": ["diffusers", "X"]}))
    return root


def test_index_naming_shards_outside_the_folder(site: Any, outside: Path) -> None:
    """Read by default, as transformers reads them; refused with `allow_outside_shards=False`, naming the shard."""
    remote = f"{site['near'].url}/ok/outside"
    for where in (str(outside), remote):
        base = read_base(f"{where}/model")
        assert set(base.weights) == {"a.weight", "b.weight"} and base.weights["a.weight"].shape == (4, 4)
        with pytest.raises(BaseModelError) as e:
            read_base(f"{where}/model", allow_outside_shards=False)
        assert e.value.code == "bad_index" and "'../beside.safetensors'" in str(e.value)
        assert e.value.path == f"{where}/model/model.safetensors.index.json"
        assert read_base(f"{where}/pipe").components.keys() == {"../model"}
        with pytest.raises(BaseModelError, match=r"component folder outside .*'\.\./model'"):
            read_base(f"{where}/pipe", allow_outside_shards=False)
    assert read_base(outside / "absolute").weights["a.weight"].file == str(outside / "beside.safetensors")
    with pytest.raises(BaseModelError, match="names a shard outside") as e:
        read_base(outside / "absolute", allow_outside_shards=False)
    assert str(outside / "beside.safetensors") in str(e.value)


def test_check_refuses_outside_shards_when_asked(outside: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "a"
    adapter.mkdir()
    write_safetensors(adapter / "adapter_model.safetensors", {"base_model.model.a.lora_A.weight": ("F32", (2, 4)),
                                                               "base_model.model.a.lora_B.weight": ("F32", (4, 2))})  # fmt: skip
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "target_modules": ["a"]}))
    assert lorafast.check([adapter], outside / "model").summary()["pairs"] == 1
    with pytest.raises(BaseModelError, match="'../beside.safetensors'"):
        lorafast.check([adapter], outside / "model", allow_outside_shards=False)
