"""The memory pool's buffer shapes (`LoRAMemoryPool.init_buffers`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat import _versions
from lorafast.compat.sglang import _pool
from lorafast.compat.sglang._config import text_config_of
from lorafast.compat.sglang._names import (
    MSG_HIDDEN_DIM,
    get_stacked_multiply,
)
from lorafast.compat.sglang._torchlike import numel


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


def expert_count(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1)


def is_moe(cfg: Mapping[str, Any]) -> bool:
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))


def _intermediate_for_layer(cfg: Mapping[str, Any], layer: int) -> int:
    first_dense = cfg.get("first_k_dense_replace")
    if first_dense is not None and is_moe(cfg) and layer >= int(first_dense):
        return int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 1)
    return int(cfg["intermediate_size"])


def _moe_intermediate(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])


def get_default_hidden_dim(
    module_name: str, base_config: Mapping[str, Any], layer: int = 0, lora_added_tokens_size: int = 0
) -> tuple[int, int]:
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


def itemsize_of(cfg: Mapping[str, Any]) -> int:
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
    cfg = text_config_of(base_config) or {}
    if moe_ep_size == 1 and stacked_multiply is None:
        pool = _pool.build_pool(
            cfg,
            _pool.base_model_tree(cfg),
            set(target_modules),
            max_lora_rank,
            max_loras_per_batch=max_loras_per_batch,
            shared_outer=experts_shared_outer,
            added=lora_added_tokens_size,
        )
        return buffer_plans(pool, itemsize_of(cfg))
    layers = int(cfg["num_hidden_layers"])
    n, r, size = max_loras_per_batch, max_lora_rank, itemsize_of(cfg)
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

    moe = is_moe(cfg)
    has_shared = bool((cfg.get("shared_expert_intermediate_size") or 0) > 0 or (cfg.get("n_shared_experts") or 0) > 0)
    experts = max(1, expert_count(cfg) // max(1, moe_ep_size))
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


def buffer_plans(pool: _pool.Pool, itemsize: int) -> list[BufferPlan]:
    """The pool's buffers as BufferPlans (layers with equal shapes grouped), in SGLang's allocation order."""
    plans = []
    for kind, a_side, b_side in (
        ("embed_tokens", pool.embedding_a, pool.embedding_b),
        ("lm_head", pool.lm_head_a, pool.lm_head_b),
    ):
        if kind in a_side:
            plans.append(BufferPlan(kind, a_side[kind], b_side[kind], (), itemsize))
    for name, a_layers in pool.a.items():
        groups: dict[tuple[Any, Any], list[int]] = {}
        for layer, (a, b) in enumerate(zip(a_layers, pool.b[name], strict=True)):
            groups.setdefault((a, b), []).append(layer)
        plans += [BufferPlan(name, a, b, tuple(ids), itemsize) for (a, b), ids in groups.items()]
    return plans
