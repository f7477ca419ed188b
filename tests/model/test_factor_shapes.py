"""A LoRA factor whose number of dimensions is not the one its module kind reads (a 0-d or 1-d
lora_A on a plain module, a 0-d lora_A on a target-parameters `experts` module, a 0-d lora_B on a stacked 3-D one)
is an `invalid_factor_shape` problem, in `scan` rows as in `inspect`. Such files used to give rows with no problem."""

from __future__ import annotations

from pathlib import Path

import lorafast
import pytest
from lorafast.testing import write_safetensors

Q = "base_model.model.model.layers.0.self_attn.q_proj"
EXPERTS = "base_model.model.model.layers.0.mlp.experts"

#: name -> (tensors, (factor, kind) of the problem, or None for a clean adapter)
CASES = {
    "0d_a_linear": ({f"{Q}.lora_A.weight": ("F32", ()), f"{Q}.lora_B.weight": ("F32", (16, 4))}, ("lora_A", "linear")),
    "1d_a_linear": (
        {f"{Q}.lora_A.weight": ("F32", (4,)), f"{Q}.lora_B.weight": ("F32", (16, 4))},
        ("lora_A", "linear"),
    ),
    "1d_b_linear": (
        {f"{Q}.lora_A.weight": ("F32", (4, 16)), f"{Q}.lora_B.weight": ("F32", (16,))},
        ("lora_B", "linear"),
    ),
    "0d_a_experts": (
        {f"{EXPERTS}.lora_A.weight": ("F32", ()), f"{EXPERTS}.lora_B.weight": ("F32", (64, 4))},
        ("lora_A", "target_parameters"),
    ),
    "0d_b_stacked": (
        {f"{EXPERTS}.gate_up_proj.lora_A.weight": ("F32", (8, 4, 16)), f"{EXPERTS}.gate_up_proj.lora_B.weight": ("F32", ())},
        ("lora_B", "stacked_3d"),
    ),
    "2d_b_stacked": (
        {
            f"{EXPERTS}.gate_up_proj.lora_A.weight": ("F32", (8, 4, 16)),
            f"{EXPERTS}.gate_up_proj.lora_B.weight": ("F32", (32, 4)),
        },
        ("lora_B", "stacked_3d"),
    ),
    "clean_linear": ({f"{Q}.lora_A.weight": ("F32", (4, 16)), f"{Q}.lora_B.weight": ("F32", (16, 4))}, None),
    "clean_stacked": (
        {
            f"{EXPERTS}.gate_up_proj.lora_A.weight": ("F32", (8, 4, 16)),
            f"{EXPERTS}.gate_up_proj.lora_B.weight": ("F32", (8, 32, 4)),
        },
        None,
    ),
    "clean_experts": (
        {f"{EXPERTS}.lora_A.weight": ("F32", (32, 16)), f"{EXPERTS}.lora_B.weight": ("F32", (64, 32))},
        None,
    ),
    "clean_conv": (
        {"lora_unet_conv_in.lora_down.weight": ("F32", (4, 3, 3, 3)), "lora_unet_conv_in.lora_up.weight": ("F32", (8, 4, 1, 1))},
        None,
    ),
}  # fmt: skip


def test_scan_flags_factors_of_the_wrong_dimensions(tmp_path: Path) -> None:
    for name, (tensors, _) in CASES.items():
        write_safetensors(tmp_path / f"{name}.safetensors", tensors)
    report = lorafast.scan([tmp_path], threads=1)
    assert not report.errors
    rows = {Path(a.path).stem: a for a in report}
    assert set(rows) == set(CASES)
    counts = dict(zip((Path(report.paths[i]).stem for i in report.columns()["path_index"]),
                      report.columns()["num_problems"], strict=True))  # fmt: skip
    for name, (_, want) in CASES.items():
        codes = [p.code for p in rows[name].problems]
        if want is None:
            assert codes == [] and counts[name] == 0, (name, rows[name].problems)
            continue
        factor, kind = want
        assert codes == ["invalid_factor_shape"] and counts[name] == 1, (name, rows[name].problems)
        (module,) = rows[name].modules
        assert module.kind == kind, name
        message = rows[name].problems[0].message
        assert factor in message and module.key in message and kind in message, message
        # inspect gives the same problem.
        assert lorafast.inspect(tmp_path / f"{name}.safetensors").problems == rows[name].problems


@pytest.mark.parametrize("shape", [(), (4,), (4, 16, 1)])
def test_a_degenerate_factor_is_no_clean_adapter(tmp_path: Path, shape: tuple[int, ...]) -> None:
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {f"{Q}.lora_A.weight": ("BF16", shape), f"{Q}.lora_B.weight": ("BF16", (16, 4))})
    adapter = lorafast.inspect(path)
    assert not adapter.ok
    assert "invalid_factor_shape" in {p.code for p in adapter.problems}
