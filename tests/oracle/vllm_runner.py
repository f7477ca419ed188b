"""Runs vLLM's own LoRA loading code (from an unpacked wheel) on oracle cases; JSON on stdin, JSON on stdout.

Started by `engines.run("vllm_runner", "vllm", version, payload)` with the wheel's sources first on sys.path.
The stubs are those of `stubs.install_vllm` (see stubs.py for each, with why). Per case it records what vLLM
returns (a summary of the `LoRAModel`) or raises (exception type name and exact message).

Payload: {"cases": [case, ...]}; a case is one of
  {"op": "parse", "name": tensor name, "mapper": mapper spec or null}: `parse_fine_tuned_lora_name`;
  {"op": "load", "path", "lora_name", "lora_int_id", "max_lora_rank", "setup": {...}}:
  `WorkerLoRAManager._load_adapter` (PEFTHelper.from_local_dir, validate_legal, LoRAModel.from_local_checkpoint
  and, from 0.33, the manager's MoE-format and classification-head checks);
  {"op": "peft_helper", "path"}: `PEFTHelper.from_local_dir(path, None)`, the helper's fields (`asdict`);
  {"op": "unexpected", "path", "setup"}: `LoRAModel.from_local_checkpoint` on that helper, with `_load_adapter`'s
  expected modules, rename mapper and (0.34) unsupported modules, up to its name check and file read (stub 5).
A mapper spec is {"prefix"|"substr"|"suffix": {old: new}}, built into vLLM's `WeightsMapper`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import traceback
import types

import stubs

# vLLM's own switch for a machine without a GPU: the CPU platform (no pinned memory, no CUDA probing).
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
# vLLM logs to stdout; the JSON answer owns stdout, so everything else goes to stderr.
RESULT_STREAM = sys.stdout
sys.stdout = sys.stderr
stubs.install_vllm()

import torch  # noqa: E402
from vllm.lora import utils as lora_utils  # noqa: E402
from vllm.lora.layers import ClassificationHeadWithLoRA, FusedMoEWithLoRA  # noqa: E402  (inert, stub 1)
from vllm.lora.lora_model import LoRAModel  # noqa: E402
from vllm.lora.model_manager import LoRAModelManager  # noqa: E402
from vllm.lora.peft_helper import PEFTHelper  # noqa: E402
from vllm.lora.worker_manager import WorkerLoRAManager  # noqa: E402
from vllm.model_executor.models.utils import WeightsMapper  # noqa: E402


def mapper(spec: dict | None) -> WeightsMapper | None:
    if spec is None:
        return None
    return WeightsMapper(
        orig_to_new_prefix=spec.get("prefix", {}),
        orig_to_new_substr=spec.get("substr", {}),
        orig_to_new_suffix=spec.get("suffix", {}),
    )


def shape(tensor: object) -> list[int] | None:
    return None if tensor is None else list(tensor.shape)  # type: ignore[attr-defined]


def summary(lora: object) -> dict:
    loras = [
        [name, w.rank, w.scaling, shape(w.lora_a), shape(w.lora_b)]
        for name, w in sorted(lora.loras.items())  # type: ignore[attr-defined]
    ]
    saved = {
        name: [shape(m.weight), shape(m.bias)]
        for name, m in sorted(getattr(lora, "modules_to_save", {}).items())  # 0.33 on
    }
    return {"rank": lora.rank, "loras": loras, "modules_to_save": saved}  # type: ignore[attr-defined]


class Manager:
    """The adapter manager's state (stub 4); its validation methods are vLLM's own."""

    _validate_moe_lora_format = getattr(LoRAModelManager, "_validate_moe_lora_format", None)
    _validate_classification_head_lora = getattr(LoRAModelManager, "_validate_classification_head_lora", None)
    _get_lora_layer_weights = getattr(LoRAModelManager, "_get_lora_layer_weights", None)
    _get_text_lora_name = getattr(LoRAModelManager, "_get_text_lora_name", None)
    _get_text_lora_names = getattr(LoRAModelManager, "_get_text_lora_names", None)
    _get_module_to_save_weights = getattr(LoRAModelManager, "_get_module_to_save_weights", None)

    def __init__(self, setup: dict) -> None:
        self.supported_lora_modules = list(setup["supported"])
        self.packed_modules_mapping = {k: list(v) for k, v in setup["packed"].items()}
        self.model = types.SimpleNamespace(hf_to_vllm_mapper=mapper(setup.get("mapper")), lora_skip_prefixes=None)
        self.moe_ep_load_spec = None
        self.modules = {name: FusedMoEWithLoRA() for name in setup.get("moe_modules", [])}
        self._enable_mixed_moe_lora_format = False
        self.is_pooling_model = bool(setup.get("is_pooling_model"))
        self.unsupported_lora_modules = set(setup.get("unsupported", []))  # 0.34 on
        self.supports_mm = False
        head = setup.get("classification_head")
        self._classification_head = None
        self._pooling_task = None
        if head is not None:
            wrapper = ClassificationHeadWithLoRA()
            wrapper.max_lora_cls_labels = head["max_labels"]
            wrapper.input_size = head["input_size"]
            self._classification_head = (head["name"], wrapper)
            self._pooling_task = head.get("pooling_task", "classify")


def load(case: dict) -> dict:
    setup = case["setup"]
    worker = types.SimpleNamespace(
        _adapter_manager=Manager(setup),
        max_position_embeddings=setup["max_position_embeddings"],
        vocab_size=setup["vocab_size"],
        lora_config=types.SimpleNamespace(max_lora_rank=case["max_lora_rank"], lora_dtype=None),  # stub 2
        _lora_model_cls=LoRAModel,
    )
    request = types.SimpleNamespace(  # stub 3
        lora_name=case["lora_name"], lora_int_id=case["lora_int_id"], lora_path=case["path"],
        is_3d_lora_weight=False, tensorizer_config_dict=None,
    )  # fmt: skip
    lora = WorkerLoRAManager._load_adapter(worker, request)  # type: ignore[arg-type]
    return summary(lora)


def expected_modules(manager: Manager) -> set[str]:
    """`_load_adapter`'s expected modules (0.30-0.34 build them with this same loop, inline)."""
    expected: list[str] = []
    for module in manager.supported_lora_modules:
        expected.extend(manager.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.append(module)
    return set(expected)


def unexpected(case: dict) -> None:
    manager = Manager(case["setup"])
    helper = PEFTHelper.from_local_dir(case["path"], None)
    rename = manager.model.hf_to_vllm_mapper
    extra = {}
    if "unsupported_lora_modules" in inspect.signature(LoRAModel.from_local_checkpoint).parameters:
        extra["unsupported_lora_modules"] = manager.unsupported_lora_modules
    real = LoRAModel.__dict__["from_lora_tensors"]
    LoRAModel.from_lora_tensors = classmethod(lambda cls, **kwargs: None)  # stub 5: stop after the name check
    try:
        LoRAModel.from_local_checkpoint(
            case["path"], expected_modules(manager), helper, lora_model_id=1, device="cpu",
            weights_mapper=None if rename is None else rename.get_rename_mapper(), **extra,
        )  # fmt: skip
    finally:
        LoRAModel.from_lora_tensors = real


def run_case(case: dict) -> dict:
    try:
        if case["op"] == "parse":
            name, is_a = lora_utils.parse_fine_tuned_lora_name(case["name"], mapper(case.get("mapper")))
            return {"ok": [name, is_a]}
        if case["op"] == "peft_helper":
            return {"ok": dataclasses.asdict(PEFTHelper.from_local_dir(case["path"], None))}
        if case["op"] == "unexpected":
            return {"ok": unexpected(case)}
        return {"ok": load(case)}
    except Exception as exc:  # every outcome is recorded, whatever vLLM raises
        if os.environ.get("LORAFAST_ORACLE_TRACE"):
            traceback.print_exc()
        return {"error": [type(exc).__name__, str(exc)]}


def main() -> None:
    payload = json.load(sys.stdin)
    torch.set_num_threads(1)
    json.dump({"results": [run_case(case) for case in payload["cases"]]}, RESULT_STREAM)


if __name__ == "__main__":
    main()
