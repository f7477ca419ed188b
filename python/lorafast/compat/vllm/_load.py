"""vLLM's `WorkerLoRAManager._load_adapter` for one adapter: helper, `validate_legal`, the model's LoRA load,
and (0.33) the manager's MoE-format and classification-head checks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat.vllm._lora_model import (
    LoraWeights,
    VLLMLoRA,
    from_lora_tensors,
    unexpected_error,
    unexpected_modules,
    weight_file_tensors,
)
from lorafast.compat.vllm._names import expected_lora_modules, since_033
from lorafast.compat.vllm._peft_helper import PEFTHelper, peft_helper, validate_helper


class LoRAAdapterNotFoundError(Exception):
    """vLLM's `vllm.exceptions.LoRAAdapterNotFoundError` (same name, same text)."""

    def __init__(self, lora_name: str, lora_path: str) -> None:
        self.message = f"Loading lora {lora_name} failed: No adapter found for {lora_path}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


# --- WorkerLoRAManager._load_adapter ----------------------------------------------------------------------


@dataclass(frozen=True)
class ClassificationHead:
    """The model's unique classification head as vLLM's LoRA manager sees it (0.33)."""

    name: str
    max_labels: int
    input_size: int
    pooling_task: str = "classify"


def _lora_of(lora: VLLMLoRA, module_name: str, is_pooling_model: bool) -> LoraWeights | None:
    """`LoRAModelManager._get_lora_layer_weights` for a text-only model."""
    name = module_name
    if is_pooling_model and name not in lora.loras and module_name.removeprefix("model.") in lora.loras:
        name = module_name.removeprefix("model.")
    return lora.loras.get(name)


def _check_moe_format(lora: VLLMLoRA, lora_id: int, moe_modules: Iterable[str], is_pooling_model: bool) -> None:
    """`_validate_moe_lora_format` (0.33): a fused (target_parameters) MoE LoRA under a 2-D MoE wrapper."""
    for module_name in moe_modules:
        weights = _lora_of(lora, module_name, is_pooling_model)
        if weights is not None and weights.lora_a_shape is not None:
            raise ValueError(
                f"LoRA adapter {lora_id} contains fused 3D MoE weights for {module_name!r}, but the model uses a "
                "2D MoE LoRA wrapper. Start the engine with enable_mixed_moe_lora_format=True "
                "(--enable-mixed-moe-lora-format) and set is_3d_lora_weight=True on the LoRA request."
            )


def _check_classification_head(lora: VLLMLoRA, head: ClassificationHead | None, is_pooling_model: bool) -> None:
    """`_validate_classification_head_lora` (0.33)."""
    if head is None:
        if lora.modules_to_save:
            raise ValueError(
                f"Cannot load full module {next(iter(lora.modules_to_save))!r}: the model does not expose a "
                "unique classification head."
            )
        return
    name = head.name
    full = lora.modules_to_save.get(name)
    if full is None:
        full = lora.modules_to_save.get(name.removeprefix("model."))
    head_lora = _lora_of(lora, name, is_pooling_model)
    if head.pooling_task == "token_classify" and (full is not None or head_lora is not None):
        raise ValueError(
            f"Classification head {name!r} uses request routing; token_classify requires a token-routed "
            "classification head."
        )
    if not lora.modules_to_save:
        return
    saved = next(iter(lora.modules_to_save))
    if full is None:
        raise ValueError(f"Full module {saved!r} does not match the model's classification head {name!r}.")
    weight, bias = full
    if len(weight) != 2 or weight[0] < 1 or weight[0] > head.max_labels or weight[1] != head.input_size:
        raise ValueError(
            f"Full module {saved!r} for {name!r} has an incompatible weight shape: expected "
            f"(1..{head.max_labels}, {head.input_size}), received {tuple(weight)}."
        )
    if bias is not None and tuple(bias) != (weight[0],):
        raise ValueError(
            f"Full module {saved!r} for {name!r} has an incompatible bias shape: expected "
            f"{(weight[0],)}, received {tuple(bias)}."
        )


@dataclass(frozen=True)
class Model:
    """What `_load_adapter` reads from the model and the worker (see `load_adapter`)."""

    expected: Any
    max_lora_rank: int
    max_position_embeddings: int | None
    vocab_size: int | None
    mapper: Any
    moe_modules: tuple[str, ...]
    classification_head: ClassificationHead | None
    is_pooling_model: bool
    unsupported: frozenset[str] = frozenset()
    """0.34's `unsupported_lora_modules`: full names of layers vLLM leaves unwrapped."""
    check_model: bool = True
    """False: the model is not described; the model-dependent steps are skipped."""


def rename_mapper(hf_to_vllm_mapper: Any) -> Any:
    mapper = hf_to_vllm_mapper.get_rename_mapper() if hasattr(hf_to_vllm_mapper, "get_rename_mapper") else None
    return hf_to_vllm_mapper if mapper is None else mapper


def read_helper(path: str, lora_name: str, model: Model, engine_version: str | None) -> tuple[str, PEFTHelper]:
    """`_load_adapter` up to `PEFTHelper.from_local_dir`: the absolute path and the helper (vLLM's errors)."""
    lora_path = path
    if not os.path.isabs(lora_path) and os.path.exists(lora_path):  # get_adapter_absolute_path
        lora_path = os.path.abspath(lora_path)
    try:
        helper = peft_helper(lora_path, model.max_position_embeddings, engine_version=engine_version)
    except FileNotFoundError as exc:
        raise LoRAAdapterNotFoundError(lora_name, path) from exc
    return lora_path, helper


def load_rest(
    lora_path: str,
    helper: PEFTHelper,
    lora_int_id: int,
    model: Model,
    engine_version: str | None,
    tensors_of: Callable[[str], Mapping[str, tuple[int, ...] | None]] | None = None,
) -> VLLMLoRA:
    """`_load_adapter` after the helper: `validate_legal`, the weight file, the expected-module check,
    `LoRAModel.from_lora_tensors` and (0.33) the manager's MoE-format and classification-head checks.
    `tensors_of` replaces the folder's weight file for an in-memory adapter (`preflight` on an `AdapterView`)."""
    validate_helper(helper, model.max_lora_rank, engine_version)
    tensors = weight_file_tensors(lora_path) if tensors_of is None else tensors_of(lora_path)
    if model.check_model:
        unexpected = unexpected_modules(
            tensors, model.expected, helper.modules_to_save, model.mapper, model.unsupported, engine_version
        )
        if unexpected:
            raise unexpected_error(lora_path, model.expected, unexpected)
    lora = from_lora_tensors(tensors, helper, model.vocab_size, model.mapper, engine_version)
    if since_033(engine_version) and model.check_model:
        _check_moe_format(lora, lora_int_id, model.moe_modules, model.is_pooling_model)
        _check_classification_head(lora, model.classification_head, model.is_pooling_model)
    return lora


def load_adapter(
    path: str | os.PathLike[str],
    *,
    supported_lora_modules: Iterable[str],
    packed_modules_mapping: Mapping[str, list[str]] | None = None,
    max_lora_rank: int = 16,
    max_position_embeddings: int | None = None,
    vocab_size: int | None = None,
    hf_to_vllm_mapper: Any = None,
    lora_name: str | None = None,
    lora_int_id: int = 1,
    moe_modules: Iterable[str] = (),
    classification_head: ClassificationHead | None = None,
    is_pooling_model: bool = False,
    unsupported_lora_modules: Iterable[str] = (),
    engine_version: str | None = None,
) -> VLLMLoRA:
    """`WorkerLoRAManager._load_adapter` for one adapter folder, from its config and weight headers.

    The model is described by what vLLM's LoRA manager reads from it: `supported_lora_modules` (module
    leaves), `packed_modules_mapping` (including `experts` for MoE models; None: Llama's qkv/gate_up
    packing), `hf_to_vllm_mapper` (vLLM's
    `WeightsMapper` or this module's; its renames are applied), `vocab_size`, `max_position_embeddings`,
    the MoE layers' names under 2-D wrappers (`moe_modules`), the classification head and (0.34) the full
    names of layers whose leaf is a LoRA module but that vLLM does not wrap (`unsupported_lora_modules`, the
    manager's set of that name: BERT's `bert.pooler.dense`).
    """
    given = os.fspath(path)
    name = os.path.basename(given.rstrip("/")) if lora_name is None else lora_name
    model = Model(
        expected_lora_modules(supported_lora_modules, packed_modules_mapping),
        max_lora_rank,
        max_position_embeddings,
        vocab_size,
        rename_mapper(hf_to_vllm_mapper),
        tuple(moe_modules),
        classification_head,
        is_pooling_model,
        frozenset(unsupported_lora_modules),
    )
    lora_path, helper = read_helper(given, name, model, engine_version)
    return load_rest(lora_path, helper, lora_int_id, model, engine_version)
