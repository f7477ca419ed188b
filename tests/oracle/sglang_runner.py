"""Oracle runner: SGLang's own LoRA code (unpacked release wheel) on adapters from disk, JSON in, JSON out.

Runs unmodified: `LoRAConfig`, `LoRAAdapter.initialize_weights` (with `DefaultModelLoader`'s weight-file choice
and the weight normalization), `LoRAManager.init_state` (adapter loads, `init_lora_shapes`, shared-outer
detection, `init_lora_modules`, a real `LoRAMemoryPool` on CPU), the first-use path (`fetch_new_loras` ->
`load_lora_weight_to_buffer`) and dynamic `load_lora_adapter`. What is stubbed is listed in
`tests/oracle/stubs.py` (SGLang LLM section): the manager's constructor (GPU backend, process groups), the
constructors of the base model's layers (they need process groups; the instances carry the attributes the LoRA
code reads) and of their LoRA wrappers (they need the kernel backend).

Payload: {"cases": [{"id", "base": {hf config dict}, "adapters": [{"name", "path", "pinned"}], "max_lora_rank",
"target_modules", "max_loras_per_batch", "experts_shared_outer", "strict_loading", "dynamic": [{"name", "path"}]}]}
Result: {"results": {id: {"startup": ..., "first_use": [...], "dynamic": [...]}}}

"functions" are direct calls: the name rules, each adapter's `LoRAAdapter.initialize_weights` on its own (built
with no LoRA backend, which `initialize_weights` never touches), and the loader's safetensors iterators on a file.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import stubs  # tests/oracle/stubs.py (on PYTHONPATH via engines.run)

os.environ["HF_HUB_OFFLINE"] = "1"  # the hub paths (a path that is not a folder) must fail without a network call

stubs.install_sglang_llm()

import torch  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.lora.lora_manager import LoRAManager  # noqa: E402
from sglang.srt.lora.lora_registry import LoRARef  # noqa: E402
from transformers import AutoConfig  # noqa: E402


def _error(exc: BaseException) -> list[str]:
    if os.environ.get("ORACLE_TRACE"):  # debugging aid: where in the engine the exception came from
        import traceback

        return [type(exc).__name__, str(exc), traceback.format_exc()[-1500:]]
    return [type(exc).__name__, str(exc)]


def _startup(case: dict, model: torch.nn.Module) -> tuple[LoRAManager | None, dict]:
    refs = [
        LoRARef(lora_name=a["name"], lora_path=a["path"], pinned=a.get("pinned", False),
                lora_id=LoRARef.deterministic_id(a["name"], a["path"]))
        for a in case["adapters"]
    ]  # fmt: skip
    mgr = stubs.sglang_manager_shell(
        LoRAManager, model, model.config, max_loras_per_batch=case.get("max_loras_per_batch", 8),
        load_config=LoadConfig(), experts_shared_outer=case.get("experts_shared_outer"),
        strict_loading=case.get("strict_loading", False),
    )  # fmt: skip
    tm = case.get("target_modules")
    try:
        mgr.init_state(max_lora_rank=case.get("max_lora_rank"), target_modules=None if tm is None else set(tm),
                       lora_paths=refs)  # fmt: skip
    except Exception as exc:  # the engine's own exception is the answer
        return None, {"error": _error(exc)}
    pool = mgr.memory_pool
    buffers = {}
    for name, layers in sorted(pool.A_buffer.items()):
        buffers[name] = [list(layers[0].shape), list(pool.B_buffer[name][0].shape)]
    for kind, a_buf, b_buf in (("embed_tokens", pool.embedding_A_buffer, pool.embedding_B_buffer),
                               ("lm_head", pool.lm_head_A_buffer, pool.lm_head_B_buffer)):  # fmt: skip
        if kind in a_buf:
            buffers[kind] = [list(a_buf[kind].shape), list(b_buf[kind].shape)]
    return mgr, {
        "target_modules": sorted(mgr.target_modules),
        "max_lora_rank": mgr.max_lora_rank,
        "shared_outer": bool(mgr.experts_shared_outer_loras),
        "added_tokens": mgr.lora_added_tokens_size,
        "buffers": buffers,
        "ids": [r.lora_id for r in refs],
    }


def _weights(adapter) -> list:
    """What `initialize_weights` left: (layer, name, shape) in dict order, then the embeddings."""
    out = [[i, name, list(w.shape)] for i, layer in enumerate(adapter.layers) for name, w in layer.weights.items()]
    return out + [[None, name, list(w.shape)] for name, w in adapter.embedding_layers.items()]


def _first_use(mgr: LoRAManager, uid: str):
    try:
        mgr.fetch_new_loras({uid})
    except Exception as exc:
        return _error(exc)
    return None


def run_case(case: dict) -> dict:
    model = stubs.sglang_tiny_model(AutoConfig.for_model(**case["base"]))
    mgr, startup = _startup(case, model)
    out: dict = {"startup": startup}
    if mgr is None:
        return out
    out["weights"] = [_weights(mgr.loras[uid]) for uid in startup["ids"]]
    out["first_use"] = [_first_use(mgr, uid) for uid in startup["ids"]]
    dynamic = []
    for a in case.get("dynamic", ()):
        # SGLang mints a random uuid4 id for an API load; the oracle fixes it to the one compat assumes by default
        # (uuid5 of name and path, what `LoraRef` computes), so messages naming the id can be compared. A reload
        # of a loaded name and path keeps a fresh id, as the server would give it.
        uid = LoRARef.deterministic_id(a["name"], a["path"])
        ref = LoRARef(lora_name=a["name"], lora_path=a["path"], pinned=a.get("pinned", False),
                      lora_id=uid if uid not in mgr.loras else uuid.uuid4().hex)  # fmt: skip
        result = mgr.load_lora_adapter(ref)
        entry = {"success": bool(result.success), "error_message": result.error_message}
        if result.success:
            entry["first_use"] = _first_use(mgr, ref.lora_id)
        dynamic.append(entry)
    out["dynamic"] = dynamic
    return out


def _loaded_weights(call: dict) -> list | None:
    """`LoRAAdapter.initialize_weights` on its own, as `load_lora_weights` runs it; None when `LoRAConfig` or the
    adapter's constructor refuses the adapter first (compat's `predict_loaded_weights` reads no config)."""
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    model = stubs.sglang_tiny_model(AutoConfig.for_model(**call["base"]))
    try:
        adapter = LoRAAdapter("oracle", LoRAConfig(call["path"]), model.config, LoadConfig(), None, base_model=model)
    except Exception:
        return None
    adapter.initialize_weights()
    return _weights(adapter)


def run_functions(calls: list[dict]) -> list:
    """SGLang's pure name rules, called directly: `get_normalized_target_modules` on every adapter config's
    `target_modules`, `auto_detect_lora_target_modules` on each tiny model with `supported_lora_modules`; and
    each adapter's `LoRAAdapter.initialize_weights`."""
    from sglang.srt.lora.utils import auto_detect_lora_target_modules, get_normalized_target_modules

    out = []
    for call in calls:
        try:
            if call["fn"] == "loaded_weights":
                out.append(_loaded_weights(call))
            elif call["fn"] == "iterate":  # the loader's tensor order in one file, both safetensors iterators
                from sglang.srt.model_loader import weight_utils as wu

                files = [call["path"]]
                out.append([[n for n, _ in wu.safetensors_weights_iterator(files)],
                            [n for n, _ in wu.buffered_multi_thread_safetensors_weights_iterator(files, 2)]])  # fmt: skip
            elif call["fn"] == "normalized":
                out.append(sorted(get_normalized_target_modules(call["target_modules"])))
            else:
                model = stubs.sglang_tiny_model(AutoConfig.for_model(**call["base"]))
                if call.get("supported") is not None:
                    model.supported_lora_modules = call["supported"]
                out.append(sorted(auto_detect_lora_target_modules(model)))
        except Exception as exc:  # the engine's own exception is the answer
            out.append(_error(exc))
    return out


def main() -> None:
    payload = json.load(sys.stdin)
    torch.set_num_threads(1)
    results = {}
    for case in payload["cases"]:
        try:
            results[case["id"]] = run_case(case)
        except Exception as exc:  # a runner bug must show up as a disagreement, not a crash
            import traceback

            results[case["id"]] = {"runner_error": _error(exc), "trace": traceback.format_exc()[-3000:]}
    functions = run_functions(payload.get("functions", []))
    json.dump({"results": results, "functions": functions}, sys.stdout)


if __name__ == "__main__":
    main()
