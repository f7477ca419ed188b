"""lorafast.compat.launch against the engines' own argument parsers (vLLM 0.34.0, 0.33.0, 0.30.0; SGLang 0.5.23).

For each verified release, tests/oracle/launch_runner.py runs the engine's own parser on every command of
tests/oracle/cases_launch.py in a child interpreter: vLLM's `vllm serve` / api-server `FlexibleArgumentParser`
(every flag of `make_arg_parser`), `AsyncEngineArgs.from_cli_args` and `create_engine_config`'s `LoRAConfig`;
SGLang's `sglang serve` / `prepare_server_args` and `check_lora_server_args`. `parse_launch` must agree on
each: the model, whether LoRA is on, the adapters, every LoRA option, or the exception (type and exact text).
The parser table lorafast rebuilds (`_launch_flags.txt`) must equal the engine's, flag for flag. A missing wheel
is a failure (`make engines`), never a skip.
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cases_launch
import engines
from lorafast.compat.launch import (
    _SGLANG_SPEC,
    LaunchCommand,
    _flag_table,
    _parser,
    _vllm_spec,
    flag_sections,
    parse_launch,
)

pytestmark = pytest.mark.timeout(900)  # the module's first test waits for four engine runs

RELEASES = [(engine, v) for engine in ("vllm", "sglang") for v in engines.PINNED[engine]]
OUT = Path(__file__).resolve().parents[2] / "target" / "_launch_flags.txt"


@pytest.fixture(scope="module")
def config_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("launch-configs")
    for name, text in cases_launch.CONFIGS.items():
        (folder / name).write_text(text)
    return folder


def _cases(engine: str, folder: Path) -> list[tuple[str, list[str]]]:
    return [(e, cases_launch.with_files(a, str(folder))) for g, e, a in cases_launch.CASES if g == engine]


def _limits(engine: str) -> list[tuple[str, list[str], str]]:
    return [(e, a, why) for g, e, a, why in cases_launch.LIMIT_CASES if g == engine]


@pytest.fixture(scope="module")
def oracle(config_folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Per release: the engine's parser rows and its outcome for every case, then every limit case."""

    def run(release: tuple[str, str]) -> dict[str, Any]:
        engine, version = release
        commands = _cases(engine, config_folder) + [(e, a) for e, a, _ in _limits(engine)]
        payload = {"table": True, "cases": [{"entry": e, "argv": a} for e, a in commands]}
        return engines.run("launch_runner", engine, version, payload)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(RELEASES, pool.map(run, RELEASES), strict=True))


def _address(text: str) -> str:
    # `--default-mm-loras`' type error names `<function loads at 0x...>`, an address of the engine's process
    return re.sub(r" at 0x[0-9a-f]+>", " at 0x...>", text)


def _outcome(parsed: LaunchCommand) -> dict[str, Any]:
    """lorafast's answer in the runner's form: the first fatal problem (what the engine raises), else the parse."""
    fatal = [p for p in parsed.problems if p.fatal]
    if fatal:
        error = fatal[0].error
        if isinstance(error, SystemExit):  # --help: compared by exit status
            return {"error": ["SystemExit", str(error.code)]}
        return {"error": [fatal[0].exc_type, _address(fatal[0].message)]}
    options = parsed.to_dict()["options"]
    return {"ok": {"model": parsed.model, "enable_lora": parsed.enable_lora,
                   "adapters": [list(a) for a in parsed.lora_adapters], "options": options}}  # fmt: skip


def _engine_outcome(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        return {"error": [result["error"][0], _address(result["error"][1])]}
    ok = dict(result["ok"])
    ok.pop("lora_config", None)
    return {"ok": ok}


@pytest.mark.parametrize(("engine", "version"), RELEASES)
def test_flag_table_is_the_engines(engine: str, version: str, oracle: dict[tuple[str, str], dict[str, Any]]) -> None:
    """`_launch_flags` holds the engine's parser, every action in order; on a change, the new file's text
    is written to target/_launch_flags.txt (copy it over python/lorafast/compat/_launch_flags.txt)."""
    expected = cases_launch.encode(oracle[(engine, version)]["parser"])
    if (engine, version) not in flag_sections() or (_flag_table(engine, version) != expected + "\n"):
        tables = {release: answer["parser"] for release, answer in oracle.items()}
        OUT.parent.mkdir(exist_ok=True)
        OUT.write_text(cases_launch.render_flags(tables))
        pytest.fail(f"{engine} {version}: the parser differs from _launch_flags.txt; new text in {OUT}")


@pytest.mark.parametrize(("engine", "version"), RELEASES)
def test_rebuilt_parser_is_the_engines(
    engine: str, version: str, oracle: dict[tuple[str, str], dict[str, Any]]
) -> None:
    """The parser lorafast builds registers the same option strings, in the same order, for the same actions, and
    gives the LoRA flags (and the model's) the engine's class, nargs, type, choices, default and const."""
    spec = _vllm_spec(version) if engine == "vllm" else _SGLANG_SPEC
    theirs = oracle[(engine, version)]["parser"]
    mine = [row for row in cases_launch.describe(_parser(engine, version, "x"), set(spec)) if row["dest"] != "help"]
    theirs = [row for row in theirs if row["dest"] != "help"]
    assert [r["dest"] for r in mine] == [r["dest"] for r in theirs]
    assert set(spec) <= {r["dest"] for r in theirs}, "a LoRA dest the engine no longer has"
    for ours, engine_row in zip(mine, theirs, strict=True):
        keys = ["dest", "strings", "shown", "required"] + (["nargs", "class", "type", "choices", "default", "const"]
                                                            if ours["dest"] in spec else [])  # fmt: skip
        assert {k: ours[k] for k in keys} == {k: engine_row[k] for k in keys}


@pytest.mark.parametrize(("engine", "version"), RELEASES)
def test_launch_commands_agree(
    engine: str, version: str, oracle: dict[tuple[str, str], dict[str, Any]], config_folder: Path
) -> None:
    cases = _cases(engine, config_folder)
    results = oracle[(engine, version)]["results"][: len(cases)]
    disagree = []
    for (entry, argv), result in zip(cases, results, strict=True):
        command = cases_launch.command(engine, entry, argv)
        mine = _outcome(parse_launch(command, engine_version=version))
        if mine != _engine_outcome(result):
            disagree.append((command, _engine_outcome(result), mine))
    assert not disagree, "\n".join(f"{c}\n  engine:   {e}\n  lorafast: {m}" for c, e, m in disagree)
    errors = sum("error" in r for r in results)
    assert len(cases) >= 40 and 10 <= errors <= len(cases) - 10  # both outcomes well represented


@pytest.mark.parametrize(("engine", "version"), RELEASES)
def test_documented_limits_still_hold(
    engine: str, version: str, oracle: dict[tuple[str, str], dict[str, Any]], config_folder: Path
) -> None:
    """docs/compat.md's limits: the engine refuses a value of a flag outside LoRA, which lorafast does not check."""
    results = oracle[(engine, version)]["results"][len(_cases(engine, config_folder)) :]
    for (entry, argv, why), result in zip(_limits(engine), results, strict=True):
        parsed = parse_launch(cases_launch.command(engine, entry, argv), engine_version=version)
        assert result["error"][0] == "ArgumentError" and parsed.ok, why
