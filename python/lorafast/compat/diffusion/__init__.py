"""SGLang's diffusion (multimodal_gen) LoRA loading rules, from safetensors headers.

Proven against SGLang 0.5.23's own `pipelines_core/lora/` code by tests/oracle/test_oracle_sglang_diffusion.py:

* `detect_lora_format`: `detect_lora_format_from_state_dict`, the key-pattern test that picks a converter;
* `normalize_peft_keys`: strip a uniform PEFT wrapper prefix and the adapter-slot name, with SGLang's errors;
* `load_peft_config`: `adapter_config.json` merged with the safetensors metadata (`lora_adapter_metadata`, and a
  global `lora_alpha`/`network_alpha`/`alpha`), with its conflict and validation errors;
* `normalize_lora_state_dict`: key normalization, format detection, the format's key conversion, then
  `apply_peft_config` (feature rejections, `alpha_pattern`, `use_rslora`) on the converted names;
* `load_lora_adapter`: the part of `LoRAPipeline.load_lora_adapter` that needs no model, in the engine's order;
* `check_set_lora`: `set_lora` up to the weights (argument errors in its order, loads, per-module merge
  decisions), built from `normalize_lora_params`, `check_targets`, `resolve_lora_merge_mode`, `should_merge_lora`
  and `check_adapters_per_target`.

Tensors come in data order (by data offset), the order safetensors' `load_file` returns them; only the values
of one-element `.alpha` tensors are read (and, for kohya Flux, the up weights whose split depends on their
values). Every entry point takes `engine_version=` ("0.5.23"); the rules are
those of 0.5.23, the only SGLang release proven so far.
"""

from __future__ import annotations

from lorafast.compat.diffusion._formats import (
    MSG_MIXED_SLOTS,
    MSG_MULTIPLE_SLOTS,
    MSG_MULTIPLE_SLOTS_SAME,
    LoRAFormat,
    detect_lora_format,
    normalize_peft_keys,
)
from lorafast.compat.diffusion._peft_config import (
    METADATA_KEY,
    MSG_AUXILIARY,
    MSG_CONFIG_NOT_OBJECT,
    MSG_DORA,
    MSG_LORA_ALPHA,
    MSG_UNSUPPORTED_FEATURES,
    SAFETENSORS_ALPHA_KEYS,
    UNSUPPORTED_CONFIG_FIELDS,
    LoadedAdapter,
    check_peft_config,
    get_peft_lora_alpha,
    load_lora_adapter,
    load_peft_config,
    normalize_lora_state_dict,
    validate_peft_features,
)
from lorafast.compat.diffusion._reading import Shape, Tensor, read_file, weight_file
from lorafast.compat.diffusion._set_lora import (
    AUTO_MERGE_MAX_ROUNDING_LOSS,
    LORA_MERGE_MODES,
    MSG_AUTO_FSDP,
    MSG_AUTO_QUANTIZED,
    MSG_CONFIG_MATCHES,
    MSG_DYNAMIC_ONE_ADAPTER,
    MSG_INVALID_MERGE_MODE,
    MSG_MERGE_FSDP,
    MSG_MISSING_MODULE,
    MSG_QUANTIZED_MERGE,
    MSG_STAYS_UNMERGED,
    PIPELINE_MODULES,
    VALID_TARGETS,
    SetLoraDecision,
    auto_merge_rounds_away,
    check_adapters_per_target,
    check_set_lora,
    check_targets,
    has_merge_rules,
    merge_log,
    merge_rounding_loss,
    normalize_lora_params,
    resolve_lora_merge_mode,
    should_merge_lora,
)

__all__ = [
    "AUTO_MERGE_MAX_ROUNDING_LOSS",
    "LORA_MERGE_MODES",
    "LoRAFormat",
    "LoadedAdapter",
    "METADATA_KEY",
    "MSG_AUTO_FSDP",
    "MSG_AUTO_QUANTIZED",
    "MSG_AUXILIARY",
    "MSG_CONFIG_MATCHES",
    "MSG_CONFIG_NOT_OBJECT",
    "MSG_DORA",
    "MSG_DYNAMIC_ONE_ADAPTER",
    "MSG_INVALID_MERGE_MODE",
    "MSG_LORA_ALPHA",
    "MSG_MERGE_FSDP",
    "MSG_MISSING_MODULE",
    "MSG_MIXED_SLOTS",
    "MSG_MULTIPLE_SLOTS",
    "MSG_MULTIPLE_SLOTS_SAME",
    "MSG_QUANTIZED_MERGE",
    "MSG_STAYS_UNMERGED",
    "MSG_UNSUPPORTED_FEATURES",
    "PIPELINE_MODULES",
    "SAFETENSORS_ALPHA_KEYS",
    "SetLoraDecision",
    "Shape",
    "Tensor",
    "UNSUPPORTED_CONFIG_FIELDS",
    "VALID_TARGETS",
    "auto_merge_rounds_away",
    "check_adapters_per_target",
    "check_peft_config",
    "check_set_lora",
    "check_targets",
    "detect_lora_format",
    "get_peft_lora_alpha",
    "has_merge_rules",
    "load_lora_adapter",
    "load_peft_config",
    "merge_log",
    "merge_rounding_loss",
    "normalize_lora_params",
    "normalize_lora_state_dict",
    "normalize_peft_keys",
    "read_file",
    "resolve_lora_merge_mode",
    "should_merge_lora",
    "validate_peft_features",
    "weight_file",
]
