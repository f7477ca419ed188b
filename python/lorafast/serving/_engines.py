"""The engine side of `lorafast.preflight`: each adapter judged by the engine's own rules (see `serving._preflight`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lorafast.serving._verdicts import AdapterVerdict, ModuleScale, PreflightReport, differs, trained_scale

if TYPE_CHECKING:
    from lorafast.adapter import Adapter
    from lorafast.base import BaseModel
    from lorafast.checker import ModuleCheck
    from lorafast.compat.launch import LaunchCommand
    from lorafast.serving._preflight import Fleet

#: check()'s module statuses under which an engine applies the module nowhere.
#: An engine's judgement of a fleet: a row per adapter, the problems that stop the server, whether it starts.
_Judged = tuple[list[AdapterVerdict], list[dict[str, Any]], bool | None]

_NOT_IN_BASE = {
    "missing": "matches no module of the base model",
    "prefix_only": "matches the base only under another prefix",
}


def judge(launch: LaunchCommand, fleet: Fleet, base: BaseModel | None, note: str | None) -> PreflightReport:
    # `sglang serve` of a diffusers pipeline runs SGLang's diffusion runtime, whose flags the LLM parser's
    # problems do not describe.
    diffusion = launch.engine == "sglang" and base is not None and bool(base.components)
    startup = [] if diffusion else [_problem_dict(p, fleet) for p in launch.problems if p.fatal]
    if launch.engine == "vllm":
        rows, more, starts = _vllm(launch, fleet, base, note)
    elif diffusion:
        rows, more, starts = _diffusion(launch, fleet)
    else:
        rows, more, starts = _sglang(launch, fleet, base, note)
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


def _problem_dict(p: Any, fleet: Fleet, fix: str | None = None) -> dict[str, Any]:
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


def _base_fit(fleet: Fleet, base: BaseModel | None) -> dict[str, dict[str, ModuleCheck]]:
    """Adapter path -> {module key: check's answer (status and the base weight it matched)} against the base."""
    if base is None or not fleet.adapters:
        return {}
    from lorafast.checker import check

    report = check(list(fleet.adapters.values()), base)
    return {pair.adapter: {m.module: m for m in pair.modules} for pair in report}


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
    if undecided and verdict != "unknown":
        # What is missing decides more than what was found: without the base the engine may refuse the adapter
        # (vLLM's expected modules, SGLang's first use) or apply none of it, so a drop or a scale found so far is
        # a reason, not the verdict (tests/oracle/test_oracle_serving.py holds this against the engines).
        reasons = [*undecided, f"so far: {reasons[0]}", *reasons[1:]]
        verdict = "unknown"
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


def _first_use_failure(name: str, path: str, source: str, why: str, fix: str, exc_type: str = "") -> AdapterVerdict:
    """An adapter that loads, and fails the first request that uses it (raising `exc_type`, when lorafast knows it)."""
    return AdapterVerdict(name, path, source, "fails", (why,), stage="first_use", exc_type=exc_type, fix=(fix,))


def _base_drops(adapter: Adapter | None, fit: Mapping[str, ModuleCheck]) -> list[tuple[str, str]]:
    if adapter is None:
        return []
    return [
        (m.name, _NOT_IN_BASE[fit[m.key].status])
        for m in adapter.modules
        if m.key in fit and fit[m.key].status in _NOT_IN_BASE
    ]


def _base_undecided(base: BaseModel | None, note: str | None) -> list[str]:
    return [] if base is not None else [f"whether each module exists in the base model: {note}"]


# ---------------------------------------------------------------------------------------------------------------
# vLLM


def _vllm(launch: LaunchCommand, fleet: Fleet, base: BaseModel | None, note: str | None) -> _Judged:
    from lorafast.compat import vllm
    from lorafast.compat.sglang import parse_lora_paths

    base_fit = _base_fit(fleet, base)
    opts = launch.options
    targets = opts.get("lora_target_modules")
    refs = parse_lora_paths([f"{name}={path}" for name, path, _ in fleet.entries]) if fleet.entries else []
    leaves, moe_layers = _vllm_model_modules(base) if base is not None else (None, [])
    plan = vllm.preflight(
        refs,
        max_lora_rank=int(opts.get("max_lora_rank") or 16),
        expected_lora_modules=leaves,
        moe_modules=moe_layers,
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
        misfit = [k for k, m in base_fit.get(path, {}).items() if m.status == "shape_mismatch"]
        if misfit:  # vLLM loads it, then copying the factors into the layer's LoRA buffers fails on their shapes
            why = (f"{len(misfit)} modules do not fit the base's weights (e.g. {misfit[0]}): the first request "
                   "that uses it fails when vLLM copies the factors into the layer")  # fmt: skip
            how = "serve it on the base it was trained for (lorafast check names the likely base)"
            rows.append(_first_use_failure(name, path, source, why, how))
            continue
        lora = plan.loras.get(ref.name)
        loras = dict(lora.loras) if lora is not None else {}
        fused = _vllm_fused_moe_at_2d(loras, moe_layers, targets, launch)
        if fused:  # 0.30: loaded and registered; the request that activates it fails in the MoE layer's set_lora
            why = (f"AssertionError in FusedMoEWithLoRA.set_lora: fused 3-D MoE LoRA weights for {fused!r} under "
                   "vLLM's 2-D MoE LoRA wrapper (no load check before 0.33): the first request that uses it fails")  # fmt: skip
            how = ("convert the experts to numbered per-expert modules (lorafast convert --to per_expert_2d), "
                   "or serve it on vLLM 0.33+ with --enable-mixed-moe-lora-format")  # fmt: skip
            rows.append(_first_use_failure(name, path, source, why, how, "AssertionError"))
            continue
        dropped: list[tuple[str, str]] = []
        fixes: list[str] = []
        if targets is not None:
            packed = dict(vllm.DEFAULT_PACKED_MODULES_MAPPING)
            for module in loras:  # the filter sees the module vLLM wraps: q_proj's is qkv_proj
                if not vllm.is_in_target_modules(_vllm_wrapped_module(module, packed), list(targets), packed):
                    dropped.append((module, f"not wrapped: --lora-target-modules {' '.join(targets)}"))
            if dropped:
                wanted = sorted({*targets, *(m.rsplit(".", 1)[-1] for m, _ in dropped)})
                fixes.append(f"--lora-target-modules {' '.join(wanted)}")
        if moe_layers:  # the model's experts sit at the checkpoint's paths (Mixtral: block_sparse_moe.experts)
            why = f"not wrapped: vLLM's MoE layers are at the checkpoint's paths ({moe_layers[0]}, ...)"
            wrong = [m for m in loras if _vllm_experts_layer(m) not in (None, *moe_layers)]
            dropped += [(m, why) for m in wrong if m not in {d for d, _ in dropped}]
        fit = base_fit.get(path, {})
        tower, text_only, tower_lora = _vllm_multimodal(adapter, fit, base, launch)
        dropped += [d for d in tower if d[0] not in {m for m, _ in dropped}]
        dropped += [d for d in _base_drops(adapter, fit) if d[0] not in {m for m, _ in dropped} | text_only]
        if any(w.startswith("match") for _, w in dropped):
            fixes.append("rename the adapter's modules to the base model's paths (lorafast check shows the prefix)")
        scales = []
        by_name = {m.name: m for m in adapter.modules} if adapter is not None else {}
        for module, weights in loras.items():
            trained = by_name.get(module)
            if trained is not None and module not in {m for m, _ in dropped}:
                t = trained_scale(trained)
                if differs(t, float(weights.scaling)):
                    scales.append(ModuleScale(module, t, float(weights.scaling)))
        if scales:
            fixes.append("merge it into the base (lorafast merge), or serve it on a vLLM that follows its patterns")
        undecided = _base_undecided(base, note)
        if plan.skipped:
            undecided.append(f"vLLM's model-dependent load steps ({', '.join(plan.skipped)}): need the base model")
        if tower_lora:
            undecided.append(f"{len(tower_lora)} tower/connector modules under --enable-tower-connector-lora "
                             "(lorafast does not model which of them vLLM wraps)")  # fmt: skip
        rows.append(_decide(name, path, source, adapter, dropped, scales, undecided, fixes, len(loras)))
    return rows, [], True


def _vllm_model_modules(base: BaseModel) -> tuple[list[str], list[str]]:
    """(the model's LoRA module names as `_load_adapter`'s expected modules hold them, its MoE layers), from the
    base's weights.

    A weight gives its module's leaf (`...self_attn.q_proj.weight`: `q_proj`), except a numbered expert's
    (`...mlp.experts.3.gate_proj.weight`, the checkpoint of a model whose experts vLLM wraps with the 2-D
    `FusedMoEWithLoRA`): for it vLLM expects `experts` and the packed expert names
    (`process_packed_modules_mapping`: `experts.3.gate_proj`), never the bare leaf, so a dense `mlp.gate_proj`
    is unexpected on such a model; its layer (`...mlp.experts`) is one of the MoE layers, in model order."""
    leaves: set[str] = set()
    layers: dict[str, None] = {}
    for n in base.weights:
        if not n.endswith(".weight") or n.count(".") < 1:
            continue
        module = n.removesuffix(".weight")
        head, sep, tail = module.rpartition(".experts.")
        if sep and tail.split(".", 1)[0].isdigit() and "." in tail:
            leaves.update(("experts", f"experts.{tail}"))
            layers[f"{head}.experts"] = None
        else:
            leaves.add(module.rsplit(".", 1)[-1])
    natural = lambda name: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]  # noqa: E731
    return sorted(leaves), sorted(layers, key=natural)


def _vllm_experts_layer(module: str) -> str | None:
    """The experts layer an adapter module belongs to (`X.experts` for `X.experts`, `X.experts.base_layer` and
    `X.experts.N.proj`), None for any other module."""
    found = re.fullmatch(r"(.*\.experts)(\.base_layer|\.\d+\..+)?", module)
    return None if found is None else found.group(1)


def _vllm_fused_moe_at_2d(
    loras: Mapping[str, Any], moe_layers: list[str], targets: Any, launch: LaunchCommand
) -> str | None:
    """vLLM before 0.33: the first wrapped 2-D MoE layer for which the adapter holds one fused (3-D,
    `target_parameters`) LoRA tensor. Activation hands that tensor to `FusedMoEWithLoRA.set_lora`, which asserts
    a per-expert list; 0.33 refuses such an adapter at load (`_validate_moe_lora_format`, in `compat.vllm`)."""
    from lorafast.compat import vllm

    if launch.rules.at_least("0.31.0"):
        return None
    packed = dict(vllm.DEFAULT_PACKED_MODULES_MAPPING)
    for layer in moe_layers:
        if layer in loras and (targets is None or vllm.is_in_target_modules(layer, list(targets), packed)):
            return layer
    return None


def _vllm_wrapped_module(module: str, packed: Mapping[str, list[str]]) -> str:
    """The model module vLLM's manager wraps for an adapter module: the packed parent of its leaf (q_proj ->
    qkv_proj), the experts layer of a per-expert module, else the module itself. `--lora-target-modules` is
    matched against that name (`_create_lora_modules`), and registration packs the adapter's modules onto it."""
    if ".experts." in module and module.split(".experts.", 1)[1].split(".", 1)[0].isdigit():
        return module.split(".experts.", 1)[0] + ".experts"
    prefix, _, leaf = module.rpartition(".")
    parent = next((p for p, children in packed.items() if leaf in children), None)
    return f"{prefix}.{parent}" if parent is not None and prefix else module


#: Where a multimodal checkpoint keeps its language model (transformers 5 names, and the stored names before it).
_LM_PREFIXES = ("model.language_model.", "language_model.")


def _text_name(weight: str) -> str:
    """A language-model weight of a multimodal base as a text-only (`*ForCausalLM`) adapter names its module."""
    name = weight.removesuffix(".weight")
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return name.removeprefix("language_model.")


def _vllm_multimodal(
    adapter: Adapter | None, fit: Mapping[str, ModuleCheck], base: BaseModel | None, launch: LaunchCommand
) -> tuple[list[tuple[str, str]], set[str], list[str]]:
    """vLLM on a multimodal base: (the modules it does not wrap, the text-only modules it applies anyway, the
    tower/connector modules that `--enable-tower-connector-lora` may wrap: not modelled, so undecided).

    The manager gives a punica wrapper to the language model alone unless tower/connector LoRA is enabled
    (`_maybe_init_mm`), and `_create_lora_modules` skips every module without one: the vision tower's and the
    projector's LoRA loads and is never applied. From 0.33 activation also looks a language-model module up under
    its text-only name (`_get_text_lora_names`: `model.layers.*`, `lm_head`), so an adapter trained on the
    causal LM alone is applied to the multimodal model's language model; 0.30 finds nothing under those names."""

    if adapter is None or base is None or not _is_multimodal(base):
        return [], set(), []
    text_fallback = launch.rules.at_least("0.33.0")
    tower_lora = bool(launch.options.get("enable_tower_connector_lora"))
    drops: list[tuple[str, str]] = []
    text_only: set[str] = set()
    towers: list[str] = []
    for m in adapter.modules:
        c = fit.get(m.key)
        if c is not None and c.weight is None and c.status == "missing" and _lm_weight(m.name, base):
            # check() finds a text-only `model.embed_tokens` under no language-model prefix: the weight is there
            if text_fallback:
                text_only.add(m.name)
            continue
        if c is None or c.weight is None:
            continue
        if not c.weight.startswith((*_LM_PREFIXES, "lm_head.")):
            if tower_lora:
                towers.append(m.name)
            else:
                drops.append((m.name, "not wrapped: vLLM applies LoRA to a multimodal model's language model only "
                                      "(its tower and connector need --enable-tower-connector-lora)"))  # fmt: skip
        elif c.status == "prefix_only" and text_fallback and _text_name(c.weight) == m.name:
            text_only.add(m.name)
    return drops, text_only, towers


def _lm_weight(name: str, base: BaseModel) -> str | None:
    """The multimodal base's language-model weight of a text-only (`model.*`) module name, if it has one."""
    if not name.startswith("model."):
        return None
    rest = name.removeprefix("model.")
    return next((w for p in ("model.language_model.", "language_model.model.") if (w := f"{p}{rest}.weight")
                 in base.weights), None)  # fmt: skip


def _is_multimodal(base: BaseModel) -> bool:
    config = base.config or {}
    return any(k in config for k in ("vision_config", "audio_config")) and any(
        n.startswith(_LM_PREFIXES) for n in base.weights
    )


# ---------------------------------------------------------------------------------------------------------------
# SGLang


def _sglang(launch: LaunchCommand, fleet: Fleet, base: BaseModel | None, note: str | None) -> _Judged:
    from lorafast.compat import LoraRef, sglang

    base_fit = _base_fit(fleet, base)
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
    needs_base = next((p for p in plan.errors if p.code == "sglang_needs_base_model"), None)
    if needs_base is not None:  # lorafast cannot resolve `all` without the base: SGLang would, so nothing is known
        why = f"SGLang's target modules ({needs_base.message.removeprefix('lorafast: ')}): {note or 'give the base'}"
        return [AdapterVerdict(n, p, s, "unknown", (why,), undecided=(why,)) for n, p, s in fleet.entries], [], None
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
            rows.append(_failed(name, path, source, problems[0], _sglang_fix(problems[0], adapter, plan)))
            continue
        dropped, total = _sglang_drops(adapter, path, targets, config)
        fix = []
        if dropped:
            fix.append("--lora-target-modules all (or add the dropped modules)")
        unapplied = _sglang_unapplied(adapter)
        if unapplied:
            dropped += unapplied
            total += len(unapplied)
            fix.append("merge it into the base (lorafast merge): SGLang serves LoRA factors only")
        dropped += [d for d in _base_drops(adapter, base_fit.get(path, {})) if d[0] not in {m for m, _ in dropped}]
        scales = []
        if adapter is not None and adapter.r and adapter.lora_alpha is not None:
            served = float(adapter.lora_alpha) / float(adapter.r)  # SGLang: one lora_alpha / r per adapter
            skipped = {m for m, _ in dropped}
            for m in adapter.modules:
                t = trained_scale(m)
                if m.name not in skipped and differs(t, served):
                    scales.append(ModuleScale(m.name, t, served))
        if scales:
            fix.append("merge it into the base (lorafast merge), or rescale it for SGLang's lora_alpha / r")
        undecided = _base_undecided(base, note)
        if base is None:
            undecided.append("SGLang's first-use checks (buffer shapes, layer ids): need the base model's config")
        rows.append(_decide(name, path, source, adapter, dropped, scales, undecided, fix, total))
    return rows, set_problems, not set_problems


def _sglang_unapplied(adapter: Adapter | None) -> list[tuple[str, str]]:
    """(part, why) for what PEFT trained besides LoRA factors, which SGLang 0.5.23 never applies: the full weights of
    `modules_to_save` (`LoRAAdapter._process_weight` keeps embed_tokens/lm_head weights only for a LoRA target,
    and first use copies lora_A/lora_B names only) and `lora_bias`'s `lora_B.bias` (a pool buffer holds one lora_B
    per module; the weight, later in SGLang's dict order, is the one copied)."""
    if adapter is None:
        return []
    saved = sorted({t.removeprefix("base_model.model.").rsplit(".", 1)[0] for t in adapter.full_weight_tensors})
    # `<module>.base_layer.weight`: the frozen base weight of a LoRA-wrapped embedding or head, which PEFT saves
    # with the factors (save_embedding_layers), not a trained part: the base's own weight serves in its place
    saved = [s for s in saved if not s.endswith(".base_layer")]
    out = [(s, "modules_to_save full weights: SGLang loads LoRA factors only") for s in saved]
    out += [
        (f"{m.name}.lora_B.bias", "lora_bias: SGLang applies lora_A and lora_B weights, not lora_B's bias")
        for m in adapter.modules
        if m.bias_key
    ]
    return out


def _sglang_fix(problem: Any, adapter: Adapter | None, plan: Any) -> list[str]:
    """The flag values that let the server take the adapter: a pool rank or target modules it does not have."""
    from lorafast.compat import sglang

    text = problem.message
    if adapter is None or not ("max_lora_rank" in text or "max-lora-rank" in text or "buffer shape" in text):
        return []
    fix = []
    rank = max(adapter.r or 0, adapter.rank)
    if rank > plan.max_lora_rank:
        fix.append(f"--max-lora-rank {rank}")
    wanted = sglang.get_normalized_target_modules(list(adapter.target_modules)) - set(plan.target_modules)
    if wanted and "target modules" in text:
        fix.append(f"--lora-target-modules with {' '.join(sorted(wanted))} (or all)")
    return fix


def _sglang_drops(
    adapter: Adapter | None, path: str, targets: set[str], base_config: Mapping[str, Any] | None
) -> tuple[list[tuple[str, str]], int]:
    """(module, why) for the adapter's modules whose weights SGLang's memory pool does not take."""
    from lorafast.compat import sglang

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


# ---------------------------------------------------------------------------------------------------------------
# SGLang diffusion


def _diffusion_flags(argv: tuple[str, ...]) -> Any:
    """The LoRA flags of SGLang's diffusion `ServerArgs` (multimodal_gen), with its names and defaults; the LLM
    parser of `compat.launch` does not know them (it would read `--lora-path` as an abbreviation)."""
    import argparse

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--lora-path", default=None)
    p.add_argument("--lora-nickname", default="default")
    p.add_argument("--lora-scale", type=float, default=1.0)
    p.add_argument("--lora-alpha", type=int, default=None)
    p.add_argument("--lora-merge-mode", default="auto")
    return p.parse_known_args(list(argv))[0]


def _diffusion(launch: LaunchCommand, fleet: Fleet) -> _Judged:
    """The start-up adapter (`--lora-path`) and every later one, applied together by one `set_lora` call on the
    pipeline, as SGLang's diffusion runtime plans it (`lorafast.plan`): its ValueErrors are the verdicts."""
    import os

    from lorafast.planner import LoraRequest, PipelineState, plan

    flags = _diffusion_flags(launch.argv)
    entries = [(n, p, s) for n, p, s in fleet.entries if s != "command"]
    if flags.lora_path:
        entries.insert(0, (flags.lora_nickname, flags.lora_path, "command"))
    fleet.entries[:] = entries
    requests = [LoraRequest(n, p, flags.lora_scale if s == "command" else 1.0) for n, p, s in entries]
    state = PipelineState(server_merge_mode=flags.lora_merge_mode)
    try:
        result = plan(requests, current=state, engine_version=launch.rules.requested)
    except ValueError as e:  # SGLang's own error, e.g. several adapters on one target in dynamic mode
        fix = ["--lora-merge-mode merge (or set_lora(..., merge_mode='merge'))"]
        if "only one adapter per target" in str(e):
            fix.append("serve the adapters one per target, or plan with --resolve (lorafast plan)")
        rows = [
            AdapterVerdict(
                n,
                p,
                s,
                "fails",
                (f"{type(e).__name__}: {e}",),
                stage="load",
                exc_type=type(e).__name__,
                message=str(e),
                fix=tuple(fix),
            )  # fmt: skip
            for n, p, s in entries
        ]
        return rows, [], True
    rows = []
    for n, p, s in entries:
        unreadable = result.unreadable.get(p) or result.unreadable.get(os.fspath(p))
        if unreadable:
            rows.append(AdapterVerdict(n, p, s, "unknown", (f"cannot read it here: {unreadable}",),
                                       undecided=(f"the adapter at {p}",)))  # fmt: skip
        else:
            modes = sorted({t.mode for t in result.targets})
            rows.append(AdapterVerdict(n, p, s, "serves", (f"set_lora applies it ({', '.join(modes)})",)))
    return rows, [], True
