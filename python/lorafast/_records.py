"""The JSON form of lorafast's result dataclasses, written once: fields in declaration order, nested results by
their own `to_dict`, tuples as lists, mappings as dicts, enums by value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from enum import Enum
from typing import Any


def plain(value: Any) -> Any:
    """`value` as JSON takes it."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list, frozenset, set)):
        return [plain(v) for v in value]
    return value


def record(obj: Any, rename: Mapping[str, str] | None = None, **override: Any) -> dict[str, Any]:
    """A dataclass instance's public fields as a dict (`rename`: field -> key); `override` replaces a key's value
    in place (or adds it at the end)."""
    rename = rename or {}
    out: dict[str, Any] = {}
    for f in fields(obj):
        if not f.name.startswith("_"):
            key = rename.get(f.name, f.name)
            out[key] = override.pop(key) if key in override else plain(getattr(obj, f.name))
    out.update(override)
    return out
