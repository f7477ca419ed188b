"""The torch merge engine: adapters into base weights, fast, in bounded memory, with an exact unmerge.

- `merge(model, plan_or_requests, ...) -> MergeHandle`: in place, transactional; `handle.unmerge()` restores
  the original bits.
- `merge_file(base, requests, out, ...)`: base checkpoint + adapters -> merged checkpoint, streamed.

Nothing here imports torch until a merge runs.
"""

from __future__ import annotations

from lorafast.merging.engine import DEFAULT_CHUNK_BYTES, SNAPSHOT_MODES, MergedTarget, MergedTerm, MergeHandle, merge
from lorafast.merging.errors import MERGE_ERROR_CODES, MergeError
from lorafast.merging.sources import Source
from lorafast.merging.stream import merge_file

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MERGE_ERROR_CODES",
    "SNAPSHOT_MODES",
    "MergeError",
    "MergeHandle",
    "MergedTarget",
    "MergedTerm",
    "Source",
    "merge",
    "merge_file",
]
