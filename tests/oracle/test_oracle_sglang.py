"""lorafast.compat.sglang against SGLang's own released code (the oracle), outcome by outcome.

tests/oracle/sglang_runner.py runs the wheel's LoRAManager start-up, memory pool, first use and dynamic loads on
CPU for every case of tests/oracle/cases_sglang.py; here `compat.sglang.preflight` answers the same cases from
headers. Compared: the start-up exception (type and exact message) or the whole decision (target modules, max
rank, shared-outer mode, added tokens, buffer shapes), every first-use failure (preflight must report it as
fatal, stage `first_use`), and every dynamic load (`SGLangPlan.check_new_adapter`) with its first use.
A missing wheel fails (MissingWheel), never skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oracle import cases_sglang, engines

VERSION = "0.5.23"
HASH_SEED = "11"  # both children hash strings alike, so printed sets come out in the same order


def _lorafast_side(cases: list[dict[str, Any]], functions: list[dict[str, Any]]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "sglang_lorafast.py")],
        input=json.dumps({"cases": cases, "functions": functions, "version": VERSION}),
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    engines.wheel("sglang", VERSION)  # raises MissingWheel (a failure) when `make engines` has not run
    data = cases_sglang.build(Path(tmp_path_factory.mktemp("sglang-oracle")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", HASH_SEED)
        theirs = engines.run(
            "sglang_runner", "sglang", VERSION, {"cases": data["cases"], "functions": data["functions"]}
        )
    ours = _lorafast_side(data["cases"], data["functions"])
    return data, theirs, ours


def _outcomes(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """One comparable outcome per start-up, per first use and per dynamic load."""
    out: list[tuple[str, Any]] = [("startup", result["startup"])]
    out += [(f"weights[{i}]", w) for i, w in enumerate(result.get("weights", ()))]
    out += [(f"first_use[{i}]", f) for i, f in enumerate(result.get("first_use", ()))]
    out += [(f"dynamic[{i}]", d) for i, d in enumerate(result.get("dynamic", ()))]
    return out


def test_data_set_size(oracle: tuple[dict[str, Any], dict[str, Any], dict[str, Any]]) -> None:
    data, theirs, _ = oracle
    results = theirs["results"]
    sets = [c for c in data["cases"] if len(c["adapters"]) + len(c.get("dynamic", ())) > 1]
    assert len(data["adapters"]) >= 500, len(data["adapters"])
    kinds = {kind for _, kind, _ in data["adapters"]}
    assert kinds >= {"bin_only", "pt_only", "bin_and_pt", "training_args_and_pt", "only_training_args", "no_weights",
                     "zero_size", "inkling_shared"}  # fmt: skip
    assert len(sets) >= 200, len(sets)
    broken = [r for r in results.values() if "runner_error" in r]
    assert not broken, broken[:2]


def test_preflight_agrees_with_sglang_0_5_23(oracle: tuple[dict[str, Any], dict[str, Any], dict[str, Any]]) -> None:
    data, theirs, ours = oracle
    results, answers = theirs["results"], ours["results"]
    total = agreed = 0
    disagreements: list[str] = []
    missed_rejections: list[str] = []
    for case in data["cases"]:
        pairs_theirs, pairs_ours = _outcomes(results[case["id"]]), dict(_outcomes(answers[case["id"]]))
        for key, value in pairs_theirs:
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
    for i, (call, value) in enumerate(zip(data["functions"], theirs["functions"], strict=True)):
        if value is None:  # loaded_weights of an adapter SGLang's LoRAConfig refuses: nothing to compare
            continue
        total += 1
        if ours["functions"][i] == value:
            agreed += 1
        else:
            disagreements.append(f"function {call}: sglang={value!r} lorafast={ours['functions'][i]!r}")
    summary = f"sglang {VERSION}: {agreed}/{total} outcomes agree, {len(missed_rejections)} rejections missed"
    print(summary)  # shown with `pytest -s`: the agreement count docs/compat.md quotes
    assert not missed_rejections, summary + "\n" + "\n".join(missed_rejections[:40])
    assert not disagreements, summary + "\n" + "\n".join(disagreements[:40])


def test_expert0_warnings_name_per_expert_buffers(
    oracle: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> None:
    """lorafast's own "SGLang copies it into expert 0 only" warning, held against the engine's pool: the buffer
    it names exists there, per-expert, with the expert dim it says (Inkling's shared experts in shared-outer mode
    go to expert_dim-1 buffers, or to none in these models, and must not be warned about)."""
    data, theirs, ours = oracle
    warned = 0
    for case in data["cases"]:
        for buffer, ab, dim in ours["results"][case["id"]].get("expert0", ()):
            warned += 1
            shapes = theirs["results"][case["id"]]["startup"]["buffers"]
            assert buffer in shapes, (case["id"], buffer, sorted(shapes))
            assert str(shapes[buffer][0 if ab == "A" else 1][1]) == dim != "1", (case["id"], buffer, ab, dim)
    assert warned >= 50, warned


def test_empty_tensors_come_in_name_order_in_every_process(
    oracle: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
) -> None:
    """Tensors of zero size share one data offset. SGLang's loader yields them in name order (compared with
    compat's order in the main run) under another hash seed too."""
    data, theirs, _ = oracle
    (i, call), *_ = [(i, c) for i, c in enumerate(data["functions"]) if c["fn"] == "iterate"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", "0")
        (again,) = engines.run("sglang_runner", "sglang", VERSION, {"cases": [], "functions": [call]})["functions"]
    names = theirs["functions"][i][0]
    assert again == theirs["functions"][i] == [names, names] and names == sorted(names)
    assert sum(".z" in n for n in names) == 3


def test_missing_wheel_fails_never_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "CACHE", tmp_path)
    with pytest.raises(engines.MissingWheel, match=r"sglang==0\.5\.23 wheel not in .*make engines"):
        engines.unpacked("sglang", VERSION)
