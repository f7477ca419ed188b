"""A small safetensors writer for tests, samples and benchmarks (numpy only; torch only when given its tensors).

`write_safetensors(path, tensors)` writes a valid file. `tensors` maps a name to a numpy array, a torch tensor, or
a `(dtype, shape)` pair when only the header matters: the data section is then zero-filled, which is
what header-only tests need and keeps sample adapters cheap to write. `write_peft_adapter(folder, tensors,
**config)` writes a PEFT folder (weights and `adapter_config.json`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Union

#: safetensors dtype name -> size in bits. Kept as a table (fmt: skip), one row per width: one name a line
#: would hide which dtypes share a size.
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip

_NUMPY_TO_ST = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}

TensorSpec = Union["Any", tuple[str, Sequence[int]]]


def header_bytes(entries: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize a header dict the way the safetensors crate does: compact JSON padded to 8 bytes."""
    obj: dict[str, Any] = {}
    if metadata is not None:
        obj["__metadata__"] = dict(metadata)
    obj.update(entries)
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * DTYPE_BITS[dtype] // 8


def _torch_entry(tensor: Any) -> tuple[str, list[int], bytes]:
    """A torch tensor's safetensors dtype, shape and little-endian bytes (dtype names from `lorafast.tensors`)."""
    import sys

    import torch

    from lorafast.tensors import _ST_DTYPES

    if sys.byteorder != "little":  # pragma: no cover - torch's bytes are native-endian
        raise NotImplementedError("writing torch tensors needs a little-endian machine")
    names = {torch_name: st for st, (torch_name, _) in _ST_DTYPES.items()}
    t = tensor.detach().cpu().contiguous()
    dtype = names[str(t.dtype).removeprefix("torch.")]
    return dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, TensorSpec],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` (name -> numpy array, torch tensor, or (dtype, shape)) as one safetensors file."""
    entries: dict[str, Any] = {}
    chunks: list[bytes | int] = []
    offset = 0
    for name, spec in tensors.items():
        if isinstance(spec, tuple):
            dtype, shape = spec[0], [int(d) for d in spec[1]]
            size = _nbytes(dtype, shape)
            chunks.append(size)
        elif type(spec).__module__.startswith("torch"):
            dtype, shape, data = _torch_entry(spec)
            size = len(data)
            chunks.append(data)
        else:
            arr = spec
            dtype = _NUMPY_TO_ST[str(arr.dtype)] if not hasattr(arr, "st_dtype") else arr.st_dtype
            shape = list(arr.shape)
            data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
            size = len(data)
            chunks.append(data)
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = header_bytes(entries, metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for chunk in chunks:
            if isinstance(chunk, int):
                if chunk:
                    f.seek(chunk - 1, os.SEEK_CUR)
                    f.write(b"\0")
            else:
                f.write(chunk)


#: The `adapter_config.json` `write_peft_adapter` starts from.
PEFT_CONFIG_DEFAULTS: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
}


def write_peft_adapter(
    folder: str | os.PathLike[str], tensors: Mapping[str, TensorSpec | Sequence[int]], **config: Any
) -> str:
    """Write a PEFT adapter folder: `adapter_model.safetensors` and `adapter_config.json`; return the folder.

    `tensors` maps a name to what `write_safetensors` takes, or to a bare shape (a tuple of ints: zero-filled
    BF16). `config` updates `PEFT_CONFIG_DEFAULTS`; a None value leaves that key out. Parent folders are made.
    """
    os.makedirs(folder, exist_ok=True)
    specs: dict[str, TensorSpec] = {}
    for name, spec in tensors.items():
        is_shape = isinstance(spec, tuple) and not (spec and isinstance(spec[0], str))
        specs[name] = ("BF16", spec) if is_shape else spec
    write_safetensors(os.path.join(folder, "adapter_model.safetensors"), specs)
    cfg = {k: v for k, v in {**PEFT_CONFIG_DEFAULTS, **config}.items() if v is not None}
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return os.fspath(folder)


def write_attention_adapter(
    folder: str | os.PathLike[str],
    r: int = 8,
    layers: int = 2,
    modules: Sequence[str] = ("q_proj", "v_proj"),
    config: Mapping[str, Any] | None = None,
    extra: Mapping[str, TensorSpec] | None = None,
    dtype: str = "BF16",
) -> str:
    """A PEFT adapter of attention `modules` on `layers` layers of a 32-wide model, rank `r`, alpha 2r; `extra`
    tensors join the file and `config` updates its `adapter_config.json`."""
    tensors: dict[str, TensorSpec] = {}
    for layer in range(layers):
        for m in modules:
            key = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            tensors[f"{key}.lora_A.weight"] = (dtype, (r, 32))
            tensors[f"{key}.lora_B.weight"] = (dtype, (32, r))
    tensors.update(extra or {})
    cfg = {"r": r, "lora_alpha": 2 * r, "target_modules": list(modules), **(config or {})}
    return write_peft_adapter(folder, tensors, **cfg)


def write_raw(path: str | os.PathLike[str], header: bytes, data_len: int = 0, n: int | None = None) -> None:
    """Write a file from a raw header (for malformed-file tests): 8-byte N, the header, `data_len` zero bytes."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if n is None else n))
        f.write(header)
        f.write(b"\0" * data_len)
