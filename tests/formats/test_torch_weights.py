"""`.bin` / `.pt` weights read without unpickling (rust/torch/).

What torch writes is read back as `torch.load(weights_only=True)` reads it: names, dtypes, shapes, and
the bytes at the reported offsets. Adapters saved by PEFT as `adapter_model.bin` classify exactly as
their safetensors twins. Hostile pickles are refused with a code and never run: each payload would
create a marker file, the marker is never there after lorafast read the file, and `torch.load` with
`weights_only=False` on the same file does create it, which proves the payload was live.
"""

from __future__ import annotations

import codecs
import collections
import json
import pickle
import shutil
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import lorafast  # noqa: E402
from helpers.torch_files import (  # noqa: E402
    ST_DTYPES,
    Call,
    Storage,
    Tensor,
    random_state_dict,
    state_pickle,
    tensor_bytes,
    torch_zip,
)
from lorafast import _core  # noqa: E402
from lorafast.errors import AdapterError  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"


def expected_entries(path: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    loaded = torch.load(path, weights_only=True)
    return [(name, ST_DTYPES[t.dtype], tuple(t.shape)) for name, t in loaded.items()]


def read_entries(path: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, dtype, tuple(shape)) for name, dtype, shape, _ in _core.read_torch_header(str(path))["tensors"]]


def mixed_state_dict() -> OrderedDict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    sd["f32"] = base
    sd["transposed"] = base.t()  # shared storage, non-contiguous
    sd["slice"] = base[2:, 3:]  # offset into the shared storage
    sd["every_other"] = base[:, ::2]
    sd["bf16"] = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    sd["f16_scalar"] = torch.tensor(3.5, dtype=torch.float16)
    sd["empty"] = torch.zeros(0, 7)
    sd["empty_bf16"] = torch.zeros(3, 0, dtype=torch.bfloat16)
    sd["expanded"] = torch.arange(3.0).reshape(3, 1).expand(3, 5)
    sd["param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    sd["f8"] = torch.randn(5, generator=g).to(torch.float8_e4m3fn)
    sd["u16"] = torch.arange(6, dtype=torch.int32).reshape(2, 3).to(torch.uint16)
    for dt in (torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
               torch.complex64, torch.float8_e5m2, torch.uint32, torch.uint64):  # fmt: skip
        sd[f"dtype.{dt}"] = torch.ones(3, dtype=dt)
    sd._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return sd


def test_torch_save_state_dict_reads_as_torch_load(tmp_path: Path) -> None:
    path = tmp_path / "mixed.pt"
    sd = mixed_state_dict()
    torch.save(sd, path)
    assert read_entries(path) == expected_entries(path)
    # The offsets hold the tensor's bytes: the extent of each tensor in its storage.
    raw = path.read_bytes()
    header = lorafast.read_torch_header(path)
    for name, t in sd.items():
        begin, end = header.tensors[name].data_offsets
        assert header.data_start + end <= len(raw)
        if t.is_contiguous() and t.numel():
            want = tensor_bytes(t)
            assert raw[header.data_start + begin : header.data_start + end] == want, name
        if not t.numel():
            assert begin == end, name
    assert header.tensors["slice"].data_offsets[0] - header.tensors["f32"].data_offsets[0] == (2 * 8 + 3) * 4
    assert header.metadata is None and header.warnings == ()
    assert header.header_size > 0 and header.file_size == len(raw)


@pytest.mark.parametrize("seed", range(12))
def test_random_state_dicts_read_as_torch_load(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "r.bin"
    torch.save(random_state_dict(seed), path)
    assert read_entries(path) == expected_entries(path)
    raw, header = path.read_bytes(), lorafast.read_torch_header(path)
    for name, t in torch.load(path, weights_only=True).items():
        begin, end = header.tensors[name].data_offsets
        if t.is_contiguous() and t.numel():
            assert raw[begin:end] == tensor_bytes(t), name


def test_shared_storage_across_dtypes_of_views_and_plain_dicts(tmp_path: Path) -> None:
    # A plain dict (not an OrderedDict), tensors on one storage at several offsets, legacy file name.
    big = torch.arange(100, dtype=torch.float32)
    sd = {f"part{i}": big[i * 10 : i * 10 + 7].reshape(7, 1) for i in range(10)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path)
    assert read_entries(path) == expected_entries(path)
    offsets = [t[3][0] for t in _core.read_torch_header(str(path))["tensors"]]
    assert [o - offsets[0] for o in offsets] == [i * 40 for i in range(10)]


def test_non_tensor_values_are_skipped_with_a_warning(tmp_path: Path) -> None:
    # Every kind of value torch.load(weights_only=True) accepts besides tensors.
    from collections import Counter

    extras = {"step": 7, "big": 2**60, "name": "x", "nested": {"a": (1, 2.5, None, True)},
              "bytes": b"\x00\xff", "set": {1, 2}, "device": torch.device("cuda", 1), "counter": Counter("aab"),
              "complex": 1 + 2j, "bytearray": bytearray(b"xy"), "size": torch.Size([2, 3]), "list": [1, [2]],
              "layout": torch.sparse_coo}  # fmt: skip
    path = tmp_path / "extra.pt"
    torch.save({"w": torch.ones(2), **extras}, path)
    assert set(torch.load(path, weights_only=True)) == {"w", *extras}
    h = lorafast.read_torch_header(path)
    assert list(h.tensors) == ["w"]
    assert h.warnings[0][0] == "non_tensor_value" and "step" in h.warnings[0][1]
    assert h.warnings[0][1].startswith(f"{len(extras)} state-dict value(s)")


# ---- PEFT ----


def tiny_llama_peft(dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype)
    lcfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"down_proj": 2}
    )
    return get_peft_model(model, lcfg)


def comparable(row: dict) -> dict:
    """An inspect row without what differs between a file and its other serialization. Lists in order of
    appearance are sorted: safetensors sorts tensors by name, torch keeps the state dict's order."""
    skip = {"weight_files", "header_size", "file_size", "metadata", "path", "config_path"}
    out = {k: sorted(v) if k in {"target_modules", "problems", "full_weight_tensors"} else v
           for k, v in row.items() if k not in skip}  # fmt: skip
    modules = [{k: v for k, v in m.items() if k != "weight_file"} for m in row["modules"]]
    out["modules"] = sorted(modules, key=lambda m: m["key"])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peft_bin_classifies_like_its_safetensors_twin(tmp_path: Path, dtype: torch.dtype) -> None:
    pm = tiny_llama_peft(dtype)
    pm.save_pretrained(tmp_path / "st")
    pm.save_pretrained(tmp_path / "bin", safe_serialization=False)
    weights = tmp_path / "bin" / "adapter_model.bin"
    assert weights.is_file() and not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    assert read_entries(weights) == expected_entries(weights)
    st, pt = _core.inspect(str(tmp_path / "st")), _core.inspect(str(tmp_path / "bin"))
    assert pt["weight_files"] == (str(weights),)
    assert comparable(pt) == comparable(st)
    assert pt["format"] == "peft" and pt["rank"] == 4 and not pt["problems"]
    # A scan finds it as one adapter, its weights named in the row.
    report = lorafast.scan([tmp_path])
    rows = {Path(a.path).name: a for a in report}
    assert set(rows) == {"st", "bin"} and not report.errors
    assert rows["bin"].weight_files == (str(weights),)
    ranks = {name: sorted((m.name, m.rank) for m in rows[name].modules) for name in rows}
    assert ranks["bin"] == ranks["st"]


def test_vllm_weight_file_order(tmp_path: Path) -> None:
    pm = tiny_llama_peft()
    folder = tmp_path / "a"
    pm.save_pretrained(folder, safe_serialization=False)
    shutil.copy(folder / "adapter_model.bin", folder / "adapter_model.pt")
    assert _core.inspect(str(folder))["weight_files"] == (str(folder / "adapter_model.bin"),)
    (folder / "adapter_model.bin").unlink()
    assert _core.inspect(str(folder))["weight_files"] == (str(folder / "adapter_model.pt"),)
    pm.save_pretrained(folder)  # adapter_model.safetensors wins over both
    assert _core.inspect(str(folder))["weight_files"] == (str(folder / "adapter_model.safetensors"),)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.pt").unlink()
    with pytest.raises(AdapterError) as e:
        _core.inspect(str(folder))
    assert e.value.code == "missing_weights" and "adapter_model.bin" in str(e.value)


def _without_adapter_metadata(folder: Path) -> bool:
    from safetensors import safe_open

    (st,) = folder.glob("*.safetensors")
    with safe_open(st, "pt") as f:
        return "lora_adapter_metadata" not in (f.metadata() or {})


REAL = [p for p in sorted(FIXTURES.iterdir()) if p.is_dir() and _without_adapter_metadata(p)]


@pytest.mark.parametrize("folder", REAL, ids=[p.name for p in REAL])
def test_real_adapters_saved_as_torch_classify_the_same(tmp_path: Path, folder: Path) -> None:
    # What PEFT's save_pretrained(safe_serialization=False) does: torch.save of the state dict.
    from safetensors.torch import load_file

    (st,) = folder.glob("*.safetensors")
    copy = tmp_path / folder.name
    copy.mkdir()
    if (folder / "adapter_config.json").exists():
        shutil.copy(folder / "adapter_config.json", copy)
        weights = copy / "adapter_model.bin"
        target = copy
    else:  # kohya / diffusers single files, given directly as .pt
        weights = copy / (st.stem + ".pt")
        target = weights
    torch.save(load_file(st), weights)
    assert read_entries(weights) == expected_entries(weights)
    got, want = _core.inspect(str(target)), _core.inspect(str(folder if target == copy else st))
    assert comparable(got) == comparable(want)


PEFT_REAL = [p for p in REAL if (p / "adapter_config.json").exists()]


@pytest.mark.parametrize("folder", PEFT_REAL, ids=[p.name for p in PEFT_REAL])
def test_sglang_preflight_of_scanned_bin_adapters_matches_safetensors(tmp_path: Path, folder: Path) -> None:
    from lorafast.compat import sglang
    from safetensors.torch import load_file

    copy = tmp_path / folder.name
    copy.mkdir()
    shutil.copy(folder / "adapter_config.json", copy)
    torch.save(load_file(folder / "adapter_model.safetensors"), copy / "adapter_model.bin")
    (st,) = lorafast.scan([folder])
    (pt,) = lorafast.scan([copy])
    want = sglang.preflight({"x": st}, collect=True)
    got = sglang.preflight({"x": pt}, collect=True)
    assert [(p.code, p.message.replace(str(copy), str(folder))) for p in got.problems] == [
        (p.code, p.message) for p in want.problems
    ]
    assert (got.target_modules, got.max_lora_rank) == (want.target_modules, want.max_lora_rank)


# ---- hostile files: refused, never run ----


class Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def refused(path: Path, code: str) -> AdapterError:
    with pytest.raises(AdapterError) as e:
        _core.read_torch_header(str(path))
    assert e.value.code == code, str(e.value)
    assert e.value.code in lorafast._core.TORCH_ERROR_CODES
    return e.value


def test_reduce_payload_saved_by_torch_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "adapter_model.bin"
    torch.save({"w": torch.ones(2), "evil": Payload(marker)}, path)
    err = refused(path, "unsafe_pickle")
    assert "posix.system" in str(err) or "os.system" in str(err)
    assert not marker.exists()
    # Through discovery and scanning too: the folder's row is the error.
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q"]}))
    report = lorafast.scan([tmp_path])
    assert [e[1] for e in report.errors] == ["unsafe_pickle"]
    assert not marker.exists()
    # The payload is live: torch's unrestricted load runs it.
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_plain_pickle_payloads_in_a_torch_zip_are_refused(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch_zip(path, pickle.dumps({"w": Payload(marker)}, protocol=protocol))
    err = refused(path, "unsafe_pickle" if protocol >= 2 else "invalid_pickle")
    if protocol > 2:
        assert "PROTO" in str(err)
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_stack_global_inst_obj_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    cmd = f"touch {marker}".encode()
    cases = {
        "STACK_GLOBAL": b"\x80\x02X\x05\x00\x00\x00posixX\x06\x00\x00\x00system\x93X"
        + len(cmd).to_bytes(4, "little")
        + cmd
        + b"\x85R.",
        "INST": b"\x80\x02(X" + len(cmd).to_bytes(4, "little") + cmd + b"iposix\nsystem\n.",
        "OBJ": b"\x80\x02(cposix\nsystem\nX" + len(cmd).to_bytes(4, "little") + cmd + b"o.",
        "global": b"\x80\x02cbuiltins\nexec\nX" + len(cmd).to_bytes(4, "little") + cmd + b"\x85R.",
    }
    for name, body in cases.items():
        path = tmp_path / f"{name}.pt"
        torch_zip(path, body)
        assert name in str(refused(path, "unsafe_pickle"))
        assert not marker.exists()


def test_memory_and_work_attacks_are_bounded(tmp_path: Path) -> None:
    cases = {
        "memo": (b"\x80\x02}r\xff\xff\xff\xff.", "invalid_pickle"),
        "get": (b"\x80\x02j\xff\xff\xff\x7f.", "invalid_pickle"),
        "deep": (b"\x80\x02)" + b"\x85" * 200_000 + b".", "pickle_limit"),
        "marks": (b"\x80\x02" + b"(" * 1_000_000 + b".", "pickle_limit"),
        "pushes": (b"\x80\x02" + b"N" * 1_000_000 + b".", "pickle_limit"),
        "string": (b"\x80\x02X\xff\xff\xff\xff.", "invalid_pickle"),
        "cycle": (b"\x80\x02}q\x00X\x01\x00\x00\x00xh\x00s.", "unsafe_pickle"),
    }
    for name, (body, code) in cases.items():
        path = tmp_path / f"{name}.pt"
        torch_zip(path, body)
        refused(path, code)


def test_broken_and_foreign_containers(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3, 3)}, good)
    raw = good.read_bytes()
    for cut in (len(raw) - 1, len(raw) - 22, len(raw) // 2, 100, 3):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(raw[:cut])
        refused(path, "invalid_zip")
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    refused(legacy, "legacy_torch_format")
    text = tmp_path / "text.bin"
    text.write_text("not a torch file")
    refused(text, "invalid_zip")
    # A list is not a state dict.
    listed = tmp_path / "list.pt"
    torch.save([torch.ones(1)], listed)
    refused(listed, "not_a_state_dict")
    # A sparse tensor's rebuild is not one of the allowed functions.
    sparse = tmp_path / "sparse.pt"
    torch.save({"s": torch.eye(3).to_sparse()}, sparse)
    refused(sparse, "unsafe_pickle")


def test_zip_bomb_is_refused_without_inflating(tmp_path: Path) -> None:
    # 64 MiB of zeros deflates to about 64 KiB; torch never compresses, so it is refused unread.
    path = tmp_path / "bomb.pt"
    body = b"\x80\x02}" + b"N" * (64 << 20) + b"."
    torch_zip(path, body, compress=zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 1 << 20
    assert "compressed" in str(refused(path, "invalid_zip"))
    # The same record name twice: which one is meant is ambiguous, so neither is.
    twice = tmp_path / "twice.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name
        with zipfile.ZipFile(twice, "w") as z:
            z.writestr("archive/data.pkl", b"\x80\x02}.")
            z.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\n.")
    assert "twice" in str(refused(twice, "invalid_zip"))


def test_errors_are_adapter_errors_with_codes(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    torch_zip(path, b"\x80\x02cos\nsystem\n.")
    err = refused(path, "unsafe_pickle")
    assert err.path == str(path) and "nothing was run" in str(err)
    assert pickle.loads(pickle.dumps(err)).code == "unsafe_pickle"
    with pytest.raises(FileNotFoundError):
        _core.read_torch_header(str(tmp_path / "missing.bin"))


def test_cli_header_reads_torch_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    path = tmp_path / "adapter_model.bin"
    torch.save({"a.lora_A.weight": torch.zeros(4, 16, dtype=torch.bfloat16)}, path)
    assert main(["header", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"]["a.lora_A.weight"]["shape"] == [4, 16]
    assert out["tensors"]["a.lora_A.weight"]["dtype"] == "BF16"
    torch_zip(path, b"\x80\x02cos\nsystem\n.")
    assert main(["header", str(path)]) == 1
    assert "unsafe_pickle" in capsys.readouterr().err


def test_torch_error_codes_are_exported_and_distinct(tmp_path: Path) -> None:
    codes = set(lorafast.TORCH_ERROR_CODES)
    assert {"unsafe_pickle", "invalid_pickle", "invalid_zip", "legacy_torch_format", "pickle_limit"} <= codes
    assert not codes & (set(lorafast.HEADER_ERROR_CODES) | set(lorafast.ADAPTER_ERROR_CODES))
    # A dtype safetensors cannot name is refused, not mislabelled.
    path = tmp_path / "c.pt"
    torch.save({"c": torch.zeros(2, dtype=torch.complex128)}, path)
    assert "complex128" in str(refused(path, "invalid_torch_tensor"))


# ---- storages declared more than once ----


def test_a_storage_key_declared_again_must_agree_with_its_first_declaration(tmp_path: Path) -> None:
    # torch.load keeps a key's first storage for later declarations of the same dtype, whatever size they say.
    first = Storage(torch.FloatStorage, "0", 64)
    records = {"0": torch.arange(64, dtype=torch.float32).numpy().tobytes()}
    again = {"a": Tensor(first, (64,), (1,)), "b": Tensor(Storage(torch.FloatStorage, "0", 64), (8, 8), (8, 1))}
    path = tmp_path / "again.pt"
    torch_zip(path, state_pickle(again), records)
    assert read_entries(path) == expected_entries(path) == [("a", "F32", (64,)), ("b", "F32", (8, 8))]
    # Declared again as 4,096 floats: torch cannot load it (the tensor needs more than the first storage has).
    bigger = {"a": Tensor(first, (64,), (1,)), "b": Tensor(Storage(torch.FloatStorage, "0", 4096), (4096,), (1,))}
    path = tmp_path / "bigger.pt"
    torch_zip(path, state_pickle(bigger), records)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(path, weights_only=True)
    assert "declared as 64 float32 elements, then as 4096 float32" in str(refused(path, "invalid_torch_tensor"))
    # Declared again as 32 doubles of the same 256 bytes: torch loads it, as float32 in older versions (the first
    # storage's dtype) and as float64 in 2.15 (the bytes taken again as doubles), so neither dtype is safe to report.
    double = {"a": Tensor(first, (64,), (1,)), "b": Tensor(Storage(torch.DoubleStorage, "0", 32), (32,), (1,))}
    path = tmp_path / "double.pt"
    torch_zip(path, state_pickle(double), records)
    assert torch.load(path, weights_only=True)["b"].shape == (32,)
    assert "then as 32 float64" in str(refused(path, "invalid_torch_tensor"))


# ---- what tests/fuzz/fuzz_torch.py found: files lorafast accepted that torch.load cannot load ----


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (Call(codecs.encode, "x", "latin0"), "invalid_pickle"),
        (Call(codecs.encode, "\u20ac", "latin1"), "invalid_pickle"),
        (Call(torch.device, "gpu"), "invalid_pickle"),
        (Call(torch.device, "cuda", -1), "invalid_pickle"),
        (Call(set, [[1]]), "invalid_pickle"),
        (Call(complex, "x"), "invalid_pickle"),
        (Call(collections.Counter, 7), "invalid_pickle"),
        (Call(torch.serialization._get_layout, "torch.nope"), "invalid_pickle"),
        (Tensor(Storage(torch.FloatStorage, "1", 4, location="cpX"), (4,), (1,)), "invalid_torch_tensor"),
        (Tensor(Storage(torch.LongStorage, "1", 2), (2,), (1,), requires_grad=True), "invalid_pickle"),
        (Tensor(Storage(torch.FloatStorage, "1", 4), (4,), (1,), metadata={"conj": True}), "invalid_pickle"),
        (Tensor(Storage(torch.FloatStorage, "1", 4), (4,), (1,), metadata=torch.float32), "invalid_pickle"),
        (
            Call(
                torch._utils._rebuild_parameter_with_state,
                Tensor(Storage(torch.FloatStorage, "1", 4), (4,), (1,)),
                False,
                collections.OrderedDict(),
                {"data": 1},
            ),
            "invalid_pickle",
        ),  # fmt: skip
        ([Tensor(Storage(torch.FloatStorage, "9", 4), (4,), (1,))], "invalid_torch_tensor"),
    ],
    ids=[
        "codec",
        "not_latin1",
        "device",
        "device_index",
        "set_of_lists",
        "complex_str",
        "counter_int",
        "layout",
        "location",
        "int_requires_grad",
        "conj_of_floats",
        "metadata_not_dict",
        "parameter_attributes",
        "nested_tensor_without_record",
    ],
)
def test_values_torch_cannot_build_are_refused(tmp_path: Path, value: object, code: str) -> None:
    path = tmp_path / "v.pt"
    torch_zip(path, state_pickle({"w": Tensor(Storage(torch.FloatStorage, "0", 4), (4,), (1,)), "v": value}),
              {"0": bytes(16), "1": bytes(16)})  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017 (each fails its own way inside torch)
        torch.load(path, weights_only=True)
    refused(path, code)


def test_values_as_torch_save_writes_them_are_read(tmp_path: Path) -> None:
    # Saved from a GPU (location cuda:0) and holding every value torch.load allows, as pickle writes them.
    path = tmp_path / "gpu.pt"
    state = {"w": Tensor(Storage(torch.FloatStorage, "0", 4, location="cuda:0"), (4,), (1,), requires_grad=True,
                         metadata={"neg": False}),
             "v": [b"\x00\xff", bytearray(b"xy"), bytearray(), {1, (2, "a")}, set(), 1 + 2j, collections.Counter("ab"),
                   torch.device("cuda", 1), torch.device("meta"), Call(torch.serialization._get_layout, "torch.sparse_csr")]}  # fmt: skip
    torch_zip(path, state_pickle(state), {"0": bytes(16)})
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    assert loaded["v"][-1] is torch.sparse_csr
    assert read_entries(path) == [("w", "F32", (4,))]
