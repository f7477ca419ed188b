"""`lorafast merge`: base checkpoint + adapters -> merged checkpoint, streamed, with a progress bar."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._status import ExitStatus, usage_error

_DESCRIPTION = (
    "Write a merged checkpoint: W += Σ strength·scale·(B@A), accumulated in fp32, cast once. "
    "Streams tensor by tensor, so memory stays bounded by --chunk-bytes."
)


def add_parser(subparsers: Any) -> None:
    summary = "merge LoRA adapters into a base safetensors checkpoint (streamed)"
    p = subparsers.add_parser("merge", help=summary, description=_DESCRIPTION)
    p.add_argument("--base", required=True, help="base checkpoint: a .safetensors file, or a model folder holding one")
    p.add_argument(
        "--adapter",
        action="append",
        required=True,
        metavar="PATH[:STRENGTH]",
        help="adapter folder or .safetensors file, with an optional strength (default 1.0); repeat to add more",
    )
    p.add_argument("--out", required=True, help="merged checkpoint to write (.safetensors; a folder for a folder base)")
    p.add_argument("--device", default=None, help="compute device (default cpu), e.g. cuda or cuda:1")
    p.add_argument("--chunk-bytes", default=None, help="bound on working memory, e.g. 256M (default 256M)")
    p.add_argument(
        "--allow-prefix",
        action="store_true",
        help="merge modules found only below another prefix (a CausalLM adapter on a Llava-style wrapper); "
        "without it they are refused, as `lorafast check` reports them",
    )
    p.add_argument("--unsafe", action="store_true", help="skip the NaN/Inf check of merged tensors")
    o.add_json(p, "print a JSON summary on stdout")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`268435456`, `256M`, `256MiB`, `1g` -> bytes (binary units)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 256M or 1G)")
    unit = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    n = int(float(m.group(1)) * unit)
    if n <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return n


def parse_adapter(text: str) -> tuple[str, float]:
    """`path` or `path:strength` (the strength is the part after the last colon, when it is a number)."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return text, 1.0


class _Bar:
    """A one-line progress bar on stderr (drawn only when stderr is a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        width = 30
        filled = int(frac * width)
        rate = done / max(now - self.start, 1e-9) / 1e9
        sys.stderr.write(
            f"\rmerging [{'#' * filled}{'.' * (width - filled)}] {frac:6.1%} "
            f"{done / 1e9:.2f}/{total / 1e9:.2f} GB {rate:.2f} GB/s"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _base_file(base: str, out: str) -> tuple[str, str]:
    """(the base file, the output file). A base folder with one weight file (as `check --base` takes it) merges
    into a folder of the same layout: OUT/<that file>, with the folder's other files (config.json, tokenizer)
    copied beside it, so OUT loads as the base did."""
    import os
    import shutil

    if not os.path.isdir(base):
        return base, out
    files = sorted(f for f in os.listdir(base) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(
            f"{base}: a folder with {len(files)} .safetensors files; merge takes a single-file base (give the file, "
            "or one shard at a time)"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out}: a file, but the base is a folder (give a folder to write the merged model to)")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(base):
        src = os.path.join(base, name)
        if name != files[0] and os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out, name))
    return os.path.join(base, files[0]), os.path.join(out, files[0])


def run(args: argparse.Namespace) -> int:
    from lorafast.merging import DEFAULT_CHUNK_BYTES, MergeError, merge_file

    try:
        chunk = DEFAULT_CHUNK_BYTES if args.chunk_bytes is None else parse_size(args.chunk_bytes)
        base, out = _base_file(args.base, args.out)
    except ValueError as exc:  # a bad --chunk-bytes, or a --base folder / --out that do not go together
        return usage_error("merge", str(exc))
    requests = [parse_adapter(a) for a in args.adapter]
    bar = _Bar(enabled=not args.quiet and not args.json and sys.stderr.isatty())
    try:
        summary: dict[str, Any] = merge_file(
            base,
            requests,
            out,
            device=args.device,
            chunk_bytes=chunk,
            safe=not args.unsafe,
            progress=bar,
            allow_prefix=args.allow_prefix,
        )
    except MergeError as exc:
        if args.json:
            print(
                json.dumps(
                    {"ok": False, "code": exc.code, "error": str(exc), "module": exc.module, "adapter": exc.adapter}
                )
            )
        print(f"lorafast merge: error: {exc}", file=sys.stderr)
        return ExitStatus.FAILED
    except (OSError, ValueError) as exc:
        print(f"lorafast merge: error: {exc}", file=sys.stderr)
        return ExitStatus.FAILED
    if args.json:
        print(json.dumps({"ok": True, **summary}))
    elif not args.quiet:
        gbps = summary["bytes"] / max(summary["seconds"], 1e-9) / 1e9
        names = ", ".join(f"{a['nickname']}@{a['strength']:g}" for a in summary["adapters"])
        print(
            f"wrote {summary['out']}: {summary['targets']} of {summary['tensors']} tensors merged "
            f"({names}) in {summary['seconds']:.2f}s, {gbps:.2f} GB/s"
        )
    if not args.quiet and not args.json:
        for row in summary.get("prefixes", ()):
            print(
                f"note: adapter {row['adapter']!r}: {row['modules']} modules merged below another prefix: "
                f"{row['adapter_prefix'] or '(none)'!r} -> {row['base_prefix'] or '(none)'!r} (--allow-prefix)",
                file=sys.stderr,
            )
    return ExitStatus.OK
