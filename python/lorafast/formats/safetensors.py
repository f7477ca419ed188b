"""safetensors: the dtype table and the one header writer. Reading is the core's (`lorafast._core.read_header`),
so scan, merge and convert share one validator."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple


class Dtype(NamedTuple):
    """One safetensors dtype: its width, and its name in torch and numpy (None where they have none)."""

    bits: int
    torch: str | None
    numpy: str | None


#: safetensors dtype name -> width and torch/numpy names. A table (fmt: skip): one row per dtype.
DTYPES: dict[str, Dtype] = {
    "BOOL": Dtype(8, "bool", "bool"),
    "F4": Dtype(4, None, None),
    "F6_E2M3": Dtype(6, None, None),
    "F6_E3M2": Dtype(6, None, None),
    "U8": Dtype(8, "uint8", "uint8"),
    "I8": Dtype(8, "int8", "int8"),
    "F8_E5M2": Dtype(8, "float8_e5m2", None),
    "F8_E4M3": Dtype(8, "float8_e4m3fn", None),
    "F8_E8M0": Dtype(8, "float8_e8m0fnu", None),
    "F8_E4M3FNUZ": Dtype(8, "float8_e4m3fnuz", None),
    "F8_E5M2FNUZ": Dtype(8, "float8_e5m2fnuz", None),
    "I16": Dtype(16, "int16", "int16"),
    "U16": Dtype(16, "uint16", "uint16"),
    "F16": Dtype(16, "float16", "float16"),
    "BF16": Dtype(16, "bfloat16", None),
    "I32": Dtype(32, "int32", "int32"),
    "U32": Dtype(32, "uint32", "uint32"),
    "F32": Dtype(32, "float32", "float32"),
    "C64": Dtype(64, None, "complex64"),
    "F64": Dtype(64, "float64", "float64"),
    "I64": Dtype(64, "int64", "int64"),
    "U64": Dtype(64, "uint64", "uint64"),
}  # fmt: skip

#: numpy dtype name -> safetensors dtype name
FROM_NUMPY: dict[str, str] = {d.numpy: name for name, d in DTYPES.items() if d.numpy is not None}
#: torch dtype attribute name -> safetensors dtype name
FROM_TORCH: dict[str, str] = {d.torch: name for name, d in DTYPES.items() if d.torch is not None}


#: struct formats of the one-element values lorafast reads (kohya `.alpha` scalars); BF16 is widened to F32
_SCALAR_FORMATS = {"F64": "<d", "F32": "<f", "F16": "<e", "I64": "<q", "I32": "<i", "I16": "<h", "I8": "<b",
                   "U8": "<B", "U16": "<H", "U32": "<I", "U64": "<Q", "BOOL": "<?"}  # fmt: skip


def decode_scalar(raw: bytes, dtype: str) -> float | int | None:
    """The value of one little-endian element of `dtype` (a `.alpha` scalar's bytes); None for a dtype without
    a plain number (F8, F4, complex)."""
    if dtype == "BF16":
        return float(struct.unpack("<f", b"\x00\x00" + raw)[0])
    fmt = _SCALAR_FORMATS.get(dtype)
    if fmt is None or len(raw) != struct.calcsize(fmt):
        return None
    value = struct.unpack(fmt, raw)[0]
    return int(value) if dtype == "BOOL" else value


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `dtype` and `shape` (KeyError for a dtype safetensors does not have)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * DTYPES[dtype].bits // 8


def itemsize(dtype: str) -> int:
    """Bytes per element of a whole-byte dtype (KeyError for an unknown one)."""
    return DTYPES[dtype].bits // 8


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.\-]*$")  # needs no JSON escaping


def encode_header(
    tensors: Iterable[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, int]:
    """The bytes before a safetensors file's data, for `(name, dtype, shape, nbytes)` in data order: the 8-byte
    length and the header, compact JSON padded with spaces to 8 bytes, as the safetensors crate writes it.
    Returns them and the data section's length.

    Assembled from strings (the bytes of `json.dumps(..., separators=(",", ":"))`): samples of thousands of
    tensors are rendered hundreds of times."""
    parts: list[str] = []
    if metadata is not None:
        parts.append('"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":")))
    offset = 0
    for name, dtype, shape, size in tensors:
        dims = ",".join(str(int(d)) for d in shape)
        quoted = f'"{name}"' if _PLAIN_NAME.match(name) else json.dumps(name)
        parts.append(f'{quoted}:{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{offset},{offset + size}]}}')
        offset += size
    raw = ("{" + ",".join(parts) + "}").encode()
    head = raw + b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(head)) + head, offset
