"""Bit-exact comparison of torch tensors (NaN-safe, -0.0 != 0.0), for the merge and convert tests."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, as integers of its width."""
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def same_bits(a: torch.Tensor | Mapping[str, torch.Tensor], b: torch.Tensor | Mapping[str, torch.Tensor]) -> bool:
    """Two tensors of the same dtype, shape and bits; or two state dicts of the same keys, each one so."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (
            isinstance(a, Mapping)
            and isinstance(b, Mapping)
            and a.keys() == b.keys()
            and all(same_bits(a[k], b[k]) for k in a)
        )
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
