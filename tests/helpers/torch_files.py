"""Hand-made `torch.save` files for the torch reader's tests and fuzz harness (tests/formats/test_torch_weights.py,
tests/fuzz/fuzz_torch.py): a state dict pickled the way torch pickles it, with any storage declarations, and the
zip around it."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import torch

#: torch dtype -> safetensors dtype, for every dtype both name.
ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e8m0fnu: "F8_E8M0",
}  # fmt: skip


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of `t`'s elements in order (a fresh buffer: a view's strides may not allow a byte view)."""
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


def random_view(base: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A view of `base`: sliced, stepped, transposed, expanded or selected, at random."""
    t = base
    for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
        op = int(torch.randint(0, 4, (1,), generator=g))
        if op == 0 and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif op == 1 and t.dim() and t.shape[0] > 1:
            t = t[1 :: int(torch.randint(1, 3, (1,), generator=g))]
        elif op == 2 and t.dim() and t.shape[-1] == 1:
            t = t.expand(*t.shape[:-1], 3)
        elif op == 3 and t.dim() and t.shape[0]:
            t = t[0]
    return t


def random_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """Up to 11 random tensors of several dtypes, 0 to 3 dims, each with a random view of its storage."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e5m2, torch.int64]
    sd: dict[str, torch.Tensor] = {}
    for i in range(int(torch.randint(1, 12, (1,), generator=g))):
        shape = [int(d) for d in torch.randint(0, 5, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)]
        dtype = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=g))]
        base = torch.randn(shape, generator=g).to(dtype)
        sd[f"t{i}"] = base
        if base.dim():
            sd[f"t{i}.view"] = random_view(base, g)  # shares base's storage
    return sd


class Storage(NamedTuple):
    """A persistent id: `numel` elements of `kind` (`torch.FloatStorage`, ...) in the record `data/<key>`."""

    kind: Any
    key: str
    numel: int
    location: str = "cpu"


class Call:
    """Pickles as a call `fn(*args)`, as pickle writes any value it reduces."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


class Tensor:
    """Pickles as torch pickles a tensor: `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, {}[,
    metadata])`."""

    def __init__(
        self,
        storage: Storage,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        offset: int = 0,
        requires_grad: bool = False,
        metadata: Any = None,
    ) -> None:
        self.args: tuple[Any, ...] = (storage, offset, size, stride, requires_grad, OrderedDict())
        if metadata is not None:
            self.args += (metadata,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Storage):
            return ("storage", obj.kind, obj.key, obj.location, obj.numel)
        return None


def state_pickle(state: dict[str, Any]) -> bytes:
    """`state` pickled as torch.save pickles a state dict (protocol 2, storages as persistent ids)."""
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(state)
    return out.getvalue()


def torch_zip(
    path: Path,
    pickle_bytes: bytes,
    records: dict[str, bytes] | None = None,
    *,
    compress: int = zipfile.ZIP_STORED,
    prefix: str = "archive",
    byteorder: bytes | None = b"little",
) -> None:
    """A torch-like archive: `data.pkl`, `byteorder` (None: left out), `version` and `data/<key>` records."""
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        z.writestr(f"{prefix}/data.pkl", pickle_bytes)
        if byteorder is not None:
            z.writestr(f"{prefix}/byteorder", byteorder)
        z.writestr(f"{prefix}/version", "3\n")
        for key, data in (records or {}).items():
            z.writestr(f"{prefix}/data/{key}", data)


def torch_records(path: Path) -> tuple[bytes, dict[str, bytes], str]:
    """(data.pkl, {storage key: bytes}, prefix) of a torch.save file."""
    with zipfile.ZipFile(path) as z:
        (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        prefix = pkl[: -len("/data.pkl")]
        records = {n[len(prefix) + 6 :]: z.read(n) for n in z.namelist() if n.startswith(f"{prefix}/data/")}
        return z.read(pkl), records, prefix
