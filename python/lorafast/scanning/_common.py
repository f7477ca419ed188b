"""What every scan entry point shares: the column codes, and the checks of the arguments the core takes."""

from __future__ import annotations

import json
import operator
import os
import sys
from collections.abc import Mapping
from typing import Any

from lorafast import _core

PathLike = str | os.PathLike[str]

#: Codes of the `status` column.
STATUS_OK, STATUS_PROBLEMS, STATUS_ERROR = 0, 1, 2
#: Column code -> name, in code order.
FORMATS: tuple[str, ...] = tuple(_core.FORMATS)
MOE_LAYOUTS: tuple[str, ...] = tuple(_core.MOE_LAYOUTS)
FLAGS: tuple[str, ...] = tuple(_core.FLAGS)

#: Scans of at least this many adapters show a progress bar when stderr is a terminal.
PROGRESS_THRESHOLD = 5000


def storage_items(storage_options: Mapping[str, Any] | None) -> list[tuple[str, str]] | None:
    """Store options as the strings object stores take (`True` -> "true"; a mapping, such as `headers`, as JSON)."""
    if storage_options is None:
        return None
    return [(str(k), _option_text(v)) for k, v in storage_options.items()]


def _option_text(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return json.dumps(dict(v)) if isinstance(v, Mapping) else str(v)


def check_threads(threads: Any) -> int | None:
    """`threads` as the core takes it: None or a positive int (not a bool, a float or 0, which the core would
    otherwise read as "all cores" or truncate)."""
    if threads is None:
        return None
    try:
        if isinstance(threads, bool):
            raise TypeError
        n = operator.index(threads)  # int and numpy integers; not float
    except TypeError:
        raise TypeError(f"threads must be a positive int or None, not {type(threads).__name__} {threads!r}") from None
    if n < 1:
        raise ValueError(f"threads must be at least 1, not {n}")
    return n


def want_progress(progress: bool | None, n_hint: int) -> bool:
    if progress is not None:
        return progress
    return n_hint >= PROGRESS_THRESHOLD and sys.stderr.isatty()
