"""What vLLM serves of each adapter: which trained modules its LoRA manager applies, and at what scale.

Started by `engines.run("vllm_serving_runner", "vllm", version, payload)`; JSON on stdin, JSON on stdout. It runs
on `vllm_runner`'s stubs (tests/oracle/stubs.py, vLLM section) and adds none. Per case, vLLM's own code decides:

1. the load: `WorkerLoRAManager._load_adapter` (`vllm_runner.load`'s setup), which raises or returns the
   `LoRAModel` (per-module rank and scaling from `PEFTHelper.get_rank_and_scaling` / `vllm_lora_scaling_factor`);
2. which of the model's LoRA-capable modules are wrapped: the filter of `LoRAModelManager._create_lora_modules`,
   run on the model's module names: with `--lora-target-modules`, the manager's `_match_target_modules`
   (`vllm.lora.utils.is_in_target_modules` with the model's packed mapping), else the module's leaf in the model's
   supported LoRA modules; then `_get_punica_wrapper` (a multimodal model's tower and connector get none unless
   tower/connector LoRA is enabled, so they are not wrapped), and `_register_packed_modules`;
3. the adapter's registration, `_create_merged_loras_inplace` (packing q/k/v and gate/up and the experts, the text
   fallback of a multimodal model, folding each scaling into `lora_b`), and activation's lookup
   `_get_lora_layer_weights` for every wrapped module, as `activate_adapter` calls it; for a MoE layer, what
   activation hands it goes through the guard of the wheel's `FusedMoEWithLoRA.set_lora` (compiled from
   lora/layers/fused_moe.py by `stubs.compile_members`, run up to its first buffer write): a fused 3-D adapter
   under the 2-D wrapper, which 0.30 has no load check for, fails there on the request that activates it
   (stage `first_use`).

The served scale of a module is measured, not read: its `lora_b` as activation would hand it to `set_lora`
(times any scaling still pending) over the `lora_b` the file holds. The module tree, the packed mapping and the
multimodal mapping are the model's (`serving_cases.VLLM_MODELS`); the manager methods are the wheel's own,
unbound from `LoRAModelManager` onto a plain object that carries the attributes `__init__` would set.

Payload: {"cases": [{"id", "path", "lora_name", "lora_int_id", "max_lora_rank", "setup": vllm_runner setup,
"serve": {"modules": [wrappable module names], "moe_modules": [...], "target_modules": [...] | null,
"mm": {"language_model", "connector", "tower_model"} | null}}]}
Result: {"results": {id: {"error": [type, message], "stage": "load"} | {"ok": {"modules": {peft module:
[applied, scale]}, "wrapped": [...]}}}}
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import traceback
import types

import stubs
import torch
import vllm_runner  # installs the stubs; its stdout is already stderr
from safetensors import safe_open
from vllm.lora import model_manager
from vllm.lora import utils as lora_utils
from vllm.lora.layers import FusedMoEWithLoRA
from vllm.lora.model_manager import LoRAModelManager
from vllm.model_executor.models.module_mapping import MultiModelKeys

DEFAULT_LANGUAGE_WRAPPER_KEY = getattr(model_manager, "DEFAULT_LANGUAGE_WRAPPER_KEY", "language_model")
METHODS = (
    "_match_target_modules", "_get_punica_wrapper", "_register_packed_modules", "_create_merged_loras_inplace",
    "_get_lora_layer_weights", "_pop_lora_weights", "_get_text_lora_name", "_get_text_lora_names",
    "_restrict_to_local_experts", "_stack_moe_lora_weights", "_slice_moe_lora_ep", "_convert_3d_to_2d_moe_lora",
    "_pad_lora_pairs_to_triplets",
)  # fmt: skip
Shell = type(
    "LoRAModelManagerShell", (), {n: LoRAModelManager.__dict__[n] for n in METHODS if n in LoRAModelManager.__dict__}
)


class _Reached(Exception):
    """`set_lora` got past its argument checks to its first buffer write (`reset_lora`)."""


def _moe_set_lora() -> type:
    """`FusedMoEWithLoRA.set_lora`, compiled unmodified from the wheel's source (the module imports kernels)."""
    lora_dir = importlib.util.find_spec("vllm.lora").submodule_search_locations[0]
    path = os.path.join(lora_dir, "layers", "fused_moe.py")
    return stubs.compile_members(path, "FusedMoEWithLoRA", ["set_lora"], {"torch": torch}, "MoESetLora")


MoESetLora = _moe_set_lora()


def activate_moe(weights) -> None:
    """What `activate_adapter` does with a MoE layer's weights: `module.set_lora(index, lora_a, lora_b)`, up to the
    first write into the layer's buffers (not modelled: the runner measures the packed weights instead)."""
    shell = MoESetLora.__new__(MoESetLora)

    def reached(index):
        raise _Reached

    shell.reset_lora = reached
    try:
        shell.set_lora(0, weights.lora_a, weights.lora_b)
    except _Reached:
        pass


def manager(case: dict) -> object:
    setup, serve = case["setup"], case["serve"]
    mgr = Shell()
    mgr.lora_config = types.SimpleNamespace(target_modules=serve["target_modules"], max_lora_rank=case["max_lora_rank"])
    mgr.supported_lora_modules = list(setup["supported"])
    mgr.packed_modules_mapping = {k: list(v) for k, v in setup["packed"].items()}
    mgr.packed_modules = {}
    mgr.modules = {}
    mgr.is_pooling_model = bool(setup.get("is_pooling_model"))
    mgr.supported_modules_to_save = set()
    mgr._enable_moe_shared_loras = False
    mgr._is_non_gated_moe = False
    mgr._enable_mixed_moe_lora_format = False
    mgr._is_3d_moe_model = False
    mm = serve.get("mm")
    mgr.supports_mm = mm is not None
    if mm is not None:  # `_maybe_init_mm` without tower/connector LoRA: one wrapper, the language model's
        mgr.mm_mapping = MultiModelKeys.from_string_field(**mm)
        mgr.punica_wrapper_mapping = {mgr.mm_mapping.language_model[0]: object()}
    else:
        mgr.punica_wrapper_mapping = {DEFAULT_LANGUAGE_WRAPPER_KEY: object()}
    return mgr


def wrap(mgr, serve: dict) -> list[str]:
    """`_create_lora_modules`' decision for each module of the model (every one of them a LoRA-capable layer)."""
    moe = set(serve.get("moe_modules", ()))
    wrapped = []
    for name in serve["modules"]:
        if mgr.lora_config.target_modules is None:
            if name.rsplit(".", 1)[-1] not in mgr.supported_lora_modules:  # is_supported_lora_module
                continue
        elif not mgr._match_target_modules(name):
            continue
        if mgr._get_punica_wrapper(name) is None:
            continue
        module = FusedMoEWithLoRA() if name in moe else types.SimpleNamespace()
        if name in moe:
            module.use_ep = False
        mgr.modules[name] = module
        if len(inspect.signature(mgr._register_packed_modules).parameters) == 2:  # 0.34 takes the module too
            mgr._register_packed_modules(name, module)
        else:
            mgr._register_packed_modules(name)
        wrapped.append(name)
    return wrapped


def ratio(served: torch.Tensor, trained: torch.Tensor) -> float | None:
    served, trained = served.double().flatten(), trained.double().flatten()
    keep = trained.abs() > 1e-6
    if served.shape != trained.shape or not keep.any():
        return None
    r = served[keep] / trained[keep]
    med = float(r.median())
    return med if float((r - med).abs().max()) <= 1e-4 * max(1.0, abs(med)) else None


def serve(case: dict) -> dict:
    try:
        lora = _load(case)
    except Exception as exc:  # the engine's own exception is the answer
        return _error(exc, "load")
    mgr = manager(case)
    wrapped = wrap(mgr, case["serve"])
    key_of = {id(w): k for k, w in lora.loras.items()}
    trained_b = {k: w.lora_b.clone() for k, w in lora.loras.items() if w.lora_b is not None}
    # Which LoRAModel entry each wrapped module (or each slice of a packed one) takes, before packing.
    slices: dict[str, list[str | None]] = {}
    for name in wrapped:
        subs = mgr.packed_modules.get(name, [name])
        slices[name] = [key_of.get(id(mgr._get_lora_layer_weights(lora, s))) for s in subs]
    try:
        mgr._create_merged_loras_inplace(lora)  # `_add_adapter`, when the adapter is registered
    except Exception as exc:
        return _error(exc, "load")
    applied: dict[str, float | None] = {}
    moe_modules = set(case["serve"].get("moe_modules", ()))
    for name in wrapped:
        weights = mgr._get_lora_layer_weights(lora, name)  # what activate_adapter hands to set_lora
        if not weights:
            continue
        if name in moe_modules:
            try:
                activate_moe(weights)
            except Exception as exc:  # the first request that activates the adapter
                return _error(exc, "first_use")
        keys = slices[name]
        if not isinstance(weights.lora_b, list):
            if keys[0] is not None:
                applied[keys[0]] = ratio(weights.lora_b * weights.scaling, trained_b[keys[0]])
            continue
        moe = name.endswith(".experts") and len(keys) != len(weights.lora_b)
        for j, key in enumerate(keys):
            if key is None:
                continue
            part = j % len(weights.lora_b) if moe else j
            b = weights.lora_b[part]
            if b is None:
                continue
            if moe:  # pack_moe: per projection, one stacked [experts, out, r] tensor, expert-major sub-modules
                b = b[j // len(weights.lora_b)]
            applied[key] = ratio(b * weights.scaling[part], trained_b[key])
    # The adapter's own names (PEFT's, before the weights mapper) for each LoRAModel entry.
    mapper = case["setup"].get("mapper")
    rename = vllm_runner.mapper(mapper)
    rename = None if rename is None else rename.get_rename_mapper()
    peft_name: dict[str, str] = {}
    for tensor in _tensor_names(case["path"]):
        if "lora_" not in tensor:
            continue
        key = lora_utils.parse_fine_tuned_lora_name(tensor, rename)[0]
        peft_name.setdefault(key, lora_utils.parse_fine_tuned_lora_name(tensor)[0])
    modules = {peft_name.get(k, k): [k in applied, applied.get(k)] for k in trained_b}
    return {"ok": {"modules": modules, "wrapped": wrapped}}


def _error(exc: BaseException, stage: str) -> dict:
    if os.environ.get("LORAFAST_ORACLE_TRACE"):
        traceback.print_exc()
    return {"error": [type(exc).__name__, str(exc)], "stage": stage}


def _load(case: dict):
    """`vllm_runner.load` returns a summary; this is the same call, returning the `LoRAModel`."""
    setup = case["setup"]
    worker = types.SimpleNamespace(
        _adapter_manager=vllm_runner.Manager(setup),
        max_position_embeddings=setup["max_position_embeddings"],
        vocab_size=setup["vocab_size"],
        lora_config=types.SimpleNamespace(max_lora_rank=case["max_lora_rank"], lora_dtype=None),  # stub 2
        _lora_model_cls=vllm_runner.LoRAModel,
    )
    request = types.SimpleNamespace(  # stub 3
        lora_name=case["lora_name"], lora_int_id=case["lora_int_id"], lora_path=case["path"],
        is_3d_lora_weight=False, tensorizer_config_dict=None,
    )  # fmt: skip
    return vllm_runner.WorkerLoRAManager._load_adapter(worker, request)


def _tensor_names(path: str) -> list[str]:
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        return []
    with safe_open(file, "pt") as f:
        return list(f.keys())


def main() -> None:
    payload = json.load(sys.stdin)
    torch.set_num_threads(1)
    results = {}
    for case in payload["cases"]:  # a runner bug raises here: it must not pass for an engine answer
        results[case["id"]] = serve(case)
    json.dump({"results": results}, vllm_runner.RESULT_STREAM)


if __name__ == "__main__":
    main()
