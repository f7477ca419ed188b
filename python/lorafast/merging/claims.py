"""Merges into one model take turns: a merge or unmerge claims the storage of every weight it writes.

Two threads merging into the same weights would each read a block, add their delta and write it back, so one
delta would be lost. Instead a merge waits until none of its weights is claimed by another merge or unmerge, then
claims them all at once (all or nothing, so two merges never deadlock, whatever their order of weights).
Merges into different weights still run side by side. A claim is keyed by the tensor's storage, so views, tied
weights and two state dicts of one model count as the same weights. A thread that would wait for its own claim
(a merge started from inside a merge's progress callback) gets a `MergeError` instead of a deadlock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from lorafast.merging.errors import MergeError

_cond = threading.Condition()
_owner: dict[tuple[str, int], int] = {}  # storage key -> thread id of the claim's holder


def storage_key(tensor: Any) -> tuple[str, int]:
    """What identifies a weight's memory: its device and the address of its storage (the tensor itself for
    tensor types without a plain storage)."""
    try:
        return str(tensor.device), int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return "object", id(tensor)


@contextmanager
def claimed(tensors: Iterable[Any]) -> Iterator[None]:
    """Hold the weights' storage for the duration, waiting for other merges into any of them to finish."""
    keys = {storage_key(t) for t in tensors}
    me = threading.get_ident()
    with _cond:
        while True:
            busy = [k for k in keys if k in _owner]
            if not busy:
                break
            if any(_owner[k] == me for k in busy):
                raise MergeError(
                    "a merge into these weights is already running in this thread (a merge started from a "
                    "merge's progress callback?); nothing was changed",
                    "bad_request",
                )
            _cond.wait()
        for k in keys:
            _owner[k] = me
    try:
        yield
    finally:
        with _cond:
            for k in keys:
                _owner.pop(k, None)
            _cond.notify_all()
