"""Tensor data as numpy arrays of unsigned integers of the element's width: a conversion moves bits, never values.

Every layout conversion is a re-layout (a copy, a repeat, a reshape, a transpose, a row permutation, a concatenation,
zero padding), so it is exact on the bits of any dtype, bf16 and fp8 included, and needs no torch. Values are read
only to report: a kohya `.alpha`, and the max difference in a `lossy` refusal (`max_difference`). numpy reads F64/F32/F16/BF16 and the
integer types; only fp8 values need torch (`as_float64`), and only in those two places.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from lorafast.formats.safetensors import DTYPES, itemsize
from lorafast.tensors import TensorFile, TensorReadError, TruncatedFileError, torch_dtype

if TYPE_CHECKING:
    from numpy.typing import NDArray

#: element width in bytes -> the unsigned type that holds one element's bits
UINT: dict[int, type[np.unsignedinteger[Any]]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: dtypes numpy reads as values (bf16 is widened by hand)
_NUMPY_VALUES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BOOL": np.bool_} | {
    k: np.dtype(v.numpy).type for k, v in DTYPES.items() if k[0] in "IU" and v.numpy
}


def uint(dtype: str) -> type[np.unsignedinteger[Any]]:
    try:
        return UINT[itemsize(dtype)]
    except KeyError:
        raise TensorReadError(f"unsupported tensor dtype {dtype!r}") from None


def array(tf: TensorFile, name: str) -> NDArray[np.unsignedinteger]:
    """Tensor `name`'s bits in its shape, a read-only view of the source map (as `TensorFile.view`, without
    torch): the size is checked against the open file first, the SIGBUS guard `lorafast.tensors` describes."""
    e = tf.entry(name)
    kind = uint(e.dtype)
    if e.numel == 0:
        return np.empty(e.shape, dtype=kind)
    tf.check_size(e.end)
    buf = tf._buffer()  # the file's map, which TensorFile owns and keeps alive
    return np.frombuffer(buf, dtype=kind, count=e.numel, offset=e.begin).reshape(e.shape)


def read_into(tf: TensorFile, name: str, out: NDArray[np.uint8]) -> None:
    """Fill `out` with tensor `name`'s bytes by `preadv`: no map is touched, so a file truncated meanwhile gives
    `TruncatedFileError`, never SIGBUS."""
    e = tf.entry(name)
    view = out.reshape(-1).data  # uint8: one byte per item
    if len(view) != e.end - e.begin:
        raise ValueError(f"{name!r} has {e.end - e.begin} bytes, not {len(view)}")
    done = 0
    while done < len(view):
        n = os.preadv(tf.fileno(), [view[done:]], e.begin + done)
        if n <= 0:
            raise TruncatedFileError(f"{tf.path}: file ended while reading tensor {name!r}", tf.path)
        done += n


def as_float64(bits: NDArray[np.unsignedinteger], dtype: str) -> NDArray[np.float64]:
    """The values that `bits` of `dtype` hold, exactly, as float64 (fp8 through torch, the only use of it)."""
    with np.errstate(invalid="ignore"):  # a NaN stays a NaN, without a warning
        if dtype == "BF16":  # bf16 is the top half of a float32
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if dtype in _NUMPY_VALUES:
            return bits.view(_NUMPY_VALUES[dtype]).astype(np.float64)
    import torch

    return torch.from_numpy(bits.copy()).view(torch_dtype(dtype)).double().numpy()  # a writable copy


def max_difference(a: NDArray[np.unsignedinteger], b: NDArray[np.unsignedinteger], dtype: str) -> float:
    """The largest |a - b| of the values (NaN where a NaN or an infinity is involved)."""
    with np.errstate(invalid="ignore"):
        return float(np.abs(as_float64(a, dtype) - as_float64(b, dtype)).max())


def scalar(tf: TensorFile, name: str) -> float:
    """The value of a one-element tensor (kohya `.alpha`), exactly."""
    bits = array(tf, name)
    if bits.size != 1:
        raise TensorReadError(f"{tf.path}: tensor {name!r} should hold one value, it has {bits.size}", tf.path)
    return float(as_float64(bits.reshape(1), tf.entry(name).dtype)[0])
