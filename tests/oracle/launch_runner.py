"""Runs an engine's own launch-command parsing (from an unpacked wheel) on oracle cases; JSON on stdin and stdout.

Started by `engines.run("launch_runner", engine, version, payload)` with the wheel's sources first on sys.path;
the stubs are the launch section of stubs.py. Payload: {"table": bool, "cases": [{"entry", "argv"}, ...]}.
Answer: {"parser": rows} when `table` (`cases_launch.describe`: the serve parser's every action in order, with
type, choices, default and const for the LoRA actions and the model's), and {"results": [...]}: per case, what
the engine makes of the command ({"ok": model, enable_lora, adapters, LoRA options}) or what it raises
({"error": [type name, exact text]}; an argparse exit with status 2 is `ArgumentError` with the text after
"<prog>: error: ", a help exit is `SystemExit` with its status).

Entries, with what runs for each:
  vllm "serve" (`vllm serve ...`): the `vllm` CLI's top-level `FlexibleArgumentParser` with the real serve
  subcommand parser, `parse_args(["serve", *argv])`, then `ServeSubcommand.cmd`'s model-tag rule;
  vllm "api_server" (`python -m vllm.entrypoints.openai.api_server ...`): `make_arg_parser(FlexibleArgumentParser())`;
  then, for both, `AsyncEngineArgs.from_cli_args` and `create_engine_config`'s own `lora_config = (...)`
  statement, compiled from the wheel's source (the rest of `create_engine_config` needs the model).
  sglang "launch_server" (`python -m sglang.launch_server ...`): `prepare_server_args(argv)`;
  sglang "serve" (`sglang serve ...`): `sglang.cli.main.main` and `sglang.cli.serve.serve` as released, with the
  LLM backend detected (detection reads the model) and its `_run_llm` replaced by `prepare_server_args` on the
  argv it gets; then, for both, `check_lora_server_args` on the record, and the LoRA fields as
  `resolving_view` gives them afterwards (the rest of the resolution pipeline needs the model and the GPU).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import sys
import traceback

import stubs
from cases_launch import describe

ENGINE, VERSION = os.environ["LORAFAST_ORACLE_ENGINE"].split("==")
os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM's switch for a machine without a GPU
RESULT_STREAM = sys.stdout
sys.stdout = sys.stderr  # the engines log to stdout; the JSON answer owns it

VLLM_LORA_DESTS = ("enable_lora", "lora_modules")  # besides the "LoRAConfig" argument group
SGLANG_LORA_NAMESPACE = "lora"


class Exit(Exception):
    """`ArgumentParser.exit`, raised instead of ending the process."""

    def __init__(self, status: int, message: str | None) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _exit(self: argparse.ArgumentParser, status: int = 0, message: str | None = None) -> None:
    prefix = f"{self.prog}: error: "
    if message is not None and message.startswith(prefix):
        message = message[len(prefix) :].rstrip("\n")
    raise Exit(status, message)


argparse.ArgumentParser.exit = _exit  # type: ignore[assignment,method-assign]


def plain(value: object) -> object:
    """A JSON form of a parsed value (dataclasses and structs as dicts, sets sorted)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in dataclasses.asdict(value).items()}
    if hasattr(value, "__struct_fields__"):
        return {k: plain(getattr(value, k)) for k in value.__struct_fields__}  # type: ignore[attr-defined]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)  # type: ignore[type-var]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


# --- vLLM -----------------------------------------------------------------------------------------------


def vllm_setup():  # type: ignore[no-untyped-def]
    stubs.install_vllm_cli()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:  # 0.30
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    import vllm.engine.arg_utils as arg_utils

    # `create_engine_config`'s own statement that builds the LoRAConfig, run on the parsed EngineArgs.
    tree = ast.parse(inspect.getsource(arg_utils))
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "create_engine_config")
    statement = next(
        n
        for n in ast.walk(method)
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "lora_config" for t in n.targets)
    )
    code = compile(ast.fix_missing_locations(ast.Module([statement], [])), arg_utils.__file__, "exec")

    def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
        top = FlexibleArgumentParser(description="vLLM CLI")
        sub = top.add_subparsers(required=False, dest="subparser")
        serve = ServeSubcommand().subparser_init(sub)
        return top, serve

    def lora_dests(parser: argparse.ArgumentParser) -> set[str]:
        group = next(g for g in parser._action_groups if g.title == "LoRAConfig")
        return {a.dest for a in group._group_actions} | set(VLLM_LORA_DESTS)

    def parse(entry: str, argv: list[str]) -> dict:
        if entry == "serve":
            top, serve = parsers()
            dests = lora_dests(serve)
            args = top.parse_args(["serve", *argv])
            if getattr(args, "model_tag", None) is not None:  # ServeSubcommand.cmd's first statement
                args.model = args.model_tag
        else:
            parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
            dests = lora_dests(parser)
            args = parser.parse_args(argv)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        namespace = {**vars(arg_utils), "self": engine_args}
        exec(code, namespace)
        lora_config = namespace["lora_config"]
        options = {d: plain(getattr(engine_args, d, getattr(args, d, None))) for d in sorted(dests)}
        options["lora_modules"] = plain(args.lora_modules)
        if lora_config is not None:
            options["max_cpu_loras"] = lora_config.max_cpu_loras
        modules = args.lora_modules or []
        return {
            "model": engine_args.model,
            "enable_lora": engine_args.enable_lora,
            "adapters": [[m.name, m.path] for m in modules],
            "options": options,
            "lora_config": lora_config is not None,
        }

    def definition() -> dict:
        _, serve = parsers()
        return {"parser": describe(serve, lora_dests(serve) | {"model", "model_tag"})}

    return parse, definition


# --- SGLang ---------------------------------------------------------------------------------------------


def sglang_setup():  # type: ignore[no-untyped-def]
    stubs.install_sglang_cli()
    import msgspec
    from sglang.cli import main as cli_main
    from sglang.cli import serve as cli_serve
    from sglang.cli.serve_backends import ServeBackendDetection
    from sglang.srt.arg_groups.fields.lora import Lora
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    lora_fields = [f.name for f in msgspec.structs.fields(Lora)]

    class Served(Exception):
        pass

    def serve_argv(argv: list[str]) -> list[str] | None:
        """`sglang serve`: the real `sglang.cli.main.main` and `serve`, with the LLM backend chosen (diffusion
        detection reads the model) and its run replaced by capturing the argv it would parse."""
        captured: list[list[str]] = []

        def run_llm(request: object) -> None:
            captured.append(list(request.argv))  # type: ignore[attr-defined]
            raise Served

        saved = {name: getattr(cli_serve, name) for name in ("_run_llm", "_detect_diffusion", "kill_process_tree")}
        cli_serve._run_llm = run_llm
        cli_serve._detect_diffusion = lambda request: ServeBackendDetection.NO_MATCH
        cli_serve.kill_process_tree = lambda *a, **k: None
        sys.argv = ["sglang", "serve", *argv]
        try:
            cli_main.main()
        except Served:
            pass
        finally:
            for name, value in saved.items():
                setattr(cli_serve, name, value)
        return captured[0] if captured else None  # None: it printed help and returned

    def parse(entry: str, argv: list[str]) -> dict:
        if entry == "serve":
            served = serve_argv(argv)
            if served is None:
                raise Exit(0, None)
            argv = served
        server_args = prepare_server_args(list(argv))
        check_lora_server_args(server_args)
        cfg = resolving_view(server_args)
        options = {name: plain(getattr(cfg, name)) for name in lora_fields}
        paths = cfg.lora_paths or []
        adapters = [[p.lora_name, p.lora_path] if hasattr(p, "lora_name") else plain(p) for p in paths]
        return {"model": cfg.model_path, "enable_lora": cfg.enable_lora, "adapters": adapters, "options": options}

    def definition() -> dict:
        parser = argparse.ArgumentParser(prog="sglang serve")
        ServerArgs.add_cli_args(parser)
        return {"parser": describe(parser, set(lora_fields) | {"model_path"})}

    return parse, definition


def run_case(parse, case: dict) -> dict:  # type: ignore[no-untyped-def]
    try:
        return {"ok": parse(case["entry"], case["argv"])}
    except Exit as exc:
        return {"error": ["ArgumentError" if exc.status == 2 else "SystemExit", exc.message or str(exc.status)]}
    except Exception as exc:  # every outcome is recorded, whatever the engine raises
        if os.environ.get("LORAFAST_ORACLE_TRACE"):
            traceback.print_exc()
        return {"error": [type(exc).__name__, str(exc)]}


def main() -> None:
    payload = json.load(sys.stdin)
    parse, definition = vllm_setup() if ENGINE == "vllm" else sglang_setup()
    result = definition() if payload.get("table") else {}
    result["results"] = [run_case(parse, case) for case in payload.get("cases", [])]
    json.dump(result, RESULT_STREAM)


if __name__ == "__main__":
    main()
