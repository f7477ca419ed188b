"""Bulk scan: discovery rules, bad files as data, columns, summary, JSON, problems, fork safety, CLI."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys

import lorafast
import numpy as np
import pytest
from lorafast.cli import main as cli_main
from lorafast.scanning import FLAGS, FORMATS, MOE_LAYOUTS, STATUS_ERROR, STATUS_OK
from lorafast.testing import write_attention_adapter as peft
from lorafast.testing import write_raw, write_safetensors


@pytest.fixture
def fleet(tmp_path):
    root = tmp_path / "fleet"
    peft(root / "team-a" / "good", r=16)
    peft(
        root / "team-a" / "dora",
        extra={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": ("BF16", (32,))},
    )
    peft(root / "team-b" / "nested" / "deep", r=4)
    kohya = root / "kohya"
    kohya.mkdir()
    write_safetensors(
        kohya / "style.safetensors",
        {
            "lora_unet_mid_block_attentions_0_proj_in.lora_down.weight": ("F16", (4, 8)),
            "lora_unet_mid_block_attentions_0_proj_in.lora_up.weight": ("F16", (8, 4)),
            "lora_unet_mid_block_attentions_0_proj_in.alpha": np.array(2.0, dtype=np.float32),
        },
    )
    broken = root / "broken"
    broken.mkdir()
    write_raw(broken / "bad.safetensors", b'{"t": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}', 4)
    (root / "team-b" / "no-weights").mkdir(parents=True)
    (root / "team-b" / "no-weights" / "adapter_config.json").write_text("{}")
    (root / ".hidden").mkdir()
    peft(root / ".hidden" / "skipped")
    (root / "notes.txt").write_text("not an adapter")
    return root


def test_discovery_rules_and_bad_files_as_data(fleet):
    report = lorafast.scan([fleet])
    names = {os.path.relpath(p, fleet) for p in report.paths}
    # `kohya/` holds one file and no sub-folder: the folder is the adapter (diffusers/kohya form).
    assert names == {"team-a/good", "team-a/dora", "team-b/nested/deep", "kohya",
                     "broken/bad.safetensors", "team-b/no-weights"}  # fmt: skip
    errors = {os.path.relpath(p, fleet): code for p, code, _ in report.errors}
    assert errors == {"broken/bad.safetensors": "unknown_dtype", "team-b/no-weights": "missing_weights"}
    assert all(fleet.name in msg or msg for _, _, msg in report.errors)
    assert len(report) == 6 and len(list(report)) == 4


def test_non_recursive_scan_only_reads_top_level_files(fleet):
    report = lorafast.scan([fleet / "kohya", fleet / "team-a"], recursive=False)
    assert sorted(os.path.basename(p) for p in report.paths) == ["style.safetensors"]


def test_columns_are_numpy_one_row_per_adapter(fleet):
    report = lorafast.scan([fleet])
    cols = report.columns()
    assert set(cols) == {"path_index", "status", "format", "rank", "num_tensors", "moe_layout", "num_experts",
                         "num_layers", "flags", "num_problems"}  # fmt: skip
    assert all(isinstance(v, np.ndarray) and len(v) == len(report) for v in cols.values())
    by_path = {os.path.relpath(report.paths[i], fleet): i for i in cols["path_index"].tolist()}
    good, bad, kohya = by_path["team-a/good"], by_path["broken/bad.safetensors"], by_path["kohya"]
    assert cols["status"][good] == STATUS_OK and cols["status"][bad] == STATUS_ERROR
    assert cols["rank"][good] == 16 and cols["num_tensors"][good] == 8 and cols["num_layers"][good] == 2
    assert FORMATS[cols["format"][good]] == "peft" and FORMATS[cols["format"][kohya]] == "kohya"
    assert MOE_LAYOUTS[cols["moe_layout"][good]] == "dense"
    dora = by_path["team-a/dora"]
    assert cols["flags"][dora] & (1 << FLAGS.index("dora"))
    assert not cols["flags"][good] & (1 << FLAGS.index("dora"))


def test_summary_and_json(fleet):
    report = lorafast.scan([fleet])
    s = report.summary()
    assert s["adapters"] == 6 and s["failed"] == 2
    assert s["formats"] == {"kohya": 1, "peft": 3}
    assert s["rank_histogram"] == {"4": 2, "8": 1, "16": 1}
    assert s["target_modules"] == ["proj_in", "q_proj", "v_proj"]
    data = json.loads(report.to_json())
    assert {e["code"] for e in data["errors"]} == {"unknown_dtype", "missing_weights"}
    assert len(data["adapters"]) == 4


def test_kohya_alpha_is_read_from_its_scalar(fleet):
    a = lorafast.inspect(fleet / "kohya" / "style.safetensors")
    (m,) = a.modules
    assert (m.alpha, m.rank, m.scale) == (2.0, 4, 0.5)
    assert a.format == lorafast.AdapterFormat.KOHYA and "kohya_alpha" in a.flags


def test_every_problem_kind_is_reported_at_once(tmp_path):
    key = "base_model.model.model.layers.0.self_attn"
    d = peft(tmp_path / "messy", r=8, layers=1, modules=("q_proj",), config={
        "target_modules": ["q_proj", "k_proj", "o_proj"], "rank_pattern": {"o_proj": 4}}, extra={
        f"{key}.k_proj.lora_A.weight": ("BF16", (8, 32)),  # A without B
        f"{key}.v_proj.lora_B.weight": ("BF16", (32, 8)),  # B without A
        f"{key}.o_proj.lora_A.weight": ("BF16", (8, 32)),  # rank 8 vs rank_pattern 4, and A/B mismatch
        f"{key}.o_proj.lora_B.weight": ("F16", (32, 6)),  # dtype mismatch
        f"{key}.up_proj.lora_A.weight": ("BF16", (8, 32)),  # not in target_modules
        f"{key}.up_proj.lora_B.weight": ("BF16", (32, 8)),
        "some.random.tensor": ("F32", (2,)),  # unknown name
    })  # fmt: skip
    codes = [p.code for p in lorafast.inspect(d).problems]
    for code in ("missing_lora_b", "missing_lora_a", "rank_mismatch", "config_rank_mismatch", "dtype_mismatch",
                 "target_modules_mismatch", "unknown_tensor"):  # fmt: skip
        assert code in codes, (code, codes)


def test_content_hash_ignores_metadata(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    arr = {"m.lora_A.weight": np.arange(8, dtype=np.float32).reshape(2, 4),
           "m.lora_B.weight": np.ones((4, 2), dtype=np.float32)}  # fmt: skip
    write_safetensors(a, arr, metadata={"x": "1"})
    write_safetensors(b, arr, metadata={"x": "2", "y": "3"})
    ha, hb = (lorafast.inspect(p, content_hash=True).content_hash for p in (a, b))
    assert ha == hb and len(ha) == 64
    assert lorafast.inspect(a).content_hash is None
    report = lorafast.scan([tmp_path], content_hash=True)
    assert {report.record(i)["content_hash"] for i in range(2)} == {ha}


def test_threads_option_and_env_give_same_result(fleet):
    base = lorafast.scan([fleet]).columns()
    one = lorafast.scan([fleet], threads=1).columns()
    assert all(np.array_equal(base[k], one[k]) for k in base)
    code = "import lorafast, sys; print(len(lorafast.scan([sys.argv[1]])))"
    out = subprocess.run([sys.executable, "-c", code, str(fleet)], env={**os.environ, "LORAFAST_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "6"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_scan_after_fork_does_not_deadlock(fleet):
    code = (
        "import os, sys, lorafast\n"
        "found = len(lorafast._core.discover([sys.argv[1]]))\n"
        "lorafast.scan([sys.argv[1]])\n"  # start the pool in the parent
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = len(lorafast.scan([sys.argv[1]])) == 6 and len(lorafast._core.discover([sys.argv[1]])) == found\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(fleet)], capture_output=True, text=True, timeout=60,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "0"


def test_cli_exit_codes_and_json(fleet, tmp_path, capsys):
    assert cli_main(["scan", str(fleet / "team-a"), "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["adapters"] == 2 and data["errors"] == []
    assert cli_main(["scan", str(fleet), "--quiet"]) == 1
    assert "unknown_dtype" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli_main(["scan"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli_main(["scan", "--threads", "x", str(fleet)])
    assert info.value.code == 2
    assert cli_main(["inspect", str(fleet / "team-a" / "good"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rank"] == 16
    assert cli_main(["inspect", str(fleet / "broken" / "bad.safetensors")]) == 1
    assert "unknown_dtype" in capsys.readouterr().err


def test_python_dash_m_and_sample_round_trip(tmp_path):
    out = tmp_path / "samples"
    run = subprocess.run([sys.executable, "-m", "lorafast", "sample", "--out", str(out), "-n", "60"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "lorafast", "scan", str(out), "--json", "--summary-only"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)["summary"]
    assert summary["adapters"] == 60 and summary["failed"] == 0
    assert {"peft", "kohya", "diffusers", "lycoris", "xlabs", "ai_toolkit", "diffusers_legacy"} <= set(
        summary["formats"]
    )
    assert {"dense", "per_expert_2d", "stacked_3d", "shared_outer", "peft_target_parameters"} <= set(
        summary["moe_layouts"]
    )
    assert run.stderr == ""  # no progress bar when stderr is not a terminal


def test_symlinked_folders_are_not_followed(fleet):
    (fleet / "team-a" / "loop").symlink_to(fleet, target_is_directory=True)
    (fleet / "alias").symlink_to(fleet / "team-a" / "good", target_is_directory=True)
    report = lorafast.scan([fleet], progress=False)
    names = {os.path.relpath(p, fleet) for p in report.paths}
    assert "alias" not in names and not any(n.startswith("team-a/loop") for n in names)
    assert len(report) == 6
    found = {os.path.relpath(p, fleet): code for p, code in lorafast._core.discover([str(fleet)])}
    assert found == {"team-a/good": None, "team-a/dora": None, "team-b/nested/deep": None, "kohya": None,
                     "broken": None, "team-b/no-weights": "missing_weights"}  # fmt: skip


def test_a_folder_named_like_the_config_is_not_a_config(tmp_path):
    odd = tmp_path / "odd"
    (odd / "adapter_config.json").mkdir(parents=True)
    peft(odd / "inner", r=4)
    report = lorafast.scan([tmp_path], progress=False)
    assert [os.path.relpath(p, tmp_path) for p in report.paths] == ["odd/inner"] and not report.errors
    found = lorafast._core.discover([str(tmp_path)])
    assert [(os.path.relpath(p, tmp_path), code) for p, code in found] == [("odd/inner", None)]


def test_modules_built_from_core_dicts_equal_dataclass_construction(fleet):
    import dataclasses

    from lorafast.adapter import LoraModule

    names = [f.name for f in dataclasses.fields(LoraModule)]
    adapter = lorafast.inspect(fleet / "team-a" / "dora")
    assert adapter.modules
    for m in adapter.modules:
        # The core fills the slots directly: every field set, nothing else held.
        assert type(m) is LoraModule and not hasattr(m, "__dict__")
        fields = {name: getattr(m, name) for name in names}
        rebuilt = LoraModule(**fields)
        assert rebuilt == m and hash(rebuilt) == hash(m) and repr(rebuilt) == repr(m)
        assert pickle.loads(pickle.dumps(m)) == m and copy.copy(m) == m and dataclasses.replace(m) == m
        with pytest.raises(dataclasses.FrozenInstanceError):
            m.rank = 1


def test_make_modules_refuses_a_class_whose_slots_are_not_the_fields():
    import dataclasses

    from lorafast import _core
    from lorafast.adapter import LoraModule

    module = {f.name: None for f in dataclasses.fields(LoraModule)}
    (m,) = _core.make_modules(LoraModule, [module])
    assert m == LoraModule(**module)
    with pytest.raises(KeyError, match="weight_file"):
        _core.make_modules(LoraModule, [{k: v for k, v in module.items() if k != "weight_file"}])

    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        name: str

    @dataclasses.dataclass(frozen=True, slots=True)
    class TooFew:
        name: str
        key: str

    class Sub(LoraModule):  # a subclass's own slots do not hold the fields
        __slots__ = ("more",)

    for cls in (NoSlots, TooFew, Sub):
        with pytest.raises(TypeError, match="cannot hold LoraModule fields"):
            _core.make_modules(cls, [module])
