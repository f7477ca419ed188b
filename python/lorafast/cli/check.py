"""`lorafast check --base PATH [--base PATH ...] ADAPTER... [--engine sglang|vllm] [--json]`: does each adapter
fit each base model? Without `--base`, the likely base families of each adapter.

Exit status 1 when some adapter would fail or silently do nothing on some base (or an engine rejects it), or,
without `--base`, when an adapter cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json
from lorafast.cli._status import ExitStatus, usage_error


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("check", help="does each adapter fit each base model? (headers only)")
    p.add_argument("adapters", nargs="+", metavar="ADAPTER", help="adapter files or folders (scanned like `scan`)")
    p.add_argument(
        "--base",
        action="append",
        default=[],
        help="base checkpoint, sharded folder, pipeline or URL; without one, name the likely base families",
    )
    p.add_argument("--engine", choices=("sglang", "vllm"), default=None, help="add the engine's own outcome")
    o.add_engine_version(p, "--engine")
    o.add_max_lora_rank(
        p, "with --engine: the server's --max-lora-rank (default: the engine's, vLLM 16, SGLang inferred)"
    )
    o.add_json(p)
    o.add_threads(p)
    o.add_remote(p, "URL bases and adapters")


def run(args: argparse.Namespace) -> int:
    from lorafast.checker import check

    if not args.base:
        if args.engine is not None or args.max_lora_rank is not None:
            return usage_error("check", "--engine and --max-lora-rank need --base")
        return _identify(args)
    report = check(
        args.adapters,
        args.base,
        engine=args.engine,
        engine_version=args.engine_version,
        strict_version=args.strict_version,
        max_lora_rank=args.max_lora_rank,
        threads=args.threads,
        **o.remote(args),
    )
    status = ExitStatus.failed_if(report.failed)
    if args.json:
        sys.stdout.write(report.to_json(indent=2) + "\n")
        return status
    for r in report:
        line = (
            f"{r.verdict:<15} {r.adapter}  on  {r.base}  ({r.matched} matched, {r.missing} missing, "
            f"{r.mismatched} mismatched)"
        )
        print(line)
        if r.hint or r.error:
            print(f"    {r.error or r.hint}")
        if r.engine is not None:
            print(f"    {r.engine.engine}: {r.engine.outcome}" + (f" ({r.engine.note})" if r.engine.note else ""))
            for e in r.engine.errors[:3]:
                print(f"      {e}")
    s = report.summary()
    print(", ".join(f"{v} {k}" for k, v in s["verdicts"].items() if v) + f" ({s['pairs']} pairs)")
    return status


def _identify(args: argparse.Namespace) -> int:
    from lorafast.families import identify
    from lorafast.scanning import scan

    report = scan(args.adapters, threads=args.threads, progress=False, **o.remote(args))
    out: list[dict[str, Any]] = []
    for adapter in report:
        ident = identify(adapter)
        out.append(
            {
                "adapter": adapter.path,
                "base_model_name_or_path": adapter.base_model_name_or_path,
                "fingerprint": dict(ident.fingerprint),
                "candidates": [list(c) for c in ident.candidates],
                "ambiguous": list(ident.ambiguous),
                "best": ident.best,
            }
        )
    if args.json:
        print_json({"identified": out, "errors": report.errors})
    else:
        for row in out:
            best = row["best"] or (f"ambiguous: {', '.join(row['ambiguous'])}" if row["ambiguous"] else "unknown")
            print(f"{best:<40} {row['adapter']}  (config says {row['base_model_name_or_path'] or 'nothing'})")
    return ExitStatus.failed_if(report.errors)
