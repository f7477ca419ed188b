"""The first-use checks: what SGLang checks when an adapter first enters a GPU slot (`load_lora_weight_to_buffer`,
replayed in `_load_to_buffer`), reported as problems, plus lorafast's own findings there."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector, CompatProblem
from lorafast.compat._inputs import AdapterView
from lorafast.compat.sglang import _pool
from lorafast.compat.sglang._buffers import BufferPlan, buffer_plans, expert_count, is_moe
from lorafast.compat.sglang._config import (
    EXPERT_ID,
    SHARED_OUTER_SLOTS,
    AdapterConfig,
    load_weights,
    logger,
    memoized,
    resolve_views,
    text_config_of,
)
from lorafast.compat.sglang._load_to_buffer import first_use_error
from lorafast.compat.sglang._names import (
    MSG_SHARED_OUTER_DICT,
    MSG_SHARED_OUTER_EXPERT_DIM,
    MSG_SKIPPED,
)
from lorafast.compat.sglang._torchlike import size_repr
from lorafast.compat.sglang._weights import LoadedWeights


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


def collect_skipped(
    view: AdapterView,
    weights: LoadedWeights,
    target_modules: set[str],
    *,
    strict: bool,
    col: Collector,
    memo: dict[Any, Any] | None = None,
) -> list[str]:
    key = ("skipped", id(weights.layers), id(weights.embedding), frozenset(target_modules))
    skipped = memoized(memo, key, lambda: _skipped_names(weights, target_modules))
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
    (view,) = resolve_views([adapter])
    weights = load_weights(view, base_config=text_config_of(base_config))
    return collect_skipped(view, weights, set(target_modules), strict=strict, col=Collector(collect=False))


@dataclass
class _Slot:
    tensor: tuple[int, ...] | None = None
    names: list[str] = field(default_factory=list)
    experts: dict[int, tuple[int, ...] | None] | None = None


def classify_slots(
    weights: LoadedWeights, target_modules: set[str], has_shared_moe: bool = False
) -> dict[int, dict[tuple[str, str], _Slot]]:
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
        expert = EXPERT_ID.search(name)
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
    slots: dict[int, dict[tuple[str, str], _Slot]], experts_shared_outer: bool, num_experts: int | None
) -> list[tuple[str, bool, str]]:
    """(code, fatal, text): SGLang's shared-outer ValueErrors (full text) and lorafast's expert-0 findings
    (text after the `LoRA adapter '<id>': ` prefix), in layer order."""
    out: list[tuple[str, bool, str]] = []
    for layer in sorted(slots):
        layer_slots = slots[layer]
        if experts_shared_outer:
            for buffer, ab in SHARED_OUTER_SLOTS:
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
            # Shared-expert (`*_shared_moe`) slots, Inkling's normalized shared experts: in shared-outer mode
            # SGLang's shared-expert buffers have expert_dim 1 there (nothing is lost), and the pool predicted
            # here has no shared-expert buffer at all (no shared fused MoE layer), so no expert-0 loss either.
            if not buffer.endswith("_moe") or buffer.endswith("_shared_moe"):
                continue
            outer = experts_shared_outer and (buffer, ab) in SHARED_OUTER_SLOTS
            expert_dim = 1 if outer else num_experts
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


def collect_expert_layout(
    view: AdapterView,
    slots: dict[int, dict[tuple[str, str], _Slot]],
    *,
    experts_shared_outer: bool,
    base_config: Mapping[str, Any] | None,
    col: Collector,
    memo: dict[Any, Any] | None = None,
    warnings_only: bool = False,
) -> None:
    """lorafast's own expert-layout findings, which SGLang never reports. With `warnings_only` the fatal ones are
    left out, for callers that take SGLang's own errors from `FirstUse`."""
    num_experts = expert_count(base_config) if base_config and is_moe(base_config) else None
    key = ("experts", id(slots), experts_shared_outer, num_experts)
    findings = memoized(memo, key, lambda: _expert_findings(slots, experts_shared_outer, num_experts))
    ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
    for code, fatal, text in findings:
        if fatal:
            if not warnings_only:
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
    (view,) = resolve_views([adapter])
    cfg = text_config_of(base_config)
    weights = load_weights(view, base_config=cfg)
    col = Collector(collect)
    slots = classify_slots(weights, set(target_modules))
    collect_expert_layout(view, slots, experts_shared_outer=experts_shared_outer, base_config=cfg, col=col)
    return col.problems


def _fit_findings(slots: dict[int, dict[tuple[str, str], _Slot]], r: int | None, plans: list[BufferPlan]) -> list[str]:
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


def _hashable(value: Any) -> Any:
    """`(type, value)` as a dict key, or None when `value` cannot be one."""
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value), value)


class FirstUse:
    """The checks SGLang makes when an adapter first enters a GPU slot, against one memory pool.

    Adapters trained from one recipe load to the same normalized dicts (`load_adapter_weights` shares them), so
    the replay is done once per (layers, embedding, r): that is everything it reads besides this pool and the
    adapter id. The id appears only in messages, which are rebuilt per adapter; an adapter whose replay raises
    is replayed again so that each problem gets its own exception object.
    """

    def __init__(
        self, pool: _pool.Pool, tree: list[_pool.Module], targets: set[str], strict: bool, shared_outer: bool
    ) -> None:
        layers = 1 + max((m.layer for m in tree if m.layer is not None), default=-1)
        self.pool, self.strict, self.shared_outer = pool, strict, shared_outer
        self.plans = buffer_plans(pool, 2)
        self.modules, _embed, self.lm_head = _pool.lora_modules(tree, targets, layers)
        # (id(layers), id(embedding), r) -> (layers, embedding, skipped, fails, fit findings); the dicts are held
        # so that their ids stay theirs while the entry lives.
        self._replays: dict[Any, tuple[Any, Any, list[str], bool, list[str]]] = {}

    def _replay(self, uid: str, weights: LoadedWeights, r: Any) -> tuple[list[str], bool, list[str]]:
        r_key = _hashable(r)
        key = None if r_key is None else (id(weights.layers), id(weights.embedding), r_key)
        hit = self._replays.get(key) if key is not None else None
        if hit is not None:
            return hit[2], hit[3], hit[4]
        targets = self.pool.target_modules
        skipped = _skipped_names(weights, targets)
        error = first_use_error(
            uid, weights, r, self.pool, self.modules, self.lm_head, strict=self.strict, shared_outer=self.shared_outer
        )
        fit: list[str] = []
        if error is None and self.plans:
            fit = _fit_findings(classify_slots(weights, targets), r if isinstance(r, int) else None, self.plans)
        if key is not None:
            self._replays[key] = (weights.layers, weights.embedding, skipped, error is not None, fit)
        return skipped, error is not None, fit

    def check(self, view: AdapterView, config: AdapterConfig, weights: LoadedWeights, col: Collector) -> None:
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        skipped, fails, fit = self._replay(view.lora_id, weights, config.r)
        if skipped and not self.strict:
            message = MSG_SKIPPED.format(
                uid=view.lora_id, n=len(skipped), targets=sorted(self.pool.target_modules), names=skipped
            )
            logger.warning(message)
            col.warn("sglang_skipped_weights", message, stage="first_use", **ids)
        if fails:
            error = first_use_error(
                view.lora_id,
                weights,
                config.r,
                self.pool,
                self.modules,
                self.lm_head,
                strict=self.strict,
                shared_outer=self.shared_outer,
            )
            assert error is not None
            col.fail("sglang_first_use", error, stage="first_use", **ids)
        else:  # SGLang accepts it; lorafast's own finding: a weight that does not match its buffer
            for text in fit:
                col.warn("sglang_buffer_shape", f"LoRA adapter '{view.lora_id}': {text}", stage="first_use", **ids)
