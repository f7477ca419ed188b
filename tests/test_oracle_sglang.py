"""lorafast.compat.sglang against SGLang's own released code (the oracle), outcome by outcome.

tests/oracle/sglang_runner.py runs the wheel's LoRAManager start-up, memory pool, first use and dynamic loads on
CPU for every case of tests/oracle/cases_sglang.py; here `compat.sglang.preflight` answers the same cases from
headers. Compared: the start-up exception (type and exact message) or the whole decision (target modules, max
rank, shared-outer mode, added tokens, buffer shapes), every first-use failure (preflight must report it as
fatal, stage `first_use`), and every dynamic load (`SGLangPlan.check_new_adapter`) with its first use.
A missing wheel fails (MissingWheel), never skips.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from lorafast.compat import sglang as sg
from lorafast.compat._common import LoraRef

from oracle import cases_sglang, engines

VERSION = "0.5.23"
STARTUP_STAGES = ("startup", "load")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    engines.wheel("sglang", VERSION)  # raises MissingWheel (a failure) when `make engines` has not run
    data = cases_sglang.build(Path(tmp_path_factory.mktemp("sglang-oracle")))
    results = engines.run("sglang_runner", "sglang", VERSION, {"cases": data["cases"]})["results"]
    return data, results


def _base_config(base: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.for_model(**base).to_dict()  # what a user passes: the base model's config.json


def _err(problem: Any) -> list[str]:
    return [problem.exc_type, problem.message]


def _buffers(plan: sg.SGLangPlan) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for b in plan.buffers or ():
        if not b.layers or 0 in b.layers:
            out[b.name] = [list(b.a_shape), list(b.b_shape)]
    return out


def lorafast_outcome(case: dict[str, Any]) -> dict[str, Any]:
    """The engine runner's result structure, answered by compat.sglang from headers."""
    refs = [LoraRef(name=a["name"], path=a["path"], pinned=a.get("pinned", False)) for a in case["adapters"]]
    cfg = _base_config(case["base"])
    tm = case.get("target_modules")
    plan = sg.preflight(
        refs, max_lora_rank=case.get("max_lora_rank"), target_modules=tm,
        max_loras_per_batch=case.get("max_loras_per_batch", 8), experts_shared_outer=case.get("experts_shared_outer"),
        strict_loading=case.get("strict_loading", False), base_config=cfg, collect=True, engine_version=VERSION,
    )  # fmt: skip
    startup = [p for p in plan.errors if p.stage in STARTUP_STAGES]
    if startup:
        return {"startup": {"error": _err(startup[0])}}
    out: dict[str, Any] = {"startup": {
        "target_modules": sorted(plan.target_modules), "max_lora_rank": plan.max_lora_rank,
        "shared_outer": plan.experts_shared_outer, "added_tokens": plan.lora_added_tokens_size,
        "buffers": _buffers(plan), "ids": [r.lora_id for r in refs],
    }}  # fmt: skip
    first = []
    for ref in refs:
        fatal = [p for p in plan.errors if p.stage == "first_use" and p.adapter_id == ref.lora_id]
        first.append(_err(fatal[0]) if fatal else None)
    out["first_use"] = first
    dynamic = []
    for a in case.get("dynamic", ()):
        ref = LoraRef(name=a["name"], path=a["path"], pinned=a.get("pinned", False))
        problems = [p for p in plan.check_new_adapter(ref, collect=True) if p.fatal]
        load = [p for p in problems if p.stage == "load"]
        if load:
            dynamic.append({"success": False, "error_message": load[0].message})
            continue
        use = [p for p in problems if p.stage == "first_use"]
        dynamic.append({"success": True, "error_message": "", "first_use": _err(use[0]) if use else None})
        plan = dataclasses.replace(plan, adapters=(*plan.adapters, ref))
    out["dynamic"] = dynamic
    return out


def _outcomes(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """One comparable outcome per start-up, per first use and per dynamic load."""
    out: list[tuple[str, Any]] = [("startup", result["startup"])]
    out += [(f"first_use[{i}]", f) for i, f in enumerate(result.get("first_use", ()))]
    out += [(f"dynamic[{i}]", d) for i, d in enumerate(result.get("dynamic", ()))]
    return out


def test_data_set_size(oracle: tuple[dict[str, Any], dict[str, Any]]) -> None:
    data, results = oracle
    sets = [c for c in data["cases"] if len(c["adapters"]) + len(c.get("dynamic", ())) > 1]
    assert len(data["adapters"]) >= 500, len(data["adapters"])
    assert len(sets) >= 200, len(sets)
    broken = [r for r in results.values() if "runner_error" in r]
    assert not broken, broken[:2]


def test_preflight_agrees_with_sglang_0_5_23(oracle: tuple[dict[str, Any], dict[str, Any]]) -> None:
    data, results = oracle
    total = agreed = 0
    disagreements: list[str] = []
    missed_rejections: list[str] = []
    for case in data["cases"]:
        theirs = results[case["id"]]
        ours = lorafast_outcome(case)
        pairs_theirs, pairs_ours = _outcomes(theirs), dict(_outcomes(ours))
        for key, value in pairs_theirs:
            if key == "startup" and "ids" in value:
                value = {k: v for k, v in value.items()}
            total += 1
            mine = pairs_ours.get(key)
            if mine == value:
                agreed += 1
                continue
            disagreements.append(f"{case['id']} {key}: sglang={value!r} lorafast={mine!r}")
            engine_rejects = (key == "startup" and "error" in value) or (key.startswith("first") and value) or (
                key.startswith("dynamic") and (not value["success"] or value.get("first_use")))  # fmt: skip
            ours_passes = mine is None or (key == "startup" and "error" not in mine) or (
                isinstance(mine, dict) and mine.get("success") and not mine.get("first_use"))  # fmt: skip
            if engine_rejects and ours_passes:
                missed_rejections.append(disagreements[-1])
    summary = f"sglang {VERSION}: {agreed}/{total} outcomes agree, {len(missed_rejections)} rejections missed"
    assert not disagreements, summary + "\n" + "\n".join(disagreements[:40])


def test_missing_wheel_fails_never_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "CACHE", tmp_path)
    with pytest.raises(engines.MissingWheel, match=r"sglang==0\.5\.23 wheel not in .*make engines"):
        engines.unpacked("sglang", VERSION)
