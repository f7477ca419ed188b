"""lorafast.compat.launch without the engines: program detection, the result's shape, versions, collecting and
raising. What each engine makes of a command is proven against its own parser in tests/oracle/test_oracle_launch.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lorafast
import pytest
from lorafast.compat import engine_rules, launch
from lorafast.compat.launch import parse_launch


@pytest.mark.parametrize(
    ("command", "engine", "entry", "argv", "env"),
    [
        ("vllm serve m --enable-lora", "vllm", "serve", ("m", "--enable-lora"), {}),
        ("CUDA_VISIBLE_DEVICES=0,1 VLLM_LOGGING_LEVEL=DEBUG vllm serve m", "vllm", "serve", ("m",),
         {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_LOGGING_LEVEL": "DEBUG"}),
        ("env -u HOME A=1 /opt/venv/bin/vllm serve m", "vllm", "serve", ("m",), {"A": "1"}),
        ("python -m vllm.entrypoints.openai.api_server --model m", "vllm", "api_server", ("--model", "m"), {}),
        ("/usr/bin/python3.11 -u -X dev -m vllm.entrypoints.openai.api_server --model m", "vllm", "api_server",
         ("--model", "m"), {}),
        ("python3 -m vllm.entrypoints.cli.main serve m", "vllm", "serve", ("m",), {}),
        ("python3 -m sglang.launch_server --model-path m", "sglang", "launch_server", ("--model-path", "m"), {}),
        ("python -msglang.launch_server --model-path m", "sglang", "launch_server", ("--model-path", "m"), {}),
        ("sglang serve --model-path 'my model'", "sglang", "serve", ("--model-path", "my model"), {}),
        ("python -m sglang.cli.main serve m", "sglang", "serve", ("m",), {}),
    ],
)  # fmt: skip
def test_program(command: str, engine: str, entry: str, argv: tuple[str, ...], env: dict[str, str]) -> None:
    parsed = parse_launch(command)
    assert (parsed.engine, parsed.entry, parsed.argv, dict(parsed.env)) == (engine, entry, argv, env)


def test_pasted_multi_line_command() -> None:
    parsed = parse_launch("python3 -m sglang.launch_server \\\n  --model-path m \\\n  --lora-paths a=/p\n")
    assert parsed.argv == ("--model-path", "m", "--lora-paths", "a=/p") and parsed.lora_adapters == (("a", "/p"),)


def test_argv_list_is_taken_as_is() -> None:
    parsed = parse_launch(["vllm", "serve", "my model", "--lora-modules", "a=/p q"])
    assert parsed.model == "my model" and parsed.lora_adapters == (("a", "/p q"),)


@pytest.mark.parametrize(
    ("command", "named"),
    [
        ("torchrun --nproc 2 serve.py", "`torchrun`"),
        ("vllm bench serve", "`vllm bench`"),
        ("sglang generate --model-path m", "`sglang generate`"),
        ("python -m http.server", "`python -m http.server`"),
        ("python3 serve.py --model m", "`python3`"),
        ("python -m vllm.entrypoints.cli.main bench", "`python -m vllm.entrypoints.cli.main bench`"),
        ("CUDA_VISIBLE_DEVICES=0", "no program"),
        ("", "no program"),
    ],
)
def test_not_a_launch_command(command: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_launch(command)


def test_vllm_defaults_follow_the_version() -> None:
    for version, cls_labels in (("0.30.0", False), ("0.33.0", True), ("0.34.0", True)):
        parsed = parse_launch("vllm serve m", engine_version=version)
        assert parsed.ok and parsed.enable_lora is None and parsed.lora_adapters == ()
        assert parsed.options["max_lora_rank"] == 16 and parsed.options["max_loras"] == 1
        assert parsed.options["max_cpu_loras"] is None  # no LoRAConfig is built without --enable-lora
        assert ("max_lora_cls_labels" in parsed.options) is cls_labels
    assert parse_launch("vllm serve --enable-lora").model == "Qwen/Qwen3-0.6B"  # EngineArgs.model's default


def test_vllm_disable_lora_is_0_33s() -> None:
    assert parse_launch("vllm serve m --disable-lora", engine_version="0.34.0").enable_lora is False
    old = parse_launch("vllm serve m --disable-lora", engine_version="0.30.0")
    assert old.ignored == ("--disable-lora",) and not old.ok
    assert old.problems[0].message == "unrecognized arguments: --disable-lora"


def test_vllm_lora_config_resolved() -> None:
    parsed = parse_launch("vllm serve m --enable-lora --max-loras 4 --lora-target-modules o_proj qkv_proj")
    assert parsed.ok and parsed.options["max_cpu_loras"] == 4  # LoRAConfig: max_cpu_loras defaults to max_loras
    assert parsed.options["lora_target_modules"] == ("o_proj", "qkv_proj")
    bad = parse_launch("vllm serve m --enable-lora --max-loras 4 --max-cpu-loras 2")
    assert bad.problems[0].code == "vllm_lora_config" and bad.problems[0].exc_type == "ValidationError"
    assert "max_cpu_loras (2) must be >= max_loras (4)." in bad.problems[0].message


def test_sglang_resolution() -> None:
    parsed = parse_launch(
        'sglang serve m --lora-paths a=/p /q \'{"lora_name": "c", "lora_path": "/r", "pinned": true}\''
    )
    assert parsed.ok and parsed.enable_lora is True  # --lora-paths turns LoRA on
    assert parsed.lora_adapters == (("a", "/p"), ("/q", "/q"), ("c", "/r"))
    refs = parsed.options["lora_paths"]
    assert [r.pinned for r in refs] == [False, False, True] and refs[0].lora_id == lorafast.compat.lora_id("a", "/p")
    targets = parse_launch("sglang serve m --enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj q_proj")
    assert targets.options["lora_target_modules"] == frozenset({"q_proj", "v_proj"})
    assert targets.options["enable_lora_overlap_loading"] is False


def test_problems_are_collected_in_engine_order_or_raised() -> None:
    command = "python -m sglang.launch_server --model-path m --max-loras-per-batch 0 --enable-lora --lora-target-modules all q_proj"
    parsed = parse_launch(command)
    assert [(p.code, p.stage, p.exc_type) for p in parsed.problems] == [
        ("sglang_server_args", "startup", "AssertionError")
    ] * 3
    assert [p.message for p in parsed.problems] == [
        "max_loras_per_batch must be positive",
        "If 'all' is specified in --lora-target-modules, it should be the only module specified.",
        "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and --lora-target-modules "
        "for LoRA initialization.",
    ]
    with pytest.raises(AssertionError, match="max_loras_per_batch must be positive"):
        parse_launch(command, collect=False)
    with pytest.raises(
        argparse.ArgumentError, match=r"argument --max-lora-rank: invalid choice: 33 \(choose from 1, 8"
    ):
        parse_launch("vllm serve m --max-lora-rank 33", collect=False)


def test_unknown_tokens_are_listed_and_refused() -> None:
    parsed = parse_launch("vllm serve m --enable-lora --frobnicate 3 --port 8000 --max-lora-rank 64")
    assert parsed.ignored == ("--frobnicate", "3")
    assert parsed.options["max_lora_rank"] == 64  # what follows is still read
    assert [(p.code, p.exc_type, p.message) for p in parsed.problems] == [
        ("launch_unrecognized_arguments", "ArgumentError", "unrecognized arguments: --frobnicate 3")
    ]


def test_help_starts_no_server() -> None:
    parsed = parse_launch("sglang serve m --help")
    assert [p.code for p in parsed.problems] == ["launch_help"] and isinstance(parsed.problems[0].error, SystemExit)


def test_not_modelled_checks_are_named() -> None:
    parsed = parse_launch("sglang serve m --lora-paths a=/p --speculative-algorithm EAGLE --lora-backend triton_v2")
    assert parsed.ok and [p.code for p in parsed.problems] == ["launch_not_modelled"] * 2
    assert all(not p.fatal for p in parsed.problems)


def test_config_without_yaml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("max-lora-rank: 64\n")

    def no_yaml(path: str) -> None:
        raise ImportError("No module named 'yaml'")

    monkeypatch.setattr(launch, "_yaml", no_yaml)
    for command in (f"vllm serve m --config {tmp_path}/c.yaml", f"sglang serve m --config {tmp_path}/c.yaml"):
        parsed = parse_launch(command)
        assert parsed.ok and [p.code for p in parsed.problems] == ["launch_config_not_read"], command
        assert parsed.options["max_lora_rank"] in (16, None) and parsed.ignored == ()


def test_versions() -> None:
    assert parse_launch("vllm serve m").rules == engine_rules("vllm")
    with pytest.warns(lorafast.UnverifiedEngineVersion):
        parsed = parse_launch("vllm serve m --enable-lora", engine_version="0.35.0")
    assert parsed.rules.rules == "0.34.0" and parsed.to_dict()["engine_version"]["status"] == "nearest: 0.34.0"
    with pytest.raises(lorafast.UnverifiedEngineVersionError):
        parse_launch("sglang serve m", engine_version="0.5.24", strict_version=True)


def test_to_dict_is_json() -> None:
    for command in (
        'vllm serve m --enable-lora --lora-modules a=/p \'{"name": "b", "path": "/q"}\' --max-lora-rank 8',
        "sglang serve m --lora-paths a=/p --lora-target-modules q_proj v_proj --max-lora-rank 8",
        "vllm serve m --enable-lora --max-loras 0 --bogus",
    ):
        text = json.dumps(parse_launch(command).to_dict())
        assert json.loads(text)["engine"] in ("vllm", "sglang")
    d = parse_launch("vllm serve m --enable-lora --max-loras 0").to_dict()
    assert d["ok"] is False and d["problems"][0]["exc_type"] == "ValidationError"
