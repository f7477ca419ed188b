"""`lorafast convert PATH... --to LAYOUT --out DIR [--from LAYOUT] [--gate-up ORDER] [--overwrite] [--json]`.

One adapter is written to DIR itself, as `lorafast.convert(path, to, out)` does. Several paths, or one folder of
adapters (a folder that is not itself an adapter), are expanded as `lorafast scan` expands them and each adapter
is written to `DIR/<name>`; one that fails is reported and the others go on (exit 1 if any failed).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json
from lorafast.cli._status import ExitStatus

if TYPE_CHECKING:
    from lorafast.converting import ConvertError, ConvertResult


def add_parser(subparsers: Any) -> None:
    from lorafast.converting import LAYOUTS

    p = subparsers.add_parser(
        "convert",
        help="rewrite adapters into another layout (exact), so one server can load a mixed fleet",
        description="Convert adapters between MoE layouts, from transformers 4 expert names to transformers 5, "
        "or from kohya/old diffusers to a PEFT folder. Exact or refused; nothing is left behind on failure.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="adapter folder or .safetensors file; several, or a folder of adapters, convert each into --out/<name>",
    )
    p.add_argument("--to", required=True, choices=LAYOUTS, help="target layout")
    p.add_argument(
        "--out",
        required=True,
        help="output folder (adapter_model.safetensors + adapter_config.json); with several adapters, the folder "
        "that holds one such folder per adapter",
    )
    p.add_argument("--from", dest="from_layout", default=None, help="expected source layout (checked)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--gate-up",
        choices=("concatenated", "interleaved"),
        default=None,
        help="row order of a target_parameters gate_up lora_B: interleaved for GPT-OSS (default: from "
        "the adapter config's base_model_name_or_path)",
    )
    o.add_json(p, "print the result as JSON (a list with several adapters)")


def _rate(nbytes: int, seconds: float) -> str:
    per = nbytes / seconds if seconds > 0 else 0.0
    return f"{per / 1e9:.2f} GB/s" if per >= 1e9 else f"{per / 1e6:.3g} MB/s"


def _line(res: ConvertResult) -> None:
    print(
        f"{res.source}: {res.from_layout} -> {res.to_layout}, {res.tensors} tensors, {res.bytes:,} bytes "
        f"in {res.seconds:.2f} s ({_rate(res.bytes, res.seconds)}) -> {res.out}"
    )
    for note in res.notes:
        print(f"note: {note}")


def _refused(exc: ConvertError) -> None:
    """A refusal as the CLI says it: naming its flags (`--overwrite`), not `convert`'s arguments."""
    print(f"lorafast: [{exc.code}] {exc.cli}", file=sys.stderr)


def _one_adapter(paths: list[str]) -> bool:
    """Whether `paths` is the single-adapter form: one path that is not a folder of adapters."""
    from lorafast.errors import AdapterError, LorafastError
    from lorafast.scanning import inspect

    if len(paths) != 1:
        return False
    try:
        inspect(paths[0])
    except AdapterError as exc:  # a folder without weights of its own may hold adapters
        return not (exc.code == "no_adapter" and os.path.isdir(paths[0]))
    except (LorafastError, OSError):  # unreadable: the single form reports it
        pass
    return True


def run(args: argparse.Namespace) -> int:
    from lorafast.converting import ConvertError, convert

    options = {"overwrite": args.overwrite, "source_layout": args.from_layout, "gate_up": args.gate_up}
    if _one_adapter(args.paths):
        try:
            res = convert(args.paths[0], args.to, args.out, **options)
        except ConvertError as exc:
            _refused(exc)
            return ExitStatus.FAILED
        if args.json:
            print_json(res.to_dict())
        else:
            _line(res)
        return ExitStatus.OK
    results = convert(list(args.paths), args.to, args.out, **options)
    failed = [r for r in results if isinstance(r, ConvertError)]
    for r in results:
        if isinstance(r, ConvertError):
            _refused(r)
        elif not args.json:
            _line(r)
    if args.json:
        shown = [
            {"source": r.path, "error": {"code": r.code, "message": r.cli}}
            if isinstance(r, ConvertError)
            else r.to_dict()
            for r in results
        ]
        print_json(shown)
    else:
        print(f"{len(results) - len(failed)} converted, {len(failed)} failed -> {args.out}")
    return ExitStatus.failed_if(failed)
