"""`make demo` (python -m lorafast.demo) and `lorafast sample --with-bases`: the fleet fits its bases where it
should, and the demo shows each seeded error with the engine's exact text, its way out, and a re-check that serves."""

from __future__ import annotations

from pathlib import Path

import lorafast
import pytest
from lorafast import demo
from lorafast.sample_bases import write_with_bases

pytestmark = pytest.mark.slow


def test_sample_with_bases_fits_where_it_should(tmp_path: Path) -> None:
    p = write_with_bases(tmp_path)
    names = ("llama-plain", "llama-r64", "llama-rslora", "llama-mlp", "qwen2-plain")
    fit = {Path(r.adapter).name: r.verdict for r in lorafast.check([p[n] for n in names], p["llama"])}
    assert fit == {"llama-plain": "ok", "llama-r64": "ok", "llama-rslora": "ok", "llama-mlp": "ok",
                   "qwen2-plain": "shape_mismatch"}  # fmt: skip
    moe = {Path(r.adapter).name: r.verdict for r in lorafast.check([p["moe-stacked"], p["moe-shared"]], p["qwen3moe"])}
    assert moe == {"moe-stacked": "ok", "moe-shared": "ok"}
    assert lorafast.inspect(p["moe-shared"]).moe_layout.value == "shared_outer"
    assert lorafast.inspect(p["moe-stacked"]).moe_layout.value == "stacked_3d"
    assert lorafast.read_base(p["flux"]).components.keys() == {"transformer"}


def test_demo_shows_the_errors_their_way_out_and_a_recheck(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.run(str(tmp_path / "fleet")) == 0
    out = capsys.readouterr().out
    for text in (
        "LoRA rank 64 is greater than max_lora_rank 32.",
        "Mixed shared-outer LoRA formats detected across loaded adapters (conflict in adapter '",
        "Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple adapters.",
        "trained 8, served 2",
        "$ lorafast convert",
        "2 adapters, the server starts: 2 serves",
        "every step gave the expected answer",
    ):
        assert text in out, text
    assert "PEFT's merge_and_unload and lorafast's merged weights differ by at most 0.00e+00" in out
