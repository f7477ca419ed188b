"""Streaming checkpoint merges (`merge_file`, `lorafast merge`), bounded memory, and truncated files (SIGBUS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.bits import bits
from lorafast.cli import main as run_cli
from lorafast.errors import HeaderError
from lorafast.merging import MergeError, merge, merge_file
from lorafast.tensors import TensorFile
from lorafast.testing import write_peft_adapter
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]


def make_base(path: Path, gen: torch.Generator) -> dict[str, torch.Tensor]:
    sd = {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=gen).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=gen).bfloat16(),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(16, 32, generator=gen).half(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 80, generator=gen),
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 24, 32, generator=gen).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(32).bfloat16(),
        "model.step": torch.tensor([7], dtype=torch.int64),
    }
    save_file(sd, str(path), metadata={"format": "pt", "origin": "test"})
    return sd


def make_adapter(folder: Path, gen: torch.Generator, r: int = 4, alpha: int = 8, nan: bool = False) -> Path:
    t = {}
    for name, (out, inp) in {
        "self_attn.q_proj": (32, 32),
        "self_attn.v_proj": (16, 32),
        "mlp.down_proj": (32, 80),
    }.items():
        t[f"base_model.model.model.layers.0.{name}.lora_A.weight"] = torch.randn(r, inp, generator=gen) * 0.1
        t[f"base_model.model.model.layers.0.{name}.lora_B.weight"] = torch.randn(out, r, generator=gen) * 0.1
    t["base_model.model.model.layers.0.mlp.experts.gate_up_proj.lora_A.weight"] = torch.randn(1, r, 32, generator=gen)
    t["base_model.model.model.layers.0.mlp.experts.gate_up_proj.lora_B.weight"] = torch.randn(4, 24, r, generator=gen)
    if nan:
        t["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"][0, 0] = float("nan")
    targets = ["q_proj", "v_proj", "down_proj"]
    return Path(write_peft_adapter(folder, t, r=r, lora_alpha=alpha, target_modules=targets))


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    base = tmp_path / "base.safetensors"
    sd = make_base(base, gen)
    return base, make_adapter(tmp_path / "a", gen), make_adapter(tmp_path / "b", gen, r=2, alpha=2), sd


def test_merge_file_matches_in_place_merge(files, tmp_path: Path) -> None:
    base, a, b, sd = files
    out = tmp_path / "merged.safetensors"
    summary = merge_file(base, [(a, 0.7), (b, -0.4)], out, chunk_bytes=4096)
    assert summary["targets"] == 4 and summary["tensors"] == len(sd) and summary["terms"] == 8
    assert 0 < summary["peak_workspace_bytes"] <= 4096
    merged = load_file(str(out))
    expected = {k: v.clone() for k, v in sd.items()}
    merge(expected, [(a, 0.7), (b, -0.4)])
    assert list(merged) == list(load_file(str(base)))  # same tensors, same order
    for k, v in merged.items():
        assert v.dtype == sd[k].dtype and v.shape == sd[k].shape
        if k in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.step"):
            assert torch.equal(bits(v) if v.is_floating_point() else v, bits(sd[k]) if v.is_floating_point() else sd[k])
        else:
            assert not torch.equal(v, sd[k]), k
            # same kernel, same math; block boundaries may differ, so allow one ulp
            diff = (v.double() - expected[k].double()).abs()
            assert bool((diff <= expected[k].double().abs() * 2.0**-7 + 1e-6).all()), k
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["origin"] == "test"
    assert [x["strength"] for x in json.loads(meta["lorafast.merged"])] == [0.7, -0.4]


def test_failure_leaves_no_output_and_keeps_an_existing_one(files, tmp_path: Path) -> None:
    base, a, _, _ = files
    bad = make_adapter(tmp_path / "bad", torch.Generator().manual_seed(1), nan=True)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous")
    with pytest.raises(MergeError) as ei:
        merge_file(base, [(a, 1.0), (bad, 1.0)], out)
    assert ei.value.code == "non_finite" and ei.value.adapter == "bad"
    assert ei.value.module == "model.layers.0.mlp.down_proj"
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "bad", "base.safetensors", "out.safetensors"]


def test_base_truncated_while_streaming_gives_an_error(files, tmp_path: Path) -> None:
    base, a, _, _ = files
    out = tmp_path / "out.safetensors"
    size = base.stat().st_size

    def truncate_after_first(done: int, total: int) -> None:
        if done and base.stat().st_size == size:
            os.truncate(base, size // 3)

    with pytest.raises(MergeError) as ei:
        merge_file(base, [(a, 1.0)], out, progress=truncate_after_first, chunk_bytes=1024)
    assert ei.value.code == "read_error" and "truncated" in str(ei.value)
    assert not out.exists()


def test_adapter_truncated_half_way_restores_weights(files) -> None:
    _, a, _, sd = files
    original = {k: v.clone() for k, v in sd.items()}
    f = a / "adapter_model.safetensors"

    def truncate(done: int, total: int) -> None:
        if f.stat().st_size > 100:
            os.truncate(f, 100)

    with pytest.raises(MergeError) as ei:
        merge(sd, [(a, 1.0)], progress=truncate)
    assert ei.value.code == "read_error" and "truncated" in str(ei.value) and ei.value.adapter == "a"
    for k in sd:
        assert torch.equal(
            bits(sd[k]) if sd[k].is_floating_point() else sd[k],
            bits(original[k]) if sd[k].is_floating_point() else original[k],
        )


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )


def test_truncated_after_mapping_guard_and_residual_sigbus(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    save_file({"first": torch.zeros(16), "last": torch.ones(256 * 1024)}, str(path))  # 1 MiB, many pages
    guarded = _child(f"""
        import os
        from lorafast.tensors import TensorFile, TruncatedFileError
        tf = TensorFile({str(path)!r})
        tf.load("first")                      # the file is now mapped
        os.truncate({str(path)!r}, 4096)
        try:
            tf.load("last")
        except TruncatedFileError as exc:
            print("clean:", exc)
    """)
    assert guarded.returncode == 0, guarded.stderr
    assert "clean:" in guarded.stdout and "truncated" in guarded.stdout

    save_file({"first": torch.zeros(16), "last": torch.ones(256 * 1024)}, str(path))
    raced = _child(f"""
        import faulthandler, os, torch
        faulthandler.enable()
        from lorafast.tensors import TensorFile
        tf = TensorFile({str(path)!r})
        view = tf.view("last")                # check passed, map handed out...
        os.truncate({str(path)!r}, 4096)      # ...then the file shrinks under it (the race the guard cannot close)
        print(float(view[-1]))
    """)
    # The child dies of SIGBUS; this process (the test runner) is unaffected and sees the signal.
    assert raced.returncode == -signal.SIGBUS, (raced.returncode, raced.stderr[-500:])
    assert "Bus error" in raced.stderr


def test_tensor_file_reads(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file(
        {
            "a": torch.arange(6, dtype=torch.float32).view(2, 3),
            "s": torch.tensor(2.5),
            "e": torch.zeros(0, 4),
            "h": torch.arange(4).half(),
        },
        str(path),
    )
    with TensorFile(path) as tf:
        v = tf.view("a")
        assert v.shape == (2, 3) and v.tolist() == [[0, 1, 2], [3, 4, 5]]
        assert tf.load_scalar("s") == 2.5 and tf.view("e").shape == (0, 4)
        assert tf.load("h", dtype=torch.float32).tolist() == [0, 1, 2, 3]
        out = torch.empty(2, dtype=torch.float32)
        tf.read_into("a", out, start=3)
        assert out.tolist() == [3, 4]
        with pytest.raises(Exception, match="no tensor"):
            tf.view("missing")
    os.truncate(path, 50)
    # the core validates the header for merge as for a scan: the same exception, with the rule's code
    with pytest.raises(HeaderError) as refused:
        TensorFile(path)
    assert refused.value.code == "invalid_header_length" and refused.value.path == str(path)


def test_workspace_memory_is_bounded(tmp_path: Path) -> None:
    """Peak RSS grows by far less than the weight (64 MiB fp32 would be 128 MiB of work space)."""
    base = tmp_path / "big.safetensors"
    save_file({"big.weight": torch.randn(4096, 4096).bfloat16()}, str(base))  # 32 MiB
    ad = tmp_path / "ad"
    write_peft_adapter(
        ad,
        {
            "base_model.model.big.lora_A.weight": torch.randn(8, 4096),
            "base_model.model.big.lora_B.weight": torch.randn(4096, 8),
        },
        r=8,
        lora_alpha=8,
        target_modules=None,
    )
    res = _child(f"""
        import resource, torch
        from lorafast.merging import merge, merge_file
        from lorafast.tensors import TensorFile
        def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with TensorFile({str(base)!r}) as tf:
            w = tf.load("big.weight")         # the model, resident
        small = {{"big.weight": torch.zeros(8, 4096).bfloat16()}}
        before = peak()
        merge_file({str(base)!r}, [({str(ad)!r}, 1.0)], {str(tmp_path / "out.safetensors")!r}, chunk_bytes=1 << 20)
        stream = peak() - before
        before = peak()
        h = merge({{"big.weight": w}}, [({str(ad)!r}, 1.0)], snapshot="subtract", chunk_bytes=1 << 20)
        inplace = peak() - before
        print(stream, inplace, h.peak_workspace_bytes)
    """)
    assert res.returncode == 0, res.stderr
    stream, inplace, ws = (int(x) for x in res.stdout.split())
    assert ws <= 1 << 20
    assert stream < 16 << 20 and inplace < 16 << 20, (stream, inplace)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def test_cli_merge(files, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, a, b, sd = files
    out = tmp_path / "cli.safetensors"
    rc = run_cli(
        [
            "merge",
            "--base",
            str(base),
            "--adapter",
            f"{a}:0.7",
            "--adapter",
            f"{b}:-0.4",
            "--out",
            str(out),
            "--chunk-bytes",
            "64K",
            "--json",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0 and cap.err == ""  # no progress bar when stderr is not a terminal
    info = json.loads(cap.out)
    assert info["ok"] and info["targets"] == 4 and [x["strength"] for x in info["adapters"]] == [0.7, -0.4]
    api = tmp_path / "api.safetensors"
    merge_file(base, [(a, 0.7), (b, -0.4)], api)
    assert all(
        torch.equal(x, y) for x, y in zip(load_file(str(out)).values(), load_file(str(api)).values(), strict=True)
    )

    rc = run_cli(["merge", "--base", str(base), "--adapter", str(a), "--out", str(tmp_path / "q.safetensors")])
    cap = capsys.readouterr()
    assert rc == 0 and "4 of 7 tensors merged" in cap.out and "a@1" in cap.out


def test_cli_errors(files, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, _, _, _ = files
    folder = tmp_path / "wrong"
    nope = "base_model.model.nope"  # zero-filled F32 factors on a module the base does not have
    tensors = {f"{nope}.lora_A.weight": ("F32", (2, 4)), f"{nope}.lora_B.weight": ("F32", (4, 2))}
    write_peft_adapter(folder, tensors, r=2, lora_alpha=2, target_modules=None)
    out = tmp_path / "o.safetensors"
    rc = run_cli(["merge", "--base", str(base), "--adapter", f"{folder}:0.5", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "'nope'" in err and "'wrong'" in err and not out.exists()
    rc = run_cli(["merge", "--base", str(base), "--adapter", str(folder), "--out", str(out), "--chunk-bytes", "lots"])
    assert rc == 2 and "not a size" in capsys.readouterr().err
    rc = run_cli(
        ["merge", "--base", str(tmp_path / "missing.safetensors"), "--adapter", str(folder), "--out", str(out)]
    )
    assert rc == 1 and "missing.safetensors" in capsys.readouterr().err


def test_cli_helpers() -> None:
    from lorafast.cli.merge import parse_adapter, parse_size

    assert parse_adapter("a/b:0.5") == ("a/b", 0.5)
    assert parse_adapter("a/b") == ("a/b", 1.0)
    assert parse_adapter("C:/x/y") == ("C:/x/y", 1.0)
    assert parse_adapter("x:-1e-1") == ("x", -0.1)
    assert parse_size("256M") == 256 << 20 and parse_size("1GiB") == 1 << 30 and parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("0")
