"""Usage errors and argument checks: one-line messages and the documented exit
codes, never a traceback; nonsense thread counts and a bare string path refused or taken as one path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lorafast
import numpy as np
import pytest
from lorafast.cli import main
from lorafast.sample import write_samples

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("samples")
    write_samples(out, 4, seed=0)
    return out


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--threads", "-1"], "--threads: must be at least 1"),
        (["--threads", "0"], "--threads: must be at least 1"),
        (["--threads", "2.5"], "--threads: expected a whole number"),
        (["--timeout", "-1"], "--timeout: must be a positive number"),
        (["--timeout", "nan"], "--timeout: must be a positive number"),
        (["--timeout", "0"], "--timeout: must be a positive number"),
        (["--timeout", "soon"], "--timeout: expected a number of seconds"),
        (["--storage-option", "novalue"], "--storage-option: expected KEY=VALUE"),
        (["--storage-option", "=value"], "--storage-option: expected KEY=VALUE"),
    ],
)
def test_scan_usage_errors_are_one_line_and_exit_2(
    adapters: Path, extra: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(["scan", str(adapters), "--quiet", *extra], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("lorafast scan: error: argument ") and words in err, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["groups", "{dir}", "--max-per-group", "0"], "lorafast groups: error: argument --max-per-group: must be at"),
        (["groups", "{dir}", "--max-lora-rank", "-1"], "lorafast groups: error: argument --max-lora-rank: must be at"),
        (["sample", "--out", "{dir}/more", "-n", "-1"], "lorafast sample: error: argument -n: must be 0 or more"),
        (["sample", "--out", "{dir}/more", "-n", "many"], "lorafast sample: error: argument -n: expected a whole"),
    ],
)
def test_other_commands_count_arguments_are_usage_errors(
    adapters: Path, argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main([a.format(dir=adapters) for a in argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(words), err
    assert not (adapters / "more").exists()


@pytest.mark.parametrize("timeout", ["1e20", "1e300", "inf", "18446744073709551616"])
def test_huge_timeouts_are_accepted_without_a_traceback(
    adapters: Path, timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(["scan", str(adapters), "--quiet", "--json", "--timeout", timeout], capsys)
    assert code == 0, err
    assert '"adapters": 4' in out and "Traceback" not in err


def test_usage_error_in_a_real_process_prints_no_traceback(adapters: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lorafast", "scan", str(adapters), "--threads", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_plan_with_a_missing_adapter_exits_1_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent"
    code, out, err = run_main(["plan", "-a", f"x={missing}:0.5"], capsys)
    assert code == 1 and out == ""
    assert err.startswith("error: cannot read adapter ") and repr(str(missing)) in err and "Traceback" not in err

    code, out, _ = run_main(["plan", "-a", f"x={missing}:0.5", "--allow-unreadable"], capsys)
    assert code == 0 and "scales unknown" in out

    p = lorafast.plan([lorafast.LoraRequest("x", str(missing), 0.5)])  # the library plans it, and says so
    assert list(p.unreadable) == [str(missing)] and "FileNotFoundError" in p.unreadable[str(missing)]
    assert p.to_dict()["unreadable"] == dict(p.unreadable)


def test_plan_with_readable_adapters_has_nothing_unreadable(capsys: pytest.CaptureFixture[str]) -> None:
    path = next(p for p in sorted(FIXTURES.iterdir()) if (p / "adapter_config.json").exists())
    code, out, err = run_main(["plan", "-a", f"x={path}:0.5"], capsys)
    assert code == 0, err
    assert lorafast.plan([lorafast.LoraRequest("x", str(path), 0.5)]).unreadable == {}


@pytest.mark.parametrize("bad", [0, -3])
def test_nonpositive_thread_counts_raise_value_error(adapters: Path, bad: int) -> None:
    with pytest.raises(ValueError, match="threads must be at least 1"):
        lorafast.scan([adapters], threads=bad)
    with pytest.raises(ValueError, match="threads must be at least 1"):
        lorafast.inspect_many([adapters], threads=bad)


@pytest.mark.parametrize("bad", [True, False, 2.0, "2"])
def test_non_integer_thread_counts_raise_type_error(adapters: Path, bad: object) -> None:
    with pytest.raises(TypeError, match="threads must be a positive int"):
        lorafast.scan([adapters], threads=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="threads must be a positive int"):
        lorafast.inspect_many([adapters], threads=bad)  # type: ignore[arg-type]


def test_integer_like_thread_counts_work(adapters: Path) -> None:
    a = lorafast.scan([adapters], threads=1)
    b = lorafast.scan([adapters], threads=np.int64(2))
    assert len(a) == len(b) == 4 and a.paths == b.paths


def test_inspect_many_takes_a_single_path_as_one_path() -> None:
    path = next(p for p in sorted(FIXTURES.iterdir()) if (p / "adapter_config.json").exists())
    expected = lorafast.inspect(path)
    for single in (str(path), path, str(path).encode()):
        got = lorafast.inspect_many(single)  # type: ignore[arg-type]
        assert len(got) == 1 and got[0] == expected, single
    assert lorafast.inspect_many([str(path)]) == [expected]
    with pytest.raises(TypeError, match="paths must be a path or a sequence of paths"):
        lorafast.inspect_many(42)  # type: ignore[arg-type]


def test_scan_prints_a_name_that_is_not_utf8_as_its_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "fleet"
    folder.mkdir()
    name = b"bad\xff.safetensors"
    (folder / os.fsdecode(name)).write_bytes(b"x")
    proc = subprocess.run(
        [sys.executable, "-m", "lorafast", "scan", str(folder)],
        capture_output=True,
        timeout=120,
        env={"PYTHONIOENCODING": "utf-8", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1, proc.stderr
    assert b"Traceback" not in proc.stderr
    assert name in proc.stdout  # the very bytes of the name, so a user can find the file
    assert b"header_too_small" in proc.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["check", "{a}", "--threads", "-1"], "--threads: must be at least 1, not -1"),
        (["check", "{a}", "--base", "{a}", "--threads", "0"], "--threads: must be at least 1, not 0"),
        (["preflight", "sglang", "{a}", "--max-lora-rank", "-5"], "--max-lora-rank: must be at least 1, not -5"),
        (["preflight", "vllm", "{a}", "--max-lora-rank", "0"], "--max-lora-rank: must be at least 1, not 0"),
    ],
)
def test_check_and_preflight_count_arguments_are_usage_errors(
    adapters: Path, argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a = str(next(adapters.iterdir()))
    code, out, err = run_main([x.format(a=a) for x in argv], capsys)
    assert code == 2 and words in err and "Traceback" not in err and out == ""


def test_preflight_refusal_is_on_stderr_with_the_engines_text(
    adapters: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = str(next(adapters.iterdir()))
    code, out, err = run_main(["preflight", "sglang", a, "--max-loras-per-batch", "0"], capsys)
    assert code == 1 and "the engine would refuse this set" in out
    assert (
        err
        == "lorafast preflight: sglang would refuse this set: AssertionError: max_loras_per_batch must be positive\n"
    )


def _actions(parser: Any, prefix: tuple[str, ...] = ()) -> Any:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, (*prefix, name))
        elif not isinstance(action, argparse._HelpAction):
            yield prefix, action


def test_every_flag_has_help() -> None:
    from lorafast.cli import build_parser
    from lorafast.cli.preflight import launch_parser

    found = list(_actions(build_parser())) + list(_actions(launch_parser(), ("preflight --",)))
    assert len(found) > 100  # every subcommand was reached
    missing = [(" ".join(p), a.option_strings or a.dest) for p, a in found if not a.help]
    assert missing == []


def test_version_says_which_build(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"lorafast {lorafast.__version__} (")
    assert f"({lorafast._core.build_profile} build" in out
    assert ("make build-release" in out) == (lorafast._core.build_profile != "release")


def test_scan_lists_adapters_with_problems_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.testing import write_peft_adapter

    for i in range(3):
        # the config says r=4, the tensors have rank 8: config_rank_mismatch
        t = {"base_model.model.layers.0.q_proj.lora_A.weight": ("F32", [8, 16]),
             "base_model.model.layers.0.q_proj.lora_B.weight": ("F32", [16, 8])}  # fmt: skip
        write_peft_adapter(tmp_path / f"bad{i}", t, r=4 if i else 8, lora_alpha=8, target_modules=["q_proj"])
    code, out, _ = run_main(["scan", str(tmp_path), "--quiet"], capsys)
    assert code == 1 and "3 adapters: 1 clean, 2 with problems, 0 failed" in out
    assert "adapter with problems" in out and "config_rank_mismatch" in out
    assert str(tmp_path / "bad1") in out and str(tmp_path / "bad0") not in out.split("adapter with problems")[1]


def test_groups_exit_status_and_convert_needs_out(adapters: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = str(next(adapters.iterdir()))
    code, _, err = run_main(["groups", a, "--convert"], capsys)
    assert code == 2 and "--convert needs --out DIR" in err
    with pytest.raises(ValueError, match="convert=True needs convert_out"):
        lorafast.plan_groups([a], convert=True)
    code, _, _ = run_main(["groups", a, "--max-per-group", "0"], capsys)
    assert code == 2


def test_scan_index_that_is_not_an_index_is_a_usage_error(
    adapters: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not sqlite at all" * 10)
    for where, words in ((tmp_path, "cannot read the index"), (garbage, "not a lorafast index")):
        code, out, err = run_main(["scan", str(adapters), "--index", str(where), "--quiet"], capsys)
        assert code == 2 and words in err and str(where) in err and "Traceback" not in err
    assert garbage.read_bytes() == b"not sqlite at all" * 10


def test_preflight_takes_a_folder_names_paths_and_cuts_long_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lorafast.testing import write_peft_adapter

    fleet = tmp_path / "fleet"
    layers = {f"base_model.model.model.layers.{i}.mlp.{p}.lora_{s}.weight": ("F32", sh)
              for i in range(40) for p in ("up_proj", "down_proj") for s, sh in (("A", [4, 16]), ("B", [16, 4]))}  # fmt: skip
    write_peft_adapter(fleet / "mlp", layers, r=4, lora_alpha=8, target_modules=["up_proj", "down_proj"])
    write_peft_adapter(fleet / "dora", {k: v for k, v in list(layers.items())[:4]}, r=4, lora_alpha=8,
                       target_modules=["up_proj", "down_proj"], use_dora=True)  # fmt: skip
    attn = {f"base_model.model.model.layers.0.self_attn.{p}.lora_{s}.weight": ("F32", sh)
            for p in ("q_proj", "k_proj", "v_proj") for s, sh in (("A", [4, 16]), ("B", [16, 4]))}  # fmt: skip
    write_peft_adapter(fleet / "qkv", attn, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"])
    code, out, err = run_main(["preflight", "sglang", str(fleet), "--lora-target-modules", "q_proj"], capsys)
    assert code == 1
    assert f"[{fleet / 'dora'} (at {fleet / 'dora'})]" in out  # the folder expanded to its two adapters
    skipped = next(line for line in out.splitlines() if "skipped because" in line)
    assert len(skipped) < 700 and "more characters; --json has the whole message" in skipped
    assert f"pass their own checks: {fleet / 'qkv'}\n" in out
    assert err.startswith("lorafast preflight: sglang would refuse this set: RuntimeError:")  # no log lines
    code, out, _ = run_main(["preflight", "sglang", str(fleet), "--json"], capsys)
    report = json.loads(out)
    assert {p["adapter_path"] for p in report["problems"]} >= {str(fleet / "dora")}


def test_plan_suggests_flags_not_python(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.sample_bases import write_with_bases

    p = write_with_bases(tmp_path)
    argv = ["plan", "-a", f"a={p['flux-a']}", "-a", f"b={p['flux-b']}", "--merge-mode", "dynamic"]
    code, _, err = run_main(argv, capsys)
    assert code == 1
    # SGLang's own text stays as it is; lorafast's suggestion names the flags
    assert "error: Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge'" in err
    assert "--resolve plans it as a merge, or pass --merge-mode merge." in err and "resolve=True" not in err
    code, out, _ = run_main([*argv, "--resolve"], capsys)
    assert code == 0 and "--resolve" in out and "resolve=True" not in out


@pytest.mark.parametrize(
    "argv",
    [
        ["scan"],
        ["inspect"],
        ["header"],
        ["sample"],
        ["preflight", "sglang"],
        ["preflight", "--threads", "0", "--", "vllm", "serve", "m"],
        ["check", "x", "--threads", "0"],
        ["plan"],
        ["groups", "x", "--max-per-group", "0"],
        ["merge", "--base", "b"],
        ["convert"],
        ["engines", "--bogus"],
        ["upgrade-check", "--engine", "vllm", "x"],
        ["nonsense"],
    ],
)
def test_every_subcommand_exits_2_on_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(argv, capsys)
    assert code == 2, (argv, err)
    assert "Traceback" not in err and "error" in err
