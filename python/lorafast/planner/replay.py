"""The replay of SGLang's diffusion `LoRAPipeline.set_lora`: `plan()` and its steps.

`_Planner.run` follows `set_lora` step by step over a copy of the pipeline state: load or reload adapters, group
the requests by target, then per target decide merge or dynamic, apply the "config matches" skip rule and the
0.5.23 rounding-loss rule, and record what each module does.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lorafast.compat import diffusion as _diffusion
from lorafast.compat import engine_rules
from lorafast.compat.diffusion import PIPELINE_MODULES, VALID_TARGETS, resolve_lora_merge_mode
from lorafast.planner._format import fmt_config
from lorafast.planner.plans import Action, LoadEvent, Plan, PlanError, PlannedAdapter, TargetPlan
from lorafast.planner.requests import (
    LoraRequest,
    normalize_lora_params,
    request_params,
    should_merge,
)
from lorafast.planner.scales import merge_steps, planned_adapter
from lorafast.planner.state import PipelineState
from lorafast.scanning import inspect

if TYPE_CHECKING:
    from lorafast.adapter import Adapter

logger = logging.getLogger("lorafast.planner")

# SGLang's rules, names and texts have one home, compat.diffusion (proven against the released set_lora):
# `LORA_MERGE_MODES` (a tuple in the invalid-mode error), `VALID_TARGETS` (a list in the invalid-target error),
# `PIPELINE_MODULES` (the order `_get_target_lora_layers("all")` lists components), and the messages.
DYNAMIC_MULTI_ADAPTER_ERROR = _diffusion.MSG_DYNAMIC_ONE_ADAPTER
CONFIG_MATCHES_MESSAGE = _diffusion.MSG_CONFIG_MATCHES
_MISSING_MODULE_MESSAGES = _diffusion.MSG_MISSING_MODULE


def plan(
    requests: Any,
    *,
    merge_mode: str | None = None,
    current: PipelineState | None = None,
    weights_sharded: bool | Mapping[str, bool] = False,
    resolve: bool = False,
    merge_weights: bool | None = None,
    tolerance: float = 0.0,
    adapters: Mapping[str, Adapter] | Iterable[Adapter] | None = None,
    modules: Sequence[str] | None = None,
    engine_version: str | None = None,
    quantized: bool | Mapping[str, bool] = False,
    base_weights: Mapping[str, Any] | None = None,
    rounding_loss: Mapping[str, float | None] | None = None,
    cache_merged: bool = False,
    strict_version: bool = False,
) -> Plan:
    """Plan one `set_lora` call.

    `requests`: a `LoraRequest`, a sequence of them, or a mapping of `set_lora` keyword arguments
    (`lora_nickname`, `lora_path`, `strength`, `target`, `lora_alpha`, optionally `merge_mode`/`merge_weights`).
    `merge_mode=None` resolves like SGLang: `merge_weights`, then the server's mode (`current.server_merge_mode`,
    "auto" by default), so the default behaves as "auto". `weights_sharded` is a bool or a per-module mapping
    (FSDP DTensor weights). `tolerance` loosens the float equality of the skip rule (0: exact, like SGLang).
    `adapters` supplies already-inspected adapters keyed by nickname or path; others are read with
    `lorafast.inspect`. `modules` overrides the pipeline components of `current`.

    `engine_version` ("0.5.23"; default: the installed SGLang, else the newest supported) picks the `set_lora`
    rules, which live in `lorafast.compat.diffusion`. From 0.5.23 on:
    - `quantized` (a bool or a per-module mapping) marks components whose LoRA layers hold quantized weights
      that cannot take a merged delta: "auto" keeps them dynamic, "merge" raises SGLang's `ValueError`;
    - "auto" keeps a lone adapter unmerged on a component when merging it would round away more than half of
      its update (by norm). That needs values: with `base_weights` ({component: {layer: tensor}} or
      {component: safetensors file}, layer names as the adapter's after SGLang's format conversion) the loss
      is computed as SGLang computes it (`compat.diffusion.merge_rounding_loss`, torch); `rounding_loss`
      ({component: loss}) gives measured values. Without either the component is planned as a merge and
      listed in `TargetPlan.undecided` / `Plan.undecided`, with a warning;
    - `cache_merged=True` (SGLang's start-up adapter) notes the file-backed merge cache; it changes how a
      merge is done, not whether.
    Versions before 0.5.23 are planned without these three rules. `Plan.version_status` says whether lorafast
    verified the version ("verified", else e.g. "nearest: 0.5.23", with an `UnverifiedEngineVersion` warning);
    `strict_version=True` raises `UnverifiedEngineVersionError` for one it has not.

    Raises SGLang's exact `ValueError`s (invalid mode, list lengths, alpha, targets, unknown adapter, several
    adapters on a dynamic target unless `resolve=True`), and `PlanError` for non-additive adapters on a dynamic
    target (unless `resolve=True`).
    """
    state = current if current is not None else PipelineState()
    if modules is not None:
        state = replace(state, modules=tuple(modules))
    rules = engine_rules("sglang", engine_version, strict=strict_version)
    version = rules.requested
    params, merge_mode, merge_weights = request_params(requests, merge_mode, merge_weights)
    mode = resolve_lora_merge_mode(merge_weights, merge_mode, state.server_merge_mode, engine_version=version)
    nicknames, paths, strengths, targets, alphas = normalize_lora_params(*params, engine_version=version)
    planner = _Planner(
        state,
        mode,
        weights_sharded,
        resolve,
        tolerance,
        adapters,
        engine_version=version,
        quantized=quantized,
        base_weights=base_weights,
        given_loss=rounding_loss,
        cache_merged=cache_merged,
    )
    return replace(planner.run(nicknames, paths, strengths, targets, alphas), version_status=rules.status)


def plan_set_lora(
    lora_nickname: str | Sequence[str],
    lora_path: str | None | list[str | None] = None,
    target: str | Sequence[str] = "all",
    strength: float | Sequence[float] = 1.0,
    merge_weights: bool | None = None,
    merge_mode: str | None = None,
    lora_alpha: float | None | list[float | None] = None,
    **kwargs: Any,
) -> Plan:
    """`plan()` with `LoRAPipeline.set_lora`'s exact signature (keyword options of `plan()` go in `kwargs`)."""
    return plan(
        {
            "lora_nickname": lora_nickname,
            "lora_path": lora_path,
            "target": target,
            "strength": strength,
            "lora_alpha": lora_alpha,
        },
        merge_mode=merge_mode,
        merge_weights=merge_weights,
        **kwargs,
    )


def _group_by_target(targets: Sequence[str]) -> dict[str, list[int]]:
    """Step 7 of `set_lora`: request indexes per target, targets in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault(t, []).append(i)
    return groups


def _resolve_target(target: str, modules: Sequence[str]) -> tuple[list[str], str | None]:
    """SGLang `_get_target_lora_layers`: components for a target, or the warning it logs."""
    if target == "all":
        return [m for m in PIPELINE_MODULES if m in modules], None
    if target in modules:
        return [target], None
    return [], _MISSING_MODULE_MESSAGES.get(target, f"Invalid target: {target}. Valid targets: {VALID_TARGETS}")


def _floats_equal(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    if len(a) != len(b):
        return False
    if tolerance <= 0:
        return list(a) == list(b)
    return all(math.isclose(x, y, rel_tol=0.0, abs_tol=tolerance) for x, y in zip(a, b, strict=True))


def _add_note(err: BaseException, note: str) -> None:
    """PEP 678 note (3.11+); on 3.10 the note is kept in `__notes__` where tracebacks ignore it."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:  # pragma: no cover - Python 3.10
        err.__notes__ = [*getattr(err, "__notes__", []), note]  # type: ignore[attr-defined]


def _config_alpha(adapter: Adapter | None) -> float | None:
    """What `get_peft_lora_alpha` stores on load when no `lora_alpha` is requested."""
    if adapter is None or adapter.lora_alpha is None:
        return None
    a = adapter.lora_alpha
    return int(a) if float(a).is_integer() else a


def _measure_rounding_loss(base: Any, path: str, strength: float, adapter_alpha: float | None) -> float | None:
    """SGLang 0.5.23's rounding loss of one adapter on one component, from the adapter's values.

    The adapter is read as SGLang's diffusion loader reads it (`compat.diffusion.load_lora_adapter`); layer `X`
    takes `X.lora_A`/`X.lora_B` (names without `diffusion_model.` and `.weight`, as `load_lora_adapter` strips
    them), with `_apply_lora_to_layers`' alpha: the layer's `.alpha` tensor (as an int), else the adapter's
    alpha, else the rank. `base` maps layer names to base weights, or is a safetensors file of them.
    """
    loaded = _diffusion.load_lora_adapter(path)
    tensors: dict[str, Any] = {}
    for name, t in loaded.tensors.items():
        tensors[name.replace("diffusion_model.", "").replace(".weight", "")] = t
    if isinstance(base, (str, os.PathLike)):
        from safetensors.torch import load_file

        base = load_file(os.fspath(base))
    layers = []
    for name, weight in base.items():
        layer = name[: -len(".weight")] if name.endswith(".weight") else name
        a, b = tensors.get(layer + ".lora_A"), tensors.get(layer + ".lora_B")
        if a is None or b is None:
            continue
        rank = int(a.shape[-2])
        alpha_t = tensors.get(layer + ".alpha")
        if alpha_t is not None:
            value = alpha_t.value if alpha_t.value is not None else alpha_t.values().item()
            alpha: float | None = int(value)
        elif adapter_alpha is not None:
            alpha = adapter_alpha
        else:
            alpha = rank
        a_values, b_values = a.values(), b.values()
        if a_values is None or b_values is None:
            raise ValueError(f"the values of {layer}'s LoRA weights are not readable after conversion")
        layers.append((weight, [(a_values, b_values, strength, rank, alpha)]))
    return _diffusion.merge_rounding_loss(layers)


@dataclass
class _TargetCall:
    """One target of the call while it is planned: its requests, and what the steps decide for its modules."""

    target: str
    nicknames: list[str]
    strengths: list[float]
    paths: list[str | None]
    modules: list[str]
    """The pipeline components the target resolves to, in SGLang's order; the first one decides."""
    adapters: list[PlannedAdapter]
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    resolved: bool = False
    merge: dict[str, bool] = field(default_factory=dict)
    """Module -> merge (True) or dynamic (False)."""
    actions: dict[str, Action] = field(default_factory=dict)
    losses: dict[str, float | None] = field(default_factory=dict)
    undecided: list[str] = field(default_factory=list)

    @property
    def first(self) -> str:
        return self.modules[0]


class _Planner:
    """Replays one `set_lora` call over a copy of the pipeline state."""

    def __init__(
        self,
        state: PipelineState,
        mode: str,
        weights_sharded: bool | Mapping[str, bool],
        resolve: bool,
        tolerance: float,
        adapters: Mapping[str, Adapter] | Iterable[Adapter] | None,
        *,
        engine_version: str,
        quantized: bool | Mapping[str, bool],
        base_weights: Mapping[str, Any] | None,
        given_loss: Mapping[str, float | None] | None,
        cache_merged: bool,
    ) -> None:
        self.state = state
        self.mode = mode
        self.weights_sharded = weights_sharded
        self.resolve = resolve
        self.tolerance = float(tolerance)
        self.cache: dict[str, Any] = {}
        if isinstance(adapters, Mapping):
            self.cache.update(adapters)
        elif adapters is not None:
            for a in adapters:
                self.cache[a.path] = a
                self.cache.setdefault(a.name, a)
        self.read_errors: dict[str, str] = {}
        self.engine_version = engine_version
        self.rules = _diffusion.has_merge_rules(engine_version)
        self.quantized = quantized
        self.base_weights: dict[str, Any] = dict(base_weights or {})
        self.given_loss: dict[str, float | None] = dict(given_loss or {})
        self.cache_merged = cache_merged
        # SGLang's `auto_merge_rounding_loss`: (module, paths, strengths, alphas) -> loss, or why it is unknown
        self.losses: dict[tuple, tuple[bool, float | None, str]] = {}
        # The pipeline's bookkeeping as the call changes it
        self.loaded_paths = dict(state.loaded_paths)
        self.loaded_alphas = dict(state.loaded_alphas)
        self.applied = dict(state.applied)
        self.merged = dict(state.merged)
        # What the call reports
        self.loads: list[LoadEvent] = []
        self.warnings: list[str] = []
        self.rejections: list[str] = []
        self.touched: dict[str, str] = {}  # module -> target that applied to it earlier in this call

    @property
    def adapter_updated(self) -> bool:
        """SGLang's `adapter_updated`: set by every load, reload and alpha change of the call."""
        return bool(self.loads)

    def is_quantized(self, module: str) -> bool:
        if isinstance(self.quantized, Mapping):
            return bool(self.quantized.get(module, False))
        return bool(self.quantized)

    def sharded(self, module: str) -> bool:
        if isinstance(self.weights_sharded, Mapping):
            return bool(self.weights_sharded.get(module, False))
        return bool(self.weights_sharded)

    def merge_decision(self, module: str) -> tuple[bool, str | None, str | None]:
        return should_merge(
            module, self.sharded(module), self.mode, self.is_quantized(module), engine_version=self.engine_version
        )

    def rounding_loss(
        self, module: str, nickname: str, path: str | None, strength: float, alpha: float | None
    ) -> tuple[bool, float | None, str]:
        """`_auto_merge_rounds_away`'s measurement for one adapter on one component: (known?, loss, why not)."""
        key = (module, path, strength, alpha)
        if key in self.losses:
            return self.losses[key]
        if module in self.given_loss:
            out: tuple[bool, float | None, str] = (True, self.given_loss[module], "")
        elif module not in self.base_weights:
            out = (False, None, f"no base weights for {module}")
        elif path is None:
            out = (False, None, f"no path for {nickname}")
        else:
            try:
                out = (True, _measure_rounding_loss(self.base_weights[module], path, strength, alpha), "")
            except Exception as e:  # unreadable file, no torch, ...: the rule stays undecided, with why
                out = (False, None, f"{type(e).__name__}: {e}")
        self.losses[key] = out
        return out

    def config_alpha(self, nickname: str, path: str) -> float | None:
        """The alpha SGLang's diffusion `load_lora_adapter` keeps when no `lora_alpha` is asked for:
        `get_peft_lora_alpha(load_peft_config(file))` (compat.diffusion: `adapter_config.json` next to the file,
        completed from its metadata), whose `ValueError`s are SGLang's. A path that is not a local file or
        folder (a Hub id SGLang would download) falls back to the inspected adapter's config."""
        try:
            weight = _diffusion.weight_file(path) if os.path.exists(path) else None
        except (OSError, ValueError):
            weight = None
        if weight is not None and os.path.isfile(weight):
            config = _diffusion.load_peft_config(weight, engine_version=self.engine_version or None)
            return _diffusion.get_peft_lora_alpha(config, engine_version=self.engine_version or None)
        return _config_alpha(self.adapter(nickname, path))

    def adapter(self, nickname: str, path: str | None) -> Adapter | None:
        """The inspected adapter for a request: supplied by the caller, cached, or read with lorafast.inspect."""
        for key in (path, os.path.abspath(path) if path else None):
            if key is not None and self.cache.get(key) is not None:
                return self.cache[key]
        by_name = self.cache.get(nickname)
        # a nickname entry only answers for the same file: a reload to a new path must read the new adapter
        if by_name is not None and (path is None or os.path.abspath(str(by_name.path)) == os.path.abspath(path)):
            return by_name
        if path is None:
            return None
        if path in self.read_errors:
            return None
        try:
            adapter = inspect(path)
        except Exception as e:
            self.read_errors[path] = f"{type(e).__name__}: {e}"
            return None
        self.cache[path] = adapter
        return adapter

    def planned_adapter(self, nickname: str, path: str | None, strength: float, alpha: float | None) -> PlannedAdapter:
        adapter = self.adapter(nickname, path)
        if adapter is None:
            note = self.read_errors.get(path or "", "not inspected")
            return PlannedAdapter(nickname, path, strength, alpha, None, (), None, {}, (f"not inspected: {note}",))
        return planned_adapter(adapter, nickname, path, strength, alpha)

    # -- the call, step by step ------------------------------------------------------------------------------

    def run(
        self,
        nicknames: list[str],
        paths: list[str | None],
        strengths: list[float],
        targets: list[str],
        alphas: list[float | None],
    ) -> Plan:
        self.load_adapters(nicknames, paths, alphas)
        target_plans = [
            self.plan_target(
                target,
                [nicknames[i] for i in idx],
                [strengths[i] for i in idx],
                [paths[i] or self.loaded_paths.get(nicknames[i]) for i in idx],
            )
            for target, idx in _group_by_target(targets).items()
        ]
        if self.rejections:
            raise PlanError(self.rejections)
        for path, error in self.read_errors.items():
            self.warnings.append(f"could not inspect {path}: {error}; its scales are unknown")
        requests = tuple(
            LoraRequest(n, p, s, t, a)
            for n, p, s, t, a in zip(nicknames, paths, strengths, targets, alphas, strict=True)
        )
        return self.result(requests, target_plans)

    def load_adapters(self, nicknames: list[str], paths: list[str | None], alphas: list[float | None]) -> None:
        """Step 6 of `set_lora`: load new adapters, reload changed paths, take changed alphas."""
        for nickname, path, alpha in zip(nicknames, paths, alphas, strict=True):
            if nickname not in self.loaded_paths and path is None:
                raise ValueError(f"Adapter {nickname} not found in the pipeline. Please provide lora_path to load it.")
            if path is not None and self.loaded_paths.get(nickname) != path:
                previous = self.loaded_paths.get(nickname)
                new_alpha = alpha if alpha is not None else self.config_alpha(nickname, path)
                self.loads.append(
                    LoadEvent(
                        nickname,
                        "load" if previous is None else "reload",
                        path,
                        previous_path=previous,
                        alpha=new_alpha,
                        previous_alpha=self.loaded_alphas.get(nickname),
                    )
                )
                self.loaded_paths[nickname] = path
                self.loaded_alphas[nickname] = new_alpha
            elif alpha is not None and self.loaded_alphas.get(nickname) != alpha:
                self.loads.append(
                    LoadEvent(
                        nickname,
                        "alpha",
                        self.loaded_paths[nickname],
                        alpha=alpha,
                        previous_alpha=self.loaded_alphas.get(nickname),
                    )
                )
                self.loaded_alphas[nickname] = alpha

    def plan_target(
        self, target: str, nicknames: list[str], strengths: list[float], paths: list[str | None]
    ) -> TargetPlan:
        """Steps 8 and 9 of `set_lora` for one target: decide, maybe skip, then apply to every module."""
        modules, missing = _resolve_target(target, self.state.modules)
        adapters = [
            self.planned_adapter(n, p, s, self.loaded_alphas.get(n))
            for n, p, s in zip(nicknames, paths, strengths, strict=True)
        ]
        if missing is not None:
            logger.info("set_lora: %s", missing)
            self.warnings.append(missing)
        if not modules:
            return _no_module_plan(target, adapters, missing)
        call = _TargetCall(target, nicknames, strengths, paths, modules, adapters)
        self.decide_first_module(call)
        self.decide_other_modules(call)
        self.merge_non_additive(call)
        skip = self.skip_if_config_matches(call)
        if not skip:
            self.apply_rounding_loss_rule(call)
            self.note_merge_cache(call)
            self.decide_actions(call)
            self.record(call)
        return self.target_plan(call, skip)

    def decide_first_module(self, call: _TargetCall) -> None:
        """The first module decides merge vs dynamic for the target; several adapters on a dynamic one raise
        SGLang's `ValueError`, unless `resolve=True` plans a merge where the weights can take one."""
        first, n = call.first, len(call.nicknames)
        merge, why, warn = self.merge_decision(first)
        call.reasons.append(why or "")
        if warn:
            call.warnings.append(warn)
        if not merge and n > 1:
            cannot_merge = self.rules and self.is_quantized(first)
            if not self.resolve or cannot_merge:
                err = ValueError(DYNAMIC_MULTI_ADAPTER_ERROR)
                _add_note(
                    err,
                    f"lorafast: target {call.target!r} resolves to dynamic LoRA on {first} with {n} adapters; "
                    + (
                        "its quantized weights cannot take a merged delta, so only one adapter can go there."
                        if cannot_merge
                        else "plan(..., resolve=True) plans it as a merge, or pass merge_mode='merge'."
                    ),
                )
                raise err
            merge, call.resolved = True, True
            call.reasons.append(
                f"resolved: {n} adapters on a dynamic target would raise SGLang's "
                f'"{DYNAMIC_MULTI_ADAPTER_ERROR}"; planned as a merge instead'
            )
        call.merge[first] = merge

    def decide_other_modules(self, call: _TargetCall) -> None:
        """The other modules of the target decide for themselves; SGLang does not raise for them."""
        first_merge, n = call.merge[call.first], len(call.nicknames)
        for m in call.modules[1:]:
            merge, why, warn = self.merge_decision(m)
            if warn:
                call.warnings.append(warn)
            if not merge and n > 1:
                if self.resolve and not (self.rules and self.is_quantized(m)):
                    merge, call.resolved = True, True
                    call.reasons.append(
                        f"resolved: {m} would be dynamic ({why}) with {n} adapters, and dynamic "
                        "LoRA keeps only the last one per layer; planned as a merge instead"
                    )
                else:
                    call.warnings.append(
                        f"{m}: {why} SGLang applies all {n} adapters dynamically there, and its "
                        "dynamic layer uses only the last one; plan with resolve=True to merge instead"
                    )
            elif why and merge != first_merge:
                call.reasons.append(f"{m}: {why}")
            call.merge[m] = merge

    def merge_non_additive(self, call: _TargetCall) -> None:
        """Non-additive adapters need the weight: they cannot ride a dynamic LoRA layer. Rejected (all reasons
        are gathered before `PlanError`), or with `resolve=True` planned as merges."""
        non_additive = [a for a in call.adapters if a.additive is False]
        if not non_additive:
            return
        names = ", ".join(f"{a.nickname} ({'/'.join(a.variants)})" for a in non_additive)
        for m in call.modules:
            if call.merge[m]:
                continue
            if self.resolve:
                call.merge[m], call.resolved = True, True
                call.reasons.append(
                    f"resolved: {names} cannot be applied dynamically on {m} (the dynamic layer computes only "
                    "x·Aᵀ·Bᵀ); planned as a merge instead"
                )
            else:
                self.rejections.append(
                    f"target {call.target!r}: {names} cannot be applied as dynamic LoRA on {m}: the dynamic layer "
                    "computes only x·Aᵀ·Bᵀ, and these adapters need the weight itself. Use merge_mode='merge', "
                    "or plan(..., resolve=True)"
                )

    def skip_if_config_matches(self, call: _TargetCall) -> bool:
        """SGLang's skip rule (`_check_lora_config_matches`), on the first module only."""
        skip, why = self.config_matches(call.first, call.nicknames, call.strengths, call.merge[call.first])
        if skip:
            call.reasons.append(CONFIG_MATCHES_MESSAGE + (f" ({why})" if why else ""))
            call.actions = dict.fromkeys(call.modules, Action.SKIP)
        else:
            call.reasons.append(why)
        return skip

    def apply_rounding_loss_rule(self, call: _TargetCall) -> None:
        """0.5.23 `_auto_merge_rounds_away`: under "auto", a lone adapter stays unmerged on each component where
        merging would round away too much of its update. Without values the component stays undecided."""
        if not (self.rules and self.mode == "auto" and len(call.nicknames) == 1):
            return
        nickname, path, strength = call.nicknames[0], call.paths[0], call.strengths[0]
        limit = f"{_diffusion.AUTO_MERGE_MAX_ROUNDING_LOSS:.0%}"
        for m in call.modules:
            if not call.merge[m]:
                continue
            known, loss, why_not = self.rounding_loss(m, nickname, path, strength, self.loaded_alphas.get(nickname))
            if not known:
                call.undecided.append(m)
                call.warnings.append(
                    f"{m}: merge_mode='auto' keeps {nickname} unmerged when merging it would round "
                    f"away more than {limit} of its update; "
                    f"that needs the base weights' values ({why_not}): planned as a merge, undecided. "
                    "Pass base_weights= or rounding_loss=, or merge_mode='merge' or 'dynamic'"
                )
                continue
            call.losses[m] = loss
            if _diffusion.auto_merge_rounds_away(loss):
                call.merge[m] = False
                call.reasons.append(
                    _diffusion.MSG_STAYS_UNMERGED.format(paths=str(path), module=m, percent=100 * (loss or 0.0))
                )
            else:
                call.reasons.append(
                    f"{m}: merging rounds away "
                    + ("nothing measurable" if loss is None else f"{100 * loss:.0f}% of the update")
                    + f" (at most {limit}): merged"
                )

    def note_merge_cache(self, call: _TargetCall) -> None:
        if self.rules and self.cache_merged and any(call.merge.values()):
            call.reasons.append(
                "cache_merged: SGLang writes the merged weights to its file-backed merge cache (or adopts "
                "a complete one of the same base, adapters and strengths) when the weights are on CPU, "
                "the process is one rank and SGLANG_DIFFUSION_DISABLE_LORA_MERGE_CACHE is unset; the "
                "decision is the same"
            )

    def decide_actions(self, call: _TargetCall) -> None:
        """What each module does, and a warning where an earlier target of the call applied to it."""
        for m in call.modules:
            action, why = self.module_action(m, call.nicknames, call.strengths, call.merge[m])
            call.actions[m] = action
            if why:
                call.reasons.append(f"{m}: {why}")
            if m in self.touched:
                prev = self.applied.get(m, ((), ()))
                new = fmt_config(call.nicknames, call.strengths)
                call.warnings.append(
                    f"target {call.target!r} re-applies {m} with clear_existing=True after target "
                    f"{self.touched[m]!r} in the same call: {fmt_config(*prev)} is replaced by {new}"
                )

    def record(self, call: _TargetCall) -> None:
        """The pipeline's bookkeeping after the target is applied (`cur_adapter_config`, `is_lora_merged`)."""
        for m in call.modules:
            self.applied[m] = (tuple(call.nicknames), tuple(call.strengths))
            self.merged[m] = call.merge[m]
            self.touched[m] = call.target

    def target_plan(self, call: _TargetCall, skip: bool) -> TargetPlan:
        first_merge = call.merge[call.first]
        steps = merge_steps(call.adapters, first_merge, call.warnings if not skip else [])
        for w in call.warnings:
            logger.info("%s", w)
        self.warnings.extend(w for w in call.warnings if w not in self.warnings)
        return TargetPlan(
            target=call.target,
            modules=tuple(call.modules),
            adapters=tuple(call.adapters),
            mode="merge" if first_merge else "dynamic",
            module_modes={m: "merge" if v else "dynamic" for m, v in call.merge.items()},
            action=call.actions[call.first],
            module_actions=call.actions,
            steps=steps,
            reasons=tuple(r for r in call.reasons if r),
            warnings=tuple(call.warnings),
            resolved=call.resolved,
            rounding_loss=call.losses,
            undecided=tuple(call.undecided),
        )

    def result(self, requests: tuple[LoraRequest, ...], target_plans: list[TargetPlan]) -> Plan:
        st = self.state
        next_state = PipelineState(
            modules=st.modules,
            loaded_paths=self.loaded_paths,
            loaded_alphas=self.loaded_alphas,
            applied=self.applied,
            merged=self.merged,
            server_merge_mode=st.server_merge_mode,
        )
        return Plan(
            merge_mode=self.mode,
            requests=requests,
            targets=tuple(target_plans),
            loads=tuple(self.loads),
            adapter_updated=self.adapter_updated,
            warnings=tuple(self.warnings),
            current=st,
            next_state=next_state,
            weights_sharded=self.weights_sharded,
            resolve=self.resolve,
            tolerance=self.tolerance,
            unreadable=dict(self.read_errors),
            engine_version=self.engine_version,
            quantized=self.quantized,
            _adapter_cache={k: v for k, v in self.cache.items() if v is not None},
            _options={"base_weights": self.base_weights, "cache_merged": self.cache_merged},
            _planner=plan,
        )

    # -- SGLang's per-module rules ---------------------------------------------------------------------------

    def config_matches(
        self, module: str, nicknames: list[str], strengths: list[float], target_merge: bool
    ) -> tuple[bool, str]:
        """SGLang `_check_lora_config_matches` on `module`: (skip?, why not / how it matched)."""
        if self.adapter_updated:
            updated = list(dict.fromkeys(e.nickname for e in self.loads))
            several = len(updated) > 1
            return False, (
                f"adapter{'s' if several else ''} {', '.join(updated)} {'were' if several else 'was'} (re)loaded "
                f"or had {'their' if several else 'its'} alpha changed in this call, so SGLang re-applies every target "
                "(adapter_updated)"
            )
        cur_merge = self.merged.get(module, False)
        if cur_merge != target_merge:
            was = "merged" if cur_merge else "not merged"
            now = "merge" if target_merge else "dynamic"
            return False, f"merge state changes on {module}: {was} now, {now} requested"
        stored = self.applied.get(module)
        if stored is None:
            return False, f"nothing applied to {module} yet"
        stored_nicks, stored_strengths = stored
        if list(stored_nicks) != nicknames:
            if sorted(stored_nicks) == sorted(nicknames):
                return False, (
                    f"same adapters in a different order on {module}: {list(stored_nicks)} -> {nicknames} "
                    "(the comparison is order-sensitive)"
                )
            return False, f"adapters change on {module}: {list(stored_nicks)} -> {nicknames}"
        if list(stored_strengths) == strengths:
            return True, ""
        if _floats_equal(stored_strengths, strengths, self.tolerance):
            return True, (
                f"strengths {list(stored_strengths)} and {strengths} are equal within tolerance {self.tolerance}; "
                "SGLang compares exactly and would re-apply"
            )
        return False, f"strengths change on {module}: {list(stored_strengths)} -> {strengths}"

    def module_action(
        self, module: str, nicknames: list[str], strengths: list[float], target_merge: bool
    ) -> tuple[Action, str]:
        """What happens to `module`'s weights, and why when it is not plain."""
        if not self.merged.get(module, False):
            if module in self.applied and not target_merge:
                return Action.APPLY, "the dynamic LoRA there is replaced (clear_existing)"
            return Action.APPLY, ""
        stored = self.applied.get(module)
        if not target_merge:
            return Action.UNMERGE_APPLY, "merged now and dynamic requested: restore the snapshot, then attach"
        if stored is not None and list(stored[0]) == nicknames and not self.adapter_updated:
            if not _floats_equal(stored[1], strengths, 0.0):
                return Action.REMERGE, (
                    f"merged with the same adapters in the same order; restore the snapshot and merge again with "
                    f"strengths {strengths} (was {list(stored[1])})"
                )
            return Action.UNMERGE_APPLY, "unchanged here, but re-applied with the rest of the target"
        return Action.UNMERGE_APPLY, "merged now with a different set: restore the snapshot, then merge"


def _no_module_plan(target: str, adapters: list[PlannedAdapter], missing: str | None) -> TargetPlan:
    """A target that names no component of the pipeline: SGLang logs a warning and applies nothing."""
    return TargetPlan(
        target=target,
        modules=(),
        adapters=tuple(adapters),
        mode="none",
        module_modes={},
        action=Action.SKIP,
        module_actions={},
        steps=(),
        reasons=(f"{missing}: SGLang logs a warning and applies nothing",),
        warnings=(missing,) if missing else (),
    )
