"""`lorafast convert PATH --to LAYOUT --out DIR [--from LAYOUT] [--overwrite] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from lorafast.converting.api import convert

    res = convert(
        args.path, args.to, args.out, overwrite=args.overwrite, source_layout=args.from_layout, gate_up=args.gate_up
    )
    if args.json:
        sys.stdout.write(json.dumps(res.to_dict(), indent=2) + "\n")
    else:
        rate = res.bytes / res.seconds / 1e9 if res.seconds > 0 else 0.0
        print(
            f"{res.source}: {res.from_layout} -> {res.to_layout}, {res.tensors} tensors, {res.bytes:,} bytes "
            f"in {res.seconds:.2f} s ({rate:.2f} GB/s) -> {res.out}"
        )
        for note in res.notes:
            print(f"note: {note}")
    return 0


def register_cli(subparsers: Any) -> None:
    """Add `lorafast convert` to an argparse subparsers object."""
    from lorafast.converting.api import LAYOUTS

    p = subparsers.add_parser(
        "convert",
        help="rewrite an adapter into another layout (exact), so one server can load a mixed fleet",
        description="Convert an adapter between MoE layouts, from transformers 4 expert names to transformers 5, "
        "or from kohya/old diffusers to a PEFT folder. Exact or refused; nothing is left behind on failure.",
    )
    p.add_argument("path", help="adapter folder or .safetensors file")
    p.add_argument("--to", required=True, choices=LAYOUTS, help="target layout")
    p.add_argument("--out", required=True, help="output folder (adapter_model.safetensors + adapter_config.json)")
    p.add_argument("--from", dest="from_layout", default=None, help="expected source layout (checked)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--gate-up",
        choices=("concatenated", "interleaved"),
        default=None,
        help="row order of a target_parameters gate_up lora_B: interleaved for GPT-OSS (default: from "
        "the adapter config's base_model_name_or_path)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)
