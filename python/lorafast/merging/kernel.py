"""The chunked merge kernel: `W[block] = cast(fp32(W[block]) + L[block] @ R)`, one block at a time.

A block is a run of whole rows of one expert, or a run of whole experts, sized so that the fp32 work buffers fit
in the byte budget: peak extra memory is the budget, whatever the size of the weight. Every term on a weight
was concatenated along the rank beforehand, so a block costs one read of W, one matmul into an fp32 buffer and
one write, with a single rounding to W's dtype at the end. DoRA steps need whole rows (a norm per output row),
which blocks always are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: bytes per fp32 element
_F32 = 4
#: Block size the CPU kernel prefers (cache-sized blocks beat big ones there); the budget still caps it.
CPU_BLOCK_BYTES = 2 << 20
#: Devices where bf16 weights are merged by `run_fused` (one low-precision GEMM per block, fp32 accumulation).
FUSED_DEVICES = {"cuda"}


@dataclass
class Segment:
    """`add`: W += L @ R (all plain terms, concatenated); `dora`: PEFT's DoRA step with magnitude `m`."""

    kind: str
    L: torch.Tensor
    """(E|1, R, k) fp32."""
    R: torch.Tensor
    """(E|1, k, C) fp32."""
    m: torch.Tensor | None = None
    """(R,) fp32 for dora."""
    label: str = ""


class NonFinite(Exception):
    """A merged block holds NaN or Inf."""


Block = tuple[int, int, int, int]

#: Fault-test hook, None in normal use: called as `block_hook(stage, block)` at every stage of every block
#: ("start", "computed", "written"), so a test can raise (KeyboardInterrupt, ...) at an exact point of a merge.
block_hook: Callable[[str, Block], None] | None = None


class Pending:
    """Snapshot-free rollback's guard for the block being written (`snapshot="subtract"`).

    Without a snapshot, a rollback subtracts the delta from the blocks in `done`, so `done` must hold exactly the
    blocks that were written. An interrupt can land between the write and the `done.append`, so the block's
    original bits are kept here (one block, at most the kernel's budget) from just before its write until it is
    recorded in `done`. A rollback first puts `block` back from that copy, bit for bit, written or not.
    """

    def __init__(self) -> None:
        self.block: Block | None = None
        self._buf: torch.Tensor | None = None

    def save(self, block: Block, w: torch.Tensor) -> None:
        import torch

        self.block = None  # first: a copy in progress must never be restored
        buf = self._buf
        if buf is None or buf.numel() < w.numel() or buf.dtype != w.dtype or buf.device != w.device:
            buf = self._buf = torch.empty(w.numel(), dtype=w.dtype, device=w.device)
        buf[: w.numel()].view(w.shape).copy_(w)
        self.block = block  # last: only a complete copy may be restored

    def put_back(self, w3: torch.Tensor) -> None:
        """Write the saved bits back over their block."""
        assert self.block is not None and self._buf is not None
        e0, e1, r0, r1 = self.block
        w = w3[e0:e1, r0:r1]
        w.copy_(self._buf[: w.numel()].view(w.shape))

    def restore(self, w3: torch.Tensor, done: list[Block]) -> None:
        """Put the pending block back (if any) and drop it from `done`, whose blocks are then all written."""
        if self.block is None or self._buf is None:
            return
        self.put_back(w3)
        if done and done[-1] == self.block:
            done.pop()
        self.block = None

    def release(self) -> None:
        self.block = None
        self._buf = None


class Workspace:
    """Work buffers on one device, allocated once at the largest size asked for and reused.

    Buffers are fp32 (fp64 for fp64 weights, whose bits fp32 could not hold). They are byte buffers underneath,
    so switching between the two dtypes does not allocate twice.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: list[torch.Tensor] = []
        self.peak_bytes = 0

    def get(self, numel: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
        import torch

        width = 8 if dtype == torch.float64 else 4
        nbytes = numel * width
        while len(self._bufs) < count:
            self._bufs.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        for i in range(count):
            if self._bufs[i].numel() < nbytes:
                self._bufs[i] = torch.empty(0, dtype=torch.uint8, device=self.device)  # free before growing
                self._bufs[i] = torch.empty(_round_up(nbytes), dtype=torch.uint8, device=self.device)
        self.peak_bytes = max(self.peak_bytes, sum(b.numel() for b in self._bufs))
        return [b[:nbytes].view(dtype) for b in self._bufs[:count]]


def _round_up(n: int) -> int:
    return (n + 63) // 64 * 64


def acc_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for a weight dtype: fp32, or fp64 for fp64 weights."""
    import torch

    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def buffers_needed(segments: list[Segment]) -> int:
    """fp32 buffers per block: the accumulator, plus a delta and the original rows for DoRA."""
    return 3 if any(s.kind == "dora" for s in segments) else 1


def blocks(
    stack: tuple[int, int, int], budget: int, nbuf: int, width: int = _F32
) -> Iterator[tuple[int, int, int, int]]:
    """(e0, e1, r0, r1) blocks of whole rows whose `nbuf` work buffers fit in `budget` bytes (one row at least)."""
    e, rows, cols = stack
    row_bytes = max(1, cols * width * nbuf)
    cap_rows = max(1, budget // row_bytes)
    if cap_rows >= rows:
        step = max(1, cap_rows // max(rows, 1))
        for e0 in range(0, e, step):
            yield e0, min(e, e0 + step), 0, rows
    else:
        for e0 in range(e):
            for r0 in range(0, rows, cap_rows):
                yield e0, e0 + 1, r0, min(rows, r0 + cap_rows)


def _sl(t: torch.Tensor, e0: int, e1: int, r0: int | None = None, r1: int | None = None) -> torch.Tensor:
    """Experts e0:e1 of a factor (broadcasting a shared [1, ...] factor), rows r0:r1 when given."""
    if t.shape[0] == 1 and e1 - e0 != 1:
        t = t.expand(e1 - e0, *t.shape[1:]) if r0 is None else t[:, r0:r1].expand(e1 - e0, -1, -1)
        return t
    t = t[e0:e1] if t.shape[0] != 1 else t
    return t if r0 is None else t[:, r0:r1]


def finite(t: torch.Tensor) -> bool:
    """True when every element is finite: a fast sum first, the exact test only when the sum is not finite."""
    import torch

    acc_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc_dtype))):
        return True
    return bool(torch.isfinite(t).all())


def run(
    w3: torch.Tensor,
    segments: list[Segment],
    *,
    ws: Workspace,
    budget: int,
    sign: float = 1.0,
    snap3: torch.Tensor | None = None,
    safe: bool = True,
    check_before_write: bool = False,
    done: list[Block] | None = None,
    pending: Pending | None = None,
    progress: Callable[[int], None] | None = None,
) -> bool:
    """Merge `segments` into the `(E, R, C)` view `w3` in place, block by block.

    With `snap3`, each block's original bits go there first and the block is appended to `done` before it is
    written, so a caller can restore exactly what was written. Without it, a block is appended to `done` only
    after it was written (a rollback subtracts the delta from those), and `pending` guards the window between the
    write and the append. Returns False when `safe` and a block may have come out non-finite (a cheap range test
    per block; the caller confirms with `finite`). With `check_before_write`, a non-finite block raises
    `NonFinite` before it is written (for modes without a snapshot).
    """
    import torch

    nbuf = buffers_needed(segments)
    stack = tuple(w3.shape)
    adt = acc_dtype(w3.dtype)
    width = 8 if adt == torch.float64 else 4
    flag = torch.zeros((), dtype=torch.bool, device=ws.device) if safe else None
    fmax = torch.finfo(w3.dtype).max
    hook = block_hook
    for block in blocks(stack, budget, nbuf, width):  # type: ignore[arg-type]
        e0, e1, r0, r1 = block
        if hook is not None:
            hook("start", block)
        w = w3[e0:e1, r0:r1]
        if snap3 is not None:
            snap3[e0:e1, r0:r1].copy_(w)
            if done is not None:
                done.append(block)
        ne, nr, cols = e1 - e0, r1 - r0, stack[2]
        bufs = ws.get(ne * nr * cols, nbuf, adt)
        acc = bufs[0].view(ne, nr, cols)
        acc.copy_(w, non_blocking=True)
        w0 = None
        if nbuf == 3:
            w0 = bufs[2].view(ne, nr, cols)
            w0.copy_(acc)
        for seg in segments:
            Lb, Rb = _sl(seg.L, e0, e1, r0, r1), _sl(seg.R, e0, e1)
            if seg.kind == "add":
                if ne == 1:
                    acc[0].addmm_(Lb[0], Rb[0], alpha=sign)
                else:
                    acc.baddbmm_(Lb, Rb, alpha=sign)
            else:  # dora: W' = m / ||W0 + Δ||_row · (W + Δ)
                assert w0 is not None and seg.m is not None
                d = bufs[1].view(ne, nr, cols)
                torch.bmm(Lb, Rb, out=d) if ne != 1 else torch.mm(Lb[0], Rb[0], out=d[0])
                acc.add_(d)
                d.add_(w0)
                norm = torch.linalg.vector_norm(d, dim=-1, keepdim=True)
                acc.mul_(seg.m[r0:r1].view(1, -1, 1) / norm)
        if flag is not None or check_before_write:
            # min and max of the fp32 block in one pass (NaN propagates into both): out of the dtype's range means
            # Inf or NaN after the cast. Cheaper than testing the cast block, and runs before it is written.
            lo, hi = torch.aminmax(acc)
            bad = ~((lo >= -fmax) & (hi <= fmax))
            if check_before_write and bool(bad) and not bool(torch.isfinite(acc.to(w3.dtype)).all()):
                raise NonFinite(block)
            if flag is not None:
                torch.logical_or(flag, bad, out=flag)
        if hook is not None:
            hook("computed", block)
        _write(w, block, w.copy_, (acc,), snap3, done, pending, hook)
        if progress is not None:
            progress(w.numel() * w.element_size())
    return not bool(flag) if flag is not None else True


def _write(
    w: torch.Tensor,
    block: Block,
    write: Callable[..., object],
    args: tuple[object, ...],
    snap3: torch.Tensor | None,
    done: list[Block] | None,
    pending: Pending | None,
    hook: Callable[[str, Block], None] | None,
) -> None:
    """Write one block; without a snapshot, record it in `done` after the write, guarded by `pending`."""
    if snap3 is not None or done is None:
        write(*args)
        if hook is not None:
            hook("written", block)
        return
    if pending is not None:
        pending.save(block, w)
    write(*args)
    if hook is not None:
        hook("written", block)
    done.append(block)
    if pending is not None:
        pending.block = None


def _add_in_place(w: torch.Tensor, segments: list[Segment], block: Block, sign: float) -> None:
    """W[block] += sign · L @ R for every segment, in W's dtype with fp32 accumulation (the fused write)."""
    e0, e1, r0, r1 = block
    for seg in segments:
        Lb, Rb = _sl(seg.L, e0, e1, r0, r1), _sl(seg.R, e0, e1)
        if e1 - e0 == 1:
            w[0].addmm_(Lb[0], Rb[0], alpha=sign)
        else:
            w.baddbmm_(Lb, Rb, alpha=sign)


def _split(x: torch.Tensor, dtype: torch.dtype, parts: int) -> list[torch.Tensor]:
    """`x` (fp32) as a sum of `parts` tensors in `dtype`, most significant first (bf16 x3 holds 24 bits)."""
    out = []
    rest = x
    for _ in range(parts):
        p = rest.to(dtype)
        out.append(p)
        rest = rest - p.float()
    return out


def fused_factors(segments: list[Segment], dtype: torch.dtype) -> list[Segment] | None:
    """The add segments re-expressed for a GEMM in `dtype` (bf16) that keeps fp32's precision in the factors.

    Each fp32 factor is split into three bf16 parts (x = x0 + x1 + x2 to fp32 precision), and
    `L @ R = Σ_{p+q<=2} Lp @ Rq` becomes one product with the rank tripled (R is usually exact in bf16 already,
    as bf16 adapters are) or multiplied by six. The GEMM accumulates in fp32 and rounds W once, so the result is
    the fp32 kernel's, while a merge moves only W's own bytes. None when it does not apply (DoRA steps).
    """
    import torch

    if any(s.kind != "add" for s in segments):
        return None
    out = []
    for s in segments:
        ls = _split(s.L, dtype, 3)
        rs = _split(s.R, dtype, 3)
        if not bool(torch.count_nonzero(rs[1])):
            rs = rs[:1]
        pairs = [(p, q) for p in range(3) for q in range(len(rs)) if p + q <= 2]
        L = torch.cat([ls[p] for p, _ in pairs], dim=2)
        R = torch.cat([rs[q] for _, q in pairs], dim=1)
        out.append(Segment("add", L.contiguous(), R.contiguous(), label=s.label))
    return out


def run_fused(
    w3: torch.Tensor,
    segments: list[Segment],
    *,
    budget: int,
    sign: float = 1.0,
    snap3: torch.Tensor | None = None,
    safe: bool = True,
    done: list[Block] | None = None,
    pending: Pending | None = None,
    progress: Callable[[int], None] | None = None,
) -> bool:
    """`run` for bf16 weights on an accelerator: W[block] += L @ R as one bf16 GEMM with fp32 accumulation and a
    single rounding (`beta = 1` on W itself), so a merge moves W's bytes once instead of through fp32 buffers.
    `segments` come from `fused_factors`. Blocks are bounded by `budget` like the fp32 kernel's."""
    import torch

    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False  # no bf16 partial sums (split-K) inside the GEMM
    try:
        flag = torch.zeros((), dtype=torch.bool, device=w3.device) if safe else None
        stack = tuple(w3.shape)
        hook = block_hook
        for block in blocks(stack, budget, 1, w3.element_size()):  # type: ignore[arg-type]
            e0, e1, r0, r1 = block
            if hook is not None:
                hook("start", block)
            w = w3[e0:e1, r0:r1]
            if snap3 is not None:
                snap3[e0:e1, r0:r1].copy_(w, non_blocking=True)
                if done is not None:
                    done.append(block)
            if hook is not None:
                hook("computed", block)
            _write(w, block, _add_in_place, (w, segments, block, sign), snap3, done, pending, hook)
            if flag is not None:
                lo, hi = torch.aminmax(w)
                torch.logical_or(flag, ~(torch.isfinite(lo) & torch.isfinite(hi)), out=flag)
            if progress is not None:
                progress(w.numel() * w.element_size())
        return not bool(flag) if flag is not None else True
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved
