"""`lorafast header FILE`: the validated header of one safetensors file (or torch .bin/.pt file)."""

from __future__ import annotations

import argparse
from typing import Any

from lorafast.cli import _options as o
from lorafast.cli._output import print_json, table
from lorafast.cli._status import ExitStatus


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "header", help="print the validated header of one safetensors file (or torch .bin/.pt file)"
    )
    p.add_argument("path", help="a .safetensors, .bin or .pt file")
    p.add_argument("--mode", choices=("pread", "mmap"), default="pread", help="how the header is read (default pread)")
    o.add_json(p)


def run(args: argparse.Namespace) -> int:
    from lorafast.header import read_header, read_torch_header

    # torch.save files (PEFT's adapter_model.bin, .pt) are read without unpickling them.
    torch_file = str(args.path).endswith((".bin", ".pt", ".pth"))
    h = read_torch_header(args.path) if torch_file else read_header(args.path, mode=args.mode)
    if args.json:
        print_json(
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
        print(table(rows, ("tensor", "dtype", "shape", "bytes")))
        print(f"\n{len(h.tensors)} tensors, header {h.header_size} bytes, file {h.file_size} bytes")
    return ExitStatus.OK
