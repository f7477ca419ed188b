"""`lorafast groups PATH...`: split adapters into the fewest SGLang servers that can each load their share.

    lorafast groups /adapters/* --max-lora-rank 64 --max-per-group 8 --json

Exit status: 0 every adapter has a group that passes its preflight; 1 an adapter is unservable or a group fails
its preflight; 2 a usage error (a value `plan_groups` refuses: the error as text, or as JSON with `--json`).
The planning is `lorafast.groups`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._status import ExitStatus, usage_error


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "groups",
        help="split adapters into the fewest SGLang servers that can each load their share",
        description="Group adapters by MoE outer layout and base model, with SGLang server arguments per group.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="adapter folders/files (or folders of adapters)")
    o.add_max_lora_rank(p, "fixed server rank limit")
    p.add_argument("--target-modules", nargs="+", default=None, help="fixed --lora-target-modules")
    p.add_argument("--max-per-group", type=o.positive_int, default=None, help="at most this many adapters per server")
    p.add_argument(
        "--convert",
        action="store_true",
        help="convert shared-outer adapters to stacked 3-D (exact) where that saves a server",
    )
    p.add_argument("--out", default=None, metavar="DIR", help="with --convert: where the converted adapters go")
    o.add_base_config(p, "the base model's config.json: each group's preflight also runs SGLang's first-use checks")
    o.add_json(p, "print the groups as JSON")


def run(args: argparse.Namespace) -> int:
    from lorafast.groups import plan_groups
    from lorafast.scanning import scan

    if args.convert and not args.out:
        return usage_error("groups", "--convert needs --out DIR, the folder the converted adapters are served from")
    paths = list(args.paths)
    source: Any = paths
    try:
        source = scan(paths)
    except Exception as e:
        print(f"warning: scan failed ({e}); inspecting paths one by one", file=sys.stderr)
        source = paths
    try:
        result = plan_groups(
            source,
            max_lora_rank=args.max_lora_rank,
            target_modules=args.target_modules,
            max_per_group=args.max_per_group,
            convert=args.convert,
            convert_out=args.out,
            base_config=o.read_json(args.base_config),
        )
    except ValueError as e:
        if not args.json:
            return usage_error("groups", str(e))
        print(json.dumps({"error": str(e)}))
        return ExitStatus.USAGE
    print(result.to_json(indent=2) if args.json else result.explain())
    return ExitStatus.failed_if(not result.ok)
