"""Converted folders and files get the modes `cp` gives: 0777 and 0666 less the umask, so a server running as
another user can read them when the umask allows it (a temporary folder's 0700 used to stay on the output)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from lorafast import convert
from test_convert import _kohya, stacked_adapter


@pytest.fixture
def umask() -> Iterator[object]:
    """`umask(mask)` sets the process umask for the test; the old one is put back after it."""
    old = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(old)


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002, 0o027, 0o000], ids=lambda m: f"umask-{m:03o}")
def test_output_modes_follow_the_umask(tmp_path: Path, umask, mask: int) -> None:
    moe = stacked_adapter(tmp_path / "moe", 1, shared_outer=True)
    kohya = _kohya(tmp_path / "k")
    umask(mask)
    outputs = [
        convert(moe, "stacked_3d", tmp_path / "new" / "moe").out,  # and the folder above it, made by the call
        convert(kohya, "peft", tmp_path / "kohya").out,
    ]
    (tmp_path / "old").mkdir(mode=0o700)
    outputs.append(convert(moe, "stacked_3d", tmp_path / "old", overwrite=True).out)  # replaces a 0700 folder
    outputs += [r.out for r in convert([moe], "per_expert_2d", tmp_path / "many")]  # type: ignore[union-attr]
    for out in outputs:
        assert _mode(out) == 0o777 & ~mask, out
        files = sorted(os.listdir(out))
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        for name in files:
            assert _mode(os.path.join(out, name)) == 0o666 & ~mask, (out, name)
    assert _mode(tmp_path / "new") == 0o777 & ~mask
    assert _mode(tmp_path / "many") == 0o777 & ~mask
