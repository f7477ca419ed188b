"""Launch-command oracle cases, and the parser-definition helpers both sides of tests/oracle/test_oracle_launch.py use.

`describe` writes an argparse parser down as rows (the engine's own, in tests/oracle/launch_runner.py, and
lorafast's replica); `encode` turns the engine's rows into the text of `lorafast/compat/_launch_flags.txt`.
`CASES` are (engine, entry, argv) command lines: the engine runs `argv` through the entry's own code and
lorafast parses the whole command, `ENTRIES[engine][entry] + argv`, shell-quoted.
"""

from __future__ import annotations

import argparse
import difflib
import json
import shlex
from typing import Any

ENTRIES = {
    "vllm": {"serve": "vllm serve", "api_server": "python -m vllm.entrypoints.openai.api_server"},
    "sglang": {"launch_server": "python3 -m sglang.launch_server", "serve": "sglang serve"},
}


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def describe(parser: argparse.ArgumentParser, dests: set[str]) -> list[dict[str, Any]]:
    """Every action in order: dest, nargs, the option strings registered for it (in registration order) and
    those its messages show, required, class; type, choices, default and const for `dests`."""
    registered: dict[int, list[str]] = {}
    for option, action in parser._option_string_actions.items():
        registered.setdefault(id(action), []).append(option)
    rows = []
    for action in parser._actions:
        row: dict[str, Any] = {
            "dest": action.dest,
            "nargs": action.nargs,
            "strings": registered.get(id(action), []),
            "shown": list(action.option_strings),
            "required": bool(action.required),
            "class": type(action).__name__,
        }
        if action.dest in dests:
            kind = action.type
            row.update(
                type=None if kind is None else getattr(kind, "__qualname__", repr(kind)),
                choices=_plain(action.choices),
                default=_plain(action.default),
                const=_plain(action.const),
            )
        rows.append(row)
    return rows


# The kind letter of each action class in _launch_flags.txt (see its header).
_KINDS = {
    ("_StoreAction", None): "",
    ("_StoreAction", "?"): "?",
    ("_StoreAction", "*"): "*",
    ("_StoreAction", "+"): "+",
    ("_StoreTrueAction", 0): "T",
    ("_AppendAction", None): "A",
    ("BooleanOptionalAction", 0): "B",
    ("EnableDisableAction", 0): "E",
    ("_HelpAction", 0): "h",
}


def _given(row: dict[str, Any]) -> list[str]:
    """The option strings the engine passed to `add_argument`: what a Boolean/EnableDisable action derived
    (`--no-X`, and `--disable-X` for `--enable-X` and back) is left out."""
    if row["class"] not in ("BooleanOptionalAction", "EnableDisableAction"):
        return row["strings"]
    given: list[str] = []
    for s in row["strings"]:
        derived = {"--no-" + g[2:] for g in given if g.startswith("--")}
        if row["class"] == "EnableDisableAction":
            for g in given:
                for prefix, inverse in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
                    if g.startswith(prefix):
                        derived.add(inverse + g.removeprefix(prefix))
        if s not in derived:
            given.append(s)
    return given


def _auto_dest(strings: list[str]) -> str:
    longs = [s for s in strings if s.startswith("--")]
    return (longs or strings)[0].lstrip("-").replace("-", "_")


def encode(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        if not row["strings"]:
            lines.append(f"@{row['dest']} {row['nargs'] or ''}".rstrip())
            continue
        kind = _KINDS.get((row["class"], row["nargs"]))
        if kind is None:  # an engine's own action class: how many values it takes, and its name
            kind = "x" + ("" if row["nargs"] is None else str(row["nargs"])) + ":" + row["class"]
        given = _given(row)
        parts = [",".join(given)] + [kind] * bool(kind) + ["!"] * row["required"]
        if row["dest"] != _auto_dest(given):
            parts.append("=" + row["dest"])
        lines.append(" ".join(parts))
    return "\n".join(lines)


def command(engine: str, entry: str, argv: list[str]) -> str:
    return " ".join([ENTRIES[engine][entry], *map(shlex.quote, argv)])


def _j(obj: Any) -> str:
    return json.dumps(obj)


# (entry, argv) per engine. Every LoRA flag, defaults, bad values, `--flag=value`, abbreviations, JSON items,
# unknown flags and non-LoRA flags with values mixed in.
# fmt: off
VLLM_CASES: list[tuple[str, list[str]]] = [
    ("serve", ["m"]),
    ("serve", ["m", "--enable-lora"]),
    ("serve", []),
    ("api_server", ["--model", "m", "--enable-lora"]),
    ("api_server", ["m", "--enable-lora", "--max-lora-rank", "64"]),
    ("serve", ["--model", "m", "--enable-lora", "--max-lora-rank", "32"]),
    ("serve", ["--model=m", "--enable-lora"]),
    ("serve", ["m", "--enable-lora", "--max-lora-rank", "33"]),
    ("serve", ["m", "--enable-lora", "--max-lora-rank", "x"]),
    ("serve", ["m", "--enable-lora", "--max-lora-rank=512", "--max-loras", "4", "--max-cpu-loras", "8"]),
    ("serve", ["m", "--enable-lora", "--max-loras", "0"]),
    ("serve", ["m", "--enable-lora", "--max-loras", "many"]),
    ("serve", ["m", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"]),
    ("serve", ["m", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "0"]),
    ("serve", ["m", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "-1"]),
    ("serve", ["m", "--enable-lora", "--max-cpu-loras", "None"]),
    ("serve", ["m", "--enable-lora", "--max-cpu-loras", "two"]),
    ("serve", ["m", "--max-loras", "0"]),  # LoRA off: no LoRAConfig, nothing validated
    ("serve", ["m", "--enable-lora", "--lora-modules", "a=/p", "b=/q", "--max-lora-rank", "8"]),
    ("serve", ["m", "--enable-lora", "--lora-modules", _j({"name": "a", "path": "/p", "base_model_name": "m"})]),
    ("serve", ["m", "--enable-lora", "--lora-modules", _j({"name": "a", "path": "/p", "is_3d_lora_weight": True}),
               "c=/r"]),
    ("serve", ["m", "--enable-lora", "--lora-modules", _j({"name": "a"})]),
    ("serve", ["m", "--enable-lora", "--lora-modules", _j({"name": "a", "path": "/p", "rank": 8})]),
    ("serve", ["m", "--enable-lora", "--lora-modules", _j([{"name": "a", "path": "/p"}])]),
    ("serve", ["m", "--enable-lora", "--lora-modules", "/only/a/path"]),
    ("serve", ["m", "--enable-lora", "--lora-modules", "a=/p,q"]),
    ("serve", ["m", "--enable-lora", "--lora-modules", "None", "", "a=/p=q"]),
    ("serve", ["m", "--enable-lora", "--lora-modules"]),
    ("serve", ["m", "--lora-modules", "a=/p"]),  # adapters named without --enable-lora
    ("serve", ["m", "--enable-lora", "--lora-target-modules", "o_proj", "qkv_proj", "--port", "8000"]),
    ("serve", ["m", "--enable-lora", "--lora-target-modules", "None"]),
    ("serve", ["m", "--enable-lora", "--lora-dtype", "bfloat16", "--fully-sharded-loras"]),
    ("serve", ["m", "--enable-lora", "--lora-dtype", "float32"]),
    ("serve", ["m", "--enable-lora", "--enable-moe-shared-loras", "--enable-mixed-moe-lora-format"]),
    ("serve", ["m", "--enable-lora", "--enable-tower-connector-lora", "--specialize-active-lora"]),
    ("serve", ["m", "--enable-lora", "--no-fully-sharded-loras", "--no-enable-moe-shared-loras"]),
    ("serve", ["m", "--enable-lora", "--disable-moe-shared-loras", "--disable-mixed-moe-lora-format"]),
    ("serve", ["m", "--enable-lora", "--disable-lora"]),
    ("serve", ["m", "--enable-lora", "--no-enable-lora"]),
    ("serve", ["m", "--enable-lora=yes"]),
    ("serve", ["m", "--enable_lora", "--max_lora_rank", "64", "--max_loras=2"]),
    ("serve", ["m", "--enable-lora", "--max-lora-r", "64"]),  # an abbreviation argparse accepts
    ("serve", ["m", "--enable-lora", "--max-lora", "64"]),  # ambiguous
    ("serve", ["m", "--enable-lora", "--max-lora-cls-labels", "0"]),
    ("serve", ["m", "--enable-lora", "--max-lora-cls-labels", "3"]),
    ("serve", ["m", "--enable-lora", "--default-mm-loras", _j({"image": "/p/img"})]),
    ("serve", ["m", "--enable-lora", "--default-mm-loras", _j({"image": 5})]),
    ("serve", ["m", "--enable-lora", "--not-a-flag", "--max-lora-rank", "32"]),
    ("serve", ["m", "--enable-lora", "--not-a-flag", "7", "--task", "embed"]),
    ("serve", ["m", "--enable-lora", "--max-lora-rank"]),
    ("serve", ["m", "--enable-lora", "--lora-modules", "a=/p", "--max-loras", "2", "-tp", "2", "--port", "8000",
               "--gpu-memory-utilization", "0.9", "--served-model-name", "base", "alias", "--trust-remote-code"]),
    ("serve", ["m", "--max-model-len", "4k", "--enable-lora", "--max-lora-rank", "16"]),
    ("serve", ["m", "-O3", "--enable-lora", "--max-lora-rank", "128"]),
    ("serve", ["m", "--enable-lora", "--model"]),
    ("serve", ["--enable-lora", "--served-model-name", "x"]),
    ("api_server", ["--enable-lora", "--served-model-name", "x"]),
    ("serve", ["m", "--enable-lora", "--max-lora-rank", "16", "--max-lora-rank", "64"]),
    ("serve", ["m", "--enable-lora", "extra-positional"]),
    ("serve", ["m", "--enable-lora", "--", "--max-lora-rank", "64"]),
    ("api_server", ["--model", "m", "--enable-lora", "--lora-modules", "a=/p", "--max-cpu-loras", "1",
                    "--max-loras", "3"]),
    ("serve", ["m", "--enable-lora", "--compilation-config.backend", "inductor", "--max-lora-rank", "16"]),
    ("serve", ["m", "--enable-lora", "--max-lora-rank.x", "5"]),  # a dotted key makes the value JSON
    ("serve", ["m", "-O", "3", "--enable-lora", "--max-loras=3"]),
    ("serve", ["m", "--enable-lora", "--default-mm-loras", "{bad json"]),  # the text names json.loads' address
    ("serve", ["m", "--enable-lora", "--default-mm-loras", "None"]),
    ("serve", ["m", "--enable-lora", "--help"]),
    ("serve", ["m", "--max-lora-rank", "x", "--help"]),  # the error comes first
    # --config: the file's settings, placed after the model and before the rest of the command
    ("serve", ["m", "--config", "@lora.yaml"]),
    ("serve", ["m", "--config", "@lora.yaml", "--max-lora-rank", "16", "--fully-sharded-loras"]),
    ("api_server", ["--model", "m", "--config", "@lora.yaml"]),  # its `false` is --no-X here, dropped by serve
    ("serve", ["--config", "@model.yaml", "--max-loras", "2"]),
    ("serve", ["--config", "@lora.yaml"]),
    ("serve", ["m", "--config", "@bad-rank.yaml"]),
    ("serve", ["m", "--config", "@lora.json"]),
    ("serve", ["m", "--config", "@missing.yaml"]),
    ("serve", ["m", "--config"]),
    ("serve", ["m", "--config", "@lora.yaml", "--config", "@model.yaml"]),
    ("serve", ["m", "--config", "@no-lora.yaml"]),
    ("api_server", ["--model", "m", "--config", "@no-lora.yaml"]),
]
# fmt: on

# What lorafast does not model, each with why (docs/compat.md, "Launch commands"); the oracle test checks that
# each still disagrees as described: the engine refuses a value of a flag that is not a LoRA flag.
VLLM_LIMITS: dict[tuple[str, ...], str] = {
    ("m", "--enable-lora", "--compilation-config.level", "3"): "CompilationConfig has no `level` (pydantic)",
    ("m", "--enable-lora", "--port", "http"): "--port's value is not an int",
}
SGLANG_LIMITS: dict[tuple[str, ...], str] = {
    ("--model-path", "m", "--lora-paths", "a=/p", "--tp", "two"): "--tp's value is not an int",
}

# Files the --config cases name ("@NAME": the test writes them to a temporary folder).
CONFIGS = {
    "lora.yaml": "enable-lora: true\nmax-lora-rank: 64\nmax_loras: 2\nlora-modules: [a=/p, b=/q]\n"
    "fully-sharded-loras: false\nenable-moe-shared-loras: true\n",
    "model.yaml": "model: m\nenable-lora: true\nlora-target-modules: [o_proj, qkv_proj]\n",
    "bad-rank.yaml": "enable-lora: true\nmax-lora-rank: 48\n",
    "no-lora.yaml": "enable-lora: false\nmax-loras: 0\n",  # serve drops a false it has no --no-X for
    "lora.json": "{}\n",
    "s-lora.yaml": "model-path: m\nenable-lora: true\nmax-lora-rank: 32\nlora-target-modules: [q_proj, v_proj]\n"
    "max_loras_per_batch: 4\nenable-lora-overlap-loading: false\nport: 30001\n",
    "s-paths.yaml": "model-path: m\nlora-paths: [a=/p]\n",
    "s-strict.yaml": "model-path: m\nlora-strict-loading: true\n",
    "s-list.yaml": "- a\n- b\n",
    "s-empty.yaml": "",
    "s-bad-batch.yaml": "max-loras-per-batch: 0\n",
}

# fmt: off
SGLANG_CASES: list[tuple[str, list[str]]] = [
    ("launch_server", ["--model-path", "m"]),
    ("launch_server", []),
    ("launch_server", ["--model", "m", "--enable-lora"]),
    ("serve", ["m", "--enable-lora", "--max-lora-rank", "32", "--lora-target-modules", "all"]),
    ("serve", ["--model-path", "m", "--lora-paths", "a=/p", "/q"]),
    ("serve", ["m", "--model-type", "llm", "--lora-paths", "a=/p"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "b=/q", "--max-lora-rank", "64"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", _j({"lora_name": "a", "lora_path": "/p", "pinned": True}),
                       "c=/r"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", _j({"lora_name": "a"})]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "{not json}"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", " a=/p "]),
    ("launch_server", ["--model-path", "m", "--lora-paths"]),
    ("launch_server", ["--model-path", "m", "--enable-lora"]),
    ("launch_server", ["--model-path", "m", "--enable-lora", "--max-lora-rank", "16"]),
    ("launch_server", ["--model-path", "m", "--enable-lora", "--lora-target-modules", "q_proj", "v_proj"]),
    ("launch_server", ["--model-path", "m", "--enable-lora", "--max-lora-rank", "0", "--lora-target-modules", "all"]),
    ("launch_server", ["--model-path", "m", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                       "all", "q_proj"]),
    ("launch_server", ["--model-path", "m", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                       "qkv"]),
    ("launch_server", ["--model-path", "m", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules"]),
    ("launch_server", ["--model-path", "m", "--max-lora-rank", "eight"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--max-loras-per-batch", "0"]),
    ("launch_server", ["--model-path", "m", "--max-loras-per-batch", "0"]),  # asserted even without LoRA
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--max-loras-per-batch", "-2"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "b=/q", "--max-loaded-loras", "4"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "b=/q", "c=/r", "--max-loaded-loras", "2",
                       "--max-loras-per-batch", "2"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--max-loaded-loras", "8"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--enable-lora-overlap-loading"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--enable-lora-overlap-loading",
                       "--max-loaded-loras", "16"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--enable-lora-overlap-loading",
                       "--max-loaded-loras", "17"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--lora-backend", "triton",
                       "--lora-eviction-policy", "fifo", "--max-lora-chunk-size", "64"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--lora-backend", "cuda"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--max-lora-chunk-size", "48"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--experts-shared-outer-loras",
                       "--lora-strict-loading", "--lora-use-virtual-experts"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--no-experts-shared-outer-loras",
                       "--no-lora-strict-loading"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--lora-drain-wait-threshold", "-1"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--lora-drain-wait-threshold", "2.5"]),
    ("launch_server", ["--model-path", "m", "--lora-paths=a=/p", "--max-lora-rank=16", "--port", "30000",
                       "--tp", "2", "--mem-fraction-static", "0.8", "--trust-remote-code"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--not-a-flag", "x"]),
    ("launch_server", ["--model-path", "m", "--enable-lora=1"]),
    ("launch_server", ["--model-path", "m", "--max-lora-r", "8", "--enable-lora", "--lora-target-modules", "all"]),
    ("launch_server", ["--model-path", "m", "--max-lora", "8"]),  # ambiguous
    ("launch_server", ["--model-path", "m", "--max_lora_rank", "8"]),  # SGLang has no underscore spelling
    ("serve", ["--lora-paths", "a=/p"]),
    ("serve", ["m", "--lora-paths", "a=/p", "--max-loras-per-batch", "4", "--max-loaded-loras", "4"]),
    ("serve", ["m", "--lora-paths", "a=/p", "--help"]),
    ("serve", ["m", "--model-type", "vision", "--lora-paths", "a=/p"]),
    ("serve", ["m", "--model-type=", "--lora-paths", "a=/p"]),
    ("serve", ["m", "--lora-paths", "a=/p", "--model-type"]),
    ("launch_server", ["--model-path", "m", "--max-loras-per-batch", "x", "-h"]),
    ("launch_server", ["--model-path", "m", "--lora-paths", "a=/p", "--moe-runner-backend", "triton"]),
    ("launch_server", ["--config", "@s-lora.yaml"]),
    ("launch_server", ["--config", "@s-lora.yaml", "--max-lora-rank", "64", "--lora-target-modules", "all"]),
    ("launch_server", ["--config", "@s-paths.yaml"]),
    ("launch_server", ["--config", "@s-strict.yaml"]),
    ("launch_server", ["--model-path", "m", "--config", "@s-list.yaml"]),
    ("launch_server", ["--model-path", "m", "--config", "@s-empty.yaml", "--lora-paths", "a=/p"]),
    ("launch_server", ["--model-path", "m", "--config", "@s-bad-batch.yaml"]),
    ("launch_server", ["--model-path", "m", "--config", "@lora.json"]),
    ("launch_server", ["--model-path", "m", "--config", "@missing.yaml"]),
    ("launch_server", ["--model-path", "m", "--config", "@s-lora.yaml", "--config", "@s-lora.yaml"]),
    ("serve", ["--config", "@s-lora.yaml"]),  # `sglang serve` looks for the model on the command line only
    ("serve", ["m", "--config", "@s-lora.yaml"]),
]
# fmt: on

CASES: list[tuple[str, str, list[str]]] = [("vllm", e, a) for e, a in VLLM_CASES] + [
    ("sglang", e, a) for e, a in SGLANG_CASES
]
LIMIT_CASES: list[tuple[str, str, list[str], str]] = [
    *(("vllm", "serve", list(a), why) for a, why in VLLM_LIMITS.items()),
    *(("sglang", "launch_server", list(a), why) for a, why in SGLANG_LIMITS.items()),
]


def with_files(argv: list[str], folder: str) -> list[str]:
    """`argv` with each "@NAME" replaced by the path of NAME in `folder` (see `CONFIGS`)."""
    return [f"{folder}/{a[1:]}" if a.startswith("@") else a for a in argv]


def _changes(old: list[str], new: list[str]) -> str:
    """`new` as edits of `old`: `=N` keeps N lines, `-N` drops N, `+LINE` adds LINE (`launch._flag_table` reads it)."""
    out: list[str] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if op == "equal":
            out.append(f"={i2 - i1}")
            continue
        if i2 > i1:
            out.append(f"-{i2 - i1}")
        out += [f"+{line}" for line in new[j1:j2]]
    return "\n".join(out)


def render_flag_tables(tables: dict[tuple[str, str], str]) -> str:
    """The text of python/lorafast/compat/_launch_flags.txt for the engines' flag tables (`encode`'s text): each
    engine's oldest release whole, each later one as its edits of the release before. The file's header
    comment is kept as it is."""
    from lorafast.compat import parse_engine_version
    from lorafast.compat.launch import FLAGS_FILE

    with open(FLAGS_FILE, encoding="utf-8") as f:
        header = [line for line in f.read().splitlines() if line.startswith("#")]
    out = list(header)
    previous: dict[str, tuple[str, list[str]]] = {}
    for (engine, version), text in sorted(tables.items(), key=lambda kv: (kv[0][0], parse_engine_version(kv[0][1]))):
        lines = text.splitlines()
        if engine in previous:
            base, old = previous[engine]
            out += [f"[{engine} {version} < {base}]", *_changes(old, lines).splitlines()]
        else:
            out += [f"[{engine} {version}]", *lines]
        previous[engine] = (version, lines)
    return "\n".join(out) + "\n"


def render_flags(tables: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    """The text of python/lorafast/compat/_launch_flags.txt for the engines' parser rows."""
    return render_flag_tables({release: encode(rows) for release, rows in tables.items()})
