"""The lorafast side of the SGLang oracle: `compat.sglang` answers for the same cases, in the runner's format.

Run as a child interpreter with the same PYTHONHASHSEED as tests/oracle/sglang_runner.py: SGLang messages print
Python sets, and compat builds those sets from the same strings in the same order, so the texts match only
between interpreters that hash strings alike.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from typing import Any

from lorafast.compat import LoraRef
from lorafast.compat import sglang as sg

STARTUP_STAGES = ("startup", "load")
# The buffer, side and expert dim an "expert 0 only" warning names.
_EXPERT0 = re.compile(r"the (\S+) lora_([AB]) buffer is per-expert \(expert_dim=(\w+),")


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


def _weights(plan: sg.SGLangPlan, ref: LoraRef) -> list:
    """The normalized weights preflight checked for `ref`: (layer, name, shape) in SGLang's dict order."""
    return _listed(plan.loaded_weights[ref.lora_id])


def _listed(weights: Any) -> list:
    out = [[i, name, list(shape)] for i, name, shape in weights.iter_layer_weights()]
    return out + [[None, name, list(shape)] for name, shape in weights.embedding.items()]


def lorafast_outcome(case: dict[str, Any], version: str) -> dict[str, Any]:
    """The engine runner's result structure, answered by compat.sglang from headers."""
    refs = [LoraRef(name=a["name"], path=a["path"], pinned=a.get("pinned", False)) for a in case["adapters"]]
    cfg = _base_config(case["base"])
    tm = case.get("target_modules")
    plan = sg.preflight(
        refs, max_lora_rank=case.get("max_lora_rank"), target_modules=tm,
        max_loras_per_batch=case.get("max_loras_per_batch", 8), experts_shared_outer=case.get("experts_shared_outer"),
        strict_loading=case.get("strict_loading", False), base_config=cfg, collect=True, engine_version=version,
    )  # fmt: skip
    startup = [p for p in plan.errors if p.stage in STARTUP_STAGES]
    if startup:
        return {"startup": {"error": _err(startup[0])}}
    out: dict[str, Any] = {"startup": {
        "target_modules": sorted(plan.target_modules), "max_lora_rank": plan.max_lora_rank,
        "shared_outer": plan.experts_shared_outer, "added_tokens": plan.lora_added_tokens_size,
        "buffers": _buffers(plan), "ids": [r.lora_id for r in refs],
    }}  # fmt: skip
    out["weights"] = [_weights(plan, ref) for ref in refs]
    out["expert0"] = [_EXPERT0.search(p.message).groups() for p in plan.warnings  # type: ignore[union-attr]
                      if p.code == "sglang_shared_factor_in_per_expert_pool"]  # fmt: skip
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


def run_functions(calls: list[dict[str, Any]]) -> list[Any]:
    """compat.sglang's name rules for the runner's direct calls (module names from the predicted tree)."""
    from lorafast.compat.sglang import _pool as _sglang_pool

    out: list[Any] = []
    for call in calls:
        try:
            if call["fn"] == "loaded_weights":
                out.append(_listed(sg.predict_loaded_weights(call["path"], base_config=_base_config(call["base"]))))
            elif call["fn"] == "iterate":  # the order compat reads one file's tensors in (both SGLang iterators)
                names = [name for _, name, _ in sg.predict_loaded_weights(call["path"]).iter_layer_weights()]
                out.append([names, names])
            elif call["fn"] == "normalized":
                out.append(sorted(sg.get_normalized_target_modules(call["target_modules"])))
            else:
                tree = _sglang_pool.base_model_tree(_base_config(call["base"]))
                names = [m.name if m.kind != "moe" else f"{m.name}.gate_up_proj" for m in tree]
                names += [f"{m.name}.down_proj" for m in tree if m.kind == "moe"]
                names = [n if not n.endswith("embed_tokens") else "embed_tokens" for n in names]
                out.append(sorted(sg.auto_detect_lora_target_modules(names, call.get("supported") or ())))
        except Exception as exc:
            out.append([type(exc).__name__, str(exc)])
    return out


def main() -> None:
    logging.disable(logging.WARNING)  # compat logs SGLang's warnings; only the answers go to stdout
    payload = json.load(sys.stdin)
    results = {}
    for case in payload["cases"]:
        try:
            results[case["id"]] = lorafast_outcome(case, payload["version"])
        except Exception as exc:  # a compat crash is a disagreement to report, not a runner failure
            results[case["id"]] = {"startup": {"crash": [type(exc).__name__, str(exc)]}}
    json.dump({"results": results, "functions": run_functions(payload.get("functions", []))}, sys.stdout)


if __name__ == "__main__":
    main()
