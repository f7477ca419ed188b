"""The module-to-weight name rule that `merge`, `check` and `convert` share, and the shape rule of each layout.

`NameTable.match` finds the weight an adapter module path names among a model's weight names: exactly (the
engines' rule), else the one weight with the same path below another prefix. `plan_linear`, `plan_stacked` and
`plan_target_parameters` say in which layout a module's factors meet that weight, from shapes alone. Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lorafast.adapter import LoraModule

_COMPONENT_PREFIXES = ("unet.", "transformer.", "text_encoder_2.", "text_encoder.", "prior.", "decoder.")
_KOHYA_PREFIXES = ("lora_unet_", "lora_te1_", "lora_te2_", "lora_te_", "lora_transformer_", "lora_prior_unet_")


def strip_prefixes(key: str) -> str:
    """A module path without PEFT's `base_model.model.` or a diffusers/kohya component prefix."""
    for p in ("peft_model.base_model.model.", "base_model.model."):
        if key.startswith(p):
            key = key[len(p) :]
            break
    for p in _COMPONENT_PREFIXES + _KOHYA_PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return key.removeprefix("diffusion_model.")


@dataclass(frozen=True)
class WeightSpec:
    """What preflight needs to know about one weight: shape, dtype, device, and its owning module's traits."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"
    fan_in_fan_out: bool = False
    """Owned by a transformers Conv1D (weight stored (in, out))."""
    is_transposed: bool | None = None
    """An experts module's `is_transposed` flag, when it has one."""


def stack_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The `(E, R, C)` view of a weight shape."""
    if len(shape) == 0:
        return (1, 1, 1)
    if len(shape) == 1:
        return (1, shape[0], 1)
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) == 3:
        return (shape[0], shape[1], shape[2])
    c = 1
    for d in shape[1:]:
        c *= d
    return (1, shape[0], c)


@dataclass(frozen=True)
class NameMatch:
    """Where an adapter module path lands among a model's weight names, by the one rule `merge` and `check` share.

    `weight`: the weight the path names exactly (the engines' rule: vLLM, SGLang and PEFT load nothing else).
    Else `prefixed`: the one weight that has the same path below another prefix (`language_model.model.layers.0…`
    for `model.layers.0…`), with `ours` the adapter's prefix and `theirs` the base's in its place ("" for none).
    `ambiguous`: several weights do so equally well. All empty: the base has no such module at all.
    """

    weight: str | None = None
    prefixed: str | None = None
    ours: str = ""
    theirs: str = ""
    ambiguous: tuple[str, ...] = ()

    @property
    def prefix_hint(self) -> str | None:
        """The prefix that would fix a suffix-only match, in words; None when there is none."""
        if self.prefixed is None:
            return None
        ours = f"'{self.ours}.'" if self.ours else "no prefix"
        theirs = f"'{self.theirs}.'" if self.theirs else "no prefix"
        return f"the adapter's paths start with {ours} where the base has {theirs}"


def is_kohya(key: str) -> bool:
    """A module key in kohya's flattened form, matched as such: a kohya key (`lora_unet_down_blocks_0_…`), or a
    path of one component (kohya names kept by a conversion to PEFT: `base_model.model.down_blocks_0_…`)."""
    for p in ("peft_model.base_model.model.", "base_model.model."):
        key = key.removeprefix(p)
    return key.startswith(_KOHYA_PREFIXES) or "." not in strip_prefixes(key)


#: a prefix-only match must agree on at least this many trailing name components (`N.self_attn.q_proj.weight`)
_MIN_TAIL = 4


class NameTable:
    """The weight names of one model (or pipeline component) and the one name rule (`match`) that `merge` and
    `check` both apply to them. Torch-free. `hidden` names are matched exactly but never offered as a prefix-only
    match (check hides stored names that transformers renames on load, so hints name the loaded form)."""

    def __init__(self, names: Iterable[str], hidden: Collection[str] = ()) -> None:
        self.names: Collection[str] = names if isinstance(names, (Mapping, set, frozenset)) else set(names)
        self.hidden = hidden
        self._tails: dict[int, dict[str, list[str]]] = {}
        self._flat: dict[str, dict[str, list[str]]] = {}

    def match(self, path: str, suffix: str, kohya: bool = False) -> NameMatch:
        """`<path><suffix>` among the names. Exact: the path as given, then without PEFT's `base_model.model.`,
        then also without a pipeline component prefix (`strip_prefixes`); a kohya path by its flattened form
        (`down_blocks_0_…` = `down_blocks.0.…` with `_` for `.`). Else prefix-only: the one name that agrees with
        the path on its last components (at least four, or the whole path when shorter) below another prefix:
        the most components in common, then the shortest prefix (a Llava wrapper's `model.language_model.` before
        its `model.vision_tower.encoder.`); a tie is `ambiguous`.
        """
        bare = strip_prefixes(path)
        peft = path
        for pre in ("peft_model.base_model.model.", "base_model.model."):
            peft = peft.removeprefix(pre)
        for p in dict.fromkeys((path, peft, bare)):
            if p + suffix in self.names:
                return NameMatch(p + suffix)
        if kohya:
            return self._match_flat(bare, suffix)
        return self._match_tail(bare, suffix)

    def _match_tail(self, path: str, suffix: str) -> NameMatch:
        name = path + suffix
        parts = name.split(".")
        j = min(_MIN_TAIL, len(parts))
        table = self._tails.get(j)
        if table is None:
            table = {}
            for n in self.names:
                if n not in self.hidden:
                    cp = n.split(".")
                    if len(cp) >= j:
                        table.setdefault(".".join(cp[-j:]), []).append(n)
            self._tails[j] = table
        best: list[str] = []
        best_key = (0, 0)
        best_len = 0
        for c in table.get(".".join(parts[-j:]), ()):
            cp = c.split(".")
            k = 0
            while k < min(len(cp), len(parts)) and cp[-1 - k] == parts[-1 - k]:
                k += 1
            key = (k, -(len(cp) - k))  # the longest common tail, then the shortest prefix in front of it
            if key > best_key or not best:
                best, best_key, best_len = [c], key, k
            elif key == best_key:
                best.append(c)
        if not best:
            return NameMatch()
        if len(best) > 1:
            return NameMatch(ambiguous=tuple(sorted(best)))
        cp = best[0].split(".")
        return NameMatch(None, best[0], ".".join(parts[: len(parts) - best_len]), ".".join(cp[: len(cp) - best_len]))

    def _match_flat(self, path: str, suffix: str) -> NameMatch:
        table = self._flat.get(suffix)
        if table is None:
            table = {}
            for n in self.names:
                if n.endswith(suffix):
                    table.setdefault(n[: len(n) - len(suffix)].replace(".", "_"), []).append(n)
            self._flat[suffix] = table
        flat = path.replace(".", "_")
        hits = table.get(flat, [])
        if len(hits) == 1:
            return NameMatch(hits[0])
        if len(hits) > 1:
            return NameMatch(ambiguous=tuple(sorted(hits)))
        keys = [k for k in table if k.endswith("_" + flat) and not any(n in self.hidden for n in table[k])]
        found = [n for k in keys for n in table[k]]
        if len(found) == 1:  # `<prefix>.<path>` with `_` for `.`: the prefix is as long in the dotted name
            return NameMatch(None, found[0], "", found[0][: len(found[0]) - len(suffix) - len(flat) - 1])
        return NameMatch(ambiguous=tuple(sorted(found))) if found else NameMatch()


def plan_linear(term_kind: str, m: LoraModule, spec: WeightSpec, fifo: bool) -> tuple[str | None, str]:
    """Form for a 2-D-factor module on `spec`, or (None, why)."""
    a, b = m.a_shape or (), m.b_shape or ()
    e, rows, cols = stack_shape(spec.shape)
    if e != 1 or len(spec.shape) < 2:
        return None, f"the weight has shape {list(spec.shape)}, not a matrix"
    r = a[0] if a else 0
    a_cols = prod(a[1:])
    if term_kind == "embedding":
        # PEFT: A (r, num_embeddings), B (embedding_dim, r); weight (num_embeddings, embedding_dim)
        if len(a) == 2 and len(b) == 2 and (a[1], b[0]) == (rows, cols) and b[1] == r:
            return "AtBt", ""
        return None, f"lora_embedding_A {list(a)} and lora_embedding_B {list(b)} do not fit weight {list(spec.shape)}"
    if len(b) > 2 and any(d != 1 for d in b[2:]):
        return None, f"lora_B has a {list(b[2:])} kernel; only 1x1 up-projections are merged"
    b_rows = b[0] if b else 0
    b_r = b[1] if len(b) > 1 else 0
    if b_r != r:
        return None, f"lora_A {list(a)} and lora_B {list(b)} disagree on the rank"
    if term_kind == "conv" and len(spec.shape) != len(a):
        return None, f"conv factors {list(a)} do not fit weight {list(spec.shape)}"
    if term_kind == "conv" and tuple(spec.shape[2:]) != tuple(a[2:]):
        return None, f"lora_A kernel {list(a[2:])} differs from the weight's {list(spec.shape[2:])}"
    if fifo:
        if (a_cols, b_rows) == (rows, cols):
            return "AtBt", ""
        return None, f"lora_A {list(a)} / lora_B {list(b)} do not fit fan_in_fan_out weight {list(spec.shape)}"
    if (b_rows, a_cols) == (rows, cols):
        return "BA", ""
    if (a_cols, b_rows) == (rows, cols) and len(spec.shape) == 2:
        return None, (
            f"lora_A {list(a)} / lora_B {list(b)} fit weight {list(spec.shape)} only transposed; "
            "set fan_in_fan_out=true if the base stores (in, out)"
        )
    return None, f"lora_A {list(a)} / lora_B {list(b)} do not fit weight {list(spec.shape)}"


def plan_stacked(m: LoraModule, spec: WeightSpec) -> tuple[str | None, str]:
    a, b = m.a_shape or (), m.b_shape or ()
    if len(spec.shape) != 3 or len(a) != 3 or len(b) != 3:
        return None, f"stacked factors {list(a)} / {list(b)} need a 3-D expert weight, got {list(spec.shape)}"
    e, d1, d2 = spec.shape
    if a[0] not in (1, e) or b[0] not in (1, e) or a[1] != b[2]:
        return None, f"stacked factors {list(a)} / {list(b)} do not fit {e} experts of weight {list(spec.shape)}"
    fits = (b[1], a[2]) == (d1, d2)
    fits_t = (a[2], b[1]) == (d1, d2)
    if fits and (spec.is_transposed is not True or not fits_t):
        return "stacked", ""
    if fits_t:
        return "stacked_t", ""
    return None, f"stacked factors {list(a)} / {list(b)} do not fit weight {list(spec.shape)}"


def plan_target_parameters(m: LoraModule, spec: WeightSpec) -> tuple[str | None, str, int]:
    """PEFT ParamWrapper: A (r·E, in), B (out, r·E) against a 3-D (E, out, in) weight (or (E, in, out))."""
    a, b = m.a_shape or (), m.b_shape or ()
    if len(spec.shape) != 3 or len(a) != 2 or len(b) != 2:
        return None, f"factors {list(a)} / {list(b)} need a 3-D expert weight, got {list(spec.shape)}", 0
    e, d1, d2 = spec.shape
    if a[0] != b[1] or a[0] % e:
        return None, f"lora_A {list(a)} / lora_B {list(b)} rows are not a multiple of {e} experts", 0
    r = a[0] // e
    fits = (b[0], a[1]) == (d1, d2)  # (E, out, in): PEFT's default, in/out swapped
    fits_t = (a[1], b[0]) == (d1, d2)  # (E, in, out): is_transposed=True
    if fits and (spec.is_transposed is not True or not fits_t):
        return "tp", "", r
    if fits_t:
        return "tp_t", "", r
    return None, f"lora_A {list(a)} / lora_B {list(b)} do not fit expert weight {list(spec.shape)}", r


def prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
