"""Header-only scanning: `inspect` one adapter, `scan` many in parallel, their `ScanReport`, and its exports.

`scanning.index` (the persistent `Index`) and `scanning.distributed` (the Ray backend) load on first use.
"""

from lorafast.scanning._common import FLAGS, FORMATS, MOE_LAYOUTS, STATUS_ERROR, STATUS_OK, STATUS_PROBLEMS, PathLike
from lorafast.scanning._entry import inspect, inspect_many, scan
from lorafast.scanning.results import ScanReport, adapter_from_raw

__all__ = [
    "FLAGS",
    "FORMATS",
    "MOE_LAYOUTS",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_PROBLEMS",
    "PathLike",
    "ScanReport",
    "adapter_from_raw",
    "inspect",
    "inspect_many",
    "scan",
]
