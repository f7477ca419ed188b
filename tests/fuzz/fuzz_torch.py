"""Differential fuzz harness of the torch `.bin` / `.pt` reader (rust/torch/) against
`torch.load(weights_only=True)`, driven by atheris (libFuzzer).

Each input is a `torch.save` archive taken apart, so that mutations reach the pickle and the storage records
rather than break the zip:

    [flags: 1 byte][data.pkl length: u32 LE][data.pkl][records: ([key length: u8][key][size: u32 LE])*]

The harness writes the zip as torch lays it out: `data.pkl`, `byteorder` (flag bit 0 leaves it out, bit 1 says
"big"), `version` (bit 2 leaves it out; the top 4 bits, when not 0, are the version written instead of 3) and each
`data/<key>` record, `size` bytes (at most 1 MiB) of a pattern that differs per record.

Every case runs `_core.read_torch_header` and `lorafast.inspect` on the file, and fails on:
- an exception that is not documented (`LorafastError`, `OSError`), an `InternalError` (a caught panic), or a
  refusal whose code is not one of `TORCH_ERROR_CODES`; `inspect` must accept or refuse as the reader does;
- lorafast accepting a file that torch refuses, or reading other tensors than torch's (names, dtypes and shapes,
  in order), another count of skipped non-tensor values, or offsets whose bytes are not the tensor's (for
  contiguous tensors);
- a hang (5 s; the input is saved as `hang-<sha1>`) or memory over 10x the file + 64 MiB while lorafast reads it.

Usage: `python tests/fuzz/fuzz_torch.py [libFuzzer flags] [CORPUS_DIR ...]`; `--seeds DIR` writes the seed corpus
(torch.save output of many state dicts, and hand-written pickles of the reader's past defects). Crashers and the inputs
worth keeping are in tests/fuzz-corpus/torch/.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import tempfile
import warnings
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import atheris
import torch
import torch._weights_only_unpickler as _wou

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

# fuzz_python's import instruments lorafast's Python code (as atheris needs it, before anything imports lorafast).
from fuzz_python import (
    DOCUMENTED,
    HANG_SECONDS,
    MEMORY_FACTOR,
    MEMORY_SLACK,
    Finding,
    Watchdog,
    _call,
    _code,
    _core,
    lorafast,
    peak,
    reset_peak,
    write_seeds,
)
from helpers.torch_files import ST_DTYPES, Storage, Tensor, random_state_dict, state_pickle, tensor_bytes, torch_records

# The reader is Rust, which libFuzzer cannot see: torch's own pure-Python reading of the pickle (its
# weights-only unpickler, `torch.load` and the tensor rebuilds) gives the coverage that guides the mutations.
# Only these functions: instrumenting all of torch takes a minute at start-up.
for _fn in (_wou.Unpickler.load, torch.serialization._load, torch.serialization.load, torch.storage.TypedStorage.__init__,
            torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3, torch._utils._rebuild_parameter):  # fmt: skip
    atheris.instrument_func(_fn)

FLAG_NO_BYTEORDER, FLAG_BIG, FLAG_NO_VERSION = 1, 2, 4
MAX_RECORD = 1 << 20
#: Record contents: record `i` is `PATTERN[i % 251 :][:size]`, so two records rarely hold the same bytes.
PATTERN = bytes(range(251)) * (MAX_RECORD // 251 + 2)


# ---------------------------------------------------------------------------------------------------------------
# container


def pack(pkl: bytes, records: dict[str, int], flags: int = 0) -> bytes:
    """The container of a pickle and its records' sizes."""
    out = bytearray([flags]) + struct.pack("<I", len(pkl)) + pkl
    for key, size in records.items():
        k = key.encode()[:255]
        out += bytes([len(k)]) + k + struct.pack("<I", size)
    return bytes(out)


def unpack(data: bytes) -> tuple[int, bytes, list[tuple[str, int]]]:
    """(flags, data.pkl, [(record key, size)]); a cut record is left out."""
    flags = data[0] if data else 0
    (n,) = struct.unpack("<I", data[1:5].ljust(4, b"\0"))
    pkl, rest = data[5 : 5 + n], data[5 + n :]
    records = []
    while rest:
        k = rest[0]
        if len(rest) < 1 + k + 4:
            break
        key = rest[1 : 1 + k].decode("utf-8", "replace")
        (size,) = struct.unpack("<I", rest[1 + k : 5 + k])
        records.append((key, min(size, MAX_RECORD)))
        rest = rest[5 + k :]
    return flags, pkl, records


def write_archive(path: Path, flags: int, pkl: bytes, records: list[tuple[str, int]]) -> None:
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as z:
        warnings.simplefilter("ignore")  # a repeated record name: the reader must refuse it
        z.writestr("archive/data.pkl", pkl)
        if not flags & FLAG_NO_BYTEORDER:
            z.writestr("archive/byteorder", "big" if flags & FLAG_BIG else "little")
        if not flags & FLAG_NO_VERSION:
            z.writestr("archive/version", f"{flags >> 4}\n" if flags >> 4 else "3\n")
        for i, (key, size) in enumerate(records):
            z.writestr(f"archive/data/{key}", PATTERN[i % 251 :][:size])


# ---------------------------------------------------------------------------------------------------------------
# the checks


def check_case(path: Path) -> dict[str, Any] | None:
    """lorafast's reading of `path`: the header it gives, or None when it refuses the file."""
    header = _call("read_torch_header", DOCUMENTED, _core.read_torch_header, str(path))
    adapter = _call("inspect", DOCUMENTED, lorafast.inspect, path)
    if isinstance(header, BaseException):
        if _code(header) not in lorafast.TORCH_ERROR_CODES:
            raise Finding(f"read_torch_header refused with {_code(header)}, not a torch code: {header}")
        if not isinstance(adapter, BaseException) or _code(adapter) != _code(header):
            raise Finding(f"read_torch_header refused ({_code(header)}) but inspect gave {adapter!r}")
        return None
    if isinstance(adapter, BaseException):
        raise Finding(f"read_torch_header accepted but inspect raised {adapter!r}")
    return header


def torch_load(path: Path) -> Any:
    """What torch.load(weights_only=True) gives for `path` on this CPU (storages saved from a GPU are mapped to
    it), or the exception it raised."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        return exc


def compare_with_torch(path: Path, header: dict[str, Any], loaded: Any) -> None:
    """torch.load(weights_only=True) must load what lorafast accepted, with the same tensors."""
    if isinstance(loaded, Exception):
        raise Finding(f"lorafast accepts a file torch.load refuses: {type(loaded).__name__}: {loaded}") from loaded
    if not isinstance(loaded, dict):
        raise Finding(f"lorafast read a state dict, torch.load gives a {type(loaded).__name__}")
    tensors = [(k, t) for k, t in loaded.items() if isinstance(t, torch.Tensor)]
    want = [(k, ST_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for k, t in tensors]
    got = [(name, dtype, tuple(shape)) for name, dtype, shape, _ in header["tensors"]]
    if got != want:
        raise Finding(f"tensors differ: lorafast {got[:8]} vs torch {want[:8]}")
    skipped = len(loaded) - len(tensors)
    said = header["warnings"][0][1] if header["warnings"] else "0 state-dict value(s)"
    if not said.startswith(f"{skipped} state-dict value(s)"):
        raise Finding(f"torch gives {skipped} non-tensor values, lorafast says {said!r}")
    raw = path.read_bytes()
    for (name, t), (_, _, _, (begin, end)) in zip(tensors, header["tensors"], strict=True):
        # torch reads any nonzero byte of a bool tensor as True, and copies it as 1.
        stored = bytes(map(bool, raw[begin:end])) if t.dtype == torch.bool else raw[begin:end]
        if t.numel() and t.is_contiguous() and stored != tensor_bytes(t):
            raise Finding(f"tensor {name!r}: bytes {begin}..{end} are not the tensor's")


class Harness:
    def __init__(self, out_dir: Path) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="lorafast-fuzz-torch-"))
        self.watchdog = Watchdog(HANG_SECONDS, out_dir)
        self.out_dir = out_dir
        self.cases = 0

    def one(self, data: bytes) -> None:
        flags, pkl, records = unpack(data)
        path = self.tmp / f"c{self.cases % 2}.bin"  # alternate names: a case never sees the previous one's file
        self.cases += 1
        write_archive(path, flags, pkl, records)
        base = reset_peak()
        self.watchdog.arm(data)
        try:
            self.check(path, base)
        except Finding:
            # Saved here too: libFuzzer does not always get to write its crash file.
            (self.out_dir / f"finding-{hashlib.sha1(data).hexdigest()}").write_bytes(data)
            raise
        finally:
            self.watchdog.disarm()

    def check(self, path: Path, base: int) -> None:
        header = check_case(path)
        used = peak() - base
        limit = MEMORY_FACTOR * path.stat().st_size + MEMORY_SLACK
        if used > limit:
            raise Finding(f"peak memory rose {used >> 20} MiB for a {path.stat().st_size}-byte file")
        loaded = torch_load(path)  # also for files lorafast refuses: its coverage guides the fuzzer
        if header is not None:
            compare_with_torch(path, header, loaded)


# ---------------------------------------------------------------------------------------------------------------
# seeds


def _saved(state: Any, tmp: Path) -> bytes:
    path = tmp / "seed.pt"
    torch.save(state, path)
    pkl, records, _ = torch_records(path)
    return pack(pkl, {k: len(v) for k, v in records.items()})


def _state_dicts() -> list[Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    mixed: OrderedDict[str, Any] = OrderedDict()
    mixed["f32"] = base
    mixed["transposed"] = base.t()
    mixed["slice"] = base[2:, 3:]
    mixed["every_other"] = base[:, ::2]
    mixed["bf16"] = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    mixed["f16_scalar"] = torch.tensor(3.5, dtype=torch.float16)
    mixed["empty"] = torch.zeros(0, 7)
    mixed["expanded"] = torch.arange(3.0).reshape(3, 1).expand(3, 5)
    mixed["param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    mixed["f8"] = torch.randn(5, generator=g).to(torch.float8_e4m3fn)
    mixed["u16"] = torch.arange(6, dtype=torch.int32).reshape(2, 3).to(torch.uint16)
    mixed._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    peft = {key.format(i, ab): torch.zeros((4, 16) if ab == "A" else (16, 4)) for i in range(3) for ab in "AB"}
    kohya = {"lora_unet_x.lora_down.weight": torch.zeros(4, 8), "lora_unet_x.lora_up.weight": torch.zeros(8, 4),
             "lora_unet_x.alpha": torch.tensor(4.0)}  # fmt: skip
    extras = {"w": torch.ones(2), "step": 7, "name": "x", "nested": {"a": (1, 2.5, None, True)}, "bytes": b"\x00",
              "set": {1, 2}, "device": torch.device("cpu"), "counter": Counter("aab"), "complex": 1 + 2j,
              "bytearray": bytearray(b"xy"), "size": torch.Size([2, 3]), "list": [1, [2]], "layout": torch.strided}  # fmt: skip
    dtypes = {str(dt): torch.ones(3, dtype=dt) for dt in ST_DTYPES}
    return [mixed, peft, kohya, extras, dtypes, {}, *(random_state_dict(seed) for seed in range(6))]


def _hand_written() -> list[bytes]:
    """Pickles of the reader's past defects: a storage declared twice (agreeing, bigger, another dtype), a tensor
    memoized once and listed under many keys."""
    first = Storage(torch.FloatStorage, "0", 64)
    out = []
    for again in (first, Storage(torch.FloatStorage, "0", 4096), Storage(torch.DoubleStorage, "0", 32)):
        state = {"a": Tensor(first, (64,), (1,)), "b": Tensor(again, (again.numel,), (1,))}
        out.append(pack(state_pickle(state), {"0": 256}))
    shared = Tensor(first, (8, 8), (8, 1))
    out.append(pack(state_pickle({f"k{i}": shared for i in range(50)}), {"0": 256}))
    return out


def seed_inputs() -> list[bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        return [_saved(s, Path(tmp)) for s in _state_dicts()] + _hand_written()


def main() -> None:
    if write_seeds(sys.argv, seed_inputs):
        return
    warnings.simplefilter("ignore")  # torch warns about the odd pickles it is given
    harness = Harness(Path(os.environ.get("LORAFAST_FUZZ_OUT", ".")))
    atheris.Setup(sys.argv, harness.one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
