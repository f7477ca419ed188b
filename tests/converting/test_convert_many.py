"""One call converts many adapters: `lorafast.convert([paths or folders], to, out_dir)` and `lorafast convert A B C
--to ... --out DIR` write each adapter to `DIR/<name>` as the single form would, report a failure and go on, and
give one result per adapter in order. The CLI's messages name its flags; the single form is unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from lorafast import ConvertError, ConvertResult, convert
from lorafast.cli import main
from test_convert import numbered_adapter, stacked_adapter, target_parameters_adapter


def _files(folder: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def _fleet(root: Path) -> dict[str, str]:
    """A folder of three adapters (one already stacked) and two adapters outside it."""
    return {
        "shared": stacked_adapter(root / "fleet" / "shared", 1, shared_outer=True),
        "stacked": stacked_adapter(root / "fleet" / "stacked", 2, shared_outer=False),
        "tp": target_parameters_adapter(root / "fleet" / "tp", 3),
        "numbered": numbered_adapter(root / "more" / "numbered", 4),
        "broken": _broken(root / "more" / "broken"),
    }


def _broken(folder: Path) -> str:
    src = stacked_adapter(folder, 5, shared_outer=True)
    weights = os.path.join(src, "adapter_model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 64)
    return src


def test_many_adapters_each_into_its_own_folder_failures_reported(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path / "in")
    out = tmp_path / "out"
    inputs = [str(tmp_path / "in" / "fleet"), fleet["numbered"], fleet["broken"], str(tmp_path / "in" / "missing")]
    results = convert(inputs, "stacked_3d", out)
    # the folder stands for its adapters, in the order scan gives them; then the others in the order given (a
    # file that cannot be read is named as scan names it)
    broken = os.path.join(fleet["broken"], "adapter_model.safetensors")
    assert [r.source if isinstance(r, ConvertResult) else r.path for r in results] == [
        fleet["shared"], fleet["stacked"], fleet["tp"], fleet["numbered"], broken, str(tmp_path / "in" / "missing"),
    ]  # fmt: skip
    ok = {Path(r.source).name: r for r in results if isinstance(r, ConvertResult)}
    errors = {Path(str(r.path).removesuffix("/adapter_model.safetensors")).name: r for r in results
              if isinstance(r, ConvertError)}  # fmt: skip
    assert sorted(ok) == ["numbered", "shared", "tp"]
    assert {n: e.code for n, e in errors.items()} == {
        "stacked": "layout_mismatch",  # already stacked
        "broken": "truncated",
        "missing": "bad_source",
    }
    # what failed left nothing; each output is what the single form writes
    assert sorted(os.listdir(out)) == ["numbered", "shared", "tp"]
    for name, res in ok.items():
        assert res.out == str(out / name) and res.to_layout == "stacked_3d"
        single = convert(fleet[name], "stacked_3d", tmp_path / "single" / name)
        assert _files(res.out) == _files(single.out)


def test_many_keeps_going_and_leaves_nothing_when_every_one_fails(tmp_path: Path) -> None:
    stacked = stacked_adapter(tmp_path / "stacked", 6, shared_outer=False)
    results = convert([stacked, stacked_adapter(tmp_path / "other", 7, shared_outer=False)], "stacked_3d",
                      tmp_path / "a" / "out")  # fmt: skip
    assert [type(r) for r in results] == [ConvertError, ConvertError]
    assert sorted(os.listdir(tmp_path)) == ["other", "stacked"]  # not even the folders above the output


def test_many_refuses_a_second_adapter_with_the_same_name(tmp_path: Path) -> None:
    first = stacked_adapter(tmp_path / "a" / "x", 8, shared_outer=True)
    second = stacked_adapter(tmp_path / "b" / "x", 9, shared_outer=True)
    one, two = convert((first, second), "stacked_3d", tmp_path / "out", overwrite=True)
    assert isinstance(one, ConvertResult) and one.source == first
    assert isinstance(two, ConvertError) and two.code == "exists" and two.path == str(tmp_path / "out" / "x")
    assert first in str(two) and second in str(two)
    assert _files(one.out) == _files(convert(first, "stacked_3d", tmp_path / "single").out)


def test_many_without_overwrite_keeps_existing_outputs(tmp_path: Path) -> None:
    a = stacked_adapter(tmp_path / "in" / "a", 10, shared_outer=True)
    b = stacked_adapter(tmp_path / "in" / "b", 11, shared_outer=True)
    (tmp_path / "out" / "a").mkdir(parents=True)
    (tmp_path / "out" / "a" / "mine.txt").write_text("kept")
    first, second = convert([a, b], "stacked_3d", tmp_path / "out")
    assert isinstance(first, ConvertError) and first.code == "exists"
    assert isinstance(second, ConvertResult)
    assert (tmp_path / "out" / "a" / "mine.txt").read_text() == "kept"


def test_cli_many(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = _fleet(tmp_path / "in")
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "in" / "fleet"), fleet["numbered"], "--to", "stacked_3d",
                 "--out", str(out)]) == 1  # fmt: skip
    got = capsys.readouterr()
    assert sorted(os.listdir(out)) == ["numbered", "shared", "tp"]
    assert got.out.splitlines()[-1] == f"3 converted, 1 failed -> {out}"
    assert [line.split(":")[0] for line in got.out.splitlines()[:-1]] == [
        fleet["shared"], fleet["tp"], fleet["numbered"]
    ]  # fmt: skip
    assert got.err == (
        f"lorafast: [layout_mismatch] {fleet['stacked']} already is stacked_3d; --to stacked_3d takes "
        "shared_outer, per_expert_2d, peft_target_parameters\n"
    )
    # everything converted: exit 0; --json gives one entry per adapter, errors included
    assert main(["convert", fleet["shared"], fleet["tp"], "--to", "per_expert_2d", "--out", str(tmp_path / "pe"),
                 "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert [r["out"] for r in rows] == [str(tmp_path / "pe" / "shared"), str(tmp_path / "pe" / "tp")]
    assert main(["convert", fleet["shared"], fleet["tp"], "--to", "per_expert_2d", "--out", str(tmp_path / "pe"),
                 "--json"]) == 1  # fmt: skip
    got = capsys.readouterr()
    rows = json.loads(got.out)
    assert [r["error"]["code"] for r in rows] == ["exists", "exists"]
    assert rows[0]["error"]["message"].endswith("exists; pass --overwrite to replace it")
    assert got.err.count("[exists]") == 2


def test_cli_one_folder_of_adapters_expands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = stacked_adapter(tmp_path / "fleet" / "a", 12, shared_outer=True)
    stacked_adapter(tmp_path / "fleet" / "b", 13, shared_outer=True)
    assert main(["convert", str(tmp_path / "fleet"), "--to", "stacked_3d", "--out", str(tmp_path / "out")]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["a", "b"]
    assert capsys.readouterr().out.splitlines()[-1] == f"2 converted, 0 failed -> {tmp_path / 'out'}"
    # one adapter: the single form, written to --out itself, as before
    assert main(["convert", a, "--to", "stacked_3d", "--out", str(tmp_path / "one")]) == 0
    assert sorted(os.listdir(tmp_path / "one")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert capsys.readouterr().out.startswith(f"{a}: shared_outer -> stacked_3d, ")


def test_messages_name_the_cli_flags_on_the_cli_and_the_arguments_in_python(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = stacked_adapter(tmp_path / "s", 14, shared_outer=True)
    (tmp_path / "out").mkdir()
    with pytest.raises(ConvertError) as info:
        convert(src, "stacked_3d", tmp_path / "out")
    assert str(info.value) == f"{tmp_path / 'out'} exists; pass overwrite=True to replace it"
    assert main(["convert", src, "--to", "stacked_3d", "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"lorafast: [exists] {tmp_path / 'out'} exists; pass --overwrite to replace it\n"
    with pytest.raises(ConvertError, match="already is shared_outer; to='shared_outer' takes stacked_3d"):
        convert(src, "shared_outer", tmp_path / "x")
    assert main(["convert", src, "--to", "shared_outer", "--out", str(tmp_path / "x")]) == 1
    assert "already is shared_outer; --to shared_outer takes stacked_3d" in capsys.readouterr().err


def test_cli_prints_small_rates_readably(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = stacked_adapter(tmp_path / "s", 15, shared_outer=True)
    assert main(["convert", src, "--to", "stacked_3d", "--out", str(tmp_path / "out")]) == 0
    line = capsys.readouterr().out
    rate = line.split(" s (")[1].split(")")[0]
    number, unit = rate.split()
    assert unit in ("MB/s", "GB/s") and float(number) > 0  # a KB-sized adapter: MB/s, not "0.00 GB/s"
