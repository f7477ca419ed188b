"""MoE expert layouts: shared-outer, stacked 3-D, numbered 2-D, PEFT `target_parameters`, transformers-5 names.

Every source is read into the same model: per layer, per projection, one `Factor` for lora_A and one for
lora_B, each a stack of E per-expert matrices (A `(r, in)`, B `(out, r)`) that points into the source map.
Every target layout is then written from that model, so each pair of layouts is one read and one write.

- shared-outer → stacked: the outer factor is repeated along the expert axis (exact).
- stacked → shared-outer: one copy is kept when all experts' outer factors are bit-identical; otherwise
  `lossy`, with the max difference.
- numbered 2-D → stacked: the experts are stacked per projection (3-D `experts.gate_proj`/`up_proj`/`down_proj`,
  rank r), the form SGLang fuses on load exactly as it fuses numbered experts.
- gate and up fused into one `gate_up_proj` (shared-outer, `target_parameters`, transformers 5): as PEFT's
  transformers-5 conversion does (A concatenated along r, B block-diagonal, rank and alpha doubled, so alpha/r stays
  and the delta is the same).
- stacked → numbered 2-D: split along the expert axis; a fused gate_up is split into gate_proj and up_proj
  (both keep the shared A; B's halves).
- `target_parameters` ⇄ stacked: A `(r·E, in)` is expert-major (a reshape); B `(out, r·E)` is rank-major
  (`col = j·E + e`, a permutation).
- GPT-OSS interleaved gate/up: transformers' GPT-OSS keeps `gate_up_proj` with gate and up alternating along the
  output (`[..., ::2]` gate, `[..., 1::2]` up), so a PEFT `target_parameters` adapter made on it has lora_B's rows
  in that order; SGLang takes gate rows then up rows and interleaves them itself for GPT-OSS. Reading such an
  adapter puts B's rows in gate-then-up order, writing one puts them back: a row permutation (exact).
- transformers 4 → 5: numbered `experts.N.w1/w3/w2` (or gate/up/down_proj) become the `target_parameters` keys
  PEFT loads into transformers 5 fused experts (`experts.base_layer` for gate_up, `experts` for down), and
  Mixtral's `block_sparse_moe` becomes `mlp`, as transformers 5 renames it.

Every step moves bits (`bits`: numpy arrays of unsigned integers of the element's width), so none needs torch.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from lorafast.adapter import Adapter, LoraModule, MoeLayout
from lorafast.converting import bits
from lorafast.converting.errors import ConvertError
from lorafast.converting.writer import OutTensor, Part, SourceBytes
from lorafast.formats.moe import SGLANG_W_RENAMES
from lorafast.formats.peft import peft_pattern_value
from lorafast.formats.safetensors import itemsize
from lorafast.tensors import TensorFile

if TYPE_CHECKING:
    from numpy.typing import NDArray

    #: a tensor's bits (`bits.array`)
    Bits = NDArray[np.unsignedinteger]

#: target layouts this module writes
MOE_TARGETS = ("stacked_3d", "shared_outer", "per_expert_2d", "peft_target_parameters", "transformers5")
_NUMBERED = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)$")


@dataclass
class Factor:
    """One LoRA factor of E experts: `stored` matrices (1 when shared by all experts) of `shape`."""

    dtype: str
    experts: int
    stored: int
    shape: tuple[int, int]
    expert: Callable[[int], Bits]  # the 2-D matrix of expert e (a view; maybe not contiguous)
    whole: Callable[[], Part] | None = None  # the bytes of the 3-D [stored, d1, d2] stack in one part
    raw: Callable[[int], SourceBytes] | None = None  # expert e's matrix, when it is a source byte range unchanged
    source: tuple[TensorFile, str] | None = None  # the source tensor whose bytes are that stack, row-major

    def stacked(self) -> Iterator[Part]:
        """The bytes of the full [E, d1, d2] stack, as a sequence of parts."""
        if self.stored == 1 and self.experts > 1:
            one = self.expert(0).copy()  # a private copy, listed E times by the writer: no further copies
            for _ in range(self.experts):
                yield one
        elif self.whole is not None:
            yield self.whole()
        else:
            for e in range(self.experts):
                yield self.raw(e) if self.raw is not None else self.expert(e)

    def matrix(self, e: int) -> Part:
        """Expert e's matrix as one part: a source byte range where it is one."""
        return self.raw(e) if self.raw is not None else self.expert(e)


@dataclass
class Group:
    """One expert projection of one layer: `owner` is the prefix-free path ending in `.experts`."""

    prefix: str  # the file's key prefix (`base_model.model.`)
    owner: str
    proj: str  # gate_up_proj | gate_proj | up_proj | down_proj
    a: Factor
    b: Factor
    rank: int
    alpha: float | None
    rslora: bool

    @property
    def experts(self) -> int:
        return max(self.a.experts, self.b.experts)


def _leaf(name: str) -> str:
    return SGLANG_W_RENAMES.get(name, name)


def _alpha(adapter: Adapter, m: LoraModule, name: str) -> float | None:
    if m.kind != "target_parameters":
        return m.alpha
    cfg = adapter.config or {}  # as the merge engine scales a ParamWrapper: alpha_pattern on the parameter path
    hit = peft_pattern_value(cfg.get("alpha_pattern") or {}, name)
    return float(hit) if hit is not None else (float(cfg["lora_alpha"]) if "lora_alpha" in cfg else m.alpha)


def _whole_factor(tf: TensorFile, key: str, experts: int) -> Factor:
    e = tf.entry(key)
    if len(e.shape) != 3 or e.shape[0] not in (1, experts):
        raise ConvertError(f"{key}: shape {list(e.shape)} is not a stack of {experts} experts", "bad_source", tf.path)
    stored, per = e.shape[0], e.shape[1] * e.shape[2] * itemsize(e.dtype)
    return Factor(
        e.dtype,
        experts,
        stored,
        (e.shape[1], e.shape[2]),
        lambda i: bits.array(tf, key)[i if stored > 1 else 0],
        lambda: SourceBytes(tf, key),
        lambda i: SourceBytes(tf, key, (i if stored > 1 else 0) * per, per),
        (tf, key),
    )


class _Scratch(threading.local):
    """Buffers per thread (the source read, and two for results: one may be in the writer thread's hands),
    reused by every transpose of a conversion: a fresh buffer per tensor costs a zero-filled page fault per
    4 KiB, as much CPU as the copy."""

    bufs: dict[str, np.ndarray]
    turn: int

    def __init__(self) -> None:
        self.bufs = {}
        self.turn = 0

    def next_out(self) -> str:
        """`out0` and `out1` in turn: the writer thread may still be writing the previous result."""
        self.turn ^= 1
        return f"out{self.turn}"

    def get(self, which: str, nbytes: int) -> np.ndarray:
        buf = self.bufs.get(which)
        if buf is None or buf.nbytes < nbytes:
            buf = self.bufs[which] = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]


_SCRATCH = _Scratch()


def release_scratch() -> None:
    """Free this thread's transpose buffers (at the end of a conversion)."""
    _SCRATCH.bufs.clear()


def transposed(tf: TensorFile, key: str, rows: int, cols: int) -> Bits:
    """Source tensor `key` read as a (rows, cols) matrix and returned transposed, (cols, rows), contiguous.

    Read with `preadv` (so the source's pages are not mapped into this process: its RSS stays a few tensors)
    and moved as unsigned integers of the element's width (any dtype, bits unchanged), in blocks of about 256 KiB
    of source rows, which stay in cache (the fastest block here: 3.4 GB per CPU-second for bf16, against 1.6 at
    64 KiB and 2.7 at 2 MiB). The buffers are the thread's scratch: the result is valid until the call after
    next in the same thread; `writer.write_file` has written it by then."""
    e = tf.entry(key)
    nbytes = e.end - e.begin
    raw = _SCRATCH.get("in", nbytes)
    bits.read_into(tf, key, raw)
    src = raw.view(bits.uint(e.dtype)).reshape(rows, cols)
    out = _SCRATCH.get(_SCRATCH.next_out(), nbytes).view(src.dtype).reshape(cols, rows)
    step = max(1, (256 << 10) // max(1, cols * src.itemsize))
    for i in range(0, rows, step):
        np.copyto(out[:, i : i + step], src[i : i + step].T)
    return out


def _named(tf: TensorFile, keys: list[str], i: int) -> Bits:
    return bits.array(tf, keys[i])


def _named_raw(tf: TensorFile, keys: list[str], i: int) -> SourceBytes:
    return SourceBytes(tf, keys[i])


def _tp_a_expert(tf: TensorFile, key: str, e: int, r: int, i: int) -> Bits:
    """Expert i's A of a target_parameters A `(r·E, in)`: rows i·r .. (i+1)·r (expert-major)."""
    return bits.array(tf, key).reshape(e, r, -1)[i]


def _tp_b_expert(tf: TensorFile, key: str, e: int, r: int, i: int) -> Bits:
    """Expert i's B of a target_parameters B `(out, r·E)`: columns j·E + i (rank-major), a strided view."""
    return bits.array(tf, key).reshape(-1, r, e)[:, :, i]


def _rows(tf: TensorFile, key: str, per: int, i: int) -> SourceBytes:
    return SourceBytes(tf, key, i * per, per)


def _one(t: Callable[[], Part]) -> Iterator[Part]:
    yield t()


def _b_expert_major(tf: TensorFile, key: str, out: int, r: int, e: int) -> Bits:
    """target_parameters' B `(out, r·E)`, column `j·E + e`, as the [E, out, r] stack: one 2-D transpose."""
    return transposed(tf, key, out * r, e).reshape(e, out, r)


def read_groups(adapter: Adapter, tf: TensorFile) -> tuple[list[Group], set[str]]:
    """The expert groups of an adapter, and the keys of the modules they cover."""
    groups: list[Group] = []
    covered: set[str] = set()
    numbered: dict[tuple[str, str, str], dict[int, LoraModule]] = {}
    for m in adapter.modules:
        if m.a_key is None or m.b_key is None or m.kind not in ("stacked_3d", "expert_2d", "target_parameters"):
            continue
        prefix = m.key[: m.key.find(m.name.split(".experts")[0])] if ".experts" in m.name else ""
        if m.kind == "expert_2d":
            hit = _NUMBERED.match(m.name)
            if hit is None:
                continue
            numbered.setdefault((prefix, hit.group(1), _leaf(hit.group(3))), {})[int(hit.group(2))] = m
            covered.update((m.a_key, m.b_key))
            continue
        leaf = _leaf(m.leaf)
        owner = m.name[: -len(m.leaf) - 1] if m.name.endswith("." + m.leaf) else m.name
        if not owner.endswith(".experts"):
            continue
        if m.kind == "stacked_3d":
            e = max(m.a_shape[0] if m.a_shape else 1, m.b_shape[0] if m.b_shape else 1)
            a, b = _whole_factor(tf, m.a_key, e), _whole_factor(tf, m.b_key, e)
        else:  # target_parameters: A (r·E, in) expert-major, B (out, r·E) rank-major
            e = m.num_experts or 0
            a_e, b_e = tf.entry(m.a_key), tf.entry(m.b_key)
            if e <= 0 or len(a_e.shape) != 2 or len(b_e.shape) != 2 or a_e.shape[0] % e or b_e.shape[1] != a_e.shape[0]:
                raise ConvertError(
                    f"{m.key}: factors {list(a_e.shape)} / {list(b_e.shape)} are not r·E rows for {e} experts",
                    "bad_source",
                    tf.path,
                )
            r = a_e.shape[0] // e
            out, fin = b_e.shape[0], a_e.shape[1]
            a_key, b_key = m.a_key, m.b_key
            a = Factor(
                a_e.dtype,
                e,
                e,
                (r, fin),
                partial(_tp_a_expert, tf, a_key, e, r),
                partial(SourceBytes, tf, a_key),
                partial(_rows, tf, a_key, r * fin * itemsize(a_e.dtype)),
                (tf, a_key),
            )  # expert-major: a reshape
            b = Factor(
                b_e.dtype,
                e,
                e,
                (out, r),
                partial(_tp_b_expert, tf, b_key, e, r),
                partial(_b_expert_major, tf, b_key, out, r, e),
            )  # rank-major: a transpose
        groups.append(Group(prefix, owner, leaf, a, b, m.rank or a.shape[0], _alpha(adapter, m, m.name), m.use_rslora))
        covered.update((m.a_key, m.b_key))
    for (prefix, owner, leaf), per in numbered.items():
        n = max(per) + 1
        if sorted(per) != list(range(n)):
            missing = sorted(set(range(n)) - set(per))
            raise ConvertError(f"{owner}: experts {missing[:8]} of {leaf} are missing", "bad_source", adapter.path)
        first = per[0]
        for m in per.values():
            if (m.a_shape, m.b_shape, m.dtype, m.alpha, m.rank) != (
                first.a_shape,
                first.b_shape,
                first.dtype,
                first.alpha,
                first.rank,
            ):
                raise ConvertError(
                    f"{m.name}: shape, dtype or scale differs from expert 0, so the experts cannot be stacked",
                    "lossy",
                    adapter.path,
                )
        assert first.a_shape is not None and first.b_shape is not None and first.dtype is not None
        keys_a = [str(per[i].a_key) for i in range(n)]
        keys_b = [str(per[i].b_key) for i in range(n)]
        a = Factor(
            first.dtype,
            n,
            n,
            (first.a_shape[0], first.a_shape[1]),
            partial(_named, tf, keys_a),
            raw=partial(_named_raw, tf, keys_a),
        )
        b = Factor(
            first.dtype,
            n,
            n,
            (first.b_shape[0], first.b_shape[1]),
            partial(_named, tf, keys_b),
            raw=partial(_named_raw, tf, keys_b),
        )
        groups.append(Group(prefix, owner, leaf, a, b, first.rank or 0, first.alpha, first.use_rslora))
    return groups, covered


# ---------------------------------------------------------------------------------------------------------------
# gate/up fusion and splitting


#: `gate_up` values: how a fused gate_up's output rows are ordered in a transformers-layout adapter
GATE_UP_ORDERS = ("concatenated", "interleaved")


def gate_up_order(adapter: Adapter, asked: str | None) -> str:
    """`asked`, else `interleaved` when the adapter's base model is a GPT-OSS (its config says so)."""
    if asked is not None:
        if asked not in GATE_UP_ORDERS:
            raise ConvertError(f"gate_up must be one of {', '.join(GATE_UP_ORDERS)}, not {asked!r}", "unsupported")
        return asked
    base = str((adapter.config or {}).get("base_model_name_or_path") or "").lower().replace("_", "-")
    return "interleaved" if "gpt-oss" in base else "concatenated"


def _deinterleave_rows(x: Bits) -> Bits:
    """(2I, r) rows gate0, up0, gate1, ... -> gate0..gateI-1, up0..upI-1."""
    return x.reshape(-1, 2, x.shape[-1]).swapaxes(0, 1).reshape(x.shape)


def _interleave_rows(x: Bits) -> Bits:
    """(2I, r) rows gate then up -> gate0, up0, gate1, up1, ..."""
    return x.reshape(2, -1, x.shape[-1]).swapaxes(0, 1).reshape(x.shape)


def _reordered(g: Group, fn: Callable[[Bits], Bits], path: str) -> Group:
    if g.proj != "gate_up_proj":
        return g
    b = g.b
    if b.shape[0] % 2:
        raise ConvertError(
            f"{g.owner}.gate_up_proj: lora_B has {b.shape[0]} rows, not gate and up halves", "bad_source", path
        )
    rows = Factor(b.dtype, b.experts, b.stored, b.shape, lambda i: fn(b.expert(i)))
    return Group(g.prefix, g.owner, g.proj, g.a, rows, g.rank, g.alpha, g.rslora)


def deinterleave(groups: list[Group], path: str) -> list[Group]:
    """A GPT-OSS-ordered adapter's groups with every gate_up lora_B in gate-then-up row order."""
    return [_reordered(g, _deinterleave_rows, path) for g in groups]


def interleave(groups: list[Group], path: str) -> list[Group]:
    """Groups with every gate_up lora_B in GPT-OSS's alternating row order."""
    return [_reordered(g, _interleave_rows, path) for g in groups]


def _fuse(gate: Group, up: Group, path: str) -> Group:
    """gate and up into one gate_up_proj, as PEFT's transformers-5 conversion: A concatenated along r, B
    block-diagonal; rank doubles and so does alpha (alpha/r is kept exactly: both are doubled)."""

    def kind(g: Group) -> tuple[object, ...]:
        return g.rank, g.alpha, g.rslora, g.experts, g.a.dtype, g.b.dtype

    if kind(gate) != kind(up):
        raise ConvertError(
            f"{gate.owner}: gate and up have different rank, scale, dtype or expert count; fusing them would change "
            "the scale or the values",
            "lossy",
            path,
        )
    if gate.rslora:
        raise ConvertError(
            f"{gate.owner}: fusing gate and up doubles the rank, and with rsLoRA alpha/sqrt(r) cannot be kept exactly",
            "lossy",
            path,
        )
    r, e = gate.rank, gate.experts
    ga, ua, gb, ub = gate.a, up.a, gate.b, up.b
    a = Factor(
        ga.dtype,
        e,
        1 if ga.stored == ua.stored == 1 else e,
        (2 * r, ga.shape[1]),
        lambda i: np.concatenate([ga.expert(i), ua.expert(i)], 0),
    )
    b = Factor(gb.dtype, e, e, (gb.shape[0] + ub.shape[0], 2 * r), lambda i: _block_diag(gb.expert(i), ub.expert(i)))
    alpha = None if gate.alpha is None else 2 * gate.alpha
    return Group(gate.prefix, gate.owner, "gate_up_proj", a, b, 2 * r, alpha, False)


def _block_diag(x: Bits, y: Bits) -> Bits:
    out = np.zeros((x.shape[0] + y.shape[0], x.shape[1] + y.shape[1]), dtype=x.dtype)  # zero bits: +0.0
    out[: x.shape[0], : x.shape[1]] = x
    out[x.shape[0] :, x.shape[1] :] = y
    return out


def fuse_gate_up(groups: list[Group], path: str) -> list[Group]:
    """Groups with every gate_proj/up_proj pair of one owner fused into gate_up_proj."""
    by = {(g.owner, g.proj): g for g in groups}
    out: list[Group] = []
    for g in groups:
        if g.proj == "up_proj" and (g.owner, "gate_proj") in by:
            continue
        if g.proj == "gate_proj":
            up = by.get((g.owner, "up_proj"))
            if up is None:
                raise ConvertError(
                    f"{g.owner}: gate_proj without up_proj cannot be fused into gate_up_proj", "unsupported", path
                )
            out.append(_fuse(g, up, path))
        elif g.proj == "up_proj":
            raise ConvertError(
                f"{g.owner}: up_proj without gate_proj cannot be fused into gate_up_proj", "unsupported", path
            )
        else:
            out.append(g)
    return out


def pad_rank(groups: list[Group], path: str) -> list[Group]:
    """Every expert group at the largest rank among them, by zero rows of A and zero columns of B (exact), with
    alpha scaled alike. SGLang's MoE buffers take one rank per adapter: after gate/up fusion doubled it, down must
    follow."""
    top = max((g.rank for g in groups), default=0)
    out = []
    for g in groups:
        if g.rank == top or g.rank == 0:
            out.append(g)
            continue
        if g.rslora or top % g.rank:
            raise ConvertError(
                f"{g.owner}.{g.proj}: padding rank {g.rank} to {top} would change its scale", "lossy", path
            )
        a, b, extra = g.a, g.b, top - g.rank

        def a_pad(i: int, a: Factor = a, extra: int = extra) -> Bits:
            x = a.expert(i)
            return np.concatenate([x, np.zeros((extra, x.shape[1]), x.dtype)], 0)

        def b_pad(i: int, b: Factor = b, extra: int = extra) -> Bits:
            x = b.expert(i)
            return np.concatenate([x, np.zeros((x.shape[0], extra), x.dtype)], 1)

        pa = Factor(a.dtype, a.experts, a.stored, (top, a.shape[1]), a_pad)
        pb = Factor(b.dtype, b.experts, b.stored, (b.shape[0], top), b_pad)
        alpha = None if g.alpha is None else g.alpha * (top // g.rank)
        out.append(Group(g.prefix, g.owner, g.proj, pa, pb, top, alpha, g.rslora))
    return out


def split_gate_up(g: Group) -> list[Group]:
    """A fused gate_up_proj as gate_proj and up_proj: both keep A, B is split in halves (exact)."""
    if g.proj != "gate_up_proj":
        return [g]
    half = g.b.shape[0] // 2
    b = g.b
    size = half * b.shape[1] * itemsize(b.dtype)

    def part(lo: int) -> Factor:
        raw = None
        if b.raw is not None:  # B is (out, r) row-major: each half is a byte range of it

            def raw(i: int, lo: int = lo) -> SourceBytes:
                whole = b.raw(i)  # type: ignore[misc]
                return SourceBytes(whole.tf, whole.name, whole.start + (size if lo else 0), size)

        return Factor(b.dtype, b.experts, b.stored, (half, b.shape[1]), lambda i: b.expert(i)[lo : lo + half], raw=raw)

    return [
        Group(g.prefix, g.owner, "gate_proj", g.a, part(0), g.rank, g.alpha, g.rslora),
        Group(g.prefix, g.owner, "up_proj", g.a, part(half), g.rank, g.alpha, g.rslora),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Writers per target layout


@dataclass
class OutModule:
    """A module of the output, for the config: its prefix-free name, rank and alpha."""

    name: str
    leaf: str
    rank: int
    alpha: float | None
    parameter: bool = False  # a target_parameters entry


def _stack_shape(f: Factor) -> tuple[int, int, int]:
    return (f.experts, *f.shape)


def write_stacked(groups: list[Group], shared_outer: bool, path: str) -> tuple[list[OutTensor], list[OutModule]]:
    """Stacked 3-D factors, per projection as the source has them: numbered gate/up become 3-D `experts.gate_proj`
    and `experts.up_proj` at rank r, which SGLang fuses on load as it fuses numbered ones. Shared-outer needs one
    `gate_up_proj` outer factor: gate/up are fused (rank 2r) and the other experts padded to that rank."""
    if shared_outer:
        groups = pad_rank(fuse_gate_up(groups, path), path)
    tensors: list[OutTensor] = []
    mods: list[OutModule] = []
    for g in groups:
        base = f"{g.prefix}{g.owner}.{g.proj}"
        a, b = g.a, g.b
        outer_a = shared_outer and g.proj == "gate_up_proj"
        outer_b = shared_outer and g.proj == "down_proj"
        if outer_a:
            _require_identical(a, f"{base}.lora_A", path)
        if outer_b:
            _require_identical(b, f"{base}.lora_B", path)
        tensors.append(_stack_out(f"{base}.lora_A.weight", a, outer_a))
        tensors.append(_stack_out(f"{base}.lora_B.weight", b, outer_b))
        mods.append(OutModule(f"{g.owner}.{g.proj}", g.proj, g.rank, g.alpha))
    return tensors, mods


def _stack_out(name: str, f: Factor, outer: bool) -> OutTensor:
    if outer:
        return OutTensor(name, f.dtype, (1, *f.shape), partial(_one, partial(f.matrix, 0)))
    return OutTensor(name, f.dtype, _stack_shape(f), f.stacked)


def _require_identical(f: Factor, what: str, path: str) -> None:
    """Shared-outer keeps one copy: every expert's factor must be bit-identical to expert 0's."""
    if f.stored == 1:
        return
    first = f.expert(0)
    worst = 0.0
    for e in range(1, f.experts):
        other = f.expert(e)
        if not np.array_equal(first, other):  # the bits
            worst = max(worst, bits.max_difference(other, first, f.dtype))
            if worst == 0.0:  # same values, different bits (-0.0, NaN payloads): still not a copy
                worst = float("nan")
    if worst != 0.0:
        raise ConvertError(
            f"{what}: the experts' factors are not identical (max difference {worst:.6g}), so one "
            "shared copy would change the adapter",
            "lossy",
            path,
        )


def write_numbered(groups: list[Group]) -> tuple[list[OutTensor], list[OutModule]]:
    tensors: list[OutTensor] = []
    mods: list[OutModule] = []
    for g in [part for whole in groups for part in split_gate_up(whole)]:
        for e in range(g.experts):
            base = f"{g.prefix}{g.owner}.{e}.{g.proj}"
            a, b = g.a, g.b
            tensors.append(OutTensor(f"{base}.lora_A.weight", a.dtype, a.shape, partial(_one, partial(a.matrix, e))))
            tensors.append(OutTensor(f"{base}.lora_B.weight", b.dtype, b.shape, partial(_one, partial(b.matrix, e))))
            mods.append(OutModule(f"{g.owner}.{e}.{g.proj}", g.proj, g.rank, g.alpha))
    return tensors, mods


def write_target_parameters(
    groups: list[Group], path: str, rename: Callable[[str], str] | None = None, interleaved: bool = False
) -> tuple[list[OutTensor], list[OutModule]]:
    """PEFT ParamWrapper keys: gate_up at `experts.base_layer` (the inner wrapper), down at `experts`;
    `interleaved`: gate_up's B rows in GPT-OSS's alternating order."""
    tensors: list[OutTensor] = []
    mods: list[OutModule] = []
    fused = fuse_gate_up(groups, path)
    for g in interleave(fused, path) if interleaved else fused:
        if g.proj not in ("gate_up_proj", "down_proj"):
            raise ConvertError(f"{g.owner}.{g.proj}: target_parameters has no place for {g.proj}", "unsupported", path)
        owner = rename(g.owner) if rename else g.owner
        key = f"{g.prefix}{owner}" + (".base_layer" if g.proj == "gate_up_proj" else "")
        e, (r, fin), (out, _) = g.experts, g.a.shape, g.b.shape
        a, b = g.a, g.b
        tensors.append(OutTensor(f"{key}.lora_A.weight", a.dtype, (r * e, fin), a.stacked))

        def b_cols(b: Factor = b) -> Iterator[Part]:
            if b.source is not None and b.stored == b.experts:  # [E, out, r] -> (out, r, E): col = j·E + e
                yield transposed(b.source[0], b.source[1], b.experts, b.shape[0] * b.shape[1])
            else:
                yield np.stack([b.expert(i) for i in range(b.experts)], axis=2)

        tensors.append(OutTensor(f"{key}.lora_B.weight", b.dtype, (out, r * e), b_cols))
        mods.append(OutModule(f"{owner}.{g.proj}", g.proj, g.rank, g.alpha, parameter=True))
    return tensors, mods


def mixtral_to_v5(owner: str) -> str:
    """transformers 5 renames Mixtral's `block_sparse_moe` to `mlp` (conversion_mapping.py)."""
    return owner.replace(".block_sparse_moe.", ".mlp.")


def source_layout(adapter: Adapter) -> str:
    layout = adapter.moe_layout
    if layout == MoeLayout.MIXED:
        raise ConvertError(
            f"{adapter.path}: the adapter mixes MoE layouts; convert needs one layout per adapter",
            "mixed_layout",
            adapter.path,
        )
    return str(layout.value)
