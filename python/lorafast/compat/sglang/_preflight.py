"""The whole start-up at once: `preflight` and the `SGLangPlan` it returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector, CompatProblem, LoraRef
from lorafast.compat._inputs import AdapterView
from lorafast.compat.sglang import _pool
from lorafast.compat.sglang._buffers import BufferPlan, buffer_plans, itemsize_of
from lorafast.compat.sglang._config import (
    AdapterConfig,
    load_weights,
    logger,
    memoized,
    read_lora_config,
    resolve_views,
    text_config_of,
)
from lorafast.compat.sglang._detect import detect_shared_outer
from lorafast.compat.sglang._first_use import FirstUse, classify_slots, collect_expert_layout, collect_skipped
from lorafast.compat.sglang._names import (
    MSG_ALL_ALONE,
    MSG_ID_LOADED,
    MSG_LOAD_FAILED,
    MSG_MAX_LORAS_POSITIVE,
    MSG_NEED_RANK_AND_TARGETS,
    MSG_SHARED_OUTER_LOG,
)
from lorafast.compat.sglang._targets import collect_lora_shapes, predict_base_model_modules
from lorafast.compat.sglang._validate import LoadedIndex, can_support, collect_new_adapter
from lorafast.compat.sglang._weights import LoadedWeights


@dataclass(frozen=True)
class SGLangPlan:
    """What an SGLang server decides at start-up for a set of adapters, and every problem found."""

    adapters: tuple[LoraRef, ...]
    target_modules: frozenset[str]
    max_lora_rank: int
    lora_added_tokens_size: int
    experts_shared_outer: bool
    shared_outer_source: str
    """Where the layout came from: "cli" or "detected"."""
    buffers: tuple[BufferPlan, ...] | None
    problems: tuple[CompatProblem, ...]
    max_loras_per_batch: int = 8
    strict_loading: bool = False
    base_config: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    first_use: Any = field(default=None, repr=False, compare=False)
    """The pool's first-use checks."""
    loaded_weights: Mapping[str, LoadedWeights] = field(default_factory=dict, repr=False, compare=False)
    """Adapter id -> the weights as SGLang holds them after `initialize_weights()` (shapes only; read-only)."""
    engine_version: _versions.EngineRules | None = field(default=None, compare=False)
    """The SGLang version answered for, and whether lorafast verified it (`status`)."""

    @property
    def verdict(self) -> str:
        """`"ok"`, `"fails"`, or `"unknown"` when the set would pass but the version is not verified."""
        if not self.ok:
            return "fails"
        return "ok" if self.engine_version is None or self.engine_version.verified else "unknown"

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
        (view,) = resolve_views([adapter])
        col = Collector(collect)
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        cfg = text_config_of(self.base_config)
        try:
            vocab = cfg.get("vocab_size") if cfg else None
            config = read_lora_config(view, vocab, col)
            collect_new_adapter(
                view,
                config,
                LoadedIndex(self.adapters),
                memory_pool=self,
                max_loras_per_batch=self.max_loras_per_batch,
                col=col,
            )
            peft_type = config.hf_config["peft_type"]
            assert peft_type.lower() == "lora"
            weights = load_weights(view, config=config, base_config=cfg)
        except Exception as exc:
            col.fail("sglang_load", exc, stage="load", **ids)
            return col.problems
        targets = set(self.target_modules)
        if self.first_use is not None:
            self.first_use.check(view, config, weights, col)
        else:
            collect_skipped(view, weights, targets, strict=self.strict_loading, col=col)
        slots = classify_slots(weights, targets)
        collect_expert_layout(
            view, slots, experts_shared_outer=self.experts_shared_outer, base_config=cfg, col=col, warnings_only=True
        )
        return col.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapters": [
                {"name": a.name, "path": a.path, "lora_id": a.lora_id, "pinned": a.pinned} for a in self.adapters
            ],
            "target_modules": sorted(self.target_modules),
            "max_lora_rank": self.max_lora_rank,
            "lora_added_tokens_size": self.lora_added_tokens_size,
            "engine_version": None if self.engine_version is None else self.engine_version.to_dict(),
            "verdict": self.verdict,
            "experts_shared_outer": self.experts_shared_outer,
            "shared_outer_source": self.shared_outer_source,
            "buffers": None
            if self.buffers is None
            else [
                {
                    "name": b.name,
                    "A": list(b.a_shape),
                    "B": list(b.b_shape),
                    "layers": list(b.layers),
                    "bytes": b.nbytes,
                }
                for b in self.buffers
            ],
            "buffer_bytes": self.buffer_bytes,
            "problems": [
                {
                    "code": p.code,
                    "type": p.exc_type,
                    "message": p.message,
                    "adapter_id": p.adapter_id,
                    "adapter_name": p.adapter_name,
                    "stage": p.stage,
                    "fatal": p.fatal,
                }
                for p in self.problems
            ],
        }


def _load_one(
    view: AdapterView,
    loaded: LoadedIndex,
    *,
    base_config: Mapping[str, Any] | None,
    max_loras_per_batch: int,
    col: Collector,
) -> tuple[AdapterConfig, LoadedWeights]:
    """`LoRAManager._load_lora_adapter` up to the weights: LoRAConfig, validate, LoRAAdapter, initialize_weights."""
    vocab = base_config.get("vocab_size") if base_config else None
    config = read_lora_config(view, vocab, col)
    collect_new_adapter(view, config, loaded, memory_pool=None, max_loras_per_batch=max_loras_per_batch, col=col)
    peft_type = config.hf_config["peft_type"]
    assert peft_type.lower() == "lora"
    config.lora_alpha / config.r  # LoRAAdapter.scaling: a string r or a zero r fails here, as in SGLang
    weights = load_weights(
        view, config=config, base_config=base_config, lora_added_tokens_size=config.lora_added_tokens_size
    )
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
    strict_version: bool = False,
) -> SGLangPlan:
    """Everything an SGLang server would decide, or reject, for `adapters` as its `--lora-paths`.

    Arguments mirror the server flags: `--max-lora-rank`, `--lora-target-modules`, `--max-loras-per-batch`,
    `--experts-shared-outer-loras` / `--no-...` (None: auto-detect), `--lora-strict-loading`. A base model
    class's `supported_lora_modules` (Gemma, Baichuan, ...) joins "all"/"all-linear" resolution. `base_config`
    is the base model's HF `config.json` as a dict; with it the buffer shapes are planned, layer ids are
    bounded and "all" targets are resolved (or pass `base_model_modules`).

    Without `collect`, the first error SGLang would raise is raised, in SGLang's order: server-argument
    asserts, each adapter's load (wrapped as `Failed to load LoRA adapter <name>: ...`), target-module and
    rank inference, shared-outer detection, the memory pool's allocation, then, for each adapter, the first
    exception of SGLang's `load_lora_weight_to_buffer` when it first enters a GPU slot (replayed on shapes;
    needs `base_config`). Problems carry `stage` "startup", "load" or "first_use". With `collect=True`
    nothing is raised: every problem of every adapter is returned in `SGLangPlan.problems`.

    `SGLangPlan.engine_version` says which version answered and whether lorafast verified it; an unverified
    one warns `UnverifiedEngineVersion` (`verdict` "unknown" for a set that would pass) and `strict_version=True`
    raises `UnverifiedEngineVersionError` instead.
    """
    rules = _versions.rules_for("sglang", engine_version, strict=strict_version)
    col = Collector(collect)
    cfg = text_config_of(base_config)
    stage = "startup"
    if not max_loras_per_batch > 0:
        col.fail("sglang_server_args", AssertionError(MSG_MAX_LORAS_POSITIVE), stage=stage)
    cli_targets = set(target_modules) if target_modules else (set() if target_modules is not None else None)
    if cli_targets and "all" in cli_targets and len(cli_targets) != 1:
        col.fail("sglang_server_args", AssertionError(MSG_ALL_ALONE), stage=stage)
    for path, code, message in getattr(adapters, "errors", None) or ():
        col.fail("scan_error", RuntimeError(f"lorafast could not scan {path}: [{code}] {message}"), stage="load")
    views = resolve_views(adapters)
    if not views and not (max_lora_rank and cli_targets):
        col.fail("sglang_server_args", AssertionError(MSG_NEED_RANK_AND_TARGETS), stage=stage)
    if base_model_modules is None and cfg is not None:
        base_model_modules = predict_base_model_modules(cfg)

    # LoRAManager.init_lora_adapters: one adapter at a time, in order.
    entries: list[tuple[AdapterView, AdapterConfig, LoadedWeights]] = []
    seen_ids: set[str] = set()
    index = LoadedIndex()
    for view in views:
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        if view.lora_id in seen_ids:
            col.fail(
                "sglang_duplicate_id", AssertionError(MSG_ID_LOADED.format(lora_id=view.lora_id)), stage="load", **ids
            )
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
            col.warn(
                "lorafast_unreadable_weights",
                f"{view.path} has .bin/.pt weights that lorafast's torch reader cannot read: lorafast checked its "
                "config but cannot see its tensors without loading them",
                stage="load",
                **ids,
            )

    tree = _pool.base_model_tree(cfg) if cfg is not None else None
    targets, rank, added = collect_lora_shapes(
        [(v, c) for v, c, _ in entries],
        max_lora_rank,
        cli_targets,
        base_model_modules,
        dsa_indexer_fusion=dsa_indexer_fusion,
        col=col,
        tree=tree,
        supported_lora_modules=supported_lora_modules,
    )

    memo: dict[Any, Any] = {}
    if experts_shared_outer is None:
        shared_outer = detect_shared_outer([w for _, _, w in entries], legacy=legacy_detection, col=col, memo=memo)
        source = "detected"
    else:
        shared_outer, source = bool(experts_shared_outer), "cli"
    if shared_outer:
        logger.info(MSG_SHARED_OUTER_LOG)

    buffers: list[BufferPlan] | None = None
    pool: _pool.Pool | None = None
    if cfg is not None and tree is not None:
        try:
            pool = _pool.build_pool(
                cfg,
                tree,
                targets,
                rank,
                max_loras_per_batch=max_loras_per_batch,
                shared_outer=shared_outer,
                added=added,
            )
            buffers = buffer_plans(pool, itemsize_of(cfg))
        except Exception as exc:  # what the pool's allocation raises, type and text
            col.fail("sglang_memory_pool", exc, stage="startup")

    # First use of each adapter: LoRAMemoryPool.load_lora_weight_to_buffer.
    target_key = frozenset(targets)
    use = FirstUse(pool, tree, targets, strict_loading, shared_outer) if pool is not None and tree is not None else None
    for view, config, weights in entries:
        if use is not None:
            use.check(view, config, weights, col)
        else:
            collect_skipped(view, weights, targets, strict=strict_loading, col=col, memo=memo)
        slots = memoized(memo, ("slots", id(weights.layers), target_key), lambda w=weights: classify_slots(w, targets))
        collect_expert_layout(
            view, slots, experts_shared_outer=shared_outer, base_config=cfg, col=col, memo=memo, warnings_only=True
        )

    refs = tuple(LoraRef(name=v.name, path=v.path, pinned=v.pinned, lora_id=v.lora_id) for v, _, _ in entries)
    return SGLangPlan(
        adapters=refs,
        target_modules=frozenset(targets),
        max_lora_rank=rank,
        lora_added_tokens_size=added,
        experts_shared_outer=shared_outer,
        shared_outer_source=source,
        buffers=None if buffers is None else tuple(buffers),
        problems=tuple(col.problems),
        max_loras_per_batch=max_loras_per_batch,
        strict_loading=strict_loading,
        base_config=cfg,
        first_use=use,
        loaded_weights={v.lora_id: w for v, _, w in entries},
        engine_version=rules,
    )
