"""A replay of SGLang's `LoRAMemoryPool.load_lora_weight_to_buffer` (sglang 0.5.23) on shapes: the engine's code.

SGLang raises these only when a request first brings the adapter into a GPU slot, long after start-up said
yes. The walk below follows the engine's loops in the engine's order (layers, weights in dict order, wrapped
modules, A buffers then B buffers, then embeddings), with the TP-1 slicing of each wrapper class, and raises
the first exception SGLang would: `Cannot find target module name ...`, the buffer-copy assertion, torch's
indexing errors, the shared-outer expert checks. `first_use_error` returns it instead of raising;
`_first_use` turns it into problems.
"""

from __future__ import annotations

import re
from typing import Any

from lorafast.compat.sglang._names import MSG_SHARED_OUTER_DICT, MSG_SHARED_OUTER_EXPERT_DIM, MSG_SKIPPED
from lorafast.compat.sglang._pool import Module, Pool
from lorafast.compat.sglang._torchlike import size_repr
from lorafast.compat.sglang._weights import LoadedWeights

Shape = tuple[int, ...]
_EXPERT = re.compile(r"experts\.(\d+)\.")
_MOE_BUFFERS = ("gate_up_proj_moe", "down_proj_moe", "gate_up_proj_shared_moe", "down_proj_shared_moe")


def target_module_name(name: str, target_modules: set[str]) -> str:
    """sglang `get_target_module_name`: the longest match, the first of equals in set order."""
    best = None
    for target in target_modules:
        if target in name and (best is None or len(target) > len(best)):
            best = target
    if best is None:
        raise ValueError(f"Cannot find target module name for {name} in {target_modules}")
    return best


def _rows(n: int, start: Any, stop: Any) -> int:
    """Length of `range(n)[start:stop]` (torch slicing clamps like Python's)."""
    for bound in (start, stop):
        if bound is not None and not isinstance(bound, int):
            raise TypeError("slice indices must be integers or None or have an __index__ method")
    return len(range(n)[start:stop])


def _index2(shape: Shape | None, rows: tuple[Any, Any], cols: tuple[Any, Any] | None = None) -> Shape:
    """`t[a:b, c:d]` (or `t[a:b, :]`) on a tensor of `shape`."""
    if shape is None:
        raise TypeError("'NoneType' object is not subscriptable")
    if len(shape) < 2:
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    first = _rows(shape[0], *rows)
    second = shape[1] if cols is None else _rows(shape[1], *cols)
    return (first, second, *shape[2:])


def _cat_rows(parts: list[Shape]) -> Shape:
    return (sum(p[0] for p in parts), *parts[0][1:])


def _slice_a(module: Module, a: Shape) -> Shape:
    if module.kind == "row":
        return _index2(a, (None, None), (0, module.input_size))
    return a


def _slice_b(module: Module, b: Shape | None) -> Shape | None:
    if module.kind == "row":
        return b
    if module.kind == "qkv":
        q, k, _v = module.output_sizes
        kv = k
        return _cat_rows([_index2(b, (0, q)), _index2(b, (q, q + kv)), _index2(b, (q + k, q + k + kv))])
    if module.kind == "merged":
        parts, offset = [], 0
        for size in module.output_sizes:
            parts.append(_index2(b, (offset, offset + size)))
            offset += size
        return _cat_rows(parts)
    if module.kind == "replicated":
        return b
    return _index2(b, (0, module.output_sizes[0]))


def _load(view: Shape, weight: Shape | None) -> None:
    if weight is not None and tuple(view) != tuple(weight):
        raise AssertionError(f"LoRA buffer shape {size_repr(view)} does not match weight shape {size_repr(weight)}.")


def _view(buffer: Shape, *index: Any) -> Shape:
    """The shape of `buffer[index]` for int and (start, stop) slice entries; the rest of the dims are kept."""
    out: list[int] = []
    for dim, entry in enumerate(index):
        size = buffer[dim]
        if isinstance(entry, tuple):
            out.append(_rows(size, *entry))
        elif entry >= size:
            raise IndexError(f"index {entry} is out of bounds for dimension {dim} with size {size}")
    return (*out, *buffer[len(index) :])


def _experts(weights: Any) -> list[tuple[int, Shape | None]]:
    if isinstance(weights, dict):
        return list(weights.items())
    if len(weights) == 3:
        return [(i, tuple(weights[1:])) for i in range(weights[0])]
    raise TypeError("Expected dict or 3D torch.Tensor, got Tensor.")


def load_to_buffer(
    uid: str,
    weights: LoadedWeights,
    r: Any,
    pool: Pool,
    modules: list[dict[str, Module]],
    lm_head_wrapped: bool,
    *,
    strict: bool,
    shared_outer: bool,
) -> None:
    """Raise what `load_lora_weight_to_buffer(uid, ...)` raises for this adapter (buffer slot 0)."""
    targets = pool.target_modules
    layers = [weights.layers.get(i, {}) for i in range(len(modules))]
    all_names = [n for layer in layers for n in layer] + list(weights.embedding)
    skipped = set()
    for name in all_names:
        try:
            target_module_name(name, targets)
        except ValueError:
            skipped.add(name)
    if skipped and strict:
        raise ValueError(MSG_SKIPPED.format(uid=uid, n=len(skipped), targets=sorted(targets), names=sorted(skipped)))
    max_r = pool.max_lora_rank
    for layer_id, layer in enumerate(layers):
        temp_a: dict[str, Any] = {k: None for k in pool.a}
        temp_b: dict[str, Any] = {k: None for k in pool.b}
        for name, shape in layer.items():
            target = target_module_name(name, targets)
            expert = _EXPERT.search(name)
            is_shared = "shared_experts." in name
            if is_shared and shape is not None and len(shape) == 3:
                target = f"{target}_shared_moe"
                dest = temp_a if "lora_A" in name else temp_b
                if expert:
                    if temp_a[target] is None:  # KeyError without a shared-expert MoE buffer, as in SGLang
                        temp_a[target], temp_b[target] = {}, {}
                    dest[target][int(expert.group(1))] = shape
                else:
                    dest[target] = shape
            elif is_shared and expert:
                raise ValueError(
                    f"Cannot load LoRA weight {name!r}: layer {layer_id} has no matching target for "
                    "indexed shared-expert weights."
                )
            elif expert:
                target = f"{target}_moe"
                if temp_a[target] is None:
                    temp_a[target], temp_b[target] = {}, {}
                (temp_a if "lora_A" in name else temp_b)[target][int(expert.group(1))] = shape
            elif "experts" in name and shape is not None and len(shape) == 3:
                (temp_a if "lora_A" in name else temp_b)[f"{target}_moe"] = shape
            else:
                (temp_a if "lora_A" in name else temp_b)[target] = shape
        active: set[str] = set()
        for module_name, module in modules[layer_id].items():
            if module.kind == "moe":
                active.update(("gate_up_proj_moe", "down_proj_moe"))
                continue  # MoE slicing is the identity at TP 1 with a gated, non-interleaved runner
            target = target_module_name(module_name, targets)
            active.add(target)
            if temp_a[target] is None:
                continue
            temp_a[target] = _slice_a(module, temp_a[target])
            missing_b = temp_b[target] is None
            temp_b[target] = _slice_b(module, temp_b[target])
            if missing_b:  # a row-parallel slice passes None through; SGLang then asserts on the B cache key
                raise AssertionError()
        for side, temp in (("A", temp_a), ("B", temp_b)):
            buffers = pool.a if side == "A" else pool.b
            for name, w in temp.items():
                if name not in active:
                    continue
                _copy(side, name, w, buffers[name][layer_id], r, max_r, shared_outer)
    if weights.embedding:
        for name, shape in weights.embedding.items():
            target = target_module_name(name, targets)
            is_a = "lora_embedding_A" in name or "lora_A" in name
            is_b = "lora_embedding_B" in name or "lora_B" in name
            if target == "embed_tokens" and "embed_tokens" in name and (is_a or is_b):
                if is_a:
                    buf = pool.embedding_a[target]
                    _load(_view(buf, 0, (None, r), (None, buf[2])), shape)
                else:
                    _load(_view(pool.embedding_b[target], 0, (None, None), (None, r)), shape)
            elif target == "lm_head" and lm_head_wrapped and "lm_head" in name and (is_a or is_b):
                if is_a:
                    _load(_view(pool.lm_head_a[target], 0, (None, r), (None, None)), shape)
                elif shape is not None:
                    rows = shape[0]
                    _load(_view(pool.lm_head_b[target], 0, (None, rows), (None, r)), shape)
            elif target == "lm_head" and "lm_head" in name and (is_a or is_b):
                raise AssertionError(
                    f"Failed to load lm_head LoRA weight: {name}, this is only expected to happen on "
                    "non-last PP stages."
                )


def _copy(side: str, name: str, w: Any, buffer: Shape, r: Any, max_r: Any, shared_outer: bool) -> None:
    """The A (or B) copy loop body for one buffer of one layer."""
    c = _stacked(name)
    if name not in _MOE_BUFFERS:
        view = (
            _view(buffer, 0, (None, r * c), (None, None)) if side == "A" else _view(buffer, 0, (None, None), (None, r))
        )
        _load(view, w)
        return
    outer = (
        ("gate_up_proj_moe", "gate_up_proj_shared_moe") if side == "A" else ("down_proj_moe", "down_proj_shared_moe")
    )
    if shared_outer and name in outer:
        label = "gate_up_proj_moe lora_A" if side == "A" else "down_proj_moe lora_B"
        if w is None or (isinstance(w, dict) and not w):
            rep = None
        elif not isinstance(w, dict) and len(w) == 3:
            if w[0] != 1:
                raise ValueError(MSG_SHARED_OUTER_EXPERT_DIM.format(buffer=label.split()[0], ab=side, e=w[0]))
            rep = tuple(w[1:])
        elif isinstance(w, dict):
            if len(w) != 1:
                raise ValueError(MSG_SHARED_OUTER_DICT.format(buffer=label.split()[0], ab=side, n=len(w)))
            rep = next(iter(w.values()))
        else:
            raise ValueError(
                f"Unexpected weight format for shared outer {label}: type=<class 'torch.Tensor'>, shape={size_repr(w)}"
            )
        if side == "B":
            _load(_view(buffer, 0, 0, (None, None), (None, r)), rep)
            return
        if rep is not None:
            _load(_view(buffer, 0, 0, (None, r * c), (None, None)), rep)
            for ci in range(c):
                view = _view(buffer, 0, 0, (ci * max_r, ci * max_r + r), (None, None))
                _load(view, _index2(rep, (ci * r, (ci + 1) * r)))
        return
    if w is None:
        return
    for eid, expert_w in _experts(w):
        if expert_w is None:
            continue
        if side == "A":
            for ci in range(c):
                view = _view(buffer, 0, eid, (ci * max_r, ci * max_r + r), (None, None))
                _load(view, _index2(expert_w, (ci * r, (ci + 1) * r)))
        else:
            _load(_view(buffer, 0, eid, (None, None), (None, r)), expert_w)


def _stacked(name: str) -> int:
    from lorafast.compat.sglang._names import get_stacked_multiply

    return get_stacked_multiply(name)


def first_use_error(*args: Any, **kwargs: Any) -> BaseException | None:
    try:
        load_to_buffer(*args, **kwargs)
    except Exception as exc:  # the engine's exception is the answer
        return exc
    return None
