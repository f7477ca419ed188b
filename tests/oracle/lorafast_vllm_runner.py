"""Answers the vLLM oracle cases with `lorafast.compat.vllm` (JSON on stdin, JSON on stdout), in a child
interpreter with the same PYTHONHASHSEED as the engine's, so that messages printing a set compare exactly.

Payload: {"engine_version": "0.33.0", "cases": [...]} (the cases of vllm_runner.py); the result per case has
the same shape as vllm_runner.py's: "load" is `load_adapter`, "peft_helper" `check_peft_helper`, "unexpected"
`check_unexpected_modules`, each given the case's path. With "preflight": true, "preflight" holds
`vllm.preflight`'s decision per load case as well (see `preflight_case`). "scanned" holds, per case, the same
answer for the adapter as `lorafast.inspect` returns it (None where inspect refuses the path or for parse and
load cases): a scanned adapter on disk must be read as vLLM reads the folder, whatever the scan made of it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lorafast
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
        "unsupported_lora_modules": setup.get("unsupported", []),
        "engine_version": version,
    }


def _step(case: dict[str, Any], version: str, adapter: Any) -> Any:
    """The peft_helper / unexpected steps on `adapter` (the case's path, or its scanned Adapter)."""
    if case["op"] == "peft_helper":
        return dict(vllm.check_peft_helper(adapter, engine_version=version))
    setup = case["setup"]
    given = mapper(setup["mapper"])
    vllm.check_unexpected_modules(
        adapter,
        vllm.expected_lora_modules(setup["supported"], setup["packed"]),
        weights_mapper=None if given is None else given.get_rename_mapper(),
        unsupported_lora_modules=setup.get("unsupported", []),
        engine_version=version,
    )
    return None


def _outcome(answer: Any) -> dict[str, Any]:
    try:
        return {"ok": answer()}
    except Exception as exc:  # every outcome is compared, whatever is raised
        return {"error": [type(exc).__name__, str(exc)]}


def run_case(case: dict[str, Any], version: str) -> dict[str, Any]:
    if case["op"] == "parse":
        return _outcome(lambda: list(vllm.parse_fine_tuned_lora_name(case["name"], mapper(case["mapper"]),
                                                                     engine_version=version)))  # fmt: skip
    if case["op"] == "load":
        return _outcome(lambda: summary(vllm.load_adapter(
            case["path"], lora_name=case["lora_name"], lora_int_id=case["lora_int_id"], **model_kwargs(case, version)
        )))  # fmt: skip
    return _outcome(lambda: _step(case, version, case["path"]))


def scanned_case(case: dict[str, Any], version: str) -> dict[str, Any] | None:
    """`run_case`'s step (or preflight's decision, for a load case) on `lorafast.inspect(path)`."""
    if case["op"] == "parse":
        return None
    try:
        adapter = lorafast.inspect(case["path"])
    except Exception:  # a path the scan refuses has no Adapter to pass
        return None
    if case["op"] == "load":
        return preflight_case(case, version, adapter)
    return _outcome(lambda: _step(case, version, adapter))


def preflight_case(case: dict[str, Any], version: str, adapter: Any = None) -> dict[str, Any] | None:
    """`vllm.preflight` on the case's adapter alone (its path, or `adapter`), under the same model: {"ok": true}
    or the rejection's {"error": [type name, message]} (None for cases other than load)."""
    if case["op"] != "load":
        return None
    plan = vllm.preflight(
        {case["lora_name"]: case["path"] if adapter is None else adapter},
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
        out["scanned"] = [scanned_case(case, version) for case in payload["cases"]]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
