"""Answers the vLLM oracle cases with `lorafast.compat.vllm` (JSON on stdin, JSON on stdout), in a child
interpreter with the same PYTHONHASHSEED as the engine's, so that messages printing a set compare exactly.

Payload: {"engine_version": "0.33.0", "cases": [...]} (the cases of vllm_runner.py); the result per case has
the same shape as vllm_runner.py's. With "preflight": true, "preflight" holds `vllm.preflight`'s decision per
case as well (see `preflight_case`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from lorafast.compat import vllm


def mapper(spec: dict | None) -> vllm.WeightsMapper | None:
    if spec is None:
        return None
    return vllm.WeightsMapper(spec.get("substr"), spec.get("prefix"), spec.get("suffix"))


def summary(lora: vllm.VLLMLoRA) -> dict[str, Any]:
    def shape(s: Any) -> list[int] | None:
        return None if s is None else list(s)

    loras = [
        [n, w.rank, w.scaling, shape(w.lora_a_shape), shape(w.lora_b_shape)] for n, w in sorted(lora.loras.items())
    ]
    saved = {n: [shape(w), shape(b)] for n, (w, b) in sorted(lora.modules_to_save.items())}
    return {"rank": lora.rank, "loras": loras, "modules_to_save": saved}


def model_kwargs(case: dict[str, Any], version: str) -> dict[str, Any]:
    """The model a load case runs under, as the keyword arguments `load_adapter` and `preflight` share."""
    setup = case["setup"]
    head = setup["classification_head"]
    return {
        "supported_lora_modules": setup["supported"],
        "packed_modules_mapping": setup["packed"],
        "max_lora_rank": case["max_lora_rank"],
        "max_position_embeddings": setup["max_position_embeddings"],
        "vocab_size": setup["vocab_size"],
        "hf_to_vllm_mapper": mapper(setup["mapper"]),
        "moe_modules": setup["moe_modules"],
        "classification_head": None if head is None else vllm.ClassificationHead(**head),
        "is_pooling_model": setup["is_pooling_model"],
        "engine_version": version,
    }


def run_case(case: dict[str, Any], version: str) -> dict[str, Any]:
    try:
        if case["op"] == "parse":
            name, is_a = vllm.parse_fine_tuned_lora_name(case["name"], mapper(case["mapper"]), engine_version=version)
            return {"ok": [name, is_a]}
        lora = vllm.load_adapter(
            case["path"],
            lora_name=case["lora_name"],
            lora_int_id=case["lora_int_id"],
            **model_kwargs(case, version),
        )
        return {"ok": summary(lora)}
    except Exception as exc:  # every outcome is compared, whatever is raised
        return {"error": [type(exc).__name__, str(exc)]}


def preflight_case(case: dict[str, Any], version: str) -> dict[str, Any] | None:
    """`vllm.preflight` on the case's adapter alone, under the same model: {"ok": true} or the rejection's
    {"error": [type name, message]} (None for parse cases)."""
    if case["op"] != "load":
        return None
    plan = vllm.preflight(
        {case["lora_name"]: case["path"]},
        first_lora_int_id=case["lora_int_id"],
        collect=True,
        **model_kwargs(case, version),
    )
    if plan.ok:
        return {"ok": True}
    (problem,) = plan.problems
    return {"error": [problem.exc_type, problem.message]}


def main() -> None:
    payload = json.load(sys.stdin)
    version = payload["engine_version"]
    out: dict[str, Any] = {"results": [run_case(case, version) for case in payload["cases"]]}
    if payload.get("preflight"):
        out["preflight"] = [preflight_case(case, version) for case in payload["cases"]]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
