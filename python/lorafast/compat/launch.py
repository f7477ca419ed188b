"""An engine's launch command, read as the engine reads it: `parse_launch`.

`parse_launch("vllm serve M --enable-lora --max-lora-rank 32 --lora-modules a=/p")` (a string, shell-split, or
an argv list) finds the engine and entry point from the program, then parses the rest with a replica of that
engine release's own argument parser: every option string of every flag, in the engine's order, with the
engine's nargs (`_launch_flags.txt`, generated from the released parsers), so `--port 8000`, abbreviations
(`--max-lora-r`), `--flag=value`, vLLM's underscore spellings and dotted JSON keys are read as the engine
reads them. The LoRA flags carry the engine's types, choices, defaults and actions; the other flags' values
are taken as strings and not checked. Then the LoRA settings are validated as the engine validates them at
start-up: vLLM's `LoRAConfig` (as `EngineArgs.create_engine_config` builds it), SGLang's
`check_lora_server_args`.

What the engine would refuse is returned as `problems` (stage "startup"), with the engine's exception type and
exact text, in the engine's order: the first is the one the engine raises. An argparse error, which the engine
prints as `<prog>: error: <text>` before exiting with status 2, is an `argparse.ArgumentError` with that text;
so are tokens no flag of the engine takes ("unrecognized arguments: ..."), which are also listed in `ignored`.
`tests/oracle/test_oracle_launch.py` runs the engines' own parsers on the same commands.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector, CompatProblem, LoraRef
from lorafast.compat.sglang._names import (
    MSG_ALL_ALONE,
    MSG_MAX_LORAS_POSITIVE,
    MSG_NEED_RANK_AND_TARGETS,
    SUPPORTED_LORA_TARGET_MODULES,
)

__all__ = ["LaunchCommand", "parse_launch"]

STAGE = "startup"


@dataclass(frozen=True)
class LaunchCommand:
    """What an engine makes of a launch command: its model, LoRA settings and adapters, and what it refuses."""

    engine: str  # "vllm" or "sglang"
    argv: tuple[str, ...]  # the tokens after the program (`vllm serve`, `python -m sglang.launch_server`, ...)
    model: str | None  # vLLM: `serve`'s MODEL, else --model (its default when absent); SGLang: --model-path
    rules: _versions.EngineRules
    enable_lora: bool | None  # as the engine decides it (SGLang: True when --lora-paths names adapters)
    lora_adapters: tuple[tuple[str, str], ...]  # (name, path): vLLM --lora-modules, SGLang --lora-paths, in order
    options: Mapping[str, Any]  # every LoRA setting after the engine's defaults, under the engine's dest names
    problems: tuple[CompatProblem, ...]  # what the engine refuses at start-up (stage "startup"), in its order
    ignored: tuple[str, ...]  # tokens no flag of the engine takes (the engine refuses them too)
    entry: str = ""  # vLLM "serve" / "api_server", SGLang "serve" / "launch_server"
    env: Mapping[str, str] = field(default_factory=dict)  # NAME=value assignments before the program

    @property
    def ok(self) -> bool:
        """No fatal problem: the engine gets past argument parsing and its LoRA checks."""
        return not any(p.fatal for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "entry": self.entry,
            "argv": list(self.argv),
            "env": dict(self.env),
            "model": self.model,
            "engine_version": self.rules.to_dict(),
            "enable_lora": self.enable_lora,
            "lora_adapters": [list(a) for a in self.lora_adapters],
            "options": _plain(dict(self.options)),
            "problems": [
                {"code": p.code, "stage": p.stage, "exc_type": p.exc_type, "message": p.message, "fatal": p.fatal}
                for p in self.problems
            ],
            "ignored": list(self.ignored),
            "ok": self.ok,
        }


def parse_launch(
    command: str | Sequence[str],
    *,
    engine_version: str | None = None,
    strict_version: bool = False,
    collect: bool = True,
) -> LaunchCommand:
    """Parse an engine's launch command as that engine release does (default: `_versions`' default version).

    `command` is the command line as typed (split like a POSIX shell, `\\`-newline continuations joined) or its
    argv. `NAME=value` prefixes (and `env`) are kept in `env`. Recognized programs: `vllm serve`, `python -m
    vllm.entrypoints.openai.api_server` (or `vllm.entrypoints.cli.main serve`), `sglang serve`, `python -m
    sglang.launch_server` (or `sglang.cli.main serve`), with any python interpreter; anything else is a
    `ValueError` naming the program. With `collect=False` the engine's first start-up error is raised instead of
    returned in `problems` (for `--help`, the engine's own `SystemExit(0)`).
    """
    if isinstance(command, str):
        tokens = shlex.split(_CONTINUATION.sub("", command))  # a pasted multi-line command, as the shell joins it
    else:
        tokens = [str(t) for t in command]
    env, engine, entry, argv = _program(tokens)
    rules = _versions.rules_for(engine, engine_version, strict=strict_version)
    col = Collector(collect)
    parse = _parse_vllm if engine == "vllm" else _parse_sglang
    parsed = parse(list(argv), entry, rules.rules, col)
    return LaunchCommand(
        engine=engine,
        argv=tuple(argv),
        model=parsed.model,
        rules=rules,
        enable_lora=parsed.enable_lora,
        lora_adapters=tuple(parsed.adapters),
        options=MappingProxyType(parsed.options),
        problems=tuple(col.problems),
        ignored=tuple(parsed.ignored),
        entry=entry,
        env=MappingProxyType(env),
    )


# --- the program ----------------------------------------------------------------------------------------

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_CONTINUATION = re.compile(r"\\\r?\n")
_PYTHON = re.compile(r"python[0-9.]*")
_MODULES = {  # python -m MODULE [subcommand]: (engine, entry, subcommand it needs)
    "vllm.entrypoints.openai.api_server": ("vllm", "api_server", None),
    "vllm.entrypoints.cli.main": ("vllm", "serve", "serve"),
    "sglang.launch_server": ("sglang", "launch_server", None),
    "sglang.cli.main": ("sglang", "serve", "serve"),
}
_PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def _program(tokens: list[str]) -> tuple[dict[str, str], str, str, list[str]]:
    env: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        if _ASSIGNMENT.match(tokens[i]):
            name, value = tokens[i].split("=", 1)
            env[name] = value
        elif os.path.basename(tokens[i]) == "env":
            while i + 1 < len(tokens) and tokens[i + 1].startswith("-"):  # env -i, env -u NAME
                i += 2 if tokens[i + 1] in ("-u", "--unset") else 1
        else:
            break
        i += 1
    if i == len(tokens):
        raise ValueError("not a vLLM or SGLang launch command: no program in it")
    program, rest = tokens[i], tokens[i + 1 :]
    name = os.path.basename(program)
    if _PYTHON.fullmatch(name):
        j = 0
        while j < len(rest) and rest[j].startswith("-") and not rest[j].startswith("-m"):
            j += 2 if rest[j] in _PYTHON_OPTIONS_WITH_VALUE else 1
        if j < len(rest) and rest[j].startswith("-m"):
            if rest[j] == "-m" and j + 1 < len(rest):
                module, rest = rest[j + 1], rest[j + 2 :]
            else:  # -mMODULE
                module, rest = rest[j][2:], rest[j + 1 :]
            known = _MODULES.get(module)
            if known is not None and (known[2] is None or rest[:1] == [known[2]]):
                return env, known[0], known[1], rest[1:] if known[2] else rest
            raise ValueError(f"not a vLLM or SGLang launch command: `{program} -m {' '.join([module, *rest[:1]])}`")
        raise ValueError(f"not a vLLM or SGLang launch command: `{program}` runs no engine module (`-m ...`)")
    if name in ("vllm", "sglang"):
        if rest[:1] == ["serve"]:
            return env, name, "serve", rest[1:]
        raise ValueError(f"not a launch command: `{name} {' '.join(rest[:1])}` (only `{name} serve` launches a server)")
    raise ValueError(f"not a vLLM or SGLang launch command: the program is `{program}`")


# --- the parser replica ---------------------------------------------------------------------------------


class _ParseError(Exception):
    """`ArgumentParser.error`: the engine prints `<prog>: error: <message>` and exits with status 2."""


class _Help(Exception):
    """`--help`: the engine prints its help and exits with status 0; no server starts."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise _ParseError(message)


class _HelpAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        raise _Help


class EnableDisableAction(argparse.BooleanOptionalAction):
    """vLLM's (vllm/utils/argparse_utils.py, 0.33 on): `--enable-X` also gets `--disable-X` (and back), while
    `--no-X` stays registered but leaves help and messages."""

    _inverse_prefixes = {"--enable-": "--disable-", "--disable-": "--enable-"}

    def __init__(self, option_strings: list[str], dest: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, *args, **kwargs)
        inverses = [
            inverse + opt.removeprefix(prefix)
            for opt in option_strings
            for prefix, inverse in self._inverse_prefixes.items()
            if opt.startswith(prefix)
        ]
        negated = {opt for opt in self.option_strings if opt not in option_strings}
        self.negative_option_strings = negated | set(inverses)
        self.visible_option_strings = [*option_strings, *inverses] if inverses else list(self.option_strings)
        self.option_strings = [*self.option_strings, *inverses]

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negative_option_strings)


_GENERIC: dict[str, dict[str, Any]] = {  # the kinds of _launch_flags.txt, for flags whose values are not checked
    "": {},
    "?": {"nargs": "?"},
    "*": {"nargs": "*"},
    "+": {"nargs": "+"},
    "T": {"action": "store_true"},
    "A": {"action": "append"},
    "B": {"action": argparse.BooleanOptionalAction},
    "E": {"action": EnableDisableAction},
    "h": {"action": _HelpAction},
}


class _Store(argparse.Action):
    """An engine's own action class taking values (`x`, `x*`, ... in _launch_flags.txt): the values are stored,
    and the class keeps the engine's name (SGLang's config-file merger names it in its errors)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _kind(kind: str) -> dict[str, Any]:
    if not kind.startswith("x"):
        return _GENERIC[kind]
    nargs, _, name = kind[1:].partition(":")
    return {"action": type(name, (_Store,), {}), "nargs": int(nargs) if nargs.isdigit() else (nargs or None)}


def _auto_dest(strings: list[str]) -> str:
    longs = [s for s in strings if s.startswith("--")]
    return (longs or strings)[0].lstrip("-").replace("-", "_")


#: the generated tables of the verified releases' parsers (its header says how to read it)
FLAGS_FILE = os.path.join(os.path.dirname(__file__), "_launch_flags.txt")


@functools.cache
def flag_sections() -> dict[tuple[str, str], tuple[str | None, str]]:
    """`_launch_flags.txt` by release: (engine, version) -> (the release its lines edit, or None for a whole
    table; the lines)."""
    sections: dict[tuple[str, str], tuple[str | None, list[str]]] = {}
    lines: list[str] = []
    with open(FLAGS_FILE, encoding="utf-8") as f:
        for line in f.read().splitlines():
            if line.startswith("#"):
                continue
            if line.startswith("["):
                engine, version, *base = line.strip("[]").replace(" < ", " ").split(" ")
                lines = []
                sections[(engine, version)] = (base[0] if base else None, lines)
            else:
                lines.append(line)
    return {release: (base, "\n".join(body) + "\n") for release, (base, body) in sections.items()}


@functools.cache
def _flag_table(engine: str, version: str) -> str:
    """The flag lines of an engine release: its table, or the table of the release before it with its edits
    applied."""
    base, changes = flag_sections()[(engine, version)]
    if base is None:
        return changes
    old = _flag_table(engine, base).splitlines()
    lines: list[str] = []
    at = 0
    for edit in changes.splitlines():
        if edit.startswith("+"):
            lines.append(edit[1:])
            continue
        count = int(edit[1:])
        if edit.startswith("="):
            lines += old[at : at + count]
        at += count
    return "\n".join(lines) + "\n"


@functools.cache
def _parser(engine: str, version: str, prog: str) -> _Parser:
    """The engine release's parser: every flag of its `_flag_table`, the LoRA ones with the engine's spec."""
    spec = _vllm_spec(version) if engine == "vllm" else _SGLANG_SPEC
    parser = _Parser(prog=prog, add_help=False)
    for line in _flag_table(engine, version).splitlines():
        first, *marks = line.split(" ")
        if first.startswith("@"):  # a positional
            dest = first[1:]
            parser.add_argument(dest, **{"nargs": marks[0] if marks else None, **spec.get(dest, {})})
            continue
        strings = first.split(",")
        kind = next((m for m in marks if m != "!" and not m.startswith("=")), "")
        dest = next((m[1:] for m in marks if m.startswith("=")), None) or _auto_dest(strings)
        kwargs = dict(spec.get(dest) or _kind(kind), dest=dest)
        if "!" in marks:
            kwargs["required"] = True
        action = parser.add_argument(*strings, **kwargs)
        if isinstance(action, EnableDisableAction):  # vLLM's _register_action: hidden strings stay registered
            action.option_strings = action.visible_option_strings
    return parser


def _parse(parser: _Parser, args: list[str], col: Collector) -> tuple[argparse.Namespace | None, list[str]]:
    """argparse's `parse_known_args`; an error or --help is recorded as the engine reports it."""
    try:
        return parser.parse_known_args(args)
    except _ParseError as exc:
        col.fail("launch_argument_error", argparse.ArgumentError(None, str(exc)), stage=STAGE)
    except _Help:
        _help(col)
    except Exception as exc:  # what an engine action raises goes out of argparse as it is (SGLang's asserts)
        col.fail("launch_argument_error", exc, stage=STAGE)
    return None, []


def _help(col: Collector) -> None:
    col.add(
        CompatProblem(
            "launch_help",
            "--help: the engine prints its help and exits with status 0; no server starts",
            SystemExit(0),
            stage=STAGE,
        )
    )


def _unrecognized(extras: list[str], col: Collector, hint: str = "") -> None:
    if extras:  # argparse's parse_args, after parse_known_args
        message = "unrecognized arguments: " + " ".join(extras) + hint
        col.fail("launch_unrecognized_arguments", argparse.ArgumentError(None, message), stage=STAGE)


def optional_type(return_type: Callable[[str], Any]) -> Callable[[str], Any]:
    """vLLM's `optional_type` (vllm/engine/arg_utils.py): "" and "None" are None."""

    def _optional_type(val: str) -> Any:
        if val == "" or val == "None":
            return None
        return parse_type(return_type)(val)

    return _optional_type


def parse_type(return_type: Callable[[str], Any]) -> Callable[[str], Any]:
    """vLLM's `parse_type`: a ValueError becomes argparse's "Value X cannot be converted to <type>."."""

    def _parse_type(val: str) -> Any:
        try:
            return return_type(val)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"Value {val} cannot be converted to {return_type}.") from e

    return _parse_type


@dataclass
class _Parsed:
    model: str | None = None
    enable_lora: bool | None = None
    adapters: list[tuple[str, str]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def _plain(value: Any) -> Any:
    if isinstance(value, LoraRef):
        return {"lora_id": value.lora_id, "lora_name": value.name, "lora_path": value.path, "pinned": value.pinned}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# --- vLLM -----------------------------------------------------------------------------------------------

_VLLM_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # EngineArgs.model
_VLLM_RANKS = [1, 8, 16, 32, 64, 128, 256, 320, 512]  # vllm/config/lora.py MaxLoRARanks
_LORA_MODULE_PATH_MODULE = "vllm.entrypoints.openai.models.protocol"


@dataclass
class LoRAModulePath:
    """vLLM's (vllm/entrypoints/openai/models/protocol.py): a `--lora-modules` item. Its module is vLLM's, so
    that Python's own TypeError texts for bad JSON fields name it as they do in vLLM."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False


LoRAModulePath.__module__ = _LORA_MODULE_PATH_MODULE


class LoRAParserAction(argparse.Action):
    """vLLM's `--lora-modules` action: `name=path` (without a comma) or a JSON object of LoRAModulePath fields."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if values is None:
            values = []
        if isinstance(values, str):
            raise TypeError("Expected values to be a list")
        lora_list: list[LoRAModulePath] = []
        for item in values:
            if item in [None, ""]:
                continue
            if "=" in item and "," not in item:
                name, path = item.split("=", 1)
                lora_list.append(LoRAModulePath(name, path))
            else:
                try:
                    lora_dict = json.loads(item)
                    lora_list.append(LoRAModulePath(**lora_dict))
                except json.JSONDecodeError:
                    parser.error(f"Invalid JSON format for --lora-modules: {item}")
                except TypeError as e:
                    parser.error(f"Invalid fields for --lora-modules: {item} - {e!s}")
        setattr(namespace, self.dest, lora_list)


@functools.cache
def _vllm_spec(version: str) -> dict[str, dict[str, Any]]:
    """The LoRA flags of `make_arg_parser` (the "LoRAConfig" group and --lora-modules) and the model's."""
    boolean = EnableDisableAction if _versions.at_least("vllm", version, "0.33.0") else argparse.BooleanOptionalAction
    spec: dict[str, dict[str, Any]] = {
        "model_tag": {"type": str},
        "model": {"type": str, "default": _VLLM_DEFAULT_MODEL},
        "lora_modules": {"action": LoRAParserAction, "nargs": "+", "type": optional_type(str)},
        "enable_lora": {"action": boolean},
        "max_loras": {"type": int, "default": 1},
        "max_lora_rank": {"type": int, "choices": list(_VLLM_RANKS), "default": 16},
        "lora_dtype": {"type": str, "choices": ["auto", "bfloat16", "float16"], "default": "auto"},
        "enable_tower_connector_lora": {"action": boolean, "default": False},
        "max_cpu_loras": {"type": optional_type(int)},
        "fully_sharded_loras": {"action": boolean, "default": False},
        "lora_target_modules": {"nargs": "+", "type": optional_type(str)},
        # dict[str, str] | None: get_kwargs gives it parse_type(json.loads), wrapped in optional_type
        "default_mm_loras": {"type": optional_type(parse_type(json.loads))},
        "specialize_active_lora": {"action": boolean, "default": False},
        "enable_mixed_moe_lora_format": {"action": boolean, "default": False},
        "enable_moe_shared_loras": {"action": boolean, "default": False},
    }
    if _versions.at_least("vllm", version, "0.33.0"):
        spec["max_lora_cls_labels"] = {"type": optional_type(int)}
    return spec


def _vllm_lora_dests(version: str) -> list[str]:
    return [d for d in _vllm_spec(version) if d not in ("model", "model_tag")]


# `vllm`'s top-level parser (vllm/entrypoints/cli/main.py): what a config file's `--no-X` is looked up in
_VLLM_TOP = argparse.ArgumentParser(add_help=True)
_VLLM_TOP.add_argument("-v", "--version", action="version")
_MODEL_FLAG = re.compile(r"^--model(=.+|$)")
_CONFIG_FLAG = re.compile(r"^--config(=.+|$)")
_SERVED_NAME_FLAG = re.compile(r"^--served[-_]model[-_]name(=.+|$)")
_NAME_PART = re.compile(r"(?<=--)[^\.]*")


def _human_readable_int(value: str) -> int:
    """vLLM's `human_readable_int` ('1k', '2M', ...), for dotted JSON keys."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in "kmgt":
            return int(float(number) * 10 ** (3 * ("kmgt".index(suffix) + 1)))
        try:
            return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1))
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
                f"{number}{suffix.lower()} instead?"
            ) from e
    return int(value)


def _vllm_preprocess(args: list[str], parser: argparse.ArgumentParser, read_config: bool = True) -> list[str]:
    """`FlexibleArgumentParser.parse_args` before argparse: `serve`'s --model moved to the front, underscores to
    dashes in flag names, `-O3`, `--config` read, and dotted keys (`--json-arg.key value`) merged into JSON values
    at the end. `parser` is the one whose `parse_args` runs: `vllm serve`'s top-level parser, or the api server's."""
    if args and args[0] == "serve":
        at = next((i for i, arg in enumerate(args) if _MODEL_FLAG.match(arg)), None)
        if at is not None:
            if args[at] == "--model":
                tag, rest = args[at + 1], at + 2  # IndexError when --model ends the command, as in vLLM
            else:
                tag, rest = args[at].removeprefix("--model="), at + 1
            args = ["serve", tag, *args[1:at], *args[rest:]]
        if (
            len(args) > 1
            and args[1].startswith("-")
            and not any(_CONFIG_FLAG.match(arg) for arg in args)
            and any(_SERVED_NAME_FLAG.match(arg) for arg in args)
        ):
            raise ValueError(
                "`model` should be provided as the first positional argument when "
                "using `vllm serve`. i.e. `vllm serve <model> --<arg> <value>`."
            )
    if "--config" in args and read_config:
        args = _vllm_config(args, parser)
    processed: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            processed.append("--help")
        elif arg.startswith("--"):
            name, eq, given = arg.partition("=")
            processed.append(_NAME_PART.sub(lambda m: m.group(0).replace("_", "-"), name, count=1) + eq + given)
        elif arg.startswith("-O") and arg != "-O":
            processed += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            processed.append("--optimization-level")
        else:
            processed.append(arg)

    delete: set[int] = set()
    dict_args: defaultdict[str, dict[str, Any]] = defaultdict(dict)
    for i, arg in enumerate(processed):
        if i in delete or (arg.startswith("--") and "." not in arg):
            continue
        if arg.startswith("-") and "." in arg:
            if "=" in arg:
                arg, value_str = arg.split("=", 1)
                if "." not in arg:
                    continue
            else:
                value_str = processed[i + 1]
                delete.add(i + 1)
            if arg.endswith("+"):
                arg, value_str = arg[:-1], json.dumps(list(value_str.split(",")))
            key, *keys = arg.split(".")
            value: Any
            try:
                value = json.loads(value_str)
            except json.JSONDecodeError:
                try:
                    value = _human_readable_int(value_str)
                except (ValueError, argparse.ArgumentTypeError):
                    value = value_str
            for k in reversed(keys):
                value = {k: value}
            _merge(dict_args[key], value)
            delete.add(i)
    processed = [a for i, a in enumerate(processed) if i not in delete]
    for key, value in dict_args.items():
        processed += [key, json.dumps(value)]
    return processed


def _yaml(path: str) -> Any:
    import yaml  # PyYAML, which both engines need; an ImportError says --config cannot be read here

    with open(path) as f:
        return yaml.safe_load(f)


def _vllm_config(args: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`FlexibleArgumentParser._pull_args_from_config` and `load_config_file`: the YAML file's keys become flags,
    after the subcommand and model and before the rest (command line > config file > defaults)."""
    assert args.count("--config") <= 1, "More than one config file specified!"
    index = args.index("--config")
    if index == len(args) - 1:
        raise ValueError("No config file specified! Please check your command-line arguments.")
    file_path = args[index + 1]
    extension = file_path.split(".")[-1]
    if extension not in ("yaml", "yml"):
        raise ValueError(f"Config file must be of a yaml/yml type. {extension} supplied")
    config_args: list[str] = []
    for key, value in _yaml(file_path).items():
        if isinstance(value, bool):
            if value:
                config_args.append("--" + key)
            elif (no_key := f"--no-{key}") in parser._option_string_actions:
                config_args.append(no_key)
        elif isinstance(value, list):
            if value:
                config_args += ["--" + key, *(str(item) for item in value)]
        elif isinstance(value, dict):
            config_args += ["--" + key, json.dumps(value)]
        else:
            config_args += ["--" + key, str(value)]
    if args[0].startswith("-"):
        return config_args + args[0:index] + args[index + 2 :]
    if args[0] == "serve":
        model_in_cli = len(args) > 1 and not args[1].startswith("-")
        if not model_in_cli and not any(arg == "--model" for arg in config_args):
            raise ValueError(
                "No model specified! Please specify model either as a positional argument or in a config file."
            )
        if model_in_cli:
            return args[:2] + config_args + args[2:index] + args[index + 2 :]
        return args[:1] + config_args + args[1:index] + args[index + 2 :]
    return [args[0]] + config_args + args[1:index] + args[index + 2 :]


def _merge(original: dict[str, Any], update: dict[str, Any]) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(original.get(k), dict):
            _merge(original[k], v)
        elif isinstance(v, list) and isinstance(original.get(k), list):
            original[k] += v
        else:
            original[k] = v


def _parse_vllm(argv: list[str], entry: str, version: str, col: Collector) -> _Parsed:
    spec = _vllm_spec(version)
    dests = _vllm_lora_dests(version)
    out = _Parsed(model=_VLLM_DEFAULT_MODEL, options={d: _frozen(spec[d].get("default")) for d in dests})
    args = ["serve", *argv] if entry == "serve" else list(argv)
    # FlexibleArgumentParser.error's hint, for `serve` only
    task_hint = args[:1] == ["serve"] and any(re.match(r"^--task(=.+|$)", a) for a in args[1:])
    parser = _parser("vllm", version, "vllm serve")
    top = _VLLM_TOP if entry == "serve" else parser
    try:
        try:
            processed = _vllm_preprocess(args, top)
        except ImportError as exc:
            col.warn("launch_config_not_read", f"--config: {exc}; its settings are not read", stage=STAGE)
            processed = _vllm_preprocess(args, top, read_config=False)
    except Exception as exc:  # what vLLM raises: its ValueErrors and asserts, a config file's OSError or YAML error,
        col.fail("launch_argument_error", exc, stage=STAGE)  # the IndexError of a flag that ends the command
        return out
    if entry == "serve":
        processed = processed[1:]  # the top-level parser hands the rest to the serve subcommand's parser
    ns, extras = _parse(parser, processed, col)
    if ns is None:
        return out
    out.ignored = list(extras)
    hint = ""
    if task_hint and re.search(r"(^|\s)--task(=|\s|$)", " ".join(extras)):
        hint = (
            "\n\nHint: --task is not a vllm serve option. "
            "For embedding, reranking, or reward models, use "
            "--runner pooling. To adapt a generative model for pooling, "
            "also use --convert embed, --convert classify, or "
            "--convert reward."
        )
    _unrecognized(extras, col, hint)
    # ServeSubcommand.cmd: the positional MODEL wins; the api_server entry point reads only --model
    out.model = ns.model_tag if entry == "serve" and ns.model_tag is not None else ns.model
    out.enable_lora = ns.enable_lora
    modules = ns.lora_modules or []
    out.adapters = [(m.name, m.path) for m in modules]
    out.options = {d: _frozen(getattr(ns, d)) for d in dests}
    out.options["lora_modules"] = tuple(_plain(m) for m in modules) if ns.lora_modules is not None else None
    if ns.enable_lora:
        _vllm_lora_config(ns, version, out, col)
    return out


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _vllm_lora_config(ns: argparse.Namespace, version: str, out: _Parsed, col: Collector) -> None:
    """`EngineArgs.create_engine_config`'s `LoRAConfig(...)`, validated as vLLM's pydantic dataclass does."""
    kwargs: dict[str, Any] = {
        "max_lora_rank": ns.max_lora_rank,
        "max_loras": ns.max_loras,
        "default_mm_loras": ns.default_mm_loras,
        "fully_sharded_loras": ns.fully_sharded_loras,
        "lora_dtype": ns.lora_dtype,
        "target_modules": ns.lora_target_modules,
        "enable_tower_connector_lora": ns.enable_tower_connector_lora,
        "specialize_active_lora": ns.specialize_active_lora,
        "enable_mixed_moe_lora_format": ns.enable_mixed_moe_lora_format,
        "enable_moe_shared_loras": ns.enable_moe_shared_loras,
    }
    if _versions.at_least("vllm", version, "0.33.0"):
        kwargs["max_lora_cls_labels"] = ns.max_lora_cls_labels
    kwargs["max_cpu_loras"] = ns.max_cpu_loras if ns.max_cpu_loras and ns.max_cpu_loras > 0 else None
    try:
        config = _lora_config_class(version)(**kwargs)
    except ValueError as exc:  # pydantic's ValidationError (a ValueError)
        col.fail("vllm_lora_config", exc, stage=STAGE)
        return
    out.options["max_cpu_loras"] = config.max_cpu_loras


@functools.cache
def _lora_config_class(version: str) -> Callable[..., Any]:
    """vLLM's `LoRAConfig` (vllm/config/lora.py): its fields in order, their types and bounds, and its model
    validator, as a pydantic dataclass, so that a rejection is pydantic's ValidationError with pydantic's text.
    (`lora_dtype` is also a `torch.dtype` there; from a command it is one of argparse's choices.)"""
    try:
        from typing import Literal

        from pydantic import ConfigDict, Field, model_validator
        from pydantic.dataclasses import dataclass as pydantic_dataclass
    except ImportError:
        return _lora_config_without_pydantic(version)

    ranks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
    namespace: dict[str, Any] = {
        "__annotations__": {
            "max_lora_rank": ranks,
            "max_loras": int,
            "fully_sharded_loras": bool,
            "max_cpu_loras": "int | None",
            "lora_dtype": Literal["auto", "float16", "bfloat16"],
            "target_modules": "list[str] | None",
            "default_mm_loras": "dict[str, str] | None",
            "enable_tower_connector_lora": bool,
            "specialize_active_lora": bool,
            "enable_mixed_moe_lora_format": bool,
            "enable_moe_shared_loras": bool,
        },
        "max_lora_rank": 16,
        "max_loras": Field(default=1, ge=1),
        "fully_sharded_loras": False,
        "max_cpu_loras": None,
        "lora_dtype": "auto",
        "target_modules": None,
        "default_mm_loras": None,
        "enable_tower_connector_lora": False,
        "specialize_active_lora": False,
        "enable_mixed_moe_lora_format": False,
        "enable_moe_shared_loras": False,
    }
    if _versions.at_least("vllm", version, "0.33.0"):
        namespace["__annotations__"]["max_lora_cls_labels"] = "int | None"
        namespace["max_lora_cls_labels"] = Field(default=None, ge=1)

    def _validate_lora_config(self: Any) -> Any:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        return self

    namespace["_validate_lora_config"] = model_validator(mode="after")(_validate_lora_config)
    cls = type("LoRAConfig", (), namespace)
    return pydantic_dataclass(cls, config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))  # type: ignore[no-any-return]


def _lora_config_without_pydantic(version: str) -> Callable[..., Any]:
    """Without pydantic installed: the bounds and the model validator, as a ValueError in pydantic's layout
    (without its documentation link, which names the installed pydantic's version)."""

    class LoRAConfig:
        def __init__(self, **kwargs: Any) -> None:
            errors = [
                f"{name}\n  Input should be greater than or equal to 1 [type=greater_than_equal, "
                f"input_value={kwargs[name]!r}, input_type={type(kwargs[name]).__name__}]"
                for name in ("max_loras", "max_lora_cls_labels")
                if isinstance(kwargs.get(name), int) and kwargs[name] < 1
            ]
            if errors:
                s = "s" if len(errors) > 1 else ""
                raise ValueError(f"{len(errors)} validation error{s} for LoRAConfig\n" + "\n".join(errors))
            self.max_cpu_loras = kwargs["max_cpu_loras"]
            if self.max_cpu_loras is None:
                self.max_cpu_loras = kwargs["max_loras"]
            elif self.max_cpu_loras < kwargs["max_loras"]:
                raise ValueError(
                    "1 validation error for LoRAConfig\n  Value error, "
                    f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({kwargs['max_loras']})."
                )

    return LoRAConfig


# --- SGLang ---------------------------------------------------------------------------------------------


class LoRAPathAction(argparse.Action):
    """SGLang's `--lora-paths` action (sglang/srt/arg_groups/argparse_actions.py): an item in braces is JSON."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        lora_paths: list[Any] = []
        if values:
            assert isinstance(values, list), "Expected a list of LoRA paths."
            for lora_path in values:
                lora_path = lora_path.strip()
                if lora_path.startswith("{") and lora_path.endswith("}"):
                    obj = json.loads(lora_path)
                    assert "lora_path" in obj and "lora_name" in obj, (
                        f"{lora_path!r} looks like a JSON str, but it does not contain 'lora_name' and 'lora_path' keys."
                    )
                    lora_paths.append(obj)
                else:
                    lora_paths.append(lora_path)
        setattr(namespace, self.dest, lora_paths)


# The `lora` namespace of ServerArgs (sglang/srt/arg_groups/fields/lora.py), as add_cli_args_from_dataclass
# registers it, and the model's flag.
_SGLANG_SPEC: dict[str, dict[str, Any]] = {
    "model_path": {"type": str},
    "enable_lora": {"action": "store_true", "default": None},
    "enable_lora_overlap_loading": {"action": "store_true", "default": None},
    "max_lora_rank": {"type": int},
    "lora_target_modules": {"type": str, "nargs": "*", "choices": [*SUPPORTED_LORA_TARGET_MODULES, "all"]},
    "lora_paths": {"action": LoRAPathAction, "type": str, "nargs": "*"},
    "max_loaded_loras": {"type": int},
    "max_loras_per_batch": {"type": int, "default": 8},
    "lora_eviction_policy": {"type": str, "choices": ["lru", "fifo"], "default": "lru"},
    "lora_backend": {
        "type": str,
        "choices": ["triton", "csgmv", "ascend", "torch_native", "triton_v2"],
        "default": "csgmv",
    },
    "max_lora_chunk_size": {"type": int, "choices": [16, 32, 64, 128], "default": 16},
    "experts_shared_outer_loras": {"action": argparse.BooleanOptionalAction},
    "lora_use_virtual_experts": {"action": "store_true", "default": False},
    "lora_strict_loading": {"action": argparse.BooleanOptionalAction, "default": False},
    "lora_drain_wait_threshold": {"type": float, "default": 0.0},
}
_SGLANG_LORA_DESTS = [d for d in _SGLANG_SPEC if d != "model_path"]


def _sglang_not_modelled(ns: argparse.Namespace) -> list[str]:
    """The checks of check_lora_server_args that read flags outside the lora namespace as earlier resolution
    hooks left them (the speculative algorithm after NEXTN became EAGLE, the MoE runners after their defaults,
    quantization from the model's config), or the platform: named, not answered."""
    notes = []
    if ns.enable_lora and ns.speculative_algorithm not in (None, "NGRAM"):
        notes.append("--speculative-algorithm: check_lora_speculative_compatibility")
    if ns.enable_lora and ns.lora_backend == "triton_v2" and not (ns.moe_runner_backend or "").startswith("lora"):
        notes.append("--lora-backend triton_v2: _check_v2_lora_modes (attention DP, PD-multiplexing, TBO, ROCm)")
    for dest in ("moe_runner_backend", "speculative_moe_runner_backend"):
        if (getattr(ns, dest) or "").startswith("lora"):
            notes.append(f"--{dest.replace('_', '-')} {getattr(ns, dest)}: check_lora_moe_runner_args")
    return [f"{note} is not modelled" for note in notes]


_SGLANG_BACKENDS = ("llm", "diffusion")  # sglang/cli/serve.py's built-in serve backends


def _sglang_serve_argv(argv: list[str], col: Collector) -> list[str] | None:
    """`sglang serve`: `_extract_model_type_override`, `_normalize_positional_model_path`, the backend name, help
    and model-path checks of `sglang.cli.serve.serve` (`auto` taken as the LLM server: detection reads the
    model; out-of-tree backends are not known)."""
    backend, filtered, i = "auto", [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--model-type":
            if i + 1 >= len(argv):
                col.fail("launch_argument_error", ValueError("Error: --model-type requires a value."), stage=STAGE)
                return None
            backend, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--model-type="):
            backend = arg.split("=", 1)[1]
        else:
            filtered.append(arg)
        i += 1
    if not backend:
        col.fail("launch_argument_error", ValueError("Error: --model-type requires a non-empty value."), stage=STAGE)
        return None
    if filtered and not filtered[0].startswith("-"):
        filtered = ["--model-path", filtered[0], *filtered[1:]]
    if backend not in ("auto", *_SGLANG_BACKENDS):  # ServeBackendRegistry.get, before a named backend's help
        available = ", ".join(("auto", *_SGLANG_BACKENDS))
        message = f"Unknown serve backend {backend!r}. Available values: {available}."
        col.fail("launch_argument_error", ValueError(message), stage=STAGE)
        return None
    if any(h in filtered for h in ("-h", "--help")):
        _help(col)
        return None
    if backend == "diffusion":
        col.warn("launch_not_modelled", "--model-type diffusion: SGLang's diffusion server is not read", stage=STAGE)
        return None
    if _sglang_model_path(filtered) is None:
        col.fail(
            "launch_argument_error",
            Exception("Error: --model-path is required. Please provide the path to the model."),
            stage=STAGE,
        )
        return None
    return filtered


def _sglang_model_path(argv: list[str]) -> str | None:
    """`sglang.cli.utils.try_get_model_path`: the exact spellings only, before argparse runs."""
    for i, arg in enumerate(argv):
        if arg in ("--model-path", "--model"):
            if i + 1 < len(argv):
                return argv[i + 1]
        elif arg.startswith("--model-path=") or arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return None


def _parse_sglang(argv: list[str], entry: str, version: str, col: Collector) -> _Parsed:
    out = _Parsed(options={d: _frozen(_SGLANG_SPEC[d].get("default")) for d in _SGLANG_LORA_DESTS})
    args: list[str] | None = list(argv)
    if entry == "serve":
        args = _sglang_serve_argv(list(argv), col)
    if args is None:
        return out
    parser = _parser("sglang", version, "sglang serve")
    if "--config" in args:
        try:
            args = _sglang_config(args, parser)
        except ImportError as exc:
            col.warn("launch_config_not_read", f"--config: {exc}; its settings are not read", stage=STAGE)
        except Exception as exc:  # ConfigArgumentMerger's ValueErrors, the file's OSError or YAML error
            col.fail("launch_argument_error", exc, stage=STAGE)
            return out
    ns, extras = _parse(parser, args, col)
    if ns is None:
        return out
    out.ignored = list(extras)
    _unrecognized(extras, col)
    out.model = ns.model_path
    _check_lora_server_args(ns, version, out, col)
    return out


def _sglang_config(args: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """SGLang's `ConfigArgumentMerger` (sglang/srt/utils/server_args_config_parser.py): the YAML file's keys
    become flags before the command line's (command line > config file > defaults). Only store_true and
    single-value actions may be set there."""

    def keys(action: argparse.Action) -> set[str]:
        return {action.dest} | {o[2:].replace("-", "_") for o in action.option_strings if o.startswith("--")}

    actions = parser._actions
    store_true = {k for a in actions if isinstance(a, argparse._StoreTrueAction) for k in keys(a)}
    supported = [
        a for a in actions if isinstance(a, (argparse._StoreTrueAction, argparse._StoreAction)) or a.nargs is None
    ]
    supported_keys = {k for a in supported for k in keys(a)}
    unsupported = {
        k: a
        for a in actions
        if a.option_strings and a not in supported and not {"--config", "--help", "-h"} & set(a.option_strings)
        for k in keys(a)
        if k not in supported_keys
    }
    at = [i for i, arg in enumerate(args) if arg == "--config"]
    if len(at) > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    if at[0] == len(args) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = args[at[0] + 1]
    suffix = os.path.splitext(path)[1]
    if suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {suffix}")
    if not os.path.exists(path):
        raise ValueError(f"Config file not found: {path}")
    config = _yaml(path)
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    config_args: list[str] = []
    for key, value in config.items():
        key_norm = key.replace("-", "_")
        if key_norm in unsupported:
            name = type(unsupported[key_norm]).__name__
            raise ValueError(f"Unsupported config option '{key_norm}' with action '{name}'")
        if isinstance(value, bool):
            if key_norm not in store_true:
                config_args += [f"--{key}", str(value).lower()]
            elif value:
                config_args.append(f"--{key}")
        elif isinstance(value, list):
            if value:
                config_args += [f"--{key}", *(str(item) for item in value)]
        else:
            config_args += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return config_args + args[: at[0]] + args[at[0] + 2 :]


def _check_lora_server_args(ns: argparse.Namespace, version: str, out: _Parsed, col: Collector) -> None:
    """SGLang's `check_lora_server_args` (sglang/srt/arg_groups/lora_hook.py), on the values as parsed."""
    from lorafast.compat.sglang._paths import parse_lora_paths

    def fail(message: str) -> None:
        col.fail("sglang_server_args", AssertionError(message), stage=STAGE)

    if not ns.max_loras_per_batch > 0:
        fail(MSG_MAX_LORAS_POSITIVE)
    if ns.lora_paths and ns.enable_lora is None:
        ns.enable_lora = True  # "--enable-lora is set to True because --lora-paths is provided."
    paths = ns.lora_paths
    if ns.enable_lora:
        if ns.enable_lora_overlap_loading is None:
            ns.enable_lora_overlap_loading = False
        if ns.enable_lora_overlap_loading:
            limit = ns.max_loras_per_batch * 2
            if not (ns.max_loaded_loras is not None and ns.max_loaded_loras <= limit):
                fail(
                    "Enabling LoRA overlap loading requires pinning LoRA adapter weights in CPU memory, "
                    f"so --max-loaded-loras must be less than or equal to double --max-loras-per-batch: {limit}"
                )
        paths = parse_lora_paths(ns.lora_paths, engine_version=version)
        if ns.lora_target_modules:
            ns.lora_target_modules = set(ns.lora_target_modules)
            if "all" in ns.lora_target_modules and len(ns.lora_target_modules) != 1:
                fail(MSG_ALL_ALONE)
        if not (paths or (ns.max_lora_rank and ns.lora_target_modules)):
            fail(MSG_NEED_RANK_AND_TARGETS)
        if ns.max_loaded_loras is not None:
            if not ns.max_loaded_loras >= ns.max_loras_per_batch:
                fail(
                    "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                    f"max_loaded_loras={ns.max_loaded_loras}, max_loras_per_batch={ns.max_loras_per_batch}"
                )
            elif not len(paths) <= ns.max_loaded_loras:
                fail(
                    "The number of LoRA paths should not exceed max_loaded_loras. "
                    f"max_loaded_loras={ns.max_loaded_loras}, lora_paths={len(paths)}"
                )
        chunk = ns.max_lora_chunk_size
        if chunk is not None and not (16 <= chunk <= 128 and (chunk & (chunk - 1)) == 0):
            fail("--max-lora-chunk-size must be a power of 2 between 16 and 128.")
        if not ns.lora_drain_wait_threshold >= 0.0:
            fail("--lora-drain-wait-threshold must be non-negative.")
    for note in _sglang_not_modelled(ns):
        col.warn("launch_not_modelled", note, stage=STAGE)
    out.enable_lora = ns.enable_lora
    out.options = {d: _frozen(getattr(ns, d)) for d in _SGLANG_LORA_DESTS}
    if ns.enable_lora:
        out.options["lora_paths"] = tuple(paths)
        out.options["lora_target_modules"] = (
            frozenset(ns.lora_target_modules) if isinstance(ns.lora_target_modules, set) else ns.lora_target_modules
        )
        out.adapters = [(ref.name, ref.path) for ref in paths]
    else:
        out.adapters = [(ref.name, ref.path) for ref in parse_lora_paths(ns.lora_paths, engine_version=version)]
