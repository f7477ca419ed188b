"""Shape arithmetic that behaves like the torch calls SGLang makes on loaded LoRA weights.

SGLang normalizes adapter weights with `torch.cat`, `Tensor.repeat` and `torch.zeros_like`. lorafast
predicts the result from header shapes alone, so these helpers return the shape torch would produce, or
raise the exception type and message torch would raise (checked against torch in the tests). A shape of
None means "unknown" (a tensor whose shape the scan did not record) and propagates without raising.
"""

from __future__ import annotations

from collections.abc import Sequence

Shape = tuple[int, ...]


def numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def size_repr(shape: Shape | None) -> str:
    """`str(torch.Size(shape))`, e.g. `torch.Size([1, 8, 4])`."""
    if shape is None:
        return "torch.Size(?)"
    return "torch.Size([" + ", ".join(str(d) for d in shape) + "])"


def _wrap_dim(dim: int, ndim: int) -> int:
    # torch treats a 0-d tensor as having one addressable dimension for wrapping purposes.
    span = max(ndim, 1)
    if not -span <= dim <= span - 1:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-span}, {span - 1}], but got {dim})")
    return dim + span if dim < 0 else dim


def cat(shapes: Sequence[Shape | None], dim: int) -> Shape | None:
    """Shape of `torch.cat(tensors, dim)`, with torch's own errors.

    torch checks, in order: no 0-d inputs; the first input that is not a legacy empty `[0]` tensor sets
    the rank and wraps `dim`; then each later input must have that rank and equal sizes off `dim`.
    """
    if any(s is None for s in shapes):
        return None
    known: list[Shape] = [s for s in shapes if s is not None]
    for pos, s in enumerate(known):
        if len(s) == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {pos}) cannot be concatenated")
    ref_index = next((i for i, s in enumerate(known) if s != (0,)), None)
    if ref_index is None:  # every input is a legacy empty tensor
        return (0,)
    ref = known[ref_index]
    d = _wrap_dim(dim, len(ref))
    total = ref[d]
    for i in range(ref_index + 1, len(known)):
        s = known[i]
        if s == (0,):
            continue
        if len(s) != len(ref):
            raise RuntimeError(f"Tensors must have same number of dimensions: got {len(ref)} and {len(s)}")
        for k in range(len(ref)):
            if k != d and s[k] != ref[k]:
                raise RuntimeError(
                    f"Sizes of tensors must match except in dimension {d}. "
                    f"Expected size {ref[k]} but got size {s[k]} for tensor number {i} in the list."
                )
        total += s[d]
    return ref[:d] + (total,) + ref[d + 1 :]


def repeat(shape: Shape | None, sizes: Sequence[int]) -> Shape | None:
    """Shape of `tensor.repeat(*sizes)`."""
    if shape is None:
        return None
    if len(sizes) < len(shape):
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor")
    padded = (1,) * (len(sizes) - len(shape)) + tuple(shape)
    return tuple(a * b for a, b in zip(padded, sizes, strict=True))


def repeat_along(shape: Shape | None, axis_from_end: int, times: int) -> Shape | None:
    """SGLang's `repeat_dims = [1]*ndim; repeat_dims[ndim-k] = times; w.repeat(*repeat_dims)`."""
    if shape is None:
        return None
    ndim = len(shape)
    sizes = [1] * ndim
    sizes[ndim - axis_from_end] = times  # a negative index wraps, as a Python list does
    return repeat(shape, sizes)
