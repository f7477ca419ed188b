"""`merge_file(base, requests, out)`: a merged checkpoint written from a base checkpoint, streamed.

Shapes and dtypes do not change in a merge, so the output header is known before any data is read: it is
written first, then every tensor in file order. Tensors no adapter touches are copied file to file by the kernel
(`copy_file_range`); targeted ones are read block by block with `preadv` (no map, so a base file truncated
meanwhile gives an error, not SIGBUS), merged by the same kernel as `merge()`, and written out. Peak memory is
one block plus the work buffers, bounded by `chunk_bytes`, whatever the checkpoint size.

The output goes to a temporary file next to `out` and is renamed into place only when everything succeeded, so
a failure leaves no partial checkpoint behind (and never touches an existing `out`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from lorafast.errors import HeaderError
from lorafast.formats.safetensors import encode_header
from lorafast.merging import kernel
from lorafast.merging.engine import DEFAULT_CHUNK_BYTES, OpenFiles, build_segments, slice_segment
from lorafast.merging.errors import MergeError
from lorafast.merging.sources import normalize
from lorafast.merging.targets import NameIndex, Target, prefixes_used, preflight
from lorafast.naming import WeightSpec
from lorafast.tensors import TensorFile, TensorReadError, torch_dtype

ProgressFn = Callable[[int, int], None]


def merge_file(
    base: str | os.PathLike[str],
    plan_or_requests: Any,
    out: str | os.PathLike[str],
    *,
    device: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    safe: bool = True,
    metadata: dict[str, str] | None = None,
    progress: ProgressFn | None = None,
    allow_prefix: bool = False,
) -> dict[str, Any]:
    """Write `out`: the `base` safetensors checkpoint with the adapters merged in. Returns a summary dict.

    The base metadata is kept, plus `lorafast.merged` (JSON: the adapters and strengths) and any `metadata`.
    Names go by the rule `check` uses: a module found only below another prefix raises `MergeError` code
    `prefix_only` unless `allow_prefix=True`; the summary's `prefixes` then names each prefix taken.
    """
    import torch

    if chunk_bytes <= 0:
        raise MergeError(f"chunk_bytes must be positive, not {chunk_bytes}", "bad_request")
    started = time.perf_counter()
    base, out = os.fspath(base), os.fspath(out)
    sources = normalize(plan_or_requests)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    with ExitStack() as stack:
        try:
            tf = stack.enter_context(TensorFile(base))
        except (TensorReadError, HeaderError) as exc:
            raise MergeError(f"cannot read base checkpoint {base}: {exc}", "read_error") from exc
        specs: dict[str, WeightSpec] = {}
        for name, e in tf.tensors.items():
            try:
                specs[name] = WeightSpec(e.shape, torch_dtype(e.dtype))
            except TensorReadError:
                continue  # a dtype torch cannot hold: copied as bytes, never a target
        index = NameIndex(specs, _renamed_on_load(base, tf))
        planned = preflight(sources, {None: index}, allow_prefix=allow_prefix)
        prefixes = prefixes_used(planned)
        targets = {t.key: t for t in planned}
        order = sorted(tf.tensors.values(), key=lambda e: e.begin)
        header, data_len = _header(order, tf.metadata, sources, metadata)
        total = data_len
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        out_dir = os.path.dirname(os.path.abspath(out))
        fd, tmp = tempfile.mkstemp(prefix=".lorafast-merge-", suffix=".tmp", dir=out_dir)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                f.write(header)
                files = OpenFiles(stack)
                ws = kernel.Workspace(dev)
                budget = min(chunk_bytes, kernel.CPU_BLOCK_BYTES) if dev.type == "cpu" else chunk_bytes
                for e in order:
                    t = targets.get(e.name)
                    if t is None:
                        try:
                            tf.copy_range_to(e.name, f.fileno())
                        except TensorReadError as exc:
                            raise MergeError(f"cannot copy tensor {e.name!r}: {exc}", "read_error") from exc
                        tick(e.end - e.begin)
                    else:
                        _merge_tensor(tf, t, f.fileno(), files, dev, ws, budget, safe, tick)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
    return {
        "out": out,
        "base": base,
        "adapters": [{"nickname": s.nickname, "path": s.adapter.path, "strength": s.strength} for s in sources],
        "tensors": len(order),
        "targets": len(targets),
        "terms": sum(len(t.terms) for t in targets.values()),
        "bytes": total,
        "seconds": time.perf_counter() - started,
        "peak_workspace_bytes": ws.peak_bytes,
        "prefixes": prefixes,
    }


def _renamed_on_load(base: str, tf: TensorFile) -> dict[str, str]:
    """Loaded name -> stored name for this file's weights, as `check` (`read_base`) sees the file: by the
    `config.json` beside it (a Llava-style wrapper's `language_model.model.` is `model.language_model.` once
    loaded). No config, or one that cannot be read: none, and names go by the stored names alone."""
    from lorafast.base import BaseModelError, LocalFiles, Weight, optional_json, renamed_on_load

    try:
        config = optional_json(LocalFiles(os.path.dirname(os.path.abspath(base))), "config.json")
    except (BaseModelError, OSError):
        return {}
    if not config:
        return {}
    return renamed_on_load({n: Weight(str(e.dtype), tuple(e.shape), base) for n, e in tf.tensors.items()}, config)


def _header(
    order: list[Any], base_meta: dict[str, str], sources: list[Any], extra: dict[str, str] | None
) -> tuple[bytes, int]:
    """The output header: the same tensors in the same order, packed offsets, metadata plus provenance."""
    meta = dict(base_meta)
    meta["lorafast.merged"] = json.dumps(
        [{"adapter": s.nickname, "path": s.adapter.path, "strength": s.strength} for s in sources]
    )
    meta.update(extra or {})
    return encode_header(((e.name, e.dtype, e.shape, e.end - e.begin) for e in order), meta)


def _merge_tensor(
    tf: TensorFile,
    t: Target,
    out_fd: int,
    files: OpenFiles,
    dev: Any,
    ws: kernel.Workspace,
    budget: int,
    safe: bool,
    tick: Callable[[int], None],
) -> None:
    import torch

    dtype = t.spec.dtype
    adt = kernel.acc_dtype(dtype)
    segments = build_segments(t, files, dev, adt, safe=safe)
    stack = t.stack
    nbuf = kernel.buffers_needed(segments) + 1  # + the staging block
    width = 8 if adt == torch.float64 else 4
    staging = torch.empty(0, dtype=dtype)
    for e0, e1, r0, r1 in kernel.blocks(stack, budget, nbuf, width):
        ne, nr, cols = e1 - e0, r1 - r0, stack[2]
        if staging.numel() < ne * nr * cols:
            staging = torch.empty(ne * nr * cols, dtype=dtype)
        block = staging[: ne * nr * cols].view(ne, nr, cols)
        try:
            tf.read_into(t.key, block, start=(e0 * stack[1] + r0) * cols)
        except TensorReadError as exc:
            raise MergeError(f"cannot read base tensor {t.key!r}: {exc}", "read_error", module=t.key) from exc
        sub = [slice_segment(s, e0, e1, r0, r1) for s in segments]
        work = block if dev.type == "cpu" else block.to(dev, non_blocking=True)
        ok = kernel.run(work, sub, ws=ws, budget=budget, safe=safe)
        if work is not block:
            block.copy_(work)
        if safe and not ok and not kernel.finite(block):
            raise MergeError(
                f"NaN or Inf in merged tensor {t.key!r} (adapters {', '.join(map(repr, t.adapters))}); "
                "no output was written",
                "non_finite",
                module=t.key,
                adapter=", ".join(t.adapters),
            )
        _write_all(out_fd, block.reshape(-1).view(torch.uint8).numpy().data)
        tick(block.numel() * block.element_size())


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]
