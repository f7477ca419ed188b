"""SGLang diffusion's key formats: `detect_lora_format_from_state_dict` and `normalize_peft_keys`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

from lorafast.compat.diffusion._reading import adapter_state, resolve_version

ADAPTER_SLOT = re.compile(r"(\.lora_[AB])\.([^.]+)\.weight$")
_WRAPPER_PREFIXES = ("peft_model.base_model.model.", "base_model.model.")


MSG_MULTIPLE_SLOTS_SAME = "LoRA checkpoint contains multiple PEFT adapter slots for the same tensor: {target!r}"
MSG_MULTIPLE_SLOTS = "LoRA checkpoint contains multiple PEFT adapter slots: {slots}"
MSG_MIXED_SLOTS = "LoRA checkpoint mixes named and unnamed PEFT adapter slots"


class LoRAFormat(str, Enum):
    """The key formats SGLang's diffusion LoRA loader tells apart (values as SGLang spells them)."""

    STANDARD = "standard"
    NON_DIFFUSERS_SD = "non-diffusers-sd"
    QWEN_IMAGE_STANDARD = "qwen-image-standard"
    XLABS_FLUX = "xlabs-ai"
    KOHYA_FLUX = "kohya-flux"
    KOHYA_MINIMAX_H3 = "kohya-minimax-h3"
    WAN = "wan"
    AI_TOOLKIT_FLUX = "ai-toolkit-flux"


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


def is_qwen_image(keys: list[str]) -> bool:
    return any(k.startswith("transformer.transformer_blocks.") for k in keys) and any(
        ".lora.down.weight" in k or ".lora.up.weight" in k for k in keys
    )


def _is_ai_toolkit_flux(keys: list[str]) -> bool:
    # Any double_blocks key counts; a single_blocks key only when it is linear1/linear2.
    double = any(k.startswith(("double_blocks.", "base_model.model.double_blocks.")) for k in keys)
    single = any(
        k.startswith(("single_blocks.", "base_model.model.single_blocks.")) and (".linear1." in k or ".linear2." in k)
        for k in keys
    )
    return (double or single) and any(".lora_A" in k or ".lora_B" in k for k in keys)


def detect(keys: list[str]) -> LoRAFormat:
    if not keys:
        return LoRAFormat.STANDARD
    if _is_ai_toolkit_flux(keys):
        return LoRAFormat.AI_TOOLKIT_FLUX
    if any(".lora_A" in k or ".lora_B" in k for k in keys):
        return LoRAFormat.STANDARD
    if any(_is_xlabs_key(k) for k in keys):
        return LoRAFormat.XLABS_FLUX
    if any(k.startswith("lora_unet_blocks_") and "_attn_qkv_proj." in k for k in keys):
        return LoRAFormat.KOHYA_MINIMAX_H3
    if any(k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for k in keys):
        return LoRAFormat.KOHYA_FLUX
    if any(_is_wan_key(k) for k in keys):
        return LoRAFormat.WAN
    if is_qwen_image(keys):
        return LoRAFormat.STANDARD
    if all(k.startswith(("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")) for k in keys):
        return LoRAFormat.NON_DIFFUSERS_SD
    if any(".lora.down" in k or ".lora_up" in k for k in keys):
        return LoRAFormat.NON_DIFFUSERS_SD
    return LoRAFormat.STANDARD


def detect_lora_format(adapter: Any, *, engine_version: str | None = None) -> LoRAFormat:
    """`detect_lora_format_from_state_dict`: the first matching key pattern decides.

    In order: ai-toolkit Flux (a `double_blocks.` key, or a `single_blocks.` linear1/linear2 key, optionally
    under `base_model.model.`, plus any `.lora_A`/`.lora_B`); any `.lora_A`/`.lora_B`: standard; XLabs Flux;
    kohya MiniMax-H3 (`lora_unet_blocks_*_attn_qkv_proj.`); kohya Flux; Wan; Qwen-Image `.lora.down/up`:
    standard; every key a kohya SD prefix; any `.lora.down`/`.lora_up`: non-diffusers SD; else standard.
    Keys are used as given; SGLang's loader runs `normalize_peft_keys` first.
    """
    resolve_version(engine_version)
    return detect(list(adapter_state(adapter)))


# --- PEFT key normalization -------------------------------------------------------------------------------


def normalize_keys(state: dict[str, Any]) -> dict[str, Any]:
    prefix = next((p for p in _WRAPPER_PREFIXES if state and all(k.startswith(p) for k in state)), "")
    normalized: dict[str, Any] = {}
    slots: set[str] = set()
    bare = False
    for key, value in state.items():
        name = key.removeprefix(prefix)
        match = ADAPTER_SLOT.search(name)
        if match is not None:
            slots.add(match.group(2))
        elif name.endswith((".lora_A.weight", ".lora_B.weight")):
            bare = True
        target = ADAPTER_SLOT.sub(r"\1.weight", name)
        if target in normalized:
            raise ValueError(MSG_MULTIPLE_SLOTS_SAME.format(target=target))
        normalized[target] = value
    if len(slots) > 1:
        raise ValueError(MSG_MULTIPLE_SLOTS.format(slots=sorted(slots)))
    if slots and bare:
        raise ValueError(MSG_MIXED_SLOTS)
    return normalized


def normalize_peft_keys(adapter: Any, *, engine_version: str | None = None) -> dict[str, Any]:
    """SGLang's `normalize_peft_keys` on names: `{new name: value as given (or a Tensor)}`, in data order.

    A wrapper prefix (`peft_model.base_model.model.` or `base_model.model.`) is removed only when every key
    has it, and `.lora_A.<slot>.weight` becomes `.lora_A.weight`. Raises SGLang's ValueError for two slots
    of the same tensor (the first in data order), more than one slot name, or named and unnamed slots mixed.
    """
    resolve_version(engine_version)
    if isinstance(adapter, Mapping) and not hasattr(adapter, "modules"):
        return normalize_keys(dict(adapter))
    return normalize_keys(adapter_state(adapter))
