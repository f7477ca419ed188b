"""The engine side of `lorafast.preflight`: each adapter judged by the engine's own rules (see `serving`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .serving import AdapterVerdict, ModuleScale, PreflightReport, _differs, trained_scale

if TYPE_CHECKING:
    from .adapter import Adapter
    from .base import BaseModel
    from .compat.launch import LaunchCommand
    from .serving import _Fleet

#: check()'s module statuses under which an engine applies the module nowhere.
_NOT_IN_BASE = {
    "missing": "matches no module of the base model",
    "prefix_only": "matches the base only under another prefix",
}


def judge(launch: LaunchCommand, fleet: _Fleet, base: BaseModel | None, note: str | None) -> PreflightReport:
    startup = [_problem_dict(p, fleet) for p in launch.problems if p.fatal]
    base_fit = _base_fit(fleet, base)
    if launch.engine == "vllm":
        rows, more, starts = _vllm(launch, fleet, base, note, base_fit)
    else:
        rows, more, starts = _sglang(launch, fleet, base, note, base_fit)
    startup += more
    if startup:
        starts = False
        first = startup[0]
        rows = [
            replace(
                r,
                verdict="fails",
                stage="startup",
                exc_type=first["type"],
                message=first["message"],
                reasons=(f"the server does not start: {first['type']}: {first['message']}", *r.reasons),
                fix=tuple(p["fix"] for p in startup if p.get("fix")) or r.fix,
            )
            for r in rows
        ]
    if not launch.rules.verified:  # every answer could differ: never a "serves" lorafast cannot stand behind
        why = f"{launch.rules.note()}; pass a verified --engine-version or check `lorafast engines`"
        rows = [_with_undecided(r, why) for r in rows]
        if starts:
            starts = None
    errors = tuple((p, c, m) for p, (c, m) in fleet.errors.items())
    return PreflightReport(
        launch,
        tuple(rows),
        starts,
        tuple(startup),
        base=None if base is None else base.path,
        base_note=note,
        errors=errors,
    )


def _problem_dict(p: Any, fleet: _Fleet, fix: str | None = None) -> dict[str, Any]:
    path = next((path for name, path, _ in fleet.entries if name == p.adapter_name), None)
    return {
        "code": p.code,
        "type": p.exc_type,
        "message": p.message,
        "stage": p.stage,
        "adapter_name": p.adapter_name,
        "adapter_path": path,
        "fix": fix,
    }


def _with_undecided(row: AdapterVerdict, why: str) -> AdapterVerdict:
    verdict = "unknown" if row.verdict == "serves" else row.verdict
    reasons = row.reasons if verdict == row.verdict else (why, *row.reasons)
    return replace(row, verdict=verdict, undecided=(*row.undecided, why), reasons=reasons)


def _base_fit(fleet: _Fleet, base: BaseModel | None) -> dict[str, dict[str, str]]:
    """Adapter path -> {module key: check's status} against the base."""
    if base is None or not fleet.adapters:
        return {}
    from .checker import check

    report = check(list(fleet.adapters.values()), base)
    return {pair.adapter: {m.module: m.status for m in pair.modules} for pair in report}


def _decide(
    name: str,
    path: str,
    source: str,
    adapter: Adapter | None,
    dropped: list[tuple[str, str]],
    scales: list[ModuleScale],
    undecided: list[str],
    fix: list[str],
    total: int,
) -> AdapterVerdict:
    applied = total - len({m for m, _ in dropped})
    reasons: list[str] = []
    if total and applied == 0:
        verdict = "silent_noop"
        reasons.append(f"none of its {total} modules is applied ({dropped[0][1]}): the output is the base model's")
    elif dropped:
        verdict = "partial"
        whys = sorted({w for _, w in dropped})
        reasons.append(f"{len({m for m, _ in dropped})} of {total} modules are not applied: " + "; ".join(whys))
    elif scales:
        verdict = "scale_differs"
        s = scales[0]
        reasons.append(
            f"{len(scales)} of {total} modules are served at another scale than trained "
            f"(e.g. {s.module}: trained {s.trained:g}, served {s.served:g})"
        )
    elif undecided:
        verdict = "unknown"
        reasons.extend(undecided)
    else:
        verdict = "serves"
    if verdict in ("partial", "silent_noop") and scales:
        reasons.append(f"{len(scales)} applied modules are also served at another scale than trained")
    return AdapterVerdict(
        name,
        path,
        source,
        verdict,
        tuple(reasons),
        modules=total,
        applied=applied,
        dropped=tuple(dropped),
        scales=tuple(scales),
        undecided=tuple(undecided),
        fix=tuple(dict.fromkeys(fix)),
    )


def _failed(name: str, path: str, source: str, problem: Any, fix: list[str]) -> AdapterVerdict:
    return AdapterVerdict(
        name,
        path,
        source,
        "fails",
        (f"{problem.exc_type}: {problem.message}" if problem.exc_type else problem.message,),
        stage=problem.stage,
        exc_type=problem.exc_type,
        message=problem.message,
        fix=tuple(fix),
    )


def _base_drops(adapter: Adapter | None, fit: Mapping[str, str]) -> list[tuple[str, str]]:
    if adapter is None:
        return []
    return [(m.name, _NOT_IN_BASE[fit[m.key]]) for m in adapter.modules if fit.get(m.key) in _NOT_IN_BASE]


def _base_undecided(base: BaseModel | None, note: str | None) -> list[str]:
    return [] if base is not None else [f"whether each module exists in the base model: {note}"]


# ---------------------------------------------------------------------------------------------------------------
# vLLM


def _vllm(
    launch: LaunchCommand,
    fleet: _Fleet,
    base: BaseModel | None,
    note: str | None,
    base_fit: Mapping[str, Mapping[str, str]],
) -> tuple[list[AdapterVerdict], list[dict[str, Any]], bool | None]:
    from .compat import vllm
    from .compat.sglang import parse_lora_paths

    opts = launch.options
    targets = opts.get("lora_target_modules")
    refs = parse_lora_paths([f"{name}={path}" for name, path, _ in fleet.entries]) if fleet.entries else []
    leaves = None
    if base is not None:  # the model's LoRA-capable leaves, as check names them for vLLM
        leaves = sorted({n.rsplit(".", 2)[-2] for n in base.weights if n.endswith(".weight") and n.count(".") >= 1})
    plan = vllm.preflight(
        refs,
        max_lora_rank=int(opts.get("max_lora_rank") or 16),
        expected_lora_modules=leaves,
        collect=True,
        engine_version=launch.rules.requested,
    )
    rows: list[AdapterVerdict] = []
    if not launch.enable_lora:  # vLLM builds no LoRA manager: no request can name an adapter
        why = "the command does not pass --enable-lora: vLLM serves no adapter"
        rows = [
            AdapterVerdict(n, p, s, "fails", (why,), stage="startup", fix=("add --enable-lora",))
            for n, p, s in fleet.entries
        ]
        return rows, [], None
    for (name, path, source), ref in zip(fleet.entries, refs, strict=True):
        adapter = fleet.adapters.get(path)
        problem = next((p for p in plan.problems if p.fatal and p.adapter_name == ref.name), None)
        if problem is not None:
            fix = []
            if "greater than max_lora_rank" in problem.message and plan.suggested_max_lora_rank:
                fix.append(f"--max-lora-rank {plan.suggested_max_lora_rank}")
            rows.append(_failed(name, path, source, problem, fix))
            continue
        lora = plan.loras.get(ref.name)
        loras = dict(lora.loras) if lora is not None else {}
        dropped: list[tuple[str, str]] = []
        fixes: list[str] = []
        if targets is not None:
            for module in loras:
                if not vllm.is_in_target_modules(module, list(targets), dict(vllm.DEFAULT_PACKED_MODULES_MAPPING)):
                    dropped.append((module, f"not wrapped: --lora-target-modules {' '.join(targets)}"))
            if dropped:
                wanted = sorted({*targets, *(m.rsplit(".", 1)[-1] for m, _ in dropped)})
                fixes.append(f"--lora-target-modules {' '.join(wanted)}")
        dropped += [d for d in _base_drops(adapter, base_fit.get(path, {})) if d[0] not in {m for m, _ in dropped}]
        if any(w.startswith("match") for _, w in dropped):
            fixes.append("rename the adapter's modules to the base model's paths (lorafast check shows the prefix)")
        scales = []
        by_name = {m.name: m for m in adapter.modules} if adapter is not None else {}
        for module, weights in loras.items():
            trained = by_name.get(module)
            if trained is not None and module not in {m for m, _ in dropped}:
                t = trained_scale(trained)
                if _differs(t, float(weights.scaling)):
                    scales.append(ModuleScale(module, t, float(weights.scaling)))
        if scales:
            fixes.append("merge it into the base (lorafast merge), or serve it on a vLLM that follows its patterns")
        undecided = _base_undecided(base, note)
        if plan.skipped:
            undecided.append(f"vLLM's model-dependent load steps ({', '.join(plan.skipped)}): need the base model")
        rows.append(_decide(name, path, source, adapter, dropped, scales, undecided, fixes, len(loras)))
    return rows, [], True


# ---------------------------------------------------------------------------------------------------------------
# SGLang


def _sglang(
    launch: LaunchCommand,
    fleet: _Fleet,
    base: BaseModel | None,
    note: str | None,
    base_fit: Mapping[str, Mapping[str, str]],
) -> tuple[list[AdapterVerdict], list[dict[str, Any]], bool | None]:
    from .compat import sglang
    from .compat._common import LoraRef

    opts = launch.options
    startup_refs = [LoraRef(name, path) for name, path, s in fleet.entries if s == "command"]
    if launch.enable_lora is False:
        why = "--enable-lora is set to False, any provided lora_paths will be ignored."
        noops = [
            AdapterVerdict(n, p, s, "silent_noop", (why,), fix=("drop --enable-lora False (or pass --enable-lora)",))
            for n, p, s in fleet.entries
        ]
        return noops, [], True
    config = base.config if base is not None else None
    shared = opts.get("experts_shared_outer_loras")
    logging.getLogger("lorafast.compat").disabled = True  # SGLang's warnings become reasons, not log lines
    try:
        plan = sglang.preflight(
            startup_refs,
            max_lora_rank=opts.get("max_lora_rank"),
            target_modules=opts.get("lora_target_modules"),
            max_loras_per_batch=int(opts.get("max_loras_per_batch", 8)),
            experts_shared_outer=shared if isinstance(shared, bool) else None,
            base_config=config,
            strict_loading=bool(opts.get("lora_strict_loading", False)),
            collect=True,
            engine_version=launch.rules.requested,
        )
    finally:
        logging.getLogger("lorafast.compat").disabled = False
    by_id = {r.lora_id: r for r in startup_refs}
    set_problems: list[dict[str, Any]] = []
    for p in plan.errors:
        if p.stage == "startup" or p.adapter_id is None:
            way_out = None
            if p.code.startswith("sglang_mixed") or "Mixed shared-outer" in p.message:
                way_out = "split the set into server groups (lorafast groups), or convert one layout (lorafast convert)"
            d = _problem_dict(p, fleet, way_out)
            ref = by_id.get(p.adapter_id or "")
            if ref is not None:
                d["adapter_name"], d["adapter_path"] = ref.name, ref.path
            set_problems.append(d)
    rows: list[AdapterVerdict] = []
    targets = set(plan.target_modules)
    for name, path, source in fleet.entries:
        adapter = fleet.adapters.get(path)
        ref = LoraRef(name, path)
        if source == "command":
            problems = [p for p in plan.errors if p.adapter_id == ref.lora_id and p.stage != "startup"]
        else:
            problems = [p for p in plan.check_new_adapter(adapter or path, collect=True) if p.fatal]
        if problems:
            fix = []
            if "max_lora_rank" in problems[0].message or "max-lora-rank" in problems[0].message:
                needed = adapter.rank if adapter is not None else None
                fix.append(f"--max-lora-rank {needed}" if needed else "a larger --max-lora-rank")
            rows.append(_failed(name, path, source, problems[0], fix))
            continue
        dropped, total = _sglang_drops(adapter, path, targets, config)
        fix = []
        if dropped:
            fix.append("--lora-target-modules all (or add the dropped modules)")
        dropped += [d for d in _base_drops(adapter, base_fit.get(path, {})) if d[0] not in {m for m, _ in dropped}]
        scales = []
        if adapter is not None and adapter.r and adapter.lora_alpha is not None:
            served = float(adapter.lora_alpha) / float(adapter.r)  # SGLang: one lora_alpha / r per adapter
            skipped = {m for m, _ in dropped}
            for m in adapter.modules:
                t = trained_scale(m)
                if m.name not in skipped and _differs(t, served):
                    scales.append(ModuleScale(m.name, t, served))
        if scales:
            fix.append("merge it into the base (lorafast merge), or rescale it for SGLang's lora_alpha / r")
        undecided = _base_undecided(base, note)
        if base is None:
            undecided.append("SGLang's first-use checks (buffer shapes, layer ids): need the base model's config")
        rows.append(_decide(name, path, source, adapter, dropped, scales, undecided, fix, total))
    return rows, set_problems, not set_problems


def _sglang_drops(
    adapter: Adapter | None, path: str, targets: set[str], base_config: Mapping[str, Any] | None
) -> tuple[list[tuple[str, str]], int]:
    """(module, why) for the adapter's modules whose weights SGLang's memory pool does not take."""
    from .compat import sglang

    if adapter is None:
        return [], 0
    skipped = set(sglang.check_skipped_weights(adapter, targets, base_config=base_config))
    # A skipped weight is named after normalization (q/k/v -> qkv_proj): map it back to the adapter's modules.
    skipped_modules = {w.rsplit(".lora_", 1)[0] for w in skipped}
    why = f"not among the server's target modules {sorted(targets)} (--lora-target-modules)"
    out = []
    for m in adapter.modules:
        norm = sorted(sglang.get_normalized_target_modules([m.leaf]))
        parent = m.key.rsplit(".", 1)[0]
        if any(f"{parent}.{n}" in skipped_modules for n in norm) or m.key in skipped_modules:
            out.append((m.name, why))
    return out, len(adapter.modules)
