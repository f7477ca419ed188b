"""Shared-outer detection (`LoRAManager._detect_shared_outer_loras`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector
from lorafast.compat.sglang._config import load_weights, memoized, resolve_views, text_config_of
from lorafast.compat.sglang._names import (
    MSG_MIXED_SHARED_OUTER,
)
from lorafast.compat.sglang._weights import LoadedWeights
from lorafast.formats.moe import NUMBERED_EXPERT


def _shared_flags(weights: LoadedWeights, legacy: bool) -> tuple[bool | None, frozenset[bool]]:
    """(first verdict, all verdicts) of the gate_up lora_A tensors that count, in SGLang's scan order."""
    first: bool | None = None
    seen: set[bool] = set()
    for _layer_id, name, shape in weights.iter_layer_weights():
        if "gate_up_proj" not in name or "lora_A" not in name or shape is None:
            continue
        if len(shape) == 3:
            is_shared = shape[0] == 1
        elif legacy or not NUMBERED_EXPERT.search(name):
            continue
        else:
            is_shared = False  # numbered 2D per-expert weights count against the agreement too
        if first is None:
            first = is_shared
        seen.add(is_shared)
        if legacy:
            break  # before SGLang PR #31681: the first 3D gate_up lora_A of each adapter decides
    return first, frozenset(seen)


def shared_outer_verdicts(weights: LoadedWeights) -> frozenset[bool]:
    """What one adapter says under `_detect_shared_outer_loras`'s rule: True for each shared-outer gate_up lora_A
    (3-D, expert dim 1), False for each per-expert one (3-D with E > 1, or numbered 2-D `experts.N.`); empty when
    no tensor counts. Both: SGLang rejects the adapter even alone (`MSG_MIXED_SHARED_OUTER`)."""
    return _shared_flags(weights, legacy=False)[1]


def detect_shared_outer(
    loaded: list[LoadedWeights], *, legacy: bool, col: Collector, memo: dict[Any, Any] | None = None
) -> bool:
    shared_outer: bool | None = None
    for weights in loaded:
        first, seen = memoized(memo, ("detect", id(weights.layers), legacy), lambda w=weights: _shared_flags(w, legacy))
        if shared_outer is None:
            shared_outer = first
        if shared_outer is not None and (not shared_outer) in seen:
            error = RuntimeError(MSG_MIXED_SHARED_OUTER.format(adapter_id=weights.lora_id))
            col.fail("sglang_mixed_shared_outer", error, stage="startup", adapter_id=weights.lora_id)
    return bool(shared_outer) if shared_outer is not None else False


def detect_shared_outer_loras(
    adapters: Any,
    *,
    legacy: bool = False,
    base_config: Mapping[str, Any] | None = None,
    engine_version: str | None = None,
) -> bool:
    """`LoRAManager._detect_shared_outer_loras` over `adapters` (keyed by adapter id, in load order).

    Looks only at `gate_up_proj` lora_A tensors after normalization: a 3D tensor is shared when its expert
    dimension is 1; a numbered 2D `experts.N.` tensor is per-expert; everything else is skipped. Every
    tensor of every adapter is checked. Disagreement raises SGLang's RuntimeError naming the adapter id.
    `legacy=True` is the behaviour before SGLang PR #31681: 3D tensors only, first match per adapter.
    """
    _versions.resolve("sglang", engine_version)
    views = resolve_views(adapters)
    cfg = text_config_of(base_config)
    loaded = [load_weights(v, base_config=cfg) for v in views]
    return detect_shared_outer(loaded, legacy=legacy, col=Collector(collect=False))
