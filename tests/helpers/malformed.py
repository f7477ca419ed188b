"""Writes the malformed-file corpus: at least one file per header rule, named after the code it must give.

Run `python tests/helpers/malformed.py DIR` to write it by hand; the tests call `write_corpus`.
"""

from __future__ import annotations

import json
import os
import struct
import sys

from lorafast.testing import write_raw


def _entry(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None, **extra) -> dict:
    return {"dtype": dtype, "shape": [1] if shape is None else shape, "data_offsets": offsets or [0, 4], **extra}


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


#: file name -> (header bytes, data length, explicit N or None, expected code)
CASES: dict[str, tuple[bytes, int, int | None, str]] = {
    "header_too_large.safetensors": (b"{}", 0, 100_000_001, "header_too_large"),
    "header_too_large_u64max.safetensors": (b"{}", 0, 2**64 - 1, "header_too_large"),
    "invalid_header_length.safetensors": (b"{}", 0, 4096, "invalid_header_length"),
    "invalid_utf8.safetensors": (b'{"\xff\xfe": ' + _json(_entry()) + b"}", 4, None, "invalid_utf8"),
    "invalid_json_truncated.safetensors": (b'{"t": {"dtype": "F32"', 0, None, "invalid_json"),
    "invalid_json_trailing.safetensors": (_json({"t": _entry()}) + b" x", 4, None, "invalid_json"),
    "invalid_json_empty.safetensors": (b"   ", 0, None, "invalid_json"),
    "header_not_object.safetensors": (b"[1, 2]", 0, None, "header_not_object"),
    "invalid_metadata_value.safetensors": (_json({"__metadata__": {"k": 1}}), 0, None, "invalid_metadata"),
    "invalid_metadata_list.safetensors": (_json({"__metadata__": ["k"]}), 0, None, "invalid_metadata"),
    "invalid_tensor_entry_missing.safetensors": (_json({"t": {"dtype": "F32", "shape": [1]}}), 0, None,
                                                  "invalid_tensor_entry"),
    "invalid_tensor_entry_negative.safetensors": (_json({"t": _entry(offsets=[-4, 0])}), 0, None,
                                                   "invalid_tensor_entry"),
    "invalid_tensor_entry_float_shape.safetensors": (b'{"t": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}',
                                                      4, None, "invalid_tensor_entry"),
    "unknown_dtype.safetensors": (_json({"t": _entry(dtype="F128")}), 4, None, "unknown_dtype"),
    "invalid_offset_gap.safetensors": (_json({"t": _entry(offsets=[4, 8])}), 8, None, "invalid_offset"),
    "invalid_offset_overlap.safetensors": (_json({"a": _entry(offsets=[0, 4]), "b": _entry(offsets=[2, 6])}), 6, None,
                                           "invalid_offset"),
    "invalid_offset_reversed.safetensors": (_json({"t": _entry(shape=[0], offsets=[4, 0])}), 4, None,
                                            "invalid_offset"),
    "overflow_shape.safetensors": (_json({"t": _entry(shape=[2**32, 2**32, 2], offsets=[0, 0])}), 0, None, "overflow"),
    "overflow_wraps_to_zero.safetensors": (_json({"t": _entry(dtype="U8", shape=[2**63, 2], offsets=[0, 0])}), 0, None,
                                           "overflow"),
    "misaligned_slice.safetensors": (_json({"t": _entry(dtype="F4", shape=[3], offsets=[0, 1])}), 1, None,
                                     "misaligned_slice"),
    "tensor_size_mismatch.safetensors": (_json({"t": _entry(shape=[2], offsets=[0, 4])}), 4, None,
                                         "tensor_size_mismatch"),
    "incomplete_buffer_polyglot_tail.safetensors": (_json({"t": _entry()}), 4 + 64, None, "incomplete_buffer"),
    "incomplete_buffer_short.safetensors": (_json({"t": _entry(shape=[4], offsets=[0, 16])}), 8, None,
                                            "incomplete_buffer"),
    "duplicate_tensor.safetensors": (b'{"t": ' + _json(_entry(shape=[0], offsets=[0, 0])) + b', "t": '
                                     + _json(_entry(shape=[0], offsets=[0, 0])) + b"}", 0, None, "duplicate_tensor"),
    "duplicate_key.safetensors": (b'{"t": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}', 4,
                                  None, "duplicate_key"),
    "duplicate_metadata.safetensors": (b'{"__metadata__": {}, "__metadata__": {}}', 0, None, "duplicate_key"),
}  # fmt: skip


def write_corpus(directory: str) -> dict[str, str]:
    """Writes every case (plus a 4-byte file) into `directory`; returns file path -> expected code."""
    os.makedirs(directory, exist_ok=True)
    expected = {}
    for name, (header, data_len, n, code) in CASES.items():
        path = os.path.join(directory, name)
        write_raw(path, header, data_len, n)
        expected[path] = code
    tiny = os.path.join(directory, "header_too_small.safetensors")
    with open(tiny, "wb") as f:
        f.write(struct.pack("<I", 7))
    expected[tiny] = "header_too_small"
    return expected


if __name__ == "__main__":
    for path, code in write_corpus(sys.argv[1] if len(sys.argv) > 1 else "malformed").items():
        print(f"{code:24s} {path}")
