"""`lorafast engines`: the engine versions lorafast verified, and what changed in each."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json
from lorafast.cli._status import ExitStatus


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("engines", help="the engine versions lorafast verified, and what changed in each")
    o.add_json(p)


def run(args: argparse.Namespace) -> int:
    from lorafast.compat import VERIFIED_VERSIONS, UnverifiedEngineVersion, engine_rules
    from lorafast.compat import VERSION_CHANGES as CHANGES

    if args.json:
        print_json({e: {v: list(CHANGES[e].get(v, ())) for v in vs} for e, vs in VERIFIED_VERSIONS.items()})
        return ExitStatus.OK
    for engine, versions in VERIFIED_VERSIONS.items():
        with warnings.catch_warnings():  # the installed version, verified or not: this command lists both
            warnings.simplefilter("ignore", UnverifiedEngineVersion)
            installed = engine_rules(engine).requested
        print(f"{engine}: verified {', '.join(versions)}; answers by default for {installed}")
        for v in versions:
            print(f"  {v}")
            for change in CHANGES[engine].get(v, ()):
                print(f"    - {change}")
    return ExitStatus.OK
