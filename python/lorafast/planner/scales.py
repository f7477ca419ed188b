"""Effective scales, and what an adapter's family means for merging it.

`module_scale` is the scale SGLang's diffusion pipeline gives one module; `planned_adapter` gathers an inspected
adapter's scales and the notes a reader needs; `merge_steps` orders a target's adapters against the weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from lorafast.formats.peft import peft_pattern_key
from lorafast.planner._format import fmt_number
from lorafast.planner.plans import MergeStep, PlannedAdapter

if TYPE_CHECKING:
    from lorafast.adapter import Adapter, LoraModule

# Why each non-additive family cannot be summed with other deltas as plain LoRA.
_NON_ADDITIVE_WHY = {
    "dora": "DoRA rescales W + ΔW to a learned magnitude per output row, so its result depends on the weight "
    "it is applied to",
    "loha": "LoHa's delta is a Hadamard product (w1a·w1b) ⊙ (w2a·w2b), not B·A",
    "lokr": "LoKr's delta is a Kronecker product kron(w1, w2), not B·A",
    "oft": "OFT rotates the weight (W' = R·W): multiplicative, it depends on the current weight",
    "boft": "BOFT rotates the weight with butterfly factors: multiplicative, it depends on the current weight",
    "ia3": "IA3 rescales the weight elementwise: multiplicative, it depends on the current weight",
    "glora": "GLoRA's delta W·a1·a2 + b1·b2 depends on the current weight",
}
# Families whose delta reads W: applying two of them in a row is order-dependent.
_WEIGHT_DEPENDENT = frozenset({"dora", "oft", "boft", "ia3", "glora"})


def module_scale(
    module: LoraModule, strength: float, adapter_alpha: float | None, alpha_pattern: Mapping[str, float] | None = None
) -> tuple[float, str]:
    """Effective scale of one module as SGLang's diffusion pipeline computes it, and where alpha came from.

    Alpha precedence (pipeline.py `_apply_lora_to_layers`): a per-module `.alpha` tensor (kohya; newer SGLang
    also turns `alpha_pattern` into those), then the adapter-level alpha (request `lora_alpha`, else the PEFT
    config), then the rank (scale 1). rsLoRA divides by √r instead of r.
    """
    if module.alpha_key is not None and module.alpha is not None:
        alpha, source = module.alpha, "tensor"
    elif alpha_pattern and module.alpha is not None and peft_pattern_key(alpha_pattern, module.name) is not None:
        alpha, source = module.alpha, "alpha_pattern"
    elif adapter_alpha is not None:
        alpha, source = adapter_alpha, "adapter"
    elif module.alpha is not None:
        alpha, source = module.alpha, "config"
    else:
        return float(strength), "rank"
    if not module.rank:
        return float(strength), source
    return strength * alpha / (math.sqrt(module.rank) if module.use_rslora else module.rank), source


def _adapter_variants(adapter: Adapter) -> tuple[str, ...]:
    variants = list(adapter.variants)
    if "dora" in adapter.flags and "dora" not in variants:
        variants.insert(0, "dora")
    return tuple(variants)


def planned_adapter(
    adapter: Adapter, nickname: str, path: str | None, strength: float, alpha: float | None
) -> PlannedAdapter:
    """`adapter` at `strength` with the pipeline's `alpha`: its scale per module, and notes on what SGLang does."""
    variants = _adapter_variants(adapter)
    notes: list[str] = []
    scales: dict[str, float] = {}
    sources: dict[str, int] = {}
    truncated: set[float] = set()
    for m in adapter.modules:
        scale, source = module_scale(m, strength, alpha, adapter.alpha_pattern)
        scales[m.name] = scale
        sources[source] = sources.get(source, 0) + 1
        if source == "tensor" and m.alpha is not None and not float(m.alpha).is_integer():
            truncated.add(m.alpha)
    if truncated:
        vals = ", ".join(fmt_number(a) for a in sorted(truncated))
        notes.append(
            f"SGLang reads per-module alpha tensors with int(alpha.item()): alpha {vals} would become "
            f"{', '.join(str(int(a)) for a in sorted(truncated))} there; lorafast uses the exact value"
        )
    if adapter.rank_pattern or adapter.alpha_pattern:
        notes.append(
            "per-module ranks/alphas from "
            + " and ".join(
                p for p, v in (("rank_pattern", adapter.rank_pattern), ("alpha_pattern", adapter.alpha_pattern)) if v
            )
        )
    if any(m.use_rslora for m in adapter.modules):
        notes.append("rsLoRA: scale = strength × alpha/√r")
    for v in variants:
        if v in _NON_ADDITIVE_WHY:
            notes.append(_NON_ADDITIVE_WHY[v])
    if "dora" in variants:
        notes.append('SGLang itself rejects it: "DoRA adapters are not supported by the native diffusion LoRA layers"')
    elif variants and not adapter.is_additive:
        notes.append("SGLang's diffusion loader reads only lora_A/lora_B pairs; lorafast.merge applies these")
    if "modules_to_save" in adapter.flags or "full_weights" in adapter.flags:
        notes.append("carries whole weights (modules_to_save / saved base weights) that replace, not add")
    return PlannedAdapter(
        nickname=nickname,
        path=path,
        strength=strength,
        alpha=alpha,
        additive=adapter.is_additive,
        variants=variants,
        scales=scales,
        alpha_sources=sources,
        notes=tuple(notes),
    )


def merge_steps(planned: list[PlannedAdapter], merge: bool, warnings: list[str]) -> tuple[MergeStep, ...]:
    """Merge order: runs of plain LoRA are summed; each non-additive adapter is its own step."""
    if not merge:
        return (MergeStep("dynamic", tuple(a.nickname for a in planned), "computed per forward: x·Aᵀ·Bᵀ·scale"),)
    steps: list[MergeStep] = []
    run: list[str] = []
    for a in planned:
        if a.additive is False:
            if run:
                steps.append(MergeStep("sum", tuple(run), "W += Σ scale·B·A (order-free)"))
                run = []
            why = next((_NON_ADDITIVE_WHY[v] for v in a.variants if v in _NON_ADDITIVE_WHY), "not a B·A sum")
            steps.append(MergeStep("sequential", (a.nickname,), f"applied to the current W on its own: {why}"))
        else:
            run.append(a.nickname)
    if run:
        steps.append(MergeStep("sum", tuple(run), "W += Σ scale·B·A (order-free)"))
    dependent = [a.nickname for a in planned if _WEIGHT_DEPENDENT & set(a.variants)]
    if len(planned) > 1 and dependent:
        verb = "read the weight they are" if len(dependent) > 1 else "reads the weight it is"
        warnings.append(
            f"{', '.join(dependent)} {verb} applied to, so the result depends on the order "
            f"{[a.nickname for a in planned]}: each step sees the weight left by the steps before it"
        )
    return tuple(steps)
