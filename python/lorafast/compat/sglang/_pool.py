"""SGLang's base-model walk and LoRA memory pool (sglang 0.5.23 `lora/utils.py`, `lora/mem_pool.py`), on shapes.

The module tree is the one SGLang's Llama/Qwen2/Mistral/Mixtral/Qwen2-MoE/Qwen3-MoE models build, predicted from
the HF config. Buffers come out in SGLang's order (dict insertion order of `A_buffer`), which matters: the first
failing buffer decides the message. Sets are built from the same strings with the same operations in the same
order as SGLang, so they print the same in the same interpreter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat.sglang._names import (
    EMBEDDING_NAMES,
    KNOWN_LORA_TARGET_MODULES,
    MSG_HIDDEN_DIM,
    get_normalized_target_modules,
    get_stacked_multiply,
)

Shape = tuple[Any, ...]
_ATTN_TP = frozenset(
    {"qkv_proj", "qkvr", "q_b_proj", "kv_b_proj", "o_proj", "out_proj", "wo_ud", "in_proj", "in_proj_qkvz"}
)
_ROW = ("o_proj", "out_proj", "down_proj", "down_proj_moe", "down_proj_shared_moe", "wo_ud")
_REPLICATED = (
    "fused_qkv_a_proj_with_mqa",
    "fc1_latent_proj",
    "fc2_latent_proj",
    "indexer.wq_b",
    "indexer.wk",
    "indexer.weights_proj",
)


class Cfg:
    """A config dict read with attribute semantics, as SGLang reads a transformers config."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.__dict__.update(data)
        # transformers' default for configs written without it (a partial dict passed by a caller)
        if "num_key_value_heads" not in data and "num_attention_heads" in data:
            self.__dict__["num_key_value_heads"] = data["num_attention_heads"]

    def __getattr__(self, name: str) -> Any:  # only reached for a missing key: AttributeError, as on a config
        raise AttributeError(f"'Cfg' object has no attribute '{name}'")


@dataclass
class Module:
    """One module of the base model that LoRA code looks at (linear layers, FusedMoE, embeddings)."""

    name: str
    kind: str
    """One of qkv, merged, row, replicated, moe, embed, lm_head."""
    layer: int | None
    input_size: int = 0
    output_sizes: list[int] = field(default_factory=list)


def base_model_tree(cfg: Mapping[str, Any]) -> list[Module]:
    """The modules of SGLang's model for `cfg`, in `named_modules()` order."""
    c = Cfg(cfg)
    hidden, heads = c.hidden_size, c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    routed = getattr(c, "n_routed_experts", None)  # DeepSeek-style: MLA attention, shared experts
    out = [Module("model.embed_tokens", "embed", None)]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        if getattr(c, "kv_lora_rank", None):
            out += _mla_attention(c, pre, i)
        else:
            qkv = [heads * head_dim, kv * head_dim, kv * head_dim]
            out.append(Module(f"{pre}.self_attn.qkv_proj", "qkv", i, hidden, qkv))
            out.append(Module(f"{pre}.self_attn.o_proj", "row", i, heads * head_dim, [hidden]))
        if routed:
            first_k = getattr(c, "first_k_dense_replace", 0) or 0
            if i < first_k:
                out += _mlp(f"{pre}.mlp", i, hidden, c.intermediate_size)
            else:
                out.append(Module(f"{pre}.mlp.experts", "moe", i))
                shared = (getattr(c, "n_shared_experts", 0) or 0) * c.moe_intermediate_size
                if shared:
                    out += _mlp(f"{pre}.mlp.shared_experts", i, hidden, shared)
        elif not experts:
            out += _mlp(f"{pre}.mlp", i, hidden, c.intermediate_size)
        elif getattr(c, "model_type", "") == "mixtral" or "MixtralForCausalLM" in (
            getattr(c, "architectures", None) or ()
        ):
            out.append(Module(f"{pre}.block_sparse_moe.gate", "replicated", i, hidden, [experts]))
            out.append(Module(f"{pre}.block_sparse_moe.experts", "moe", i))
        else:
            out.append(Module(f"{pre}.mlp.gate", "replicated", i, hidden, [experts]))
            out.append(Module(f"{pre}.mlp.experts", "moe", i))
            shared = getattr(c, "shared_expert_intermediate_size", 0) or 0
            if shared:
                out += _mlp(f"{pre}.mlp.shared_expert", i, hidden, shared)
    out.append(Module("lm_head", "lm_head", None))
    return out


def _mlp(prefix: str, layer: int, hidden: int, inter: int) -> list[Module]:
    return [
        Module(f"{prefix}.gate_up_proj", "merged", layer, hidden, [inter, inter]),
        Module(f"{prefix}.down_proj", "row", layer, inter, [hidden]),
    ]


def _mla_attention(c: Cfg, pre: str, layer: int) -> list[Module]:
    """DeepSeek MLA attention as SGLang builds it (fused q_a/kv_a when there is a q LoRA rank)."""
    heads, hidden = c.num_attention_heads, c.hidden_size
    q_rank = getattr(c, "q_lora_rank", None)
    kv_a = c.kv_lora_rank + c.qk_rope_head_dim
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    out = []
    if q_rank:
        out.append(Module(f"{pre}.self_attn.fused_qkv_a_proj_with_mqa", "replicated", layer, hidden, [q_rank + kv_a]))
        out.append(Module(f"{pre}.self_attn.q_b_proj", "column", layer, q_rank, [heads * qk]))
    else:
        out.append(Module(f"{pre}.self_attn.q_proj", "column", layer, hidden, [heads * qk]))
        out.append(Module(f"{pre}.self_attn.kv_a_proj_with_mqa", "replicated", layer, hidden, [kv_a]))
    out.append(
        Module(
            f"{pre}.self_attn.kv_b_proj", "column", layer, c.kv_lora_rank, [heads * (c.qk_nope_head_dim + c.v_head_dim)]
        )
    )
    out.append(Module(f"{pre}.self_attn.o_proj", "row", layer, heads * c.v_head_dim, [hidden]))
    return out


def auto_detect(tree: list[Module], supported_lora_modules: Any = None) -> set[str]:
    """`auto_detect_lora_target_modules(model)` over the predicted tree (and the model's `supported_lora_modules`)."""
    raw: set[str] = set()
    for m in tree:
        if m.kind == "moe":
            raw.add("gate_up_proj")
            raw.add("down_proj")
        elif m.kind == "lm_head":
            raw.add("lm_head")
        elif m.kind == "embed":
            raw.add("embed_tokens")
        else:
            parts = m.name.split(".")
            qualified = ".".join(parts[-2:])
            if qualified in ("indexer.wq_b", "indexer.wk", "indexer.weights_proj"):
                raw.add(qualified)
            elif parts[-1] in ("wq_b", "wk", "weights_proj"):
                continue
            else:
                raw.add(parts[-1])
    normalized = get_normalized_target_modules(raw)
    result = normalized & KNOWN_LORA_TARGET_MODULES
    if supported_lora_modules is not None:
        result.update(set(supported_lora_modules) & KNOWN_LORA_TARGET_MODULES)
    return result


def get_default_hidden_dim(module_name: str, c: Cfg, layer_idx: int, added: int = 0) -> tuple[Any, Any]:
    """sglang `get_default_hidden_dim`, line for line (the same None arithmetic fails the same way)."""
    head_dim = getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    if module_name == "qkv_proj":
        return c.hidden_size, head_dim * (c.num_attention_heads + c.num_key_value_heads * 2)
    if module_name == "o_proj":
        o_head_dim = getattr(c, "v_head_dim", None) or head_dim
        return o_head_dim * c.num_attention_heads, c.hidden_size
    if module_name in ("gate_up_proj", "down_proj"):
        inter = c.intermediate_size
        first_k = getattr(c, "first_k_dense_replace", None)
        moe_freq = getattr(c, "moe_layer_freq", 1)
        if first_k is not None and layer_idx >= first_k and layer_idx % moe_freq == 0:
            moe_inter = getattr(c, "moe_intermediate_size", None)
            n_shared = getattr(c, "n_shared_experts", None)
            if moe_inter is not None and n_shared is not None:
                inter = moe_inter * n_shared
        return (c.hidden_size, inter * 2) if module_name == "gate_up_proj" else (inter, c.hidden_size)
    if module_name == "fused_qkv_a_proj_with_mqa":
        q_lora_rank = getattr(c, "q_lora_rank", None) or 0
        return c.hidden_size, q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim
    if module_name == "q_b_proj":
        return c.q_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    if module_name == "kv_b_proj":
        return c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
    if module_name in ("gate_up_proj_moe", "down_proj_moe"):
        moe_inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        return (c.hidden_size, moe_inter * 2) if module_name == "gate_up_proj_moe" else (moe_inter, c.hidden_size)
    if module_name == "embed_tokens":
        return c.vocab_size + added, c.hidden_size
    if module_name == "lm_head":
        return c.hidden_size, c.vocab_size + added
    raise NotImplementedError(MSG_HIDDEN_DIM + module_name)


def zeros(shape: Shape) -> Shape:
    """The shape `torch.zeros(shape)` accepts, or torch's TypeError for a non-integer size."""
    for pos, d in enumerate(shape):
        if type(d) is not int:
            if pos == 0:
                raise TypeError(
                    f"zeros(): argument 'size' (position 1) must be tuple of ints, but found element "
                    f"of type {type(d).__name__} at pos 0"
                )
            raise TypeError(
                f"zeros(): argument 'size' failed to unpack the object at pos {pos + 1} with error "
                f'"type must be tuple of ints,but got {type(d).__name__}"'
            )
    return tuple(shape)


@dataclass
class Pool:
    """`LoRAMemoryPool` buffers: name -> per-layer shape, in SGLang's insertion order."""

    target_modules: set[str]
    max_lora_rank: Any
    num_experts: int
    a: dict[str, list[Shape]] = field(default_factory=dict)
    b: dict[str, list[Shape]] = field(default_factory=dict)
    embedding_a: dict[str, Shape] = field(default_factory=dict)
    embedding_b: dict[str, Shape] = field(default_factory=dict)
    lm_head_a: dict[str, Shape] = field(default_factory=dict)
    lm_head_b: dict[str, Shape] = field(default_factory=dict)


def build_pool(
    cfg: Mapping[str, Any],
    tree: list[Module],
    target_modules: set[str],
    max_lora_rank: Any,
    *,
    max_loras_per_batch: int,
    shared_outer: bool,
    added: int,
) -> Pool:
    """`LoRAMemoryPool.__init__` -> `init_buffers` at TP 1, raising what it raises."""
    c = Cfg(cfg)
    n = max_loras_per_batch
    num_experts = (
        getattr(c, "num_experts", None)
        or getattr(c, "num_local_experts", None)
        or getattr(c, "n_routed_experts", None)
        or 1
    )
    pool = Pool(target_modules, max_lora_rank, num_experts)
    linears: dict[tuple[str, int], Module] = {}
    for m in tree:
        if m.layer is not None and m.kind in ("qkv", "merged", "row", "replicated", "column"):
            linears.setdefault((m.name.rsplit(".", 1)[-1], m.layer), m)

    def local_dim(name: str, layer: int, axis: str) -> Any:
        if name in _ATTN_TP or "moe" in name:
            return None
        base = linears.get((name, layer))
        if base is None:
            return None
        if axis == "input":
            return base.input_size
        return sum(base.output_sizes[: get_stacked_multiply(name)]) if base.output_sizes else None

    def expert_dim(name: str, outer: tuple[str, ...]) -> int:
        return 1 if shared_outer and name in outer else num_experts

    def a_shape(name: str, layer: int) -> Shape:
        input_dim, _ = get_default_hidden_dim(name, c, layer)
        mult = get_stacked_multiply(name)
        if name in _ROW and name not in _REPLICATED:
            local = local_dim(name, layer, "input")
            if local is not None:
                input_dim = local
        if "moe" in name:
            return (
                n,
                expert_dim(name, ("gate_up_proj_moe", "gate_up_proj_shared_moe")),
                max_lora_rank * mult,
                input_dim,
            )
        return (n, max_lora_rank * mult, input_dim)

    def b_shape(name: str, layer: int) -> Shape:
        _, output_dim = get_default_hidden_dim(name, c, layer)
        if name not in _ROW and name not in _REPLICATED:
            local = local_dim(name, layer, "output")
            if local is not None:
                output_dim = local
        if "moe" in name:
            return (n, expert_dim(name, ("down_proj_moe", "down_proj_shared_moe")), output_dim, max_lora_rank)
        return (n, output_dim, max_lora_rank)

    has_shared = (
        getattr(c, "shared_expert_intermediate_size", None) is not None and c.shared_expert_intermediate_size > 0
    ) or (getattr(c, "n_shared_experts", 0) or 0) > 0
    has_moe = any(m.kind == "moe" for m in tree)
    layers = range(c.num_hidden_layers)

    def init_buffer(buffer: dict[str, list[Shape]], shape_fn: Any) -> None:
        modules = target_modules - set(EMBEDDING_NAMES)
        for name in modules:
            if name in {"gate_up_proj", "down_proj"} and has_moe:
                if has_shared:
                    buffer[name] = [zeros(shape_fn(name, i)) for i in layers]
                buffer[f"{name}_moe"] = [zeros(shape_fn(f"{name}_moe", i)) for i in layers]
            else:
                buffer[name] = [zeros(shape_fn(name, i)) for i in layers]

    def embedding_buffers(buffer: dict[str, Shape], b_side: bool) -> None:
        for name in target_modules & set(EMBEDDING_NAMES):
            in_dim, out_dim = get_default_hidden_dim(name, c, 0, added)
            buffer[name] = zeros((n, out_dim, max_lora_rank) if b_side else (n, max_lora_rank, in_dim))

    if added > 0:
        zeros((n, added, c.hidden_size))
    if "embed_tokens" in target_modules:
        embedding_buffers(pool.embedding_a, False)
        embedding_buffers(pool.embedding_b, True)
    if "lm_head" in target_modules:
        embedding_buffers(pool.lm_head_a, False)
        embedding_buffers(pool.lm_head_b, True)
    init_buffer(pool.a, a_shape)
    init_buffer(pool.b, b_shape)
    return pool


def lora_modules(
    tree: list[Module], target_modules: set[str], num_layers: int
) -> tuple[list[dict[str, Module]], bool, bool]:
    """`init_lora_modules`: the wrapped modules of each layer, and whether embed_tokens / lm_head are wrapped."""
    per_layer: list[dict[str, Module]] = [{} for _ in range(num_layers)]
    embed = lm_head = False
    both = all(x in target_modules for x in ["gate_up_proj", "down_proj"])
    for m in tree:
        if "embed_tokens" in m.name and "embed_tokens" in target_modules and m.kind == "embed":
            embed = True
            continue
        if "lm_head" in m.name and "lm_head" in target_modules and m.kind == "lm_head":
            lm_head = True
            continue
        parts = m.name.split(".")
        if parts[-1] in target_modules or ".".join(parts[-2:]) in target_modules:
            if m.layer is not None:
                per_layer[m.layer][m.name] = m
            continue
        if m.kind == "moe" and both and m.layer is not None:
            per_layer[m.layer][m.name] = m
    return per_layer, embed, lm_head
