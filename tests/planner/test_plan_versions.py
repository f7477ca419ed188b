"""`lorafast.plan` per SGLang version: 0.5.23's quantized-layer rule, auto-merge rounding-loss rule and merge
cache, how a plan reports the rounding rule when it lacks weight values, and the rules' one home in compat.

The engine itself is the oracle in tests/oracle/test_oracle_plan.py; these pin the planner's own reporting.
"""

from __future__ import annotations

from pathlib import Path

import lorafast
import pytest
import torch
from lorafast import planner
from lorafast.compat import diffusion as df
from lorafast.planner import PipelineState, plan
from lorafast.testing import write_peft_adapter
from safetensors.torch import save_file


def adapter(tmp_path: Path, name: str, scale: float) -> str:
    gen = torch.Generator().manual_seed(7)
    tensors = {"l0.lora_A.weight": torch.randn(4, 16, generator=gen) * scale, "l0.lora_B.weight": torch.randn(8, 4)}
    folder = write_peft_adapter(tmp_path / name, tensors, r=4, lora_alpha=4, target_modules=None)
    return str(Path(folder) / "adapter_model.safetensors")


def base(tmp_path: Path, dtype: torch.dtype) -> str:
    path = tmp_path / f"base-{dtype}.safetensors"
    save_file({"l0.weight": torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).to(dtype)}, str(path))
    return str(path)


def test_rules_and_texts_have_one_home() -> None:
    assert planner.VALID_TARGETS is df.VALID_TARGETS
    assert planner.LORA_MERGE_MODES is df.LORA_MERGE_MODES
    assert planner.DYNAMIC_MULTI_ADAPTER_ERROR == df.MSG_DYNAMIC_ONE_ADAPTER
    assert planner.CONFIG_MATCHES_MESSAGE == df.MSG_CONFIG_MATCHES


def test_auto_rounding_rule_without_values_is_undecided(tmp_path: Path) -> None:
    path = adapter(tmp_path, "a", 1e-5)
    p = plan({"lora_nickname": "a", "lora_path": path}, engine_version="0.5.23")
    t = p["all"]
    assert t.undecided == ("transformer",) and p.undecided == [("all", "transformer")]
    assert t.mode == "merge" and p.next_state.merged == {"transformer": True}  # SGLang's choice unless it loses >50%
    assert any("needs the base weights' values" in w and "undecided" in w for w in t.warnings)
    assert "undecided: transformer" in p.explain()
    assert p.to_dict()["undecided"] == [["all", "transformer"]]
    # "merge", "dynamic" and several adapters never measure: nothing undecided
    assert not plan({"lora_nickname": "a", "lora_path": path}, merge_mode="merge", engine_version="0.5.23").undecided
    assert not plan({"lora_nickname": "a", "lora_path": path}, merge_mode="dynamic", engine_version="0.5.23").undecided


def test_rounding_loss_from_values_and_given(tmp_path: Path) -> None:
    req = {"lora_nickname": "a", "lora_path": adapter(tmp_path, "a", 1e-5)}
    bf16 = {"transformer": base(tmp_path, torch.bfloat16)}
    p = plan(req, base_weights=bf16, engine_version="0.5.23")
    loss = p["all"].rounding_loss["transformer"]
    assert loss is not None and loss > 0.5
    assert p["all"].mode == "dynamic" and p.next_state.merged == {"transformer": False}
    assert any(r.startswith(f"LoRA {req['lora_path']} stays unmerged on transformer") for r in p["all"].reasons)
    # the next identical call: SGLang compares its merge decision before the rounding rule, so it never skips
    again = p.then(req)
    assert again["all"].action.value == "apply" and again.next_state.merged == {"transformer": False}
    # float32 weights: nothing rounds, so the loss is None and it merges
    fp32 = plan(req, base_weights={"transformer": base(tmp_path, torch.float32)}, engine_version="0.5.23")
    assert fp32["all"].rounding_loss == {"transformer": None} and fp32["all"].mode == "merge"
    # a measured loss given directly
    given = plan(req, rounding_loss={"transformer": 0.2}, engine_version="0.5.23")
    assert given["all"].mode == "merge" and given["all"].rounding_loss == {"transformer": 0.2}
    assert plan(req, rounding_loss={"transformer": 0.75}, engine_version="0.5.23")["all"].mode == "dynamic"


def test_quantized_rule(tmp_path: Path) -> None:
    req = {"lora_nickname": "a", "lora_path": adapter(tmp_path, "a", 1.0)}
    auto = plan(req, quantized=True, engine_version="0.5.23")
    assert auto["all"].mode == "dynamic" and not auto.undecided
    assert df.MSG_AUTO_QUANTIZED.format(module="transformer") in auto["all"].reasons
    with pytest.raises(ValueError) as err:
        plan(req, quantized={"transformer": True}, merge_mode="merge", engine_version="0.5.23")
    assert str(err.value) == df.MSG_QUANTIZED_MERGE.format(module="transformer")
    # resolve=True cannot turn several adapters on a quantized target into a merge: SGLang's error stays
    two = {"lora_nickname": ["a", "b"], "lora_path": [req["lora_path"], adapter(tmp_path, "b", 1.0)]}
    with pytest.raises(ValueError, match="only one adapter per target"):
        plan(two, quantized=True, resolve=True, engine_version="0.5.23")


def test_versions_before_0_5_23_lack_the_new_rules(tmp_path: Path) -> None:
    req = {"lora_nickname": "a", "lora_path": adapter(tmp_path, "a", 1e-5)}
    with pytest.warns(lorafast.UnverifiedEngineVersion, match="rules before 0.5.23 that lorafast keeps"):
        old = plan(req, quantized=True, base_weights={"transformer": base(tmp_path, torch.bfloat16)},
                   engine_version="0.5.22")  # fmt: skip
    assert old.engine_version == "0.5.22" and old["all"].mode == "merge" and old.version_status == "older than 0.5.23"
    assert old["all"].rounding_loss == {} and not old.undecided
    assert plan(req, engine_version="0.5.23").engine_version == "0.5.23"
    with pytest.raises(ValueError, match="not an engine version"):
        plan(req, engine_version="latest")


def test_cache_merged_is_noted(tmp_path: Path) -> None:
    req = {"lora_nickname": "a", "lora_path": adapter(tmp_path, "a", 1.0)}
    p = plan(req, merge_mode="merge", cache_merged=True, engine_version="0.5.23")
    assert any(r.startswith("cache_merged:") for r in p["all"].reasons) and p["all"].mode == "merge"


def test_state_round_trip_keeps_version_options(tmp_path: Path) -> None:
    req = {"lora_nickname": "a", "lora_path": adapter(tmp_path, "a", 1e-5)}
    p = plan(req, base_weights={"transformer": base(tmp_path, torch.bfloat16)}, engine_version="0.5.23",
             current=PipelineState(server_merge_mode="auto"))  # fmt: skip
    nxt = p.then({**req, "strength": 2.0})
    assert nxt.engine_version == "0.5.23" and "transformer" in nxt["all"].rounding_loss
