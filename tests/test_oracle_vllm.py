"""lorafast.compat.vllm against vLLM's own released code (0.33.0 and 0.30.0), case by case.

Each case runs twice in child interpreters with the same PYTHONHASHSEED: once through vLLM's unmodified LoRA
code from the unpacked wheel (tests/oracle/vllm_runner.py) and once through lorafast.compat.vllm
(tests/oracle/lorafast_vllm_runner.py). The outcome (return summary, or exception type name and exact message)
must agree for every case, and so must `vllm.preflight`'s decision on each load case (ok, or the rejection's
type and message), computed in the same child interpreter and compared with the same engine outcomes. A missing
wheel is a failure (`make engines`), never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "oracle"))

import cases as case_gen
import cases_vllm
import engines

VERSIONS = engines.PINNED["vllm"]
HASH_SEED = "0"
RUNNER = Path(__file__).parent / "oracle" / "lorafast_vllm_runner.py"


@pytest.fixture(scope="session")
def vllm_cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("oracle-cases")
    written = case_gen.write_cases(root, 600)
    return cases_vllm.load_cases(written) + cases_vllm.parse_cases()


def _engine(version: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", HASH_SEED)
        return engines.run("vllm_runner", "vllm", version, payload)["results"]


def _lorafast(version: str, payload: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any] | None]]:
    """(load_adapter outcomes, preflight decisions) per case, from one child interpreter."""
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    given = {**payload, "engine_version": version, "preflight": True}
    proc = subprocess.run([sys.executable, str(RUNNER)], input=json.dumps(given),
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    return out["results"], out["preflight"]


def _decision(outcome: dict[str, Any]) -> dict[str, Any]:
    """An engine outcome as a preflight decision: accepted, or the rejection's type and text."""
    return {"ok": True} if "ok" in outcome else outcome


def test_compat_vllm_agrees_with_vllm(vllm_cases: list[dict[str, Any]]) -> None:
    for version in VERSIONS:
        engines.unpacked("vllm", version)  # MissingWheel fails the test here, with what to run
    payload = {"cases": vllm_cases}
    with ThreadPoolExecutor(4) as pool:
        engine = {v: pool.submit(_engine, v, payload) for v in VERSIONS}
        ours = {v: pool.submit(_lorafast, v, payload) for v in VERSIONS}
        results = {v: (engine[v].result(), ours[v].result()) for v in VERSIONS}
    counts, disagreements = {}, []
    for version, (theirs, (mine, decided)) in results.items():
        assert len(theirs) == len(mine) == len(decided) == len(vllm_cases)
        agree = agree_preflight = loads = 0
        for case, a, b, d in zip(vllm_cases, theirs, mine, decided, strict=True):
            where = case.get("path") or case.get("name")
            if a == b:
                agree += 1
            else:
                disagreements.append(f"vllm {version} {case['kind']} {where}\n  vllm:     {a}\n  lorafast: {b}")
            if case["op"] != "load":
                continue
            # preflight's decision (accept, or the rejection's type and text) is _load_adapter's outcome
            loads += 1
            if d == _decision(a):
                agree_preflight += 1
            else:
                disagreements.append(
                    f"vllm {version} preflight {case['kind']} {where}\n  vllm:      {a}\n  preflight: {d}"
                )
        counts[version] = f"load {agree}/{len(vllm_cases)}, preflight {agree_preflight}/{loads}"
    assert len(vllm_cases) >= 500
    assert not disagreements, f"agreement per vLLM version: {counts}\n" + "\n".join(disagreements[:40])


def test_outcomes_cover_every_class(vllm_cases: list[dict[str, Any]]) -> None:
    kinds = {case["kind"] for case in vllm_cases}
    for kind in (
        "init_pissa",
        "lora_bias",
        "alora",
        "layer_replication",
        "qalora",
        "bdlora",
        "rank_pattern_zero",
        "bias_null",
        "r_float",
        "r_bool",
        "alpha_null",
        "alpha_string",
        "config_invalid_json",
        "config_bom",
        "config_array",
        "no_config",
        "file_not_folder",
        "bin_only",
        "pt_only_unexpected",
        "safetensors_over_bin",
        "score_full_score",
        "classifier_and_score",
        "mts_classifier_score",
    ):
        assert kind in kinds
    families = {case["family"] for case in vllm_cases if case["op"] == "load"}
    assert families >= {
        "llama",
        "qwen2",
        "qwen2_vl",
        "mistral",
        "gpt2",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "llama_seqcls",
    }
