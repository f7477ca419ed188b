"""Fixtures, markers and hypothesis profiles shared by the whole suite.

Layout: one folder per package of `lorafast` (formats/, model/, scanning/, compat/, planner/, groups/, merging/,
converting/, check/, serving/, cli/), and three folders that are families of their own: oracle/ (the engines'
released code, with its runners), remote/ (loopback servers) and fuzz/ (the atheris harnesses). Modules the tests
share live in helpers/ (`from helpers.servers import RangeServer`); tests/ is on sys.path (pyproject's
`pythonpath`), so `helpers` and `oracle` import from any folder. tests/rust/ holds the cargo tests.

Markers (registered in pyproject.toml; `make test-fast` deselects all five, `make test` runs everything):
- `oracle`, `remote`, `fuzz`: every test in the folder of that name;
- `fuzz`, `ray`, `slow` where a file declares it (`pytestmark = pytest.mark.slow`): the differential fuzz passes
  kept beside their package, the Ray cluster, and the tests of tiny real models or the whole demo.

Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (unset: `default`):
- `default`: 200 examples a test, derandomized (the same inputs every run), no deadline;
- `dev`: 20 examples, for a quick loop;
- `ci`: as `default`, with the blob that replays a failure printed;
- `fuzz`: 2,000 examples from a new seed each run, nothing kept in the example database.
A test's own size is the profile's; a test whose examples cost more takes a fraction of it
(`helpers.fuzzing.scaled`), so every size follows the profile.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from lorafast.testing import write_peft_adapter

# Deadlines are off everywhere: most properties write and read files, whose time says nothing about the code.
_COMMON: dict[str, Any] = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", max_examples=200, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=20, derandomize=True, **_COMMON)
settings.register_profile("ci", max_examples=200, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("fuzz", max_examples=2000, derandomize=False, database=None, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def peft(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., str]:
    """`peft(name, tensors, **config)`: a PEFT folder `tmp_path / name`, written by
    `lorafast.testing.write_peft_adapter` (bare shapes are zero-filled BF16; None config values are left out).
    A test module's `PEFT_CONFIG` dict, when it has one, comes before `config`."""
    defaults = getattr(request.module, "PEFT_CONFIG", {})

    def write(name: str | Path, tensors: Mapping[str, Any], **config: Any) -> str:
        return write_peft_adapter(tmp_path / name, tensors, **{**defaults, **config})

    return write


#: The folders whose every test carries the marker of their name; a new file there joins the family.
_FOLDER_FAMILIES = ("oracle", "remote", "fuzz")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        if folder in _FOLDER_FAMILIES:
            item.add_marker(folder)
