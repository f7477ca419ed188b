"""`lorafast.preflight`'s verdicts against what the engines' released code serves, adapter by adapter.

The fleet (tests/oracle/serving_cases.py) is real PEFT output on tiny Llama, Qwen2, Llava, Mixtral and Qwen3-MoE
models, with the scale PEFT trained each module at (`LoraLayer.scaling` of the `PeftModel`). For each engine
version and launch command, the engine's own code decides, in one child interpreter per version:

- vLLM 0.30.0, 0.33.0, 0.34.0 (tests/oracle/vllm_serving_runner.py): `_load_adapter` raises or gives the
  `LoRAModel`; the manager's target filter (`is_in_target_modules`, the punica wrappers of a multimodal model)
  decides which modules are wrapped; registration packs the adapter's modules onto them; the scale each wrapped
  module serves at is measured from what activation hands to `set_lora` (a MoE layer's through the guard of the
  wheel's `FusedMoEWithLoRA.set_lora`);
- SGLang 0.5.23 (tests/oracle/sglang_serving_runner.py): start-up, dynamic load and first use raise or pass; the
  memory pool's buffers show which of the adapter's tensors it took, and where; the scale is
  `LoRAAdapter.scaling` (and what the pool copy multiplied in).

From that, the engine's verdict per adapter with `serving.VERDICTS`' definitions: `fails` if its load, start-up
or first use raises; `silent_noop` if no trained module is applied; `partial` if some are not; `scale_differs`
if an applied module serves at another scale than PEFT trained it; else `serves`. `lorafast.preflight` on the
same launch command must give that verdict for every adapter, with the same dropped modules and scales: a
`serves` where the engine drops or rescales a module is a defect like a false ok. Known limits, documented in
docs/compat.md ("Serving verdicts"), are strict expected failures below, never a false `serves`.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import engines
import lorafast
import serving_cases as sc
from lorafast.serving import VERDICTS

VLLM_VERSIONS = engines.PINNED["vllm"]
SGLANG_VERSIONS = engines.PINNED["sglang"]
TOLERANCE = 1e-5

# Cases where lorafast cannot give the engine's verdict yet, each with why; docs/compat.md "Serving verdicts".
# Keys: (engine, version or None for all, launch label or None, adapter name). None at present: the transformers-5
# Mixtral adapter of fused experts (`m_experts`), once one, is decided since lorafast reads vLLM's MoE layers from
# the base's per-expert weights.
LIMITS: dict[tuple[str, str | None, str | None, str], str] = {}


# --- the fleet and the launch commands ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> sc.Fleet:
    return sc.build_fleet(tmp_path_factory.mktemp("serving-oracle"))


def _targets(flags: list[str]) -> list[str] | None:
    if "--lora-target-modules" not in flags:
        return None
    rest = flags[flags.index("--lora-target-modules") + 1 :]
    return [f for f in rest[: next((i for i, f in enumerate(rest) if f.startswith("--")), len(rest))]]


def vllm_launches(fleet: sc.Fleet) -> list[dict[str, Any]]:
    """One launch per base and flag set, every adapter of the base named in --lora-modules."""
    out = []
    for base, names in sc.SERVED_ON.items():
        for label, flags in [*sc.VLLM_LAUNCHES, *sc.VLLM_BASE_LAUNCHES.get(base, [])]:
            mods = [f"{n}={fleet.adapters[n]}" for n in names]
            argv = ["vllm", "serve", str(fleet.bases[base]), "--enable-lora", *flags, "--lora-modules", *mods]
            out.append({"id": f"{base}/{label}", "base": base, "label": label, "argv": argv, "names": names,
                        "dynamic": [], "targets": _targets(flags)})  # fmt: skip
    return out


def sglang_launches(fleet: sc.Fleet) -> list[dict[str, Any]]:
    """Start-up launches with one adapter each in --lora-paths (a set's failure would hide each adapter's own
    answer), and one launch per base whose adapters all come through the dynamic load."""
    out = []
    for base in sc.SGLANG_BASES:
        names = sc.SERVED_ON[base]
        for label, flags, how in [*sc.SGLANG_LAUNCHES, *sc.SGLANG_BASE_LAUNCHES.get(base, [])]:
            head = ["python", "-m", "sglang.launch_server", "--model-path", str(fleet.bases[base]), "--enable-lora"]
            if how == "startup":
                for n in names:
                    argv = [*head, *flags, "--lora-paths", f"{n}={fleet.adapters[n]}"]
                    out.append({"id": f"{base}/{label}/{n}", "base": base, "label": label, "argv": argv,
                                "names": [n], "dynamic": [], "targets": _targets(flags)})  # fmt: skip
            else:
                out.append({"id": f"{base}/{label}", "base": base, "label": label, "argv": [*head, *flags],
                            "names": [], "dynamic": names, "targets": _targets(flags)})  # fmt: skip
    return out


def _rank(argv: list[str]) -> int:
    return int(argv[argv.index("--max-lora-rank") + 1])


def vllm_payload(fleet: sc.Fleet, launches: list[dict[str, Any]]) -> dict[str, Any]:
    cases = []
    for launch in launches:
        model = sc.vllm_model(launch["base"], fleet.configs[launch["base"]])
        for i, n in enumerate(launch["names"]):
            cases.append({"id": f"{launch['id']}/{n}", "path": str(fleet.adapters[n]), "lora_name": n,
                          "lora_int_id": i + 1, "max_lora_rank": _rank(launch["argv"]), "setup": model["setup"],
                          "serve": {**model["serve"], "target_modules": launch["targets"]}})  # fmt: skip
    return {"cases": cases}


def sglang_payload(fleet: sc.Fleet, launches: list[dict[str, Any]]) -> dict[str, Any]:
    cases = []
    for launch in launches:
        ref = lambda n: {"name": n, "path": str(fleet.adapters[n])}  # noqa: E731
        common = {"base": fleet.configs[launch["base"]], "max_lora_rank": _rank(launch["argv"]),
                  "target_modules": launch["targets"], "adapters": [ref(n) for n in launch["names"]]}  # fmt: skip
        if launch["dynamic"]:  # each dynamic load on a server of its own, as preflight judges each one alone
            cases += [{"id": f"{launch['id']}/{n}", **common, "dynamic": [ref(n)]} for n in launch["dynamic"]]
        else:
            cases.append({"id": launch["id"], **common, "dynamic": []})
    return {"cases": cases}


# --- the engine's verdict -----------------------------------------------------------------------------------


def engine_verdict(result: dict[str, Any], trained: dict[str, float], saved: list[str]) -> dict[str, Any]:
    """The verdict the engine's behaviour amounts to, with `serving.VERDICTS`' definitions."""
    if "error" in result:
        exc_type, message = result["error"][:2]
        stage = result["stage"]
        if stage == "startup" and message.startswith("Failed to load LoRA adapter "):
            stage = "load"  # SGLang's start-up loading one adapter: that adapter's load
        return {"verdict": "fails", "stage": stage, "type": exc_type, "message": message}
    served = result["modules"]
    units = [*trained, *saved]
    applied = [m for m in units if served.get(m, [False])[0]]
    dropped = sorted(set(units) - set(applied))
    scales = {}
    for m in applied:
        if m in trained:
            s = served[m][1]
            assert s is not None, f"{m}: the engine applied it, but not at one scale"
            if not math.isclose(s, trained[m], rel_tol=TOLERANCE):
                scales[m] = (trained[m], s)
    if not applied:
        verdict = "silent_noop"
    elif dropped:
        verdict = "partial"
    elif scales:
        verdict = "scale_differs"
    else:
        verdict = "serves"
    return {"verdict": verdict, "applied": len(applied), "modules": len(units), "dropped": dropped, "scales": scales}


def ours(row: Any) -> dict[str, Any]:
    """lorafast's row in the same shape (module names as PEFT gives them, without `base_model.model.`)."""
    if row.verdict == "fails":
        return {"verdict": "fails", "stage": row.stage, "type": row.exc_type, "message": row.message}
    return {
        "verdict": row.verdict,
        "applied": row.applied,
        "modules": row.modules,
        "dropped": sorted({_name(m) for m, _ in row.dropped}),
        "scales": {_name(s.module): (s.trained, s.served) for s in row.scales},
    }


def _name(module: str) -> str:
    return module.removeprefix("base_model.model.")


def _text(message: str) -> str:
    """An error text without what describes the model rather than the adapter: vLLM's unexpected-modules error
    prints the model's expected module set and the names after the model's weights mapper, and keeps
    `base_model.model.` in names only under a mapper. lorafast describes the model from the base's weights (the
    texts themselves are proven in test_oracle_vllm.py, on vLLM's own model descriptions). A printed set of
    names is compared as a set."""
    message = re.sub(r"expected target modules in \{[^}]*\} but received \[[^]]*\]", "expected ... received ...",
                     message)  # fmt: skip
    # a set of names prints in the interpreter's hash order (SGLang's "Cannot find target module name for ... in
    # {...}"): compared as a set
    message = re.sub(r"\{'[^{}]*'\}", lambda m: "{" + ", ".join(sorted(m.group(0)[1:-1].split(", "))) + "}", message)
    return message.replace("base_model.model.", "")


def agree(truth: dict[str, Any], mine: dict[str, Any]) -> bool:
    if truth["verdict"] != mine["verdict"]:
        return False
    if truth["verdict"] == "fails":  # the engine's stage, exception type (where it gives one) and text
        return (
            truth["stage"] == mine["stage"]
            and truth["type"] in ("", mine["type"])
            and _text(truth["message"]) == _text(mine["message"])
        )
    if truth["verdict"] in ("partial", "silent_noop") and truth["dropped"] != mine["dropped"]:
        return False
    if set(truth["scales"]) != set(mine["scales"]):
        return False
    return all(
        math.isclose(a, b, rel_tol=TOLERANCE)
        for m, t in truth["scales"].items()
        for a, b in zip(t, mine["scales"][m], strict=True)
    )


# --- runs ---------------------------------------------------------------------------------------------------


def _preflight(launch: dict[str, Any], fleet: sc.Fleet, version: str) -> dict[str, Any]:
    report = lorafast.preflight(launch["argv"], [fleet.adapters[n] for n in launch["dynamic"]],
                                engine_version=version)  # fmt: skip
    return {row.name: ours(row) for row in report}


@pytest.fixture(scope="module")
def outcomes(fleet: sc.Fleet) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """{(engine, version): [{"case", "launch", "adapter", "truth", "ours"}]}, the engines run side by side."""
    for v in VLLM_VERSIONS:
        engines.unpacked("vllm", v)  # a missing wheel fails here, saying what to run
    for v in SGLANG_VERSIONS:
        engines.unpacked("sglang", v)
    vl, sg = vllm_launches(fleet), sglang_launches(fleet)
    with ThreadPoolExecutor(len(VLLM_VERSIONS) + len(SGLANG_VERSIONS)) as pool:
        runs = {("vllm", v): pool.submit(engines.run, "vllm_serving_runner", "vllm", v, vllm_payload(fleet, vl))
                for v in VLLM_VERSIONS}  # fmt: skip
        runs.update({("sglang", v): pool.submit(engines.run, "sglang_serving_runner", "sglang", v,
                                                sglang_payload(fleet, sg)) for v in SGLANG_VERSIONS})  # fmt: skip
        out: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for (engine, version), future in runs.items():
            rows = []
            for launch in vl if engine == "vllm" else sg:
                mine = _preflight(launch, fleet, version)
                for n in [*launch["names"], *launch["dynamic"]]:
                    if engine == "vllm":
                        result = future.result()["results"][f"{launch['id']}/{n}"]
                        result = result if "error" in result else result["ok"]
                    else:
                        key = launch["id"] if launch["names"] else f"{launch['id']}/{n}"
                        (result,) = future.result()["results"][key]
                    truth = engine_verdict(result, fleet.trained[n], fleet.saved[n])
                    rows.append({"case": f"{launch['id'].removesuffix('/' + n)}/{n}", "launch": launch["label"],
                                 "adapter": n, "truth": truth, "ours": mine[n]})  # fmt: skip
            out[(engine, version)] = rows
    if os.environ.get("LORAFAST_SERVING_DUMP"):  # every case, for a look at the numbers
        with open(os.environ["LORAFAST_SERVING_DUMP"], "w") as f:
            json.dump({f"{e} {v}": rows for (e, v), rows in out.items()}, f, indent=1, default=str)
    return out


def _limit(engine: str, version: str, row: dict[str, Any]) -> str | None:
    for (e, v, label, name), why in LIMITS.items():
        if e == engine and v in (None, version) and label in (None, row["launch"]) and name == row["adapter"]:
            return why
    return None


ALL = [("vllm", v) for v in VLLM_VERSIONS] + [("sglang", v) for v in SGLANG_VERSIONS]


@pytest.mark.parametrize(("engine", "version"), ALL)
def test_preflight_gives_the_engines_verdict(
    outcomes: dict[tuple[str, str], list[dict[str, Any]]], engine: str, version: str
) -> None:
    rows = outcomes[(engine, version)]
    checked = [r for r in rows if _limit(engine, version, r) is None]
    wrong = [r for r in checked if not agree(r["truth"], r["ours"])]
    truth = Counter(r["truth"]["verdict"] for r in rows)
    print(f"\n{engine} {version}: {len(rows)} cases, {len(checked) - len(wrong)}/{len(checked)} agree "
          f"({len(rows) - len(checked)} known limits); engine verdicts: "
          + ", ".join(f"{v} {truth[v]}" for v in VERDICTS if truth[v]))  # fmt: skip
    false_serves = [r for r in rows if r["ours"]["verdict"] == "serves" and r["truth"]["verdict"] != "serves"]
    assert not false_serves and not wrong, "\n".join(
        [f"false serves: {r['case']}" for r in false_serves]
        + [f"{r['case']}:\n  engine   {r['truth']}\n  lorafast {r['ours']}" for r in wrong]
    )
    # every verdict class the engine can reach is reached on this fleet (vLLM from 0.33 serves every applied
    # module at PEFT's scale: rsLoRA, alpha_pattern and rank_pattern are followed)
    reached = {"fails", "silent_noop", "partial", "serves"}
    if engine == "sglang" or version == "0.30.0":
        reached.add("scale_differs")
    assert reached <= set(truth), truth


LIMIT_CASES = [pytest.param(key, marks=pytest.mark.xfail(strict=True, reason=why), id="-".join(map(str, key)))
               for key, why in LIMITS.items()]  # fmt: skip


@pytest.mark.parametrize("key", LIMIT_CASES)
def test_known_limits(outcomes: dict[tuple[str, str], list[dict[str, Any]]], key: tuple[Any, ...]) -> None:
    engine, version, label, name = key
    rows = [r for (e, v), rs in outcomes.items() if e == engine and version in (None, v) for r in rs
            if label in (None, r["launch"]) and r["adapter"] == name]  # fmt: skip
    assert rows
    for r in rows:
        assert r["ours"]["verdict"] != "serves" or r["truth"]["verdict"] == "serves"  # never a false serves
        assert agree(r["truth"], r["ours"]), (r["truth"], r["ours"])


@pytest.mark.parametrize(("engine", "version"), ALL)
def test_undecided_is_unknown_never_serves(
    outcomes: dict[tuple[str, str], list[dict[str, Any]]], fleet: sc.Fleet, engine: str, version: str
) -> None:
    """The same launches with the base out of reach, and with an engine version lorafast has not verified: what
    depends on the missing input is `unknown`, never `serves`; what lorafast still decides is the engine's."""
    truth = {r["case"]: r["truth"] for r in outcomes[(engine, version)]}
    launches = vllm_launches(fleet) if engine == "vllm" else sglang_launches(fleet)
    seen: Counter[str] = Counter()
    wrong = []
    for launch in launches:
        argv = [
            a if a != str(fleet.bases[launch["base"]]) else f"/nonexistent/{launch['base']}" for a in launch["argv"]
        ]
        mine = _preflight({**launch, "argv": argv}, fleet, version)
        for n, row in mine.items():
            case = f"{launch['id'].removesuffix('/' + n)}/{n}"
            seen[row["verdict"]] += 1
            if row["verdict"] == "serves" or (row["verdict"] != "unknown" and not agree(truth[case], row)):
                wrong.append(f"{case}: engine {truth[case]['verdict']}, lorafast without the base {row}")
    print(f"\n{engine} {version} without the base: " + ", ".join(f"{v} {seen[v]}" for v in VERDICTS if seen[v]))
    assert not wrong, "\n".join(wrong)
    assert seen["unknown"] > 0
    # a release after this one, which lorafast answers with the rules of a verified one and says so
    later = ".".join([*version.split(".")[:-1], str(int(version.split(".")[-1]) + 1)])
    unverified: Counter[str] = Counter()
    for launch in launches:
        with pytest.warns(lorafast.UnverifiedEngineVersion):
            mine = _preflight(launch, fleet, later)
        unverified.update(row["verdict"] for row in mine.values())
    print(f"{engine} {later} (not verified): " + ", ".join(f"{v} {unverified[v]}" for v in VERDICTS if unverified[v]))
    assert not unverified["serves"] and unverified["unknown"] > 0
