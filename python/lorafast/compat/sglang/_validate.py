"""`validate_new_adapter` and `LoRAMemoryPool.can_support`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector, LoraRef
from lorafast.compat._inputs import AdapterView
from lorafast.compat.sglang._config import AdapterConfig, logger, read_lora_config, resolve_views
from lorafast.compat.sglang._names import (
    MSG_ADDED_TOKENS,
    MSG_ALREADY_LOADED,
    MSG_DORA,
    MSG_INCOMPATIBLE,
    MSG_PINNED,
    MSG_SAME_PATH,
    get_normalized_target_modules,
)


@dataclass(frozen=True)
class MemoryPool:
    """The part of SGLang's `LoRAMemoryPool` that `can_support` reads (an `SGLangPlan` works too)."""

    max_lora_rank: int
    target_modules: frozenset[str]
    lora_added_tokens_size: int = 0


def _can_support_one(pool: Any, config: AdapterConfig) -> bool:
    if config.r > pool.max_lora_rank:
        return False
    if config.lora_added_tokens_size > pool.lora_added_tokens_size:
        return False
    normalized = get_normalized_target_modules(config.target_modules)
    return "all" in normalized or normalized.issubset(set(pool.target_modules))


def can_support(
    memory_pool: Any, adapters: Any, *, base_vocab_size: int | None = None, engine_version: str | None = None
) -> bool:
    """`LoRAMemoryPool.can_support`: every adapter fits the pool's rank, added tokens and target modules.

    SGLang's configs drop "fake" added tokens (ids below the base vocabulary) before this check: the vocabulary
    size comes from `base_vocab_size`, else from the pool's `base_config` (an `SGLangPlan` has one).
    """
    _versions.resolve("sglang", engine_version)
    if base_vocab_size is None:
        base = getattr(memory_pool, "base_config", None)
        base_vocab_size = base.get("vocab_size") if base else None
    return all(_can_support_one(memory_pool, read_lora_config(v, base_vocab_size)) for v in resolve_views(adapters))


def _refs(loaded: Any) -> list[Any]:
    """Already loaded adapters as objects with `name`, `path`, `pinned` (LoraRefs and views pass through)."""
    if not loaded:
        return []
    if isinstance(loaded, Mapping) or not isinstance(loaded, Iterable) or isinstance(loaded, str):
        return list(resolve_views(loaded))
    out = []
    for item in loaded:
        if isinstance(item, (LoraRef, AdapterView)):
            out.append(item)
        else:
            out.extend(resolve_views([item]))
    return out


class LoadedIndex:
    """The adapters loaded so far (`LoRAManager.lora_refs`), indexed so each new load is checked in O(1)."""

    def __init__(self, refs: Iterable[Any] = ()) -> None:
        self.count = 0
        self.num_pinned = 0
        self.first_by_name: dict[str, int] = {}
        self.by_path: dict[str, list[tuple[int, str]]] = {}
        self.refs: list[Any] = []
        for ref in refs:
            self.add(ref)

    def add(self, ref: Any) -> None:
        self.first_by_name.setdefault(ref.name, self.count)
        self.by_path.setdefault(ref.path, []).append((self.count, ref.name))
        self.num_pinned += int(bool(ref.pinned))
        self.refs.append(ref)
        self.count += 1


def collect_new_adapter(
    view: AdapterView,
    config: AdapterConfig,
    loaded: LoadedIndex,
    *,
    memory_pool: Any,
    max_loras_per_batch: int,
    col: Collector | None,
) -> list[str]:
    warnings: list[str] = []
    if config.lora_added_tokens_size > 0:
        raise ValueError(MSG_ADDED_TOKENS.format(name=view.name))
    if config.use_dora:
        raise ValueError(MSG_DORA.format(name=view.name))
    # SGLang walks the loaded refs in order: a same-path warning for each, until a same-name one raises.
    stop = loaded.first_by_name.get(view.name, loaded.count)
    for index, old_name in loaded.by_path.get(view.path, ()):
        if index >= stop:
            break
        message = MSG_SAME_PATH.format(path=view.path, old=old_name, new=view.name)
        logger.warning(message)
        warnings.append(message)
        if col is not None:
            col.warn("sglang_same_path", message, stage="load", adapter_id=view.lora_id, adapter_name=view.name)
    if stop < loaded.count:
        raise ValueError(MSG_ALREADY_LOADED.format(name=view.name))
    if memory_pool is not None and not _can_support_one(memory_pool, config):
        raise ValueError(MSG_INCOMPATIBLE.format(name=view.name, r=config.r))
    if view.pinned and loaded.num_pinned >= max_loras_per_batch - 1:
        raise ValueError(MSG_PINNED.format(name=view.name))
    return warnings


def validate_new_adapter(
    adapter: Any,
    *,
    loaded: Any = (),
    memory_pool: Any = None,
    max_loras_per_batch: int = 8,
    base_vocab_size: int | None = None,
    engine_version: str | None = None,
) -> list[str]:
    """`LoRAManager.validate_new_adapter` for one adapter against those already `loaded`.

    Raises SGLang's ValueError (added tokens, DoRA, same name, `memory_pool.can_support` when a pool is
    given, pinning every slot). Returns SGLang's warnings (the same path loaded under another name).
    """
    _versions.resolve("sglang", engine_version)
    (view,) = resolve_views([adapter])
    existing = LoadedIndex(_refs(loaded))
    config = read_lora_config(view, base_vocab_size)
    return collect_new_adapter(
        view, config, existing, memory_pool=memory_pool, max_loras_per_batch=max_loras_per_batch, col=None
    )
