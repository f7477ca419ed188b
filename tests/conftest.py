"""Fixtures shared by the test files. Adapter files are written with `lorafast.testing`, the one home of the writers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from lorafast.testing import write_peft_adapter


@pytest.fixture
def peft(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., str]:
    """`peft(name, tensors, **config)`: a PEFT folder `tmp_path / name`, written by
    `lorafast.testing.write_peft_adapter` (bare shapes are zero-filled BF16; None config values are left out).
    A test module's `PEFT_CONFIG` dict, when it has one, comes before `config`."""
    defaults = getattr(request.module, "PEFT_CONFIG", {})

    def write(name: str | Path, tensors: Mapping[str, Any], **config: Any) -> str:
        return write_peft_adapter(tmp_path / name, tensors, **{**defaults, **config})

    return write


# Markers by file, so that a change can be tested without the slow families: `make test-fast` deselects them,
# `make test` runs everything. A new file in one of these families joins it by its name.
_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("oracle", ("test_oracle_", "test_sglang_first_use_replay", "test_engine_versions")),
    ("ray", ("test_distributed_ray",)),
    ("remote", ("test_remote_", "test_check_remote", "test_index_remote", "test_base_hostile", "test_netproxy")),
    (
        "fuzz",
        ("test_fuzz_", "test_convert_fuzz", "test_index_fuzz", "test_base_fuzz", "test_compat_sglang_differential"),
    ),
    ("slow", ("test_demo", "test_check", "test_merge_reference", "test_convert_memory", "test_serving")),
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.stem
        for marker, prefixes in _FAMILIES:
            if name.startswith(prefixes):
                item.add_marker(marker)
