"""`--lora-paths` as `check_lora_server_args` parses it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import LoraRef
from lorafast.compat.sglang._names import (
    MSG_PATHS_DICT_KEYS,
    MSG_PATHS_ITEM_TYPE,
    MSG_PATHS_TYPE,
)


def parse_lora_paths(lora_paths: Any, *, engine_version: str | None = None) -> list[LoraRef]:
    """`--lora-paths` as `check_lora_server_args` parses it: `NAME=PATH`, `PATH`, or dicts with `pinned`."""
    _versions.resolve("sglang", engine_version)
    if lora_paths is None:
        return []
    if isinstance(lora_paths, Mapping):
        return [LoraRef(name=k, path=v) for k, v in lora_paths.items()]
    if not isinstance(lora_paths, list):
        raise ValueError(MSG_PATHS_TYPE.format(type=type(lora_paths)))
    refs = []
    for item in lora_paths:
        if isinstance(item, str):
            name, path = item.split("=", 1) if "=" in item else (item, item)
            refs.append(LoraRef(name=name, path=path))
        elif isinstance(item, dict):
            assert "lora_name" in item and "lora_path" in item, MSG_PATHS_DICT_KEYS.format(item=item)
            refs.append(LoraRef(name=item["lora_name"], path=item["lora_path"], pinned=item.get("pinned", False)))
        else:
            raise ValueError(MSG_PATHS_ITEM_TYPE.format(type=type(item)))
    return refs
