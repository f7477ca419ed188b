"""lorafast: header-only scanning, engine checks, merge planning and merging for LoRA adapter fleets.

`import lorafast` is cheap (no numpy, no torch, no dataclasses): each feature's module loads on
first use of the name that needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _core
from .codes import ADAPTER_ERROR_CODES, HEADER_ERROR_CODES, PROBLEM_CODES, TORCH_ERROR_CODES
from .errors import AdapterError, HeaderError, InternalError, LorafastError

__version__: str = _core.__version__  # Cargo.toml's version, the one source (pyproject takes it too)

# A library logs, the application decides what is shown: without this, Python's last-resort handler prints the
# engines' warnings that lorafast replays (one SGLang warning lists every skipped weight) to stderr.
import logging as _logging

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# public name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "Adapter": ("adapter", "Adapter"),
    "AdapterFormat": ("adapter", "AdapterFormat"),
    "LoraModule": ("adapter", "LoraModule"),
    "MoeLayout": ("adapter", "MoeLayout"),
    "Problem": ("adapter", "Problem"),
    "Header": ("header", "Header"),
    "TensorInfo": ("header", "TensorInfo"),
    "read_header": ("header", "read_header"),
    "read_torch_header": ("header", "read_torch_header"),
    "ScanReport": ("scanning", "ScanReport"),
    "inspect": ("scanning", "inspect"),
    "inspect_many": ("scanning", "inspect_many"),
    "scan": ("scanning", "scan"),
    "Index": ("scanning.index", "Index"),
    "plan": ("planner", "plan"),
    "LoraRequest": ("planner", "LoraRequest"),
    "Plan": ("planner", "Plan"),
    "PlanError": ("planner", "PlanError"),
    "plan_groups": ("groups", "plan_groups"),
    "merge": ("merging", "merge"),
    "convert": ("converting", "convert"),
    "ConvertError": ("converting", "ConvertError"),
    "ConvertResult": ("converting", "ConvertResult"),
    "MergeHandle": ("merging", "MergeHandle"),
    "compat": ("compat", None),
    "BaseModel": ("base", "BaseModel"),
    "read_base": ("base", "read_base"),
    "check": ("checker", "check"),
    "CheckReport": ("checker", "CheckReport"),
    "identify": ("families", "identify"),
    "fingerprint": ("families", "fingerprint"),
    "preflight": ("serving", "preflight"),
    "PreflightReport": ("serving", "PreflightReport"),
    "AdapterVerdict": ("serving", "AdapterVerdict"),
    "UnverifiedEngineVersion": ("compat", "UnverifiedEngineVersion"),
    "UnverifiedEngineVersionError": ("compat", "UnverifiedEngineVersionError"),
}

if TYPE_CHECKING:
    from . import compat as compat
    from .adapter import Adapter, AdapterFormat, LoraModule, MoeLayout, Problem
    from .base import BaseModel, read_base
    from .checker import CheckReport, check
    from .compat import UnverifiedEngineVersion, UnverifiedEngineVersionError
    from .converting import ConvertError, ConvertResult, convert
    from .families import fingerprint, identify
    from .groups import plan_groups
    from .header import Header, TensorInfo, read_header, read_torch_header
    from .merging import MergeHandle, merge
    from .planner import LoraRequest, Plan, PlanError, plan
    from .scanning import ScanReport, inspect, inspect_many, scan
    from .scanning.index import Index
    from .serving import AdapterVerdict, PreflightReport, preflight


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'lorafast' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{target[0]}", __name__)
    # Bind every public name of that module at once: importing a submodule named like one of
    # its functions (plan, merge) would otherwise leave the module object under that name.
    for other, (mod, attr) in _LAZY.items():
        if mod == target[0]:
            globals()[other] = module if attr is None else getattr(module, attr)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "ADAPTER_ERROR_CODES",
    "HEADER_ERROR_CODES",
    "PROBLEM_CODES",
    "TORCH_ERROR_CODES",
    "Adapter",
    "AdapterError",
    "AdapterVerdict",
    "BaseModel",
    "CheckReport",
    "ConvertError",
    "ConvertResult",
    "AdapterFormat",
    "Header",
    "HeaderError",
    "Index",
    "InternalError",
    "LoraModule",
    "LoraRequest",
    "LorafastError",
    "MergeHandle",
    "MoeLayout",
    "Plan",
    "PlanError",
    "PreflightReport",
    "Problem",
    "ScanReport",
    "TensorInfo",
    "UnverifiedEngineVersion",
    "UnverifiedEngineVersionError",
    "check",
    "compat",
    "convert",
    "fingerprint",
    "identify",
    "inspect",
    "inspect_many",
    "merge",
    "plan",
    "plan_groups",
    "preflight",
    "read_base",
    "read_header",
    "read_torch_header",
    "scan",
]
