"""The requests of a `set_lora` call, and SGLang's handling of its arguments.

SGLang's rules and texts live in `lorafast.compat.diffusion`; these wrappers give them the planner's signatures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorafast.compat import diffusion as _diffusion


@dataclass(frozen=True)
class LoraRequest:
    """One adapter of a `set_lora` call: `nickname` (with `path` to load it) at `strength` on `target`."""

    nickname: str
    path: str | None = None
    strength: float = 1.0
    target: str = "all"
    alpha: float | None = None
    """SGLang `lora_alpha`: overrides the adapter-level alpha."""


def parse_adapter_spec(spec: str) -> LoraRequest:
    """`NICK[=PATH][:STRENGTH][@TARGET]` (`lorafast plan --adapter`), parsed from the right so paths may hold ':'
    or '@'. Raises `ValueError` for a spec without a nickname."""
    target = "all"
    head, sep, tail = spec.rpartition("@")
    if sep and tail in _diffusion.VALID_TARGETS:
        spec, target = head, tail
    strength = 1.0
    head, sep, tail = spec.rpartition(":")
    if sep:
        try:
            strength = float(tail)
            spec = head
        except ValueError:
            pass
    nickname, sep, path = spec.partition("=")
    if not nickname:
        raise ValueError(f"bad --adapter {spec!r}: expected NICK=PATH[:STRENGTH][@TARGET]")
    return LoraRequest(nickname, path or None, strength, target)


def normalize_lora_params(
    lora_nickname: str | Sequence[str],
    lora_path: str | None | list[str | None] = None,
    strength: float | Sequence[float] = 1.0,
    target: str | Sequence[str] = "all",
    lora_alpha: float | None | list[float | None] = None,
    *,
    engine_version: str | None = None,
) -> tuple[list[str], list[str | None], list[float], list[str], list[float | None]]:
    """SGLang `_normalize_lora_params` + target validation (`compat.diffusion.normalize_lora_params` and
    `check_targets`), with the same broadcasting and error texts.

    Quirks kept on purpose: `lora_path` and `lora_alpha` count as lists only when they are `list`s (a tuple is
    one value), while `strength` and `target` broadcast only from a scalar.
    """
    nicknames = [lora_nickname] if isinstance(lora_nickname, str) else list(lora_nickname)
    targets_in = target if isinstance(target, str) else list(target)
    strength_in = strength if isinstance(strength, (int, float)) else list(strength)
    normalize: Any = _diffusion.normalize_lora_params  # takes float alphas too: SGLang only compares them to 0
    nicks, paths, strengths, targets, alphas = normalize(
        nicknames, lora_path, strength_in, targets_in, lora_alpha, engine_version=engine_version
    )
    _diffusion.check_targets(targets, engine_version=engine_version)
    return list(nicks), list(paths), strengths, list(targets), list(alphas)


def should_merge(
    module: str, sharded: bool, merge_mode: str, quantized: bool = False, *, engine_version: str | None = None
) -> tuple[bool, str | None, str | None]:
    """SGLang `_should_merge_lora_for_layers` (`compat.diffusion.should_merge_lora`): (merge?, info reason,
    warning). `sharded` = DTensor weights; `quantized` = layers whose weights cannot take a merged delta (0.5.23;
    "merge" on them raises SGLang's `ValueError`)."""
    merge = _diffusion.should_merge_lora(
        merge_mode, fsdp_sharded=sharded, quantized=quantized, module_name=module, engine_version=engine_version
    )
    log = _diffusion.merge_log(
        merge_mode, fsdp_sharded=sharded, quantized=quantized, module_name=module, engine_version=engine_version
    )
    if merge_mode == "dynamic":
        return False, "merge_mode='dynamic' never merges", None
    if merge_mode == "auto":
        if log is not None:
            return False, log, None
        return True, "merge_mode='auto' merges weights that are neither sharded nor quantized", None
    return merge, "merge_mode='merge' always merges", log


#: The keyword arguments of `LoRAPipeline.set_lora`.
_SET_LORA_KEYS = frozenset(
    {"lora_nickname", "lora_path", "target", "strength", "lora_alpha", "merge_mode", "merge_weights"}
)


def request_params(requests: Any, merge_mode: str | None, merge_weights: bool | None) -> tuple[tuple, Any, Any]:
    """Turn any accepted request form into `_normalize_lora_params` arguments."""
    if isinstance(requests, LoraRequest):
        requests = [requests]
    if isinstance(requests, Mapping):
        unknown = set(requests) - _SET_LORA_KEYS
        if unknown:
            raise TypeError(f"unknown set_lora argument(s): {sorted(unknown)}")
        if "lora_nickname" not in requests:
            raise TypeError("set_lora arguments need 'lora_nickname'")
        if merge_mode is None:
            merge_mode = requests.get("merge_mode")
        if merge_weights is None:
            merge_weights = requests.get("merge_weights")
        params = (
            requests["lora_nickname"],
            requests.get("lora_path"),
            requests.get("strength", 1.0),
            requests.get("target", "all"),
            requests.get("lora_alpha"),
        )
        return params, merge_mode, merge_weights
    items = list(requests)
    if not items:
        raise ValueError("plan() needs at least one LoraRequest")
    if not all(isinstance(r, LoraRequest) for r in items):
        raise TypeError("requests must be LoraRequest objects or a mapping of set_lora arguments")
    params = (
        [r.nickname for r in items],
        [r.path for r in items],
        [r.strength for r in items],
        [r.target for r in items],
        [r.alpha for r in items],
    )
    return params, merge_mode, merge_weights
