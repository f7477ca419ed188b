"""SGLang's diffusion (multimodal_gen) LoRA loading rules, from safetensors headers.

Proven against SGLang 0.5.23's own `pipelines_core/lora/` code by tests/test_oracle_sglang_diffusion.py:

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

import json
import math
import os
import re
import struct
from collections.abc import Collection, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

from lorafast.compat import _versions
from lorafast.compat._inputs import AdapterView

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
SAFETENSORS_ALPHA_KEYS = ("lora_alpha", "network_alpha", "alpha")
METADATA_KEY = "lora_adapter_metadata"
_NATIVE_LORA_A_SUFFIXES = (".lora_A.weight", ".lora_down.weight", ".lora.down.weight")
LORA_MERGE_MODES = ("auto", "merge", "dynamic")
VALID_TARGETS = ["all", "transformer", "transformer_2", "critic"]

MSG_MULTIPLE_SLOTS_SAME = "LoRA checkpoint contains multiple PEFT adapter slots for the same tensor: {target!r}"
MSG_MULTIPLE_SLOTS = "LoRA checkpoint contains multiple PEFT adapter slots: {slots}"
MSG_MIXED_SLOTS = "LoRA checkpoint mixes named and unnamed PEFT adapter slots"
MSG_UNSUPPORTED_FEATURES = "PEFT adapter requires unsupported auxiliary/runtime features: {features}"
MSG_DORA = "DoRA adapters are not supported by the native diffusion LoRA layers"
MSG_AUXILIARY = "PEFT adapter contains unsupported auxiliary tensors: {names}"
MSG_LORA_ALPHA = "PEFT lora_alpha must be a positive integer"
MSG_CONFIG_NOT_OBJECT = "PEFT adapter_config.json must contain a JSON object"
MSG_INVALID_MERGE_MODE = "Invalid LoRA merge mode: {mode}. Valid modes: {modes}"
MSG_DYNAMIC_ONE_ADAPTER = (
    "Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple adapters."
)
MSG_QUANTIZED_MERGE = (
    "LoRA merge mode is unavailable for {module} because its quantized weights cannot be updated in place; "
    "use merge mode 'dynamic'"
)
# `set_lora`'s log lines (texts as SGLang logs them; the planner quotes them as reasons).
MSG_AUTO_FSDP = "Using dynamic LoRA for {module} because FSDP-sharded weights would require a full-gather merge."
MSG_AUTO_QUANTIZED = "Using dynamic LoRA for {module} because its quantized weights cannot be merged in place."
MSG_MERGE_FSDP = "Merging LoRA for {module} with FSDP-sharded weights may require full-gather and can OOM."
MSG_CONFIG_MATCHES = "LoRA configuration matches exactly, skipping"
MSG_MISSING_MODULE = {
    "transformer_2": "transformer_2 does not exist in this pipeline",
    "critic": "critic (fake_score_transformer) does not exist in this pipeline",
}
MSG_STAYS_UNMERGED = (
    "LoRA {paths} stays unmerged on {module}: merging it into the base weights would round away {percent:.0f}% of "
    "its update. Pass --lora-merge-mode merge to merge anyway."
)
#: Components a target resolves to, in the order `_get_target_lora_layers("all")` lists them.
PIPELINE_MODULES = ("transformer", "transformer_2", "critic")
#: merge_mode "auto" keeps a lone adapter unmerged when merging would round away more than this share of its
#: update, by norm (`AUTO_MERGE_MAX_ROUNDING_LOSS`, 0.5.23).
AUTO_MERGE_MAX_ROUNDING_LOSS = 0.5
# The release whose `set_lora` gained the quantized-layer rule, the auto-merge rounding-loss rule and the merge
# cache (issue 11). Earlier versions are answered without them; only 0.5.23 is proven by the oracle.
_MERGE_RULES_SINCE = (0, 5, 23)


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


class Tensor(NamedTuple):
    """A tensor as these rules see it: its shape, and its value when it has one element and was read.

    `data` says where the rest of its values are, for the one rule that needs them (kohya Flux, below): a
    `(file, dtype, start, end)` tuple of a tensor read from a file, or an array the caller passed.
    """

    shape: Shape
    value: float | int | None = None
    data: Any = None


class LoadedAdapter(NamedTuple):
    """What `load_lora_adapter` knows before the model's name mapping: format, tensors, alpha, config."""

    format: LoRAFormat
    tensors: dict[str, Tensor]
    lora_alpha: int | None
    config: dict[str, Any]


def _version(engine_version: str | None) -> tuple[int, ...]:
    return _versions.resolve("sglang", engine_version)


# --- reading ----------------------------------------------------------------------------------------------

_SCALAR_FORMATS = {
    "F64": "<d",
    "F32": "<f",
    "F16": "<e",
    "I64": "<q",
    "I32": "<i",
    "I16": "<h",
    "I8": "<b",
    "U8": "<B",
    "U16": "<H",
    "U32": "<I",
    "U64": "<Q",
    "BOOL": "<?",
}


def _scalar(raw: bytes, dtype: str) -> float | int | None:
    if dtype == "BF16":
        return struct.unpack("<f", b"\x00\x00" + raw)[0]
    fmt = _SCALAR_FORMATS.get(dtype)
    if fmt is None:
        return None
    value = struct.unpack(fmt, raw)[0]
    return int(value) if dtype == "BOOL" else value


def _weight_file(path: str) -> str:
    """A file as given; a folder: its one `.safetensors` file."""
    if not os.path.isdir(path):
        return path
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if len(found) != 1:
        raise ValueError(f"{path}: expected one .safetensors file, found {len(found)}; pass the file")
    return os.path.join(path, found[0])


def read_file(path: str | os.PathLike[str]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """`({name: Tensor}, metadata)` of one safetensors file, in data order, header only.

    Data order is the order of `data_offsets` (SGLang's `load_file` returns tensors so); the values of
    one-element `.alpha` tensors are read (a few bytes each), no other tensor data.
    """
    from lorafast import _core

    path = _weight_file(os.fspath(path))
    header = _core.read_header(path, "pread")
    entries = sorted(header["tensors"], key=lambda e: (tuple(e[3]), e[0]))
    base = 8 + header["header_size"]
    out: dict[str, Tensor] = {}
    with open(path, "rb") as f:
        for name, dtype, shape, (start, end) in entries:
            shape = tuple(int(d) for d in shape)
            value = None
            if name.endswith(".alpha") and math.prod(shape) == 1:
                f.seek(base + start)
                value = _scalar(f.read(end - start), dtype)
            out[name] = Tensor(shape, value, (path, dtype, base + start, base + end))
    return out, dict(header["metadata"] or {})


def _as_tensor(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value
    shape = getattr(value, "shape", value)
    shape = tuple(int(d) for d in shape) if shape is not None else ()
    scalar = None
    if hasattr(value, "item") and math.prod(shape) == 1:
        scalar = value.item()
    return Tensor(shape, scalar, value if hasattr(value, "shape") else None)


def _state(adapter: Any) -> dict[str, Tensor]:
    """`{name: Tensor}` for a path, an AdapterView, a scanned Adapter, or a state dict of shapes or arrays."""
    if isinstance(adapter, (str, os.PathLike)):
        return read_file(adapter)[0]
    if isinstance(adapter, AdapterView):
        if adapter.path and os.path.exists(adapter.path):
            try:
                return read_file(adapter.path)[0]  # data order and alpha values, which the view lacks
            except ValueError:
                pass  # not one readable safetensors file: the view's own table
        return {k: Tensor(tuple(v or ())) for k, v in adapter.tensors.items()}
    if isinstance(adapter, Mapping) and not hasattr(adapter, "modules"):
        return {k: _as_tensor(v) for k, v in adapter.items()}
    files = getattr(adapter, "weight_files", None)
    if files:
        return read_file(files[0])[0]
    raise TypeError(f"expected a path, an Adapter, an AdapterView or a state dict, got {type(adapter).__name__}")


def _config(adapter: Any, config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if config is not None:
        return config
    if isinstance(adapter, (str, os.PathLike)):
        return load_peft_config(_weight_file(os.fspath(adapter)))
    if isinstance(adapter, AdapterView):
        return adapter.config or {}
    if isinstance(adapter, Mapping):
        return {}
    files = getattr(adapter, "weight_files", None)
    return load_peft_config(files[0]) if files else {}  # a scanned Adapter: read as SGLang reads it


# --- format detection -------------------------------------------------------------------------------------

_KOHYA_H3_KEY = re.compile(
    r"^lora_unet_blocks_(\d+)_(attn_qkv_proj|attn_out_proj|mlp_fc1|mlp_fc2)\.(lora_down|lora_up|alpha)(?:\.weight)?$"
)
_KOHYA_H3_MODULES = {
    "attn_qkv_proj": "attn.qkv_proj",
    "attn_out_proj": "attn.out_proj",
    "mlp_fc1": "mlp.fc1",
    "mlp_fc2": "mlp.fc2",
}
_KOHYA_H3_SUFFIXES = {"lora_down": "lora_A", "lora_up": "lora_B", "alpha": "alpha"}


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


def _is_qwen_image(keys: list[str]) -> bool:
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


def _detect(keys: list[str]) -> LoRAFormat:
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
    if _is_qwen_image(keys):
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
    _version(engine_version)
    return _detect(list(_state(adapter)))


# --- PEFT key normalization -------------------------------------------------------------------------------


def _normalize_peft_keys(state: dict[str, Any]) -> dict[str, Any]:
    prefix = next((p for p in _WRAPPER_PREFIXES if state and all(k.startswith(p) for k in state)), "")
    normalized: dict[str, Any] = {}
    slots: set[str] = set()
    bare = False
    for key, value in state.items():
        name = key.removeprefix(prefix)
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


def normalize_peft_keys(adapter: Any, *, engine_version: str | None = None) -> dict[str, Any]:
    """SGLang's `normalize_peft_keys` on names: `{new name: value as given (or a Tensor)}`, in data order.

    A wrapper prefix (`peft_model.base_model.model.` or `base_model.model.`) is removed only when every key
    has it, and `.lora_A.<slot>.weight` becomes `.lora_A.weight`. Raises SGLang's ValueError for two slots
    of the same tensor (the first in data order), more than one slot name, or named and unnamed slots mixed.
    """
    _version(engine_version)
    if isinstance(adapter, Mapping) and not hasattr(adapter, "modules"):
        return _normalize_peft_keys(dict(adapter))
    return _normalize_peft_keys(_state(adapter))


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
    _version(engine_version)
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
    if any(_ADAPTER_SLOT.search(name) is not None for name in tensors):
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
    _version(engine_version)
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


# --- key conversion per format ------------------------------------------------------------------------------


def _convert_qwen_image(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        new = name.removeprefix("transformer.")
        if new.endswith(".lora.down.weight"):
            new = new.replace(".lora.down.weight", ".lora_A.weight")
        elif new.endswith(".lora.up.weight"):
            new = new.replace(".lora.up.weight", ".lora_B.weight")
        out[new] = tensor
    return out


def _convert_down_up(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`_convert_non_diffusers_sd_simple`: lora_down/lora_up -> lora_A/lora_B, first matching rule only."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        new = name
        if "lora_down.weight" in new:
            new = new.replace("lora_down.weight", "lora_A.weight")
        elif "lora_up.weight" in new:
            new = new.replace("lora_up.weight", "lora_B.weight")
        elif new.endswith(".lora_down"):
            new = new.replace(".lora_down", ".lora_A")
        elif new.endswith(".lora_up"):
            new = new.replace(".lora_up", ".lora_B")
        out[new] = tensor
    return out


def _convert_minimax_h3(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        match = _KOHYA_H3_KEY.match(name)
        if match is None:
            out[name] = tensor  # kept as is (SGLang logs them as unmatched)
            continue
        layer, module, suffix = match.groups()
        out[f"blocks.{layer}.{_KOHYA_H3_MODULES[module]}.{_KOHYA_H3_SUFFIXES[suffix]}"] = tensor
    return out


def _chunk3(tensor: Tensor) -> list[Tensor]:
    """`torch.chunk(t, 3, dim=0)` on shapes, unpacked into three as SGLang does."""
    if not tensor.shape:
        raise IndexError("tuple index out of range")
    n = tensor.shape[0]
    size = -(-n // 3)
    sizes = [0, 0, 0] if n == 0 else [min(size, n - i) for i in range(0, n, size)]
    if len(sizes) != 3:
        raise ValueError(f"not enough values to unpack (expected 3, got {len(sizes)})")
    return [Tensor((s, *tensor.shape[1:])) for s in sizes]


_AI_TOOLKIT_EXTRA = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
}


def _convert_ai_toolkit(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`_convert_ai_toolkit_flux_lora`: BFL Flux block names -> diffusers names; fused qkv B split in three."""
    original: dict[str, Tensor] = {}
    for name, tensor in state.items():
        original[name.removeprefix("diffusion_model.").removeprefix("base_model.model.")] = tensor
    num_double = num_single = 0
    for key in original:
        parts = key.split(".")
        if len(parts) > 1 and parts[1].isdigit():
            if parts[0] == "single_blocks":
                num_single = max(num_single, int(parts[1]) + 1)
            elif parts[0] == "double_blocks":
                num_double = max(num_double, int(parts[1]) + 1)
    out: dict[str, Tensor] = {}
    for block in range(num_single):
        for ab in ("lora_A", "lora_B"):
            for src, dst in (("linear1", "to_qkv_mlp_proj"), ("linear2", "to_out")):
                key = f"single_blocks.{block}.{src}.{ab}.weight"
                if key in original:
                    out[f"single_transformer_blocks.{block}.attn.{dst}.{ab}.weight"] = original.pop(key)
    for block in range(num_double):
        prefix = f"transformer_blocks.{block}.attn"
        for ab in ("lora_A", "lora_B"):
            for attn in ("img_attn", "txt_attn"):
                key = f"double_blocks.{block}.{attn}.qkv.{ab}.weight"
                if key not in original:
                    continue
                fused = original.pop(key)
                projs = ("to_q", "to_k", "to_v") if attn == "img_attn" else ("add_q_proj", "add_k_proj", "add_v_proj")
                pieces = [fused] * 3 if ab == "lora_A" else _chunk3(fused)
                for proj, part in zip(projs, pieces, strict=True):
                    out[f"{prefix}.{proj}.{ab}.weight"] = part
        for src, dst in (("img_attn.proj", "attn.to_out.0"), ("txt_attn.proj", "attn.to_add_out")):
            for ab in ("lora_A", "lora_B"):
                key = f"double_blocks.{block}.{src}.{ab}.weight"
                if key in original:
                    out[f"transformer_blocks.{block}.{dst}.{ab}.weight"] = original.pop(key)
    for key, tensor in original.items():
        out[
            key.replace("double_blocks.", "transformer_blocks.").replace("single_blocks.", "single_transformer_blocks.")
        ] = tensor
    final: dict[str, Tensor] = {}
    for key, tensor in out.items():
        new = key
        for src, dst in _AI_TOOLKIT_EXTRA.items():
            if key.startswith(src):
                new = key.replace(src, dst, 1)
                break
        final[new] = tensor
    return final


_DIFFUSERS_CONVERTERS = {
    LoRAFormat.XLABS_FLUX: (
        "_convert_xlabs_flux_lora_to_diffusers",
        "convert_xlabs_lora_state_dict_to_diffusers",
        "convert_xlabs_lora_to_diffusers",
        "convert_xlabs_flux_lora_to_diffusers",
    ),
    LoRAFormat.KOHYA_FLUX: ("_convert_kohya_flux_lora_to_diffusers", "convert_kohya_flux_lora_to_diffusers"),
}


_TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def _real(t: Tensor) -> Any:
    """The tensor's values, from its file or the array given; None when unknown."""
    import torch

    if t.data is None:
        return None
    if not isinstance(t.data, tuple):
        return torch.as_tensor(t.data)
    path, dtype, start, end = t.data
    if dtype not in _TORCH_DTYPES:
        return None
    with open(path, "rb") as f:
        f.seek(start)
        raw = bytearray(f.read(end - start))
    return torch.frombuffer(raw, dtype=getattr(torch, _TORCH_DTYPES[dtype])).reshape(t.shape) if raw else None


def _kohya_up_needs_values(name: str, state: Mapping[str, Tensor]) -> bool:
    """diffusers splits a fused kohya Flux up weight (qkv in 3, single-block linear1 in 4) by rank when its
    off-diagonal blocks are all zero: for a rank that 3 or 4 divides, the split depends on the values."""
    if not name.endswith(".lora_up.weight"):
        return False
    down = state.get(name.removesuffix(".lora_up.weight") + ".lora_down.weight")
    rank = down.shape[0] if down is not None and down.shape else 0
    return rank > 0 and (rank % 3 == 0 or rank % 4 == 0)


def _convert_with_diffusers(state: Mapping[str, Tensor], fmt: LoRAFormat) -> dict[str, Tensor]:
    """XLabs and kohya Flux: SGLang calls diffusers' converter, and keeps the keys when every candidate fails.

    The converter runs here too, on shape-only (meta) tensors, with the real `.alpha` values, so names,
    shapes and failures are diffusers' own. Kohya up weights whose split depends on their values (see
    `_kohya_up_needs_values`) are read; `.diff`/`.diff_b` tensors, whose values diffusers only logs about,
    are zeros. Needs torch and diffusers, as SGLang does.
    """
    import torch
    from diffusers.loaders import lora_conversion_utils as lcu

    converters = [getattr(lcu, n) for n in _DIFFUSERS_CONVERTERS[fmt] if callable(getattr(lcu, n, None))]
    meta = {}
    for name, t in state.items():
        real = _real(t) if fmt == LoRAFormat.KOHYA_FLUX and _kohya_up_needs_values(name, state) else None
        if real is not None:
            meta[name] = real
        elif t.value is not None:
            meta[name] = torch.tensor(t.value).reshape(t.shape)
        elif ".diff" in name:
            meta[name] = torch.zeros(()).expand(t.shape)
        else:
            meta[name] = torch.empty(t.shape, device="meta")
        module = name.removesuffix(".lora_down.weight")
        if fmt == LoRAFormat.KOHYA_FLUX and module != name and f"{module}.alpha" not in state and t.shape:
            # diffusers' default alpha is the rank, made on the weight's device: a real scalar keeps .item() working
            meta[f"{module}.alpha"] = torch.tensor(float(t.shape[0]))
    for fn in converters:
        try:
            out = fn(dict(meta))
            if isinstance(out, tuple) and isinstance(out[0], dict):
                out = out[0]
            if not isinstance(out, dict):
                raise TypeError(f"Converter returned {type(out)}")
        except Exception:  # SGLang tries the next candidate, then keeps the input
            continue
        return {
            k: Tensor(tuple(v.shape), v.item() if v.device.type != "meta" and v.numel() == 1 else None)
            for k, v in out.items()
        }
    return dict(state)


def _convert(state: dict[str, Tensor], fmt: LoRAFormat) -> dict[str, Tensor]:
    """`convert_lora_state_dict_by_format`. diffusers has no `maybe_convert_state_dict`, so the standard,
    Wan and SD paths keep keys before their own renames."""
    if fmt == LoRAFormat.AI_TOOLKIT_FLUX:
        return _convert_ai_toolkit(state)
    if fmt in (LoRAFormat.XLABS_FLUX, LoRAFormat.KOHYA_FLUX):
        return _convert_down_up(_convert_with_diffusers(state, fmt))
    if fmt == LoRAFormat.KOHYA_MINIMAX_H3:
        return _convert_minimax_h3(state)
    if fmt in (LoRAFormat.WAN, LoRAFormat.NON_DIFFUSERS_SD):
        return _convert_down_up(state)
    if fmt == LoRAFormat.QWEN_IMAGE_STANDARD or _is_qwen_image(list(state)):
        return _convert_qwen_image(state)
    return dict(state)


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
    _version(engine_version)
    _validate_features(list(_state(adapter)), _config(adapter, config))


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
    _version(engine_version)
    return _apply_peft_config(_state(adapter), _config(adapter, config))


def normalize_lora_state_dict(
    adapter: Any, config: Mapping[str, Any] | None = None, *, engine_version: str | None = None
) -> dict[str, Tensor]:
    """`normalize_lora_state_dict`: PEFT key normalization, format detection, the format's conversion, then
    `apply_peft_config` on the converted names. Returns `{name: Tensor}` in SGLang's order."""
    _version(engine_version)
    cfg = _config(adapter, config)
    state = _normalize_peft_keys(_state(adapter))
    return _apply_peft_config(_convert(state, _detect(list(state))), cfg or {})


def load_lora_adapter(
    path: str | os.PathLike[str], lora_alpha: int | None = None, *, engine_version: str | None = None
) -> LoadedAdapter:
    """`LoRAPipeline.load_lora_adapter` up to the model's name mapping, in its order: read the file, load the
    PEFT config, normalize and convert, then the adapter's alpha (`lora_alpha`, else the config's)."""
    _version(engine_version)
    path = _weight_file(os.fspath(path))
    raw = read_file(path)[0]
    config = load_peft_config(path)
    state = _normalize_peft_keys(raw)
    fmt = _detect(list(state))
    tensors = _apply_peft_config(_convert(state, fmt), config or {})
    alpha = lora_alpha if lora_alpha is not None else _lora_alpha(config)
    return LoadedAdapter(fmt, tensors, alpha, config)


# --- set_lora --------------------------------------------------------------------------------------------


def normalize_lora_params(
    lora_nickname: str | list[str],
    lora_path: str | None | list[str | None] = None,
    strength: float | list[float] = 1.0,
    target: str | list[str] = "all",
    lora_alpha: int | None | list[int | None] = None,
    *,
    engine_version: str | None = None,
) -> tuple[list[str], list[str | None], list[float], list[str], list[int | None]]:
    """`_normalize_lora_params` (then `set_lora`'s target check): lists of equal length, or SGLang's error."""
    _version(engine_version)
    nicknames = [lora_nickname] if isinstance(lora_nickname, str) else lora_nickname
    paths = lora_path if isinstance(lora_path, list) else [lora_path]
    if len(paths) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but lora_path has {len(paths)} items. "
            "Provide one path per nickname."
        )
    if isinstance(strength, (int, float)):
        strengths = [float(strength)] * len(nicknames)
    else:
        strengths = [float(s) for s in strength]
    if len(strengths) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but strength has {len(strengths)} items"
        )
    targets = [target] * len(nicknames) if isinstance(target, str) else target
    if len(targets) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but target has {len(targets)} items"
        )
    alphas = lora_alpha if isinstance(lora_alpha, list) else [lora_alpha] * len(nicknames)
    if len(alphas) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but lora_alpha has {len(alphas)} items"
        )
    if any(alpha is not None and alpha <= 0 for alpha in alphas):
        raise ValueError("lora_alpha values must be positive integers or null")
    return nicknames, paths, strengths, targets, alphas


def check_targets(targets: list[str], *, engine_version: str | None = None) -> None:
    """`set_lora`'s target check, after `normalize_lora_params`."""
    _version(engine_version)
    invalid = [t for t in targets if t not in VALID_TARGETS]
    if invalid:
        raise ValueError(f"Invalid target(s): {invalid}. Valid targets: {VALID_TARGETS}")


def resolve_lora_merge_mode(
    merge_mode: str | None = None,
    merge_weights: bool | None = None,
    server_mode: str = "auto",
    *,
    engine_version: str | None = None,
) -> str:
    """`LoRAPipeline._resolve_lora_merge_mode`: an explicit mode, else merge_weights, else the server's."""
    _version(engine_version)
    if merge_mode is None:
        if merge_weights is not None:
            merge_mode = "merge" if merge_weights else "dynamic"
        else:
            merge_mode = server_mode
    if merge_mode not in LORA_MERGE_MODES:
        raise ValueError(MSG_INVALID_MERGE_MODE.format(mode=merge_mode, modes=LORA_MERGE_MODES))
    return merge_mode


def has_merge_rules(engine_version: str | None = None) -> bool:
    """Whether `set_lora` of this SGLang version has the quantized-layer rule, the auto-merge rounding-loss
    rule and the merge cache (0.5.23 and later)."""
    return _version(engine_version) >= _MERGE_RULES_SINCE


def should_merge_lora(
    merge_mode: str,
    *,
    fsdp_sharded: bool = False,
    quantized: bool = False,
    module_name: str = "transformer",
    engine_version: str | None = None,
) -> bool:
    """`_should_merge_lora_for_layers`. "dynamic" never merges; "auto" merges unless a layer's weights are
    FSDP-sharded or quantized so that they cannot take a merged delta; "merge" on such quantized layers is an
    error (FSDP only warns). Before 0.5.23 quantized layers are not looked at. `merge_log` gives the line SGLang
    logs with the decision."""
    if not has_merge_rules(engine_version):
        quantized = False
    if merge_mode == "dynamic":
        return False
    if merge_mode == "auto":
        return not fsdp_sharded and not quantized
    if quantized:
        raise ValueError(MSG_QUANTIZED_MERGE.format(module=module_name))
    return True


def merge_log(
    merge_mode: str,
    *,
    fsdp_sharded: bool = False,
    quantized: bool = False,
    module_name: str = "transformer",
    engine_version: str | None = None,
) -> str | None:
    """The line `_should_merge_lora_for_layers` logs for this decision (info for "auto", a warning for "merge"
    on FSDP-sharded weights), or None. A "merge" on quantized layers raises instead: see `should_merge_lora`."""
    if not has_merge_rules(engine_version):
        quantized = False
    if merge_mode == "auto":
        if fsdp_sharded:
            return MSG_AUTO_FSDP.format(module=module_name)
        if quantized:
            return MSG_AUTO_QUANTIZED.format(module=module_name)
    elif merge_mode == "merge" and fsdp_sharded and not quantized:
        return MSG_MERGE_FSDP.format(module=module_name)
    return None


def merge_rounding_loss(layers: Any, max_rows: int = 1024) -> float | None:
    """`merge_rounding_loss` over `BaseLayerWithLoRA.merge_rounding_norms` (0.5.23), computed the same way.

    `layers` yields `(weight, entries)` per LoRA layer of a component: the base weight (a torch tensor) and the
    adapters attached unmerged there, as `(lora_A, lora_B, strength, rank, alpha)`. Per layer, on an even
    sample of at most `max_rows` rows, in float32: the update `Σ strength·(alpha/rank if alpha != rank)·B·A`, and
    what rounding `W + update` to the weight's dtype loses. A layer whose weight is float32 or not floating, or
    whose A or B is not 2-D, counts for nothing. Returns `sqrt(Σ lost² / Σ update²)`, or None when there is
    nothing to measure. Needs torch."""
    import torch

    lost = total = 0.0
    for weight, entries in layers:
        if not entries:
            continue
        src = torch.as_tensor(weight)
        if not src.is_floating_point() or src.dtype == torch.float32:
            continue
        w2 = src.reshape(-1, src.shape[-1])
        rows = torch.linspace(0, w2.shape[0] - 1, min(max_rows, w2.shape[0])).round().long().unique()
        base = w2[rows].to(torch.float32)
        delta = torch.zeros_like(base)
        flat = True
        for lora_a, lora_b, strength, rank, alpha in entries:
            a = torch.as_tensor(lora_a).to(torch.float32)
            b = torch.as_tensor(lora_b).to(torch.float32)
            if a.dim() > 2 or b.dim() > 2:
                flat = False
                break
            scale = strength
            if alpha is not None and rank is not None and alpha != rank:
                scale *= alpha / rank
            delta += scale * (b[rows] @ a)
        if not flat:
            continue
        exact = base + delta
        err = exact.to(src.dtype).to(torch.float32) - exact
        lost += float(err.square().sum())
        total += float(delta.square().sum())
    return (lost / total) ** 0.5 if total > 0 else None


def auto_merge_rounds_away(loss: float | None) -> bool:
    """`_auto_merge_rounds_away`'s verdict on a measured loss: keep the adapter unmerged above the threshold."""
    return loss is not None and loss > AUTO_MERGE_MAX_ROUNDING_LOSS


def check_adapters_per_target(
    num_adapters: int,
    merge_mode: str = "auto",
    *,
    fsdp_sharded: bool = False,
    quantized: bool = False,
    engine_version: str | None = None,
) -> bool:
    """`set_lora`'s rule for one target: dynamic LoRA takes one adapter. Returns whether it would merge."""
    merge = should_merge_lora(
        resolve_lora_merge_mode(merge_mode, engine_version=engine_version),
        fsdp_sharded=fsdp_sharded,
        quantized=quantized,
        engine_version=engine_version,
    )
    if not merge and num_adapters > 1:
        raise ValueError(MSG_DYNAMIC_ONE_ADAPTER)
    return merge


class SetLoraDecision(NamedTuple):
    """What `set_lora` decides before touching weights: `(module, merges)` in the order it decides them, and
    the adapters it loads, as `(nickname, path, lora_alpha)`."""

    decisions: list[tuple[str, bool]]
    loads: list[tuple[str, str, int | None]]


def _target_modules(target: str, modules: Collection[str]) -> list[str]:
    """`_get_target_lora_layers`: "all" is the transformer plus transformer_2 and critic when the pipeline has
    them; "transformer" is always there; a missing one gives nothing (SGLang logs a warning)."""
    if target == "all":
        return ["transformer"] + [m for m in ("transformer_2", "critic") if m in modules]
    if target == "transformer":
        return ["transformer"]
    return [target] if target in modules else []


def check_set_lora(
    lora_nickname: str | list[str],
    lora_path: str | None | list[str | None] = None,
    target: str | list[str] = "all",
    strength: float | list[float] = 1.0,
    merge_weights: bool | None = None,
    merge_mode: str | None = None,
    lora_alpha: int | None | list[int | None] = None,
    *,
    server_mode: str = "auto",
    loaded: Mapping[str, str] | None = None,
    modules: Collection[str] = ("transformer",),
    fsdp_sharded: Collection[str] = (),
    quantized: Collection[str] = (),
    engine_version: str | None = None,
) -> SetLoraDecision:
    """`LoRAPipeline.set_lora` up to the weights: its argument errors, in its order, and its decisions.

    `loaded` maps the nicknames already loaded to their paths; `modules` names the DiTs the pipeline has
    (`transformer`, `transformer_2`, `critic`); `fsdp_sharded`/`quantized` name those whose LoRA layers hold
    FSDP-sharded weights, or quantized weights that cannot take a merged delta. Loading an adapter and the
    `auto` rounding-loss rule need the files and weights: see `load_lora_adapter`.
    """
    mode = resolve_lora_merge_mode(merge_mode, merge_weights, server_mode, engine_version=engine_version)
    nicknames, paths, _strengths, targets, alphas = normalize_lora_params(
        lora_nickname, lora_path, strength, target, lora_alpha, engine_version=engine_version
    )
    check_targets(targets, engine_version=engine_version)
    loaded_paths = dict(loaded or {})
    loads: list[tuple[str, str, int | None]] = []
    for nickname, path, alpha in zip(nicknames, paths, alphas, strict=True):
        if nickname not in loaded_paths and path is None:
            raise ValueError(f"Adapter {nickname} not found in the pipeline. Please provide lora_path to load it.")
        if path is not None and loaded_paths.get(nickname) != path:
            loads.append((nickname, path, alpha))
            loaded_paths[nickname] = path
    groups: dict[str, int] = {}
    for tgt in targets:
        groups[tgt] = groups.get(tgt, 0) + 1
    decisions: list[tuple[str, bool]] = []
    for tgt, count in groups.items():
        names = _target_modules(tgt, modules)
        for i, name in enumerate(names):
            merge = should_merge_lora(
                mode,
                fsdp_sharded=name in fsdp_sharded,
                quantized=name in quantized,
                module_name=name,
                engine_version=engine_version,
            )
            decisions.append((name, merge))
            if i == 0 and not merge and count > 1:
                raise ValueError(MSG_DYNAMIC_ONE_ADAPTER)
    return SetLoraDecision(decisions, loads)
