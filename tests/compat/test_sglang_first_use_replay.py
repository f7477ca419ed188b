"""preflight replays SGLang's first use once per normalized structure: adapters that share one must still get
their own problems (their own ids in the texts, their own exception objects), as when checked one at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lorafast.compat import sglang as sg

P = "base_model.model.model.layers."
BASE = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 2, "num_experts": 4,
    "vocab_size": 100, "torch_dtype": "bfloat16",
}  # fmt: skip


def _attn() -> dict[str, tuple[int, ...]]:
    base = f"{P}0.self_attn."
    return {base + "q_proj.lora_A.weight": (4, 16), base + "q_proj.lora_B.weight": (16, 4),
            base + "v_proj.lora_A.weight": (4, 16), base + "v_proj.lora_B.weight": (8, 4)}  # fmt: skip


def _numbered() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for x in range(2):
        base = f"{P}0.mlp.experts.{x}."
        out |= {base + "gate_proj.lora_A.weight": (4, 16), base + "gate_proj.lora_B.weight": (8, 4),
                base + "up_proj.lora_A.weight": (4, 16), base + "up_proj.lora_B.weight": (8, 4),
                base + "down_proj.lora_A.weight": (4, 8), base + "down_proj.lora_B.weight": (16, 4)}  # fmt: skip
    return out


CASES: dict[str, tuple[dict[str, tuple[int, ...]], list[str], dict[str, Any]]] = {
    "skipped": ({**_attn(), f"{P}0.mlp.c_fc.lora_A.weight": (4, 16)}, ["q_proj", "v_proj"], {}),
    "skipped-strict": ({**_attn(), f"{P}0.mlp.c_fc.lora_A.weight": (4, 16)}, ["q_proj", "v_proj"],
                       {"strict_loading": True}),
    "fit": ({**_attn(), f"{P}0.self_attn.v_proj.lora_B.weight": (12, 4)}, ["q_proj", "v_proj"], {}),
    "shared-outer": (_numbered(), ["gate_proj", "up_proj", "down_proj"], {"experts_shared_outer": True}),
}  # fmt: skip


def _first_use(plan: Any, adapter_id: str) -> list[tuple[str, str, bool, str | None]]:
    return [(p.code, p.message, p.fatal, p.exc_type) for p in plan.problems
            if p.stage == "first_use" and p.adapter_id == adapter_id]  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_structure_gets_own_first_use_problems(peft: Callable[..., str], case: str) -> None:
    tensors, targets, kwargs = CASES[case]
    names = ["a", "b", "c"]
    paths = {n: peft(n, tensors, target_modules=targets) for n in names}
    together = sg.preflight(paths, base_config=BASE, collect=True, **kwargs)
    found = []
    for name in names:
        alone = sg.preflight({name: paths[name]}, base_config=BASE, collect=True, **kwargs)
        mine = _first_use(together, name)
        assert mine == _first_use(alone, name)
        assert mine
        if case != "shared-outer":  # SGLang's shared-outer texts name no adapter
            assert any(f"'{name}'" in message for _, message, _, _ in mine)
        found += [p for p in together.problems if p.stage == "first_use" and p.adapter_id == name]
    errors = [p.error for p in found if p.fatal]
    assert len({id(e) for e in errors}) == len(errors)  # each problem raises its own exception


def test_header_parsed_once_per_distinct_header(tmp_path: Path, peft: Callable[..., str]) -> None:
    """Identical headers share one parse; a rewritten file, or a broken one, is read again."""
    from lorafast.compat import AdapterView

    a = peft("a", _attn(), target_modules=["q_proj", "v_proj"])
    b = peft("b", _attn(), target_modules=["q_proj", "v_proj"])
    va, vb = AdapterView.from_path(a), AdapterView.from_path(b)
    assert va.tensors == vb.tensors and va.tensors is not vb.tensors
    peft("b2/b", {k: (s[0], 2 * s[1]) for k, s in _attn().items()}, target_modules=["q_proj", "v_proj"])
    (Path(b) / "adapter_model.safetensors").write_bytes(
        (tmp_path / "b2" / "b" / "adapter_model.safetensors").read_bytes()
    )
    assert AdapterView.from_path(b).tensors == {k: (s[0], 2 * s[1]) for k, s in _attn().items()}
    weights = Path(a) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-2])  # same header, data cut short: the core's error again
    assert AdapterView.from_path(a).load_error is not None
    assert AdapterView.from_path(b).load_error is None
