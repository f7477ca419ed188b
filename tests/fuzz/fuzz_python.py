"""Fuzz harness for lorafast's Python surface, driven by atheris (libFuzzer).

Each input is a small container that becomes an adapter on disk:

    [flags: 1 byte][config length: u16 LE][adapter_config.json bytes][header length: u32 LE][header JSON][data]

The harness writes the safetensors file as `u64 length + header + data`, so mutations of the JSON keep a valid
length prefix; flag bit 1 ("raw") writes the bytes after the config verbatim instead, to reach the length and
size rules. Flag bit 0 makes a PEFT folder (the config as `adapter_config.json`); otherwise the file stands alone.

Every case runs `read_header` (pread and mmap), `inspect`, `scan`, `inspect_many`, `compat.sglang.preflight` and
`compat.vllm.preflight` (collect=True), `compat.diffusion` checks, `plan` and `plan_groups`, and fails on:
- an exception that is not documented: lorafast's own (but never `InternalError`, a caught panic), `OSError`,
  `ValueError`, `TypeError`, and for the engine checks the exceptions the engines raise;
- a disagreement: the scan row must equal a fresh `inspect` of the same file (field by field, or the same error
  code), pread and mmap must agree, and a header `read_header` rejects must be rejected by `inspect` too;
- a hang: a case over 5 s (a watchdog thread saves the input to `hang-<sha1>` and ends the process);
- memory: a case whose peak RSS rises more than 10x the file size + 64 MiB (Linux `clear_refs` resets the peak).

Usage: `python tests/fuzz/fuzz_python.py [libFuzzer flags] [CORPUS_DIR ...]`, e.g. `-max_total_time=600 -seed=1`.
`python tests/fuzz/fuzz_python.py --seeds DIR` writes the seed corpus (fixtures + `lorafast sample` output) to DIR.
Crashers and interesting inputs are kept in tests/fuzz-corpus/python/.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["lorafast"]):
    import lorafast
    import lorafast.groups
    import lorafast.header
    import lorafast.planner
    import lorafast.scanning
    from lorafast import _core
    from lorafast.compat import diffusion, sglang, vllm
    from lorafast.errors import InternalError, LorafastError

HANG_SECONDS = 5.0
MEMORY_FACTOR, MEMORY_SLACK = 10, 64 << 20
#: Exceptions the lorafast API documents.
DOCUMENTED = (LorafastError, OSError, ValueError, TypeError)
#: What the engines raise for a bad adapter (SGLang, vLLM and diffusers checks re-raise their messages as these).
ENGINE = (*DOCUMENTED, RuntimeError, AssertionError, NotImplementedError, KeyError)
#: Fields a scan row and a fresh inspect share.
SHARED = ("path", "weight_files", "config_path", "config_json", "format", "peft_type", "num_tensors", "dtypes",
          "layers", "base_model_name_or_path", "target_modules", "rank", "moe_layout", "num_experts", "flags",
          "variants", "full_weight_tensors", "problems", "header_size", "file_size")  # fmt: skip

FLAG_CONFIG, FLAG_RAW, FLAG_HASH = 1, 2, 4


class Finding(Exception):
    """A harness check failed: libFuzzer saves the input as a crash."""


# ---------------------------------------------------------------------------------------------------------------
# container


def pack(config: bytes | None, file_bytes: bytes, *, raw: bool = False) -> bytes:
    """The container for a config (None: bare file) and a safetensors file."""
    flags = (FLAG_CONFIG if config is not None else 0) | (FLAG_RAW if raw else 0)
    cfg = config or b""
    out = bytes([flags]) + struct.pack("<H", len(cfg)) + cfg
    if raw:
        return out + file_bytes
    (n,) = struct.unpack("<Q", file_bytes[:8])
    return out + struct.pack("<I", n) + file_bytes[8:]


def unpack(data: bytes) -> tuple[int, bytes | None, bytes]:
    """(flags, config or None, safetensors file bytes)."""
    if len(data) < 3:
        return 0, None, data
    flags = data[0]
    (clen,) = struct.unpack("<H", data[1:3])
    config = data[3 : 3 + clen] if flags & FLAG_CONFIG else None
    rest = data[3 + clen :] if flags & FLAG_CONFIG else data[3:]
    if flags & FLAG_RAW or len(rest) < 4:
        return flags, config, rest
    (hlen,) = struct.unpack("<I", rest[:4])
    header = rest[4 : 4 + hlen]
    data = rest[4 + hlen :]
    return flags, config, struct.pack("<Q", len(header)) + header + data + bytes(_missing(header, len(data)))


def _missing(header: bytes, have: int) -> int:
    """Zero bytes to add so the data section is as long as the header says (up to 16 MiB): seeds keep only the
    start of their data, and a mutated shape still gives a complete file."""
    try:
        entries = json.loads(header)
        end = max(
            (v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__" and isinstance(v, dict)),
            default=0,
        )
    except Exception:  # not JSON, or not the usual shape: the file stays as it is
        return 0
    return end - have if isinstance(end, int) and have < end <= 16 << 20 else 0


# ---------------------------------------------------------------------------------------------------------------
# watchdog and memory


class Watchdog:
    """One thread for the whole run: if a case passes its deadline, save the input and end the process. (The core
    releases the GIL while it reads, so this thread runs even when a read blocks.)"""

    def __init__(self, seconds: float, out_dir: Path) -> None:
        self.seconds = seconds
        self.out_dir = out_dir
        self.deadline = 0.0
        self.data = b""
        threading.Thread(target=self._watch, daemon=True, name="fuzz-watchdog").start()

    def arm(self, data: bytes) -> None:
        self.data = data
        self.deadline = time.monotonic() + self.seconds

    def disarm(self) -> None:
        self.deadline = 0.0

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            if self.deadline and time.monotonic() > self.deadline:
                name = self.out_dir / f"hang-{hashlib.sha1(self.data).hexdigest()}"
                name.write_bytes(self.data)
                sys.stderr.write(f"\nfuzz_python: case ran over {self.seconds} s; input saved to {name}\n")
                sys.stderr.flush()
                os._exit(70)


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def reset_peak() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS; returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return _status_kib("VmRSS:") << 10


def peak() -> int:
    return _status_kib("VmHWM:") << 10


# ---------------------------------------------------------------------------------------------------------------
# the checks


def _code(exc: BaseException) -> str:
    return getattr(exc, "code", None) or type(exc).__name__


def _call(what: str, allowed: tuple[type[BaseException], ...], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(...) -> result, or the exception when it is an allowed one; anything else is a finding."""
    try:
        return fn(*args, **kwargs)
    except InternalError as exc:
        raise Finding(f"{what}: internal error (a panic in the core): {exc}") from exc
    except allowed as exc:
        return exc
    except BaseException as exc:  # a PanicException is a BaseException
        raise Finding(f"{what}: undocumented {type(exc).__name__}: {exc}") from exc


def _row(report: Any, i: int) -> dict[str, Any] | None:
    r = report._result.record(i)
    return None if r is None else {k: r[k] for k in SHARED}


def check_case(target: str, file_bytes: bytes, flags: int) -> None:
    is_err = lambda x: isinstance(x, BaseException)  # noqa: E731
    weights = target if not flags & FLAG_CONFIG else os.path.join(target, "adapter_model.safetensors")

    # read_header: pread and mmap agree
    h1 = _call("read_header(pread)", DOCUMENTED, lorafast.read_header, weights)
    h2 = _call("read_header(mmap)", DOCUMENTED, lorafast.read_header, weights, mode="mmap")
    if is_err(h1) != is_err(h2) or (is_err(h1) and _code(h1) != _code(h2)) or (not is_err(h1) and h1 != h2):
        raise Finding(f"read_header pread/mmap disagree: {h1!r} vs {h2!r}")

    # inspect, and the scan row against a fresh inspect
    hashing = bool(flags & FLAG_HASH)
    adapter = _call("inspect", DOCUMENTED, lorafast.inspect, target, content_hash=hashing)
    fresh = _call("_core.inspect", DOCUMENTED, _core.inspect, target)
    if is_err(h1) and not is_err(adapter) and getattr(h1, "code", None) is not None:
        raise Finding(f"read_header rejects ({_code(h1)}) but inspect accepts")
    report = _call("scan", DOCUMENTED, lorafast.scan, [target], progress=False, content_hash=hashing)
    if is_err(report):
        raise Finding(f"scan raised {report!r} for one path (errors must be rows)")
    if len(report) != 1:
        raise Finding(f"scan gave {len(report)} rows for one adapter")
    if is_err(adapter):
        codes = [c for _, c, _ in report.errors]
        if codes != [_code(adapter)] and not (isinstance(adapter, OSError) and len(codes) == 1):
            raise Finding(f"inspect failed with {_code(adapter)} but the scan row has {codes}")
    else:
        if report.errors:
            raise Finding(f"inspect succeeded but the scan row failed: {report.errors}")
        if not is_err(fresh) and _row(report, 0) != {k: fresh[k] for k in SHARED}:
            raise Finding(f"scan row != fresh inspect: {_row(report, 0)} vs { {k: fresh[k] for k in SHARED} }")
        (listed,) = _call("inspect_many", DOCUMENTED, lorafast.inspect_many, [target], content_hash=hashing)
        if listed != adapter:
            raise Finding("inspect_many differs from inspect")
        check_consumers(target, adapter)


def check_consumers(target: str, adapter: Any) -> None:
    """The engine checks and the planners on an adapter that inspect accepted."""
    for name, fn in (("sglang.preflight", sglang.preflight), ("vllm.preflight", vllm.preflight)):
        _call(name, DOCUMENTED, fn, [adapter], collect=True)
    _call("diffusion.detect_lora_format", ENGINE, diffusion.detect_lora_format, adapter)
    _call("diffusion.check_peft_config", ENGINE, diffusion.check_peft_config, adapter)
    _call("diffusion.validate_peft_features", ENGINE, diffusion.validate_peft_features, adapter)
    _call("plan", DOCUMENTED, lorafast.plan, [lorafast.LoraRequest("x", target, 0.7)], adapters=[adapter])
    _call("plan_groups", DOCUMENTED, lorafast.plan_groups, [adapter])


class Harness:
    def __init__(self, out_dir: Path) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="lorafast-fuzz-"))
        self.watchdog = Watchdog(HANG_SECONDS, out_dir)
        self.cases = 0

    def one(self, data: bytes) -> None:
        flags, config, file_bytes = unpack(data)
        case = self.tmp / f"c{self.cases % 2}"  # alternate folders: a case never sees the previous one's files
        self.cases += 1
        _clear(case)
        if config is not None:
            case.mkdir()
            (case / "adapter_config.json").write_bytes(config)
            (case / "adapter_model.safetensors").write_bytes(file_bytes)
            target = str(case)
        else:
            case.mkdir()
            target = str(case / "adapter.safetensors")
            Path(target).write_bytes(file_bytes)
        base = reset_peak()
        self.watchdog.arm(data)
        try:
            check_case(target, file_bytes, flags)
        finally:
            self.watchdog.disarm()
        used = peak() - base
        limit = MEMORY_FACTOR * (len(file_bytes) + len(config or b"")) + MEMORY_SLACK
        if used > limit:
            raise Finding(f"peak memory rose {used >> 20} MiB for a {len(file_bytes)}-byte file (limit {limit >> 20})")


def _clear(case: Path) -> None:
    if case.exists():
        for p in case.iterdir():
            p.unlink()
        case.rmdir()


# ---------------------------------------------------------------------------------------------------------------
# seeds


def _file(tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file of zeros: name -> (dtype, shape)."""
    width = {"F16": 2, "BF16": 2, "F32": 4}
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = width[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(offset)


def regression_inputs() -> list[bytes]:
    """Inputs that once broke the Python surface: 0-d factors on `experts` modules, a layer index past any model,
    config fields of the wrong type, and a header of 5,000 metadata keys."""
    experts = "base_model.model.model.layers.0.mlp.experts"
    peft = json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["experts"]}).encode()
    far = "base_model.model.model.layers.999999999.self_attn.q_proj"
    return [
        pack(peft, _file({f"{experts}.lora_A.weight": ("F16", []), f"{experts}.lora_B.weight": ("F16", [4, 8, 2])})),
        pack(peft, _file({f"{experts}.lora_A.weight": ("F16", [4, 2, 8]), f"{experts}.lora_B.weight": ("F16", [])})),
        pack(None, _file({f"{far}.lora_A.weight": ("F16", [2, 8]), f"{far}.lora_B.weight": ("F16", [8, 2])})),
        pack(
            json.dumps({"peft_type": "LORA", "r": "8", "lora_alpha": "x", "target_modules": 7}).encode(),
            _file({f"{far}.lora_A.weight": ("F16", [2, 8]), f"{far}.lora_B.weight": ("F16", [8, 2])}),
        ),
        pack(None, _file({"a.lora_A.weight": ("F16", [2, 8])}, {f"k{i}": "v" for i in range(5000)})),
    ]


def seed_inputs() -> list[bytes]:
    """Containers made from tests/fixtures/real, a few `lorafast sample` adapters of every kind, and the
    regression inputs."""
    from lorafast.sample import write_samples

    out = regression_inputs()
    roots = [Path(__file__).resolve().parents[1] / "fixtures" / "real"]
    with tempfile.TemporaryDirectory() as tmp:
        write_samples(tmp, 40, seed=7)
        roots.append(Path(tmp))
        for root in roots:
            for st in sorted(root.rglob("*.safetensors")):
                cfg_path = st.parent / "adapter_config.json"
                config = cfg_path.read_bytes() if cfg_path.exists() and st.name == "adapter_model.safetensors" else None
                body = st.read_bytes()
                container = pack(config, body)
                # Keep the corpus small: the data is zero-filled back to its length (`_missing`), but its first
                # bytes stay (kohya alphas come early in small files).
                out.append(container[: len(container) - len(body) + min(len(body), 8 + 65536)])
                if (
                    config is not None and st.parent.name == "peft_llama_patterns"
                ):  # config fields of the wrong type, and a cut file
                    out.append(pack(json.dumps({"r": "8", "lora_alpha": [], "target_modules": 7}).encode(), body))
                    out.append(pack(config, body[: len(body) // 2], raw=True))
    return out


def write_seeds(argv: list[str], inputs: Callable[[], list[bytes]]) -> bool:
    """`--seeds DIR`: write each of `inputs()` to DIR under its sha1 and say so (True); otherwise False."""
    if len(argv) != 3 or argv[1] != "--seeds":
        return False
    dest = Path(argv[2])
    dest.mkdir(parents=True, exist_ok=True)
    for data in inputs():
        (dest / hashlib.sha1(data).hexdigest()).write_bytes(data)
    return True


def main() -> None:
    if write_seeds(sys.argv, seed_inputs):
        return
    logging.disable(logging.WARNING)  # the engine checks log what SGLang would log; not wanted here
    out_dir = Path(os.environ.get("LORAFAST_FUZZ_OUT", "."))
    harness = Harness(out_dir)

    def test_one_input(data: bytes) -> None:
        harness.one(data)

    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
