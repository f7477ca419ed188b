"""`lorafast preflight`: SGLang's (or vLLM's) start-up checks for a set of adapters, from headers.

    lorafast preflight sglang a=/adapters/a /adapters/b --max-lora-rank 64 --base-config config.json
    lorafast preflight vllm /adapters/* --max-lora-rank 64 --engine-version 0.30.0 --json

Adapters are given as SGLang's `--lora-paths` items (`NAME=PATH` or `PATH`). Exit code 0: the engine would
start with them; 1: it would refuse (every problem is listed, not only the first).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _load_json(path: str | None) -> Any:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _cmd(args: argparse.Namespace) -> int:
    from lorafast.compat import sglang, vllm

    if args.engine == "sglang":
        refs = sglang.parse_lora_paths(list(args.adapters))
        shared = {"on": True, "off": False, "auto": None}[args.experts_shared_outer_loras]
        plan = sglang.preflight(
            refs,
            max_lora_rank=args.max_lora_rank,
            target_modules=args.lora_target_modules,
            max_loras_per_batch=args.max_loras_per_batch,
            experts_shared_outer=shared,
            base_config=_load_json(args.base_config),
            strict_loading=args.lora_strict_loading,
            collect=True,
            engine_version=args.engine_version,
        )
        report: dict[str, Any] = plan.to_dict()
        ok = plan.ok
    else:
        refs = sglang.parse_lora_paths(list(args.adapters))  # NAME=PATH or PATH; NAME is vLLM's lora_name
        expected = args.expected_modules.split(",") if args.expected_modules else None
        vplan = vllm.preflight(
            refs,
            max_lora_rank=args.max_lora_rank or 16,
            expected_lora_modules=expected,
            collect=True,
            engine_version=args.engine_version,
        )
        report = {
            "max_rank": vplan.max_rank,
            "suggested_max_lora_rank": vplan.suggested_max_lora_rank,
            "skipped": list(vplan.skipped),
            "problems": [
                {"code": p.code, "type": p.exc_type, "message": p.message, "adapter": p.adapter_name, "fatal": p.fatal}
                for p in vplan.problems
            ],
        }
        ok = vplan.ok
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return 0 if ok else 1
    for key in (
        "target_modules",
        "max_lora_rank",
        "experts_shared_outer",
        "buffer_bytes",
        "max_rank",
        "suggested_max_lora_rank",
    ):
        if key in report:
            sys.stdout.write(f"{key}: {report[key]}\n")
    if report.get("skipped"):  # vLLM without --expected-modules: the model-dependent load steps
        sys.stdout.write(f"skipped (no --expected-modules): {', '.join(report['skipped'])}\n")
    from lorafast.compat._way_out import grouped_lines, way_out

    for line in grouped_lines(report["problems"]):  # consequential problems once, with a count
        sys.stdout.write(line + "\n")
    sys.stdout.write("ok\n" if ok else "the engine would refuse this set\n")
    if not ok and args.engine == "sglang":
        given = [(a.get("name") or a["path"], a["path"]) for a in report.get("adapters", [])]
        for line in way_out(given, report["problems"]):
            sys.stdout.write(line + "\n")
    return 0 if ok else 1


def register_cli(subparsers: Any) -> None:
    """Add `lorafast preflight {sglang,vllm} ADAPTER...`."""
    p = subparsers.add_parser("preflight", help="an engine's start-up checks for a set of adapters, from headers")
    p.add_argument("engine", choices=["sglang", "vllm"])
    p.add_argument("adapters", nargs="+", help="NAME=PATH or PATH, as SGLang's --lora-paths")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="+", default=None)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--experts-shared-outer-loras", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--lora-strict-loading", action="store_true")
    p.add_argument("--base-config", help="the base model's config.json (plans buffer shapes)")
    p.add_argument("--expected-modules", help="vLLM: comma-separated expected LoRA module names")
    p.add_argument(
        "--engine-version",
        default=None,
        help="the engine release to answer for, e.g. 0.5.23 or 0.33.0 (default: installed, else newest)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd)
