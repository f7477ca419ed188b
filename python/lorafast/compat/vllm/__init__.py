"""vLLM's LoRA adapter checks, answered from safetensors headers, version by version (vLLM 0.30.0, 0.33.0, 0.34.0).

The rules follow vLLM's released code (`vllm/lora/peft_helper.py`, `lora_model.py`, `utils.py`,
`worker_manager.py`, `model_manager.py`), and the oracle tests (`tests/oracle/test_oracle_vllm.py`) run that code on
the same adapters. Every entry point takes `engine_version=` (default: the installed vLLM, else the newest
supported).

* `load_adapter`: `WorkerLoRAManager._load_adapter` as a whole: config, `validate_legal`, weight-file choice,
  the expected-module check, tensor names, and (0.33) the MoE-format and classification-head checks. It
  returns what vLLM builds (ranks, scalings, shapes) or raises what vLLM raises (same type name, same text);
* `peft_helper` (`PEFTHelper.from_local_dir`/`from_dict`), `validate_legal`, `parse_fine_tuned_lora_name`,
  `expected_lora_modules`, `check_unexpected_modules`: the single steps;
* `preflight`: `load_adapter`'s code on every adapter of a set, problems collected per adapter;
  `VLLM_MAX_LORA_RANKS`, `smallest_max_lora_rank`.

Messages that print a Python set (the expected modules, the missing config fields) are built from the same
strings in the same order as vLLM builds them, so the text equals vLLM's in the same interpreter.
"""

from __future__ import annotations

from lorafast.compat.vllm._load import ClassificationHead, LoRAAdapterNotFoundError, load_adapter
from lorafast.compat.vllm._lora_model import LoraWeights, UnknownPatternError, VLLMLoRA, check_unexpected_modules
from lorafast.compat.vllm._names import (
    DEFAULT_PACKED_MODULES_MAPPING,
    WeightsMapper,
    expected_lora_modules,
    is_in_target_modules,
    parse_fine_tuned_lora_name,
)
from lorafast.compat.vllm._peft_helper import PEFTHelper, check_peft_helper, peft_helper, validate_legal
from lorafast.compat.vllm._preflight import VLLM_MAX_LORA_RANKS, VLLMPlan, preflight, smallest_max_lora_rank

__all__ = [
    "DEFAULT_PACKED_MODULES_MAPPING",
    "ClassificationHead",
    "PEFTHelper",
    "VLLM_MAX_LORA_RANKS",
    "LoRAAdapterNotFoundError",
    "UnknownPatternError",
    "LoraWeights",
    "VLLMLoRA",
    "VLLMPlan",
    "WeightsMapper",
    "check_peft_helper",
    "check_unexpected_modules",
    "expected_lora_modules",
    "is_in_target_modules",
    "load_adapter",
    "parse_fine_tuned_lora_name",
    "peft_helper",
    "preflight",
    "smallest_max_lora_rank",
    "validate_legal",
]
