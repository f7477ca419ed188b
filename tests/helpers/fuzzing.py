"""`fuzz(short)`: hypothesis settings for the Python differential fuzz passes (test_convert_fuzz.py,
test_index_fuzz.py): `short` inputs, derandomized, in the suite; `LORAFAST_FUZZ_CASES=N` for N inputs and
`LORAFAST_FUZZ_SEED` for a seed of its own, as `make fuzz` runs the core's harnesses."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, seed, settings


def fuzz(short: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    cases = int(os.environ.get("LORAFAST_FUZZ_CASES") or short)
    chosen = os.environ.get("LORAFAST_FUZZ_SEED")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = settings(
            max_examples=cases,
            deadline=None,
            derandomize=chosen is None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(fn)
        return seed(int(chosen))(fn) if chosen is not None else fn

    return wrap
