"""Predict, from headers, the weight names and shapes SGLang holds after loading an adapter (sglang-lora.md §4).

SGLang reads every tensor, routes it by name (`_process_weight`), then fuses q/k/v, renames `.w1./.w3./.w2.`,
stacks Mamba `in_proj` and GDN `in_proj_qkvz`, fuses gate/up and DeepSeek `q_a`/`kv_a` (`_normalize_weights`).
Detection and pool checks then look at the result. This module replays those steps on `{name: shape}`
dicts, with the same dict operations in the same order, so names, shapes, insertion order and errors
(KeyError for a missing partner, torch's cat/repeat errors) come out as SGLang's would.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat._inputs import AdapterView
from lorafast.compat.sglang import _torchlike as T
from lorafast.compat.sglang._names import MSG_ADDED_TOKENS_SHAPE, get_normalized_target_modules

Shape = tuple[int, ...]
Weights = dict[str, "Shape | None"]

_LAYER_ID = re.compile(r"layers\.(\d+)\.")
_ROUTED_EXPERT = re.compile(r"\.experts\.")


#: Passed as `target_modules` when the adapter has no config to read (e.g. a bare state dict).
NO_CONFIG: Any = object()


def get_layer_id(name: str) -> int | None:
    match = _LAYER_ID.search(name)
    return int(match.group(1)) if match else None


@dataclass
class LoadedWeights:
    """What `LoRAAdapter` holds after `initialize_weights()`: per-layer dicts, embeddings, added tokens."""

    lora_id: str
    layers: dict[int, Weights] = field(default_factory=dict)
    """Only the layers that received a tensor, ascending."""
    embedding: Weights = field(default_factory=dict)
    added_tokens: Weights = field(default_factory=dict)

    def iter_layer_weights(self) -> Any:
        for layer_id in sorted(self.layers):
            for name, shape in self.layers[layer_id].items():
                yield layer_id, name, shape


def _ndim(shape: Shape | None) -> int | None:
    return None if shape is None else len(shape)


def _cat_dim_minus_2(shapes: list[Shape | None]) -> Shape | None:
    first = shapes[0]
    if first is None:
        return None
    return T.cat(shapes, len(first) - 2)


def route_weights(
    view: AdapterView,
    *,
    target_modules: Any = NO_CONFIG,
    num_hidden_layers: int | None = None,
    lora_added_tokens_size: int = 0,
) -> LoadedWeights:
    """`_process_weight` for every tensor, in load order.

    `target_modules` is the adapter's `target_modules` from its config (`NO_CONFIG`: skip the check
    and the embedding filter). Names with no `layers.N.` that are not embeddings are dropped, as in SGLang.
    """
    loaded = LoadedWeights(view.lora_id)
    normalized: set[str] | None = None
    for name, shape in view.tensors.items():
        if target_modules is not NO_CONFIG and normalized is None:
            normalized = get_normalized_target_modules(target_modules)  # raises per weight in SGLang
        if "unembed_tokens" in name:
            name = name.replace("unembed_tokens", "lm_head")
        layer_id = get_layer_id(name)
        if layer_id is not None:
            if num_hidden_layers is not None and layer_id >= num_hidden_layers:
                raise IndexError(f"index {layer_id} is out of range")  # nn.ModuleList's message
            loaded.layers.setdefault(layer_id, {})[name] = shape
        elif "embed_tokens" in name or "lm_head" in name:
            module = "embed_tokens" if "embed_tokens" in name else "lm_head"
            if normalized is None or "all" in normalized or module in normalized:
                loaded.embedding[name] = shape
        elif "input_embeddings" in name or "output_embeddings" in name:
            loaded.added_tokens[name] = shape
            if shape is not None and not shape:
                raise IndexError("tuple index out of range")  # `shape[0]` of a 0-d tensor
            if shape is not None and shape[0] != lora_added_tokens_size:
                raise AssertionError(
                    MSG_ADDED_TOKENS_SHAPE.format(uid=view.lora_id, n=lora_added_tokens_size, name=name, m=shape[0])
                )
    return loaded


# --- _normalize_weights, step by step ------------------------------------------------------------------


def _normalize_qkv(names: list[str], w: Weights) -> None:
    present = set()
    for n in names:
        for part in ("k_proj", "q_proj", "v_proj", "qkv_proj"):
            if part in n:
                present.add(part)
    if not present:
        return
    for n in names:
        if "q_proj" in n:
            k_name = n.replace("q_proj", "k_proj")
            v_name = n.replace("q_proj", "v_proj")
            qkv_name = n.replace("q_proj", "qkv_proj")
            k_shape = w[k_name] if "k_proj" in present else w[v_name]  # zeros_like(v) has v's shape
            w[qkv_name] = T.cat([w[n], k_shape, w[v_name]], 0)
            w.pop(n)
            if "k_proj" in present:
                w.pop(k_name)
            w.pop(v_name)
        elif "qkv_proj" in n and "lora_A" in n:
            w[n] = T.repeat(w[n], (3, 1))


def _normalize_inkling_qkvr(w: Weights, rank: int | None) -> None:
    for n in list(w):
        if "wq_du" in n:
            parts = [n, n.replace("wq_du", "wk_dv"), n.replace("wq_du", "wv_dv"), n.replace("wq_du", "wr_du")]
            if any(p not in w for p in parts):
                continue
            w[n.replace("wq_du", "qkvr")] = _cat_dim_minus_2([w[p] for p in parts])
            for p in parts:
                w.pop(p)
        elif "qkvr" in n and "lora_A" in n:
            shape = w[n]
            if shape is not None and len(shape) >= 2 and shape[-2] == rank:
                w[n] = T.repeat_along(shape, 2, 4)


def _reshape(shape: Shape, new: tuple[int, ...]) -> Shape:
    if T.numel(shape) != T.numel(new):
        raise RuntimeError(f"shape '{list(new)}' is invalid for input of size {T.numel(shape)}")
    return new


def _normalize_inkling_shared_experts(w: Weights, n_shared: int) -> None:
    """`_normalize_shared_expert_moe` (sglang 0.5.23): flat 2D `shared_experts.` factors of an Inkling model become
    the 3D shared-outer form; numbered `shared_experts.N.` factors are kept for validation to reject."""
    for n in list(w):
        if "shared_experts." not in n or re.search(r"shared_experts\.\d+\.", n):
            continue
        is_down = any(k in n for k in (".w2.", ".down_proj."))
        is_gate_up = any(k in n for k in (".w1.", ".w3.", ".gate_proj.", ".up_proj.", ".gate_up_proj."))
        shape = w[n]
        if not (is_down or is_gate_up) or shape is None or len(shape) != 2:
            continue
        if "lora_A" in n:
            if is_down:
                r, flat = shape
                reshaped = _reshape(shape, (r, n_shared, flat // n_shared))
                w[n] = (reshaped[1], reshaped[0], reshaped[2])  # .transpose(0, 1)
            else:
                w[n] = (1, *shape)
        elif is_down:
            w[n] = (1, *shape)
        else:
            flat, r = shape
            w[n] = _reshape(shape, (n_shared, flat // n_shared, r))


def _rename_w123(w: Weights) -> None:
    renames: dict[str, str] = {}
    for n in list(w):
        new = n
        if ".w1." in n:
            new = n.replace(".w1.", ".gate_proj.")
        elif ".w3." in n:
            new = n.replace(".w3.", ".up_proj.")
        elif ".w2." in n:
            new = n.replace(".w2.", ".down_proj.")
        if new != n:
            renames[n] = new
    for old, new in renames.items():
        w[new] = w.pop(old)


def _normalize_in_proj(w: Weights) -> None:
    for n in list(w):
        if "gate_proj" not in n:
            continue
        x_name = n.replace("gate_proj", "x_proj")
        if x_name not in w:
            continue
        w[n.replace("gate_proj", "in_proj")] = _cat_dim_minus_2([w[n], w[x_name]])
        w.pop(n)
        w.pop(x_name)


def _normalize_in_proj_qkvz(w: Weights) -> None:
    for n in list(w):
        if "in_proj_q." in n:
            others = [n.replace("in_proj_q", s) for s in ("in_proj_k", "in_proj_v", "in_proj_z")]
            if any(o not in w for o in others):
                continue
            w[n.replace("in_proj_q", "in_proj_qkvz")] = _cat_dim_minus_2([w[n]] + [w[o] for o in others])
            w.pop(n)
            for o in others:
                w.pop(o)
        elif "in_proj_qkvz" in n and "lora_A" in n:
            w[n] = T.repeat_along(w[n], 2, 4)


def _normalize_gate_up(names: list[str], w: Weights, is_non_gated_moe: Callable[[str], bool]) -> None:
    for n in names:
        if "gate_proj" in n:
            up = n.replace("gate_proj", "up_proj")
            gate_up = n.replace("gate_proj", "gate_up_proj")
            up_shape = w.get(up)
            if up not in w or (up_shape is not None and T.numel(up_shape) == 0):
                if is_non_gated_moe(n):
                    w[gate_up] = w.pop(n)
                    if up in w:
                        w.pop(up)
                    continue
                w[up] = w[n]  # zeros_like(gate)
            w[gate_up] = _cat_dim_minus_2([w[n], w[up]])
            w.pop(n)
            w.pop(up)
        elif "gate_up_proj" in n and "lora_A" in n:
            w[n] = T.repeat_along(w[n], 2, 2)


def _normalize_fused_qkv_a(names: list[str], w: Weights) -> None:
    for n in names:
        if "q_a_proj" not in n or "fused_qkv_a_proj_with_mqa" in n:
            continue
        kv_name = n.replace("q_a_proj", "kv_a_proj_with_mqa")
        kv_shape = w[kv_name] if kv_name in w else w[n]  # zeros_like(q_a)
        w[n.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")] = T.cat([w[n], kv_shape], 0)
        w.pop(n)
        if kv_name in w:
            w.pop(kv_name)


def normalize_layer(
    w: Weights,
    *,
    rank: int | None = None,
    inkling_shared_experts: int | None = None,
    is_non_gated_moe: Callable[[str], bool] = lambda name: False,
) -> None:
    """`_normalize_weights` for one layer's dict, in place."""
    _normalize_qkv(list(w), w)
    _normalize_inkling_qkvr(w, rank)
    if inkling_shared_experts:
        _normalize_inkling_shared_experts(w, inkling_shared_experts)
    _rename_w123(w)
    _normalize_in_proj(w)
    _normalize_in_proj_qkvz(w)
    _normalize_gate_up(list(w), w, is_non_gated_moe)
    _normalize_fused_qkv_a(list(w), w)


#: Normalized layers seen before, keyed by the layer's names with its layer id blanked out. Fleets of
#: adapters (and the layers of one adapter) repeat the same structure, so each is normalized once.
class _BoundedCache:
    """A dict emptied once it holds more than `budget` tensor entries in all (keys hold tensor names)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.data: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self.data.get(key)

    def put(self, key: Any, value: Any, weight: int) -> None:
        if self.used + weight > self.budget:
            self.data.clear()
            self.used = 0
        if weight <= self.budget:
            self.data[key] = value
            self.used += weight


_LAYER_CACHE = _BoundedCache(200_000)
_BLANK = "layers.\x00."
_FAILED = object()


def _normalize_layer_cached(
    w: Weights, layer_id: int, *, rank: int | None, inkling_shared_experts: int | None, non_gated: bool
) -> Weights:
    token = f"layers.{layer_id}."
    names = list(w)
    if any("\x00" in n for n in names):
        key = None
    else:
        key = (tuple((n.replace(token, _BLANK, 1), w[n]) for n in names), rank, inkling_shared_experts, non_gated)
        cached = _LAYER_CACHE.get(key)
        if cached is not None and cached is not _FAILED:
            return {n.replace(_BLANK, token, 1): shape for n, shape in cached}

    def is_non_gated(name: str) -> bool:
        return non_gated and _ROUTED_EXPERT.search(name) is not None

    try:
        # Errors name real tensors, so a layer that fails is always normalized under its real names.
        normalize_layer(w, rank=rank, inkling_shared_experts=inkling_shared_experts, is_non_gated_moe=is_non_gated)
    except Exception:
        if key is not None:
            _LAYER_CACHE.put(key, _FAILED, len(names))
        raise
    if key is not None:
        _LAYER_CACHE.put(key, tuple((n.replace(token, _BLANK, 1), shape) for n, shape in w.items()), 2 * len(names))
    return w


def _is_inkling(base_config: Mapping[str, Any] | None) -> bool:
    if not base_config:
        return False
    archs = base_config.get("architectures") or []
    return any("Inkling" in str(a) for a in archs) or "inkling" in str(base_config.get("model_type", "")).lower()


_ADAPTER_CACHE = _BoundedCache(400_000)


def _freeze(value: Any) -> Any:
    if value is NO_CONFIG:
        return ("no-config",)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, str) or value is None:
        return ("str", value)
    return ("repr", type(value).__name__, repr(value))


def load_adapter_weights(
    view: AdapterView,
    *,
    target_modules: Any = NO_CONFIG,
    rank: int | None = None,
    base_config: Mapping[str, Any] | None = None,
    lora_added_tokens_size: int = 0,
    non_gated_moe_layers: frozenset[int] = frozenset(),
) -> LoadedWeights:
    """Route and normalize every tensor of `view` the way `LoRAAdapter.initialize_weights` does.

    The result may share its dicts with other adapters of the same structure (cached): treat it as read-only.
    """
    if view.load_error is not None:
        raise view.load_error
    num_layers = None
    if base_config is not None and base_config.get("num_hidden_layers") is not None:
        num_layers = int(base_config["num_hidden_layers"])
    n_shared = None
    if _is_inkling(base_config):  # SGLang skips the reshape when the model has no shared experts
        n_shared = int(base_config.get("n_shared_experts") or 0) or None  # type: ignore[union-attr]
    key = (
        tuple(view.tensors.items()),
        _freeze(target_modules),
        rank,
        num_layers,
        n_shared,
        lora_added_tokens_size,
        non_gated_moe_layers,
    )
    cached = _ADAPTER_CACHE.get(key)
    if cached is not None and cached is not _FAILED:
        layers, embedding, added = cached
        return LoadedWeights(view.lora_id, layers, embedding, added)
    try:
        loaded = route_weights(
            view,
            target_modules=target_modules,
            num_hidden_layers=num_layers,
            lora_added_tokens_size=lora_added_tokens_size,
        )
        for layer_id in sorted(loaded.layers):
            loaded.layers[layer_id] = _normalize_layer_cached(
                loaded.layers[layer_id],
                layer_id,
                rank=rank,
                inkling_shared_experts=n_shared,
                non_gated=layer_id in non_gated_moe_layers,
            )
    except Exception:
        _ADAPTER_CACHE.put(key, _FAILED, len(view.tensors))  # errors name this adapter: recomputed, never replayed
        raise
    _ADAPTER_CACHE.put(key, (loaded.layers, loaded.embedding, loaded.added_tokens), 2 * len(view.tensors))
    return loaded
