"""Layout conversion: rewrite adapters into the layout an engine takes, exactly, so one server loads a fleet.

- `convert(adapter, to, out, *, overwrite=False) -> ConvertResult`; `convert([adapters or folders], to, out_dir)`
  -> one `ConvertResult` or `ConvertError` per adapter, each written to `out_dir/<name>`
- `ConvertError` (`.code` in `CONVERT_ERROR_CODES`, `.cli` as the CLI says it), `LAYOUTS`

No conversion imports torch (`bits`): each moves bits, with numpy and the OS's copies.
"""

from __future__ import annotations

from lorafast.converting.api import LAYOUTS, ConvertResult, convert, detect_layout
from lorafast.converting.errors import CONVERT_ERROR_CODES, ConvertError

__all__ = [
    "CONVERT_ERROR_CODES",
    "LAYOUTS",
    "ConvertError",
    "ConvertResult",
    "convert",
    "detect_layout",
]
