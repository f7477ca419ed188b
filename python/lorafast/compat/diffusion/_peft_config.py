"""SGLang diffusion's PEFT config: `load_peft_config` (adapter_config.json and the safetensors metadata),
`apply_peft_config`, and the loader's steps before the model (`normalize_lora_state_dict`, `load_lora_adapter`)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from lorafast.compat._inputs import AdapterView
from lorafast.compat.diffusion._convert import convert
from lorafast.compat.diffusion._formats import ADAPTER_SLOT, LoRAFormat, detect, normalize_keys
from lorafast.compat.diffusion._reading import Tensor, adapter_state, read_file, resolve_version, weight_file

UNSUPPORTED_CONFIG_FIELDS = (
    "alora_invocation_tokens",
    "layer_replication",
    "modules_to_save",
    "target_parameters",
    "trainable_token_indices",
    "use_bdlora",
    "use_qalora",
)
SAFETENSORS_ALPHA_KEYS = ("lora_alpha", "network_alpha", "alpha")
METADATA_KEY = "lora_adapter_metadata"
_NATIVE_LORA_A_SUFFIXES = (".lora_A.weight", ".lora_down.weight", ".lora.down.weight")


MSG_UNSUPPORTED_FEATURES = "PEFT adapter requires unsupported auxiliary/runtime features: {features}"
MSG_DORA = "DoRA adapters are not supported by the native diffusion LoRA layers"
MSG_AUXILIARY = "PEFT adapter contains unsupported auxiliary tensors: {names}"
MSG_LORA_ALPHA = "PEFT lora_alpha must be a positive integer"
MSG_CONFIG_NOT_OBJECT = "PEFT adapter_config.json must contain a JSON object"


class LoadedAdapter(NamedTuple):
    """What `load_lora_adapter` knows before the model's name mapping: format, tensors, alpha, config."""

    format: LoRAFormat
    tensors: dict[str, Tensor]
    lora_alpha: int | None
    config: dict[str, Any]


def _config(adapter: Any, config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if config is not None:
        return config
    if isinstance(adapter, (str, os.PathLike)):
        return load_peft_config(weight_file(os.fspath(adapter)))
    if isinstance(adapter, AdapterView):
        return adapter.config or {}
    if isinstance(adapter, Mapping):
        return {}
    files = getattr(adapter, "weight_files", None)
    return load_peft_config(files[0]) if files else {}  # a scanned Adapter: read as SGLang reads it


# --- PEFT config: adapter_config.json and safetensors metadata ----------------------------------------------


def _lora_alpha(config: Mapping[str, Any]) -> int | None:
    alpha = config.get("lora_alpha")
    if alpha is None:
        return None
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or alpha <= 0
        or (isinstance(alpha, float) and not alpha.is_integer())
    ):
        raise ValueError(MSG_LORA_ALPHA)
    return int(alpha)


def get_peft_lora_alpha(config: Mapping[str, Any], *, engine_version: str | None = None) -> int | None:
    """`get_peft_lora_alpha`: `lora_alpha` as an int, None when absent; not a positive whole number: ValueError."""
    resolve_version(engine_version)
    return _lora_alpha(config)


def _metadata_config(metadata: Mapping[str, str]) -> dict[str, Any]:
    """The transformer's LoraConfig that diffusers' `save_lora_weights` embeds (`transformer.` fields only)."""
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return {}
    try:
        packed = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"safetensors metadata {METADATA_KEY!r} is not valid JSON") from error
    if not isinstance(packed, dict):
        raise ValueError(f"safetensors metadata {METADATA_KEY!r} must be a JSON object")
    return {name[len("transformer.") :]: value for name, value in packed.items() if name.startswith("transformer.")}


def _global_alpha(metadata: Mapping[str, str]) -> int | None:
    declared = []
    for key in SAFETENSORS_ALPHA_KEYS:
        value = metadata.get(key)
        if value is None:
            continue
        try:
            numeric = float(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"safetensors metadata {key!r} must be a positive integer") from error
        if not math.isfinite(numeric) or numeric <= 0 or not numeric.is_integer():
            raise ValueError(f"safetensors metadata {key!r} must be a positive integer")
        declared.append((key, int(numeric)))
    if len({value for _, value in declared}) > 1:
        raise ValueError(f"conflicting safetensors LoRA alpha metadata: {declared}")
    return declared[0][1] if declared else None


def _global_alpha_is_unambiguous(tensors: Mapping[str, Tensor]) -> bool:
    """A global alpha applies to a named-slot (PEFT) file, or to a bare one whose A tensors share one rank."""
    if any(ADAPTER_SLOT.search(name) is not None for name in tensors):
        return True
    ranks = {t.shape[-2] for n, t in tensors.items() if n.endswith(_NATIVE_LORA_A_SUFFIXES) and len(t.shape) >= 2}
    return len(ranks) == 1


def _safetensors_config(weight_path: str) -> dict[str, Any]:
    if Path(weight_path).suffix.lower() != ".safetensors":
        return {}
    tensors, metadata = read_file(weight_path)
    config = _metadata_config(metadata)
    if not _global_alpha_is_unambiguous(tensors):
        return config
    metadata_alpha = _global_alpha(metadata)
    if metadata_alpha is None:
        return config
    config_alpha = _lora_alpha(config)
    if config_alpha is not None and config_alpha != metadata_alpha:
        raise ValueError(
            f"conflicting safetensors LoRA alpha metadata: {METADATA_KEY} has {config_alpha}, "
            f"global alpha is {metadata_alpha}"
        )
    config["lora_alpha"] = metadata_alpha
    return config


def load_peft_config(weight_path: str | os.PathLike[str], *, engine_version: str | None = None) -> dict[str, Any]:
    """`load_peft_config`: `adapter_config.json` next to the weights, completed from the file's metadata.

    Metadata fields fill what the JSON lacks. Errors as SGLang raises them: a JSON value that is not an
    object, an invalid `lora_alpha` on either side, alphas that conflict, invalid metadata JSON.
    """
    resolve_version(engine_version)
    weight_path = os.fspath(weight_path)
    path = Path(weight_path).with_name("adapter_config.json")
    config: Any = {}
    if path.is_file():
        with path.open(encoding="utf-8") as file:
            config = json.load(file)
    if not isinstance(config, dict):
        raise ValueError(MSG_CONFIG_NOT_OBJECT)
    metadata_config = _safetensors_config(weight_path)
    metadata_alpha = _lora_alpha(metadata_config)
    config_alpha = _lora_alpha(config)
    if metadata_alpha is not None and config_alpha is not None and metadata_alpha != config_alpha:
        raise ValueError(
            f"adapter_config.json lora_alpha conflicts with safetensors metadata: {config_alpha} != {metadata_alpha}"
        )
    for name, value in metadata_config.items():
        config.setdefault(name, value)
    return config


# --- apply_peft_config ------------------------------------------------------------------------------------


def _validate_features(names: list[str], cfg: Mapping[str, Any]) -> None:
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


def validate_peft_features(
    adapter: Any, config: Mapping[str, Any] | None = None, *, engine_version: str | None = None
) -> None:
    """The first rejections of `apply_peft_config`, on the names given, in its order.

    Unsupported PEFT features (config fields, `bias`, `fan_in_fan_out`, `lora_bias`), then DoRA (`use_dora`
    or a `lora_magnitude_vector`/`dora_scale` tensor), then auxiliary tensors (`lora_embedding_`,
    `modules_to_save`, `trainable_tokens`; the first eight are listed). SGLang runs this on the converted
    names (`normalize_lora_state_dict`); `config` defaults to the adapter's.
    """
    resolve_version(engine_version)
    _validate_features(list(adapter_state(adapter)), _config(adapter, config))


def _apply_peft_config(state: dict[str, Tensor], cfg: Mapping[str, Any]) -> dict[str, Tensor]:
    _validate_features(list(state), cfg)
    normalized = dict(state)
    patterns = cfg.get("alpha_pattern", {})
    if not isinstance(patterns, dict):
        raise ValueError("PEFT alpha_pattern must be an object")
    compiled = []
    for pattern, value in patterns.items():
        if not isinstance(pattern, str):
            raise ValueError("PEFT alpha_pattern keys must be strings")
        try:
            expression = re.compile(rf"(.*\.)?({pattern})$")
        except re.error as error:
            raise ValueError(f"Invalid PEFT alpha_pattern expression {pattern!r}: {error}") from error
        alpha = _lora_alpha({"lora_alpha": value})
        if alpha is None:
            raise ValueError(f"PEFT alpha_pattern value for {pattern!r} must be a positive integer")
        compiled.append((expression, alpha))
    suffix = ".lora_A.weight"
    for name in state:
        if not name.endswith(suffix):
            continue
        base = name[: -len(suffix)]
        alpha = next((a for expression, a in compiled if expression.match(base)), None)
        if alpha is None:
            continue
        key = f"{base}.alpha"
        existing = normalized.get(key)
        if existing is not None and (math.prod(existing.shape) != 1 or int(existing.value) != alpha):  # type: ignore[arg-type]
            raise ValueError(f"PEFT alpha_pattern conflicts with tensor {key!r}")
        normalized[key] = Tensor((), alpha)
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise ValueError("PEFT use_rslora must be boolean")
    if not use_rslora:
        return normalized
    suffix = ".lora_B.weight"
    pairs = 0
    for name in state:
        if not name.endswith(suffix):
            continue
        lora_a = state.get(f"{name[: -len(suffix)]}.lora_A.weight")
        if lora_a is None or len(lora_a.shape) < 2 or lora_a.shape[-2] <= 0:
            raise ValueError(f"RSLoRA weight {name!r} has no valid rank-bearing A")
        pairs += 1  # B is scaled by sqrt(rank): values change, shapes do not
    if not pairs:
        raise ValueError("PEFT use_rslora is true, but no LoRA A/B pairs were found")
    return normalized


def check_peft_config(
    adapter: Any, config: Mapping[str, Any] | None = None, *, engine_version: str | None = None
) -> dict[str, Tensor]:
    """`apply_peft_config` on the names given: its rejections, and the tensors it returns (alpha_pattern adds
    `<module>.alpha` scalars). An existing `.alpha` tensor is compared by value, read from the file."""
    resolve_version(engine_version)
    return _apply_peft_config(adapter_state(adapter), _config(adapter, config))


def normalize_lora_state_dict(
    adapter: Any, config: Mapping[str, Any] | None = None, *, engine_version: str | None = None
) -> dict[str, Tensor]:
    """`normalize_lora_state_dict`: PEFT key normalization, format detection, the format's conversion, then
    `apply_peft_config` on the converted names. Returns `{name: Tensor}` in SGLang's order."""
    resolve_version(engine_version)
    cfg = _config(adapter, config)
    state = normalize_keys(adapter_state(adapter))
    return _apply_peft_config(convert(state, detect(list(state))), cfg or {})


def load_lora_adapter(
    path: str | os.PathLike[str], lora_alpha: int | None = None, *, engine_version: str | None = None
) -> LoadedAdapter:
    """`LoRAPipeline.load_lora_adapter` up to the model's name mapping, in its order: read the file, load the
    PEFT config, normalize and convert, then the adapter's alpha (`lora_alpha`, else the config's)."""
    resolve_version(engine_version)
    path = weight_file(os.fspath(path))
    raw = read_file(path)[0]
    config = load_peft_config(path)
    state = normalize_keys(raw)
    fmt = detect(list(state))
    tensors = _apply_peft_config(convert(state, fmt), config or {})
    alpha = lora_alpha if lora_alpha is not None else _lora_alpha(config)
    return LoadedAdapter(fmt, tensors, alpha, config)
