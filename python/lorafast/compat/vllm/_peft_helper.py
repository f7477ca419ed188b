"""vLLM's `PEFTHelper`: `from_local_dir`/`from_dict` and `validate_legal`, version by version."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat._inputs import AdapterView
from lorafast.compat.vllm._inputs import adapter_entries
from lorafast.compat.vllm._names import CLASSIFIERS, since_033, since_034

# PEFTHelper's dataclass fields, in declaration order, per version; the first three are required.
_PEFT_FIELDS = ("r", "lora_alpha", "target_modules", "bias", "modules_to_save", "use_rslora", "use_dora")
_VLLM_FIELDS = ("vllm_lora_scaling_factor", "vllm_max_position_embeddings")
_FIELDS_030 = (*_PEFT_FIELDS, *_VLLM_FIELDS)
_FIELDS_033 = (
    *_PEFT_FIELDS,
    "lora_bias",
    "init_lora_weights",
    "alora_invocation_tokens",
    "layer_replication",
    "use_bdlora",
    "use_qalora",
    "rank_pattern",
    "alpha_pattern",
    *_VLLM_FIELDS,
)
# 0.34 reads PEFT's task_type: a SEQ_CLS/TOKEN_CLS adapter's modules_to_save gains classifier and score.
_FIELDS_034 = (*_FIELDS_033[:5], "task_type", *_FIELDS_033[5:])
_CLS_TASKS = ("SEQ_CLS", "TOKEN_CLS")
_REQUIRED = ("r", "lora_alpha", "target_modules")
_DEFAULTS: dict[str, Any] = {
    "bias": "none",
    "modules_to_save": None,
    "task_type": None,
    "use_rslora": False,
    "use_dora": False,
    "lora_bias": False,
    "init_lora_weights": True,
    "alora_invocation_tokens": None,
    "layer_replication": None,
    "use_bdlora": None,
    "use_qalora": False,
    "rank_pattern": None,
    "alpha_pattern": None,
    "vllm_lora_scaling_factor": 1.0,
    "vllm_max_position_embeddings": False,
}
# init_lora_weights strings 0.33 accepts: they only set the initial weights (peft_helper._init_is_supported).
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
_INIT_TEXT = (
    "vLLM does not support init_lora_weights={init!r}. Inits such as PiSSA, OLoRA, CorDA and LoftQ modify the "
    "base model weights when PEFT loads the adapter. Convert it to a regular LoRA adapter with PEFT's "
    "path_initial_model_for_weight_conversion, or set init_lora_weights to true if the served base model "
    "already contains the modified weights."
)


# --- PEFTHelper --------------------------------------------------------------------------------------------


@dataclass
class PEFTHelper:
    """The fields of vLLM's `PEFTHelper` after `from_dict` and `__post_init__` (values as in the JSON)."""

    fields: dict[str, Any]
    scaling: float

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None


def _peft_helper_from_dict(config: Any, engine_version: str | None) -> PEFTHelper:
    new = since_033(engine_version)
    names = (_FIELDS_034 if since_034(engine_version) else _FIELDS_033) if new else _FIELDS_030
    required = {name for name in names if name in _REQUIRED}
    missing = required - set(config.keys())
    if missing:
        raise ValueError(f"Missing required configuration fields: {missing}")
    fields: dict[str, Any] = {name: _DEFAULTS.get(name) for name in names}
    fields.update({k: v for k, v in config.items() if k in names})
    r = fields["r"]
    if r <= 0:
        raise ValueError(f"LoRA rank `r` must be a positive integer, got {r}.")
    if new:
        fields["rank_pattern"] = fields["rank_pattern"] or {}
        fields["alpha_pattern"] = fields["alpha_pattern"] or {}
        for key, rank in fields["rank_pattern"].items():
            if not isinstance(rank, int) or rank <= 0:
                raise ValueError(f"LoRA rank for `{key}` in `rank_pattern` must be a positive integer, got {rank}.")
    if fields.get("task_type") in _CLS_TASKS:  # 0.34's __post_init__, same expression (a `5` is its TypeError)
        fields["modules_to_save"] = list(dict.fromkeys([*(fields["modules_to_save"] or []), *CLASSIFIERS]))
    alpha = fields["lora_alpha"]
    scaling = alpha / math.sqrt(r) if fields["use_rslora"] else alpha / r
    fields["vllm_lora_scaling_factor"] = scaling
    return PEFTHelper(fields, scaling)


def peft_helper(
    path: str, max_position_embeddings: int | None = None, *, engine_version: str | None = None
) -> PEFTHelper:
    """`PEFTHelper.from_local_dir`: reads `adapter_config.json` as vLLM does (same exceptions)."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    return helper_from_config(config, max_position_embeddings, engine_version)


def helper_from_config(config: Any, max_position_embeddings: int | None, engine_version: str | None) -> PEFTHelper:
    config["vllm_max_position_embeddings"] = max_position_embeddings
    return _peft_helper_from_dict(config, engine_version)


def _validate_features(helper: PEFTHelper, new: bool) -> list[str]:
    errors: list[str] = []
    if helper.modules_to_save:
        if not new:
            errors.append("vLLM only supports modules_to_save being None.")
        else:
            unsupported = [m for m in helper.modules_to_save if m not in CLASSIFIERS]
            if unsupported:
                errors.append(
                    "vLLM only supports modules_to_save being either None "
                    'or ["classifier", "score"] for classification models. '
                    f"Unsupported modules_to_save: {unsupported}"
                )
    if helper.use_dora:
        errors.append("vLLM does not yet support DoRA.")
    if not new:
        return errors
    if helper.lora_bias:
        errors.append("vLLM does not support LoRA bias (lora_bias).")
    init = helper.init_lora_weights
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        errors.append(_INIT_TEXT.format(init=init))
    if helper.alora_invocation_tokens:
        errors.append("vLLM does not support Activated LoRA (aLoRA).")
    if helper.layer_replication:
        errors.append("vLLM does not support layer_replication.")
    if helper.use_bdlora:
        errors.append("vLLM does not support block-diagonal LoRA (BD-LoRA).")
    if helper.use_qalora:
        errors.append("vLLM does not support QALoRA.")
    return errors


def validate_helper(helper: PEFTHelper, max_lora_rank: int, engine_version: str | None) -> None:
    new = since_033(engine_version)
    errors = _validate_features(helper, new)
    rank = max([helper.r, *helper.rank_pattern.values()]) if new else helper.r
    if rank > max_lora_rank:
        errors.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    if helper.bias != "none":
        errors.append("Adapter bias is not supported.")
    if errors:
        raise ValueError(" ".join(errors))


def adapter_source(adapter: Any) -> tuple[str, AdapterView | None]:
    """(path, None) for one adapter on disk (a path, or a scanned adapter whose path exists), which is read as
    vLLM reads that folder, whatever a scan made of it; (path, view) for one held in memory."""
    ((_, _, path, view),) = adapter_entries(adapter)
    return path, view


def helper_of(path: str, view: AdapterView | None, engine_version: str | None) -> PEFTHelper:
    """`PEFTHelper.from_local_dir(path)` (a missing, broken or non-PEFT `adapter_config.json`, or a file given
    for a folder, raises what vLLM raises), or the helper of an in-memory view's config."""
    if view is None:
        return peft_helper(path, engine_version=engine_version)
    return helper_from_config(dict(view.config or {}), None, engine_version)


def check_peft_helper(adapter: Any, *, engine_version: str | None = None) -> Mapping[str, Any]:
    """`PEFTHelper.from_local_dir` (`from_dict` for an adapter in memory): the config file as vLLM reads it,
    required fields, rank (and 0.33's rank_pattern) checks, 0.34's classification `task_type`.

    Returns the helper's fields (config values with vLLM's defaults, and `vllm_lora_scaling_factor`).
    """
    return helper_of(*adapter_source(adapter), engine_version).fields


def validate_legal(adapter: Any, max_lora_rank: int = 16, *, engine_version: str | None = None) -> None:
    """`PEFTHelper.validate_legal`: every failed rule, joined with spaces, in one ValueError.

    0.30: modules_to_save, DoRA, `r` above `max_lora_rank`, bias. 0.33 adds `["classifier", "score"]` as
    allowed modules_to_save, lora_bias, PiSSA-like inits, aLoRA, layer_replication, BD-LoRA and QALoRA, and
    takes the rank as the max over `r` and the `rank_pattern` values.
    """
    validate_helper(helper_of(*adapter_source(adapter), engine_version), max_lora_rank, engine_version)
