"""`lorafast scan PATH...`: classify every adapter under the given files, folders and URLs."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from lorafast.cli import _options as o
from lorafast.cli._output import table
from lorafast.cli._status import ExitStatus, usage_error

if TYPE_CHECKING:
    from lorafast.scanning import ScanReport


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("scan", help="classify every adapter under the given files and folders")
    p.add_argument("paths", nargs="+", help="adapter files, folders (searched recursively) and URLs")
    o.add_json(p)
    o.add_threads(p)
    o.add_progress(p)
    o.add_all(p, "failed adapter and adapter with problems")
    p.add_argument("--no-recursive", action="store_true", help="do not descend into sub-folders")
    o.add_hash(p)
    p.add_argument("--summary-only", action="store_true", help="with --json: leave out per-adapter records")
    p.add_argument("--index", metavar="FLEET.db", help="keep a persistent index there; read only what changed")
    p.add_argument("--backend", choices=("local", "ray"), default="local", help="ray: scan shards in Ray tasks")
    p.add_argument("--ray-address", default=None, help="Ray cluster to use (default: RAY_ADDRESS or a local one)")
    o.add_remote(p, "URL paths")


def run(args: argparse.Namespace) -> int:
    from lorafast.scanning import scan

    # what `scan` and `Index.scan` take alike
    options: dict[str, Any] = {
        "recursive": not args.no_recursive,
        "threads": args.threads,
        "progress": o.progress(args),
        "content_hash": args.hash,
        **o.remote(args),
    }
    report: ScanReport
    if args.index:
        from lorafast.scanning.index import Index

        if args.backend != "local":
            return usage_error("scan", "--index scans with the local backend")
        try:
            index = Index(args.index)
        except ValueError as e:  # a folder, a file that is not an index, one of a newer lorafast: a bad --index
            return usage_error("scan", f"--index {e}")
        with index:
            report = index.scan(args.paths, **options)
        changes = f"{len(report.added)} added, {len(report.changed)} changed, {len(report.removed)} removed"
        print(f"index {args.index}: {changes}, {report.reads} read", file=sys.stderr)
    else:
        report = scan(args.paths, **options, backend=args.backend, ray_address=args.ray_address)
    # An adapter that failed or has a problem is not "all fine".
    s = report.summary()
    status = ExitStatus.failed_if(report.errors or s["with_problems"])
    if args.json:
        report.to_json(sys.stdout, indent=2, records=not args.summary_only)
        sys.stdout.write("\n")
        return status
    print(f"{s['adapters']} adapters: {s['ok']} clean, {s['with_problems']} with problems, {s['failed']} failed")
    counts = (
        ("format", sorted(s["formats"].items())),
        ("moe layout", sorted(s["moe_layouts"].items())),
        ("rank", sorted(s["rank_histogram"].items(), key=lambda kv: int(kv[0]))),
        ("flag", sorted(s["flags"].items())),
    )
    for title, rows in counts:
        if rows:
            print("\n" + table(rows, (title, "adapters")))
    if s["target_modules"]:
        print("\ntarget modules: " + ", ".join(s["target_modules"]))
    limit = None if args.all else 20
    if report.errors:
        shown = report.errors[:limit]
        print("\n" + table([(p, c, m[:100]) for p, c, m in shown], ("failed adapter", "code", "message")))
        if len(report.errors) > len(shown):
            print(f"... and {len(report.errors) - len(shown)} more (--all, or --json for all)")
    if s["with_problems"]:
        rows = [
            (a.path, a.problems[0].code, a.problems[0].message[:100], len(a.problems)) for a in report if a.problems
        ]
        print("\n" + table(rows[:limit], ("adapter with problems", "first code", "message", "problems")))
        if limit is not None and len(rows) > limit:
            print(f"... and {len(rows) - limit} more (--all, or --json for all)")
    return status
