"""SGLang's LoRA checks, answered from safetensors headers (drop-in for `sglang.srt.lora`).

Every function takes scanned `lorafast.Adapter`s or paths (or a mapping `{adapter_id: adapter}`, a
`ScanReport`, `LoraRef`s, `AdapterView`s; see `resolve_adapters`) and returns what SGLang returns, or
raises the exception SGLang raises with the same type and byte-identical message. No tensor is loaded:
the names and shapes SGLang would hold after its weight normalization are predicted from the header.

`preflight` runs the whole start-up sequence of an SGLang server at once (`--lora-paths` parsing, every
adapter's load checks, target-module and rank inference, shared-outer detection, memory-pool shapes)
plus the checks SGLang only makes when an adapter first enters a GPU slot.

Reference: shared/reference/sglang-lora.md (§4-§9, §11), SGLang `main` of 2026-08-06.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat import _sglang_pool as _pool
from lorafast.compat import _versions
from lorafast.compat._common import Collector, CompatProblem, LoraRef, lora_id
from lorafast.compat._inputs import AdapterView, resolve_adapters
from lorafast.compat._sglang_first_use import first_use_error
from lorafast.compat._sglang_names import (
    DSA_INDEXER_LORA_NAMES,
    EMBEDDING_NAMES,
    KNOWN_LORA_TARGET_MODULES,
    MSG_ADDED_TOKENS,
    MSG_ALL_ALONE,
    MSG_ALREADY_LOADED,
    MSG_DORA,
    MSG_DSA_FUSION,
    MSG_HIDDEN_DIM,
    MSG_ID_LOADED,
    MSG_INCOMPATIBLE,
    MSG_LOAD_FAILED,
    MSG_MAX_LORAS_POSITIVE,
    MSG_MIXED_SHARED_OUTER,
    MSG_NEED_RANK_AND_TARGETS,
    MSG_NO_WEIGHTS,
    MSG_NOT_SUBSET,
    MSG_ONLY_LIST,
    MSG_PATHS_DICT_KEYS,
    MSG_PATHS_ITEM_TYPE,
    MSG_PATHS_TYPE,
    MSG_PINNED,
    MSG_SAME_PATH,
    MSG_SHARED_OUTER_DICT,
    MSG_SHARED_OUTER_EXPERT_DIM,
    MSG_SHARED_OUTER_LOG,
    MSG_SKIPPED,
    MSG_UNRECOGNIZED_STRING,
    PARAMS_MAPPING,
    STACKED_MULTIPLY,
    SUPPORTED_LORA_TARGET_MODULES,
    auto_detect_lora_target_modules,
    get_normalized_target_modules,
    get_stacked_multiply,
    get_target_module_name,
)
from lorafast.compat._sglang_weights import NO_CONFIG, LoadedWeights, load_adapter_weights
from lorafast.compat._torchlike import numel, size_repr
from lorafast.compat.diffusion import detect_lora_format, normalize_peft_keys, validate_peft_features

__all__ = [
    "DSA_INDEXER_LORA_NAMES",
    "EMBEDDING_NAMES",
    "KNOWN_LORA_TARGET_MODULES",
    "PARAMS_MAPPING",
    "STACKED_MULTIPLY",
    "SUPPORTED_LORA_TARGET_MODULES",
    "AdapterView",
    "BufferPlan",
    "CompatProblem",
    "LoraRef",
    "MemoryPool",
    "SGLangPlan",
    "auto_detect_lora_target_modules",
    "can_support",
    "check_expert_layout",
    "check_skipped_weights",
    "detect_lora_format",
    "detect_shared_outer_loras",
    "get_normalized_target_modules",
    "get_stacked_multiply",
    "get_target_module_name",
    "init_lora_shapes",
    "lora_id",
    "normalize_peft_keys",
    "parse_lora_paths",
    "plan_buffers",
    "predict_base_model_modules",
    "predict_loaded_weights",
    "preflight",
    "resolve_adapters",
    "validate_new_adapter",
    "validate_peft_features",
]  # fmt: skip

logger = logging.getLogger("lorafast.compat.sglang")

_NUMBERED_EXPERT = re.compile(r"(?:shared_)?experts\.\d+\.")
_EXPERT_ID = re.compile(r"experts\.(\d+)\.")
_SHARED_OUTER_SLOTS = (("gate_up_proj_moe", "A"), ("down_proj_moe", "B"))


# --- adapter_config.json as SGLang's LoRAConfig reads it ------------------------------------------------


@dataclass(frozen=True)
class _LoraConfig:
    hf_config: Mapping[str, Any]
    target_modules: Any
    r: Any
    lora_alpha: Any
    use_dora: bool
    lora_added_tokens_size: int


def _lora_config(view: AdapterView, base_vocab_size: int | None = None, col: Collector | None = None) -> _LoraConfig:
    """`LoRAConfig(path)`: a missing required key raises a plain KeyError, in SGLang's order."""
    error = view.config_error()
    if error is not None:
        raise error
    hf = view.config
    assert hf is not None
    target_modules = hf["target_modules"]
    r = hf["r"]
    lora_alpha = hf["lora_alpha"]
    added = 0
    if view.added_tokens_error is not None:
        message = f"Failed to parse added_tokens.json: {view.added_tokens_error}"
        logger.warning(message)
        if col is not None:
            col.warn("sglang_added_tokens_json", message, stage="load", adapter_id=view.lora_id,
                     adapter_name=view.name)  # fmt: skip
    elif view.added_tokens:
        # Ids below the base vocabulary are "fake" added tokens and dropped.
        added = sum(1 for v in view.added_tokens.values() if base_vocab_size is None or v >= base_vocab_size)
    return _LoraConfig(hf, target_modules, r, lora_alpha, bool(hf.get("use_dora", False)), added)


def _text_config(base_config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """`base_hf_config.get_text_config()` for multimodal configs."""
    if base_config is None:
        return None
    for key in ("text_config", "language_config", "llm_config"):
        sub = base_config.get(key)
        if isinstance(sub, Mapping):
            return sub
    return base_config


# --- weights after SGLang's normalization ---------------------------------------------------------------


def predict_loaded_weights(
    adapter: Any, *, base_config: Mapping[str, Any] | None = None, engine_version: str | None = None
) -> LoadedWeights:
    """The per-layer `{name: shape}` dicts SGLang holds after `initialize_weights()` for one adapter.

    Fused gate/up (`[E, r, H]` + `[E, r, H]` -> `[E, 2r, H]`), `.w1/.w3/.w2` renames, q/k/v fusion and the
    repeat of an already fused lora_A are all applied, with SGLang's errors.
    """
    _versions.resolve("sglang", engine_version)
    (view,) = resolve_adapters([adapter]) if not isinstance(adapter, AdapterView) else (adapter,)
    shared = _load_weights(view, base_config=_text_config(base_config))
    # A private copy: the normalized dicts are cached and shared between adapters of the same structure.
    return LoadedWeights(
        shared.lora_id, {i: dict(w) for i, w in shared.layers.items()}, dict(shared.embedding),
        dict(shared.added_tokens),
    )  # fmt: skip


def _load_weights(
    view: AdapterView,
    *,
    config: _LoraConfig | None = None,
    base_config: Mapping[str, Any] | None = None,
    lora_added_tokens_size: int = 0,
) -> LoadedWeights:
    if config is None and view.config is not None and view.config_file:
        target_modules = view.config.get("target_modules", NO_CONFIG)
        rank = view.config.get("r")
    elif config is not None:
        target_modules, rank = config.target_modules, config.r
    else:
        target_modules, rank = NO_CONFIG, None
    return load_adapter_weights(
        view, target_modules=target_modules, rank=rank if isinstance(rank, int) else None,
        base_config=base_config, lora_added_tokens_size=lora_added_tokens_size,
    )  # fmt: skip


# --- §7 shared-outer detection --------------------------------------------------------------------------


def _memo(memo: dict[Any, Any] | None, key: Any, compute: Any) -> Any:
    """Per-preflight reuse of a result for adapters that share one normalized structure (same dict objects)."""
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _shared_flags(weights: LoadedWeights, legacy: bool) -> tuple[bool | None, frozenset[bool]]:
    """(first verdict, all verdicts) of the gate_up lora_A tensors that count, in SGLang's scan order."""
    first: bool | None = None
    seen: set[bool] = set()
    for _layer_id, name, shape in weights.iter_layer_weights():
        if "gate_up_proj" not in name or "lora_A" not in name or shape is None:
            continue
        if len(shape) == 3:
            is_shared = shape[0] == 1
        elif legacy or not _NUMBERED_EXPERT.search(name):
            continue
        else:
            is_shared = False  # numbered 2D per-expert weights count against the agreement too
        if first is None:
            first = is_shared
        seen.add(is_shared)
        if legacy:
            break  # pre-#31681: the first 3D gate_up lora_A of each adapter decides
    return first, frozenset(seen)


def _detect(loaded: list[LoadedWeights], *, legacy: bool, col: Collector, memo: dict[Any, Any] | None = None) -> bool:
    shared_outer: bool | None = None
    for weights in loaded:
        first, seen = _memo(memo, ("detect", id(weights.layers), legacy), lambda w=weights: _shared_flags(w, legacy))
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
    views = resolve_adapters(adapters)
    cfg = _text_config(base_config)
    loaded = [_load_weights(v, base_config=cfg) for v in views]
    return _detect(loaded, legacy=legacy, col=Collector(collect=False))


# --- §6 init_lora_shapes ------------------------------------------------------------------------------


def predict_base_model_modules(base_config: Mapping[str, Any], *, engine_version: str | None = None) -> set[str]:
    """A guess at the module names SGLang's `auto_detect_lora_target_modules` finds in a base model.

    Standard decoders: `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, `embed_tokens`, `lm_head`; DeepSeek
    MLA configs (`kv_lora_rank`) use `fused_qkv_a_proj_with_mqa`/`q_b_proj`/`kv_b_proj`. Pass the real module
    list as `base_model_modules` where the exact answer matters.
    """
    _versions.resolve("sglang", engine_version)
    cfg = _text_config(base_config) or {}
    modules = {"o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"}
    if cfg.get("kv_lora_rank"):
        modules |= {"kv_b_proj"}
        modules |= {"fused_qkv_a_proj_with_mqa", "q_b_proj"} if cfg.get("q_lora_rank") else {"q_proj"}
    else:
        modules.add("qkv_proj")
    return modules


def _cli_target_modules(target_modules: Any) -> set[str] | None:
    if target_modules is None:
        return None
    if isinstance(target_modules, str):
        return {target_modules}
    return set(target_modules)


def _init_lora_shapes(
    entries: list[tuple[AdapterView, _LoraConfig]],
    max_lora_rank: int | None,
    target_modules: set[str] | None,
    base_model_modules: Iterable[str] | None,
    *,
    dsa_indexer_fusion: bool,
    col: Collector,
    tree: list[_pool.Module] | None = None,
    supported_lora_modules: Iterable[str] | None = None,
) -> tuple[set[str], int, int]:
    auto_cache: list[set[str]] = []

    def auto_detect() -> set[str]:
        if tree is not None:
            return _pool.auto_detect(tree, supported_lora_modules)  # a fresh set each time, as SGLang walks it
        if not auto_cache:
            if base_model_modules is None:
                col.fail("sglang_needs_base_model", ValueError(
                    "lorafast: resolving target_modules 'all'/'all-linear' needs base_model_modules or base_config"
                ), stage="startup")  # fmt: skip
                auto_cache.append(set())
            else:
                auto_cache.append(auto_detect_lora_target_modules(base_model_modules))
        return set(auto_cache[0])

    if target_modules and target_modules == {"all"}:
        resolved = auto_detect()
        resolved.update(EMBEDDING_NAMES)
        target_modules = resolved
    elif target_modules:
        resolved = get_normalized_target_modules(target_modules)
    else:
        resolved = set()
    for view, config in entries:
        tm = config.target_modules
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        if isinstance(tm, str):
            if tm in ("all-linear", "all"):
                if target_modules is not None:
                    continue
                resolved |= auto_detect()
                continue
            col.fail("sglang_target_modules_string", ValueError(MSG_UNRECOGNIZED_STRING.format(tm=tm)),
                     stage="startup", **ids)  # fmt: skip
            continue
        if not isinstance(tm, list):
            col.fail("sglang_target_modules_type", ValueError(MSG_ONLY_LIST), stage="startup", **ids)
            continue
        adapter_tm = get_normalized_target_modules(tm)
        if target_modules is not None:
            if not adapter_tm.issubset(resolved):
                message = MSG_NOT_SUBSET.format(
                    name=view.name, missing=sorted(adapter_tm - resolved), have=sorted(resolved),
                    union=sorted(resolved | adapter_tm),
                )  # fmt: skip
                col.fail("sglang_target_modules_not_included", ValueError(message), stage="startup", **ids)
        else:
            resolved |= adapter_tm
    indexer = resolved & DSA_INDEXER_LORA_NAMES
    if indexer and dsa_indexer_fusion:
        col.fail("sglang_dsa_indexer_fusion", ValueError(MSG_DSA_FUSION.format(names=sorted(indexer))),
                 stage="startup")  # fmt: skip
    rank = max_lora_rank if max_lora_rank is not None else max([c.r for _, c in entries], default=0)
    added = next((c.lora_added_tokens_size for _, c in entries if c.lora_added_tokens_size > 0), 0)
    return resolved, rank, added


def init_lora_shapes(
    adapters: Any,
    max_lora_rank: int | None = None,
    target_modules: Iterable[str] | None = None,
    base_model_modules: Iterable[str] | None = None,
    *,
    base_config: Mapping[str, Any] | None = None,
    dsa_indexer_fusion: bool = False,
    engine_version: str | None = None,
) -> tuple[set[str], int, int]:
    """`LoRAManager.init_lora_shapes`: `(target_modules, max_lora_rank, lora_added_tokens_size)`.

    `target_modules` / `max_lora_rank` are the `--lora-target-modules` / `--max-lora-rank` values (None when
    not given). `base_model_modules` (or a `base_config` to guess them from) resolves "all" / "all-linear".
    """
    _versions.resolve("sglang", engine_version)
    text = _text_config(base_config)
    tree = _pool.base_model_tree(text) if text is not None and base_model_modules is None else None
    vocab = text.get("vocab_size") if text else None
    entries = [(v, _lora_config(v, vocab)) for v in resolve_adapters(adapters)]
    return _init_lora_shapes(
        entries, max_lora_rank, _cli_target_modules(target_modules), base_model_modules,
        dsa_indexer_fusion=dsa_indexer_fusion, col=Collector(collect=False), tree=tree,
    )  # fmt: skip


# --- §8 validate_new_adapter / can_support ----------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPool:
    """The part of SGLang's `LoRAMemoryPool` that `can_support` reads (an `SGLangPlan` works too)."""

    max_lora_rank: int
    target_modules: frozenset[str]
    lora_added_tokens_size: int = 0


def _can_support_one(pool: Any, config: _LoraConfig) -> bool:
    if config.r > pool.max_lora_rank:
        return False
    if config.lora_added_tokens_size > pool.lora_added_tokens_size:
        return False
    normalized = get_normalized_target_modules(config.target_modules)
    return "all" in normalized or normalized.issubset(set(pool.target_modules))


def can_support(memory_pool: Any, adapters: Any, *, engine_version: str | None = None) -> bool:
    """`LoRAMemoryPool.can_support`: every adapter fits the pool's rank, added tokens and target modules."""
    _versions.resolve("sglang", engine_version)
    return all(_can_support_one(memory_pool, _lora_config(v)) for v in resolve_adapters(adapters))


def _refs(loaded: Any) -> list[Any]:
    """Already loaded adapters as objects with `name`, `path`, `pinned` (LoraRefs and views pass through)."""
    if not loaded:
        return []
    if isinstance(loaded, Mapping) or not isinstance(loaded, Iterable) or isinstance(loaded, str):
        return list(resolve_adapters(loaded))
    out = []
    for item in loaded:
        if isinstance(item, (LoraRef, AdapterView)):
            out.append(item)
        else:
            out.extend(resolve_adapters([item]))
    return out


class _LoadedIndex:
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


def _validate_new_adapter(
    view: AdapterView,
    config: _LoraConfig,
    loaded: _LoadedIndex,
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
    (view,) = resolve_adapters([adapter])
    existing = _LoadedIndex(_refs(loaded))
    config = _lora_config(view, base_vocab_size)
    return _validate_new_adapter(
        view, config, existing, memory_pool=memory_pool, max_loras_per_batch=max_loras_per_batch, col=None
    )


# --- §9 memory pool -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BufferPlan:
    """One LoRA buffer of SGLang's memory pool: A and B shapes, for which decoder layers (empty: one buffer)."""

    name: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    layers: tuple[int, ...]
    itemsize: int = 2

    @property
    def nbytes(self) -> int:
        return (numel(self.a_shape) + numel(self.b_shape)) * self.itemsize * max(1, len(self.layers))


def _num_experts(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1)


def _is_moe(cfg: Mapping[str, Any]) -> bool:
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))


def _intermediate_for_layer(cfg: Mapping[str, Any], layer: int) -> int:
    first_dense = cfg.get("first_k_dense_replace")
    if first_dense is not None and _is_moe(cfg) and layer >= int(first_dense):
        return int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 1)
    return int(cfg["intermediate_size"])


def _moe_intermediate(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])


def get_default_hidden_dim(module_name: str, base_config: Mapping[str, Any], layer: int = 0,
                           lora_added_tokens_size: int = 0) -> tuple[int, int]:  # fmt: skip
    """`(in_dim, out_dim)` of a LoRA target in a base model with no `get_hidden_dim` of its own."""
    cfg = base_config
    hidden = int(cfg["hidden_size"])
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if module_name == "qkv_proj":
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        return hidden, head_dim * (heads + 2 * kv_heads)
    if module_name == "o_proj":
        return int(cfg.get("v_head_dim") or head_dim) * heads, hidden
    if module_name == "gate_up_proj":
        return hidden, 2 * _intermediate_for_layer(cfg, layer)
    if module_name == "down_proj":
        return _intermediate_for_layer(cfg, layer), hidden
    if module_name == "gate_up_proj_moe":
        return hidden, 2 * _moe_intermediate(cfg)
    if module_name == "down_proj_moe":
        return _moe_intermediate(cfg), hidden
    if module_name == "fused_qkv_a_proj_with_mqa":
        return hidden, int(cfg["q_lora_rank"]) + int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
    if module_name == "q_b_proj":
        return int(cfg["q_lora_rank"]), heads * (int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]))
    if module_name == "kv_b_proj":
        return int(cfg["kv_lora_rank"]), heads * (int(cfg["qk_nope_head_dim"]) + int(cfg["v_head_dim"]))
    if module_name == "embed_tokens":
        return int(cfg["vocab_size"]) + lora_added_tokens_size, hidden
    if module_name == "lm_head":
        return hidden, int(cfg["vocab_size"]) + lora_added_tokens_size
    raise NotImplementedError(MSG_HIDDEN_DIM + module_name)


def _itemsize(cfg: Mapping[str, Any]) -> int:
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return 4 if "32" in dtype else 8 if "64" in dtype else 2


def plan_buffers(
    base_config: Mapping[str, Any],
    target_modules: Iterable[str],
    max_lora_rank: int,
    *,
    max_loras_per_batch: int = 8,
    experts_shared_outer: bool = False,
    lora_added_tokens_size: int = 0,
    moe_ep_size: int = 1,
    stacked_multiply: Mapping[str, int] | None = None,
    engine_version: str | None = None,
) -> list[BufferPlan]:
    """The LoRA buffers SGLang's memory pool allocates (§9.2), for one GPU (tensor parallel size 1).

    Dense modules get `(max_loras, max_rank*c, in)` / `(max_loras, out, max_rank)` per layer. On MoE models
    `gate_up_proj`/`down_proj` get 4D `<name>_moe` buffers with an expert dimension, forced to 1 for the
    outer factors (gate_up A, down B) in shared-outer mode; a dense buffer exists there only when the
    model has shared experts. Raises SGLang's NotImplementedError for a module it has no dims for.
    With the default `moe_ep_size` and `stacked_multiply` the shapes are SGLang 0.5.23's own (dense buffers
    sized from the base layer of that name, in SGLang's allocation order; oracle-tested).
    """
    _versions.resolve("sglang", engine_version)
    cfg = _text_config(base_config) or {}
    if moe_ep_size == 1 and stacked_multiply is None:
        pool = _pool.build_pool(cfg, _pool.base_model_tree(cfg), set(target_modules), max_lora_rank,
                                max_loras_per_batch=max_loras_per_batch, shared_outer=experts_shared_outer,
                                added=lora_added_tokens_size)  # fmt: skip
        return _buffer_plans(pool, _itemsize(cfg))
    layers = int(cfg["num_hidden_layers"])
    n, r, size = max_loras_per_batch, max_lora_rank, _itemsize(cfg)
    plans: list[BufferPlan] = []

    def per_layer(name: str, dims: Any) -> None:
        groups: dict[tuple[Any, Any], list[int]] = {}
        for layer in range(layers):
            a, b = dims(layer)
            groups.setdefault((a, b), []).append(layer)
        for (a, b), ids in groups.items():
            plans.append(BufferPlan(name, a, b, tuple(ids), size))

    def dense(name: str) -> None:
        c = get_stacked_multiply(name, stacked_multiply)

        def dims(layer: int) -> tuple[Any, Any]:
            in_dim, out_dim = get_default_hidden_dim(name, cfg, layer, lora_added_tokens_size)
            return (n, r * c, in_dim), (n, out_dim, r)

        per_layer(name, dims)

    moe = _is_moe(cfg)
    has_shared = bool((cfg.get("shared_expert_intermediate_size") or 0) > 0 or (cfg.get("n_shared_experts") or 0) > 0)
    experts = max(1, _num_experts(cfg) // max(1, moe_ep_size))
    for name in sorted(target_modules):
        if name == "embed_tokens" or name == "lm_head":
            in_dim, out_dim = get_default_hidden_dim(name, cfg, 0, lora_added_tokens_size)
            plans.append(BufferPlan(name, (n, r, in_dim), (n, out_dim, r), (), size))
        elif moe and name in ("gate_up_proj", "down_proj"):
            moe_name = f"{name}_moe"
            c = get_stacked_multiply(moe_name, stacked_multiply)
            in_dim, out_dim = get_default_hidden_dim(moe_name, cfg, 0, lora_added_tokens_size)
            e_a = 1 if experts_shared_outer and moe_name == "gate_up_proj_moe" else experts
            e_b = 1 if experts_shared_outer and moe_name == "down_proj_moe" else experts
            plans.append(
                BufferPlan(moe_name, (n, e_a, r * c, in_dim), (n, e_b, out_dim, r), tuple(range(layers)), size)
            )
            if has_shared:
                dense(name)
        else:
            dense(name)
    return plans


# --- §9.3 checks when an adapter enters a GPU slot ---------------------------------------------------------


def _matcher(target_modules: Iterable[str]) -> Any:
    """`get_target_module_name` without the exception: the longest matching target, or None."""
    ordered = sorted(target_modules, key=len, reverse=True)  # stable: ties keep iteration order, as max() does

    def match(name: str) -> str | None:
        for target in ordered:
            if target in name:
                return target
        return None

    return match


def _skipped_names(weights: LoadedWeights, target_modules: set[str]) -> list[str]:
    match = _matcher(target_modules)
    names = [name for _, name, _ in weights.iter_layer_weights()] + list(weights.embedding)
    return sorted(name for name in names if match(name) is None)


def _check_skipped(view: AdapterView, weights: LoadedWeights, target_modules: set[str], *, strict: bool,
                   col: Collector, memo: dict[Any, Any] | None = None) -> list[str]:  # fmt: skip
    key = ("skipped", id(weights.layers), id(weights.embedding), frozenset(target_modules))
    skipped = _memo(memo, key, lambda: _skipped_names(weights, target_modules))
    if skipped:
        message = MSG_SKIPPED.format(uid=view.lora_id, n=len(skipped), targets=sorted(target_modules), names=skipped)
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        if strict:
            col.fail("sglang_skipped_weights", ValueError(message), stage="first_use", **ids)
        else:
            logger.warning(message)
            col.warn("sglang_skipped_weights", message, stage="first_use", **ids)
    return list(skipped)


def check_skipped_weights(
    adapter: Any,
    target_modules: Iterable[str],
    *,
    strict: bool = False,
    base_config: Mapping[str, Any] | None = None,
    engine_version: str | None = None,
) -> list[str]:
    """The weight-name pre-validation of `load_lora_weight_to_buffer` (§9.3.1) for one adapter.

    Returns the post-normalization names no target module matches. With `strict=True`
    (`--lora-strict-loading`) SGLang's ValueError is raised; otherwise its warning is logged.
    """
    _versions.resolve("sglang", engine_version)
    (view,) = resolve_adapters([adapter])
    weights = _load_weights(view, base_config=_text_config(base_config))
    return _check_skipped(view, weights, set(target_modules), strict=strict, col=Collector(collect=False))


@dataclass
class _Slot:
    tensor: tuple[int, ...] | None = None
    names: list[str] = field(default_factory=list)
    experts: dict[int, tuple[int, ...] | None] | None = None


def _classify(weights: LoadedWeights, target_modules: set[str], has_shared_moe: bool = False
              ) -> dict[int, dict[tuple[str, str], _Slot]]:  # fmt: skip
    """Per layer: (buffer name, "A"/"B") -> what SGLang stages for that buffer (§9.3.2)."""
    out: dict[int, dict[tuple[str, str], _Slot]] = {}
    match = _matcher(target_modules)
    for layer, name, shape in weights.iter_layer_weights():
        if shape is None:
            continue
        ab = "A" if "lora_A" in name else "B" if "lora_B" in name else None
        if ab is None:
            continue
        target = match(name)
        if target is None:
            continue
        expert = _EXPERT_ID.search(name)
        if "shared_experts." in name and (len(shape) == 3 or has_shared_moe):
            key = f"{target}_shared_moe"
        elif expert or ("experts" in name and len(shape) == 3):
            key = f"{target}_moe"
        else:
            key = target
        slot = out.setdefault(layer, {}).setdefault((key, ab), _Slot())
        slot.names.append(name)
        if expert and (key.endswith("_moe")):
            if slot.experts is None:
                slot.experts = {}
            slot.experts[int(expert.group(1))] = shape
        else:
            slot.tensor, slot.experts = shape, None
    return out


def _expert_findings(
    slots: dict[int, dict[tuple[str, str], _Slot]], experts_shared_outer: bool, num_experts: int | None, n_shared: int
) -> list[tuple[str, bool, str]]:
    """(code, fatal, text): SGLang's shared-outer ValueErrors (full text) and lorafast's expert-0 findings
    (text after the `LoRA adapter '<id>': ` prefix), in layer order."""
    out: list[tuple[str, bool, str]] = []
    for layer in sorted(slots):
        layer_slots = slots[layer]
        if experts_shared_outer:
            for buffer, ab in _SHARED_OUTER_SLOTS:
                slot = layer_slots.get((buffer, ab))
                if slot is None:
                    continue
                if slot.experts is not None and len(slot.experts) != 1:
                    text = MSG_SHARED_OUTER_DICT.format(buffer=buffer, ab=ab, n=len(slot.experts))
                    out.append(("sglang_shared_outer_expert_dim", True, text))
                elif slot.experts is None and slot.tensor is not None and slot.tensor[0] != 1:
                    text = MSG_SHARED_OUTER_EXPERT_DIM.format(buffer=buffer, ab=ab, e=slot.tensor[0])
                    out.append(("sglang_shared_outer_expert_dim", True, text))
        # What SGLang does not check: a shared [1, ...] factor copied into a per-expert buffer fills expert 0 only.
        for (buffer, ab), slot in sorted(layer_slots.items()):
            if slot.experts is not None or slot.tensor is None or len(slot.tensor) != 3 or slot.tensor[0] != 1:
                continue
            if buffer.endswith("_shared_moe"):
                expert_dim: int | None = n_shared
            elif buffer.endswith("_moe"):
                outer = experts_shared_outer and (buffer, ab) in _SHARED_OUTER_SLOTS
                expert_dim = 1 if outer else num_experts
            else:
                continue
            if expert_dim == 1:
                continue
            dim_text = "num_experts" if expert_dim is None else str(expert_dim)
            text = (
                f"{slot.names[-1]} has expert_dim=1 (a shared outer factor) but the {buffer} lora_{ab} buffer is "
                f"per-expert (expert_dim={dim_text}, experts_shared_outer_loras={experts_shared_outer}); SGLang copies "
                "it into expert 0 only and the other experts get no LoRA."
            )
            out.append(("sglang_shared_factor_in_per_expert_pool", False, text))
    return out


def _check_expert_layout(
    view: AdapterView,
    slots: dict[int, dict[tuple[str, str], _Slot]],
    *,
    experts_shared_outer: bool,
    base_config: Mapping[str, Any] | None,
    col: Collector,
    memo: dict[Any, Any] | None = None,
) -> None:
    num_experts = _num_experts(base_config) if base_config and _is_moe(base_config) else None
    n_shared = int(base_config.get("n_shared_experts") or 1) if base_config else 1
    key = ("experts", id(slots), experts_shared_outer, num_experts, n_shared)
    findings = _memo(memo, key, lambda: _expert_findings(slots, experts_shared_outer, num_experts, n_shared))
    ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
    for code, fatal, text in findings:
        if fatal:
            col.fail(code, ValueError(text), stage="first_use", **ids)
        else:
            col.warn(code, f"LoRA adapter '{view.lora_id}': {text}", stage="first_use", **ids)


def check_expert_layout(
    adapter: Any,
    *,
    experts_shared_outer: bool,
    target_modules: Iterable[str] = ("gate_up_proj", "down_proj"),
    base_config: Mapping[str, Any] | None = None,
    collect: bool = False,
    engine_version: str | None = None,
) -> list[CompatProblem]:
    """The MoE expert-dimension checks of `load_lora_weight_to_buffer` (§9.3.3-4) for one adapter.

    In shared-outer mode, gate_up lora_A and down lora_B must have expert_dim 1 (SGLang's ValueError is
    raised unless `collect`). In either mode a `[1, ...]` factor headed for a per-expert buffer is reported:
    SGLang silently fills expert 0 only. Returns the problems found (warnings, plus errors when collecting).
    """
    _versions.resolve("sglang", engine_version)
    (view,) = resolve_adapters([adapter])
    cfg = _text_config(base_config)
    weights = _load_weights(view, base_config=cfg)
    col = Collector(collect)
    slots = _classify(weights, set(target_modules))
    _check_expert_layout(view, slots, experts_shared_outer=experts_shared_outer, base_config=cfg, col=col)
    return col.problems


def _fit_findings(slots: dict[int, dict[tuple[str, str], _Slot]], r: int | None,
                  plans: list[BufferPlan]) -> list[str]:  # fmt: skip
    """Weights that cannot be copied into the planned buffers (SGLang asserts at first use); text after the
    `LoRA adapter '<id>': ` prefix."""
    by_name: dict[tuple[str, int], BufferPlan] = {}
    for plan in plans:
        for layer in plan.layers:
            by_name[(plan.name, layer)] = plan
    out: list[str] = []
    for layer, layer_slots in sorted(slots.items()):
        for (buffer, ab), slot in sorted(layer_slots.items()):
            found = by_name.get((buffer, layer))
            if found is None:
                continue
            shapes = list(slot.experts.values()) if slot.experts is not None else [slot.tensor]
            for shape in shapes:
                if shape is None or len(shape) < 2:
                    continue
                if len(found.a_shape) == 3:  # dense: SGLang copies into buf[slot, :r*c, :] and buf[slot, :, :r]
                    if r is None:
                        continue
                    c = found.a_shape[1] // max(1, found.b_shape[2])
                    want = (r * c, found.a_shape[2]) if ab == "A" else (found.b_shape[1], r)
                    if tuple(shape) != want:
                        out.append(
                            f"{slot.names[-1]} does not fit {buffer} (layer {layer}): LoRA buffer shape "
                            f"{size_repr(want)}, weight shape {size_repr(shape)}; SGLang's slice to the base layer "
                            "hides the difference and the weight is cut or padded without an error."
                        )
                else:  # MoE: compare the input dim of A and the output dim of B
                    got = shape[-1] if ab == "A" else shape[-2]
                    want_dim = found.a_shape[-1] if ab == "A" else found.b_shape[-2]
                    if got != want_dim:
                        out.append(
                            f"{slot.names[-1]} has {'in' if ab == 'A' else 'out'} dim {got} but the {buffer} "
                            f"lora_{ab} buffer expects {want_dim} (layer {layer})."
                        )
    return out


def _check_buffer_fit(view: AdapterView, config: _LoraConfig, plans: list[BufferPlan],
                      slots: dict[int, dict[tuple[str, str], _Slot]], col: Collector,
                      memo: dict[Any, Any] | None = None) -> None:  # fmt: skip
    r = config.r if isinstance(config.r, int) else None
    findings = _memo(memo, ("fit", id(slots), r, id(plans)), lambda: _fit_findings(slots, r, plans))
    for text in findings:
        col.warn("sglang_buffer_shape", f"LoRA adapter '{view.lora_id}': {text}", stage="first_use",
                 adapter_id=view.lora_id, adapter_name=view.name)  # fmt: skip


def _expert_warnings(view: AdapterView, slots: dict[int, dict[tuple[str, str], _Slot]], *,
                     experts_shared_outer: bool, base_config: Mapping[str, Any] | None, col: Collector,
                     memo: dict[Any, Any] | None = None) -> None:  # fmt: skip
    """lorafast's own expert-layout findings, which SGLang never reports (its errors come from `_FirstUse`)."""
    num_experts = _num_experts(base_config) if base_config and _is_moe(base_config) else None
    n_shared = int(base_config.get("n_shared_experts") or 1) if base_config else 1
    key = ("experts", id(slots), experts_shared_outer, num_experts, n_shared)
    findings = _memo(memo, key, lambda: _expert_findings(slots, experts_shared_outer, num_experts, n_shared))
    for code, fatal, text in findings:
        if not fatal:
            col.warn(code, f"LoRA adapter '{view.lora_id}': {text}", stage="first_use", adapter_id=view.lora_id,
                     adapter_name=view.name)  # fmt: skip


def _buffer_plans(pool: _pool.Pool, itemsize: int) -> list[BufferPlan]:
    """The pool's buffers as BufferPlans (layers with equal shapes grouped), in SGLang's allocation order."""
    plans = []
    for kind, a_side, b_side in (("embed_tokens", pool.embedding_a, pool.embedding_b),
                                 ("lm_head", pool.lm_head_a, pool.lm_head_b)):  # fmt: skip
        if kind in a_side:
            plans.append(BufferPlan(kind, a_side[kind], b_side[kind], (), itemsize))
    for name, a_layers in pool.a.items():
        groups: dict[tuple[Any, Any], list[int]] = {}
        for layer, (a, b) in enumerate(zip(a_layers, pool.b[name], strict=True)):
            groups.setdefault((a, b), []).append(layer)
        plans += [BufferPlan(name, a, b, tuple(ids), itemsize) for (a, b), ids in groups.items()]
    return plans


class _FirstUse:
    """The checks SGLang makes when an adapter first enters a GPU slot, against one memory pool."""

    def __init__(self, pool: _pool.Pool, tree: list[_pool.Module], targets: set[str], strict: bool,
                 shared_outer: bool) -> None:  # fmt: skip
        layers = 1 + max((m.layer for m in tree if m.layer is not None), default=-1)
        self.pool, self.strict, self.shared_outer = pool, strict, shared_outer
        self.plans = _buffer_plans(pool, 2)
        self.modules, _embed, self.lm_head = _pool.lora_modules(tree, targets, layers)

    def check(self, view: AdapterView, config: _LoraConfig, weights: LoadedWeights, col: Collector) -> None:
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        skipped = _skipped_names(weights, self.pool.target_modules)
        if skipped and not self.strict:
            message = MSG_SKIPPED.format(uid=view.lora_id, n=len(skipped), targets=sorted(self.pool.target_modules),
                                         names=skipped)  # fmt: skip
            logger.warning(message)
            col.warn("sglang_skipped_weights", message, stage="first_use", **ids)
        error = first_use_error(view.lora_id, weights, config.r, self.pool, self.modules, self.lm_head,
                                strict=self.strict, shared_outer=self.shared_outer)  # fmt: skip
        if error is not None:
            col.fail("sglang_first_use", error, stage="first_use", **ids)
        elif self.plans:  # SGLang accepts it; lorafast's own finding: a weight that does not match its buffer
            _check_buffer_fit(view, config, self.plans, _classify(weights, self.pool.target_modules), col)


# --- §11 --lora-paths ---------------------------------------------------------------------------------------


def parse_lora_paths(lora_paths: Any, *, engine_version: str | None = None) -> list[LoraRef]:
    """`--lora-paths` as `check_lora_server_args` parses it: `NAME=PATH`, `PATH`, or dicts with `pinned`."""
    _versions.resolve("sglang", engine_version)
    if lora_paths is None:
        return []
    if isinstance(lora_paths, Mapping):
        return [LoraRef(name=k, path=v) for k, v in lora_paths.items()]
    if not isinstance(lora_paths, list):
        raise ValueError(MSG_PATHS_TYPE.format(type=type(lora_paths)))
    refs = []
    for item in lora_paths:
        if isinstance(item, str):
            name, path = item.split("=", 1) if "=" in item else (item, item)
            refs.append(LoraRef(name=name, path=path))
        elif isinstance(item, dict):
            assert "lora_name" in item and "lora_path" in item, MSG_PATHS_DICT_KEYS.format(item=item)
            refs.append(LoraRef(name=item["lora_name"], path=item["lora_path"], pinned=item.get("pinned", False)))
        else:
            raise ValueError(MSG_PATHS_ITEM_TYPE.format(type=type(item)))
    return refs


# --- preflight ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SGLangPlan:
    """What an SGLang server decides at start-up for a set of adapters, and every problem found."""

    adapters: tuple[LoraRef, ...]
    target_modules: frozenset[str]
    max_lora_rank: int
    lora_added_tokens_size: int
    experts_shared_outer: bool
    shared_outer_source: str  # "cli" | "detected"
    buffers: tuple[BufferPlan, ...] | None
    problems: tuple[CompatProblem, ...]
    max_loras_per_batch: int = 8
    strict_loading: bool = False
    base_config: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    first_use: Any = field(default=None, repr=False, compare=False)  # the pool's first-use checks
    #: adapter id -> the weights as SGLang holds them after `initialize_weights()` (shapes only; read-only)
    loaded_weights: Mapping[str, LoadedWeights] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[CompatProblem]:
        return [p for p in self.problems if p.fatal]

    @property
    def warnings(self) -> list[CompatProblem]:
        return [p for p in self.problems if not p.fatal]

    @property
    def buffer_bytes(self) -> int | None:
        return None if self.buffers is None else sum(b.nbytes for b in self.buffers)

    def can_support(self, adapters: Any) -> bool:
        """Whether a later `POST /load_lora_adapter` fits this pool (`LoRAMemoryPool.can_support`)."""
        return can_support(self, adapters)

    def check_new_adapter(self, adapter: Any, *, collect: bool = False) -> list[CompatProblem]:
        """A later `POST /load_lora_adapter` of `adapter` into this running server.

        The load itself (`validate_new_adapter` against this pool, then the weights) raises what SGLang puts in
        the response's `error_message`; the pool layout is frozen (detection is not re-run), so the first-use
        checks use this plan's target modules and shared-outer mode. Returns the problems found, warnings
        included (a shared `[1, ...]` factor entering a per-expert pool is the case SGLang never reports).
        """
        (view,) = resolve_adapters([adapter])
        col = Collector(collect)
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        cfg = _text_config(self.base_config)
        try:
            vocab = cfg.get("vocab_size") if cfg else None
            config = _lora_config(view, vocab, col)
            _validate_new_adapter(view, config, _LoadedIndex(self.adapters), memory_pool=self,
                                  max_loras_per_batch=self.max_loras_per_batch, col=col)  # fmt: skip
            peft_type = config.hf_config["peft_type"]
            assert peft_type.lower() == "lora"
            if not view.has_weights:
                raise RuntimeError(MSG_NO_WEIGHTS.format(path=view.path))
            weights = _load_weights(view, config=config, base_config=cfg)
        except Exception as exc:
            col.fail("sglang_load", exc, stage="load", **ids)
            return col.problems
        targets = set(self.target_modules)
        if self.first_use is not None:
            self.first_use.check(view, config, weights, col)
        else:
            _check_skipped(view, weights, targets, strict=self.strict_loading, col=col)
        slots = _classify(weights, targets)
        _expert_warnings(view, slots, experts_shared_outer=self.experts_shared_outer, base_config=cfg, col=col)
        return col.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapters": [{"name": a.name, "path": a.path, "lora_id": a.lora_id, "pinned": a.pinned} for a in self.adapters],
            "target_modules": sorted(self.target_modules),
            "max_lora_rank": self.max_lora_rank,
            "lora_added_tokens_size": self.lora_added_tokens_size,
            "experts_shared_outer": self.experts_shared_outer,
            "shared_outer_source": self.shared_outer_source,
            "buffers": None if self.buffers is None else [
                {"name": b.name, "A": list(b.a_shape), "B": list(b.b_shape), "layers": list(b.layers), "bytes": b.nbytes}
                for b in self.buffers
            ],
            "buffer_bytes": self.buffer_bytes,
            "problems": [
                {"code": p.code, "type": p.exc_type, "message": p.message, "adapter_id": p.adapter_id,
                 "adapter_name": p.adapter_name, "stage": p.stage, "fatal": p.fatal}
                for p in self.problems
            ],
        }  # fmt: skip


def _load_one(
    view: AdapterView,
    loaded: _LoadedIndex,
    *,
    base_config: Mapping[str, Any] | None,
    max_loras_per_batch: int,
    col: Collector,
) -> tuple[_LoraConfig, LoadedWeights]:
    """`LoRAManager._load_lora_adapter` up to the weights: LoRAConfig, validate, LoRAAdapter, initialize_weights."""
    vocab = base_config.get("vocab_size") if base_config else None
    config = _lora_config(view, vocab, col)
    _validate_new_adapter(view, config, loaded, memory_pool=None, max_loras_per_batch=max_loras_per_batch, col=col)
    peft_type = config.hf_config["peft_type"]
    assert peft_type.lower() == "lora"
    config.lora_alpha / config.r  # LoRAAdapter.scaling: a string r or a zero r fails here, as in SGLang
    if not view.has_weights:
        raise RuntimeError(MSG_NO_WEIGHTS.format(path=view.path))
    weights = _load_weights(view, config=config, base_config=base_config,
                            lora_added_tokens_size=config.lora_added_tokens_size)  # fmt: skip
    return config, weights


def preflight(
    adapters: Any,
    *,
    max_lora_rank: int | None = None,
    target_modules: Iterable[str] | None = None,
    max_loras_per_batch: int = 8,
    experts_shared_outer: bool | None = None,
    base_config: Mapping[str, Any] | None = None,
    collect: bool = False,
    strict_loading: bool = False,
    base_model_modules: Iterable[str] | None = None,
    legacy_detection: bool = False,
    dsa_indexer_fusion: bool = False,
    supported_lora_modules: Iterable[str] | None = None,
    engine_version: str | None = None,
) -> SGLangPlan:
    """Everything an SGLang server would decide, or reject, for `adapters` as its `--lora-paths`.

    Arguments mirror the server flags: `--max-lora-rank`, `--lora-target-modules`, `--max-loras-per-batch`,
    `--experts-shared-outer-loras` / `--no-...` (None: auto-detect), `--lora-strict-loading`. A base model
    class's `supported_lora_modules` (Gemma, Baichuan, ...) joins "all"/"all-linear" resolution. `base_config`
    is the base model's HF `config.json` as a dict; with it the buffer shapes are planned, layer ids are
    bounded and "all" targets are resolved (or pass `base_model_modules`).

    Without `collect`, the first error SGLang would raise is raised, in SGLang's order: server-argument
    asserts, each adapter's load (wrapped as `Failed to load LoRA adapter <name>: ...`), target-module and
    rank inference, shared-outer detection, buffer planning, then the checks made when each adapter first
    enters a GPU slot (skipped weights under strict loading, shared-outer expert dims). With `collect=True`
    nothing is raised: every problem of every adapter is returned in `SGLangPlan.problems`.
    """
    _versions.resolve("sglang", engine_version)
    col = Collector(collect)
    cfg = _text_config(base_config)
    stage = "startup"
    if not max_loras_per_batch > 0:
        col.fail("sglang_server_args", AssertionError(MSG_MAX_LORAS_POSITIVE), stage=stage)
    cli_targets = set(target_modules) if target_modules else (set() if target_modules is not None else None)
    if cli_targets and "all" in cli_targets and len(cli_targets) != 1:
        col.fail("sglang_server_args", AssertionError(MSG_ALL_ALONE), stage=stage)
    for path, code, message in getattr(adapters, "errors", None) or ():
        col.fail("scan_error", RuntimeError(f"lorafast could not scan {path}: [{code}] {message}"), stage="load")
    views = resolve_adapters(adapters)
    if not views and not (max_lora_rank and cli_targets):
        col.fail("sglang_server_args", AssertionError(MSG_NEED_RANK_AND_TARGETS), stage=stage)
    if base_model_modules is None and cfg is not None:
        base_model_modules = predict_base_model_modules(cfg)

    # LoRAManager.init_lora_adapters: one adapter at a time, in order.
    entries: list[tuple[AdapterView, _LoraConfig, LoadedWeights]] = []
    seen_ids: set[str] = set()
    index = _LoadedIndex()
    for view in views:
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        if view.lora_id in seen_ids:
            col.fail("sglang_duplicate_id", AssertionError(MSG_ID_LOADED.format(lora_id=view.lora_id)),
                     stage="load", **ids)  # fmt: skip
            continue
        try:
            config, weights = _load_one(view, index, base_config=cfg, max_loras_per_batch=max_loras_per_batch, col=col)
        except Exception as exc:
            wrapped = RuntimeError(MSG_LOAD_FAILED.format(name=view.name, error=str(exc)))
            wrapped.__cause__ = exc
            col.fail("sglang_load", wrapped, stage="load", **ids)
            continue
        seen_ids.add(view.lora_id)
        index.add(view)
        entries.append((view, config, weights))
        if not view.weights_readable:
            col.warn("lorafast_unreadable_weights", f"{view.path} has only .bin/.pt weights: lorafast checked its "
                     "config but cannot see its tensors without loading them", stage="load", **ids)  # fmt: skip

    tree = _pool.base_model_tree(cfg) if cfg is not None else None
    targets, rank, added = _init_lora_shapes(
        [(v, c) for v, c, _ in entries], max_lora_rank, cli_targets, base_model_modules,
        dsa_indexer_fusion=dsa_indexer_fusion, col=col, tree=tree, supported_lora_modules=supported_lora_modules,
    )  # fmt: skip

    memo: dict[Any, Any] = {}
    if experts_shared_outer is None:
        shared_outer = _detect([w for _, _, w in entries], legacy=legacy_detection, col=col, memo=memo)
        source = "detected"
    else:
        shared_outer, source = bool(experts_shared_outer), "cli"
    if shared_outer:
        logger.info(MSG_SHARED_OUTER_LOG)

    buffers: list[BufferPlan] | None = None
    pool: _pool.Pool | None = None
    if cfg is not None and tree is not None:
        try:
            pool = _pool.build_pool(cfg, tree, targets, rank, max_loras_per_batch=max_loras_per_batch,
                                    shared_outer=shared_outer, added=added)  # fmt: skip
            buffers = _buffer_plans(pool, _itemsize(cfg))
        except Exception as exc:  # what the pool's allocation raises, type and text
            col.fail("sglang_memory_pool", exc, stage="startup")

    # First use of each adapter: LoRAMemoryPool.load_lora_weight_to_buffer.
    target_key = frozenset(targets)
    use = _FirstUse(pool, tree, targets, strict_loading, shared_outer) if pool is not None else None
    for view, config, weights in entries:
        if use is not None:
            use.check(view, config, weights, col)
        else:
            _check_skipped(view, weights, targets, strict=strict_loading, col=col, memo=memo)
        slots = _memo(memo, ("slots", id(weights.layers), target_key), lambda w=weights: _classify(w, targets))
        _expert_warnings(view, slots, experts_shared_outer=shared_outer, base_config=cfg, col=col, memo=memo)

    refs = tuple(LoraRef(name=v.name, path=v.path, pinned=v.pinned, lora_id=v.lora_id) for v, _, _ in entries)
    return SGLangPlan(
        adapters=refs, target_modules=frozenset(targets), max_lora_rank=rank, lora_added_tokens_size=added,
        experts_shared_outer=shared_outer, shared_outer_source=source,
        buffers=None if buffers is None else tuple(buffers), problems=tuple(col.problems),
        max_loras_per_batch=max_loras_per_batch, strict_loading=strict_loading, base_config=cfg,
        first_use=use, loaded_weights={v.lora_id: w for v, _, w in entries},
    )  # fmt: skip
