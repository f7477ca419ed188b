"""vLLM's `LoRAModel.from_local_checkpoint`: the expected-module check, the weight file, per-module rank and
scaling (`rank_pattern`/`alpha_pattern`), `from_lora_tensors` on names and shapes."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat._inputs import read_names_and_shapes
from lorafast.compat.vllm._inputs import memory_tensors
from lorafast.compat.vllm._names import is_base_embedding, parse_fine_tuned_lora_name, since_033, since_034
from lorafast.compat.vllm._peft_helper import PEFTHelper, adapter_source, helper_of
from lorafast.errors import HeaderError

# --- LoRAModel.from_local_checkpoint -----------------------------------------------------------------------


def unexpected_modules(
    names: Iterable[str],
    expected: Any,
    modules_to_save: Any,
    weights_mapper: Any,
    unsupported: Iterable[str],
    engine_version: str | None,
) -> list[str]:
    unexpected: list[str] = []
    # 0.34: layers whose leaf name is expected but that vLLM does not wrap (BERT's pooler.dense)
    unwrapped = frozenset(unsupported) if since_034(engine_version) else frozenset()
    for key in names:
        if is_base_embedding(key) or "base_layer" in key:
            continue
        module, _ = parse_fine_tuned_lora_name(key, weights_mapper, engine_version=engine_version)
        base = module.rsplit(".", 1)[-1]
        if ".experts" in module:
            if module[module.find(".experts") + 1 :] not in expected:
                unexpected.append(module)
        elif base not in expected and (not since_033(engine_version) or base not in (modules_to_save or ())):
            unexpected.append(module)
        elif module in unwrapped:
            unexpected.append(f"{module} (not a LoRA layer)")
    return unexpected


def unexpected_error(lora_dir: str, expected: Any, unexpected: list[str]) -> ValueError:
    return ValueError(
        f"While loading {lora_dir}, expected target modules in {expected} but received {unexpected}. "
        "Please verify that the loaded LoRA module is correct"
    )


def check_unexpected_modules(
    adapter: Any,
    expected_lora_modules: Any,
    *,
    weights_mapper: Any = None,
    unsupported_lora_modules: Iterable[str] = (),
    lora_dir: str | None = None,
    engine_version: str | None = None,
) -> None:
    """`LoRAModel.from_local_checkpoint`'s name check, on the helper `PEFTHelper.from_local_dir` builds (its
    errors first) and the tensor names of the one file vLLM reads (its errors next).

    Keys containing `base_layer` are skipped; an expert module is compared from `experts` on, any other
    module by its last component (0.33: or a `modules_to_save` name; 0.34: a module named in
    `unsupported_lora_modules`, the model's unwrapped layers, is "(not a LoRA layer)"). `expected_lora_modules`
    is printed as given: pass the set `expected_lora_modules()` builds, as vLLM does.
    """
    path, view = adapter_source(adapter)
    tensors: Mapping[str, tuple[int, ...] | None]
    if view is None:
        saved, tensors = helper_of(path, None, engine_version).modules_to_save, weight_file_tensors(path)
    else:  # in memory: its config, when it has one, names the saved modules
        saved = None if view.config is None else helper_of(path, view, engine_version).modules_to_save
        tensors = memory_tensors(view)(path)
    unexpected = unexpected_modules(
        tensors, expected_lora_modules, saved, weights_mapper, unsupported_lora_modules, engine_version
    )
    if unexpected:
        raise unexpected_error(path if lora_dir is None else lora_dir, expected_lora_modules, unexpected)


@dataclass(frozen=True)
class LoraWeights:
    """One entry of `LoRAModel.loras`: rank and scaling as vLLM computes them, and the tensor shapes."""

    rank: int
    scaling: float
    lora_a_shape: tuple[int, ...] | None
    lora_b_shape: tuple[int, ...] | None


@dataclass(frozen=True)
class VLLMLoRA:
    """What `_load_adapter` returns: the `LoRAModel`'s rank, its LoRA modules and (0.33) its full modules."""

    rank: Any
    loras: dict[str, LoraWeights]
    modules_to_save: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]]


def _pattern_value(pattern: Mapping[str, Any], name: str) -> Any:
    """`PEFTHelper._match_pattern`. vLLM matches with the `regex` package, which differs from `re` on keys
    (variable-width lookbehind, `\\p{L}`, inline flags, error texts), so `regex` answers when installed (it is a
    vLLM dependency); without it, a key `re` cannot read as `regex` would is refused, never guessed."""
    for key, value in pattern.items():
        if _regex_match(rf"(.*\.)?({key})$", name):
            return value
    return None


class UnknownPatternError(ValueError):
    """A `rank_pattern`/`alpha_pattern` key that only vLLM's `regex` package can evaluate, and it is not installed:
    lorafast cannot tell what vLLM decides."""


def _regex_match(pattern: str, name: str) -> bool:
    try:
        import regex
    except ImportError:
        return _re_match(pattern, name)
    return regex.match(pattern, name) is not None


def _re_match(pattern: str, name: str) -> bool:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # `re`'s FutureWarning marks syntax that `regex` reads differently
            return re.match(pattern, name) is not None
    except (re.error, FutureWarning) as exc:
        raise UnknownPatternError(
            f"lorafast: cannot evaluate the pattern {pattern!r} as vLLM does without the `regex` package ({exc})"
        ) from None


def _rank_and_scaling(helper: PEFTHelper, module_name: str) -> tuple[Any, float]:
    """0.33's `PEFTHelper.get_rank_and_scaling`."""
    if not helper.rank_pattern and not helper.alpha_pattern:
        return helper.r, helper.scaling
    if module_name.endswith(".experts.base_layer"):
        module_name = module_name.removesuffix(".base_layer") + ".gate_up_proj"
    elif module_name.endswith(".experts"):
        module_name += ".down_proj"
    rank = _pattern_value(helper.rank_pattern, module_name)
    rank = helper.r if rank is None else rank
    alpha = _pattern_value(helper.alpha_pattern, module_name)
    alpha = helper.lora_alpha if alpha is None else alpha
    return rank, (alpha / math.sqrt(rank) if helper.use_rslora else alpha / rank)


def weight_file_tensors(lora_dir: str) -> dict[str, tuple[int, ...] | None]:
    """Tensor names and shapes of the one file vLLM reads (`adapter_model.safetensors`, else `.bin`, else `.pt`;
    other files in the folder are never read), headers only; vLLM's ValueError when there is none."""
    st = os.path.join(lora_dir, "adapter_model.safetensors")
    if os.path.isfile(st):
        return _safetensors_header(st)
    for name in ("adapter_model.bin", "adapter_model.pt"):
        file = os.path.join(lora_dir, name)
        if os.path.isfile(file):
            # The core's restricted reader: names and shapes in the saved order, the pickle never run.
            from lorafast import read_torch_header

            return {key: tuple(info.shape) for key, info in read_torch_header(file).tensors.items()}
    raise ValueError(f"{lora_dir} doesn't contain tensors")


def _safetensors_header(file: str) -> dict[str, tuple[int, ...] | None]:
    """Names and shapes as vLLM's `safetensors.safe_open` reads them. The core is stricter than safetensors (a
    repeated name) and words its errors its own way, so a header it refuses is read again, header only, by the
    `safetensors` package when installed (it always is beside vLLM): that raises vLLM's `SafetensorError`, text
    and all, or gives what vLLM loads. Without the package the core's HeaderError stands."""
    try:
        return read_names_and_shapes(file)
    except HeaderError as exc:
        try:
            from safetensors import safe_open
        except ImportError:
            raise exc from None
        with safe_open(file, framework="numpy") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def from_lora_tensors(
    tensors: Mapping[str, tuple[int, ...] | None],
    helper: PEFTHelper,
    vocab_size: int | None,
    weights_mapper: Any,
    engine_version: str | None,
) -> VLLMLoRA:
    """`LoRAModel.from_lora_tensors` on names and shapes."""
    new = since_033(engine_version)
    saved_names = (helper.modules_to_save or []) if new else []
    full: dict[str, dict[str, tuple[int, ...] | None]] = {}
    loras: dict[str, list[Any]] = {}
    for key, shape in tensors.items():
        if is_base_embedding(key):
            continue
        module, is_a = parse_fine_tuned_lora_name(key, weights_mapper, engine_version=engine_version)
        if module in saved_names:
            full.setdefault(module, {})[key.split(".")[-1]] = shape
            continue
        if module not in loras:
            if new:
                peft_name, _ = parse_fine_tuned_lora_name(key, engine_version=engine_version)
                rank, scaling = _rank_and_scaling(helper, peft_name)
            else:
                rank, scaling = helper.r, helper.scaling
            loras[module] = [rank, scaling, None, None]
        if is_a:
            if "lora_embedding_A" in key and vocab_size is not None and vocab_size != (shape or ())[1]:
                raise RuntimeError(
                    f"The embedding LoRA size({shape[1]}) must be consistent"  # type: ignore[index]
                    f" with the base model's vocabulary size({vocab_size})."
                )
            loras[module][2] = shape
        else:
            loras[module][3] = shape
    saved: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
    for module, params in full.items():
        weight = params.get("weight")
        if weight is None:
            raise ValueError(f"Full module {module!r} is missing weight.")
        saved[module] = (weight, params.get("bias"))
    if len(saved) > 1:
        raise ValueError(f"Only one full classification module is supported per adapter, received {sorted(saved)}.")
    return VLLMLoRA(helper.r, {k: LoraWeights(*v) for k, v in loras.items()}, saved)
