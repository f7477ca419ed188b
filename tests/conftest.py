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
