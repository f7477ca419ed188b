"""Differential fuzz of `read_base` on sharded checkpoints: random shards and indexes, some damaged, read by lorafast
and by the references, transformers' index reading (`get_checkpoint_shard_files`) and safetensors' own header
reader (`safe_open`). A short seeded pass in the suite; `LORAFAST_FUZZ_CASES=N` for a long one (`make fuzz`).

- a checkpoint both references read: `read_base` gives every tensor of every shard the index names, with the dtype
  and shape safetensors reads, and the shard it is in;
- an index transformers refuses, or one naming a shard that is not there: `read_base` raises `BaseModelError`;
- a shard safetensors refuses: `read_base` refuses it too (`HeaderError` naming the shard, or `BaseModelError`);
- nothing else ever escapes (no other exception, no crash)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
from helpers.fuzzing import fuzz
from hypothesis import given
from hypothesis import strategies as st
from lorafast.base import BaseModelError, read_base
from lorafast.errors import HeaderError
from safetensors import safe_open
from safetensors.numpy import save_file

pytestmark = pytest.mark.fuzz

DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "U8": np.uint8}
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
TENSOR = st.tuples(st.sampled_from(sorted(DTYPES)), SHAPES)
CHECKPOINT = st.lists(st.dictionaries(st.from_regex(r"[a-z]{1,3}(\.[a-z0-9]{1,3}){0,2}", fullmatch=True), TENSOR,
                                      min_size=1, max_size=4), min_size=1, max_size=3)  # fmt: skip
DAMAGE = st.sampled_from(["none", "none", "none", "drop_shard", "flip_header", "truncate", "extra_unlisted",
                          "index_not_map", "index_bad_json"])  # fmt: skip


def _write(root: str, shards: list[dict[str, tuple[str, tuple[int, ...]]]], damage: str, where: int) -> None:
    weight_map: dict[str, str] = {}
    seen: set[str] = set()
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {k: np.zeros(shape, dtype=DTYPES[d]) for k, (d, shape) in tensors.items() if k not in seen}
        seen |= set(arrays)
        if not arrays:
            arrays = {f"pad{i}": np.zeros((1,), dtype=np.float32)}
        if damage == "extra_unlisted" and i == 0:
            arrays["unlisted.weight"] = np.zeros((2,), dtype=np.float32)
        save_file(arrays, os.path.join(root, name))
        weight_map.update({k: name for k in arrays if k != "unlisted.weight"})
    index = {"metadata": {}, "weight_map": weight_map}
    path = os.path.join(root, "model.safetensors.index.json")
    with open(path, "w") as f:
        if damage == "index_not_map":
            json.dump({"weight_map": list(weight_map)}, f)
        elif damage == "index_bad_json":
            f.write(json.dumps(index)[:-3])
        else:
            json.dump(index, f)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"]}, f)
    victim = os.path.join(root, sorted(set(weight_map.values()))[where % len(set(weight_map.values()))])
    if damage == "drop_shard":
        os.unlink(victim)
    elif damage in ("flip_header", "truncate"):
        with open(victim, "rb") as f:
            data = bytearray(f.read())
        if damage == "flip_header":
            data[8 + (where % max(1, int.from_bytes(data[:8], "little")))] ^= 0x5A
        else:
            data = data[: max(0, len(data) - 1 - where % 16)]
        with open(victim, "wb") as f:
            f.write(bytes(data))


def _references(root: str) -> tuple[str, Any]:
    """("ok", {name: (dtype, shape, file)}) or (kind of refusal, exception) as transformers and safetensors read it."""
    from transformers.utils.hub import get_checkpoint_shard_files

    try:
        files, _ = get_checkpoint_shard_files(root, os.path.join(root, "model.safetensors.index.json"))
    except Exception as e:
        return "index", e
    weights = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    weights[k] = (s.get_dtype(), tuple(s.get_shape()), file)
        except Exception as e:
            return "shard", e
    return "ok", weights


@fuzz(60)
@given(CHECKPOINT, DAMAGE, st.integers(0, 1 << 16))
def test_read_base_agrees_with_transformers_and_safetensors(shards: Any, damage: str, where: int) -> None:
    root = tempfile.mkdtemp(prefix="lorafast-base-fuzz-")
    try:
        _write(root, shards, damage, where)
        kind, ref = _references(root)
        try:
            base = read_base(root)
        except (BaseModelError, HeaderError) as e:
            assert kind != "ok", f"{damage}: lorafast refused what both references read: {e}"
            assert root in str(e), e  # the error names the file
            return
        assert kind == "ok", f"{damage}: lorafast read what the references refuse ({kind}: {ref!r})"
        got = {k: (w.dtype, w.shape, os.path.abspath(w.file)) for k, w in base.weights.items()}
        want = {k: (d, s, os.path.abspath(f)) for k, (d, s, f) in ref.items()}
        assert got == want, damage
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_each_damage_is_refused_as_the_references_refuse_it(tmp_path: Any) -> None:
    shards = [{"a.weight": ("F32", (2, 3)), "b.bias": ("F16", (3,))}, {"c.weight": ("I64", (1, 1))}]
    outcomes = {}
    for damage in (
        "none",
        "drop_shard",
        "flip_header",
        "truncate",
        "index_not_map",
        "index_bad_json",
        "extra_unlisted",
    ):
        root = tmp_path / damage
        root.mkdir()
        _write(str(root), shards, damage, 1)
        kind, _ = _references(str(root))
        try:
            read_base(str(root))
            outcomes[damage] = (kind, "read")
        except (BaseModelError, HeaderError) as e:
            outcomes[damage] = (kind, e.code)
    assert outcomes["none"] == ("ok", "read") and outcomes["extra_unlisted"] == ("ok", "read")
    assert outcomes["drop_shard"] == ("shard", "missing_shard")  # transformers lists it; opening it fails
    assert outcomes["index_not_map"][1] == outcomes["index_bad_json"][1] == "bad_index"
    assert outcomes["flip_header"][0] == "shard" and outcomes["flip_header"][1] != "read"
    assert outcomes["truncate"][0] == "shard" and outcomes["truncate"][1] != "read"
