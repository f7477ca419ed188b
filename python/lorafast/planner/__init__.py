"""Merge-mode planning: what `set_lora` would merge, keep dynamic, skip, unmerge or re-merge.

`plan(requests, engine_version=...)` replays the decisions of SGLang's diffusion `LoRAPipeline.set_lora` of that
release without touching a weight. SGLang's rules, names and texts live in `lorafast.compat.diffusion`; this
module imports them. tests/oracle/test_oracle_plan.py runs the released `set_lora` (0.5.23) on the same calls:

1. the merge mode is resolved (`merge_mode`, else `merge_weights`, else the server's `--lora-merge-mode`);
2. the parallel lists are normalized and the targets validated, with SGLang's exact error texts;
3. adapters are loaded or reloaded (a new or changed path, or a changed `lora_alpha`, sets `adapter_updated`);
4. per target, in first-seen order: the first module decides merge vs dynamic, several adapters on a dynamic
   target raise SGLang's exact `ValueError`, the "config matches" rule may skip, and every module is re-applied.
   From 0.5.23: quantized layers stay dynamic under "auto" (and refuse "merge"), and "auto" keeps a lone adapter
   unmerged where merging would round away more than half of its update, which needs weight values
   (`base_weights=`; without them the component is reported as undecided).

On top of SGLang it computes each adapter's effective scale per module (strength × alpha/r, or alpha/√r with
rsLoRA, honouring per-module alphas, rank_pattern and alpha_pattern), plans adapters that are not plain
B @ A sums (DoRA, LoHa, LoKr, OFT/BOFT, IA3, GLoRA) as separate steps against the current weight, and with
`resolve=True` turns the targets SGLang would reject into merges, saying why.

`Plan.next_state` is the pipeline state after the call, so a sequence of `set_lora` calls can be planned by
feeding it back as `current=` (or with `Plan.then`).

The package follows the parts of that work: `requests` (a call's requests and SGLang's argument handling),
`state` (the pipeline state), `scales` (effective scales, and what an adapter's family means for merging),
`plans` (the objects `plan()` returns) and `replay` (the replay of `set_lora` itself); `lorafast plan` is
`lorafast.cli.plan`.
"""

from __future__ import annotations

from lorafast.compat.diffusion import LORA_MERGE_MODES, VALID_TARGETS
from lorafast.planner.plans import Action, LoadEvent, MergeStep, Plan, PlanError, PlannedAdapter, TargetPlan
from lorafast.planner.replay import CONFIG_MATCHES_MESSAGE, DYNAMIC_MULTI_ADAPTER_ERROR, plan, plan_set_lora
from lorafast.planner.requests import LoraRequest, normalize_lora_params, parse_adapter_spec, should_merge
from lorafast.planner.scales import module_scale
from lorafast.planner.state import PipelineState

__all__ = [
    "CONFIG_MATCHES_MESSAGE",
    "DYNAMIC_MULTI_ADAPTER_ERROR",
    "LORA_MERGE_MODES",
    "VALID_TARGETS",
    "Action",
    "LoadEvent",
    "LoraRequest",
    "MergeStep",
    "PipelineState",
    "Plan",
    "PlanError",
    "PlannedAdapter",
    "TargetPlan",
    "module_scale",
    "normalize_lora_params",
    "parse_adapter_spec",
    "plan",
    "plan_set_lora",
    "should_merge",
]
