"""vLLM's LoRA names: `WeightsMapper`, `parse_fine_tuned_lora_name`, the expected modules, `is_in_target_modules`;
and the release gates the rules follow (`since_033`, `since_034`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat import _versions

DEFAULT_PACKED_MODULES_MAPPING: Mapping[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

_PREFIX = "base_model.model."
CLASSIFIERS = ["classifier", "score"]


def since_033(engine_version: str | None) -> bool:
    # Only 0.30.0 and 0.33.0 are checked against vLLM's code; versions in between get the 0.33.0 rules.
    return _versions.at_least("vllm", engine_version, "0.31.0")


def since_034(engine_version: str | None) -> bool:
    return _versions.at_least("vllm", engine_version, "0.34.0")


# --- names -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsMapper:
    """The renaming part of vLLM's `WeightsMapper` (substrings, then prefixes, then suffixes; a None target
    drops the name), for describing a model's `hf_to_vllm_mapper` without vLLM installed."""

    orig_to_new_substr: Mapping[str, str | None] = None  # type: ignore[assignment]
    orig_to_new_prefix: Mapping[str, str | None] = None  # type: ignore[assignment]
    orig_to_new_suffix: Mapping[str, str | None] = None  # type: ignore[assignment]

    def _map_name(self, key: str) -> str | None:
        for substr, new in (self.orig_to_new_substr or {}).items():
            if substr in key:
                if new is None:
                    return None
                key = key.replace(substr, new, 1)
        for prefix, new in (self.orig_to_new_prefix or {}).items():
            if key.startswith(prefix):
                if new is None:
                    return None
                key = key.replace(prefix, new, 1)
        for suffix, new in (self.orig_to_new_suffix or {}).items():
            if key.endswith(suffix):
                if new is None:
                    return None
                key = new.join(key.rsplit(suffix, 1))
        return key

    def get_rename_mapper(self) -> WeightsMapper:
        """vLLM's rename-only variant: targets of None are dropped (what `_load_adapter` applies)."""

        def keep(d: Mapping[str, str | None] | None) -> dict[str, str | None]:
            return {k: v for k, v in (d or {}).items() if v is not None}

        return WeightsMapper(
            keep(self.orig_to_new_substr), keep(self.orig_to_new_prefix), keep(self.orig_to_new_suffix)
        )


def _map(name: str, weights_mapper: Any) -> str:
    mapped = weights_mapper._map_name(name) if hasattr(weights_mapper, "_map_name") else weights_mapper(name)
    if mapped is None:
        raise ValueError("Mapped LoRA weight name cannot be None.")
    return mapped


def parse_fine_tuned_lora_name(
    name: str, weights_mapper: Callable[[str], str | None] | Any = None, *, engine_version: str | None = None
) -> tuple[str, bool]:
    """`(module name, is_lora_a)` for a LoRA tensor name, or vLLM's "... is unsupported LoRA weight" ValueError.

    `base_model.model.` is dropped from the module name; `weights_mapper` (a callable, vLLM's `WeightsMapper`
    or this module's) is applied to the rest. From 0.33, `score`/`classifier` weights and biases name the
    classification head (`modules_to_save`).
    """
    if name.startswith(_PREFIX):
        name = name.replace(_PREFIX, "")
        if weights_mapper:
            name = _PREFIX + _map(name, weights_mapper)
    elif weights_mapper:
        name = _map(name, weights_mapper)
    start = 2 if name.startswith(_PREFIX) else 0
    parts = name.split(".")
    if since_033(engine_version):
        if parts[-1] in ("weight", "bias") and len(parts) >= 2:
            if parts[-2] in ("lora_A", "lora_B") and parts[-1] == "weight":
                return ".".join(parts[start:-2]), parts[-2] == "lora_A"
            if parts[-2] in CLASSIFIERS:
                return parts[-2], False
    elif parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[start:-2]), parts[-2] == "lora_A"
    if parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        return ".".join(parts[start:-1]), parts[-1] == "lora_embedding_A"
    raise ValueError(f"{name} is unsupported LoRA weight")


def expected_lora_modules(
    supported_lora_modules: Iterable[str],
    packed_modules_mapping: Mapping[str, list[str]] | None = None,
    *,
    engine_version: str | None = None,
) -> set[str]:
    """`_load_adapter`'s expected modules: the model's LoRA module leaves with packed names expanded, plus
    `experts` itself for MoE models, as a set built in vLLM's order (its repr is the one vLLM prints).
    The rule is the same in 0.30.0 and 0.33.0."""
    _versions.resolve("vllm", engine_version)
    packed = DEFAULT_PACKED_MODULES_MAPPING if packed_modules_mapping is None else packed_modules_mapping
    out: list[str] = []
    for module in supported_lora_modules:
        if module in packed:
            out.extend(packed[module])
        else:
            out.append(module)
        if module == "experts":
            out.append(module)
    return set(out)


def is_in_target_modules(
    module_name: str, target_modules: list[str] | None, packed_modules_mapping: Mapping[str, list[str]] | None = None
) -> bool:
    """`vllm.lora.utils.is_in_target_modules`: does a module pass `--lora-target-modules`, the deployment-time
    filter of which modules `LoRAModelManager` wraps? (`_load_adapter` never consults it: an adapter module that
    fails it loads and is silently not applied.) Its suffix, or its whole name, must be listed, or a packed parent
    or child of it."""
    if target_modules is None:
        return True
    wanted = set(target_modules)
    suffix = module_name.split(".")[-1]
    if suffix in wanted or module_name in wanted:
        return True
    if not packed_modules_mapping:
        return False
    children = packed_modules_mapping.get(suffix)
    if children and any(child in wanted for child in children):
        return True
    return any(suffix in kids and parent in wanted for parent, kids in packed_modules_mapping.items())


def is_base_embedding(name: str) -> bool:
    return name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight"))
