"""Parsing and classification of hostile files: valid files that once crashed the classifier give rows,
memory and time follow the input, wrong-typed config fields are problems, and bad UTF-8 is the
error reported first. The Rust side is tested in the cargo test reliability_parse and the fuzz harnesses."""

from __future__ import annotations

import json
import os

import lorafast
import pytest
from lorafast.testing import write_attention_adapter as peft
from lorafast.testing import write_raw, write_safetensors

EXPERTS = "base_model.model.model.layers.0.mlp.experts"

#: Valid safetensors files whose 0-d factors the classifier used to index (PanicException).
ZERO_D = {
    "zero_d_a_on_experts": {
        f"{EXPERTS}.lora_A.weight": ("F32", ()),
        f"{EXPERTS}.lora_B.weight": ("F32", (64, 4)),
    },
    "zero_d_b_on_3d_experts": {
        f"{EXPERTS}.gate_up_proj.lora_A.weight": ("F32", (8, 4, 16)),
        f"{EXPERTS}.gate_up_proj.lora_B.weight": ("F32", ()),
    },
}


@pytest.mark.parametrize("name", sorted(ZERO_D))
def test_scan_of_good_adapters_and_a_zero_d_experts_file_gives_every_row(tmp_path, name):
    for i in range(3):
        peft(tmp_path / f"good{i}")
    bad = tmp_path / f"{name}.safetensors"
    write_safetensors(bad, ZERO_D[name])
    lorafast.read_header(bad)  # valid for the reader, as for safetensors
    report = lorafast.scan([str(tmp_path)], threads=1)
    assert len(report) == 4
    assert report.errors == []
    adapter = lorafast.inspect(bad)
    assert adapter.num_tensors == 2
    assert len(adapter.modules) == 1


def test_huge_layer_index_is_listed(tmp_path):
    path = tmp_path / "far.safetensors"
    write_safetensors(
        path,
        {
            "model.layers.999999999.q_proj.lora_A.weight": ("F32", (4, 8)),
            "model.layers.999999999.q_proj.lora_B.weight": ("F32", (8, 4)),
        },
    )
    assert list(lorafast.inspect(path).layers) == [999_999_999]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("r", "8"),
        ("target_modules", 7),
        ("lora_alpha", "16"),
        ("use_rslora", 1),
        ("rank_pattern", ["q_proj"]),
        ("modules_to_save", {"score": 1}),
    ],
)
def test_wrong_typed_config_field_is_a_problem(tmp_path, field, value):
    folder = peft(tmp_path / "a", config={field: value})
    problems = [p for p in lorafast.inspect(folder).problems if p.code == "invalid_config_field"]
    assert len(problems) == 1
    assert repr(field) in problems[0].message.replace('"', "'")
    # Read as absent, in the typed result too.
    adapter = lorafast.inspect(folder)
    assert adapter.r is None if field == "r" else adapter.r == 8
    assert isinstance(adapter.rank_pattern, dict) and isinstance(adapter.use_rslora, bool)
    assert lorafast.scan([folder], threads=1).errors == []
    assert len(list(lorafast.scan([folder], threads=1))) == 1


def test_right_typed_config_has_no_field_problem(tmp_path):
    folder = peft(tmp_path / "a", config={"use_rslora": False, "rank_pattern": {"q_proj": 8}, "modules_to_save": None})
    assert all(p.code != "invalid_config_field" for p in lorafast.inspect(folder).problems)


def test_problem_codes_are_documented(tmp_path):
    folder = peft(tmp_path / "a", config={"r": "8"}, extra={"junk": ("F32", (1,))})
    codes = {p.code for p in lorafast.inspect(folder).problems}
    assert codes == {"invalid_config_field", "unknown_tensor"}
    assert codes <= set(lorafast.PROBLEM_CODES)
    assert len(set(lorafast.PROBLEM_CODES)) == len(lorafast.PROBLEM_CODES)


@pytest.mark.parametrize(
    "header",
    [
        b'["\xff"]',
        b'{"t":{"dtype":"X","shape":[],"data_offsets":[0,0]},"\xff":1}',
        b'{"__metadata__":{"a":1,"\xff":"b"}}',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"u":{"dtype":"F32","shape":[0],"data_offsets":[8,8],"x":"\xfe"}}',
    ],
)
@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_invalid_utf8_is_reported_first(tmp_path, header, mode):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data_len=8)
    with pytest.raises(lorafast.HeaderError) as info:
        lorafast.read_header(path, mode=mode)
    assert info.value.code == "invalid_utf8"
    report = lorafast.scan([str(path)], threads=1)
    assert [code for _, code, _ in report.errors] == ["invalid_utf8"]


def test_metadata_with_many_keys_and_a_repeat(tmp_path):
    pairs = {f"k{i}": "v" for i in range(60_000)}
    path = tmp_path / "meta.safetensors"
    write_safetensors(path, {}, metadata=pairs)
    assert len(lorafast.read_header(path).metadata) == 60_000
    body = json.dumps(pairs)[:-1] + ', "k59999": "w"}'
    write_raw(path, ('{"__metadata__": ' + body + "}").encode())
    with pytest.raises(lorafast.HeaderError) as info:
        lorafast.read_header(path)
    assert info.value.code == "duplicate_key"


def test_many_modules_to_save_with_many_unknown_tensors(tmp_path):
    n = 8_000
    extra = {f"base_model.model.head{i}.weight": ("F32", (0,)) for i in range(n)}
    folder = peft(tmp_path / "a", config={"modules_to_save": [f"head{i}" for i in range(0, n, 2)]}, extra=extra)
    adapter = lorafast.inspect(folder)
    assert "modules_to_save" in adapter.flags
    unknown = [p for p in adapter.problems if p.code == "unknown_tensor"]
    assert unknown and all(int(p.tensor.split("head")[1].split(".")[0]) % 2 == 1 for p in unknown)
    assert os.path.isdir(folder)
