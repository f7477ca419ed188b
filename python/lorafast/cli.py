"""The `lorafast` command (also `python -m lorafast`).

Subcommands: `scan`, `inspect`, `header`, `sample`, and from their own modules `plan`, `groups`, `convert` and
`merge`. Exit codes: 0 all fine, 1 some adapter failed (or a check failed), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

#: Modules that add their own subcommands through `register_cli(subparsers)`.
_PLUGINS = (
    "lorafast.planner.cli",
    "lorafast.groups_cli",
    "lorafast.merging.cli",
    "lorafast.compat.cli",
    "lorafast.checker",
    "lorafast.converting.cli",
)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _table(rows: Sequence[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    cells = [tuple(str(c) for c in header), *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_scan(args: argparse.Namespace) -> int:
    from .scanning import ScanReport, scan

    # what `scan` and `Index.scan` take alike
    options: dict[str, Any] = {
        "recursive": not args.no_recursive,
        "threads": args.threads,
        "progress": False if args.quiet else None,
        "content_hash": args.hash,
        "storage_options": dict(args.storage_option) or None,
        "timeout": args.timeout,
    }
    report: ScanReport
    if args.index:
        from .scanning.index import Index

        if args.backend != "local":
            print("lorafast scan: error: --index scans with the local backend", file=sys.stderr)
            return 2
        try:
            index = Index(args.index)
        except ValueError as e:  # a folder, a file that is not an index, one of a newer lorafast: a bad --index
            print(f"lorafast scan: error: --index {e}", file=sys.stderr)
            return 2
        with index:
            report = index.scan(args.paths, **options)
        changes = f"{len(report.added)} added, {len(report.changed)} changed, {len(report.removed)} removed"
        print(f"index {args.index}: {changes}, {report.reads} read", file=sys.stderr)
    else:
        report = scan(args.paths, **options, backend=args.backend, ray_address=args.ray_address)
    if args.json:
        report.to_json(sys.stdout, indent=2, records=not args.summary_only)
        sys.stdout.write("\n")
        return 1 if report.errors or report.summary()["with_problems"] else 0
    s = report.summary()
    print(f"{s['adapters']} adapters: {s['ok']} clean, {s['with_problems']} with problems, {s['failed']} failed")
    if s["formats"]:
        print("\n" + _table(sorted(s["formats"].items()), ("format", "adapters")))
    if s["moe_layouts"]:
        print("\n" + _table(sorted(s["moe_layouts"].items()), ("moe layout", "adapters")))
    if s["rank_histogram"]:
        ranks = sorted(s["rank_histogram"].items(), key=lambda kv: int(kv[0]))
        print("\n" + _table(ranks, ("rank", "adapters")))
    if s["flags"]:
        print("\n" + _table(sorted(s["flags"].items()), ("flag", "adapters")))
    if s["target_modules"]:
        print("\ntarget modules: " + ", ".join(s["target_modules"]))
    limit = None if args.all else 20
    if report.errors:
        shown = report.errors[:limit]
        print("\n" + _table([(p, c, m[:100]) for p, c, m in shown], ("failed adapter", "code", "message")))
        if len(report.errors) > len(shown):
            print(f"... and {len(report.errors) - len(shown)} more (--all, or --json for all)")
    if s["with_problems"]:
        rows = [
            (a.path, a.problems[0].code, a.problems[0].message[:100], len(a.problems)) for a in report if a.problems
        ]
        print("\n" + _table(rows[:limit], ("adapter with problems", "first code", "message", "problems")))
        if limit is not None and len(rows) > limit:
            print(f"... and {len(rows) - limit} more (--all, or --json for all)")
    # An adapter that failed or has a problem is not "all fine": exit 1, as every command does.
    return 1 if report.errors or s["with_problems"] else 0


# Argument types: argparse turns their ArgumentTypeError into a one-line usage error, exit status 2.


def key_value(text: str) -> tuple[str, str]:
    """`KEY=VALUE` with a non-empty key."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key, value


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None


def positive_int(text: str) -> int:
    """A count of at least 1 (threads, ranks, group sizes)."""
    n = _whole(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def count(text: str) -> int:
    """A count of at least 0."""
    n = _whole(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {n}")
    return n


def seconds(text: str) -> float:
    """A timeout: positive, not NaN. Huge values (even inf) pass; the library clamps them."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if math.isnan(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return x


def engine_version(text: str) -> str:
    """A release such as 0.5.23 or 0.34.0 (pre-release and local suffixes allowed)."""
    from .compat import parse_engine_version

    try:
        parse_engine_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_version_arguments(p: argparse.ArgumentParser, engine: str) -> None:
    """`--engine-version VERSION` and `--strict-version`, the same on every command that answers for an engine."""
    p.add_argument(
        "--engine-version",
        metavar="VERSION",
        type=engine_version,
        default=None,
        help=f"the {engine} release to answer for, e.g. 0.5.23 or 0.34.0 (default: installed, else newest verified;"
        " `lorafast engines` lists the verified ones)",
    )
    p.add_argument(
        "--strict-version",
        action="store_true",
        help="refuse (exit 2) an engine version lorafast has not verified, instead of answering with the nearest",
    )


def add_remote_arguments(p: argparse.ArgumentParser, urls: str) -> None:
    """`--storage-option KEY=VALUE` (repeatable) and `--timeout SECONDS`, for a command that reads `urls`."""
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=key_value,
        help=f"object store option for {urls} (endpoint, region, allow_http, ...); repeatable",
    )
    p.add_argument("--timeout", type=seconds, default=None, help="seconds per remote request (default 10)")


def cmd_inspect(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .scanning import inspect

    adapter = inspect(args.path, content_hash=args.hash)
    if args.json:
        d = asdict(adapter)
        d["flags"] = sorted(adapter.flags)
        if not args.modules:
            d.pop("modules")
        _print_json(d)
    else:
        print(
            f"{adapter.path}\n  format {adapter.format.value}, peft_type {adapter.peft_type}, "
            f"{adapter.num_tensors} tensors, {len(adapter.modules)} modules, rank {adapter.rank}"
        )
        print(f"  moe layout {adapter.moe_layout.value}, experts {adapter.num_experts}, layers {len(adapter.layers)}")
        print(f"  targets {', '.join(adapter.target_modules)}; flags {', '.join(sorted(adapter.flags)) or '-'}")
        for p in adapter.problems:
            print(f"  problem {p.code}: {p.message}")
    return 0


def cmd_header(args: argparse.Namespace) -> int:
    from .header import read_header, read_torch_header

    # torch.save files (PEFT's adapter_model.bin, .pt) are read without unpickling them.
    torch_file = str(args.path).endswith((".bin", ".pt", ".pth"))
    h = read_torch_header(args.path) if torch_file else read_header(args.path, mode=args.mode)
    if args.json:
        _print_json(
            {
                "tensors": {k: vars(v) for k, v in h.tensors.items()},
                "metadata": h.metadata,
                "header_size": h.header_size,
                "file_size": h.file_size,
                "warnings": h.warnings,
            }
        )
    else:
        rows = [
            (name, t.dtype, list(t.shape), f"{t.data_offsets[0]}..{t.data_offsets[1]}") for name, t in h.tensors.items()
        ]
        print(_table(rows, ("tensor", "dtype", "shape", "bytes")))
        print(f"\n{len(h.tensors)} tensors, header {h.header_size} bytes, file {h.file_size} bytes")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from .sample import write_samples

    if args.with_bases:
        from .sample_bases import write_with_bases

        written = write_with_bases(args.out, seed=args.seed)
        if args.json:
            _print_json({"out": os.fspath(args.out), "paths": written})
        else:
            print(f"wrote {len(written)} bases and adapters that fit them to {args.out}:")
            for name, path in written.items():
                print(f"  {name:<14} {path}")
        return 0
    paths = write_samples(args.out, args.n, seed=args.seed)
    if args.json:
        _print_json({"out": os.fspath(args.out), "written": len(paths)})
    else:
        print(f"wrote {len(paths)} sample adapters to {args.out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (no usage dump): `lorafast scan: error: ...`, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """`--version` on one line (argparse's own action wraps the text to the terminal)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_text())
        parser.exit(0)


def version_text() -> str:
    """`lorafast 0.1.0 (release build)`; a debug build (`make test`'s editable one) says so, since it is slower."""
    from . import _core

    profile = getattr(_core, "build_profile", "unknown")
    note = "" if profile == "release" else "; about 4x slower than a release build: `make build-release`"
    return f"lorafast {_core.__version__} ({profile} build{note})"


def launch_parser() -> argparse.ArgumentParser:
    """`lorafast preflight [ADAPTER...] [options] -- LAUNCH COMMAND`: the verdict for the server that command starts."""
    p = _Parser(
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
    add_version_arguments(p, "engine")
    p.add_argument("--json", action="store_true", help="every adapter's verdict, machine-readable, on stdout")
    p.add_argument("--all", action="store_true", help="list every adapter that does not serve (default: the top 20)")
    p.add_argument("--threads", type=positive_int, default=None, help="worker threads for reading the adapters")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_remote_arguments(p, "URL adapters and bases")
    return p


def cmd_launch_preflight(argv: Sequence[str]) -> int:
    from .serving import preflight

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
            storage_options=dict(args.storage_option) or None,
            timeout=args.timeout,
            threads=args.threads,
            progress=False if args.quiet else None,
        )
    except ValueError as e:  # not a launch command of a known engine, or a version refused by --strict-version
        from .compat import UnverifiedEngineVersionError

        if isinstance(e, UnverifiedEngineVersionError) or "launch command" in str(e):
            print(f"lorafast preflight: error: {e}", file=sys.stderr)
            return 2
        raise
    if args.json:
        sys.stdout.write(report.to_json(indent=2) + "\n")
    else:
        sys.stdout.write(report.summary(limit=len(report) if args.all else 20) + "\n")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lorafast",
        description="Header-only tools for LoRA adapter fleets. Exit status, for every command: 0 all fine, "
        "1 something failed or does not serve, 2 a usage error.",
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="the version and whether the build is a release one"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("scan", help="classify every adapter under the given files and folders")
    p.add_argument("paths", nargs="+", help="adapter files, folders (searched recursively) and URLs")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument(
        "--threads", type=positive_int, default=None, help="worker threads (default: LORAFAST_NUM_THREADS or cores)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--all", action="store_true", help="list every failed adapter and adapter with problems (not 20)")
    p.add_argument("--no-recursive", action="store_true", help="do not descend into sub-folders")
    p.add_argument("--hash", action="store_true", help="add the sha256 of each data section (reads all data)")
    p.add_argument("--summary-only", action="store_true", help="with --json: leave out per-adapter records")
    p.add_argument("--index", metavar="FLEET.db", help="keep a persistent index there; read only what changed")
    p.add_argument("--backend", choices=("local", "ray"), default="local", help="ray: scan shards in Ray tasks")
    p.add_argument("--ray-address", default=None, help="Ray cluster to use (default: RAY_ADDRESS or a local one)")
    add_remote_arguments(p, "URL paths")
    p.set_defaults(func=cmd_scan)

    p = sub.add_parser("inspect", help="everything about one adapter")
    p.add_argument("path", help="an adapter file, folder or URL")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--modules", action="store_true", help="with --json: include per-module records")
    p.add_argument("--hash", action="store_true", help="add the sha256 of each data section (reads all data)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("header", help="print the validated header of one safetensors file (or torch .bin/.pt file)")
    p.add_argument("path", help="a .safetensors, .bin or .pt file")
    p.add_argument("--mode", choices=("pread", "mmap"), default="pread", help="how the header is read (default pread)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=cmd_header)

    p = sub.add_parser("sample", help="write realistic sample adapters of every format and MoE layout")
    p.add_argument("--out", required=True, help="the folder to write the adapters into")
    p.add_argument("-n", type=count, default=100, help="how many adapters (default 100)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same fleet")
    p.add_argument(
        "--with-bases",
        action="store_true",
        help="write tiny base models and adapters that fit them (and some that do not), instead of -n samples",
    )
    p.add_argument("--json", action="store_true", help="list what was written, machine-readable, on stdout")
    p.set_defaults(func=cmd_sample)

    for name in _PLUGINS:
        importlib.import_module(name).register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .compat import UnverifiedEngineVersion

    # Paths keep their OS bytes (os.fsdecode's surrogates); print them back as those bytes instead of failing.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")
    argv = sys.argv[1:] if argv is None else list(argv)
    launch = argv[:1] == ["preflight"] and "--" in argv
    args = None if launch else build_parser().parse_args(argv)
    with warnings.catch_warnings():  # restores showwarning for callers of main() in-process
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
            if issubclass(category, UnverifiedEngineVersion):  # one readable line, not a source location
                print(f"lorafast: warning: {message}", file=sys.stderr)
            else:
                shown(message, category, *rest, **kw)

        warnings.showwarning = show
        warnings.simplefilter("default", UnverifiedEngineVersion)  # shown once per call site, never an error
        return _run(args, argv[1:])


def _run(args: argparse.Namespace | None, launch_argv: Sequence[str]) -> int:
    from .compat import UnverifiedEngineVersionError
    from .errors import LorafastError

    try:
        if args is None:
            return cmd_launch_preflight(launch_argv)
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `lorafast scan ... | head`; before OSError, of which it is a subclass
        return 0
    except UnverifiedEngineVersionError as e:  # --strict-version: the input is refused, as a usage error
        print(f"lorafast {args.command if args else 'preflight'}: error: {e}", file=sys.stderr)
        return 2
    except (LorafastError, OSError) as e:
        code = getattr(e, "code", None)
        print(f"lorafast: {f'[{code}] ' if code else ''}{e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
