"""lorafast: header-only scanning, engine checks, merge planning and merging for LoRA adapter fleets.

`import lorafast` is cheap: numpy and torch load only when a call needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core import HEADER_ERROR_CODES
from .adapter import Adapter, AdapterFormat, LoraModule, MoeLayout, Problem
from .errors import AdapterError, HeaderError, LorafastError
from .header import Header, TensorInfo, read_header
from .scan import ScanReport, inspect, inspect_many, scan

__version__ = "0.1.0"

# Features built on torch or on the planner load on first use.
_LAZY = {
    "plan": ("plan", "plan"),
    "LoraRequest": ("plan", "LoraRequest"),
    "Plan": ("plan", "Plan"),
    "plan_groups": ("groups", "plan_groups"),
    "merge": ("merge", "merge"),
    "MergeHandle": ("merge", "MergeHandle"),
    "compat": ("compat", None),
}

if TYPE_CHECKING:
    from . import compat as compat


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(f".{module_name}", __name__)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lorafast' has no attribute {name!r}")


__all__ = [
    "HEADER_ERROR_CODES",
    "Adapter",
    "AdapterError",
    "AdapterFormat",
    "Header",
    "HeaderError",
    "LoraModule",
    "LorafastError",
    "MoeLayout",
    "Problem",
    "ScanReport",
    "TensorInfo",
    "inspect",
    "inspect_many",
    "read_header",
    "scan",
    *_LAZY,
]
