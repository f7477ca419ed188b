"""SGLang diffusion's `set_lora`: argument checks, the merge mode, and the per-module merge decisions."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from lorafast.compat.diffusion._reading import resolve_version

LORA_MERGE_MODES = ("auto", "merge", "dynamic")
VALID_TARGETS = ["all", "transformer", "transformer_2", "critic"]


MSG_INVALID_MERGE_MODE = "Invalid LoRA merge mode: {mode}. Valid modes: {modes}"
MSG_DYNAMIC_ONE_ADAPTER = (
    "Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple adapters."
)
MSG_QUANTIZED_MERGE = (
    "LoRA merge mode is unavailable for {module} because its quantized weights cannot be updated in place; "
    "use merge mode 'dynamic'"
)
# `set_lora`'s log lines (texts as SGLang logs them; the planner quotes them as reasons).
MSG_AUTO_FSDP = "Using dynamic LoRA for {module} because FSDP-sharded weights would require a full-gather merge."
MSG_AUTO_QUANTIZED = "Using dynamic LoRA for {module} because its quantized weights cannot be merged in place."
MSG_MERGE_FSDP = "Merging LoRA for {module} with FSDP-sharded weights may require full-gather and can OOM."
MSG_CONFIG_MATCHES = "LoRA configuration matches exactly, skipping"
MSG_MISSING_MODULE = {
    "transformer_2": "transformer_2 does not exist in this pipeline",
    "critic": "critic (fake_score_transformer) does not exist in this pipeline",
}
MSG_STAYS_UNMERGED = (
    "LoRA {paths} stays unmerged on {module}: merging it into the base weights would round away {percent:.0f}% of "
    "its update. Pass --lora-merge-mode merge to merge anyway."
)
#: Components a target resolves to, in the order `_get_target_lora_layers("all")` lists them.
PIPELINE_MODULES = ("transformer", "transformer_2", "critic")
#: merge_mode "auto" keeps a lone adapter unmerged when merging would round away more than this share of its
#: update, by norm (`AUTO_MERGE_MAX_ROUNDING_LOSS`, 0.5.23).
AUTO_MERGE_MAX_ROUNDING_LOSS = 0.5
# The release whose `set_lora` gained the quantized-layer rule, the auto-merge rounding-loss rule and the merge
# cache. Earlier versions are answered without them; only 0.5.23 is proven by the oracle.
_MERGE_RULES_SINCE = (0, 5, 23)


# --- set_lora --------------------------------------------------------------------------------------------


def normalize_lora_params(
    lora_nickname: str | list[str],
    lora_path: str | None | list[str | None] = None,
    strength: float | list[float] = 1.0,
    target: str | list[str] = "all",
    lora_alpha: int | None | list[int | None] = None,
    *,
    engine_version: str | None = None,
) -> tuple[list[str], list[str | None], list[float], list[str], list[int | None]]:
    """`_normalize_lora_params` (then `set_lora`'s target check): lists of equal length, or SGLang's error."""
    resolve_version(engine_version)
    nicknames = [lora_nickname] if isinstance(lora_nickname, str) else lora_nickname
    paths = lora_path if isinstance(lora_path, list) else [lora_path]
    if len(paths) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but lora_path has {len(paths)} items. "
            "Provide one path per nickname."
        )
    if isinstance(strength, (int, float)):
        strengths = [float(strength)] * len(nicknames)
    else:
        strengths = [float(s) for s in strength]
    if len(strengths) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but strength has {len(strengths)} items"
        )
    targets = [target] * len(nicknames) if isinstance(target, str) else target
    if len(targets) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but target has {len(targets)} items"
        )
    alphas = lora_alpha if isinstance(lora_alpha, list) else [lora_alpha] * len(nicknames)
    if len(alphas) != len(nicknames):
        raise ValueError(
            f"Length mismatch: lora_nickname has {len(nicknames)} items, but lora_alpha has {len(alphas)} items"
        )
    if any(alpha is not None and alpha <= 0 for alpha in alphas):
        raise ValueError("lora_alpha values must be positive integers or null")
    return nicknames, paths, strengths, targets, alphas


def check_targets(targets: list[str], *, engine_version: str | None = None) -> None:
    """`set_lora`'s target check, after `normalize_lora_params`."""
    resolve_version(engine_version)
    invalid = [t for t in targets if t not in VALID_TARGETS]
    if invalid:
        raise ValueError(f"Invalid target(s): {invalid}. Valid targets: {VALID_TARGETS}")


def resolve_lora_merge_mode(
    merge_weights: bool | None = None,
    merge_mode: str | None = None,
    server_mode: str = "auto",
    *,
    engine_version: str | None = None,
) -> str:
    """`LoRAPipeline._resolve_lora_merge_mode(merge_weights, merge_mode)`, in its argument order, with the server's
    `--lora-merge-mode` as `server_mode`: an explicit mode, else merge_weights, else the server's."""
    resolve_version(engine_version)
    if merge_mode is None:
        if merge_weights is not None:
            merge_mode = "merge" if merge_weights else "dynamic"
        else:
            merge_mode = server_mode
    if merge_mode not in LORA_MERGE_MODES:
        raise ValueError(MSG_INVALID_MERGE_MODE.format(mode=merge_mode, modes=LORA_MERGE_MODES))
    return merge_mode


def has_merge_rules(engine_version: str | None = None) -> bool:
    """Whether `set_lora` of this SGLang version has the quantized-layer rule, the auto-merge rounding-loss
    rule and the merge cache (0.5.23 and later)."""
    return resolve_version(engine_version) >= _MERGE_RULES_SINCE


def should_merge_lora(
    merge_mode: str,
    *,
    fsdp_sharded: bool = False,
    quantized: bool = False,
    module_name: str = "transformer",
    engine_version: str | None = None,
) -> bool:
    """`_should_merge_lora_for_layers`. "dynamic" never merges; "auto" merges unless a layer's weights are
    FSDP-sharded or quantized so that they cannot take a merged delta; "merge" on such quantized layers is an
    error (FSDP only warns). Before 0.5.23 quantized layers are not looked at. `merge_log` gives the line SGLang
    logs with the decision."""
    if not has_merge_rules(engine_version):
        quantized = False
    if merge_mode == "dynamic":
        return False
    if merge_mode == "auto":
        return not fsdp_sharded and not quantized
    if quantized:
        raise ValueError(MSG_QUANTIZED_MERGE.format(module=module_name))
    return True


def merge_log(
    merge_mode: str,
    *,
    fsdp_sharded: bool = False,
    quantized: bool = False,
    module_name: str = "transformer",
    engine_version: str | None = None,
) -> str | None:
    """The line `_should_merge_lora_for_layers` logs for this decision (info for "auto", a warning for "merge"
    on FSDP-sharded weights), or None. A "merge" on quantized layers raises instead: see `should_merge_lora`."""
    if not has_merge_rules(engine_version):
        quantized = False
    if merge_mode == "auto":
        if fsdp_sharded:
            return MSG_AUTO_FSDP.format(module=module_name)
        if quantized:
            return MSG_AUTO_QUANTIZED.format(module=module_name)
    elif merge_mode == "merge" and fsdp_sharded and not quantized:
        return MSG_MERGE_FSDP.format(module=module_name)
    return None


def merge_rounding_loss(layers: Any, max_rows: int = 1024) -> float | None:
    """`merge_rounding_loss` over `BaseLayerWithLoRA.merge_rounding_norms` (0.5.23), computed the same way.

    `layers` yields `(weight, entries)` per LoRA layer of a component: the base weight (a torch tensor) and the
    adapters attached unmerged there, as `(lora_A, lora_B, strength, rank, alpha)`. Per layer, on an even
    sample of at most `max_rows` rows, in float32: the update `Σ strength·(alpha/rank if alpha != rank)·B·A`, and
    what rounding `W + update` to the weight's dtype loses. A layer whose weight is float32 or not floating, or
    whose A or B is not 2-D, counts for nothing. Returns `sqrt(Σ lost² / Σ update²)`, or None when there is
    nothing to measure. Needs torch."""
    import torch

    lost = total = 0.0
    for weight, entries in layers:
        if not entries:
            continue
        src = torch.as_tensor(weight)
        if not src.is_floating_point() or src.dtype == torch.float32:
            continue
        w2 = src.reshape(-1, src.shape[-1])
        rows = torch.linspace(0, w2.shape[0] - 1, min(max_rows, w2.shape[0])).round().long().unique()
        base = w2[rows].to(torch.float32)
        delta = torch.zeros_like(base)
        flat = True
        for lora_a, lora_b, strength, rank, alpha in entries:
            a = torch.as_tensor(lora_a).to(torch.float32)
            b = torch.as_tensor(lora_b).to(torch.float32)
            if a.dim() > 2 or b.dim() > 2:
                flat = False
                break
            scale = strength
            if alpha is not None and rank is not None and alpha != rank:
                scale *= alpha / rank
            delta += scale * (b[rows] @ a)
        if not flat:
            continue
        exact = base + delta
        err = exact.to(src.dtype).to(torch.float32) - exact
        lost += float(err.square().sum())
        total += float(delta.square().sum())
    return (lost / total) ** 0.5 if total > 0 else None


def auto_merge_rounds_away(loss: float | None) -> bool:
    """`_auto_merge_rounds_away`'s verdict on a measured loss: keep the adapter unmerged above the threshold."""
    return loss is not None and loss > AUTO_MERGE_MAX_ROUNDING_LOSS


def check_adapters_per_target(
    num_adapters: int,
    merge_mode: str = "auto",
    *,
    fsdp_sharded: bool = False,
    quantized: bool = False,
    engine_version: str | None = None,
) -> bool:
    """`set_lora`'s rule for one target: dynamic LoRA takes one adapter. Returns whether it would merge."""
    merge = should_merge_lora(
        resolve_lora_merge_mode(merge_mode=merge_mode, engine_version=engine_version),
        fsdp_sharded=fsdp_sharded,
        quantized=quantized,
        engine_version=engine_version,
    )
    if not merge and num_adapters > 1:
        raise ValueError(MSG_DYNAMIC_ONE_ADAPTER)
    return merge


class SetLoraDecision(NamedTuple):
    """What `set_lora` decides before touching weights: `(module, merges)` in the order it decides them, and
    the adapters it loads, as `(nickname, path, lora_alpha)`."""

    decisions: list[tuple[str, bool]]
    loads: list[tuple[str, str, int | None]]


def _target_modules(target: str, modules: Collection[str]) -> list[str]:
    """`_get_target_lora_layers`: "all" is the transformer plus transformer_2 and critic when the pipeline has
    them; "transformer" is always there; a missing one gives nothing (SGLang logs a warning)."""
    if target == "all":
        return ["transformer"] + [m for m in ("transformer_2", "critic") if m in modules]
    if target == "transformer":
        return ["transformer"]
    return [target] if target in modules else []


def check_set_lora(
    lora_nickname: str | list[str],
    lora_path: str | None | list[str | None] = None,
    target: str | list[str] = "all",
    strength: float | list[float] = 1.0,
    merge_weights: bool | None = None,
    merge_mode: str | None = None,
    lora_alpha: int | None | list[int | None] = None,
    *,
    server_mode: str = "auto",
    loaded: Mapping[str, str] | None = None,
    modules: Collection[str] = ("transformer",),
    fsdp_sharded: Collection[str] = (),
    quantized: Collection[str] = (),
    engine_version: str | None = None,
) -> SetLoraDecision:
    """`LoRAPipeline.set_lora` up to the weights: its argument errors, in its order, and its decisions.

    `loaded` maps the nicknames already loaded to their paths; `modules` names the DiTs the pipeline has
    (`transformer`, `transformer_2`, `critic`); `fsdp_sharded`/`quantized` name those whose LoRA layers hold
    FSDP-sharded weights, or quantized weights that cannot take a merged delta. Loading an adapter and the
    `auto` rounding-loss rule need the files and weights: see `load_lora_adapter`.
    """
    mode = resolve_lora_merge_mode(merge_weights, merge_mode, server_mode, engine_version=engine_version)
    nicknames, paths, _strengths, targets, alphas = normalize_lora_params(
        lora_nickname, lora_path, strength, target, lora_alpha, engine_version=engine_version
    )
    check_targets(targets, engine_version=engine_version)
    loaded_paths = dict(loaded or {})
    loads: list[tuple[str, str, int | None]] = []
    for nickname, path, alpha in zip(nicknames, paths, alphas, strict=True):
        if nickname not in loaded_paths and path is None:
            raise ValueError(f"Adapter {nickname} not found in the pipeline. Please provide lora_path to load it.")
        if path is not None and loaded_paths.get(nickname) != path:
            loads.append((nickname, path, alpha))
            loaded_paths[nickname] = path
    groups: dict[str, int] = {}
    for tgt in targets:
        groups[tgt] = groups.get(tgt, 0) + 1
    decisions: list[tuple[str, bool]] = []
    for tgt, count in groups.items():
        names = _target_modules(tgt, modules)
        for i, name in enumerate(names):
            merge = should_merge_lora(
                mode,
                fsdp_sharded=name in fsdp_sharded,
                quantized=name in quantized,
                module_name=name,
                engine_version=engine_version,
            )
            decisions.append((name, merge))
            if i == 0 and not merge and count > 1:
                raise ValueError(MSG_DYNAMIC_ONE_ADAPTER)
    return SetLoraDecision(decisions, loads)
