"""lorafast.compat.vllm against vLLM's own released code (0.34.0, 0.33.0 and 0.30.0), case by case.

Each case runs twice in child interpreters with the same PYTHONHASHSEED: once through vLLM's unmodified LoRA
code from the unpacked wheel (tests/oracle/vllm_runner.py) and once through lorafast.compat.vllm
(tests/oracle/lorafast_vllm_runner.py). The outcome (return summary, or exception type name and exact message)
must agree for every case: `load_adapter` against `_load_adapter`, `check_peft_helper` against
`PEFTHelper.from_local_dir`, `check_unexpected_modules` against `from_local_checkpoint`'s name check. So must
`vllm.preflight`'s decision on each load case (ok, or the rejection's type and message), and every answer given
for the adapter as `lorafast.inspect` scans it. A missing wheel is a failure (`make engines`), never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cases as case_gen
import cases_vllm
import engines

VERSIONS = engines.PINNED["vllm"]
HASH_SEED = "0"
RUNNER = Path(__file__).parent / "lorafast_vllm_runner.py"


@pytest.fixture(scope="session")
def vllm_cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("oracle-cases")
    written = case_gen.write_cases(root, 600)
    loads = cases_vllm.load_cases(written)
    return loads + cases_vllm.step_cases(loads) + cases_vllm.parse_cases()


def _engine(version: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", HASH_SEED)
        return engines.run("vllm_runner", "vllm", version, payload)["results"]


Answers = tuple[list[dict[str, Any]], list[dict[str, Any] | None], list[dict[str, Any] | None]]


def _lorafast(version: str, payload: dict[str, Any]) -> Answers:
    """(outcomes, preflight decisions, answers for the scanned adapter) per case, from one child interpreter."""
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    given = {**payload, "engine_version": version, "preflight": True}
    proc = subprocess.run([sys.executable, str(RUNNER)], input=json.dumps(given),
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    return out["results"], out["preflight"], out["scanned"]


def _decision(outcome: dict[str, Any]) -> dict[str, Any]:
    """An engine outcome as a preflight decision: accepted, or the rejection's type and text."""
    return {"ok": True} if "ok" in outcome else outcome


@pytest.fixture(scope="session")
def vllm_outcomes(vllm_cases: list[dict[str, Any]]) -> dict[str, tuple[list[dict[str, Any]], Answers]]:
    """{version: (vLLM's outcome per case, lorafast's answers)}, every version run side by side."""
    for version in VERSIONS:
        engines.unpacked("vllm", version)  # MissingWheel fails the test here, with what to run
    payload = {"cases": vllm_cases}
    with ThreadPoolExecutor(4) as pool:
        engine = {v: pool.submit(_engine, v, payload) for v in VERSIONS}
        ours = {v: pool.submit(_lorafast, v, payload) for v in VERSIONS}
        return {v: (engine[v].result(), ours[v].result()) for v in VERSIONS}


def _comparisons(cases: list[dict[str, Any]], theirs: list[dict[str, Any]], answers: Answers) -> Iterator[Any]:
    """(what is compared, case, vLLM's outcome, lorafast's) for every answer lorafast gave."""
    for case, a, b, d, s in zip(cases, theirs, *answers, strict=True):
        yield case["op"], case, a, b
        if case["op"] == "load":
            # preflight's decision (accept, or the rejection's type and text) is _load_adapter's outcome
            yield "preflight", case, _decision(a), d
        if s is not None:  # the same answer for the scanned Adapter
            yield f"scanned {'preflight' if case['op'] == 'load' else case['op']}", case, (
                _decision(a) if case["op"] == "load" else a), s  # fmt: skip


def test_compat_vllm_agrees_with_vllm(
    vllm_cases: list[dict[str, Any]], vllm_outcomes: dict[str, tuple[list[dict[str, Any]], Answers]]
) -> None:
    counts, disagreements = {}, []
    for version, (theirs, answers) in vllm_outcomes.items():
        assert len(theirs) == len(vllm_cases) and all(len(a) == len(vllm_cases) for a in answers)
        tally: dict[str, list[int]] = {}  # what was compared -> [agree, cases]
        for what, case, engine, ours in _comparisons(vllm_cases, theirs, answers):
            counted = tally.setdefault(what, [0, 0])
            counted[1] += 1
            if engine == ours:
                counted[0] += 1
            else:
                where = case.get("path") or case.get("name")
                disagreements.append(f"vllm {version} {what} {case['kind']} {where}\n  vllm:     {engine}\n"
                                     f"  lorafast: {ours}")  # fmt: skip
        counts[version] = {what: f"{agree}/{total}" for what, (agree, total) in sorted(tally.items())}
        print(f"vllm {version} oracle agreement: {counts[version]}")
    assert len(vllm_cases) >= 500
    assert not disagreements, f"agreement per vLLM version: {counts}\n" + "\n".join(disagreements[:40])


# What vLLM 0.34.0 changed, shown on the oracle cases: kind -> the step whose outcome differs from 0.33.0's.
CHANGED_IN_034 = {
    "task_seq_cls_score_none": "unexpected",  # task_type SEQ_CLS: classifier/score join modules_to_save
    "task_seq_cls_score_missing": "unexpected",
    "task_seq_cls_score_empty": "unexpected",
    "task_seq_cls_score_classifier": "unexpected",
    "task_token_cls_score": "load",
    "mts_null": "peft_helper",
    "task_seq_cls_mts_int": "peft_helper",  # TypeError: Value after * must be an iterable, not int
    "as_is": "unexpected",  # BERT's bert.pooler.dense LoRA: "(not a LoRA layer)"
}


def test_oracle_shows_what_034_changed(
    vllm_cases: list[dict[str, Any]], vllm_outcomes: dict[str, tuple[list[dict[str, Any]], Answers]]
) -> None:
    old, (new, (ours, _, _)) = vllm_outcomes["0.33.0"][0], vllm_outcomes["0.34.0"]
    for kind, op in CHANGED_IN_034.items():
        changed = [i for i, case in enumerate(vllm_cases)
                   if case["kind"] == kind and case["op"] == op and old[i] != new[i]]  # fmt: skip
        assert changed, f"no {op} outcome of {kind} differs between vLLM 0.33.0 and 0.34.0"
        assert all(ours[i] == new[i] for i in changed), kind
    pooler = [i for i, case in enumerate(vllm_cases) if case.get("family") == "bert_seqcls" and case["op"] == "unexpected"
              and "(not a LoRA layer)" in str(new[i])]  # fmt: skip
    assert pooler and all("(not a LoRA layer)" not in str(old[i]) for i in pooler)


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
        *CHANGED_IN_034,
        "mts_true",
        "config_non_peft",
        "config_in_metadata",
        "extra_safetensors",
        "weights_duplicate_name",
        "weights_bad_json",
        "rank_pattern_lookbehind",
        "rank_pattern_backref",
        "alpha_pattern_inline_flag",
        "kohya_alpha_0",
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
        "bert_seqcls",
    }
    assert {case["op"] for case in vllm_cases} == {"load", "peft_helper", "unexpected", "parse"}
