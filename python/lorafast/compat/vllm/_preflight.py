"""vLLM's load path on a set of adapters: `preflight`, `smallest_max_lora_rank`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector, CompatProblem
from lorafast.compat._inputs import resolve_adapters
from lorafast.compat.vllm._inputs import adapter_entries, memory_tensors
from lorafast.compat.vllm._load import (
    ClassificationHead,
    LoRAAdapterNotFoundError,
    Model,
    load_rest,
    read_helper,
    rename_mapper,
)
from lorafast.compat.vllm._lora_model import VLLMLoRA
from lorafast.compat.vllm._names import expected_lora_modules as _expected_modules
from lorafast.compat.vllm._names import since_033
from lorafast.compat.vllm._peft_helper import helper_from_config

#: `LoRAConfig.max_lora_rank: Literal[...]` in `vllm/config/lora.py` (0.30.0 and 0.33.0).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# --- sets of adapters -------------------------------------------------------------------------------------


def smallest_max_lora_rank(adapters: Any, *, engine_version: str | None = None) -> int | None:
    """The smallest `--max-lora-rank` vLLM accepts that fits every adapter (None: above 512). The rank is `r`,
    and from 0.33 the largest `rank_pattern` value too, as `validate_legal` takes it."""
    new = since_033(engine_version)
    ranks = []
    for view in resolve_adapters(adapters):
        config = view.config or {}
        pattern = (config.get("rank_pattern") or {}) if new else {}
        ranks.append(int(max([config.get("r") or 0, *pattern.values()])))
    need = max(ranks, default=0)
    return next((value for value in VLLM_MAX_LORA_RANKS if value >= need), None)


@dataclass(frozen=True)
class VLLMPlan:
    """The result of `preflight`: the rank the set needs, every problem found, and what each adapter loads as.

    `loras` maps each adapter's name to what `_load_adapter` builds for it (adapters vLLM rejects are absent).
    `skipped` names the load steps that need the model and were not run because it was not described
    (`supported_lora_modules` or `expected_lora_modules`); empty when the verdict is vLLM's whole load path.
    """

    max_rank: int
    suggested_max_lora_rank: int | None
    problems: tuple[CompatProblem, ...]
    loras: Mapping[str, VLLMLoRA] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    engine_version: _versions.EngineRules | None = field(default=None, compare=False)
    """The vLLM version answered for, and whether lorafast verified it (`status`)."""

    @property
    def ok(self) -> bool:
        return not any(p.fatal for p in self.problems)

    @property
    def verdict(self) -> str:
        """`"ok"`, `"fails"`, or `"unknown"` when the set would load but the version is not verified."""
        if not self.ok:
            return "fails"
        return "ok" if self.engine_version is None or self.engine_version.verified else "unknown"


_MODEL_STEPS = ("expected_modules", "moe_format", "classification_head")


def preflight(
    adapters: Any,
    *,
    max_lora_rank: int = 16,
    supported_lora_modules: Iterable[str] | None = None,
    packed_modules_mapping: Mapping[str, list[str]] | None = None,
    expected_lora_modules: Any = None,
    max_position_embeddings: int | None = None,
    vocab_size: int | None = None,
    hf_to_vllm_mapper: Any = None,
    weights_mapper: Any = None,
    moe_modules: Iterable[str] = (),
    classification_head: ClassificationHead | None = None,
    is_pooling_model: bool = False,
    unsupported_lora_modules: Iterable[str] = (),
    first_lora_int_id: int = 1,
    collect: bool = False,
    engine_version: str | None = None,
    strict_version: bool = False,
) -> VLLMPlan:
    """`WorkerLoRAManager._load_adapter` for every adapter of a set: each adapter is decided by the code of
    `load_adapter` (config, `validate_legal`, weight file, expected modules, `from_lora_tensors`, and in 0.33
    the MoE-format and classification-head checks), so a rejection has vLLM's exception type and text.

    The model is described as for `load_adapter` (`supported_lora_modules`, `packed_modules_mapping`, ...), or
    by `expected_lora_modules` (the expanded module set itself). Without either, the model-dependent steps are
    skipped and listed in `VLLMPlan.skipped`. `weights_mapper` is an older name of `hf_to_vllm_mapper`.
    Adapters get vLLM int ids `first_lora_int_id`, +1, ... in order (only the MoE-format message prints one).
    `max_lora_rank` outside `VLLM_MAX_LORA_RANKS` is reported first (vLLM's config validation rejects it).
    Raises the first error unless `collect=True`; then every problem is in `VLLMPlan.problems`.
    `VLLMPlan.engine_version` says which version answered and whether lorafast verified it; an unverified one
    warns `UnverifiedEngineVersion` and `strict_version=True` raises `UnverifiedEngineVersionError` instead.
    """
    rules = _versions.rules_for("vllm", engine_version, strict=strict_version)
    col = Collector(collect)
    if max_lora_rank not in VLLM_MAX_LORA_RANKS:
        col.fail(
            "vllm_max_lora_rank_value",
            ValueError(f"lorafast: vLLM accepts --max-lora-rank in {list(VLLM_MAX_LORA_RANKS)}, not {max_lora_rank}"),
            stage="config",
        )
    if supported_lora_modules is not None:
        expected: Any = _expected_modules(supported_lora_modules, packed_modules_mapping)
    elif expected_lora_modules is not None:
        expected = expected_lora_modules if isinstance(expected_lora_modules, set) else set(expected_lora_modules)
    else:
        expected = None
    model = Model(
        expected,
        max_lora_rank,
        max_position_embeddings,
        vocab_size,
        rename_mapper(hf_to_vllm_mapper if hf_to_vllm_mapper is not None else weights_mapper),
        tuple(moe_modules),
        classification_head,
        is_pooling_model,
        frozenset(unsupported_lora_modules),
        check_model=expected is not None,
    )
    ranks: list[Any] = []
    loras: dict[str, VLLMLoRA] = {}
    for i, (name, adapter_id, path, view) in enumerate(adapter_entries(adapters)):
        try:
            if view is None:
                lora_path, helper = read_helper(path, name, model, engine_version)
                tensors_of = None
            else:
                if view.config is None:
                    raise LoRAAdapterNotFoundError(name, path)
                lora_path = path
                helper = helper_from_config(dict(view.config), max_position_embeddings, engine_version)
                tensors_of = memory_tensors(view)
            ranks.append(max([helper.r, *(helper.fields.get("rank_pattern") or {}).values()]))
            loras[name] = load_rest(lora_path, helper, first_lora_int_id + i, model, engine_version, tensors_of)
        except Exception as exc:  # whatever vLLM's load path raises is its verdict on this adapter
            col.fail("vllm_load", exc, stage="load", adapter_id=adapter_id, adapter_name=name)
    need = int(max(ranks, default=0))
    suggested = next((value for value in VLLM_MAX_LORA_RANKS if value >= need), None)
    skipped = () if model.check_model else _MODEL_STEPS
    return VLLMPlan(need, suggested, tuple(col.problems), loras, skipped, engine_version=rules)
