"""SGLang's diffusion (multimodal_gen) LoRA checks, from safetensors headers (sglang-lora.md §12.2, §12.6).

* `detect_lora_format`: `detect_lora_format_from_state_dict`, the key-pattern test that picks a converter;
* `normalize_peft_keys`: strip a uniform PEFT wrapper prefix and the adapter-slot name, with SGLang's errors;
* `validate_peft_features`: the rejections of `apply_peft_config` (unsupported PEFT features, DoRA,
  auxiliary tensors), plus `check_peft_config` for the rest of what it checks without tensor data;
* `resolve_lora_merge_mode`: how `set_lora` picks "merge" or "dynamic".

Reference: SGLang `lora/format_adapter.py` @32dbab0b, `lora/peft_adapter.py` @0d7e47be, `lora/pipeline.py`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

from lorafast.compat._inputs import AdapterView, resolve_adapters

Shape = tuple[int, ...]

_ADAPTER_SLOT = re.compile(r"(\.lora_[AB])\.([^.]+)\.weight$")
_WRAPPER_PREFIXES = ("peft_model.base_model.model.", "base_model.model.")
UNSUPPORTED_CONFIG_FIELDS = (
    "alora_invocation_tokens",
    "layer_replication",
    "modules_to_save",
    "target_parameters",
    "trainable_token_indices",
    "use_bdlora",
    "use_qalora",
)
LORA_MERGE_MODES = ("auto", "merge", "dynamic")

MSG_MULTIPLE_SLOTS_SAME = "LoRA checkpoint contains multiple PEFT adapter slots for the same tensor: {target!r}"
MSG_MULTIPLE_SLOTS = "LoRA checkpoint contains multiple PEFT adapter slots: {slots}"
MSG_MIXED_SLOTS = "LoRA checkpoint mixes named and unnamed PEFT adapter slots"
MSG_UNSUPPORTED_FEATURES = "PEFT adapter requires unsupported auxiliary/runtime features: {features}"
MSG_DORA = "DoRA adapters are not supported by the native diffusion LoRA layers"
MSG_AUXILIARY = "PEFT adapter contains unsupported auxiliary tensors: {names}"
MSG_INVALID_MERGE_MODE = "Invalid LoRA merge mode: {mode}. Valid modes: {modes}"
MSG_DYNAMIC_ONE_ADAPTER = (
    "Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple adapters."
)


class LoRAFormat(str, Enum):
    """The key formats SGLang's diffusion LoRA loader tells apart (values as SGLang spells them)."""

    STANDARD = "standard"
    NON_DIFFUSERS_SD = "non-diffusers-sd"
    QWEN_IMAGE_STANDARD = "qwen-image-standard"
    XLABS_FLUX = "xlabs-ai"
    KOHYA_FLUX = "kohya-flux"
    WAN = "wan"
    AI_TOOLKIT_FLUX = "ai-toolkit-flux"


def _state_dict(adapter: Any) -> dict[str, Any]:
    """`{tensor name: shape or tensor}` for an adapter, a path, a view or an in-memory state dict."""
    if isinstance(adapter, Mapping) and not hasattr(adapter, "modules"):
        return dict(adapter)
    if isinstance(adapter, AdapterView):
        return dict(adapter.tensors)
    (view,) = resolve_adapters([adapter])
    return dict(view.tensors)


def _config(adapter: Any, config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if config is not None:
        return config
    if isinstance(adapter, AdapterView):
        return adapter.config or {}
    if isinstance(adapter, Mapping) and not hasattr(adapter, "modules"):
        return {}
    (view,) = resolve_adapters([adapter])
    return view.config or {}


# --- format detection -------------------------------------------------------------------------------------


def _is_xlabs_key(key: str) -> bool:
    if not key.endswith((".down.weight", ".up.weight")):
        return False
    roots = ("double_blocks.", "single_blocks.", "diffusion_model.double_blocks", "diffusion_model.single_blocks")
    return key.startswith(roots) and (".processor." in key or ".proj_lora" in key or ".qkv_lora" in key)


def _is_wan_key(key: str) -> bool:
    return (
        key.startswith("diffusion_model.blocks.")
        and (".lora_down" in key or ".lora_up" in key)
        and any(part in key for part in (".cross_attn.", ".self_attn.", ".ffn.", ".norm3."))
    )


def detect_lora_format(adapter: Any) -> LoRAFormat:
    """`detect_lora_format_from_state_dict`: the first matching key pattern decides (§12.6 step 2).

    1. ai-toolkit Flux: a key starting `double_blocks.`/`single_blocks.` (optionally under `base_model.model.`)
       and any `.lora_A`/`.lora_B` key; 2. any `.lora_A`/`.lora_B`: standard; 3. XLabs Flux; 4. kohya Flux
       (`lora_unet_double_blocks_`/`lora_unet_single_blocks_`); 5. Wan; 6. Qwen-Image `.lora.down/up`: standard;
       7. every key a kohya SD prefix; 8. any `.lora.down`/`.lora_up`: non-diffusers SD; 9. standard.
    Takes an Adapter, a path, an AdapterView, or a state dict / `{name: shape}` mapping. Keys are used as they
    are in the file; SGLang's pipeline runs `normalize_peft_keys` first (see there).
    """
    keys = list(_state_dict(adapter))
    if not keys:
        return LoRAFormat.STANDARD
    has_ab = any(".lora_A" in k or ".lora_B" in k for k in keys)
    flux_roots = ("double_blocks.", "base_model.model.double_blocks.", "single_blocks.",
                  "base_model.model.single_blocks.")  # fmt: skip
    if has_ab and any(k.startswith(flux_roots) for k in keys):
        return LoRAFormat.AI_TOOLKIT_FLUX
    if has_ab:
        return LoRAFormat.STANDARD
    if any(_is_xlabs_key(k) for k in keys):
        return LoRAFormat.XLABS_FLUX
    if any(k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for k in keys):
        return LoRAFormat.KOHYA_FLUX
    if any(_is_wan_key(k) for k in keys):
        return LoRAFormat.WAN
    if any(k.startswith("transformer.transformer_blocks.") for k in keys) and any(
        ".lora.down.weight" in k or ".lora.up.weight" in k for k in keys
    ):
        return LoRAFormat.STANDARD
    if all(k.startswith(("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")) for k in keys):
        return LoRAFormat.NON_DIFFUSERS_SD
    if any(".lora.down" in k or ".lora_up" in k for k in keys):
        return LoRAFormat.NON_DIFFUSERS_SD
    return LoRAFormat.STANDARD


# --- PEFT key normalization -------------------------------------------------------------------------------


def normalize_peft_keys(adapter: Any) -> dict[str, Any]:
    """SGLang's `normalize_peft_keys` on names: `{new name: shape (or the value given)}`.

    A wrapper prefix (`peft_model.base_model.model.` or `base_model.model.`) is removed only when every key
    has it, and `.lora_A.<slot>.weight` becomes `.lora_A.weight`. Raises SGLang's ValueError for two slots
    of the same tensor, more than one slot name, or named and unnamed slots mixed.
    """
    state = _state_dict(adapter)
    prefix = next((p for p in _WRAPPER_PREFIXES if state and all(k.startswith(p) for k in state)), "")
    normalized: dict[str, Any] = {}
    slots: set[str] = set()
    bare = False
    for key, value in state.items():
        name = key[len(prefix) :] if prefix else key
        match = _ADAPTER_SLOT.search(name)
        if match is not None:
            slots.add(match.group(2))
        elif name.endswith((".lora_A.weight", ".lora_B.weight")):
            bare = True
        target = _ADAPTER_SLOT.sub(r"\1.weight", name)
        if target in normalized:
            raise ValueError(MSG_MULTIPLE_SLOTS_SAME.format(target=target))
        normalized[target] = value
    if len(slots) > 1:
        raise ValueError(MSG_MULTIPLE_SLOTS.format(slots=sorted(slots)))
    if slots and bare:
        raise ValueError(MSG_MIXED_SLOTS)
    return normalized


# --- apply_peft_config ------------------------------------------------------------------------------------


def validate_peft_features(adapter: Any, config: Mapping[str, Any] | None = None) -> None:
    """The rejections `apply_peft_config` makes before touching any tensor, in its order.

    Unsupported PEFT features (config fields, `bias`, `fan_in_fan_out`, `lora_bias`), then DoRA (`use_dora`
    or a `lora_magnitude_vector`/`dora_scale` tensor), then auxiliary tensors (`lora_embedding_`,
    `modules_to_save`, `trainable_tokens`; the first eight are listed). `config` defaults to the adapter's.
    """
    names = list(_state_dict(adapter))
    cfg = _config(adapter, config)
    unsupported = {name for name in UNSUPPORTED_CONFIG_FIELDS if cfg.get(name)}
    if cfg.get("bias") not in (None, "none"):
        unsupported.add("bias")
    unsupported.update(name for name in ("fan_in_fan_out", "lora_bias") if cfg.get(name, False))
    if unsupported:
        raise ValueError(MSG_UNSUPPORTED_FEATURES.format(features=sorted(unsupported)))
    if cfg.get("use_dora", False) or any("lora_magnitude_vector" in n or "dora_scale" in n for n in names):
        raise ValueError(MSG_DORA)
    markers = ("lora_embedding_", "modules_to_save", "trainable_tokens")
    auxiliary = [n for n in names if any(m in n for m in markers)]
    if auxiliary:
        raise ValueError(MSG_AUXILIARY.format(names=auxiliary[:8]))


def _positive_int(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return False
    return not (isinstance(value, float) and not value.is_integer())


def check_peft_config(adapter: Any, config: Mapping[str, Any] | None = None) -> None:
    """Everything `apply_peft_config` rejects that headers can tell: `validate_peft_features`, then the
    `alpha_pattern` and `use_rslora` checks (an alpha tensor's value is not compared: that needs data)."""
    validate_peft_features(adapter, config)
    state = _state_dict(adapter)
    cfg = _config(adapter, config)
    patterns = cfg.get("alpha_pattern", {})
    if not isinstance(patterns, dict):
        raise ValueError("PEFT alpha_pattern must be an object")
    for pattern, value in patterns.items():
        if not isinstance(pattern, str):
            raise ValueError("PEFT alpha_pattern keys must be strings")
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as error:
            raise ValueError(f"Invalid PEFT alpha_pattern expression {pattern!r}: {error}") from error
        if value is not None and not _positive_int(value):
            raise ValueError("PEFT lora_alpha must be a positive integer")
        if value is None:
            raise ValueError(f"PEFT alpha_pattern value for {pattern!r} must be a positive integer")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise ValueError("PEFT use_rslora must be boolean")
    if not use_rslora:
        return
    suffix = ".lora_B.weight"
    pairs = 0
    for name in state:
        if not name.endswith(suffix):
            continue
        a_shape = state.get(f"{name[: -len(suffix)]}.lora_A.weight")
        a_shape = getattr(a_shape, "shape", a_shape)
        if a_shape is None or len(a_shape) < 2 or a_shape[-2] <= 0:
            raise ValueError(f"RSLoRA weight {name!r} has no valid rank-bearing A")
        pairs += 1
    if not pairs:
        raise ValueError("PEFT use_rslora is true, but no LoRA A/B pairs were found")


# --- set_lora --------------------------------------------------------------------------------------------


def resolve_lora_merge_mode(
    merge_mode: str | None = None, merge_weights: bool | None = None, server_mode: str = "auto"
) -> str:
    """`LoRAPipeline._resolve_lora_merge_mode`: an explicit mode, else merge_weights, else the server's."""
    if merge_mode is None:
        if merge_weights is not None:
            merge_mode = "merge" if merge_weights else "dynamic"
        else:
            merge_mode = server_mode
    if merge_mode not in LORA_MERGE_MODES:
        raise ValueError(MSG_INVALID_MERGE_MODE.format(mode=merge_mode, modes=LORA_MERGE_MODES))
    return merge_mode


def should_merge_lora(merge_mode: str, *, fsdp_sharded: bool = False) -> bool:
    """`_should_merge_lora_for_layers`: "dynamic" never merges; "auto" merges unless weights are FSDP-sharded."""
    if merge_mode == "dynamic":
        return False
    if merge_mode == "auto":
        return not fsdp_sharded
    return True


def check_adapters_per_target(num_adapters: int, merge_mode: str = "auto", *, fsdp_sharded: bool = False) -> bool:
    """`set_lora`'s rule for one target: dynamic LoRA takes one adapter. Returns whether it would merge."""
    merge = should_merge_lora(resolve_lora_merge_mode(merge_mode), fsdp_sharded=fsdp_sharded)
    if not merge and num_adapters > 1:
        raise ValueError(MSG_DYNAMIC_ONE_ADAPTER)
    return merge
