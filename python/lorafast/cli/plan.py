"""`lorafast plan -a NICK=PATH ...`: plan a `set_lora` call from the command line.

Exit status: 1 when the call would fail (SGLang's own error, said as SGLang says it) or an adapter cannot be
read; 2 for a malformed `--adapter`, `--alpha` or `--base-weights` value.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._status import ExitStatus
from lorafast.compat.diffusion import LORA_MERGE_MODES, PIPELINE_MODULES


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan a set_lora call: what is merged, dynamic, skipped or unmerged",
        description="Plan an SGLang diffusion set_lora call without touching weights.",
    )
    p.add_argument(
        "--adapter",
        "-a",
        action="append",
        required=True,
        metavar="NICK=PATH[:STRENGTH][@TARGET]",
        help="an adapter to apply (repeat, in order); NICK alone reuses an adapter loaded in --state",
    )
    p.add_argument("--alpha", action="append", metavar="NICK=ALPHA", help="lora_alpha override for one adapter")
    p.add_argument(
        "--merge-mode", choices=LORA_MERGE_MODES, default=None, help="default: the state's server mode (auto)"
    )
    p.add_argument(
        "--sharded",
        nargs="*",
        choices=PIPELINE_MODULES,
        metavar="MODULE",
        help="weights are FSDP-sharded (DTensor): all modules, or only those named",
    )
    p.add_argument(
        "--quantized",
        nargs="*",
        choices=PIPELINE_MODULES,
        metavar="MODULE",
        help="weights are quantized and cannot take a merged delta (SGLang 0.5.23): all modules, or those named",
    )
    p.add_argument(
        "--base-weights",
        action="append",
        metavar="MODULE=FILE",
        help="a component's base weights (safetensors), for SGLang 0.5.23's auto-merge rounding-loss rule",
    )
    o.add_engine_version(p, "SGLang")
    p.add_argument("--resolve", action="store_true", help="plan targets SGLang would reject as merges")
    p.add_argument("--tolerance", type=float, default=0.0, help="float tolerance for the skip rule (default: exact)")
    p.add_argument("--modules", nargs="+", choices=PIPELINE_MODULES, help="pipeline components (default: transformer)")
    p.add_argument("--state", metavar="JSON", help="current pipeline state (a PipelineState or a previous plan --json)")
    o.add_json(p, "print the plan as JSON")
    p.add_argument(
        "--allow-unreadable",
        action="store_true",
        help="plan adapters that cannot be read here (e.g. Hub ids SGLang downloads) with unknown scales",
    )


def _parse_alpha(spec: str) -> tuple[str, float]:
    nickname, sep, value = spec.partition("=")
    if not sep:
        raise ValueError(f"bad --alpha {spec!r}: expected NICK=ALPHA")
    return nickname, float(value)


def _parse_base_weights(spec: str) -> tuple[str, str]:
    module, sep, path = spec.partition("=")
    if not sep or module not in PIPELINE_MODULES or not path:
        raise ValueError(
            f"bad --base-weights {spec!r}: expected MODULE=FILE.safetensors, MODULE one of {PIPELINE_MODULES}"
        )
    return module, path


def _sharded_arg(value: list[str] | None) -> bool | dict[str, bool]:
    """`--sharded` alone: every module; `--sharded transformer_2`: only those; absent: none."""
    if value is None:
        return False
    return True if not value else dict.fromkeys(value, True)


def _error(args: argparse.Namespace, e: ValueError, status: ExitStatus) -> ExitStatus:
    notes = [_cli_words(n) for n in getattr(e, "__notes__", [])]
    if args.json:
        print(json.dumps({"error": str(e), "type": type(e).__name__, "notes": notes}))
    else:
        print(f"error: {e}", file=sys.stderr)  # the engine's own text, as it is
        for note in notes:
            print(note, file=sys.stderr)
    return status


def run(args: argparse.Namespace) -> int:
    from lorafast.planner import PipelineState, parse_adapter_spec, plan

    try:
        requests = [parse_adapter_spec(s) for s in args.adapter]
        alphas = dict(_parse_alpha(s) for s in args.alpha or [])
        base_weights = dict(_parse_base_weights(s) for s in args.base_weights or [])
    except ValueError as e:  # a malformed flag value: a usage error
        return _error(args, e, ExitStatus.USAGE)
    requests = [replace(r, alpha=alphas.get(r.nickname, r.alpha)) for r in requests]
    try:
        current = None
        if args.state:
            with open(args.state, encoding="utf-8") as f:
                data = json.load(f)
            current = PipelineState.from_dict(data.get("next_state", data))
        p = plan(
            requests,
            merge_mode=args.merge_mode,
            current=current,
            weights_sharded=_sharded_arg(args.sharded),
            resolve=args.resolve,
            tolerance=args.tolerance,
            modules=args.modules,
            engine_version=args.engine_version,
            strict_version=args.strict_version,
            quantized=_sharded_arg(args.quantized),
            base_weights=base_weights,
        )
        if p.unreadable and not args.allow_unreadable:  # a plan for files that are not there would mislead
            path, error = next(iter(p.unreadable.items()))
            raise ValueError(
                f"cannot read adapter {path!r}: {error} ({len(p.unreadable)} unreadable; "
                "--allow-unreadable plans them with unknown scales)"
            )
    except ValueError as e:  # SGLang's own errors and PlanError: say why
        from lorafast.compat import UnverifiedEngineVersionError

        if isinstance(e, UnverifiedEngineVersionError):
            raise  # refused by --strict-version: main's usage error
        return _error(args, e, ExitStatus.FAILED)
    print(p.to_json(indent=2) if args.json else _cli_words(p.explain()))
    return ExitStatus.OK


# lorafast's own suggestions name the Python API; on the command line they name the flags. (SGLang's texts, which
# say merge_mode='merge', are the engine's and stay as they are: they are never passed through this.)
_CLI_WORDS = (
    ("plan(..., resolve=True)", "--resolve"),
    ("plan with resolve=True", "plan with --resolve"),
    ("pass merge_mode='merge'", "pass --merge-mode merge"),
    ("Use merge_mode='merge', or", "Use --merge-mode merge, or"),
    ("resolve=True", "--resolve"),
)


def _cli_words(text: str) -> str:
    for api, flag in _CLI_WORDS:
        text = text.replace(api, flag)
    return text
