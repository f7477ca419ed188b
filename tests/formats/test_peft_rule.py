"""One PEFT pattern rule: `formats.peft.peft_pattern_key` (the Python copy planning, conversion and merging use)
picks the key PEFT's own `get_pattern_key` picks, and the Rust core's classification resolves each module's rank
and alpha from the same key, on generated names and patterns."""

from __future__ import annotations

from pathlib import Path

import lorafast
from hypothesis import given
from hypothesis import strategies as st
from lorafast.formats.peft import peft_pattern_key, peft_pattern_value
from lorafast.testing import write_peft_adapter
from peft.utils.other import get_pattern_key

LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj")
LAYERS = 3


def _name(layer: int, leaf: str) -> str:
    return f"model.layers.{layer}.self_attn.{leaf}"


#: pattern keys of the kinds people write: a leaf, a full path, an alternation, a layer range, a wildcard
KEYS = st.one_of(
    st.sampled_from(LEAVES),
    st.builds(_name, st.integers(0, LAYERS - 1), st.sampled_from(LEAVES)),
    st.builds(lambda a, b: f"{a}|{b}", st.sampled_from(LEAVES), st.sampled_from(LEAVES)),
    st.builds(
        lambda hi, leaf: rf"layers\.[0-{hi}]\.self_attn\.{leaf}", st.integers(0, LAYERS - 1), st.sampled_from(LEAVES)
    ),
    st.builds(lambda leaf: f".*{leaf[:1]}_proj", st.sampled_from(LEAVES)),
    st.sampled_from(("self_attn", "layers", "proj")),  # match no whole module name
)
PATTERNS = st.dictionaries(KEYS, st.integers(1, 8), max_size=4)


@given(PATTERNS, st.integers(0, LAYERS - 1), st.sampled_from(LEAVES))
def test_the_python_rule_is_peft_s(patterns: dict[str, int], layer: int, leaf: str) -> None:
    name = _name(layer, leaf)
    ours = peft_pattern_key(patterns, name)
    theirs = get_pattern_key(patterns.keys(), name)  # PEFT: the name itself when no key matches
    assert ours == (theirs if theirs in patterns else None)
    assert peft_pattern_value(patterns, name) == (patterns[ours] if ours is not None else None)


@given(PATTERNS, PATTERNS)
def test_the_core_resolves_the_same_key(tmp_path_factory, ranks: dict[str, int], alphas: dict[str, int]) -> None:
    folder: Path = tmp_path_factory.mktemp("adapter")
    r, alpha = 4, 16
    tensors = {}
    for layer in range(LAYERS):
        for leaf in LEAVES:
            name = _name(layer, leaf)
            rank = ranks[k] if (k := peft_pattern_key(ranks, name)) is not None else r
            tensors[f"base_model.model.{name}.lora_A.weight"] = ("F32", (rank, 8))
            tensors[f"base_model.model.{name}.lora_B.weight"] = ("F32", (8, rank))
    write_peft_adapter(folder, tensors, r=r, lora_alpha=alpha, target_modules=list(LEAVES), rank_pattern=ranks,
                       alpha_pattern=alphas)  # fmt: skip
    adapter = lorafast.inspect(folder)
    assert len(adapter.modules) == LAYERS * len(LEAVES)
    for m in adapter.modules:
        want_rank = peft_pattern_value(ranks, m.name)
        want_alpha = peft_pattern_value(alphas, m.name)
        assert m.config_rank == (want_rank if want_rank is not None else r), (m.name, ranks)
        assert m.alpha == (want_alpha if want_alpha is not None else alpha), (m.name, alphas)
    assert not [p for p in adapter.problems if p.code == "config_rank_mismatch"]
