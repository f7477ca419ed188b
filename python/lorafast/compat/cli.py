"""`lorafast preflight`: SGLang's (or vLLM's) start-up checks for a set of adapters, from headers.

    lorafast preflight sglang a=/adapters/a /adapters/b --max-lora-rank 64 --base-config config.json
    lorafast preflight vllm /adapters/* --max-lora-rank 64 --engine-version 0.30.0 --json

Adapters are given as SGLang's `--lora-paths` items (`NAME=PATH` or `PATH`). Exit code 0: the engine would
start with them; 1: it would refuse (every problem is listed, not only the first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _load_json(path: str | None) -> Any:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


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


def _cmd(args: argparse.Namespace) -> int:
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
            base_config=_load_json(args.base_config),
            strict_loading=args.lora_strict_loading,
            collect=True,
            engine_version=args.engine_version,
            strict_version=args.strict_version,
        )
        report: dict[str, Any] = plan.to_dict()
        ok, verdict, rules = plan.ok, plan.verdict, plan.engine_version
    else:
        refs = sglang.parse_lora_paths(list(args.adapters))  # NAME=PATH or PATH; NAME is vLLM's lora_name
        expected = args.expected_modules.split(",") if args.expected_modules else None
        vplan = vllm.preflight(
            refs,
            max_lora_rank=args.max_lora_rank or 16,
            expected_lora_modules=expected,
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
    status = 0 if verdict == "ok" else 1
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
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
    from lorafast.compat._way_out import grouped_lines, way_out

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


def _cmd_engines(args: argparse.Namespace) -> int:
    from lorafast.compat import _versions

    if args.json:
        sys.stdout.write(
            json.dumps(
                {e: {v: list(_versions.CHANGES[e].get(v, ())) for v in vs} for e, vs in _versions.SUPPORTED.items()},
                indent=2,
            )
            + "\n"
        )
        return 0
    for engine, versions in _versions.SUPPORTED.items():
        installed = _versions._default(engine)
        sys.stdout.write(f"{engine}: verified {', '.join(versions)}; answers by default for {installed}\n")
        for v in versions:
            sys.stdout.write(f"  {v}\n")
            for change in _versions.CHANGES[engine].get(v, ()):
                sys.stdout.write(f"    - {change}\n")
    return 0


def _cmd_upgrade_transformers(args: argparse.Namespace) -> int:
    from lorafast.compat._upgrade import diff_bases

    if not (args.from_base and args.to_base):
        sys.stderr.write("lorafast upgrade-check: error: --engine transformers needs --from-base and --to-base\n")
        return 2
    diff = diff_bases(list(args.adapters), args.from_base, args.to_base, labels=(args.from_version, args.to_version))
    title = (
        f"transformers {args.from_version or ''} base {diff.old_base} -> {args.to_version or ''} base {diff.new_base}"
    )
    return _print_diff(args, diff, title, lambda o: f"{o.verdict:<15} {len(o.matched)} modules reach a weight")


def _print_diff(args: argparse.Namespace, diff: Any, title: str, side: Any) -> int:
    """An upgrade check's answer: JSON, or a summary line and each changed adapter, old and new (`side(outcome)`).
    Exit 1 when some adapter changes."""
    if args.json:
        sys.stdout.write(json.dumps(diff.to_dict(), indent=2) + "\n")
        return 1 if diff.changes else 0
    s = diff.summary()
    kinds = " (" + ", ".join(f"{n} {k}" for k, n in s["kinds"].items()) + ")" if s["kinds"] else ""
    sys.stdout.write(f"{title}: {s['changed']} of {s['adapters']} adapters change{kinds}\n")
    for c in diff.changes[: args.limit]:
        sys.stdout.write(f"{c.name}  [{', '.join(c.kinds)}]  {c.old.path}\n")
        for label, o in (("old", c.old), ("new", c.new)):
            sys.stdout.write(f"    {label} {side(o)}\n")
    if len(diff.changes) > args.limit:
        sys.stdout.write(f"... and {len(diff.changes) - args.limit} more (--limit, or --json for all)\n")
    return 1 if diff.changes else 0


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from lorafast.compat._upgrade import diff_versions

    if args.engine == "transformers":
        return _cmd_upgrade_transformers(args)
    if not (args.from_version and args.to_version):
        sys.stderr.write(f"lorafast upgrade-check: error: --engine {args.engine} needs --from and --to\n")
        return 2

    options: dict[str, Any] = {}
    if args.max_lora_rank is not None:
        options["max_lora_rank"] = args.max_lora_rank
    if args.engine == "vllm" and args.expected_modules:
        options["expected_lora_modules"] = args.expected_modules.split(",")
    if args.engine == "sglang" and args.base_config:
        options["base_config"] = _load_json(args.base_config)
    diff = diff_versions(
        args.engine,
        args.from_version,
        args.to_version,
        list(args.adapters),
        strict_version=args.strict_version,
        **options,
    )
    title = f"{args.engine} {diff.old.requested} ({diff.old.status}) -> {diff.new.requested} ({diff.new.status})"

    def side(o: Any) -> str:
        detail = f"{o.exc_type}: {_short(o.message)}" if o.outcome == "fails" else f"{len(o.modules)} modules"
        return f"{o.outcome:<6} {o.stage + ' ' if o.stage else ''}{detail}"

    return _print_diff(args, diff, title, side)


def _short(text: str, width: int = 200) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def register_cli(subparsers: Any) -> None:
    """Add `lorafast preflight {sglang,vllm} ADAPTER...`, `lorafast engines` and `lorafast upgrade-check`."""
    from lorafast.cli import add_version_arguments, engine_version, positive_int

    p = subparsers.add_parser("engines", help="the engine versions lorafast verified, and what changed in each")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=_cmd_engines)

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
    p.add_argument("--from", dest="from_version", type=engine_version, help="the version served now")
    p.add_argument("--to", dest="to_version", type=engine_version, help="the version to upgrade to")
    p.add_argument("--from-base", help="transformers: the base model as the current version saved it")
    p.add_argument("--to-base", help="transformers: the base model as the new version saved it")
    p.add_argument("--max-lora-rank", type=positive_int, default=None, help="the server's --max-lora-rank")
    p.add_argument("--expected-modules", help="vLLM: comma-separated LoRA module names of the model")
    p.add_argument("--base-config", help="SGLang: the base model's config.json")
    p.add_argument("--strict-version", action="store_true", help="refuse (exit 2) a version lorafast has not verified")
    p.add_argument("--limit", type=positive_int, default=20, help="changed adapters listed in text output")
    p.add_argument("--json", action="store_true", help="every adapter's change, old and new, on stdout")
    p.set_defaults(func=_cmd_upgrade)
    p = subparsers.add_parser("preflight", help="an engine's start-up checks for a set of adapters, from headers")
    p.add_argument("engine", choices=["sglang", "vllm"], help="the engine whose start-up checks to run")
    p.add_argument("adapters", nargs="+", help="NAME=PATH or PATH, as SGLang's --lora-paths")
    # A rank below 1 is a usage error: SGLang would only fail later, allocating a buffer of negative size.
    p.add_argument(
        "--max-lora-rank", type=positive_int, default=None, help="the server's --max-lora-rank (default: inferred)"
    )
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
    p.add_argument("--base-config", help="the base model's config.json (plans buffer shapes, first-use checks)")
    p.add_argument("--expected-modules", help="vLLM: comma-separated expected LoRA module names")
    add_version_arguments(p, "engine")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=_cmd)
