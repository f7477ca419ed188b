"""Where each adapter module goes, and in which layout its factors meet the weight.

Every target weight is seen as a 3-D matrix stack `(E, R, C)`: a bias is `(1, n, 1)`, a linear or embedding
weight `(1, out, in)`, a conv weight `(1, out, in·kh·kw)`, an expert stack `(E, ., .)` as it is. Every adapter
term becomes `L @ R` in that layout, with `L` `(E|1, R, k)` and `R` `(E|1, k, C)`, so one chunked kernel merges
all of them, and the terms on one weight are concatenated along `k` into a single matmul.

`preflight` does all of this from shapes alone, before any weight is touched: a missing module, a shape that
does not fit, an unsupported variant or dtype all fail here, naming the module and the adapter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lorafast.adapter import LoraModule
from lorafast.formats.moe import NUMBERED_EXPERT_WEIGHT, SGLANG_W_RENAMES, STACKED_EXPERT_MODULE
from lorafast.formats.peft import peft_pattern_value
from lorafast.merging.errors import MergeError
from lorafast.merging.sources import Source
from lorafast.naming import (
    NameMatch,
    NameTable,
    WeightSpec,
    is_kohya,
    plan_linear,
    plan_stacked,
    plan_target_parameters,
    stack_shape,
)

if TYPE_CHECKING:
    import torch


#: adapter factor dtypes the engine reads (safetensors names)
FLOAT_FACTOR_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
#: module kinds the engine merges
MERGEABLE_KINDS = frozenset({"linear", "conv", "embedding", "expert_2d", "stacked_3d", "target_parameters"})


@dataclass
class Term:
    """One adapter module's contribution to one weight."""

    source: Source
    module: LoraModule
    form: str
    """One of BA, AtBt, stacked, stacked_t, tp, tp_t, bias, dora."""
    coef: float
    """Strength × scale."""
    rank: int
    experts: int = 1
    slot: tuple[int, int, int] | None = None
    """Form "expert_slot": (expert, part, parts) inside a fused weight."""
    prefix: tuple[str, str] | None = None
    """(adapter's, base's) prefix of a prefix-only match (allow_prefix=True)."""

    @property
    def label(self) -> str:
        return f"module {self.module.name!r} of adapter {self.source.nickname!r}"


@dataclass
class Target:
    """One weight to merge into, with its terms in application order."""

    name: str
    """The tensor name, qualified as "component:name" in a dict of pipeline components."""
    spec: WeightSpec
    component: str | None = None
    key: str = ""
    """The tensor name inside its component."""
    terms: list[Term] = field(default_factory=list)

    @property
    def stack(self) -> tuple[int, int, int]:
        return stack_shape(self.spec.shape)

    @property
    def adapters(self) -> list[str]:
        seen: list[str] = []
        for t in self.terms:
            if t.source.nickname not in seen:
                seen.append(t.source.nickname)
        return seen


# ---------------------------------------------------------------------------------------------------------------
# Matching adapter module names to tensor names


class NameIndex:
    """Tensor names of one model (or component) with their specs, and the name rule (`NameTable.match`).

    `renamed`: loaded name -> stored name for the weights transformers 5 renames on load (`base.renamed_on_load`,
    the mapping `check` uses). Their loaded names match as well, and resolve to the stored weight; as in `check`,
    a stored name that is renamed on load is never offered as a prefix-only match."""

    def __init__(self, specs: Mapping[str, WeightSpec], renamed: Mapping[str, str] | None = None) -> None:
        self.specs = specs
        self.renamed = {new: old for new, old in (renamed or {}).items() if old in specs and new not in specs}
        names: Mapping[str, Any] = {**specs, **self.renamed} if self.renamed else specs
        self.table = NameTable(names, hidden=frozenset(self.renamed.values()))
        self._parents: dict[str, list[str]] | None = None
        self._parent_table: NameTable | None = None

    def _stored(self, hit: NameMatch) -> NameMatch:
        """A match on loaded names, as the stored names it stands for."""
        if not self.renamed:
            return hit
        get = self.renamed.get
        return replace(
            hit,
            weight=hit.weight and get(hit.weight, hit.weight),
            prefixed=hit.prefixed and get(hit.prefixed, hit.prefixed),
            ambiguous=tuple(get(n, n) for n in hit.ambiguous),
        )

    def match(self, module_name: str, suffix: str, kohya: bool = False) -> NameMatch:
        """`NameTable.match` on the tensor names (stored and loaded), as stored names."""
        return self._stored(self.table.match(module_name, suffix, kohya))

    def match_module(self, module_name: str) -> NameMatch:
        """The same rule on module paths (the parents of tensors)."""
        if self._parent_table is None:
            self._parents = {}
            for n in (*self.specs, *self.renamed):
                if "." in n:
                    self._parents.setdefault(n.rsplit(".", 1)[0], []).append(self.renamed.get(n, n))
            self._parent_table = NameTable(self._parents)
        return self._parent_table.match(module_name, "")

    def children(self, module_path: str) -> list[str]:
        """Direct tensors of a module path (`<path>.<leaf>`), as stored names."""
        self.match_module(module_path)  # builds the parent table
        assert self._parents is not None
        return list(self._parents.get(module_path, []))


# ---------------------------------------------------------------------------------------------------------------
# Preflight


def _refusal(source: Source) -> str | None:
    """Why a whole adapter cannot be merged, or None."""
    adapter = source.adapter
    variants = [v for v in adapter.variants if v != "dora"]
    if variants:
        return (
            f"adapter {source.nickname!r} contains {', '.join(variants)} modules; only plain LoRA (and PEFT DoRA) "
            "can be merged by lorafast"
        )
    flags = set(adapter.flags)
    if "modules_to_save" in flags:
        return (
            f"adapter {source.nickname!r} has modules_to_save (whole replacement modules), which cannot be merged "
            "at a strength; merge it with PEFT or drop them from the adapter"
        )
    if "trainable_tokens" in flags:
        return f"adapter {source.nickname!r} has trainable tokens, which lorafast does not merge"
    init = (adapter.config or {}).get("init_lora_weights")
    if isinstance(init, str) and init.lower().split("_")[0] in ("pissa", "olora", "corda", "loftq"):
        return (
            f"adapter {source.nickname!r} was initialised with {init}, which changes the base weights; it is not "
            "a plain delta and cannot be merged into the original model"
        )
    return None


def _fan_in_fan_out(source: Source, spec: WeightSpec) -> bool:
    cfg = source.adapter.config or {}
    return bool(cfg.get("fan_in_fan_out", False)) or spec.fan_in_fan_out


def _tp_candidates(index: NameIndex, m: LoraModule, find: _Find) -> list[str]:
    """The 3-D parameters a target_parameters module may wrap: `<experts>.<leaf>` first, then its siblings."""
    path = re.sub(r"\.base_layer\b", "", m.name)
    owner = path
    if m.leaf and m.leaf != "experts" and path.endswith("." + m.leaf):
        owner = path[: -len(m.leaf) - 1]
    parent = find(index.match_module(owner))
    if parent is None:
        return []
    kids = [n for n in index.children(parent) if len(index.specs[n].shape) == 3]
    preferred = [n for n in kids if m.leaf and n.endswith("." + m.leaf)]
    return preferred + [n for n in kids if n not in preferred]


class _Problem(Exception):
    def __init__(self, code: str, why: str) -> None:
        super().__init__(why)
        self.code = code
        self.why = why


_Find = Callable[[NameMatch], "str | None"]


@dataclass
class _Resolved:
    weight: str
    form: str
    rank: int
    experts: int
    prefix: NameMatch | None = None
    """The prefix-only match taken (allow_prefix=True)."""


def _resolve(src: Source, m: LoraModule, index: NameIndex, allow_prefix: bool = False) -> _Resolved:
    """The weight, form, rank and experts of one module, or `_Problem`.

    Names go by `NameTable.match`, exact matches first. A module that only a prefix-only match reaches is refused
    (code `prefix_only`, naming the prefix), unless `allow_prefix`; then that match is taken and returned."""
    kohya = is_kohya(m.key)
    seen: list[NameMatch] = []

    def exact(hit: NameMatch) -> str | None:
        if hit.prefixed is not None or hit.ambiguous:
            seen.append(hit)
        return hit.weight

    try:
        return _resolve_with(src, m, index, exact, kohya)
    except _Problem as p:
        if p.code != "missing_module" or not seen:
            raise
        missing = p
    hit = seen[0]
    if not allow_prefix:
        if hit.prefixed is None:
            raise missing from None
        raise _Problem(
            "prefix_only",
            f"no weight is named by this module's path, only {hit.prefixed!r} below another "
            f"prefix: {hit.prefix_hint}; rename the adapter's keys, or pass allow_prefix=True "
            "(--allow-prefix) to merge there",
        ) from None
    if hit.ambiguous:
        raise _Problem("ambiguous_module", f"several weights match below other prefixes: {list(hit.ambiguous[:4])}")
    taken: list[NameMatch] = []

    def prefixed(found: NameMatch) -> str | None:
        if found.weight is None and found.prefixed is not None:
            taken.append(found)
            return found.prefixed
        if found.ambiguous and found.weight is None:
            raise _Problem(
                "ambiguous_module", f"several weights match below other prefixes: {list(found.ambiguous[:4])}"
            )
        return found.weight

    got = _resolve_with(src, m, index, prefixed, kohya)
    got.prefix = taken[0] if taken else None
    return got


def _resolve_with(src: Source, m: LoraModule, index: NameIndex, find: _Find, kohya: bool) -> _Resolved:
    if m.kind == "target_parameters":
        cands = _tp_candidates(index, m, find)
        last = "no 3-D expert parameter matches this module"
        for c in cands:
            form, last, rank = plan_target_parameters(m, index.specs[c])
            if form is not None:
                bad = _check_weight(index.specs[c])
                if bad:
                    raise _Problem(bad[0], f"weight {c!r}: {bad[1]}")
                return _Resolved(c, form, rank, index.specs[c].shape[0])
        raise _Problem("shape_mismatch" if cands else "missing_module", last)
    weight = find(index.match(m.key, ".weight", kohya))
    if weight is None and m.kind == "stacked_3d":
        weight = find(index.match(m.key, "", kohya))  # a fused expert parameter (`experts.gate_up_proj`)
    if weight is None and m.kind in ("expert_2d", "stacked_3d"):
        fused = _fused_expert(m, index, find)
        if fused is not None:
            return fused
    if weight is None:
        raise _Problem("missing_module", "no weight in the model matches this module")
    spec = index.specs[weight]
    bad = _check_weight(spec)
    if bad:
        raise _Problem(bad[0], f"weight {weight!r}: {bad[1]}")
    if m.kind == "stacked_3d":
        form, why = plan_stacked(m, spec)
        experts = spec.shape[0] if len(spec.shape) == 3 else 1
    else:
        fifo = m.kind in ("linear", "expert_2d") and _fan_in_fan_out(src, spec)
        form, why = plan_linear(m.kind, m, spec, fifo)
        experts = 1
    if form is None:
        raise _Problem("shape_mismatch", f"weight {weight!r}: {why}")
    return _Resolved(weight, form, m.rank or 0, experts)


def expert_slot(m: LoraModule) -> tuple[str, str, int, int, int] | None:
    """A numbered expert module (`experts.3.w1`) as (experts path, fused leaf, expert, part, parts): transformers 5
    fuses gate (w1) and up (w3) into `gate_up_proj` (gate rows first) and stacks down (w2) into `down_proj`.
    A 3-D module of one projection (`experts.gate_proj`) gives expert -1: all experts."""
    hit = (
        NUMBERED_EXPERT_WEIGHT.match(m.name + ".weight")
        if m.kind == "expert_2d"
        else STACKED_EXPERT_MODULE.match(m.name)
    )
    if hit is None:
        return None
    expert, leaf = (int(hit.group(2)), hit.group(3)) if m.kind == "expert_2d" else (-1, hit.group(2))
    leaf = SGLANG_W_RENAMES.get(leaf, leaf)
    part = {"gate_proj": 0, "up_proj": 1}.get(leaf)
    fused = "down_proj" if part is None else "gate_up_proj"
    return hit.group(1), fused, expert, part or 0, 1 if part is None else 2


def _fused_expert(m: LoraModule, index: NameIndex, find: _Find) -> _Resolved | None:
    """(weight, form, rank, experts) for a numbered expert module (form "expert_slot") or a 3-D stack of one
    projection ("stacked_slot") whose model keeps its experts fused; None when the model has no such weight."""
    slot = expert_slot(m)
    if slot is None:
        return None
    owner, fused, e, part, parts = slot
    a, b = m.a_shape or (), m.b_shape or ()
    if e < 0:  # a 3-D stack of one projection: check it as expert 0 of the same number of experts
        if len(a) != 3 or len(b) != 3 or a[0] != b[0]:
            raise _Problem("shape_mismatch", f"stacked factors {list(a)} / {list(b)} are not one stack of experts")
        experts, a, b = a[0], a[1:], b[1:]
    for path in dict.fromkeys((owner, owner.replace(".block_sparse_moe.", ".mlp."))):  # Mixtral's v5 rename
        weight = find(index.match(f"{path}.{fused}", ""))
        if weight is None:
            continue
        spec = index.specs[weight]
        if len(spec.shape) != 3 or len(a) != 2 or len(b) != 2:
            raise _Problem("shape_mismatch", f"weight {weight!r} {list(spec.shape)} is not a fused expert stack")
        if (
            e >= spec.shape[0]
            or (e < 0 and experts != spec.shape[0])
            or (spec.shape[1], spec.shape[2]) != (parts * b[0], a[1])
            or a[0] != b[1]
        ):
            raise _Problem(
                "shape_mismatch",
                f"lora_A {list(a)} / lora_B {list(b)} of expert {e} do not fit fused "
                f"weight {weight!r} {list(spec.shape)}",
            )
        bad = _check_weight(spec)
        if bad:
            raise _Problem(bad[0], f"weight {weight!r}: {bad[1]}")
        return _Resolved(weight, "expert_slot" if e >= 0 else "stacked_slot", a[0], spec.shape[0])
    return None


def _tp_module(src: Source, m: LoraModule, weight: str, rank: int) -> LoraModule:
    """A target_parameters module as PEFT scales it: r = rows / E, alpha_pattern matched on the parameter path."""
    cfg = src.adapter.config or {}
    alpha = m.alpha
    hit = peft_pattern_value(cfg.get("alpha_pattern") or {}, weight)
    if hit is not None:
        alpha = float(hit)
    elif "lora_alpha" in cfg:
        alpha = float(cfg["lora_alpha"])
    return replace(m, name=weight, rank=rank, alpha=alpha)


def preflight(
    sources: list[Source],
    indexes: Mapping[str | None, NameIndex],
    *,
    allow_dora: bool = True,
    allow_prefix: bool = False,
) -> list[Target]:
    """Resolve every adapter module of every source onto a weight; raise one `MergeError` listing all problems.

    `indexes` maps a component name to its `NameIndex` (`None` for a plain model or state dict). Names go by
    `NameTable.match`, the rule `check` uses: a module that exists only below another prefix fails with code
    `prefix_only` (naming the prefix), unless `allow_prefix`; the prefix then taken is in `Term.prefix`.
    """
    problems: list[tuple[str, str, str, str]] = []  # (code, module, adapter, message)
    targets: dict[str, Target] = {}

    def fail(code: str, m: LoraModule | None, src: Source, why: str) -> None:
        mod = m.name if m is not None else "*"
        problems.append((code, mod, src.nickname, f"{why} (module {mod!r} of adapter {src.nickname!r})"))

    def add(comp: str | None, key: str, spec: WeightSpec, term: Term) -> None:
        qual = f"{comp}:{key}" if comp is not None else key
        t = targets.get(qual)
        if t is None:
            t = targets[qual] = Target(qual, spec, comp, key)
        t.terms.append(term)

    for src in sources:
        why = _refusal(src)
        if why:
            problems.append(("unsupported", "*", src.nickname, why))
            continue
        comps = _components_for(src, indexes)
        if not comps:
            fail("missing_module", None, src, f"none of the components {list(src.components or ())} exist here")
            continue
        for m in src.adapter.modules:
            if m.kind not in MERGEABLE_KINDS:
                fail("unsupported", m, src, f"a {m.kind} module cannot be merged")
                continue
            if m.a_key is None or m.b_key is None or m.a_shape is None or m.b_shape is None:
                fail("unsupported", m, src, "the module lacks a lora_A/lora_B pair")
                continue
            if m.dtype is not None and m.dtype not in FLOAT_FACTOR_DTYPES:
                fail("dtype", m, src, f"factor dtype {m.dtype} is not a float type")
                continue
            found: list[tuple[str | None, NameIndex, _Resolved]] = []
            first: _Problem | None = None
            for comp in _components_of(m, comps):
                index = indexes[comp]
                try:
                    found.append((comp, index, _resolve(src, m, index, allow_prefix)))
                except _Problem as p:
                    if first is None or (first.code == "missing_module" and p.code != "missing_module"):
                        first = p
            if not found:
                assert first is not None
                fail(first.code, m, src, first.why)
                continue
            for comp, index, got in found:
                weight, form, rank, experts = got.weight, got.form, got.rank, got.experts
                renamed = (got.prefix.ours, got.prefix.theirs) if got.prefix is not None else None
                spec = index.specs[weight]
                scaled = _tp_module(src, m, weight, rank) if m.kind == "target_parameters" else m
                coef = src.coefficient(scaled)
                if m.magnitude_key is not None:
                    if m.magnitude_key.endswith("dora_scale"):
                        fail("unsupported", m, src, "kohya/LyCORIS DoRA (dora_scale, per-column) is not merged")
                        break
                    if not allow_dora:
                        fail("unsupported", m, src, "DoRA cannot be unmerged by subtraction; use a snapshot mode")
                        break
                    if form != "BA":
                        fail("unsupported", m, src, f"DoRA is merged only into plain linear/conv weights, not {form}")
                        break
                    form = "dora"
                slot = expert_slot(m)[2:] if form in ("expert_slot", "stacked_slot") else None  # type: ignore[index]
                add(comp, weight, spec, Term(src, m, form, coef, rank, experts, slot, renamed))
                if m.bias_key is not None:
                    bias = weight.removesuffix(".weight") + ".bias"
                    out_dim = stack_shape(spec.shape)[2 if form == "AtBt" else 1]
                    if bias not in index.specs:
                        fail("missing_module", m, src, "the adapter has lora_B.bias but the base module has no bias")
                        break
                    bspec = index.specs[bias]
                    if tuple(bspec.shape) != (out_dim,):
                        why = f"bias {bias!r} has shape {list(bspec.shape)}, expected [{out_dim}]"
                        fail("shape_mismatch", m, src, why)
                        break
                    add(comp, bias, bspec, Term(src, m, "bias", coef, rank, prefix=renamed))
    if problems:
        code, mod, adapter, message = problems[0]
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise MergeError(
            f"cannot merge: {message}{more}; no weight was changed",
            code,
            module=mod,
            adapter=adapter,
            problems=tuple(p[3] for p in problems),
        )
    return list(targets.values())


def prefixes_used(targets: list[Target]) -> list[dict[str, Any]]:
    """The prefix-only matches taken (allow_prefix=True): per adapter and (adapter prefix, base prefix), the
    number of modules merged that way. Each is also logged as a warning on the `lorafast.merge` logger."""
    import logging

    counts: dict[tuple[str, str, str], set[str]] = {}
    for t in targets:
        for term in t.terms:
            if term.prefix is not None:
                counts.setdefault((term.source.nickname, *term.prefix), set()).add(term.module.key)
    out = [
        {"adapter": a, "adapter_prefix": ours, "base_prefix": theirs, "modules": len(mods)}
        for (a, ours, theirs), mods in counts.items()
    ]
    log = logging.getLogger("lorafast.merge")
    for row in out:
        log.warning(
            "adapter %r: %d modules merged with prefix %r replaced by %r (allow_prefix=True)",
            row["adapter"],
            row["modules"],
            row["adapter_prefix"],
            row["base_prefix"],
        )
    return out


def _check_weight(spec: WeightSpec) -> tuple[str, str] | None:
    import torch

    if spec.device == "meta":
        return "meta_device", "it is on the meta device (no data to merge into; load the weights first)"
    if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return "dtype", f"dtype {spec.dtype} cannot be merged into (only float16, bfloat16, float32, float64)"
    return None


def _components_for(src: Source, indexes: Mapping[str | None, NameIndex]) -> list[str | None]:
    if None in indexes:
        # a single model: it is the "transformer" of a pipeline, and the target of "all"
        if src.components is None or "transformer" in src.components:
            return [None]
        return []
    names = list(indexes)
    if src.components is None:
        return names
    return [c for c in names if c in src.components]


def _components_of(m: LoraModule, comps: list[str | None]) -> list[str | None]:
    """The components a module goes into: the one its key names (`transformer.…`, `lora_transformer_…`), else
    every candidate (SGLang's "all" applies an adapter to each pipeline component that has the module)."""
    for comp in comps:
        if comp is not None and (m.key.startswith(comp + ".") or m.key.startswith("lora_" + comp + "_")):
            return [comp]
    return comps


# ---------------------------------------------------------------------------------------------------------------
# Factors in the weight's layout


def factors(term: Term, a: torch.Tensor, b: torch.Tensor, stack: tuple[int, int, int]) -> tuple[Any, Any]:
    """`(L, R)` for a term, in fp32, with the coefficient folded into L: `L @ R` is the term's delta."""
    e = stack[0]
    form = term.form
    if form in ("BA", "dora"):
        L = b.reshape(b.shape[0], -1).unsqueeze(0)
        R = a.reshape(a.shape[0], -1).unsqueeze(0)
    elif form == "AtBt":
        L = a.reshape(a.shape[0], -1).t().unsqueeze(0)
        R = b.reshape(b.shape[0], -1).t().unsqueeze(0)
    elif form == "stacked":
        L, R = b, a
    elif form == "stacked_t":
        L, R = a.transpose(1, 2), b.transpose(1, 2)
    elif form in ("tp", "tp_t"):
        r = term.rank
        a3 = a.reshape(e, r, a.shape[-1])  # rows of A are expert-major: row = e*r + j
        b3 = b.reshape(b.shape[0], r, e)  # columns of B are rank-major: col = j*E + e
        if form == "tp":
            L, R = b3.permute(2, 0, 1), a3  # (E, out, r), (E, r, in)
        else:
            L, R = a3.transpose(1, 2), b3.permute(2, 1, 0)  # (E, in, r), (E, r, out)
    elif form == "expert_slot":
        return expert_slot_factors([term], [a], [b], stack)
    elif form == "stacked_slot":  # one projection's 3-D stack into its rows of a fused weight; zeros elsewhere
        assert term.slot is not None
        _, part, parts = term.slot
        out = stack[1] // parts
        L = b.new_zeros((stack[0], stack[1], b.shape[2]))
        L[:, part * out : (part + 1) * out] = b
        R = a
    else:
        raise AssertionError(form)
    return L * term.coef, R


def expert_slot_factors(terms: list[Term], a: list[Any], b: list[Any], stack: tuple[int, int, int]) -> tuple[Any, Any]:
    """Numbered experts of one adapter on one fused weight as one stacked term, laid out as PEFT's transformers-5
    conversion lays them: per expert, A of gate and up concatenated along r, B block-diagonal (`(E, 2·out, 2r)`).
    So the merged bits equal those of the adapter converted to fused names (`lorafast.convert`)."""
    import torch

    parts = terms[0].slot[2] if terms[0].slot else 1
    r = a[0].shape[0]
    out = stack[1] // parts
    L = torch.zeros((stack[0], stack[1], parts * r), dtype=b[0].dtype, device=b[0].device)
    R = torch.zeros((stack[0], parts * r, stack[2]), dtype=a[0].dtype, device=a[0].device)
    coefs = {t.coef for t in terms}
    for t, at, bt in zip(terms, a, b, strict=True):
        assert t.slot is not None
        e, part, _ = t.slot
        block = bt if len(coefs) == 1 else bt * t.coef
        L[e, part * out : (part + 1) * out, part * r : (part + 1) * r] = block
        R[e, part * r : (part + 1) * r] = at
    return (L * coefs.pop() if len(coefs) == 1 else L), R


def bias_factors(term: Term, bias: torch.Tensor) -> tuple[Any, Any]:
    import torch

    L = (bias.reshape(1, -1, 1) * term.coef).contiguous()
    R = torch.ones((1, 1, 1), dtype=L.dtype, device=L.device)
    return L, R
