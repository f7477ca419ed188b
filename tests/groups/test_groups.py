"""lorafast.plan_groups: the fewest SGLang servers for a fleet, each passing compat.sglang.preflight.

Adapters are real PEFT folders (MoE shared-outer, stacked per-expert, numbered per-expert, dense) written with
`lorafast.testing.write_safetensors`. Minimality is checked against an exhaustive search whose validity oracle
is SGLang's own start-up check (`compat.sglang.preflight`) plus "one base model".
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import lorafast
import pytest
from lorafast.cli import main
from lorafast.compat.sglang import LoraRef, detect_shared_outer_loras, preflight
from lorafast.groups import (
    NO_SHARED_OUTER_FLAG,
    SHARED_OUTER_FLAG,
    OuterLayout,
    outer_layout,
    plan_groups,
)
from lorafast.groups._plan import _Item, _lower_bound, _partition
from lorafast.testing import TensorSpec, write_peft_adapter

H, I = 16, 8  # noqa: E741 - hidden and MoE intermediate sizes of the toy model
KINDS = ("shared", "stacked", "numbered", "dense")


def write_moe(folder: Path, kind: str, *, base: str | None = "org/moe", r: int = 8, experts: int = 4,
              layers: int = 2, dora: bool = False) -> str:  # fmt: skip
    """A PEFT adapter for a MoE model: attention LoRA plus experts in the layout `kind` ("mixed": layer 0 shared,
    layer 1 stacked)."""
    t: dict[str, TensorSpec] = {}
    expert_targets: list[str] = []
    for layer in range(layers):
        pre = f"base_model.model.model.layers.{layer}"
        for p in ("q_proj", "v_proj"):
            t[f"{pre}.self_attn.{p}.lora_A.weight"] = ("F16", (r, H))
            t[f"{pre}.self_attn.{p}.lora_B.weight"] = ("F16", (H, r))
            if dora:
                t[f"{pre}.self_attn.{p}.lora_magnitude_vector"] = ("F16", (H,))
        k = kind if kind != "mixed" else ("shared" if layer == 0 else "stacked")
        if k in ("shared", "stacked"):
            outer = 1 if k == "shared" else experts
            e = f"{pre}.mlp.experts"
            t[f"{e}.gate_up_proj.lora_A.weight"] = ("F16", (outer, r, H))
            t[f"{e}.gate_up_proj.lora_B.weight"] = ("F16", (experts, 2 * I, r))
            t[f"{e}.down_proj.lora_A.weight"] = ("F16", (experts, r, I))
            t[f"{e}.down_proj.lora_B.weight"] = ("F16", (outer, H, r))
            expert_targets = ["gate_up_proj", "down_proj"]
        elif k == "numbered":
            for x in range(experts):
                for p, fin, fout in (("gate_proj", H, I), ("up_proj", H, I), ("down_proj", I, H)):
                    t[f"{pre}.mlp.experts.{x}.{p}.lora_A.weight"] = ("F16", (r, fin))
                    t[f"{pre}.mlp.experts.{x}.{p}.lora_B.weight"] = ("F16", (fout, r))
            expert_targets = ["gate_proj", "up_proj", "down_proj"]
    targets = sorted(["q_proj", "v_proj", *expert_targets])
    return write_peft_adapter(  # a None value leaves its key out
        folder, t, r=r, lora_alpha=2 * r, target_modules=targets, base_model_name_or_path=base, use_dora=dora or None
    )


def preflight_group_args(group) -> None:  # type: ignore[no-untyped-def]
    """Replay a group's server arguments through compat.sglang.preflight in raise mode (SGLang's own order)."""
    refs = [
        LoraRef(name=n, path=p, adapter=a) for n, p, a in zip(group.names, group.paths, group.adapters, strict=True)
    ]
    targets = None if group.target_modules == ("all",) else list(group.target_modules)
    preflight(
        refs,
        max_lora_rank=group.max_lora_rank,
        target_modules=targets or list(group.served_target_modules),
        experts_shared_outer=group.experts_shared_outer,
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("groups")
    return {
        "s1": write_moe(d / "s1", "shared"),
        "s2": write_moe(d / "s2", "shared", r=16),
        "p1": write_moe(d / "p1", "stacked"),
        "n1": write_moe(d / "n1", "numbered"),
        "d1": write_moe(d / "d1", "dense"),
        "d2": write_moe(d / "d2", "dense", base=None),
        "x1": write_moe(d / "x1", "shared", base="org/other"),
        "m1": write_moe(d / "m1", "mixed"),
        "dora": write_moe(d / "dora", "dense", dora=True),
    }


def test_outer_layout_follows_sglang_detection(fleet: dict[str, str]) -> None:
    expected = {"s1": "shared_outer", "p1": "per_expert", "n1": "per_expert", "d1": "none", "m1": "mixed"}
    for name, layout in expected.items():
        adapter = lorafast.inspect(fleet[name])
        assert outer_layout(adapter).value == layout, name
        # SGLang's own detection on the adapter alone agrees: True only for shared, a raise only for mixed
        if layout == "mixed":
            with pytest.raises(RuntimeError, match="^Mixed shared-outer LoRA formats"):
                detect_shared_outer_loras([adapter])
        else:
            assert detect_shared_outer_loras([adapter]) is (layout == "shared_outer")


def test_mixed_fleet_splits_into_deployable_groups(fleet: dict[str, str]) -> None:
    servable = [fleet[k] for k in ("s1", "s2", "p1", "n1", "d1", "d2", "x1")]
    # one server for all of them fails at start-up, exactly as SGLang does
    with pytest.raises(RuntimeError, match="Mixed shared-outer LoRA formats detected across loaded adapters"):
        preflight(servable)
    result = plan_groups([*servable, fleet["m1"], fleet["dora"]])
    assert len(result) == 3 and result.lower_bound == 3 and result.minimal
    by_names = {g.names: g for g in result}
    shared = by_names[("s1", "s2")]
    assert shared.layout is OuterLayout.SHARED and shared.base_model == "org/moe" and shared.max_lora_rank == 16
    assert shared.server_args() == [
        "--model-path", "org/moe", "--enable-lora", "--max-lora-rank", "16",
        "--lora-target-modules", "down_proj", "gate_up_proj", "qkv_proj", SHARED_OUTER_FLAG,
        "--lora-paths", f"s1={fleet['s1']}", f"s2={fleet['s2']}",
    ]  # fmt: skip
    per_expert = by_names[("p1", "n1", "d1", "d2")]  # dense adapters join; d2's unknown base fits anywhere
    assert per_expert.layout is OuterLayout.PER_EXPERT and NO_SHARED_OUTER_FLAG in per_expert.server_args()
    other = by_names[("x1",)]
    assert other.base_model == "org/other" and other.experts_shared_outer is True
    for g in result:
        assert g.preflight == "passed (start-up only)", g.preflight_problems
        preflight_group_args(g)  # raises on any start-up or first-use failure
    # the adapters no server can take, with SGLang's reasons
    reasons = {u.name: u for u in result.unservable}
    assert set(reasons) == {"m1", "dora"}
    with pytest.raises(RuntimeError) as mixed:
        preflight([LoraRef(name="m1", path=fleet["m1"])])
    assert reasons["m1"].reason == str(mixed.value)
    assert "doesn't support DoRA adapters" in reasons["dora"].reason
    assert not result.ok
    text = result.explain()
    assert "3 groups (minimal), 2 unservable" in text and "python -m sglang.launch_server" in text


def test_max_per_group_chunks_and_stays_minimal(fleet: dict[str, str]) -> None:
    paths = [fleet[k] for k in ("s1", "s2", "p1", "n1", "d1", "d2", "x1")]
    result = plan_groups(paths, max_per_group=2)
    assert all(len(g.adapters) <= 2 for g in result)
    assert sorted(p for g in result for p in g.paths) == sorted(paths)
    assert len(result) == result.lower_bound == 4 and result.minimal
    assert all(g.preflight == "passed (start-up only)" for g in result)
    with pytest.raises(ValueError, match="max_per_group must be at least 1"):
        plan_groups(paths, max_per_group=0)


def test_fixed_limits_report_unservable_adapters(fleet: dict[str, str]) -> None:
    paths = [fleet[k] for k in ("s1", "s2", "d1", "d2")]
    result = plan_groups(paths, max_lora_rank=8, target_modules=["q_proj", "v_proj"])
    assert [g.names for g in result] == [("d1", "d2")]
    (g,) = result
    assert g.server_args()[g.server_args().index("--lora-target-modules") + 1 :][:2] == ["q_proj", "v_proj"]
    assert g.max_lora_rank == 8
    reasons = {u.name: u.reason for u in result.unservable}
    assert reasons["s1"] == (
        "LoRA adapter 's1' contains target modules ['down_proj', 'gate_up_proj'] that are not included in the "
        "specified --lora-target-modules ['qkv_proj']. Please update --lora-target-modules to include all required "
        "modules: ['down_proj', 'gate_up_proj', 'qkv_proj'], or use 'all' to enable all supported modules."
    )
    result = plan_groups(paths, max_lora_rank=8)
    assert {u.name: u.code for u in result.unservable} == {"s2": "rank"}
    assert plan_groups(paths, target_modules="all").target_modules == ("all",)


def test_duplicate_names_get_unique_lora_paths(tmp_path: Path) -> None:
    a = write_moe(tmp_path / "one" / "style", "dense")
    b = write_moe(tmp_path / "two" / "style", "dense")
    (g,) = plan_groups([a, b])
    assert g.names == ("style", "style-2")
    assert g.preflight == "passed (start-up only)"  # SGLang would refuse the same name twice ("already loaded")


def test_scan_report_and_unreadable_paths(fleet: dict[str, str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    report = lorafast.scan([fleet["s1"], fleet["p1"], str(broken)])
    result = plan_groups(report)
    assert len(result) == 2
    assert [u.path for u in result.unservable] == [str(broken)]
    result = plan_groups([fleet["s1"], str(tmp_path / "nowhere")])
    assert [u.code for u in result.unservable] == ["unreadable"]
    # a mapping gives the names
    (g,) = plan_groups({"alpha": fleet["s1"], "beta": fleet["s2"]})
    assert g.names == ("alpha", "beta")


# --------------------------------------------------------------------------------------------------------------
# Minimality


def _exhaustive_minimum(adapters: list, cap: int | None) -> int:  # type: ignore[type-arg]
    """The fewest blocks over every partition, a block being valid when SGLang starts with it and the known
    base models agree (memoized per subset)."""
    n = len(adapters)
    ok: dict[frozenset[int], bool] = {}

    def valid(block: frozenset[int]) -> bool:
        if block not in ok:
            bases = {adapters[i].base_model_name_or_path for i in block} - {None}
            refs = [LoraRef(name=f"a{i}", path=adapters[i].path, adapter=adapters[i]) for i in sorted(block)]
            ok[block] = len(bases) <= 1 and (cap is None or len(block) <= cap) and preflight(refs, collect=True).ok
        return ok[block]

    best = n

    def search(rest: list[int], blocks: int) -> None:  # fmt: skip
        nonlocal best
        if blocks >= best:
            return
        if not rest:
            best = blocks
            return
        first, others = rest[0], rest[1:]
        for k in range(len(others), -1, -1):  # biggest blocks first finds good answers early
            for combo in itertools.combinations(others, k):
                block = frozenset((first, *combo))
                if valid(block):
                    search([i for i in others if i not in combo], blocks + 1)

    search(list(range(n)), 0)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_generated_fleets_are_minimal_and_valid(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(4, 7)
    bases = ["org/a", "org/b", None]
    adapters = []
    for i in range(n):
        kind = rng.choice(KINDS)
        base = rng.choice(bases)
        path = write_moe(tmp_path / f"a{i}", kind, base=base, r=rng.choice((4, 8, 16)), layers=1)
        adapters.append(lorafast.inspect(path))
    cap = (None, None, 2, 3, None, 2)[seed]
    result = plan_groups(adapters, max_per_group=cap)
    assert not result.unservable
    grouped = sorted(str(a.path) for g in result for a in g.adapters)
    assert grouped == sorted(str(a.path) for a in adapters)  # a partition
    for g in result:
        assert g.preflight == "passed (start-up only)", g.preflight_problems
        assert cap is None or len(g.adapters) <= cap
        preflight_group_args(g)
    optimum = _exhaustive_minimum(adapters, cap)
    assert result.lower_bound <= optimum <= len(result)
    half_layout = any(outer_layout(a) is not OuterLayout.NONE and a.base_model_name_or_path is None for a in adapters)
    half_base = any(outer_layout(a) is OuterLayout.NONE and a.base_model_name_or_path for a in adapters)
    if cap is None or not (half_layout and half_base):  # the cases with a proof: the bound is met
        assert result.minimal and len(result) == optimum


def test_partition_matches_brute_force_on_keys() -> None:
    """The grouping core on abstract keys: valid always; optimal and tight where proven; the bound is sound."""

    def partitions(seq: list[_Item]):  # type: ignore[no-untyped-def]
        if not seq:
            yield []
            return
        for p in partitions(seq[1:]):
            for i in range(len(p)):
                yield [*p[:i], [seq[0], *p[i]], *p[i + 1 :]]
            yield [[seq[0]], *p]

    def valid(block: list[_Item], cap: int | None) -> bool:
        layouts = {it.layout for it in block} - {None}
        bases = {it.base for it in block} - {None}
        return len(layouts) <= 1 and len(bases) <= 1 and (cap is None or len(block) <= cap)

    rng = random.Random(1)
    layouts = [None, OuterLayout.SHARED, OuterLayout.PER_EXPERT]
    for _ in range(300):
        items = [_Item(i, rng.choice(layouts), rng.choice([None, "a", "b", "c"])) for i in range(rng.randint(1, 6))]
        cap = rng.choice([None, 1, 2, 3])
        bins = _partition(items, cap)
        assert sorted(i for b in bins for i in b.members) == list(range(len(items)))
        assert all(valid([items[i] for i in b.members], cap) for b in bins)
        optimum = min(len(p) for p in partitions(items) if all(valid(b, cap) for b in p))
        bound = _lower_bound(items, cap)
        assert bound <= optimum <= len(bins)
        if len(bins) == bound:
            assert len(bins) == optimum
        half_layout = any(it.layout is not None and it.base is None for it in items)
        half_base = any(it.layout is None and it.base is not None for it in items)
        if cap is None or not (half_layout and half_base):
            assert len(bins) == optimum == bound


def test_cli_groups(fleet: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["groups", fleet["s1"], fleet["p1"], fleet["d1"], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [len(g["adapters"]) for g in data["groups"]] == [1, 2] and data["minimal"] is True
    assert data["groups"][0]["server_args"][-2:] == ["--lora-paths", f"s1={fleet['s1']}"]
    assert main(["groups", fleet["s1"], fleet["m1"], "--max-lora-rank", "8"]) == 1  # something is unservable
    assert "unservable: m1" in capsys.readouterr().out


def test_groups_with_a_base_config_run_the_first_use_checks(fleet: dict[str, str], tmp_path: Path) -> None:
    """Without the base's config a group passes only the start-up checks, and says so; with it, SGLang's first-use
    checks run too, and a base the adapters do not fit fails them."""
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
            "intermediate_size": 4 * H, "moe_intermediate_size": I, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": H // 2, "num_hidden_layers": 2, "num_experts": 4,
            "vocab_size": 64, "torch_dtype": "float16"}  # fmt: skip
    (plain,) = plan_groups([fleet["p1"]]).groups
    assert plain.preflight == "passed (start-up only)"
    (fits,) = plan_groups([fleet["p1"]], base_config=qwen).groups
    assert fits.preflight == "passed", fits.preflight_problems
    wide = plan_groups([fleet["p1"]], base_config={**qwen, "hidden_size": 2 * H, "head_dim": H})
    assert not wide.ok and wide.unservable[0].code == "preflight" and "buffer shape" in wide.unservable[0].reason
    config = tmp_path / "config.json"
    config.write_text(json.dumps(qwen))
    assert main(["groups", fleet["p1"], "--base-config", str(config), "--json"]) == 0
