"""`lorafast groups`: split adapters into the fewest SGLang servers that can each load their share.

    lorafast groups /adapters/* --max-lora-rank 64 --max-per-group 8 --json

Exit status as for every command: 0 every adapter has a group that passes its preflight; 1 an adapter is
unservable or a group fails its preflight; 2 a usage error (a bad value: the error as text, or as JSON with
`--json`). The planning is `lorafast.groups`.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse


def _config(path: str | None) -> Any:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _run_cli(args: argparse.Namespace) -> int:
    from lorafast.groups import plan_groups
    from lorafast.scanning import scan

    if args.convert and not args.out:
        print("lorafast groups: error: --convert needs --out DIR, the folder the converted adapters are served from",
              file=sys.stderr)  # fmt: skip
        return 2
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
            base_config=_config(args.base_config),
        )
    except ValueError as e:
        print(
            json.dumps({"error": str(e)}) if args.json else f"error: {e}", file=sys.stdout if args.json else sys.stderr
        )
        return 2
    print(result.to_json(indent=2) if args.json else result.explain())
    return 0 if result.ok else 1


def register_cli(subparsers: Any) -> None:
    """Add `lorafast groups` to the lorafast CLI."""
    from lorafast.cli import positive_int  # argparse types: a bad count is a usage error (exit 2)

    p = subparsers.add_parser(
        "groups",
        help="split adapters into the fewest SGLang servers that can each load their share",
        description="Group adapters by MoE outer layout and base model, with SGLang server arguments per group.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="adapter folders/files (or folders of adapters)")
    p.add_argument("--max-lora-rank", type=positive_int, default=None, help="fixed server rank limit")
    p.add_argument("--target-modules", nargs="+", default=None, help="fixed --lora-target-modules")
    p.add_argument("--max-per-group", type=positive_int, default=None, help="at most this many adapters per server")
    p.add_argument(
        "--convert",
        action="store_true",
        help="convert shared-outer adapters to stacked 3-D (exact) where that saves a server",
    )
    p.add_argument("--out", default=None, metavar="DIR", help="with --convert: where the converted adapters go")
    p.add_argument(
        "--base-config",
        metavar="CONFIG.json",
        help="the base model's config.json: each group's preflight also runs SGLang's first-use checks",
    )
    p.add_argument("--json", action="store_true", help="print the groups as JSON")
    p.set_defaults(func=_run_cli)
