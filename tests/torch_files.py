"""Hand-made `torch.save` files for the torch reader's tests and fuzz harness (tests/test_torch_weights.py,
tests/fuzz_torch.py): a state dict pickled the way torch pickles it, with any storage declarations, and the
zip around it."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import torch


class Storage(NamedTuple):
    """A persistent id: `numel` elements of `kind` (`torch.FloatStorage`, ...) in the record `data/<key>`."""

    kind: Any
    key: str
    numel: int


class Tensor:
    """Pickles as torch pickles a tensor: `_rebuild_tensor_v2(storage, offset, size, stride, False, {})`."""

    def __init__(self, storage: Storage, size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> None:
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Storage):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
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
