"""`lorafast inspect PATH`: everything about one adapter."""

from __future__ import annotations

import argparse
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json
from lorafast.cli._status import ExitStatus


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="everything about one adapter")
    p.add_argument("path", help="an adapter file, folder or URL")
    o.add_json(p)
    p.add_argument("--modules", action="store_true", help="with --json: include per-module records")
    o.add_hash(p)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from lorafast.scanning import inspect

    adapter = inspect(args.path, content_hash=args.hash)
    if args.json:
        d = asdict(adapter)
        d["flags"] = sorted(adapter.flags)
        if not args.modules:
            d.pop("modules")
        print_json(d)
    else:
        print(
            f"{adapter.path}\n  format {adapter.format.value}, peft_type {adapter.peft_type}, "
            f"{adapter.num_tensors} tensors, {len(adapter.modules)} modules, rank {adapter.rank}"
        )
        print(f"  moe layout {adapter.moe_layout.value}, experts {adapter.num_experts}, layers {len(adapter.layers)}")
        print(f"  targets {', '.join(adapter.target_modules)}; flags {', '.join(sorted(adapter.flags)) or '-'}")
        for p in adapter.problems:
            print(f"  problem {p.code}: {p.message}")
    return ExitStatus.failed_if(adapter.problems)  # an adapter with problems is not "all fine", as in a scan
