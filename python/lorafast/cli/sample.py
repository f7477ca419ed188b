"""`lorafast sample --out DIR`: realistic sample adapters of every format and MoE layout."""

from __future__ import annotations

import argparse
import os
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json
from lorafast.cli._status import ExitStatus


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("sample", help="write realistic sample adapters of every format and MoE layout")
    p.add_argument("--out", required=True, help="the folder to write the adapters into")
    p.add_argument("-n", type=o.count, default=100, help="how many adapters (default 100)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same fleet")
    p.add_argument(
        "--with-bases",
        action="store_true",
        help="write tiny base models and adapters that fit them (and some that do not), instead of -n samples",
    )
    o.add_json(p, "list what was written, machine-readable, on stdout")


def run(args: argparse.Namespace) -> int:
    from lorafast.sample import write_samples

    if args.with_bases:
        from lorafast.sample_bases import write_with_bases

        written = write_with_bases(args.out, seed=args.seed)
        if args.json:
            print_json({"out": os.fspath(args.out), "paths": written})
        else:
            print(f"wrote {len(written)} bases and adapters that fit them to {args.out}:")
            for name, path in written.items():
                print(f"  {name:<14} {path}")
        return ExitStatus.OK
    paths = write_samples(args.out, args.n, seed=args.seed)
    if args.json:
        print_json({"out": os.fspath(args.out), "written": len(paths)})
    else:
        print(f"wrote {len(paths)} sample adapters to {args.out}")
    return ExitStatus.OK
