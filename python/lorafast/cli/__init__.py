"""The `lorafast` command (also `python -m lorafast`): `main()` and the table of subcommands.

Each subcommand is a module of this package with `add_parser(subparsers)` and `run(args) -> ExitStatus`; its
shared flags come from `_options`, and every subcommand exits by the one rule of `_status.ExitStatus`: 0 all fine,
1 something failed or does not serve, 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lorafast.cli import (
    check,
    convert,
    engines,
    groups,
    header,
    inspect,
    merge,
    plan,
    preflight,
    sample,
    scan,
    upgrade_check,
)
from lorafast.cli._status import ExitStatus, Parser

#: The subcommands, in the order `lorafast --help` lists them.
COMMANDS: dict[str, ModuleType] = {
    "scan": scan,
    "inspect": inspect,
    "header": header,
    "sample": sample,
    "plan": plan,
    "groups": groups,
    "merge": merge,
    "engines": engines,
    "upgrade-check": upgrade_check,
    "preflight": preflight,
    "check": check,
    "convert": convert,
}


_DESCRIPTION = (
    "Header-only tools for LoRA adapter fleets. Exit status, for every command: 0 all fine, "
    "1 something failed or does not serve, 2 a usage error."
)


class _Version(argparse.Action):
    """`--version` on one line (argparse's own action wraps the text to the terminal)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_text())
        parser.exit(ExitStatus.OK)


def version_text() -> str:
    """`lorafast 0.1.0 (release build)`; a debug build (`make test`'s editable one) says so, since it is slower."""
    from lorafast import _core

    profile = getattr(_core, "build_profile", "unknown")
    note = "" if profile == "release" else "; about 4x slower than a release build: `make build-release`"
    return f"lorafast {_core.__version__} ({profile} build{note})"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lorafast", description=_DESCRIPTION)
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="the version and whether the build is a release one"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from lorafast.compat import UnverifiedEngineVersion

    # Paths keep their OS bytes (os.fsdecode's surrogates); print them back as those bytes instead of failing.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None if preflight.is_launch(argv) else build_parser().parse_args(argv)
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
    """Run the subcommand; the exceptions that reach here map to the exit status by the one rule."""
    from lorafast.compat import UnverifiedEngineVersionError
    from lorafast.errors import LorafastError

    try:
        if args is None:
            return int(preflight.run_launch(launch_argv))
        return int(COMMANDS[args.command].run(args))
    except BrokenPipeError:  # e.g. `lorafast scan ... | head`; before OSError, of which it is a subclass
        return ExitStatus.OK
    except UnverifiedEngineVersionError as e:  # --strict-version: the input is refused, as a usage error
        print(f"lorafast {args.command if args else 'preflight'}: error: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    except (LorafastError, OSError) as e:  # something failed: a file, a read, an adapter
        code = getattr(e, "code", None)
        print(f"lorafast: {f'[{code}] ' if code else ''}{e}", file=sys.stderr)
        return ExitStatus.FAILED


__all__ = ["COMMANDS", "ExitStatus", "build_parser", "main", "version_text"]
