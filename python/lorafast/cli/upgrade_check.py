"""`lorafast upgrade-check ADAPTER... --engine E --from V --to W`: which adapters an engine upgrade changes.

Exit status 1 when some adapter changes (its outcome, error, stage, modules or scale), 0 when none does.
"""

from __future__ import annotations

import argparse
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json
from lorafast.cli._status import ExitStatus, usage_error


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "upgrade-check", help="which adapters an engine upgrade changes: outcome, error, stage, modules, scale"
    )
    p.add_argument("adapters", nargs="+", metavar="ADAPTER", help="NAME=PATH or PATH, as the server's adapter list")
    p.add_argument(
        "--engine",
        choices=["sglang", "vllm", "transformers"],
        required=True,
        help="the engine being upgraded (transformers: the base as each version saved it, --from-base/--to-base)",
    )
    p.add_argument("--from", dest="from_version", type=o.engine_version, help="the version served now")
    p.add_argument("--to", dest="to_version", type=o.engine_version, help="the version to upgrade to")
    p.add_argument("--from-base", help="transformers: the base model as the current version saved it")
    p.add_argument("--to-base", help="transformers: the base model as the new version saved it")
    o.add_max_lora_rank(p, "the server's --max-lora-rank")
    o.add_expected_modules(p, "vLLM: comma-separated LoRA module names of the model")
    o.add_base_config(p, "SGLang: the base model's config.json")
    o.add_strict_version(p)
    p.add_argument("--limit", type=o.positive_int, default=20, help="changed adapters listed in text output")
    o.add_json(p, "every adapter's change, old and new, on stdout")


def run(args: argparse.Namespace) -> int:
    from lorafast.checker import diff_bases
    from lorafast.compat import diff_versions

    if args.engine == "transformers":
        if not (args.from_base and args.to_base):
            return usage_error("upgrade-check", "--engine transformers needs --from-base and --to-base")
        labels = (args.from_version, args.to_version)
        bases = diff_bases(list(args.adapters), args.from_base, args.to_base, labels=labels)
        title = (
            f"transformers {args.from_version or ''} base {bases.old_base} -> {args.to_version or ''} base"
            f" {bases.new_base}"
        )
        return _print_diff(
            args, bases, title, lambda out: f"{out.verdict:<15} {len(out.matched)} modules reach a weight"
        )
    if not (args.from_version and args.to_version):
        return usage_error("upgrade-check", f"--engine {args.engine} needs --from and --to")

    options: dict[str, Any] = {}
    if args.max_lora_rank is not None:
        options["max_lora_rank"] = args.max_lora_rank
    if args.engine == "vllm" and args.expected_modules:
        options["expected_lora_modules"] = args.expected_modules
    if args.engine == "sglang" and args.base_config:
        options["base_config"] = o.read_json(args.base_config)
    diff = diff_versions(
        args.engine,
        args.from_version,
        args.to_version,
        list(args.adapters),
        strict_version=args.strict_version,
        **options,
    )
    title = f"{args.engine} {diff.old.requested} ({diff.old.status}) -> {diff.new.requested} ({diff.new.status})"

    def side(out: Any) -> str:
        detail = f"{out.exc_type}: {_short(out.message)}" if out.outcome == "fails" else f"{len(out.modules)} modules"
        return f"{out.outcome:<6} {out.stage + ' ' if out.stage else ''}{detail}"

    return _print_diff(args, diff, title, side)


def _print_diff(args: argparse.Namespace, diff: Any, title: str, side: Any) -> int:
    """An upgrade check's answer: JSON, or a summary line and each changed adapter, old and new (`side(outcome)`)."""
    status = ExitStatus.failed_if(diff.changes)
    if args.json:
        print_json(diff.to_dict())
        return status
    s = diff.summary()
    kinds = " (" + ", ".join(f"{n} {k}" for k, n in s["kinds"].items()) + ")" if s["kinds"] else ""
    print(f"{title}: {s['changed']} of {s['adapters']} adapters change{kinds}")
    for c in diff.changes[: args.limit]:
        print(f"{c.name}  [{', '.join(c.kinds)}]  {c.old.path}")
        for label, outcome in (("old", c.old), ("new", c.new)):
            print(f"    {label} {side(outcome)}")
    if len(diff.changes) > args.limit:
        print(f"... and {len(diff.changes) - args.limit} more (--limit, or --json for all)")
    return status


def _short(text: str, width: int = 200) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
