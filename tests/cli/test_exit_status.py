"""The one exit-status rule of `lorafast` (cli/_status.py): 0 all fine, 1 something failed or does not serve,
2 a usage error; the subcommand table; the flags declared once in cli/_options.py."""

from __future__ import annotations

import ast
import pathlib

import lorafast
import pytest
from lorafast.cli import COMMANDS, ExitStatus, build_parser, main
from lorafast.testing import write_peft_adapter

PACKAGE = pathlib.Path(lorafast.__file__).parent
KEY = "base_model.model.model.layers.0.self_attn"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_every_subcommand_is_in_the_table_and_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert [int(s) for s in ExitStatus] == [0, 1, 2]
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for name, module in COMMANDS.items():
        assert name in out and callable(module.add_parser) and callable(module.run)
    parsers = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(parsers.choices) == list(COMMANDS)  # type: ignore[attr-defined]


def test_no_library_module_registers_or_imports_the_cli() -> None:
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts[:1]:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert "register_cli" not in names, path
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                target = "." * node.level + node.module
                if path.name != "demo.py" and path.name != "__main__.py":
                    assert not target.startswith(("lorafast.cli", ".cli")), (path, target)


def test_an_adapter_with_problems_is_not_all_fine(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_peft_adapter(
        tmp_path / "good",
        {f"{KEY}.q_proj.lora_A.weight": (8, 32), f"{KEY}.q_proj.lora_B.weight": (32, 8)},
        r=8,
        target_modules=["q_proj"],
    )
    messy = write_peft_adapter(
        tmp_path / "messy", {f"{KEY}.q_proj.lora_A.weight": (8, 32)}, r=8, target_modules=["q_proj"]
    )  # A without B
    assert run(["inspect", good], capsys)[0] == ExitStatus.OK
    for argv in (["inspect", messy], ["inspect", messy, "--json"], ["scan", messy, "--quiet"]):
        code, out, _ = run(argv, capsys)
        assert code == ExitStatus.FAILED and "missing_lora_b" in out, argv


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plan", "-a", "=p"], "bad --adapter"),
        (["plan", "-a", "a=p", "--alpha", "a"], "bad --alpha"),
        (["plan", "-a", "a=p", "--base-weights", "nowhere=x"], "bad --base-weights"),
        (["plan", "-a", "a=p", "--engine-version", "0.5.24", "--strict-version"], "lorafast plan: error:"),
        (["groups", "x", "--convert"], "lorafast groups: error: --convert needs --out"),
        (["check", "x", "--engine", "vllm"], "lorafast check: error:"),
        (["merge", "--base", "b", "--adapter", "a", "--out", "o", "--chunk-bytes", "lots"], "not a size"),
        (["upgrade-check", "x", "--engine", "transformers"], "lorafast upgrade-check: error:"),
    ],
)
def test_refused_flags_are_usage_errors(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(argv, capsys)
    assert code == ExitStatus.USAGE, (argv, out, err)
    assert says in out + err and "Traceback" not in err


def test_shared_flags_parse_alike(capsys: pytest.CaptureFixture[str]) -> None:
    """`--threads`, `--max-lora-rank`, `--timeout` and `--engine-version` come from one declaration each."""
    for argv in (
        ["scan", "x", "--threads", "0"],
        ["check", "x", "--base", "b", "--threads", "0"],
        ["preflight", "--threads", "0", "--", "vllm", "serve", "m"],
        ["groups", "x", "--max-lora-rank", "0"],
        ["preflight", "sglang", "x", "--max-lora-rank", "0"],
        ["upgrade-check", "x", "--engine", "vllm", "--max-lora-rank", "0"],
        ["check", "x", "--base", "b", "--engine", "vllm", "--max-lora-rank", "0"],
    ):
        code, _, err = run(argv, capsys)
        assert code == ExitStatus.USAGE and "must be at least 1, not 0" in err, argv
    for argv in (
        ["plan", "-a", "a", "--engine-version", "next"],
        ["preflight", "vllm", "x", "--engine-version", "next"],
        ["check", "x", "--base", "b", "--engine-version", "next"],
        ["upgrade-check", "x", "--engine", "vllm", "--from", "next"],
    ):
        code, _, err = run(argv, capsys)
        assert code == ExitStatus.USAGE and "not an engine version: 'next'" in err, argv
    help_texts = {
        name: {a.dest: a.help for a in sub._actions}
        for name, sub in next(a for a in build_parser()._actions if a.dest == "command").choices.items()  # type: ignore[attr-defined]
    }
    threads = {h["threads"] for h in help_texts.values() if "threads" in h}
    strict = {h["strict_version"] for h in help_texts.values() if "strict_version" in h}
    assert len(threads) == 1 and len(strict) == 1
