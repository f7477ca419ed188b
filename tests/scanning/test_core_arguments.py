"""The typed arguments of the compiled core (rust/py/): `mode`, `timeout` and `concurrency` are checked as the
core extracts them, with errors that name the argument, and the Python-visible defaults stay as written."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lorafast import _core

#: Each core function that takes a mode, called with `mode` as a keyword (and nothing that could be read first).
WITH_MODE: dict[str, Callable[..., Any]] = {
    "read_header": lambda path, **kw: _core.read_header(path, **kw),
    "inspect": lambda path, **kw: _core.inspect(path, **kw),
    "inspect_many": lambda path, **kw: _core.inspect_many([path], **kw),
    "scan": lambda path, **kw: _core.scan([path], **kw),
    "scan_targets": lambda path, **kw: _core.scan_targets([(path, None, None, "not_found", "gone")], **kw),
}


@pytest.mark.parametrize("name", sorted(WITH_MODE))
def test_mode_defaults_to_pread_in_the_signature(name: str) -> None:
    assert inspect.signature(getattr(_core, name)).parameters["mode"].default == "pread"


@pytest.mark.parametrize("name", sorted(WITH_MODE))
def test_an_unknown_mode_is_a_value_error(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be 'pread' or 'mmap', not \"fast\""):
        WITH_MODE[name](str(tmp_path / "x.safetensors"), mode="fast")


@pytest.mark.parametrize("name", sorted(WITH_MODE))
def test_a_mode_that_is_no_str_is_a_type_error(name: str, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="mode must be 'pread' or 'mmap', not int"):
        WITH_MODE[name](str(tmp_path / "x.safetensors"), mode=1)


def test_both_modes_read_the_same_header(tmp_path: Path) -> None:
    from lorafast.sample import write_samples

    write_samples(str(tmp_path), 1)
    path = next(str(p) for p in tmp_path.rglob("*.safetensors"))
    assert _core.read_header(path, "mmap") == _core.read_header(path, "pread") == _core.read_header(path)


def test_zero_concurrency_is_a_value_error(tmp_path: Path) -> None:
    for call in (_core.scan, _core.discover_targets):
        with pytest.raises(ValueError, match="concurrency must be at least 1"):
            call([str(tmp_path)], concurrency=0)


def test_a_timeout_that_is_no_number_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError) as raised:
        _core.scan([str(tmp_path)], timeout="soon")
    assert "timeout" in "".join(getattr(raised.value, "__notes__", [])), raised.value
