"""What SGLang serves of each adapter: which trained modules its memory pool takes at first use, and at what scale.

Started by `engines.run("sglang_serving_runner", "sglang", version, payload)`; JSON on stdin, JSON on stdout. It
runs on `sglang_runner`'s stubs (tests/oracle/stubs.py, SGLang LLM section) and SGLang's own code: start-up
(`LoRAManager.init_state`: the loads, the target-module normalization, the memory pool, the wrapped modules),
dynamic `load_lora_adapter`, and first use (`fetch_new_loras` -> `load_lora_weight_to_buffer`).

To see which weights the pool takes, every tensor is filled, as SGLang's loader reads it
(`LoRAAdapter._process_weight`), with a value of its own (a prime above 1000), and every copy into a pool buffer
(`mem_pool.copy_weight_into_buffer`, the one function `load_lora_weight_to_buffer` copies with) is recorded with the
buffer it lands in. After SGLang's normalization (q/k/v and gate/up stacked, `w1/w3` renamed, zero-filled
missing parts) a buffer holds the values of exactly the adapter tensors it took. A trained module is applied when
its lora_A and lora_B both land in the buffers of its own module: the wrapped module of that layer and target
whose path is the trained module's (after SGLang's name normalization, and with a multimodal model's
`model.language_model.` read as the causal LM's `model.`). A module whose weights land nowhere, or in another
module's buffer (SGLang places weights by layer id and target name, not by path), is not applied.

The served scale is `LoRAAdapter.scaling` (`lora_alpha / r`), which the dense kernels multiply in (the batch
info's `scalings`), times the factor the pool copy applied (MoE lora_B copies are multiplied by it there, and the
MoE runner applies no scaling of its own): read from the copied values, not assumed.

Payload: {"cases": [{"id", "base": {hf config}, "adapters": [{"name", "path"}], "dynamic": [{"name", "path"}],
"max_lora_rank", "target_modules", "max_loras_per_batch"}]}
Result: {"results": {id: [per adapter: {"name", "error": [type, message], "stage"} | {"name", "scaling",
"modules": {peft module (or `<module>.lora_B.bias`): [applied, served scale]}}]}}
"""

from __future__ import annotations

import json
import re
import sys
import uuid

import sglang_runner  # installs the stubs
import torch
from sglang.srt.lora import mem_pool
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.lora.utils import get_normalized_target_modules, get_target_module_name
from transformers import AutoConfig


def _primes(n: int, start: int = 1009) -> list[int]:
    out, k = [], start
    while len(out) < n:
        if all(k % d for d in range(2, int(k**0.5) + 1)):
            out.append(k)
        k += 2
    return out


PRIMES = _primes(600)
FILLED: dict[str, dict[int, str]] = {}  # adapter path -> {fill value: tensor name}
_process_weight = LoRAAdapter._process_weight


def _filling_process_weight(self, name, loaded_weight):
    if loaded_weight.is_floating_point() and loaded_weight.dim() > 0:
        values = FILLED.setdefault(self.config.path, {})
        value = PRIMES[len(values)]
        values[value] = name
        loaded_weight = torch.full_like(loaded_weight, float(value))
    return _process_weight(self, name, loaded_weight)


LoRAAdapter._process_weight = _filling_process_weight
COPIES: list[tuple[torch.Tensor, torch.Tensor]] = []
_copy = mem_pool.copy_weight_into_buffer


def _recording_copy(buffer_view, weight):
    COPIES.append((buffer_view, weight.detach().clone()))
    return _copy(buffer_view, weight)


mem_pool.copy_weight_into_buffer = _recording_copy


def _buffers(pool) -> dict[int, tuple[str, int | None]]:
    """Storage address -> (target module, layer) of every pool buffer."""
    out: dict[int, tuple[str, int | None]] = {}
    for buffers in (pool.A_buffer, pool.B_buffer):
        for name, layers in buffers.items():
            for layer_id, t in enumerate(layers):
                out[t.untyped_storage().data_ptr()] = (name, layer_id)
    for buffers in (pool.embedding_A_buffer, pool.embedding_B_buffer, pool.lm_head_A_buffer, pool.lm_head_B_buffer):
        for name, t in buffers.items():
            out[t.untyped_storage().data_ptr()] = (name, None)
    return out


def _canonical(path: str) -> str:
    path = path.removeprefix("base_model.model.")
    for prefix in ("model.language_model.", "language_model.model."):
        if path.startswith(prefix):
            return "model." + path.removeprefix(prefix)
    return path


def _module_of(tensor: str) -> str:
    """The trained module a tensor belongs to (PEFT's name, without `base_model.model.`)."""
    if tensor.endswith(".lora_B.bias"):  # lora_bias: a trained part of its own
        return tensor.removeprefix("base_model.model.")
    name = re.sub(r"\.(lora_(A|B)\.weight|lora_embedding_(A|B)|lora_magnitude_vector|weight|bias)$", "", tensor)
    return name.removeprefix("base_model.model.")


def _home(module: str) -> str:
    """The trained module's runtime module in SGLang's naming: the stacked module of its leaf, or the experts."""
    if re.search(r"\.experts\.\d+\.", module):
        return _canonical(module.split(".experts.")[0] + ".experts")
    parent, _, leaf = module.rpartition(".")
    leaf = sorted(get_normalized_target_modules([leaf]))[0]
    return _canonical(f"{parent}.{leaf}" if parent else leaf)


def _wrapped(mgr, target: str, layer_id: int | None) -> str | None:
    """The module that reads the buffer of (target, layer)."""
    if layer_id is None:  # embed_tokens / lm_head: the wrapper `update_lora_info` hands that buffer to
        wrapper = getattr(mgr, {"embed_tokens": "embed_tokens_module", "lm_head": "lm_head_module"}[target], None)
        return next((n for n, m in mgr.base_model.named_modules() if wrapper is not None and m is wrapper), None)
    moe = target.endswith("_moe")
    for name, module in mgr.lora_modules[layer_id].items():
        if moe and type(module).__name__ == "FusedMoEWithLoRA":
            return name
        if not moe and get_target_module_name(name, mgr.target_modules) == target:
            return name
    return None


def _first_use(mgr, uid: str, path: str) -> dict:
    COPIES.clear()
    try:
        mgr.fetch_new_loras({uid})
    except Exception as exc:  # the engine's own exception is the answer
        return {"error": sglang_runner._error(exc), "stage": "first_use"}
    adapter = mgr.loras[uid]
    scaling = float(adapter.scaling)
    filled = FILLED.get(path, {})
    where = _buffers(mgr.memory_pool)
    landed: dict[str, list[tuple[str, int | None, float]]] = {}  # tensor name -> [(target, layer, factor)]
    for view, weight in COPIES:
        target, layer_id = where[view.untyped_storage().data_ptr()]
        for v in {float(x) for x in torch.unique(weight)} - {0.0}:
            found = [(p, f) for p in filled for f in (1.0, scaling) if abs(v - p * f) <= 1e-3 * p]
            if len(found) != 1:
                raise RuntimeError(f"value {v} in {target} matches {found}")
            ((p, f),) = found
            landed.setdefault(filled[p], []).append((target, layer_id, f))
    modules: dict[str, list] = {}
    for tensor in sorted(filled.values()):
        module = _module_of(tensor)
        home = _home(module.removesuffix(".lora_B.bias"))
        at_home = [(t, f) for t, layer_id, f in landed.get(tensor, ())
                   if _canonical(_wrapped(mgr, t, layer_id) or "") == home]  # fmt: skip
        entry = modules.setdefault(module, [True, None])
        entry[0] = entry[0] and bool(at_home)
        if "lora_B.weight" in tensor or "embedding_B" in tensor:
            factors = {f * (1.0 if t.endswith("_moe") else scaling) for t, f in at_home}
            entry[1] = factors.pop() if len(factors) == 1 else None
    return {"scaling": scaling, "modules": {m: [a, s if a else None] for m, (a, s) in modules.items()}}


def run_case(case: dict) -> list[dict]:
    model = sglang_runner.stubs.sglang_tiny_model(AutoConfig.for_model(**case["base"]))
    mgr, startup = sglang_runner._startup(case, model)
    names = [a["name"] for a in case["adapters"]] + [a["name"] for a in case.get("dynamic", ())]
    if mgr is None:
        return [{"name": n, "error": startup["error"], "stage": "startup"} for n in names]
    out = []
    for a, uid in zip(case["adapters"], startup["ids"], strict=True):
        out.append({"name": a["name"], **_first_use(mgr, uid, a["path"])})
    for a in case.get("dynamic", ()):
        uid = LoRARef.deterministic_id(a["name"], a["path"])
        ref = LoRARef(lora_name=a["name"], lora_path=a["path"], pinned=False,
                      lora_id=uid if uid not in mgr.loras else uuid.uuid4().hex)  # fmt: skip
        result = mgr.load_lora_adapter(ref)
        if not result.success:
            out.append({"name": a["name"], "error": ["", result.error_message], "stage": "load"})
            continue
        out.append({"name": a["name"], **_first_use(mgr, ref.lora_id, a["path"])})
    return out


def main() -> None:
    payload = json.load(sys.stdin)
    torch.set_num_threads(1)
    results = {}
    for case in payload["cases"]:  # a runner bug raises: it must not pass for an engine answer
        FILLED.clear()
        results[case["id"]] = run_case(case)
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    main()
