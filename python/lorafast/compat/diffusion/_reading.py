"""SGLang diffusion's adapter tensors as these rules see them (`Tensor`): one safetensors file read header only,
in data order, with the values of one-element `.alpha` tensors; or a state dict, a scanned adapter, a view."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from lorafast.compat import _versions
from lorafast.compat._inputs import AdapterView
from lorafast.formats.safetensors import DTYPES, decode_scalar

Shape = tuple[int, ...]


class Tensor(NamedTuple):
    """A tensor as these rules see it: its shape, and its value when it has one element and was read.

    `data` says where the rest of its values are, for the one rule that needs them (kohya Flux, below): a
    `(file, dtype, start, end)` tuple of a tensor read from a file, or an array the caller passed.
    """

    shape: Shape
    value: float | int | None = None
    data: Any = None

    def values(self) -> Any:
        """Its values as a torch tensor, from its file or the array given; None when unknown. Needs torch."""
        return _tensor_values(self)


def resolve_version(engine_version: str | None) -> tuple[int, ...]:
    return _versions.resolve("sglang", engine_version)


# --- reading ----------------------------------------------------------------------------------------------


def weight_file(path: str) -> str:
    """A file as given; a folder: its one `.safetensors` file."""
    if not os.path.isdir(path):
        return path
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if len(found) != 1:
        raise ValueError(f"{path}: expected one .safetensors file, found {len(found)}; pass the file")
    return os.path.join(path, found[0])


def read_file(path: str | os.PathLike[str]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """`({name: Tensor}, metadata)` of one safetensors file, in data order, header only.

    Data order is the order of `data_offsets` (SGLang's `load_file` returns tensors so); the values of
    one-element `.alpha` tensors are read (a few bytes each), no other tensor data.
    """
    from lorafast import _core

    path = weight_file(os.fspath(path))
    header = _core.read_header(path, "pread")
    entries = sorted(header["tensors"], key=lambda e: (tuple(e[3]), e[0]))
    base = 8 + header["header_size"]
    out: dict[str, Tensor] = {}
    with open(path, "rb") as f:
        for name, dtype, shape, (start, end) in entries:
            shape = tuple(int(d) for d in shape)
            value = None
            if name.endswith(".alpha") and math.prod(shape) == 1:
                f.seek(base + start)
                value = decode_scalar(f.read(end - start), dtype)
            out[name] = Tensor(shape, value, (path, dtype, base + start, base + end))
    return out, dict(header["metadata"] or {})


def _as_tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    shape = getattr(value, "shape", value)
    shape = tuple(int(d) for d in shape) if shape is not None else ()
    scalar = None
    if hasattr(value, "item") and math.prod(shape) == 1:
        scalar = value.item()
    return Tensor(shape, scalar, value if hasattr(value, "shape") else None)


def adapter_state(adapter: Any) -> dict[str, Tensor]:
    """`{name: Tensor}` for a path, an AdapterView, a scanned Adapter, or a state dict of shapes or arrays."""
    if isinstance(adapter, (str, os.PathLike)):
        return read_file(adapter)[0]
    if isinstance(adapter, AdapterView):
        if adapter.path and os.path.exists(adapter.path):
            try:
                return read_file(adapter.path)[0]  # data order and alpha values, which the view lacks
            except ValueError:
                pass  # not one readable safetensors file: the view's own table
        return {k: Tensor(tuple(v or ())) for k, v in adapter.tensors.items()}
    if isinstance(adapter, Mapping) and not hasattr(adapter, "modules"):
        return {k: _as_tensor(v) for k, v in adapter.items()}
    files = getattr(adapter, "weight_files", None)
    if files:
        return read_file(files[0])[0]
    raise TypeError(f"expected a path, an Adapter, an AdapterView or a state dict, got {type(adapter).__name__}")


def _tensor_values(t: Tensor) -> Any:
    """The tensor's values, from its file or the array given; None when unknown."""
    import torch

    if t.data is None:
        return None
    if not isinstance(t.data, tuple):
        return torch.as_tensor(t.data)
    path, dtype, start, end = t.data
    torch_name = DTYPES[dtype].torch if dtype in DTYPES else None
    if torch_name is None or not hasattr(torch, torch_name):
        return None
    with open(path, "rb") as f:
        f.seek(start)
        raw = bytearray(f.read(end - start))
    return torch.frombuffer(raw, dtype=getattr(torch, torch_name)).reshape(t.shape) if raw else None
