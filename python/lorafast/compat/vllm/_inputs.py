"""The adapters of a vLLM check as vLLM reads them: a folder on disk (read by vLLM's own code path here), or an
adapter held in memory."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from lorafast.compat._common import LoraRef, lora_id
from lorafast.compat._inputs import AdapterView, is_adapter, resolve_adapters, view_of


def adapter_entries(adapters: Any) -> list[tuple[str, str, str, AdapterView | None]]:
    """(name, id, path, in-memory view or None) per adapter. Paths are not read here: vLLM's load path reads
    them (its own weight-file choice); an Adapter or AdapterView whose path is not on disk is loaded from memory."""

    def one(
        obj: Any, name: str | None = None, adapter_id: str | None = None
    ) -> tuple[str, str, str, AdapterView | None]:
        if isinstance(obj, LoraRef) and obj.adapter is None:
            return name or obj.name, adapter_id or obj.lora_id, obj.path, None
        if isinstance(obj, (str, os.PathLike)):
            path = os.fspath(obj)
            name = name or os.path.basename(path.rstrip("/")).removesuffix(".safetensors")
            return name, adapter_id or lora_id(name, path), path, None
        if is_adapter(obj) and os.path.exists(str(obj.path)):  # a scanned Adapter: vLLM reads its folder
            path = str(obj.path)
            name = name or obj.name
            return name, adapter_id or lora_id(name, path), path, None
        (view,) = resolve_adapters([obj]) if name is None else [view_of(obj, name=name, adapter_id=adapter_id)]
        on_disk = bool(view.path) and os.path.exists(view.path)
        return view.name, view.lora_id, view.path, None if on_disk else view

    if isinstance(adapters, (str, os.PathLike, AdapterView, LoraRef)) or is_adapter(adapters):
        return [one(adapters)]
    if isinstance(adapters, Mapping):
        return [one(value, str(key), str(key)) for key, value in adapters.items()]
    return [one(item) for item in adapters]


def memory_tensors(view: AdapterView) -> Callable[[str], Mapping[str, tuple[int, ...] | None]]:
    def tensors_of(path: str) -> Mapping[str, tuple[int, ...] | None]:
        if view.tensors or view.has_weights:
            return view.tensors
        raise ValueError(f"{path} doesn't contain tensors")

    return tensors_of
