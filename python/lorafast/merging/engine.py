"""`merge(model, requests)`: adapters into live weights, transactionally, with an exact `unmerge`.

Order of work: resolve every module onto a weight from shapes alone (`targets.preflight`; nothing is touched if
that fails), then merge weight by weight. Each weight's original bits are copied to a snapshot block by block
just before the block is written. If anything fails half-way (a NaN, a read error, an interrupt), every block
written so far is restored from its snapshot, so the weights end bit-identical to before, and the `MergeError`
names the module and the adapter. `MergeHandle.unmerge()` restores the snapshots the same way.

`snapshot="subtract"` keeps no snapshot: unmerge (and a failure's rollback) subtract the delta again, which is
lossy by up to an ulp per element but needs no memory beyond the factors and one block's copy. Only blocks that were written are
subtracted; the block being written when a failure struck is put back from a one-block copy (`kernel.Pending`).

Merges and unmerges into the same weights take turns (`claims.py`): a second thread waits for the first.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorafast.errors import HeaderError
from lorafast.merging import claims, kernel
from lorafast.merging.errors import MergeError
from lorafast.merging.sources import Source, normalize
from lorafast.merging.targets import (
    NameIndex,
    Target,
    Term,
    bias_factors,
    expert_slot_factors,
    factors,
    prefixes_used,
    preflight,
)
from lorafast.naming import WeightSpec, stack_shape
from lorafast.tensors import TensorFile, TensorReadError

if TYPE_CHECKING:
    import torch

#: Default bound on the extra working memory of a merge, in bytes (snapshots not counted; see docs/merge.md).
DEFAULT_CHUNK_BYTES = 256 << 20
SNAPSHOT_MODES = ("cpu", "device", "subtract")

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class MergedTerm:
    """One adapter module merged into one weight."""

    adapter: str
    module: str
    strength: float
    coefficient: float
    """Strength × alpha / r (or / √r)."""
    form: str
    """How the factors met the weight: BA, AtBt, stacked, tp, bias, dora, ..."""


@dataclass(frozen=True)
class MergedTarget:
    name: str
    shape: tuple[int, ...]
    dtype: str
    terms: tuple[MergedTerm, ...]


@dataclass
class _Record:
    target: Target
    tensor: Any
    """The Parameter / tensor merged into."""
    view: Any
    """(E, R, C) view of its data."""
    snap: Any
    """Snapshot tensor (E, R, C) or None."""
    done: list[tuple[int, int, int, int]] = field(default_factory=list)
    segments: list[kernel.Segment] | None = None
    """Kept for subtract mode."""
    pending: kernel.Pending | None = None
    """Subtract mode: the block being written, until it is in `done`."""
    undone: int = 0
    """Subtract mode: blocks at the end of `done` already subtracted again."""
    version: int = -1
    """The tensor's version counter right after the merge."""
    start_version: int = -1
    """Its logical version before the merge (see `_logical_version`)."""
    data_ptr: int = 0
    complete: bool = False


class MergeHandle:
    """What `merge()` did, and the means to undo it. Also a context manager that unmerges on exit."""

    def __init__(self, sources: list[Source], snapshot: str, device: str | None, chunk_bytes: int) -> None:
        self.sources = tuple(sources)
        self.snapshot = snapshot
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.merged = False
        self.seconds = 0.0
        self.bytes_merged = 0  # bytes of weights rewritten
        self.peak_workspace_bytes = 0
        #: prefix-only matches taken with allow_prefix=True: adapter, adapter_prefix, base_prefix, modules
        self.prefixes: list[dict[str, Any]] = []
        self._records: list[_Record] = []
        self._budget = chunk_bytes
        self._workspaces: dict[str, kernel.Workspace] = {}

    # -- what was merged ----------------------------------------------------------------------------------------
    @property
    def targets(self) -> tuple[MergedTarget, ...]:
        out = []
        for r in self._records:
            t = r.target
            terms = tuple(
                MergedTerm(x.source.nickname, x.module.name, x.source.strength, x.coef, x.form) for x in t.terms
            )
            out.append(MergedTarget(t.name, tuple(t.spec.shape), str(t.spec.dtype).removeprefix("torch."), terms))
        return tuple(out)

    @property
    def snapshot_bytes(self) -> int:
        return sum(r.snap.numel() * r.snap.element_size() for r in self._records if r.snap is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "merged": self.merged,
            "snapshot": self.snapshot,
            "adapters": [
                {"nickname": s.nickname, "path": s.adapter.path, "strength": s.strength, "alpha": s.alpha}
                for s in self.sources
            ],
            "targets": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "terms": [vars(x) for x in t.terms],
                }
                for t in self.targets
            ],
            "seconds": self.seconds,
            "bytes_merged": self.bytes_merged,
            "peak_workspace_bytes": self.peak_workspace_bytes,
            "snapshot_bytes": self.snapshot_bytes,
        }

    def __repr__(self) -> str:
        state = "merged" if self.merged else "unmerged"
        names = ", ".join(f"{s.nickname}@{s.strength:g}" for s in self.sources)
        return f"<MergeHandle {state}: {names} into {len(self._records)} weights, snapshot={self.snapshot}>"

    def __enter__(self) -> MergeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.merged:
            self.unmerge()

    # -- undo ---------------------------------------------------------------------------------------------------
    def unmerge(self, *, force: bool = False) -> None:
        """Restore every merged weight, bit for bit from the snapshots (or by subtraction in subtract mode).

        Refuses (`MergeError` code "stale", nothing touched) when a weight changed after the merge, since
        restoring would silently drop that change; `force=True` restores anyway. Merges stacked on one weight
        unmerge in reverse order. An unmerge cut short (KeyboardInterrupt) leaves the handle merged; calling
        it again resumes it.
        """
        import torch

        with claims.claimed(r.tensor for r in self._records):
            if not self.merged:
                raise MergeError("this merge is not applied (already unmerged or committed)", "not_merged")
            stale = [r.target.name for r in self._records if _changed(r)]
            if stale and not force:
                raise MergeError(
                    f"weight {stale[0]!r} changed after the merge (or was replaced), so unmerging would drop that "
                    f"change; {len(stale)} weight(s) affected (merges into one model unmerge in reverse order). "
                    "Pass force=True to restore anyway",
                    "stale",
                    module=stale[0],
                    restored=False,
                )
            try:
                with torch.no_grad():
                    self._restore_all()
            except BaseException:
                # Interrupted half-way: the handle stays merged, and the writes so far were ours, not a change
                # made by someone else, so a retry of unmerge() resumes without `force`.
                for r in self._records:
                    r.version = int(r.tensor._version)
                raise
            self.merged = False
            self._records_release()

    def commit(self) -> None:
        """Keep the merged weights and free the snapshots; the merge can no longer be undone."""
        if not self.merged:
            raise MergeError("this merge is not applied (already unmerged or committed)", "not_merged")
        self.merged = False
        self._records_release()

    def _records_release(self) -> None:
        for r in self._records:
            r.snap = None
            r.segments = None
            r.pending = None

    def _restore_all(self) -> None:
        for r in reversed(self._records):
            self._restore(r)
        _mark_restored(self._records)

    def _restore(self, r: _Record) -> None:
        if r.snap is not None:
            if r.complete:
                r.view.copy_(r.snap)
            else:
                for e0, e1, r0, r1 in r.done:
                    r.view[e0:e1, r0:r1].copy_(r.snap[e0:e1, r0:r1])
        elif r.segments is not None:
            if r.pending is not None and not r.complete:
                r.pending.restore(r.view, r.done)  # the block whose write may have been cut short, bit for bit
            self._subtract(r)

    def _subtract(self, r: _Record) -> None:
        """Subtract the delta from the written blocks, last first, so that an interrupted unmerge can resume.

        `r.undone` counts the blocks (from the end of `done`) already subtracted. The block being subtracted keeps
        its merged bits in `guard` until it is counted; a retry puts them back first if it was not.
        """
        assert r.segments is not None
        guard = r.pending = r.pending or kernel.Pending()
        nxt = len(r.done) - 1 - r.undone
        if nxt >= 0 and guard.block == r.done[nxt]:
            guard.put_back(r.view)  # an earlier unmerge stopped inside this block
        guard.block = None
        ws = self._workspace(r.segments[0].L.device)
        for i in range(nxt, -1, -1):
            e0, e1, r0, r1 = block = r.done[i]
            w = r.view[e0:e1, r0:r1]
            guard.save(block, w)
            sub = [slice_segment(s, e0, e1, r0, r1) for s in r.segments]
            kernel.run(w, sub, ws=ws, budget=self._budget, sign=-1.0, safe=False)
            r.undone = len(r.done) - i  # one store: the block counts as subtracted from here on
        guard.release()

    def _workspace(self, device: torch.device) -> kernel.Workspace:
        key = str(device)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = kernel.Workspace(device)
        return ws


def _changed(r: _Record) -> bool:
    t = r.tensor
    same = int(t._version) == r.version or _logical_version(t) == r.version
    return not same or t.data_ptr() != r.data_ptr


# A restore writes the weight, which bumps its version counter, yet it leaves the weight as it was before that
# merge. The tensor remembers this (attribute below), so merges stacked on one weight can be unmerged in reverse
# order without being taken for changes made by someone else.
_RESTORED = "_lorafast_restored"


def _logical_version(t: Any) -> int:
    """The tensor's version counter, or the earlier version it equals when the last write was a restore."""
    v = int(t._version)
    mark = getattr(t, _RESTORED, None)
    return mark[1] if mark is not None and mark[0] == v else v


def _mark_restored(records: list[_Record]) -> None:
    first: dict[int, _Record] = {}
    for r in records:
        if r.done or r.complete:
            first.setdefault(id(r.tensor), r)  # tied weights: the earliest record holds the version before all
    for r in first.values():
        try:
            setattr(r.tensor, _RESTORED, (int(r.tensor._version), r.start_version))
        except AttributeError:  # a tensor type without attributes: unmerging out of order stays "stale"
            pass


def slice_segment(s: kernel.Segment, e0: int, e1: int, r0: int, r1: int) -> kernel.Segment:
    L = s.L[e0:e1, r0:r1] if s.L.shape[0] != 1 else s.L[:, r0:r1]
    R = s.R[e0:e1] if s.R.shape[0] != 1 else s.R
    return kernel.Segment(s.kind, L, R, None if s.m is None else s.m[r0:r1], s.label)


# ---------------------------------------------------------------------------------------------------------------
# The model side


def _is_module(x: Any) -> bool:
    try:
        import torch

        return isinstance(x, torch.nn.Module)
    except ImportError:  # pragma: no cover
        return False


def _module_tensors(model: Any) -> tuple[dict[str, Any], dict[str, WeightSpec]]:
    """Every parameter of a module under every name it has (tied weights appear twice), with its owner's traits."""
    tensors: dict[str, Any] = {}
    specs: dict[str, WeightSpec] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        fifo = type(mod).__name__ == "Conv1D"  # transformers Conv1D stores (in, out); PEFT forces fan_in_fan_out
        transposed = getattr(mod, "is_transposed", None)
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{pname}" if mod_name else pname
            tensors[name] = p
            specs[name] = WeightSpec(
                tuple(p.shape),
                p.dtype,
                p.device.type,
                fan_in_fan_out=fifo and pname == "weight",
                is_transposed=transposed if isinstance(transposed, bool) else None,
            )
    return tensors, specs


def _collect(model: Any) -> tuple[dict[str | None, dict[str, Any]], dict[str | None, NameIndex]]:
    import torch

    if _is_module(model):
        tensors, specs = _module_tensors(model)
        return {None: tensors}, {None: NameIndex(specs)}
    if isinstance(model, Mapping):
        values = list(model.values())
        if values and all(_is_module(v) for v in values):
            all_t: dict[str | None, dict[str, Any]] = {}
            idx: dict[str | None, NameIndex] = {}
            for comp, mod in model.items():
                tensors, specs = _module_tensors(mod)
                all_t[str(comp)] = tensors
                idx[str(comp)] = NameIndex(specs)
            return all_t, idx
        tensors = {str(k): v for k, v in model.items() if isinstance(v, torch.Tensor)}
        specs = {k: WeightSpec(tuple(v.shape), v.dtype, v.device.type) for k, v in tensors.items()}
        return {None: tensors}, {None: NameIndex(specs)}
    raise MergeError(
        f"cannot merge into a {type(model).__name__}: pass a torch.nn.Module, a state dict of tensors, "
        "or a dict of pipeline components",
        "bad_request",
    )


def _as_stack(t: Any) -> Any:
    """The (E, R, C) view of a weight's data, sharing its storage (and version counter)."""
    w = t.detach()
    e, rows, cols = stack_shape(tuple(w.shape))
    if w.dim() == 1:
        return w.unsqueeze(0).unsqueeze(-1)
    if w.dim() == 2:
        return w.unsqueeze(0)
    if w.dim() == 3:
        return w
    if not w.is_contiguous():
        raise MergeError(f"cannot merge into a non-contiguous {w.dim()}-D weight", "unsupported")
    return w.view(e, rows, cols)


# ---------------------------------------------------------------------------------------------------------------
# Factors


class OpenFiles:
    """Adapter weight files opened once per merge."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._open: dict[str, TensorFile] = {}

    def get(self, path: str) -> TensorFile:
        tf = self._open.get(path)
        if tf is None:
            tf = self._stack.enter_context(TensorFile(path))
            self._open[path] = tf
        return tf


def build_segments(
    target: Target, files: OpenFiles, device: torch.device, dtype: torch.dtype, *, safe: bool
) -> list[kernel.Segment]:
    """Load a target's factors (copied out of the maps at once) and group them: consecutive plain terms become
    one `add` segment with the ranks concatenated; each DoRA term is its own step."""
    import torch

    stack = target.stack
    segs: list[kernel.Segment] = []
    Ls: list[torch.Tensor] = []
    Rs: list[torch.Tensor] = []
    labels: list[str] = []

    def flush() -> None:
        if not Ls:
            return
        e = max(x.shape[0] for x in Ls + Rs)
        Lc = torch.cat([x.expand(e, -1, -1) for x in Ls], dim=2) if len(Ls) > 1 else Ls[0]
        Rc = torch.cat([x.expand(e, -1, -1) for x in Rs], dim=1) if len(Rs) > 1 else Rs[0]
        segs.append(kernel.Segment("add", Lc.contiguous(), Rc.contiguous(), label="+".join(labels)))
        Ls.clear()
        Rs.clear()
        labels.clear()

    slots: list[tuple[Term, torch.Tensor, torch.Tensor]] = []  # numbered experts of one adapter, one fused weight

    def flush_slots() -> None:
        if slots:
            L, R = expert_slot_factors(
                [t for t, _, _ in slots], [x for _, x, _ in slots], [y for _, _, y in slots], stack
            )
            Ls.append(L)
            Rs.append(R)
            labels.append(slots[0][0].label + (f" (+{len(slots) - 1} experts)" if len(slots) > 1 else ""))
            slots.clear()

    for term in target.terms:
        if slots and (term.form != "expert_slot" or term.source is not slots[0][0].source):
            flush_slots()
        mod = term.module
        try:
            tf = files.get(mod.weight_file)
            if term.form == "bias":
                assert mod.bias_key is not None
                L, R = bias_factors(term, tf.load(mod.bias_key, device=device, dtype=dtype))
                Ls.append(L)
                Rs.append(R)
                labels.append(term.label)
                continue
            assert mod.a_key is not None and mod.b_key is not None
            a = tf.load(mod.a_key, device=device, dtype=dtype)
            b = tf.load(mod.b_key, device=device, dtype=dtype)
            m = None
            if term.form == "dora":
                assert mod.magnitude_key is not None
                m = tf.load(mod.magnitude_key, device=device, dtype=dtype).reshape(-1)
        except (TensorReadError, HeaderError) as exc:
            raise MergeError(
                f"cannot read {term.label}: {exc}", "read_error", module=mod.name, adapter=term.source.nickname
            ) from exc
        if safe and not (kernel.finite(a) and kernel.finite(b)):
            raise MergeError(
                f"{term.label} has NaN or Inf in its lora_A/lora_B factors; the adapter seems to be broken",
                "non_finite",
                module=mod.name,
                adapter=term.source.nickname,
            )
        if term.form == "expert_slot":
            slots.append((term, a, b))
            continue
        L, R = factors(term, a, b, stack)
        if m is None:
            Ls.append(L)
            Rs.append(R)
            labels.append(term.label)
            continue
        if m.numel() != stack[1]:
            raise MergeError(
                f"{term.label}: DoRA magnitude has {m.numel()} values for {stack[1]} output rows",
                "shape_mismatch",
                module=mod.name,
                adapter=term.source.nickname,
            )
        flush()
        segs.append(kernel.Segment("dora", L.contiguous(), R.contiguous(), m, term.label))
    flush_slots()
    flush()
    return segs


# ---------------------------------------------------------------------------------------------------------------
# merge()


def merge(
    model: Any,
    plan_or_requests: Any,
    *,
    device: str | torch.device | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    safe: bool = True,
    snapshot: str = "cpu",
    progress: ProgressFn | None = None,
    allow_prefix: bool = False,
) -> MergeHandle:
    """Merge adapters into `model`'s weights in place and return a `MergeHandle` that can undo it exactly.

    `model`: a `torch.nn.Module`, a state dict (`dict[str, Tensor]`), or a dict of pipeline components
    (`{"transformer": module, ...}`). Adapter module paths are matched to weight names with PEFT/diffusers/kohya
    prefixes stripped, exactly, by the rule `check` uses (`targets.NameTable.match`). A module found only below
    another prefix (a CausalLM adapter on a Llava-style wrapper's `language_model.model.layers…`) raises
    `MergeError` code `prefix_only`, naming the prefix; `allow_prefix=True` merges it there, and
    `handle.prefixes` (and a warning on the `lorafast.merge` logger) names each prefix so taken. `plan_or_requests`: a `lorafast.Plan`, or a list of `LoraRequest`s,
    `(path, strength)` pairs, paths or `Adapter`s, applied in order.

    Math: W += Σ strength·scale·(B @ A) per weight, accumulated in fp32 and rounded to W's dtype once.
    `device`: where to compute (default: where each weight lives). `chunk_bytes`: bound on the work buffers.
    `safe`: refuse NaN/Inf results. `snapshot`: "cpu" (default) or "device" keep the original bits for an exact
    unmerge; "subtract" keeps none and unmerges by subtracting (lossy).

    Thread safety: merges (and unmerges) into the same weights are serialized; a second thread's merge waits
    for the first and then merges on top of it. Unmerge them in reverse order: unmerging the first while the
    second is still merged raises `MergeError` code "stale".
    """
    if snapshot not in SNAPSHOT_MODES:
        raise MergeError(f"snapshot must be one of {SNAPSHOT_MODES}, not {snapshot!r}", "bad_request")
    if chunk_bytes <= 0:
        raise MergeError(f"chunk_bytes must be positive, not {chunk_bytes}", "bad_request")
    started = time.perf_counter()
    sources = normalize(plan_or_requests)
    tensors, indexes = _collect(model)
    targets = preflight(sources, indexes, allow_dora=snapshot != "subtract", allow_prefix=allow_prefix)
    handle = MergeHandle(sources, snapshot, None if device is None else str(device), chunk_bytes)
    handle.prefixes = prefixes_used(targets)
    total = sum(_nbytes(t.spec) for t in targets)
    done_bytes = [0]

    def tick(n: int) -> None:
        done_bytes[0] += n
        if progress is not None:
            progress(done_bytes[0], total)

    _warn_tied(targets, tensors)
    with claims.claimed(tensors[t.component][t.key] for t in targets):
        _merge_all(handle, targets, tensors, device, safe, tick)
    handle.merged = True
    for r in handle._records:
        r.complete = True
        r.version = int(r.tensor._version)
        r.data_ptr = r.tensor.data_ptr()
        if snapshot != "subtract":
            r.segments = None
    handle.seconds = time.perf_counter() - started
    handle.bytes_merged = total
    handle.peak_workspace_bytes = max((w.peak_bytes for w in handle._workspaces.values()), default=0)
    return handle


def _merge_all(
    handle: MergeHandle,
    targets: list[Target],
    tensors: Mapping[str | None, Mapping[str, Any]],
    device: Any,
    safe: bool,
    tick: Callable[[int], None],
) -> None:
    """Merge every target in order, by the handle's `snapshot` and `chunk_bytes`; on any failure, roll back every
    block written and raise."""
    import torch

    snapshot = handle.snapshot

    current: Target | None = None
    try:
        with ExitStack() as stack, torch.no_grad():
            files = OpenFiles(stack)
            for target in targets:
                current = target
                tensor = tensors[target.component][target.key]
                _apply(handle, target, tensor, files, device, safe, tick)
    except BaseException as exc:
        with torch.no_grad():
            handle._restore_all()
            # Subtraction cannot undo a non-finite write (safe=False): say so instead of claiming a restore.
            broken = (
                []
                if snapshot != "subtract"
                else [r.target.name for r in handle._records if r.done and not kernel.finite(r.view)]
            )
        handle._records_release()
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt & co: weights restored, the interrupt goes on as it was
        raise _wrap(exc, current, snapshot != "subtract", broken) from exc


def _apply(
    handle: MergeHandle,
    target: Target,
    tensor: Any,
    files: OpenFiles,
    device: Any,
    safe: bool,
    tick: Callable[[int], None],
) -> None:
    import torch

    snapshot, chunk_bytes = handle.snapshot, handle.chunk_bytes

    view = _as_stack(tensor)
    dev = torch.device(device) if device is not None else view.device
    adt = kernel.acc_dtype(view.dtype)
    segments = build_segments(target, files, dev, adt, safe=safe)
    snap = None
    if snapshot == "cpu":
        snap = torch.empty(view.shape, dtype=view.dtype, device="cpu")
    elif snapshot == "device":
        snap = torch.empty_like(view)
    record = _Record(target, tensor, view, snap, segments=segments if snapshot == "subtract" else None)
    record.start_version = _logical_version(tensor)
    if snapshot == "subtract":
        record.pending = kernel.Pending()
    handle._records.append(record)
    budget = min(chunk_bytes, kernel.CPU_BLOCK_BYTES) if dev.type == "cpu" else chunk_bytes
    handle._budget = budget
    fused = None
    if (
        dev.type in kernel.FUSED_DEVICES
        and view.device == dev
        and view.dtype == torch.bfloat16
        and not (safe and snapshot == "subtract")  # that mode must test each block before it is written
    ):
        fused = kernel.fused_factors(segments, view.dtype)
    try:
        if fused is not None:
            ok = kernel.run_fused(
                view,
                fused,
                budget=budget,
                snap3=snap,
                safe=safe,
                done=record.done,
                pending=record.pending,
                progress=tick,
            )
        else:
            ok = kernel.run(
                view,
                segments,
                ws=handle._workspace(dev),
                budget=budget,
                snap3=snap,
                safe=safe,
                check_before_write=safe and snapshot == "subtract",
                done=record.done,
                pending=record.pending,
                progress=tick,
            )
        bad = not ok and not kernel.finite(view)  # the per-block test is a cheap range test; confirm exactly
    except kernel.NonFinite:
        bad = True  # caught before the block was written
    if not bad:
        record.complete = True
        record.pending = None  # every block is in `done`; free the one-block copy
        return
    raise MergeError(
        f"NaN or Inf in merged weight {target.name!r} (adapters {', '.join(map(repr, target.adapters))})",
        "non_finite",
        module=target.name,
        adapter=", ".join(target.adapters),
    )


def _wrap(exc: Exception, target: Target | None, exact: bool, broken: list[str] | None = None) -> MergeError:
    how = "restored bit for bit" if exact else "restored by subtraction (subtract mode: not bit-exact)"
    restored = not broken
    if broken:
        how = (
            f"NOT restored: {len(broken)} weight(s), first {broken[0]!r}, hold NaN or Inf that subtraction cannot "
            "undo (safe=False in subtract mode)"
        )
    if isinstance(exc, MergeError):
        if exc.module is None and target is not None:
            exc.module = target.name
        err = MergeError(
            f"{exc.args[0]}; weights {how}",
            exc.code,
            module=exc.module,
            adapter=exc.adapter,
            problems=exc.problems,
            restored=restored,
        )
        return err
    name = target.name if target is not None else None
    adapters = ", ".join(target.adapters) if target is not None else None
    listed = ", ".join(map(repr, target.adapters)) if target is not None else "?"
    return MergeError(
        f"merging into {name!r} (adapters {listed}) failed: {type(exc).__name__}: {exc}; weights {how}",
        "failed",
        module=name,
        adapter=adapters,
        restored=restored,
    )


def _nbytes(spec: WeightSpec) -> int:
    import torch

    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=spec.dtype).element_size()


def _warn_tied(targets: list[Target], tensors: Mapping[str | None, Mapping[str, Any]]) -> None:
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    for t in targets:
        ten = tensors[t.component][t.key]
        key = (ten.data_ptr(), tuple(ten.shape))
        if ten.device.type != "meta" and key in seen:
            warnings.warn(
                f"weights {seen[key]!r} and {t.name!r} are tied (one tensor); both targets are merged into it",
                stacklevel=3,
            )
        seen.setdefault(key, t.name)
