"""Tensor names and shapes of a `torch.save` zip file (`adapter_model.bin` / `.pt`), without running its pickle.

vLLM loads such adapters with `torch.load(weights_only=True)` and checks their names like safetensors keys.
This reader unpickles `data.pkl` with an allow-list: the only callables it resolves are its own stand-ins for
`OrderedDict` and torch's tensor rebuild, which record a shape and touch no data. Any other global is refused
with `pickle.UnpicklingError`, so a hostile pickle never runs code. Tensor data is never read.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from typing import Any

Shape = tuple[int, ...]

_STORAGES = frozenset(
    f"{kind}Storage"
    for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool", "Untyped")
)


def _rebuild_tensor(storage: Any, offset: int, size: Any, *rest: Any) -> Shape:
    return tuple(int(d) for d in size)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return name
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in a LoRA weights file")

    def persistent_load(self, pid: Any) -> Any:
        return None  # a storage reference; its bytes are not needed for names and shapes


def read_torch_names_and_shapes(path: str) -> dict[str, Shape | None]:
    """`{name: shape}` in the order `torch.load` returns them (the saved dict's order)."""
    with zipfile.ZipFile(path) as zf:
        pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise ValueError(f"{path}: not a torch zip checkpoint (no data.pkl)")
        data = _Unpickler(io.BytesIO(zf.read(pkl))).load()
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the checkpoint is not a dict of tensors")
    return {str(k): (v if isinstance(v, tuple) else None) for k, v in data.items()}
