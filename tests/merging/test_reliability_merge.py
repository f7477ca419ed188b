"""Merge under faults: non-finite deltas, a truncated adapter, interrupts at every stage of random
blocks, and two threads merging into one model. After each, the weights must be bit-identical to before.

Factors and weights are small integers here, so every merged value and every subtraction is exact: then even
`snapshot="subtract"`, whose rollback subtracts the delta again, must give back the original bits, and a test
can tell a block that was wrongly subtracted (or never restored) from a lossy rounding.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.bits import same_bits
from lorafast.merging import MergeError, merge
from lorafast.merging import kernel as merge_kernel
from lorafast.testing import write_peft_adapter

MODES = ("cpu", "device", "subtract")
NAMES = ("q_proj", "k_proj", "up_proj", "down_proj")
ROWS, COLS = 12, 8
BLOCK_BYTES = COLS * 4  # one fp32 row per block: many blocks per weight


def weights(dtype: torch.dtype = torch.float16, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{n}.weight": torch.randint(-8, 8, (ROWS, COLS), generator=g).to(device, dtype) for n in NAMES}


#: CPU always; CUDA (device snapshots, the real fused bf16 GEMM) where there is one.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def write_rows_adapter(folder: Path, b_rows: dict[str, torch.Tensor], rank: int = 2) -> Path:
    """A PEFT adapter with A = ones and B given per module, so the delta of row i is rank · B[i]."""
    tensors = {}
    for name, b in b_rows.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.ones(rank, COLS)
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.expand(ROWS, rank).contiguous()
    return Path(write_peft_adapter(folder, tensors, r=rank, lora_alpha=rank, target_modules=sorted(b_rows)))


def int_adapter(folder: Path, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    return write_rows_adapter(folder, {n: torch.randint(-3, 4, (ROWS, 1), generator=g).float() for n in NAMES})


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch):
    """Install a `kernel.block_hook` for one test."""

    def install(fn) -> None:
        monkeypatch.setattr(merge_kernel, "block_hook", fn)

    return install


# ---------------------------------------------------------------------------------------------------------------
# non-finite deltas


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_delta_restores_every_bit_in_every_snapshot_mode(
    tmp_path: Path, mode: str, dtype: torch.dtype, device: str
) -> None:
    # Finite factors whose delta reaches 2.4e38 per rank (4.8e38 in all: Inf even in fp32), in the
    # last row of the last weight, after every other block was written. Subtract mode used to subtract the delta
    # from the block it had refused to write, leaving down_proj all -Inf.
    sd = weights(dtype, device=device)
    before = {k: v.clone() for k, v in sd.items()}
    b = {n: torch.arange(ROWS, dtype=torch.float32).view(-1, 1) for n in NAMES}
    b["down_proj"] = b["down_proj"].clone()
    b["down_proj"][-1] = 2.4e38
    path = write_rows_adapter(tmp_path / "huge", b)
    with pytest.raises(MergeError) as ei:
        merge(sd, path, snapshot=mode, chunk_bytes=BLOCK_BYTES)
    err = ei.value
    assert err.code == "non_finite" and err.module == "down_proj.weight" and err.restored
    assert ("bit for bit" in str(err)) == (mode != "subtract")
    assert same_bits(sd, before)


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_in_the_first_block_leaves_the_weight_untouched(tmp_path: Path, mode: str) -> None:
    sd = weights(torch.float16)
    before = {k: v.clone() for k, v in sd.items()}
    path = write_rows_adapter(tmp_path / "inf", {"q_proj": torch.full((ROWS, 1), 1e5)})  # > fp16 max in every row
    with pytest.raises(MergeError) as ei:
        merge(sd, path, snapshot=mode, chunk_bytes=BLOCK_BYTES)
    assert ei.value.code == "non_finite" and ei.value.restored
    assert same_bits(sd, before)


def test_subtract_rollback_says_when_it_cannot_restore(tmp_path: Path, hook) -> None:
    # safe=False lets an Inf be written; a later failure's rollback cannot subtract it away, and must say so.
    sd = weights(torch.float16)
    path = write_rows_adapter(tmp_path / "unsafe", {n: torch.full((ROWS, 1), 1e5) for n in NAMES})  # Inf in fp16
    calls = {"n": 0}

    def fail_late(stage: str, block: tuple[int, int, int, int]) -> None:
        calls["n"] += stage == "start"
        if calls["n"] == ROWS + 1:  # first block of the second weight
            raise RuntimeError("injected")

    hook(fail_late)
    with pytest.raises(MergeError) as ei:
        merge(sd, path, snapshot="subtract", safe=False, chunk_bytes=BLOCK_BYTES)
    err = ei.value
    assert not err.restored and "NOT restored: 1 weight(s)" in str(err) and "injected" in str(err)
    assert sum(not bool(torch.isfinite(w).all()) for w in sd.values()) == 1


# ---------------------------------------------------------------------------------------------------------------
# adapter truncated mid-merge


@pytest.mark.parametrize("mode", MODES)
def test_adapter_truncated_mid_merge_is_a_read_error_and_restores(tmp_path: Path, mode: str, hook) -> None:
    sd = weights(torch.float32)
    before = {k: v.clone() for k, v in sd.items()}
    path = int_adapter(tmp_path / "a", seed=1)
    weights_file = path / "adapter_model.safetensors"
    size = weights_file.stat().st_size
    calls = {"n": 0}

    def truncate(stage: str, block: tuple[int, int, int, int]) -> None:
        calls["n"] += stage == "start"
        if stage == "start" and calls["n"] == ROWS + 3:  # inside the second weight
            os.truncate(weights_file, size // 2)

    hook(truncate)
    with pytest.raises(MergeError) as ei:
        merge(sd, path, snapshot=mode, chunk_bytes=BLOCK_BYTES)
    assert ei.value.code == "read_error" and ei.value.restored
    assert os.path.getsize(weights_file) == size // 2  # the truncation happened mid-merge
    assert same_bits(sd, before)


# ---------------------------------------------------------------------------------------------------------------
# KeyboardInterrupt at random blocks, at every stage of a block


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_keyboard_interrupt_at_random_blocks_restores_every_bit(
    tmp_path: Path, mode: str, fused: bool, device: str, hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fused: the bf16 GEMM path, also run on CPU here (subtract mode takes it only with safe=False)
    monkeypatch.setattr(merge_kernel, "FUSED_DEVICES", {"cpu", "cuda"} if fused else set())
    dtype = torch.bfloat16 if fused else torch.float16
    safe = not (fused and mode == "subtract")
    path = int_adapter(tmp_path / "a", seed=2)
    counts: dict[str, int] = {}
    hook(lambda stage, block: counts.update({stage: counts.get(stage, 0) + 1}))
    merge(weights(dtype, device=device), path, snapshot=mode, safe=safe, chunk_bytes=BLOCK_BYTES)
    total = counts["start"]
    assert counts == {"start": total, "computed": total, "written": total} and total >= 2 * len(NAMES)
    rng = random.Random(f"{mode}-{fused}")
    for stage in ("start", "computed", "written"):
        for n in [1, total, *rng.sample(range(2, total), 4)]:
            sd = weights(dtype, seed=n, device=device)
            before = {k: v.clone() for k, v in sd.items()}
            seen = {"n": 0, "raised": False}

            def interrupt(at: str, block: object, stage: str = stage, n: int = n, seen: dict = seen) -> None:
                if at == stage and not seen["raised"]:  # (subtract mode's rollback runs the kernel too)
                    seen["n"] += 1
                    if seen["n"] == n:
                        seen["raised"] = True
                        raise KeyboardInterrupt

            hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                merge(sd, path, snapshot=mode, safe=safe, chunk_bytes=BLOCK_BYTES)
            assert seen["raised"]
            assert same_bits(sd, before), (stage, n)
        hook(None)
        sd = weights(dtype, device=device)
        before = {k: v.clone() for k, v in sd.items()}
        merge(sd, path, snapshot=mode, safe=safe, chunk_bytes=BLOCK_BYTES).unmerge()  # still works afterwards
        assert same_bits(sd, before)


def test_interrupted_subtract_unmerge_resumes_on_retry(tmp_path: Path, hook) -> None:
    path = int_adapter(tmp_path / "a", seed=3)
    rng = random.Random(3)
    for stage in ("start", "computed", "written"):
        for n in [1, len(NAMES) * ROWS, *rng.sample(range(2, len(NAMES) * ROWS), 3)]:
            sd = weights(torch.float32, seed=n)
            before = {k: v.clone() for k, v in sd.items()}
            hook(None)
            h = merge(sd, path, snapshot="subtract", chunk_bytes=BLOCK_BYTES)
            seen = {"n": 0}

            def interrupt(at: str, block: object, stage: str = stage, n: int = n, seen: dict = seen) -> None:
                if at == stage:
                    seen["n"] += 1
                    if seen["n"] == n:
                        raise KeyboardInterrupt

            hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                h.unmerge()
            assert h.merged  # not undone yet, and the partial unmerge is not taken for someone else's change
            h.unmerge()  # resumes: no block subtracted twice, none left out
            assert same_bits(sd, before), (stage, n)


def test_interrupted_snapshot_unmerge_resumes_on_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafast.merging.engine import MergeHandle

    sd = weights(torch.float16)
    before = {k: v.clone() for k, v in sd.items()}
    h = merge(sd, int_adapter(tmp_path / "a", seed=4))
    real = MergeHandle._restore
    calls = {"n": 0}

    def restore_then_interrupt(self, r) -> None:
        calls["n"] += 1
        real(self, r)
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(MergeHandle, "_restore", restore_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        h.unmerge()
    assert h.merged and not same_bits(sd, before)
    h.unmerge()
    assert same_bits(sd, before) and not h.merged


# ---------------------------------------------------------------------------------------------------------------
# two threads, one model


@pytest.mark.parametrize("mode", MODES)
def test_two_threads_merging_into_one_model_take_turns(tmp_path: Path, mode: str, hook) -> None:
    # Two threads on one block: without the claims, both read it, wait, and write it back, so one delta is lost.
    sd = weights(torch.float32)
    before = {k: v.clone() for k, v in sd.items()}
    paths = [int_adapter(tmp_path / "a", seed=4), int_adapter(tmp_path / "b", seed=5)]
    expected = {k: v.clone() for k, v in sd.items()}
    merge(expected, paths[0]).commit()
    merge(expected, paths[1]).commit()  # exact integer sums: the same in either order

    hook(lambda stage, block: time.sleep(0.001) if stage == "computed" else None)  # widen the read-write window
    barrier = threading.Barrier(2)
    handles: list = [None, None]
    finished: list[int] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            handles[i] = merge(sd, paths[i], snapshot=mode, chunk_bytes=BLOCK_BYTES)
            finished.append(i)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(finished) == 2
    assert same_bits(sd, expected)  # both deltas, in every weight

    first, second = (handles[i] for i in finished)
    with pytest.raises(MergeError) as ei:  # out of order: the second merge would be silently dropped
        first.unmerge()
    assert ei.value.code == "stale" and not ei.value.restored
    second.unmerge()
    first.unmerge()
    assert same_bits(sd, before)


def test_a_merge_from_inside_a_merge_of_the_same_weights_is_refused(tmp_path: Path) -> None:
    sd = weights(torch.float32)
    before = {k: v.clone() for k, v in sd.items()}
    inner_path = int_adapter(tmp_path / "inner", seed=6)
    caught: list[MergeError] = []

    def progress(done: int, total: int) -> None:
        if not caught:
            with pytest.raises(MergeError) as ei:
                merge(sd, inner_path)
            caught.append(ei.value)

    merge(sd, int_adapter(tmp_path / "outer", seed=7), progress=progress).unmerge()
    assert caught and caught[0].code == "bad_request" and "already running in this thread" in str(caught[0])
    assert same_bits(sd, before)


def test_stacked_merges_unmerge_in_reverse_order_only(tmp_path: Path) -> None:
    sd = weights(torch.float16)
    before = {k: v.clone() for k, v in sd.items()}
    handles = [merge(sd, int_adapter(tmp_path / f"a{i}", seed=10 + i), snapshot="cpu") for i in range(3)]
    with pytest.raises(MergeError, match="reverse order") as ei:
        handles[1].unmerge()
    assert ei.value.code == "stale"
    for h in reversed(handles):
        h.unmerge()
    assert same_bits(sd, before)
