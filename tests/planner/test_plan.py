"""lorafast.plan: SGLang's set_lora decisions (modes, errors, skip rule), effective scales, non-additive adapters.

Adapters are real files written with `lorafast.testing.write_safetensors` and read with `lorafast.inspect`.
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import lorafast
import numpy as np
import pytest
from lorafast.cli import main
from lorafast.compat.diffusion import resolve_lora_merge_mode
from lorafast.planner import (
    DYNAMIC_MULTI_ADAPTER_ERROR,
    Action,
    LoraRequest,
    PipelineState,
    PlanError,
    module_scale,
    normalize_lora_params,
    plan,
    plan_set_lora,
)
from lorafast.testing import TensorSpec, write_peft_adapter, write_safetensors

H = 16  # hidden size of the toy models


def write_peft(folder: Path, modules: dict[str, int], *, r: int = 8, alpha: float = 16, dora: bool = False,
               **config: object) -> str:  # fmt: skip
    """A PEFT adapter folder: `modules` maps a module path (without base_model.model.) to its rank."""
    tensors: dict[str, TensorSpec] = {}
    for name, rank in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = ("F16", (rank, H))
        tensors[f"base_model.model.{name}.lora_B.weight"] = ("F16", (H, rank))
        if dora:
            tensors[f"base_model.model.{name}.lora_magnitude_vector"] = ("F16", (H,))
    targets = sorted({n.rsplit(".", 1)[-1] for n in modules})
    cfg = {"r": r, "lora_alpha": alpha, "target_modules": targets, **config, **({"use_dora": True} if dora else {})}
    return write_peft_adapter(folder, tensors, **cfg)


def write_kohya(path: Path, alphas: dict[str, float | None], rank: int = 8) -> str:
    """A kohya file; a module's alpha of None writes no `.alpha` tensor."""
    tensors: dict[str, object] = {}
    for name, alpha in alphas.items():
        tensors[f"lora_unet_{name}.lora_down.weight"] = ("F16", (rank, H))
        tensors[f"lora_unet_{name}.lora_up.weight"] = ("F16", (H, rank))
        if alpha is not None:
            tensors[f"lora_unet_{name}.alpha"] = np.array(alpha, dtype=np.float32)
    write_safetensors(path, tensors)
    return str(path)


def write_loha(path: Path, rank: int = 4) -> str:
    name = "lora_unet_blocks_0_attn_to_q"
    write_safetensors(
        path,
        {
            f"{name}.hada_w1_a": ("F16", (H, rank)),
            f"{name}.hada_w1_b": ("F16", (rank, H)),
            f"{name}.hada_w2_a": ("F16", (H, rank)),
            f"{name}.hada_w2_b": ("F16", (rank, H)),
            f"{name}.alpha": np.array(float(rank), dtype=np.float32),
        },
    )
    return str(path)


ATTN = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("plan")
    return {
        "a": write_peft(d / "a", dict.fromkeys(ATTN, 8), r=8, alpha=16),
        "a2": write_peft(d / "a2", dict.fromkeys(ATTN, 8), r=8, alpha=8),
        "b": write_peft(d / "b", dict.fromkeys(ATTN, 4), r=4, alpha=4),
        "c": write_peft(d / "c", dict.fromkeys(ATTN, 16), r=16, alpha=8, use_rslora=True),
        "pattern": write_peft(
            d / "pattern",
            {n: (4 if n.endswith("q_proj") else 8) for n in ATTN},
            r=8,
            alpha=16,
            rank_pattern={"q_proj": 4},
            alpha_pattern={"v_proj": 32},
        ),
        "dora": write_peft(d / "dora", dict.fromkeys(ATTN[:2], 8), r=8, alpha=8, dora=True),
        "kohya": write_kohya(d / "kohya.safetensors", {"blocks_0_attn_to_q": 4.0, "blocks_0_attn_to_k": 4.5}),
        "kohya_noalpha": write_kohya(d / "kohya_noalpha.safetensors", {"blocks_0_attn_to_q": None}),
        "loha": write_loha(d / "loha.safetensors"),
    }


def reqs(fleet: dict[str, str], *names: str, strength: float = 1.0, target: str = "all") -> list[LoraRequest]:
    return [LoraRequest(n, fleet[n], strength, target) for n in names]


# --------------------------------------------------------------------------------------------------------------
# Modes: every mode x adapters per target x sharded x resolve


@pytest.mark.parametrize(
    ("mode", "n", "sharded", "resolve"),
    list(itertools.product(["auto", "merge", "dynamic"], [1, 2, 3], [False, True], [False, True])),
)
def test_mode_matrix(fleet: dict[str, str], mode: str, n: int, sharded: bool, resolve: bool) -> None:
    requests = reqs(fleet, *["a", "b", "c"][:n])
    would_merge = mode == "merge" or (mode == "auto" and not sharded)
    if not would_merge and n > 1 and not resolve:
        with pytest.raises(ValueError) as info:
            plan(requests, merge_mode=mode, weights_sharded=sharded)
        assert type(info.value) is ValueError
        assert str(info.value) == DYNAMIC_MULTI_ADAPTER_ERROR
        assert any("resolve=True" in note for note in info.value.__notes__)
        return
    p = plan(requests, merge_mode=mode, weights_sharded=sharded, resolve=resolve)
    (t,) = p.targets
    resolved = not would_merge and n > 1
    assert t.mode == ("merge" if would_merge or resolved else "dynamic")
    assert t.resolved is resolved
    assert t.action is Action.APPLY
    assert t.nicknames == tuple(["a", "b", "c"][:n])
    merge_warning = "Merging LoRA for transformer with FSDP-sharded weights may require full-gather and can OOM."
    assert (merge_warning in p.warnings) is (mode == "merge" and sharded)
    auto_reason = "Using dynamic LoRA for transformer because FSDP-sharded weights would require a full-gather merge."
    assert (auto_reason in t.reasons) is (mode == "auto" and sharded)
    if resolved:
        assert any(r.startswith("resolved:") and DYNAMIC_MULTI_ADAPTER_ERROR in r for r in t.reasons)
    assert p.next_state.merged == {"transformer": t.mode == "merge"}
    assert p.next_state.applied["transformer"] == (t.nicknames, (1.0,) * n)


def test_merge_mode_resolution_matches_sglang() -> None:
    assert resolve_lora_merge_mode(None, None, "auto") == "auto"
    assert resolve_lora_merge_mode(True, None, "auto") == "merge"
    assert resolve_lora_merge_mode(False, None, "merge") == "dynamic"
    assert resolve_lora_merge_mode(False, "merge", "auto") == "merge"  # an explicit mode wins
    assert resolve_lora_merge_mode(None, None, "dynamic") == "dynamic"
    with pytest.raises(ValueError) as info:
        resolve_lora_merge_mode(None, "fast", "auto")
    assert str(info.value) == "Invalid LoRA merge mode: fast. Valid modes: ('auto', 'merge', 'dynamic')"


def test_merge_weights_and_server_mode_drive_plan(fleet: dict[str, str]) -> None:
    assert plan(reqs(fleet, "a"), merge_weights=False)["all"].mode == "dynamic"
    assert plan(reqs(fleet, "a"), merge_weights=True, weights_sharded=True)["all"].mode == "merge"
    server_dynamic = PipelineState(server_merge_mode="dynamic")
    assert plan(reqs(fleet, "a"), current=server_dynamic)["all"].mode == "dynamic"
    with pytest.raises(ValueError, match=r"^Dynamic LoRA currently supports only one adapter per target\."):
        plan(reqs(fleet, "a", "b"), current=server_dynamic)
    # the mode is resolved before the lists are normalized, as in set_lora
    with pytest.raises(ValueError, match="^Invalid LoRA merge mode: x"):
        plan({"lora_nickname": ["a", "b"], "lora_path": ["p"]}, merge_mode="x")


# --------------------------------------------------------------------------------------------------------------
# Argument normalization: identical texts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"lora_nickname": ["a", "b"], "lora_path": "p"},
            "Length mismatch: lora_nickname has 2 items, but lora_path has 1 items. Provide one path per nickname.",
        ),
        (
            {"lora_nickname": ["a", "b"], "lora_path": ("p", "q")},  # a tuple is one path to SGLang
            "Length mismatch: lora_nickname has 2 items, but lora_path has 1 items. Provide one path per nickname.",
        ),
        (
            {"lora_nickname": ["a", "b"], "lora_path": ["p", "q"], "strength": [1.0]},
            "Length mismatch: lora_nickname has 2 items, but strength has 1 items",
        ),
        (
            {"lora_nickname": ["a", "b"], "lora_path": ["p", "q"], "target": ["all"]},
            "Length mismatch: lora_nickname has 2 items, but target has 1 items",
        ),
        (
            {"lora_nickname": ["a", "b"], "lora_path": ["p", "q"], "lora_alpha": [8, 8, 8]},
            "Length mismatch: lora_nickname has 2 items, but lora_alpha has 3 items",
        ),
        (
            {"lora_nickname": "a", "lora_path": "p", "lora_alpha": 0},
            "lora_alpha values must be positive integers or null",
        ),
        (
            {"lora_nickname": ["a", "b"], "lora_path": ["p", "q"], "lora_alpha": [4, -1]},
            "lora_alpha values must be positive integers or null",
        ),
        (
            {"lora_nickname": ["a", "b"], "lora_path": ["p", "q"], "target": ["all", "unet"]},
            "Invalid target(s): ['unet']. Valid targets: ['all', 'transformer', 'transformer_2', 'critic']",
        ),
    ],
)
def test_normalization_errors_are_sglangs(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        plan(kwargs)
    assert str(info.value) == message
    with pytest.raises(ValueError) as direct:
        normalize_lora_params(
            kwargs["lora_nickname"],  # type: ignore[arg-type]
            kwargs.get("lora_path"),  # type: ignore[arg-type]
            kwargs.get("strength", 1.0),  # type: ignore[arg-type]
            kwargs.get("target", "all"),  # type: ignore[arg-type]
            kwargs.get("lora_alpha"),  # type: ignore[arg-type]
        )
    assert str(direct.value) == message


def test_broadcasting_like_set_lora(fleet: dict[str, str]) -> None:
    nicks, paths, strengths, targets, alphas = normalize_lora_params(["a", "b"], ["p", None], 0.5, "transformer", 8)
    assert (nicks, paths, strengths, targets, alphas) == (
        ["a", "b"], ["p", None], [0.5, 0.5], ["transformer", "transformer"], [8, 8],
    )  # fmt: skip
    assert normalize_lora_params("a", None, 2, "all", None)[2] == [2.0]  # int strength becomes float
    p = plan_set_lora(["a", "b"], [fleet["a"], fleet["b"]], strength=[0.5, 0.25], merge_mode="merge")
    assert p["all"].strengths == (0.5, 0.25)
    assert [r.path for r in p.requests] == [fleet["a"], fleet["b"]]


def test_unknown_adapter_without_path(fleet: dict[str, str]) -> None:
    with pytest.raises(ValueError) as info:
        plan([LoraRequest("ghost")])
    assert str(info.value) == "Adapter ghost not found in the pipeline. Please provide lora_path to load it."
    # known from the state: reused without a path, and its loaded path is planned
    state = plan(reqs(fleet, "a")).next_state
    p = plan([LoraRequest("a")], current=state)
    assert p["all"].adapters[0].path == fleet["a"]
    assert p.loads == ()
    # loaded earlier in the same call: the second mention needs no path
    p = plan([LoraRequest("a", fleet["a"], target="transformer"), LoraRequest("a", None, 0.5, "all")])
    assert [t.target for t in p] == ["transformer", "all"]


# --------------------------------------------------------------------------------------------------------------
# The skip rule


def test_identical_call_is_skipped(fleet: dict[str, str]) -> None:
    first = plan(reqs(fleet, "a", "b"))
    assert first.actions == {"all": "apply"}
    second = first.then([LoraRequest("a"), LoraRequest("b")])
    assert second.actions == {"all": "skip"}
    assert "LoRA configuration matches exactly, skipping" in second["all"].reasons
    assert second.next_state == first.next_state
    # giving the same paths again is not a reload
    assert first.then(reqs(fleet, "a", "b")).actions == {"all": "skip"}


def test_order_change_is_not_skipped(fleet: dict[str, str]) -> None:
    p = plan(reqs(fleet, "a", "b")).then([LoraRequest("b"), LoraRequest("a")])
    t = p["all"]
    assert t.action is Action.UNMERGE_APPLY
    assert any("different order" in r for r in t.reasons)
    assert p.next_state.applied["transformer"][0] == ("b", "a")


def test_strength_change_remerges_and_tolerance_loosens(fleet: dict[str, str]) -> None:
    base = plan([LoraRequest("a", fleet["a"], 0.1 + 0.2)])
    again = base.then([LoraRequest("a", None, 0.3)])
    assert again.actions == {"all": "remerge"}  # 0.30000000000000004 != 0.3, exactly as SGLang compares
    loose = base.then([LoraRequest("a", None, 0.3)], tolerance=1e-9)
    assert loose.actions == {"all": "skip"}
    assert any("within tolerance" in r for r in loose["all"].reasons)
    assert loose.next_state.applied["transformer"][1] == (0.1 + 0.2,)  # nothing applied, nothing recorded
    bigger = base.then([LoraRequest("a", None, 0.5)], tolerance=1e-9)
    assert bigger.actions == {"all": "remerge"}
    assert bigger["all"].adapters[0].scales == {n: 0.5 * 16 / 8 for n in ATTN}


def test_reload_and_alpha_change_defeat_the_skip_everywhere(fleet: dict[str, str]) -> None:
    both = PipelineState(modules=("transformer", "transformer_2"))
    first = plan(
        [LoraRequest("a", fleet["a"], target="transformer"), LoraRequest("b", fleet["b"], target="transformer_2")],
        current=both,
    )
    same = first.then([LoraRequest("a", target="transformer"), LoraRequest("b", target="transformer_2")])
    assert same.actions == {"transformer": "skip", "transformer_2": "skip"}
    # a new path for b re-applies both targets: SGLang's adapter_updated is global to the call
    reloaded = first.then(
        [LoraRequest("a", target="transformer"), LoraRequest("b", fleet["a2"], target="transformer_2")]
    )
    assert reloaded.actions == {"transformer": "unmerge_apply", "transformer_2": "unmerge_apply"}
    assert [(e.nickname, e.kind, e.previous_path) for e in reloaded.loads] == [("b", "reload", fleet["b"])]
    assert any("adapter_updated" in r for r in reloaded["transformer"].reasons)
    # an alpha equal to what the adapter was loaded with (its config alpha, 16) changes nothing
    same_alpha = first.then(
        [LoraRequest("a", target="transformer", alpha=16), LoraRequest("b", target="transformer_2")]
    )
    assert same_alpha.actions == {"transformer": "skip", "transformer_2": "skip"}
    new_alpha = first.then([LoraRequest("a", target="transformer", alpha=8), LoraRequest("b", target="transformer_2")])
    assert new_alpha.actions == {"transformer": "unmerge_apply", "transformer_2": "unmerge_apply"}
    assert [(e.kind, e.previous_alpha, e.alpha) for e in new_alpha.loads] == [("alpha", 16, 8)]
    assert new_alpha.next_state.loaded_alphas["a"] == 8
    assert set(new_alpha["transformer"].adapters[0].scales.values()) == {8 / 8}


def test_merge_state_change_is_not_skipped(fleet: dict[str, str]) -> None:
    merged = plan(reqs(fleet, "a"), merge_mode="merge")
    to_dynamic = merged.then([LoraRequest("a")], merge_mode="dynamic")
    assert to_dynamic.actions == {"all": "unmerge_apply"}
    assert any("merge state changes" in r for r in to_dynamic["all"].reasons)
    assert to_dynamic.next_state.merged == {"transformer": False}
    # dynamic -> the same dynamic set: SGLang skips (merged False == requested False)
    assert to_dynamic.then([LoraRequest("a")], merge_mode="dynamic").actions == {"all": "skip"}
    back = to_dynamic.then([LoraRequest("a")], merge_mode="merge")
    assert back.actions == {"all": "apply"}


def test_skip_checks_first_module_only_and_reapplies_all(fleet: dict[str, str]) -> None:
    both = PipelineState(
        modules=("transformer", "transformer_2"),
        loaded_paths={"a": fleet["a"], "b": fleet["b"]},
        loaded_alphas={"a": 16, "b": 4},
        applied={"transformer": (("a",), (1.0,)), "transformer_2": (("b",), (1.0,))},
        merged={"transformer": True, "transformer_2": True},
    )
    p = plan([LoraRequest("a")], current=both)  # target "all": transformer matches, so the whole target skips
    assert p.actions == {"all": "skip"}
    assert p["all"].module_actions == {"transformer": Action.SKIP, "transformer_2": Action.SKIP}
    assert p.next_state.applied["transformer_2"] == (("b",), (1.0,))
    p = plan([LoraRequest("b")], current=both)  # transformer differs: both modules are re-applied
    assert p["all"].module_actions == {"transformer": Action.UNMERGE_APPLY, "transformer_2": Action.UNMERGE_APPLY}
    assert p.next_state.applied == {"transformer": (("b",), (1.0,)), "transformer_2": (("b",), (1.0,))}


def test_missing_and_overlapping_targets(fleet: dict[str, str]) -> None:
    p = plan(reqs(fleet, "a", target="transformer_2"))
    assert p["transformer_2"].action is Action.SKIP and p["transformer_2"].modules == ()
    assert p.warnings[0] == "transformer_2 does not exist in this pipeline"
    assert p.next_state.applied == {}
    p = plan(reqs(fleet, "a", target="critic"))
    assert "critic (fake_score_transformer) does not exist in this pipeline" in p.warnings
    # "all" then "transformer": the second group clears what the first applied to transformer
    both = PipelineState(modules=("transformer", "transformer_2"))
    p = plan(
        [LoraRequest("a", fleet["a"], 0.5, "all"), LoraRequest("b", fleet["b"], 0.25, "transformer")], current=both
    )
    assert [t.target for t in p] == ["all", "transformer"]
    assert p["all"].modules == ("transformer", "transformer_2")
    assert any("clear_existing" in w and "[a@0.5] is replaced by [b@0.25]" in w for w in p["transformer"].warnings)
    assert p.next_state.applied == {"transformer": (("b",), (0.25,)), "transformer_2": (("a",), (0.5,))}


def test_per_module_sharding(fleet: dict[str, str]) -> None:
    both = PipelineState(modules=("transformer", "transformer_2"))
    sharded = {"transformer_2": True}
    p = plan(reqs(fleet, "a"), current=both, weights_sharded=sharded)
    assert p["all"].module_modes == {"transformer": "merge", "transformer_2": "dynamic"}
    assert p.next_state.merged == {"transformer": True, "transformer_2": False}
    # two adapters: SGLang does not raise (transformer merges) but transformer_2 keeps only the last one
    p = plan(reqs(fleet, "a", "b"), current=both, weights_sharded=sharded)
    assert any("only the last one" in w for w in p["all"].warnings)
    p = plan(reqs(fleet, "a", "b"), current=both, weights_sharded=sharded, resolve=True)
    assert p["all"].module_modes == {"transformer": "merge", "transformer_2": "merge"} and p["all"].resolved


# --------------------------------------------------------------------------------------------------------------
# Effective scales


def test_scales_follow_alpha_rank_rslora_and_patterns(fleet: dict[str, str]) -> None:
    p = plan(
        [
            LoraRequest("a", fleet["a"], 0.5),
            LoraRequest("c", fleet["c"], 1.0),
            LoraRequest("pattern", fleet["pattern"], 2.0),
        ]
    )
    a, c, pat = p["all"].adapters
    assert a.scales == {n: 0.5 * 16 / 8 for n in ATTN}
    assert c.scales == {n: 8 / math.sqrt(16) for n in ATTN}  # rsLoRA
    expected = {n: 2.0 * (16 / 4 if n.endswith("q_proj") else 32 / 8) for n in ATTN}
    assert pat.scales == expected
    assert any("rank_pattern and alpha_pattern" in note for note in pat.notes)


def test_request_alpha_overrides_adapter_alpha_but_not_module_alphas(fleet: dict[str, str]) -> None:
    p = plan([LoraRequest("pattern", fleet["pattern"], 1.0, alpha=8), LoraRequest("kohya", fleet["kohya"], alpha=64)])
    pat, kohya = p["all"].adapters
    # alpha_pattern modules keep their alpha (SGLang turns them into per-layer .alpha tensors); the rest take 8
    assert pat.scales == {n: (8 / 4 if n.endswith("q_proj") else 32 / 8) for n in ATTN}
    assert pat.alpha_sources == {"adapter": 2, "alpha_pattern": 2}
    # kohya per-module alpha tensors always win
    assert kohya.scales == {"lora_unet_blocks_0_attn_to_q": 4 / 8, "lora_unet_blocks_0_attn_to_k": 4.5 / 8}
    assert any("int(alpha.item())" in n and "4.5 would become 4" in n for n in kohya.notes)
    plain = plan([LoraRequest("kohya_noalpha", fleet["kohya_noalpha"], 0.7)])["all"].adapters[0]
    assert plain.scales == {"lora_unet_blocks_0_attn_to_q": 0.7}  # no alpha anywhere: scale 1 × strength
    assert plain.alpha_sources == {"rank": 1}


def test_module_scale_precedence() -> None:
    from lorafast.adapter import LoraModule

    def mod(**kw: object) -> LoraModule:
        base = {
            "name": "m", "key": "m", "kind": "linear", "leaf": "m", "layer": 0, "expert": None, "num_experts": None,
            "rank": 8, "in_features": H, "out_features": H, "dtype": "F16", "a_key": "m.lora_A.weight",
            "b_key": "m.lora_B.weight", "a_shape": (8, H), "b_shape": (H, 8), "alpha": None, "alpha_key": None,
            "bias_key": None, "magnitude_key": None, "extra_keys": (), "config_rank": 8, "use_rslora": False,
            "weight_file": "x",
        }  # fmt: skip
        base.update(kw)
        return LoraModule(**base)  # type: ignore[arg-type]

    assert module_scale(mod(alpha=4.0, alpha_key="m.alpha"), 1.0, 32) == (0.5, "tensor")
    assert module_scale(mod(alpha=16.0), 1.0, 32) == (4.0, "adapter")
    assert module_scale(mod(alpha=16.0), 1.0, None) == (2.0, "config")
    assert module_scale(mod(alpha=16.0), 1.0, 32, {"m": 16}) == (2.0, "alpha_pattern")
    assert module_scale(mod(), 0.5, None) == (0.5, "rank")
    assert module_scale(mod(alpha=16.0, use_rslora=True, rank=16), 1.0, None) == (4.0, "config")


# --------------------------------------------------------------------------------------------------------------
# Non-additive adapters


def test_non_additive_adapters_are_separate_steps(fleet: dict[str, str]) -> None:
    p = plan(reqs(fleet, "a", "dora", "b", "loha"), merge_mode="merge")
    t = p["all"]
    assert [(s.kind, s.nicknames) for s in t.steps] == [
        ("sum", ("a",)),
        ("sequential", ("dora",)),
        ("sum", ("b",)),
        ("sequential", ("loha",)),
    ]
    dora = t.adapters[1]
    assert dora.additive is False and dora.variants == ("dora",)
    assert any("DoRA adapters are not supported by the native diffusion LoRA layers" in n for n in dora.notes)
    assert t.adapters[3].variants == ("loha",) and "Hadamard" in t.steps[3].reason
    assert any("depends on the order" in w for w in t.warnings)
    # plain adapters only: one summed step
    assert [(s.kind, s.nicknames) for s in plan(reqs(fleet, "a", "b"))["all"].steps] == [("sum", ("a", "b"))]


@pytest.mark.parametrize(("mode", "sharded"), [("dynamic", False), ("auto", True)])
def test_non_additive_on_dynamic_target_is_rejected_or_resolved(
    fleet: dict[str, str], mode: str, sharded: bool
) -> None:
    with pytest.raises(PlanError) as info:
        plan(reqs(fleet, "dora"), merge_mode=mode, weights_sharded=sharded)
    assert isinstance(info.value, ValueError) and isinstance(info.value, lorafast.LorafastError)
    (rejection,) = info.value.rejections
    assert "dora (dora) cannot be applied as dynamic LoRA on transformer" in rejection
    assert "merge_mode='merge'" in rejection
    p = plan(reqs(fleet, "dora"), merge_mode=mode, weights_sharded=sharded, resolve=True)
    assert p["all"].mode == "merge" and p["all"].resolved
    assert [s.kind for s in p["all"].steps] == ["sequential"]
    # a single plain adapter stays dynamic
    assert plan(reqs(fleet, "a"), merge_mode=mode, weights_sharded=sharded)["all"].mode == "dynamic"


# --------------------------------------------------------------------------------------------------------------
# State, output, CLI


def test_state_from_sglang_pipeline_and_round_trip(fleet: dict[str, str]) -> None:
    pipeline = SimpleNamespace(
        loaded_adapter_paths={"a": fleet["a"]},
        loaded_adapter_alphas={"a": None},
        cur_adapter_config={"transformer": (["a"], [0.5])},
        is_lora_merged={"transformer": True},
        lora_layers_transformer_2={"blocks.0": object()},
        lora_layers_critic={},
        server_args=SimpleNamespace(lora_merge_mode="merge"),
    )
    state = PipelineState.from_pipeline(pipeline)
    assert state.modules == ("transformer", "transformer_2")
    assert state.applied == {"transformer": (("a",), (0.5,))}
    assert state.server_merge_mode == "merge"
    assert PipelineState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    p = plan([LoraRequest("a", None, 0.5, "transformer")], current=state)
    assert p.actions == {"transformer": "skip"}
    with pytest.raises(ValueError, match="modules must include 'transformer'"):
        PipelineState(modules=("unet",))


def test_to_dict_is_json_and_explain_reads_well(fleet: dict[str, str]) -> None:
    p = plan(reqs(fleet, "a", "pattern", "dora"), merge_mode="merge")
    data = json.loads(p.to_json())
    assert [(s["kind"], s["nicknames"]) for s in data["targets"][0]["steps"]] == [
        ("sum", ["a", "pattern"]),
        ("sequential", ["dora"]),
    ]
    assert data["targets"][0]["adapters"][1]["scales"]["model.layers.0.self_attn.v_proj"] == 4.0
    assert data["next_state"]["applied"]["transformer"] == {
        "nicknames": ["a", "pattern", "dora"],
        "strengths": [1.0] * 3,
    }
    text = p.explain()
    needles = ["merge_mode=merge", "target 'all' -> transformer", "action: apply", "1. a  strength 1"]
    needles += ["scale 2 on 4 modules", "dora [dora]", "sequential: dora", "next state: transformer: merged"]
    for needle in needles:
        assert needle in text, needle


def test_unreadable_adapter_is_reported_not_raised(tmp_path: Path) -> None:
    p = plan([LoraRequest("x", str(tmp_path / "missing"))])
    adapter = p["all"].adapters[0]
    assert adapter.scales is None and adapter.additive is None
    assert any("could not inspect" in w for w in p.warnings)


def test_cli_plan(fleet: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = ["--modules", "transformer", "transformer_2"]
    assert (
        main(
            [
                "plan",
                "--adapter",
                f"a={fleet['a']}:0.5@transformer",
                "-a",
                f"b={fleet['b']}@transformer_2",
                *both,
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert [(t["target"], t["adapters"][0]["strength"]) for t in data["targets"]] == [
        ("transformer", 0.5),
        ("transformer_2", 1.0),
    ]
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(data))  # a previous plan's JSON is a valid --state
    assert main(["plan", "-a", "a:0.5@transformer", "-a", "b@transformer_2", "--state", str(state_file)]) == 0
    out = capsys.readouterr().out
    assert out.count("action: skip") == 2, out
    assert main(["plan", "-a", f"a={fleet['a']}", "-a", f"b={fleet['b']}", "--merge-mode", "dynamic"]) == 1
    err = capsys.readouterr().err
    assert DYNAMIC_MULTI_ADAPTER_ERROR in err and "--resolve plans it as a merge" in err
    assert main(["plan", "-a", f"a={fleet['a']}", "-a", f"b={fleet['b']}", "--merge-mode", "dynamic", "--resolve"]) == 0
    assert "(resolved)" in capsys.readouterr().out


def test_cli_adapter_spec_parsing() -> None:
    from lorafast.planner import parse_adapter_spec

    assert parse_adapter_spec("n=/x/y:0.25@critic") == LoraRequest("n", "/x/y", 0.25, "critic")
    assert parse_adapter_spec("n=C:/x@y/z") == LoraRequest("n", "C:/x@y/z", 1.0, "all")  # ':' / '@' in paths
    assert parse_adapter_spec("n") == LoraRequest("n", None, 1.0, "all")
    assert parse_adapter_spec("n:2") == LoraRequest("n", None, 2.0, "all")
    with pytest.raises(ValueError):
        parse_adapter_spec("=p")


def test_lorafast_plan_is_the_function_even_after_importing_its_module(fleet: dict[str, str]) -> None:
    import lorafast.planner as module

    p = lorafast.plan(reqs(fleet, "a"))
    assert isinstance(p, module.Plan) and p.actions == {"all": "apply"}
    assert lorafast.PlanError is module.PlanError


def test_plan_error_pickles_with_its_rejections() -> None:
    err = PlanError(["target 'all': a (dora) cannot be applied", "target 'critic': b (oft) cannot be applied"])
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is PlanError and back.rejections == err.rejections and str(back) == str(err)


def test_supplied_adapters_are_used_and_a_reload_reads_the_new_file(fleet: dict[str, str]) -> None:
    supplied = {"a": lorafast.inspect(fleet["a"])}
    first = plan([LoraRequest("a", fleet["a"])], adapters=supplied)
    assert set(first["all"].adapters[0].scales.values()) == {16 / 8}
    reloaded = first.then([LoraRequest("a", fleet["a2"])])  # same nickname, new file with alpha 8
    assert reloaded.loads[0].kind == "reload"
    assert set(reloaded["all"].adapters[0].scales.values()) == {8 / 8}


def test_cli_sharded_modules(fleet: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    two = ["--modules", "transformer", "transformer_2"]
    assert main(["plan", "-a", f"a={fleet['a']}", *two, "--sharded", "transformer_2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["targets"][0]["module_modes"] == {"transformer": "merge", "transformer_2": "dynamic"}
    assert data["weights_sharded"] == {"transformer_2": True}
    assert main(["plan", "-a", f"a={fleet['a']}", *two, "--sharded", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["targets"][0]["mode"] == "dynamic"
