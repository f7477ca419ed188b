"""The `adapter_config.json` of a converted adapter: same scales, new module names.

Each output module must resolve (PEFT's first-match `rank_pattern`/`alpha_pattern` rule on the module's name as
PEFT sees it, then `r`/`lora_alpha`) to the rank its tensors have and to the alpha that keeps its scale. Where the
source config would not give that, an entry is put in front of the patterns: the leaf name when every module with
that leaf needs the same values, else `experts.<leaf>` when every expert module with it does, else the module's
own name. `mismatches` checks a written config against the same rule, so a config that misses is refused.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.formats.peft import peft_pattern_value


@dataclass(frozen=True)
class Want:
    """What one output module needs: `name` (as PEFT matches patterns against it: the key without
    `base_model.model.`, a diffusers component prefix kept, so SDXL's two text encoders differ), `leaf` (the part
    `target_modules` and shared pattern keys name), `rank`, `alpha` (None: alpha = rank)."""

    name: str
    leaf: str
    rank: int
    alpha: float | None
    parameter: bool = False  # a PEFT target_parameters entry rather than a target module


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _value(w: Want) -> tuple[int, float]:
    return w.rank, w.alpha if w.alpha is not None else float(w.rank)


def _resolve(cfg: Mapping[str, Any], name: str) -> tuple[int, float]:
    """The (rank, alpha) PEFT gives module `name` under `cfg` (`LoraModel._create_and_replace`)."""
    rk = peft_pattern_value(cfg.get("rank_pattern") or {}, name)
    al = peft_pattern_value(cfg.get("alpha_pattern") or {}, name)
    return (
        int(rk) if rk is not None else int(cfg.get("r", 8)),
        float(al) if al is not None else float(cfg.get("lora_alpha", 8)),
    )


def mismatches(cfg: Mapping[str, Any], wants: list[Want]) -> list[str]:
    """One line per module that `cfg` does not give its rank and alpha (so its scale), empty when it gives all."""
    out = []
    for w in wants:
        got = _resolve(cfg, w.name)
        if got != _value(w):
            out.append(
                f"{w.name}: rank {got[0]} alpha {_num(got[1])}, the source has {w.rank} and {_num(_value(w)[1])}"
            )
    return out


def build(
    source: Mapping[str, Any] | None, wants: list[Want], target_parameters: list[str], *, widest: bool = False
) -> dict[str, Any]:
    """The config for `wants`. `widest`: make the largest rank (and its alpha) the config's `r`/`lora_alpha`, so
    engines that read only `r` and one `lora_alpha` per adapter (SGLang) size buffers and scale alike."""
    if source is None:
        ranks = Counter(w.rank for w in wants)
        r = ranks.most_common(1)[0][0] if ranks else 8
        alphas = Counter(w.alpha if w.alpha is not None else w.rank for w in wants if w.rank == r)
        alpha = alphas.most_common(1)[0][0] if alphas else r
        cfg: dict[str, Any] = {
            "peft_type": "LORA",
            "r": r,
            "lora_alpha": _num(alpha),
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_rslora": False,
            "bias": "none",
            "lora_dropout": 0.0,
        }
    else:
        cfg = copy.deepcopy(dict(source))
    if widest and wants:
        top = max(wants, key=lambda w: w.rank)
        if top.rank > int(cfg.get("r", 8)):
            cfg["r"], cfg["lora_alpha"] = top.rank, _num(_value(top)[1])
    rank_p = dict(cfg.get("rank_pattern") or {})
    alpha_p = dict(cfg.get("alpha_pattern") or {})
    needed = [w for w in wants if _resolve(cfg, w.name) != _value(w)]
    new_r: dict[str, int] = {}
    new_a: dict[str, float | int] = {}
    by_leaf: dict[str, list[Want]] = {}
    for w in needed:
        by_leaf.setdefault(w.leaf, []).append(w)
    for leaf, ws in by_leaf.items():
        values = {_value(w) for w in ws}
        same_leaf = [w for w in wants if w.leaf == leaf]
        generic = f"experts.{leaf}"
        experts = [w for w in wants if w.name.endswith("." + generic)]
        if len(values) == 1 and {_value(w) for w in same_leaf} == values:
            keys = [(leaf, ws[0])]  # every module with this leaf needs the same: one key
        elif len(values) == 1 and set(ws) <= set(experts) and {_value(w) for w in experts} == values:
            keys = [(generic, ws[0])]
        else:
            keys = [(w.name, w) for w in ws]
        for key, w in keys:
            new_r[key] = w.rank
            new_a[key] = _num(_value(w)[1])
    cfg["rank_pattern"] = {**new_r, **{k: v for k, v in rank_p.items() if k not in new_r}}
    cfg["alpha_pattern"] = {**new_a, **{k: v for k, v in alpha_p.items() if k not in new_a}}
    modules = sorted({w.leaf for w in wants if not w.parameter})
    cfg["target_modules"] = modules
    if target_parameters:
        cfg["target_parameters"] = sorted(set(target_parameters))
    else:
        cfg.pop("target_parameters", None)
    return cfg
