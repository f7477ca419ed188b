"""GPT-OSS's interleaved gate/up: transformers keeps GPT-OSS's fused `gate_up_proj` with gate and up rows
alternating, so a PEFT `target_parameters` adapter made on it has lora_B's rows in that order, while SGLang's
layouts hold gate rows then up rows (SGLang interleaves them itself). Converting reorders B's rows; the merged
weights are bit-identical up to the same reordering of the base's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from lorafast import ConvertError, convert  # noqa: E402
from test_convert import (  # noqa: E402
    IM,
    LAYERS,
    assert_bit_identical,
    fused_base,
    merged,
    numbered_base,
    stacked_adapter,
    target_parameters_adapter,
)

GPT_OSS = "openai/gpt-oss-20b"


def interleaved_base(concatenated: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`fused_base` as transformers' GPT-OSS orders gate_up's output rows: gate 0, up 0, gate 1, up 1, ..."""
    return {k: _interleave(v) if k.endswith("gate_up_proj") else v for k, v in concatenated.items()}


def _interleave(w: torch.Tensor) -> torch.Tensor:  # (E, 2I, H): rows gate then up -> alternating
    return torch.stack([w[:, :IM], w[:, IM:]], dim=2).reshape(w.shape).clone()


def _deinterleave(w: torch.Tensor) -> torch.Tensor:
    return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)


def as_concatenated(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: _deinterleave(v) if k.endswith("gate_up_proj") else v for k, v in sd.items()}


def gpt_oss_adapter(folder: Path, seed: int) -> str:
    path = target_parameters_adapter(folder, seed)
    cfg_path = Path(path, "adapter_config.json")
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "base_model_name_or_path": GPT_OSS}))
    return path


def test_interleaving_helpers_are_inverse() -> None:
    w = fused_base()[f"model.layers.{LAYERS - 1}.mlp.experts.gate_up_proj"]
    assert torch.equal(_deinterleave(_interleave(w)), w) and not torch.equal(_interleave(w), w)


def test_gpt_oss_target_parameters_to_sglang_layouts_is_exact(tmp_path: Path) -> None:
    src = gpt_oss_adapter(tmp_path / "gpt-oss", 21)
    want = as_concatenated(merged(interleaved_base(fused_base()), src))  # the source, on GPT-OSS's row order
    st = convert(src, "stacked_3d", tmp_path / "st")  # interleaved: from the config's base model
    assert any("interleaved" in n for n in st.notes)
    assert_bit_identical(want, merged(fused_base(), st.out))
    so = convert(src, "per_expert_2d", tmp_path / "numbered")  # gate and up split from the reordered rows
    got = merged(numbered_base(), so.out)
    for layer in range(LAYERS):
        gu = want[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        assert torch.equal(got[f"model.layers.{layer}.mlp.experts.1.gate_proj.weight"], gu[1, :IM])
        assert torch.equal(got[f"model.layers.{layer}.mlp.experts.1.up_proj.weight"], gu[1, IM:])
    # without the reordering the result differs: the test tells the two orders apart
    plain = convert(src, "stacked_3d", tmp_path / "plain", gate_up="concatenated")
    assert plain.notes == ()
    diff = merged(fused_base(), plain.out)
    assert not torch.equal(
        diff["model.layers.0.mlp.experts.gate_up_proj"], want["model.layers.0.mlp.experts.gate_up_proj"]
    )


def test_stacked_to_gpt_oss_target_parameters_is_exact(tmp_path: Path) -> None:
    src = stacked_adapter(tmp_path / "st", 22, shared_outer=False)
    tp = convert(src, "peft_target_parameters", tmp_path / "tp", gate_up="interleaved")
    assert_bit_identical(merged(fused_base(), src), as_concatenated(merged(interleaved_base(fused_base()), tp.out)))
    # and back: the round trip gives the source's tensors
    cfg_path = Path(tp.out, "adapter_config.json")
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "base_model_name_or_path": GPT_OSS}))
    back = convert(tp.out, "stacked_3d", tmp_path / "back")
    assert_bit_identical(merged(fused_base(), src), merged(fused_base(), back.out))


def test_gate_up_order_is_checked(tmp_path: Path) -> None:
    src = gpt_oss_adapter(tmp_path / "gpt-oss", 23)
    with pytest.raises(ConvertError) as err:
        convert(src, "stacked_3d", tmp_path / "x", gate_up="alternating")
    assert err.value.code == "unsupported" and not (tmp_path / "x").exists()
