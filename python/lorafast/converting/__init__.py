"""Layout conversion: rewrite adapters into the layout an engine takes, exactly, so one server loads a fleet.

- `convert(adapter, to, out, *, overwrite=False) -> ConvertResult`
- `ConvertError` (`.code` in `CONVERT_ERROR_CODES`), `LAYOUTS`
- `register_cli(subparsers)`: the `lorafast convert` command.
"""

from __future__ import annotations

from lorafast.converting.api import LAYOUTS, ConvertResult, convert, detect_layout
from lorafast.converting.cli import register_cli
from lorafast.converting.errors import CONVERT_ERROR_CODES, ConvertError

__all__ = [
    "CONVERT_ERROR_CODES",
    "LAYOUTS",
    "ConvertError",
    "ConvertResult",
    "convert",
    "detect_layout",
    "register_cli",
]
