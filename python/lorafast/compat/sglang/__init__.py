"""SGLang's LoRA checks, answered from safetensors headers (drop-in for `sglang.srt.lora`).

Every function takes scanned `lorafast.Adapter`s or paths (or a mapping `{adapter_id: adapter}`, a
`ScanReport`, `LoraRef`s, `AdapterView`s; see `resolve_adapters`) and returns what SGLang returns, or
raises the exception SGLang raises with the same type and byte-identical message. No tensor is loaded:
the names and shapes SGLang would hold after its weight normalization are predicted from the header.

`preflight` runs the whole start-up sequence of an SGLang server at once (`--lora-paths` parsing, every
adapter's load checks, target-module and rank inference, shared-outer detection, memory-pool shapes)
plus the checks SGLang only makes when an adapter first enters a GPU slot.

Rules and texts are SGLang 0.5.23's, checked against its released code by tests/oracle/test_oracle_sglang.py.
"""

from __future__ import annotations

from lorafast.compat._common import CompatProblem, LoraRef, lora_id
from lorafast.compat._inputs import AdapterView, resolve_adapters
from lorafast.compat.sglang._buffers import BufferPlan, plan_buffers
from lorafast.compat.sglang._config import predict_loaded_weights
from lorafast.compat.sglang._detect import detect_shared_outer_loras, shared_outer_verdicts
from lorafast.compat.sglang._first_use import check_expert_layout, check_skipped_weights
from lorafast.compat.sglang._names import (
    DSA_INDEXER_LORA_NAMES,
    EMBEDDING_NAMES,
    KNOWN_LORA_TARGET_MODULES,
    MSG_MIXED_SHARED_OUTER,
    PARAMS_MAPPING,
    STACKED_MULTIPLY,
    SUPPORTED_LORA_TARGET_MODULES,
    auto_detect_lora_target_modules,
    get_normalized_target_modules,
    get_stacked_multiply,
    get_target_module_name,
)
from lorafast.compat.sglang._paths import parse_lora_paths
from lorafast.compat.sglang._preflight import SGLangPlan, preflight
from lorafast.compat.sglang._targets import init_lora_shapes, predict_base_model_modules
from lorafast.compat.sglang._validate import MemoryPool, can_support, validate_new_adapter

__all__ = [
    "DSA_INDEXER_LORA_NAMES",
    "EMBEDDING_NAMES",
    "KNOWN_LORA_TARGET_MODULES",
    "MSG_MIXED_SHARED_OUTER",
    "PARAMS_MAPPING",
    "STACKED_MULTIPLY",
    "SUPPORTED_LORA_TARGET_MODULES",
    "AdapterView",
    "BufferPlan",
    "CompatProblem",
    "LoraRef",
    "MemoryPool",
    "SGLangPlan",
    "auto_detect_lora_target_modules",
    "can_support",
    "check_expert_layout",
    "check_skipped_weights",
    "detect_shared_outer_loras",
    "get_normalized_target_modules",
    "get_stacked_multiply",
    "get_target_module_name",
    "init_lora_shapes",
    "lora_id",
    "parse_lora_paths",
    "plan_buffers",
    "predict_base_model_modules",
    "predict_loaded_weights",
    "preflight",
    "resolve_adapters",
    "shared_outer_verdicts",
    "validate_new_adapter",
]
