"""The torch merge engine: adapters into base weights, fast, in bounded memory, with an exact unmerge.

- `merge(model, plan_or_requests, ...) -> MergeHandle`: in place, transactional; `handle.unmerge()` restores
  the original bits.
- `merge_file(base, requests, out, ...)`: base checkpoint + adapters -> merged checkpoint, streamed.
- `register_cli(subparsers)`: the `lorafast merge` command.

Nothing here imports torch until a merge runs.
"""

from __future__ import annotations

from lorafast.merge.cli import register_cli
from lorafast.merge.engine import DEFAULT_CHUNK_BYTES, SNAPSHOT_MODES, MergedTarget, MergedTerm, MergeHandle, merge
from lorafast.merge.errors import MERGE_ERROR_CODES, MergeError
from lorafast.merge.sources import Source
from lorafast.merge.stream import merge_file

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
    "register_cli",
]


def _make_callable() -> None:
    """Let `lorafast.merge(...)` work even when `lorafast.merge` is this package (it was imported as a module
    before the name was bound to the function): calling the package calls `merge`."""
    import sys
    import types

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return merge(*args, **kwargs)

    sys.modules[__name__].__class__ = _CallableModule


_make_callable()
