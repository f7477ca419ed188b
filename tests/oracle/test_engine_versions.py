"""Engine versions: one list of verified releases, honest answers for the others, and the upgrade check."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lorafast
import lorafast.checker
import pytest
from lorafast.cli import main
from lorafast.compat import _versions, diff_versions, engine_rules, sglang, vllm
from lorafast.testing import write_peft_adapter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
import engines  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

LLAMA = {f"base_model.model.model.layers.0.self_attn.{p}.lora_{s}.weight": ("F32", sh)
         for p in ("q_proj", "v_proj") for s, sh in (("A", [8, 64]), ("B", [64, 8]))}  # fmt: skip


def adapter(tmp_path: Path, name: str, tensors: dict[str, Any] | None = None, **config: Any) -> str:
    folder = tmp_path / name
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA", **config}
    write_peft_adapter(folder, tensors or LLAMA, **cfg)
    return str(folder)


# --- which rules answer -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "asked", "rules", "status"),
    [
        ("vllm", "0.34.0", "0.34.0", "verified"),
        ("vllm", "0.34", "0.34.0", "verified"),
        ("vllm", "0.33.0+cu128", "0.33.0", "verified"),  # a local build label is the same release
        ("vllm", "0.34.0rc1", "0.34.0", "nearest: 0.34.0"),
        ("vllm", "0.35.0", "0.34.0", "nearest: 0.34.0"),
        ("vllm", "1.0.0", "0.34.0", "nearest: 0.34.0"),
        ("vllm", "0.31.0", "0.33.0", "nearest: 0.33.0"),  # between two verified releases: the newer one's rules
        ("vllm", "0.29.0", "0.30.0", "older than 0.30.0"),
        ("sglang", "0.5.24", "0.5.23", "nearest: 0.5.23"),
        ("sglang", "9.9.9", "0.5.23", "nearest: 0.5.23"),
        ("sglang", "0.5.22", "0.5.23", "older than 0.5.23"),
    ],
)
def test_rules_and_status(engine: str, asked: str, rules: str, status: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = engine_rules(engine, asked)
    assert (got.rules, got.status, got.verified) == (rules, status, status == "verified")
    assert got.to_dict() == {"engine": engine, "requested": asked, "rules": rules, "verified": got.verified,
                             "status": status}  # fmt: skip


@pytest.mark.parametrize("bad", ["banana", "", "latest", "0.x", "v", "1..2"])
def test_a_string_that_is_not_a_version_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="not an engine version"):
        engine_rules("vllm", bad)


def test_gates_follow_the_rules_version() -> None:
    # 0.31.0 is answered with 0.33.0's rules, 0.35.0 with 0.34.0's; 0.5.22 keeps the older rules lorafast knows
    assert _versions.at_least("vllm", "0.31.0", "0.33.0")
    assert _versions.at_least("vllm", "0.35.0", "0.34.0")
    assert not _versions.at_least("vllm", "0.30.0", "0.31.0")
    assert not _versions.at_least("sglang", "0.5.22", "0.5.23")


# --- every answer says which version answered ------------------------------------------------------------------


def test_preflights_carry_the_version_and_warn_when_unverified(tmp_path: Path) -> None:
    path = adapter(tmp_path, "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a verified version never warns
        s = sglang.preflight([path], collect=True, engine_version="0.5.23")
        v = vllm.preflight([path], collect=True, engine_version="0.34.0")
    assert s.engine_version.status == v.engine_version.status == "verified"
    assert s.verdict == v.verdict == "ok"
    assert s.to_dict()["engine_version"]["status"] == "verified"

    with pytest.warns(lorafast.UnverifiedEngineVersion, match="vllm 0.35.0 is not a version lorafast has verified"):
        v = vllm.preflight([path], collect=True, engine_version="0.35.0")
    assert v.ok and v.verdict == "unknown" and v.engine_version.status == "nearest: 0.34.0"
    with pytest.warns(lorafast.UnverifiedEngineVersion, match="sglang 0.5.24"):
        s = sglang.preflight([path], collect=True, engine_version="0.5.24")
    assert s.ok and s.verdict == "unknown" and s.to_dict()["engine_version"]["status"] == "nearest: 0.5.23"
    # a set that fails is "fails" whatever the version's status
    with pytest.warns(lorafast.UnverifiedEngineVersion):
        v = vllm.preflight([adapter(tmp_path, "r32", r=32)], collect=True, engine_version="0.35.0")
    assert v.verdict == "fails"


def test_strict_version_refuses(tmp_path: Path) -> None:
    path = adapter(tmp_path, "a")
    for call in (
        lambda: vllm.preflight([path], collect=True, engine_version="0.35.0", strict_version=True),
        lambda: sglang.preflight([path], collect=True, engine_version="9.9.9", strict_version=True),
        lambda: lorafast.plan({"lora_nickname": "a", "lora_path": path}, engine_version="0.5.24", strict_version=True),
        lambda: diff_versions("vllm", "0.33.0", "0.35.0", [path], strict_version=True),
    ):
        with pytest.raises(lorafast.UnverifiedEngineVersionError, match="strict_version=True refuses it"):
            call()
    # verified versions pass under strict
    assert vllm.preflight([path], collect=True, engine_version="0.33.0", strict_version=True).verdict == "ok"


def test_plan_and_check_carry_the_status(tmp_path: Path) -> None:
    path = adapter(tmp_path, "a")
    p = lorafast.plan({"lora_nickname": "a", "lora_path": path}, engine_version="0.5.23")
    assert p.version_status == "verified" and p.to_dict()["version_status"] == "verified"
    with pytest.warns(lorafast.UnverifiedEngineVersion):
        p = lorafast.plan({"lora_nickname": "a", "lora_path": path}, engine_version="0.5.24")
    assert p.version_status == "nearest: 0.5.23" and "not verified by lorafast" in p.explain()

    base = tmp_path / "base"
    base.mkdir()
    weights = {f"model.layers.0.self_attn.{m}.weight": ("F32", [64, 64]) for m in ("q_proj", "k_proj", "v_proj")}
    from lorafast.testing import write_safetensors

    write_safetensors(base / "model.safetensors", weights)
    (base / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    ok = lorafast.check([path], str(base), engine="vllm", engine_version="0.34.0")
    (pair,) = list(ok)
    assert pair.engine is not None and pair.engine.outcome == "accepted" and pair.engine.version_status == "verified"
    with pytest.warns(lorafast.UnverifiedEngineVersion):
        report = lorafast.check([path], str(base), engine="vllm", engine_version="0.35.0")
    (pair,) = list(report)
    assert pair.engine is not None and pair.engine.outcome == "unknown"
    assert pair.engine.version_status == "nearest: 0.34.0" and report.failed
    assert json.loads(report.to_json())["pairs"][0]["engine"]["version_status"] == "nearest: 0.34.0"


# --- the CLI ---------------------------------------------------------------------------------------------------


def test_cli_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = adapter(tmp_path, "a")
    for argv in (
        ["preflight", "vllm", path, "--engine-version", "banana"],
        ["check", path, "--base", path, "--engine", "vllm", "--engine-version", "banana"],
        ["plan", "-a", f"a={path}", "--engine-version", "banana"],
        ["upgrade-check", "--engine", "vllm", "--from", "0.33.0", "--to", "banana", path],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
        assert "not an engine version: 'banana'" in capsys.readouterr().err

    assert main(["preflight", "vllm", path, "--engine-version", "0.34.0"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == "ok" and "vllm 0.34.0 (verified)" in out.out and out.err == ""

    assert main(["preflight", "vllm", path, "--engine-version", "0.35.0"]) == 1  # never a silent ok
    out = capsys.readouterr()
    assert "unknown: the set passes vllm 0.34.0's rules, but 0.35.0 is not verified" in out.out
    assert out.err.startswith("lorafast: warning: vllm 0.35.0 is not a version lorafast has verified")

    assert main(["preflight", "sglang", path, "--engine-version", "0.5.24", "--strict-version"]) == 2
    assert "strict_version=True refuses it" in capsys.readouterr().err

    assert main(["preflight", "vllm", path, "--engine-version", "0.35.0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "unknown" and report["engine_version"]["status"] == "nearest: 0.34.0"


def test_engines_lists_the_verified_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engines", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {e: tuple(v) for e, v in listed.items()} == _versions.SUPPORTED
    assert any("task_type" in c for c in listed["vllm"]["0.34.0"])
    assert main(["engines"]) == 0
    assert "vllm: verified 0.30.0, 0.33.0, 0.34.0" in capsys.readouterr().out


# --- one list ------------------------------------------------------------------------------------------------


def test_every_list_of_versions_follows_compat_versions() -> None:
    pins = subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(ROOT), "--eval", "print-wheels: ; @echo $(ENGINE_WHEELS)",
         "print-wheels", f"PY={sys.executable}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert pins == _versions.wheels()
    assert {e: tuple(sorted(v)) for e, v in engines.PINNED.items()} == {
        e: tuple(sorted(v)) for e, v in _versions.SUPPORTED.items()
    }
    assert set(_versions.CHANGES) == set(_versions.SUPPORTED)
    for engine, versions in _versions.SUPPORTED.items():
        assert set(_versions.CHANGES[engine]) == set(versions)
    # the README's table names exactly the verified versions
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (SGLang \(LLM\)|vLLM) \| ([^|]+) \|", readme, re.M))
    assert [v.strip() for v in rows["vLLM"].split(",")] == list(_versions.SUPPORTED["vllm"])
    assert [v.strip() for v in rows["SGLang (LLM)"].split(",")] == list(_versions.SUPPORTED["sglang"])


# --- the upgrade check ---------------------------------------------------------------------------------------

HEAD = {
    **LLAMA,
    "base_model.model.score.weight": ("F32", [2, 64]),
}


def test_upgrade_check_finds_the_task_type_rule(tmp_path: Path) -> None:
    # 0.34.0 adds classifier/score to modules_to_save for SEQ_CLS adapters: one saved without it loads there
    seq_cls = adapter(tmp_path, "seqcls", HEAD, task_type="SEQ_CLS", modules_to_save=None)
    plain = adapter(tmp_path, "plain")
    model = {
        "expected_lora_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "classification_head": vllm.ClassificationHead("score", max_labels=2, input_size=64),
        "is_pooling_model": True,
    }
    diff = diff_versions("vllm", "0.33.0", "0.34.0", [f"cls={seq_cls}", f"plain={plain}"], **model)
    assert diff.old.verified and diff.new.verified and diff.adapters == 2
    (change,) = diff.changes
    assert change.name == "cls" and "outcome" in change.kinds
    assert change.old.outcome == "fails" and change.old.exc_type == "ValueError" and "score" in change.old.message
    assert change.new.outcome == "loads" and change.new.modules
    assert diff.summary()["unchanged"] == 1 and diff.summary()["kinds"]["outcome"] == 1


def test_upgrade_check_where_nothing_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [adapter(tmp_path, f"a{i}", r=8 * (i + 1), lora_alpha=16) for i in range(3)]
    diff = diff_versions("vllm", "0.33.0", "0.34.0", paths, max_lora_rank=32)
    assert diff.changes == () and diff.summary()["unchanged"] == 3
    assert main(["upgrade-check", "--engine", "vllm", "--from", "0.33.0", "--to", "0.34.0", "--max-lora-rank", "32",
                 *paths]) == 0  # fmt: skip
    assert "0 of 3 adapters change" in capsys.readouterr().out


def test_upgrade_check_scale_and_modules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0.30 serves every module at lora_alpha / r; 0.33 follows alpha_pattern per module
    path = adapter(tmp_path, "pattern", alpha_pattern={"q_proj": 32})
    diff = diff_versions("vllm", "0.30.0", "0.33.0", [path])
    (change,) = diff.changes
    assert change.kinds == ("scale",)
    q = next(m for m in change.old.scales if "q_proj" in m)
    assert change.old.scales[q] == 2.0 and change.new.scales[q] == 4.0
    assert main(["upgrade-check", "--engine", "vllm", "--from", "0.30.0", "--to", "0.33.0", path, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["kinds"] == {"scale": 1} and out["changes"][0]["new"]["scales"][q] == 4.0


def test_engine_diff_lists_and_diffs_the_lora_files(capsys: pytest.CaptureFixture[str]) -> None:
    import engine_diff

    assert engine_diff.main(["vllm==0.33.0", "vllm==0.34.0", "--names-only"]) == 0
    listed = capsys.readouterr().out
    assert "changed vllm/lora/peft_helper.py" in listed and "@@" not in listed
    assert engine_diff.main(["vllm==0.33.0", "vllm==0.34.0"]) == 0
    text = capsys.readouterr().out
    assert "+    task_type: str | None = field(default=None)" in text  # the 0.34.0 change lorafast implements
    assert engine_diff.main(["vllm==0.33.0", "vllm==0.33.0", "--names-only"]) == 0
    assert capsys.readouterr().out.startswith("vllm 0.33.0 -> 0.33.0: 0 changed, 0 added, 0 removed")
    with pytest.raises(SystemExit):
        engine_diff.main(["vllm==0.33.0", "sglang==0.5.23"])


def test_upgrade_check_transformers_llava_rename(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers 5 renamed Llava's modules (`language_model.model.*` -> `model.language_model.*`) and loads a
    checkpoint of 4 under the new names. A base as 5 names it serves an adapter made on 5, and not one made on 4."""
    from helpers import check_fixtures as cf
    from lorafast.testing import write_safetensors

    saved = tmp_path / "llava4"  # the installed transformers saves Llava under 4's names
    model = cf.make_llava(saved)
    v5 = cf.peft_adapter(model, tmp_path / "made-on-5", ["q_proj", "v_proj"], r=4)
    base4 = lorafast.read_base(saved)
    assert any(n.startswith("language_model.model.") for n in base4.weights)
    new = tmp_path / "llava5"
    new.mkdir()
    stored_to_loaded = {stored: loaded for loaded, stored in base4.renamed_on_load.items()}
    write_safetensors(new / "model.safetensors",
                      {stored_to_loaded.get(n, n): (w.dtype, w.shape) for n, w in base4.weights.items()})  # fmt: skip
    (new / "config.json").write_text((saved / "config.json").read_text())
    old_names = tmp_path / "made-on-4"  # the same adapter under 4's module names
    a = lorafast.inspect(v5)
    renamed = {}
    for m in a.modules:
        for key, shape in ((m.a_key, m.a_shape), (m.b_key, m.b_shape)):
            renamed[key.replace("model.language_model.", "language_model.model.")] = ("F32", shape)
    old_names.mkdir()
    write_safetensors(old_names / "adapter_model.safetensors", renamed)
    (old_names / "adapter_config.json").write_text((v5 / "adapter_config.json").read_text())

    diff = lorafast.checker.diff_bases([v5, old_names], saved, new, labels=("4.57.0", "5.0.0"))
    by = {c.name: c for c in diff.changes}
    single = {p.adapter: p.verdict for p in lorafast.check([v5, old_names], new)}
    assert single[str(v5)] == "ok" and single[str(old_names)] != "ok"
    assert set(by) == {"made-on-4"} and by["made-on-4"].old.verdict == "ok" and by["made-on-4"].new.verdict != "ok"
    assert diff.summary()["unchanged"] == 1
    assert main(["upgrade-check", "--engine", "transformers", "--from-base", str(saved), "--to-base", str(new),
                 str(v5), str(old_names)]) == 1  # fmt: skip
    assert "1 of 2 adapters change (1 verdict, 1 modules)" in capsys.readouterr().out
    assert main(["upgrade-check", "--engine", "transformers", str(v5)]) == 2
    assert "needs --from-base and --to-base" in capsys.readouterr().err
