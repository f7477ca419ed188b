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

from lorafast.formats.safetensors import DTYPES, FROM_NUMPY, FROM_TORCH, encode_header, nbytes

#: safetensors dtype name -> size in bits (from `lorafast.formats.safetensors.DTYPES`)
DTYPE_BITS = {name: d.bits for name, d in DTYPES.items()}

TensorSpec = Union["Any", tuple[str, Sequence[int]]]


def _torch_entry(tensor: Any) -> tuple[str, list[int], bytes]:
    """A torch tensor's safetensors dtype, shape and little-endian bytes (dtype names from `lorafast.formats.safetensors`)."""
    import sys

    import torch

    if sys.byteorder != "little":  # pragma: no cover - torch's bytes are native-endian
        raise NotImplementedError("writing torch tensors needs a little-endian machine")
    t = tensor.detach().cpu().contiguous()
    dtype = FROM_TORCH[str(t.dtype).removeprefix("torch.")]
    return dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, TensorSpec],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` (name -> numpy array, torch tensor, or (dtype, shape)) as one safetensors file."""
    entries: list[tuple[str, str, list[int], int]] = []
    chunks: list[bytes | int] = []
    for name, spec in tensors.items():
        if isinstance(spec, tuple):
            dtype, shape = spec[0], [int(d) for d in spec[1]]
            size = nbytes(dtype, shape)
            chunks.append(size)
        elif type(spec).__module__.startswith("torch"):
            dtype, shape, data = _torch_entry(spec)
            size = len(data)
            chunks.append(data)
        else:
            arr = spec
            dtype = FROM_NUMPY[str(arr.dtype)] if not hasattr(arr, "st_dtype") else arr.st_dtype
            shape = list(arr.shape)
            data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
            size = len(data)
            chunks.append(data)
        entries.append((name, dtype, shape, size))
    head, _ = encode_header(entries, metadata)
    with open(path, "wb") as f:
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
