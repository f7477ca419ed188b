"""The flags several subcommands share, declared once, and the argument types of every subcommand.

An argument type raises `argparse.ArgumentTypeError`, which argparse turns into a one-line usage error (exit
status 2). A subcommand takes a shared flag from here rather than declaring it again, so that `--threads`,
`--json`, `--engine-version` or the remote options parse the same everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

# ---------------------------------------------------------------------------------------------------------------
# Argument types


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
    from lorafast.compat import parse_engine_version

    try:
        parse_engine_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def comma_list(text: str) -> list[str]:
    """`a,b,c` -> `["a", "b", "c"]`; an empty value is an empty list (the flag's default)."""
    return text.split(",") if text else []


def read_json(path: str | None) -> Any:
    """The JSON file a flag names (`--base-config`), or None without one."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------
# Shared flags


def add_json(p: argparse.ArgumentParser, help: str = "machine-readable output on stdout") -> None:
    p.add_argument("--json", action="store_true", help=help)


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads", type=positive_int, default=None, help="worker threads (default: LORAFAST_NUM_THREADS or cores)"
    )


def add_progress(p: argparse.ArgumentParser) -> None:
    """`--quiet`: no progress bar (`progress(args)` is what the library's `progress=` takes)."""
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def progress(args: argparse.Namespace) -> bool | None:
    """`progress=` of a scan: off with `--quiet`, else the library's default (a bar when stderr is a terminal)."""
    return False if args.quiet else None


def add_all(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--all", action="store_true", help=f"list every {what} (default: the top 20)")


def add_hash(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hash", action="store_true", help="add the sha256 of each data section (reads all data)")


def add_remote(p: argparse.ArgumentParser, urls: str) -> None:
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


def remote(args: argparse.Namespace) -> dict[str, Any]:
    """`storage_options=` and `timeout=` as the library takes them, from `add_remote`'s flags."""
    return {"storage_options": dict(args.storage_option) or None, "timeout": args.timeout}


def add_engine_version(p: argparse.ArgumentParser, engine: str) -> None:
    """`--engine-version VERSION` and `--strict-version`, the same on every command that answers for an engine."""
    p.add_argument(
        "--engine-version",
        metavar="VERSION",
        type=engine_version,
        default=None,
        help=f"the {engine} release to answer for, e.g. 0.5.23 or 0.34.0 (default: installed, else newest verified;"
        " `lorafast engines` lists the verified ones)",
    )
    add_strict_version(p)


def add_strict_version(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strict-version",
        action="store_true",
        help="refuse (exit 2) an engine version lorafast has not verified, instead of answering with the nearest",
    )


def add_max_lora_rank(p: argparse.ArgumentParser, help: str) -> None:
    """The server's `--max-lora-rank`: a rank below 1 is a usage error (SGLang would only fail later, allocating a
    buffer of negative size)."""
    p.add_argument("--max-lora-rank", type=positive_int, default=None, help=help)


def add_base_config(p: argparse.ArgumentParser, help: str) -> None:
    """`--base-config CONFIG.json`, read with `read_json(args.base_config)`."""
    p.add_argument("--base-config", metavar="CONFIG.json", default=None, help=help)


def add_expected_modules(p: argparse.ArgumentParser, help: str) -> None:
    """vLLM's expected LoRA module names, comma-separated (a list in `args.expected_modules`)."""
    p.add_argument("--expected-modules", type=comma_list, default=None, help=help)
