"""`lorafast preflight`: will an engine take these adapters?

Two forms:

    lorafast preflight sglang a=/adapters/a /adapters/b --max-lora-rank 64 --base-config config.json
    lorafast preflight vllm /adapters/* --max-lora-rank 64 --engine-version 0.30.0 --json
    lorafast preflight [ADAPTER...] [options] -- vllm serve ... | python -m sglang.launch_server ...

The first runs SGLang's (or vLLM's) start-up checks for a set of adapters, from headers; adapters are given as
SGLang's `--lora-paths` items (`NAME=PATH` or `PATH`). The second (`lorafast.serving.preflight`) answers for the
server a launch command starts, and whether it serves each adapter as trained. Exit status 0: the engine would
start with them (and serve them); 1: it would refuse, or the answer is unknown (every problem is listed, not only
the first); 2: a usage error (not a launch command of a known engine, a version refused by `--strict-version`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json
from lorafast.cli._status import ExitStatus, Parser, usage_error
from lorafast.cli._way_out import grouped_lines, way_out


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("preflight", help="an engine's start-up checks for a set of adapters, from headers")
    p.add_argument("engine", choices=["sglang", "vllm"], help="the engine whose start-up checks to run")
    p.add_argument("adapters", nargs="+", help="NAME=PATH or PATH, as SGLang's --lora-paths")
    o.add_max_lora_rank(p, "the server's --max-lora-rank (default: inferred)")
    p.add_argument("--lora-target-modules", nargs="+", default=None, help="the server's --lora-target-modules")
    # Any whole number: SGLang's own start-up assert reports one below 1, and so does preflight.
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="SGLang's --max-loras-per-batch (default 8)")
    p.add_argument(
        "--experts-shared-outer-loras",
        choices=["auto", "on", "off"],
        default="auto",
        help="SGLang's --experts-shared-outer-loras / --no-... (auto: detected from the adapters)",
    )
    p.add_argument("--lora-strict-loading", action="store_true", help="SGLang's --lora-strict-loading")
    o.add_base_config(p, "the base model's config.json (plans buffer shapes, first-use checks)")
    o.add_expected_modules(p, "vLLM: comma-separated expected LoRA module names")
    o.add_engine_version(p, "engine")
    o.add_json(p)


def is_launch(argv: Sequence[str]) -> bool:
    """`lorafast preflight ... -- LAUNCH COMMAND`: the launch form, parsed by `launch_parser`."""
    return argv[:1] == ["preflight"] and "--" in argv


def launch_parser() -> argparse.ArgumentParser:
    """`lorafast preflight [ADAPTER...] [options] -- LAUNCH COMMAND`: the verdict for the server that command starts."""
    p = Parser(
        prog="lorafast preflight",
        description="Will the server this launch command starts serve each adapter as trained? Everything after `--`"
        " is the engine's launch command, verbatim (vllm serve ..., python -m sglang.launch_server ...).",
    )
    p.add_argument(
        "adapters",
        nargs="*",
        metavar="ADAPTER",
        help="adapters loaded later through the engine's dynamic-load path (files, folders, URLs, as for scan);"
        " those the command names are loaded at start-up",
    )
    p.add_argument("--base", default=None, help="the base model to check against (default: the command's model)")
    o.add_engine_version(p, "engine")
    o.add_json(p, "every adapter's verdict, machine-readable, on stdout")
    o.add_all(p, "adapter that does not serve")
    o.add_threads(p)
    o.add_progress(p)
    o.add_remote(p, "URL adapters and bases")
    return p


def run_launch(argv: Sequence[str]) -> int:
    """`preflight [ADAPTER...] [options] -- LAUNCH COMMAND` (`argv` without the word `preflight`)."""
    from lorafast.serving import preflight

    split = list(argv).index("--")
    args = launch_parser().parse_args(list(argv[:split]))
    command = list(argv[split + 1 :])
    if not command:
        launch_parser().error("give the engine's launch command after --")
    try:
        report = preflight(
            command,
            args.adapters,
            base=args.base,
            engine_version=args.engine_version,
            strict_version=args.strict_version,
            threads=args.threads,
            progress=o.progress(args),
            **o.remote(args),
        )
    except ValueError as e:  # not a launch command of a known engine (a refused version is main's usage error)
        if "launch command" in str(e):
            return usage_error("preflight", str(e))
        raise
    if args.json:
        sys.stdout.write(report.to_json(indent=2) + "\n")
    else:
        sys.stdout.write(report.summary(limit=len(report) if args.all else 20) + "\n")
    return ExitStatus.failed_if(not report.ok)


def _expand(items: list[str]) -> list[str]:
    """`NAME=PATH` or `PATH` items, with a folder of adapters standing for every adapter under it (as `scan` finds
    them); a folder that is itself one adapter stays one item."""
    from lorafast import _core

    out: list[str] = []
    for item in items:
        name, sep, path = item.partition("=")
        if sep or "://" in item or not os.path.isdir(item):
            out.append(item)
            continue
        found = [p for p, _ in _core.discover([item], True)]
        out.extend(
            found if len(found) > 1 or (found and os.path.normpath(found[0]) != os.path.normpath(item)) else [item]
        )
    return out


def run(args: argparse.Namespace) -> int:
    """`preflight sglang|vllm ADAPTER...`."""
    from lorafast.compat import sglang, vllm

    args.adapters = _expand(list(args.adapters))
    if args.engine == "sglang":
        refs = sglang.parse_lora_paths(list(args.adapters))
        shared = {"on": True, "off": False, "auto": None}[args.experts_shared_outer_loras]
        plan = sglang.preflight(
            refs,
            max_lora_rank=args.max_lora_rank,
            target_modules=args.lora_target_modules,
            max_loras_per_batch=args.max_loras_per_batch,
            experts_shared_outer=shared,
            base_config=o.read_json(args.base_config),
            strict_loading=args.lora_strict_loading,
            collect=True,
            engine_version=args.engine_version,
            strict_version=args.strict_version,
        )
        report: dict[str, Any] = plan.to_dict()
        ok, verdict, rules = plan.ok, plan.verdict, plan.engine_version
    else:
        refs = sglang.parse_lora_paths(list(args.adapters))  # NAME=PATH or PATH; NAME is vLLM's lora_name
        vplan = vllm.preflight(
            refs,
            max_lora_rank=args.max_lora_rank or 16,
            expected_lora_modules=args.expected_modules or None,
            collect=True,
            engine_version=args.engine_version,
            strict_version=args.strict_version,
        )
        report = {
            "engine_version": None if vplan.engine_version is None else vplan.engine_version.to_dict(),
            "verdict": vplan.verdict,
            "max_rank": vplan.max_rank,
            "suggested_max_lora_rank": vplan.suggested_max_lora_rank,
            "skipped": list(vplan.skipped),
            "problems": [
                {"code": p.code, "type": p.exc_type, "message": p.message, "adapter": p.adapter_name, "fatal": p.fatal}
                for p in vplan.problems
            ],
        }
        ok, verdict, rules = vplan.ok, vplan.verdict, vplan.engine_version
    # Every problem names its adapter's path, not only the engine's uuid of it (a set conflict names the uuid).
    paths = {r.lora_id: r.path for r in refs} | {r.name: r.path for r in refs}
    names = {r.lora_id: r.name for r in refs}
    for p in report["problems"]:
        p["adapter_path"] = paths.get(p.get("adapter_id") or "") or paths.get(
            p.get("adapter_name") or p.get("adapter") or ""
        )
        if not (p.get("adapter_name") or p.get("adapter")) and p.get("adapter_id") in names:
            p["adapter_name"] = names[p["adapter_id"]]  # a set conflict names the engine's uuid only
    failed = {p.get("adapter_name") or p.get("adapter") for p in report["problems"] if p.get("fatal", True)}
    passed = [r.name for r in refs if r.name not in failed]
    report["passed"] = passed
    undecided = []
    if args.engine == "sglang" and args.base_config is None:  # the first-use checks need the model's shapes
        undecided.append(
            "skipped (no --base-config): SGLang's first-use checks (buffer shapes, each adapter's rank against"
            " --max-lora-rank); `lorafast preflight -- <launch command>` reads the base the command names"
        )
        if verdict == "ok":
            verdict = "unknown"
    report["undecided"] = undecided
    # Exit 0 only for a verdict lorafast can stand behind: a set that passes on an unverified version, or without
    # the checks that need the base, is unknown.
    status = ExitStatus.failed_if(verdict != "ok")
    if args.json:
        print_json(report)
        return status
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
    for line in undecided:
        sys.stdout.write(line + "\n")
    for line in grouped_lines(report["problems"]):  # consequential problems once, with a count
        sys.stdout.write(line + "\n")
    if rules is not None:
        sys.stdout.write(f"engine: {rules.note()}\n")
    if passed:
        shown = ", ".join(passed[:20]) + (f" and {len(passed) - 20} more" if len(passed) > 20 else "")
        sys.stdout.write(f"pass their own checks: {shown}\n")
    if verdict == "unknown" and rules is not None and not rules.verified:
        sys.stdout.write(
            f"unknown: the set passes {rules.engine} {rules.rules}'s rules, but {rules.requested} is not verified"
            " (use a verified --engine-version, or see `lorafast engines`)\n"
        )
    elif verdict == "unknown":
        sys.stdout.write("unknown: the start-up checks pass; the first-use checks need --base-config\n")
    else:
        sys.stdout.write("ok\n" if ok else "the engine would refuse this set\n")
    if not ok:  # the refusal on stderr too, so that a script that keeps only stderr sees why it failed
        first = next(p for p in report["problems"] if p.get("fatal", True))
        sys.stderr.write(
            f"lorafast preflight: {args.engine} would refuse this set: {first['type']}: {first['message']}\n"
        )
    if not ok and args.engine == "sglang":
        given = [(a.get("name") or a["path"], a["path"]) for a in report.get("adapters", [])]
        flags = ["--base-config", args.base_config] if args.base_config else []
        if args.max_lora_rank is not None:
            flags += ["--max-lora-rank", str(args.max_lora_rank)]
        for line in way_out(given, report["problems"], flags):
            sys.stdout.write(line + "\n")
    return status
