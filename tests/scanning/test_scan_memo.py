"""A scan remembers the classification of a header it has seen (rust/scan/memo.rs): adapters with the
same header bytes, file size and config get it without a second parse. These tests check that a
remembered row is always the row a fresh read gives, and that whatever is not in the key (tensor
data such as kohya alphas, the config, the file size) is never taken from the memory."""

from __future__ import annotations

import json
import os
import shutil

import lorafast
import numpy as np
import pytest
from lorafast import _core
from lorafast.testing import write_attention_adapter as peft
from lorafast.testing import write_safetensors

# Fields a scan row and a fresh inspect share (inspect also lists modules and metadata).
SHARED = ("path", "weight_files", "config_path", "config_json", "format", "peft_type", "num_tensors", "dtypes",
          "layers", "base_model_name_or_path", "target_modules", "rank", "moe_layout", "num_experts", "flags",
          "variants", "full_weight_tensors", "problems", "header_size", "file_size")  # fmt: skip


def fresh(path: str) -> dict:
    """The row of a fresh read: `inspect` keeps modules, and such reads never use the memory."""
    d = _core.inspect(path)
    return {k: d[k] for k in SHARED}


def rows(report: lorafast.ScanReport) -> list[dict | None]:
    out = []
    for i in range(len(report)):
        r = report._result.record(i)
        out.append(None if r is None else {k: r[k] for k in SHARED})
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_repeated_headers_give_the_rows_of_a_fresh_read(tmp_path, threads):
    template = peft(tmp_path / "template", r=8)
    for i in range(40):
        shutil.copytree(template, tmp_path / "fleet" / f"copy-{i:02d}")
    # Same header, other configs: a rank that disagrees with the tensors, other targets.
    with open(tmp_path / "fleet" / "copy-05" / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}, f)
    with open(tmp_path / "fleet" / "copy-06" / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["k_proj"]}, f)
    # No config at all: the same header read as a bare file.
    shutil.copy(
        tmp_path / "template" / "adapter_model.safetensors",
        tmp_path / "fleet" / "copy-07" / "adapter_model.safetensors",
    )
    os.remove(tmp_path / "fleet" / "copy-07" / "adapter_config.json")
    # Same header, file cut short: the size is part of the key.
    with open(tmp_path / "fleet" / "copy-08" / "adapter_model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "template" / "adapter_model.safetensors") - 2)
    report = lorafast.scan([tmp_path / "fleet"], threads=threads, progress=False)
    assert len(report) == 40
    got = rows(report)
    for path, row in zip(report.paths, got, strict=True):
        if row is not None:
            assert row == fresh(path), path
    fleet = tmp_path / "fleet"
    by_name = {os.path.relpath(p, fleet).split(os.sep)[0]: r for p, r in zip(report.paths, got, strict=True)}
    codes = {p[0] for p in by_name["copy-05"]["problems"]}
    assert "config_rank_mismatch" in codes
    assert any(p[0] == "target_modules_mismatch" for p in by_name["copy-06"]["problems"])
    assert by_name["copy-07"]["config_json"] is None and by_name["copy-07"]["format"] == "peft"
    assert by_name["copy-08"] is None
    errors = {os.path.relpath(p, fleet).split(os.sep)[0]: code for p, code, _ in report.errors}
    assert errors == {"copy-08": "incomplete_buffer"}
    assert by_name["copy-00"]["problems"] == [] and by_name["copy-00"]["rank"] == 8


def test_alpha_values_are_read_for_every_file_even_with_equal_headers(tmp_path):
    """kohya alphas are tensor data, not header: equal headers with other alphas must differ."""
    names = {
        "lora_unet_mid_block_attentions_0_proj_in.lora_down.weight": ("F16", (4, 8)),
        "lora_unet_mid_block_attentions_0_proj_in.lora_up.weight": ("F16", (8, 4)),
    }
    for i, alpha in enumerate([2.0, np.nan, 2.0, np.inf, 4.0]):
        tensors = dict(names)
        tensors["lora_unet_mid_block_attentions_0_proj_in.alpha"] = np.array(alpha, dtype=np.float32)
        write_safetensors(tmp_path / f"style-{i}.safetensors", tensors)
    report = lorafast.scan([tmp_path], threads=1, progress=False)
    problems = [len(r["problems"]) for r in rows(report)]
    assert problems == [0, 1, 0, 1, 0]
    assert [r["problems"][0][0] for r in rows(report) if r["problems"]] == ["invalid_alpha", "invalid_alpha"]


def test_diffusers_metadata_config_survives_a_repeat(tmp_path):
    meta = {"lora_adapter_metadata": json.dumps({"unet.r": 4, "unet.lora_alpha": 8, "unet.target_modules": ["to_q"]})}
    tensors = {
        "unet.down_blocks.0.attentions.0.to_q.lora_A.weight": ("F16", (4, 8)),
        "unet.down_blocks.0.attentions.0.to_q.lora_B.weight": ("F16", (8, 4)),
    }
    for i in range(4):
        write_safetensors(tmp_path / f"pytorch_lora_weights_{i}.safetensors", tensors, metadata=meta)
    report = lorafast.scan([tmp_path], threads=1, progress=False)
    got = rows(report)
    assert all(r == fresh(p) for p, r in zip(report.paths, got, strict=True))
    assert all(r["config_json"] == meta["lora_adapter_metadata"] for r in got)


def test_duplicate_names_stay_an_error_when_repeated(tmp_path):
    from lorafast.testing import write_raw

    entry = '"a.lora_A.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    for i in range(3):
        write_raw(tmp_path / f"dup-{i}.safetensors", ("{" + entry + "," + entry + "}").encode(), 4)
    report = lorafast.scan([tmp_path], threads=1, progress=False)
    assert [code for _, code, _ in report.errors] == ["duplicate_tensor"] * 3


def test_run_specific_metadata_is_left_out_of_the_key_but_diffusers_config_is_not(tmp_path):
    """Training tools write per-run `__metadata__`; only `lora_adapter_metadata` decides a result."""
    tensors = {
        "unet.down_blocks.0.attentions.0.to_q.lora_A.weight": ("F16", (4, 8)),
        "unet.down_blocks.0.attentions.0.to_q.lora_B.weight": ("F16", (8, 4)),
    }
    metas = []
    for i in range(6):
        meta = {"ss_session_id": str(1000 + i), "ss_training_started_at": f"17000000{i:02d}"}
        if i >= 3:  # a config whose rank disagrees with the tensors
            meta["lora_adapter_metadata"] = json.dumps({"unet.r": 4 if i == 3 else 8, "unet.target_modules": ["to_q"]})
        metas.append(meta)
        write_safetensors(tmp_path / f"run-{i}.safetensors", tensors, metadata=meta)
    # A leading metadata that is not valid must still fail, whatever was remembered.
    header = json.dumps(
        {
            "__metadata__": {"ss_session_id": 7},
            **{
                k: {"dtype": "F16", "shape": list(s), "data_offsets": [0, 64]}
                for k, (_, s) in list(tensors.items())[:1]
            },
        },
        separators=(",", ":"),
    ).encode()
    from lorafast.testing import write_raw

    write_raw(tmp_path / "run-9-bad.safetensors", header, 64)
    report = lorafast.scan([tmp_path], threads=1, progress=False)
    got = rows(report)
    assert all(r == fresh(p) for p, r in zip(report.paths, got, strict=True) if r is not None)
    assert [r["config_json"] is not None for r in got[:6]] == [False] * 3 + [True] * 3
    assert [r["format"] for r in got[:6]] == ["diffusers"] * 6
    assert [code for _, code, _ in report.errors] == ["invalid_metadata"]
