"""Target modules and max rank (`LoRAManager.init_lora_shapes`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector
from lorafast.compat._inputs import AdapterView
from lorafast.compat.sglang import _pool
from lorafast.compat.sglang._config import AdapterConfig, read_lora_config, resolve_views, text_config_of
from lorafast.compat.sglang._names import (
    DSA_INDEXER_LORA_NAMES,
    EMBEDDING_NAMES,
    MSG_DSA_FUSION,
    MSG_NOT_SUBSET,
    MSG_ONLY_LIST,
    MSG_UNRECOGNIZED_STRING,
    auto_detect_lora_target_modules,
    get_normalized_target_modules,
)


def predict_base_model_modules(base_config: Mapping[str, Any], *, engine_version: str | None = None) -> set[str]:
    """A guess at the module names SGLang's `auto_detect_lora_target_modules` finds in a base model.

    Standard decoders: `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, `embed_tokens`, `lm_head`; DeepSeek
    MLA configs (`kv_lora_rank`) use `fused_qkv_a_proj_with_mqa`/`q_b_proj`/`kv_b_proj`. Pass the real module
    list as `base_model_modules` where the exact answer matters.
    """
    _versions.resolve("sglang", engine_version)
    cfg = text_config_of(base_config) or {}
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


def collect_lora_shapes(
    entries: list[tuple[AdapterView, AdapterConfig]],
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
                col.fail(
                    "sglang_needs_base_model",
                    ValueError(
                        "lorafast: resolving target_modules 'all'/'all-linear' needs base_model_modules or base_config"
                    ),
                    stage="startup",
                )
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
            col.fail(
                "sglang_target_modules_string",
                ValueError(MSG_UNRECOGNIZED_STRING.format(tm=tm)),
                stage="startup",
                **ids,
            )
            continue
        if not isinstance(tm, list):
            col.fail("sglang_target_modules_type", ValueError(MSG_ONLY_LIST), stage="startup", **ids)
            continue
        adapter_tm = get_normalized_target_modules(tm)
        if target_modules is not None:
            if not adapter_tm.issubset(resolved):
                message = MSG_NOT_SUBSET.format(
                    name=view.name,
                    missing=sorted(adapter_tm - resolved),
                    have=sorted(resolved),
                    union=sorted(resolved | adapter_tm),
                )
                col.fail("sglang_target_modules_not_included", ValueError(message), stage="startup", **ids)
        else:
            resolved |= adapter_tm
    indexer = resolved & DSA_INDEXER_LORA_NAMES
    if indexer and dsa_indexer_fusion:
        col.fail("sglang_dsa_indexer_fusion", ValueError(MSG_DSA_FUSION.format(names=sorted(indexer))), stage="startup")
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
    text = text_config_of(base_config)
    tree = _pool.base_model_tree(text) if text is not None and base_model_modules is None else None
    vocab = text.get("vocab_size") if text else None
    entries = [(v, read_lora_config(v, vocab)) for v in resolve_views(adapters)]
    return collect_lora_shapes(
        entries,
        max_lora_rank,
        _cli_target_modules(target_modules),
        base_model_modules,
        dsa_indexer_fusion=dsa_indexer_fusion,
        col=Collector(collect=False),
        tree=tree,
    )
