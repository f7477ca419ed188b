"""Test sizes that follow the hypothesis profile (tests/conftest.py), and the settings of the differential fuzz
passes.

- `scaled(n)`: `n` examples under the `default` profile, scaled with the loaded one (`dev` a tenth, `fuzz` ten
  times), for a test whose examples cost more than the profile's size allows;
- `fuzz(short)`: the settings of a differential fuzz pass (test_convert_fuzz.py, test_index_fuzz.py,
  test_base_fuzz.py): `scaled(short)` inputs, derandomized, in the suite; `LORAFAST_FUZZ_CASES=N` for N inputs and
  `LORAFAST_FUZZ_SEED` for a seed of its own, as `make fuzz` runs the core's harnesses."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, seed, settings

#: The `default` profile's max_examples (tests/conftest.py), the size `scaled` is relative to.
DEFAULT_EXAMPLES = 200


def scaled(n: int) -> int:
    return max(1, n * settings.default.max_examples // DEFAULT_EXAMPLES)


def fuzz(short: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    cases = int(os.environ.get("LORAFAST_FUZZ_CASES") or scaled(short))
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
