"""rank_pattern / alpha_pattern keys are matched as PEFT matches them (`get_pattern_key`): against the module's name
without `base_model.model.`, a diffusers component prefix kept. SDXL's two text encoders share every module path
after that prefix, so a pattern that tells them apart must see it (a folder `lorafast convert` writes from kohya)."""

from __future__ import annotations

from pathlib import Path

import lorafast
from lorafast.testing import write_peft_adapter
from peft.utils.other import get_pattern_key

Q = "text_model.encoder.layers.0.self_attn.q_proj"


def test_patterns_see_the_component_prefix(tmp_path: Path) -> None:
    tensors = {}
    for component, r in (("text_encoder", 4), ("text_encoder_2", 8)):
        tensors[f"base_model.model.{component}.{Q}.lora_A.weight"] = ("F32", (r, 16))
        tensors[f"base_model.model.{component}.{Q}.lora_B.weight"] = ("F32", (16, r))
    ranks, alphas = {f"text_encoder_2.{Q}": 8}, {f"text_encoder.{Q}": 4, f"text_encoder_2.{Q}": 1}
    write_peft_adapter(tmp_path, tensors, r=4, lora_alpha=8, target_modules=["q_proj"], rank_pattern=ranks,
                       alpha_pattern=alphas)  # fmt: skip
    a = lorafast.inspect(tmp_path)
    assert a.problems == ()  # no config_rank_mismatch: each encoder gets its own rank
    for m in a.modules:
        peft_name = m.key.removeprefix("base_model.model.")
        key = get_pattern_key(ranks.keys(), peft_name)  # PEFT's own rule: the key itself when none matches
        want_r = ranks.get(key, 4)
        want_alpha = alphas[get_pattern_key(alphas.keys(), peft_name)]
        assert (m.config_rank, m.alpha) == (want_r, want_alpha), m.key
        assert m.rank == want_r
    # a plain leaf key still matches every module, as in PEFT
    write_peft_adapter(tmp_path / "plain", tensors, r=4, lora_alpha=8, target_modules=["q_proj"],
                       alpha_pattern={"q_proj": 2})  # fmt: skip
    assert {m.alpha for m in lorafast.inspect(tmp_path / "plain").modules} == {2.0}
