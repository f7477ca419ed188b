"""lorafast.compat.sglang._torchlike predicts torch.cat / Tensor.repeat shapes and errors; checked against torch."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from lorafast.compat.sglang import _torchlike as T

shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


def run(fn: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc), str(exc))


@given(st.lists(shapes, min_size=1, max_size=4), st.integers(-4, 3))
def test_cat_matches_torch(inputs: list[tuple[int, ...]], dim: int) -> None:
    expected = run(lambda: tuple(torch.cat([torch.empty(s) for s in inputs], dim).shape))
    assert run(lambda: T.cat(inputs, dim)) == expected


@given(shapes, st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_repeat_matches_torch(shape: tuple[int, ...], sizes: list[int]) -> None:
    expected = run(lambda: tuple(torch.empty(shape).repeat(*sizes).shape))
    assert run(lambda: T.repeat(shape, sizes)) == expected


def test_unknown_shapes_propagate_and_size_repr() -> None:
    assert T.cat([(2, 3), None], 0) is None
    assert T.repeat(None, (2, 1)) is None
    assert T.size_repr((1, 8, 4)) == str(torch.Size([1, 8, 4]))
    assert T.size_repr(()) == str(torch.Size([]))


def test_repeat_along_is_sglangs_list_indexing() -> None:
    # SGLang: reps = [1] * ndim; reps[ndim - 2] = k; w.repeat(*reps). A 1-D tensor wraps to the last axis.
    assert T.repeat_along((3,), 2, 2) == tuple(torch.empty(3).repeat(2).shape)
    assert T.repeat_along((4, 2, 5), 2, 2) == (4, 4, 5)
    assert run(lambda: T.repeat_along((), 2, 2)) == ("error", IndexError, "list assignment index out of range")
