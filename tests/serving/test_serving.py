"""`lorafast.preflight`: one verdict per adapter for the server a launch command starts, on real PEFT adapters of
tiny transformers models. The trained scale is checked against PEFT's own `LoraLayer.scaling`; the engines' side
(what they load, wrap and scale) against their released code in tests/oracle/test_oracle_serving.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import lorafast
import pytest
from lorafast.cli import main
from lorafast.serving import VERDICTS, trained_scale

pytestmark = pytest.mark.slow

cf = pytest.importorskip("helpers.check_fixtures")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving")
    llama = cf.make_llama(root / "llama")
    out = {"llama": root / "llama"}
    for name, targets, kw in (
        ("plain", ["q_proj", "v_proj"], {"r": 8}),
        ("rslora", ["q_proj", "v_proj"], {"r": 16, "use_rslora": True}),
        ("pattern", ["q_proj", "v_proj"], {"r": 8, "alpha_pattern": {"q_proj": 32}}),
        ("ranks", ["q_proj", "v_proj"], {"r": 8, "rank_pattern": {"v_proj": 4}}),
        ("big", ["q_proj", "v_proj"], {"r": 64}),
        ("mlp", ["q_proj", "v_proj", "gate_proj", "down_proj"], {"r": 8}),
    ):
        out[name] = cf.peft_adapter(llama, root / name, targets, **kw)
    llava = cf.make_llava(root / "llava")
    out["llava"] = root / "llava"
    out["multimodal"] = cf.peft_adapter(llava, root / "multimodal", ["q_proj", "v_proj"], r=8)
    return out


def verdicts(report: lorafast.serving.PreflightReport) -> dict[str, str]:
    return {a.name: a.verdict for a in report}


def vllm_cmd(fleet: dict[str, Path], *flags: str, names: tuple[str, ...] = ()) -> list[str]:
    mods = [f"{n}={fleet[n]}" for n in names]
    return ["vllm", "serve", str(fleet["llama"]), "--enable-lora", *flags, *(["--lora-modules", *mods] if mods else [])]


def test_trained_scale_is_peft_scaling(fleet: dict[str, Path]) -> None:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    for name in ("plain", "rslora", "pattern", "ranks"):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fleet["llama"]), fleet[name])
        peft_scales = {
            n.removeprefix("base_model.model."): m.scaling["default"]
            for n, m in model.named_modules()
            if isinstance(m, LoraLayer)
        }
        ours = {m.name: trained_scale(m) for m in lorafast.inspect(fleet[name]).modules}
        assert ours.keys() == peft_scales.keys(), name
        for module, scale in peft_scales.items():
            assert math.isclose(ours[module], scale, rel_tol=1e-9), (name, module, ours[module], scale)


def test_vllm_verdicts(fleet: dict[str, Path]) -> None:
    names = ("plain", "rslora", "pattern", "big", "mlp", "multimodal")
    cmd = vllm_cmd(fleet, "--max-lora-rank", "32", "--lora-target-modules", "q_proj", "v_proj", names=names)
    report = lorafast.preflight(cmd, engine_version="0.34.0")
    assert report.server_starts is True and report.base == str(fleet["llama"])
    assert verdicts(report) == {
        "plain": "serves",
        "rslora": "serves",  # vLLM 0.34 scales rsLoRA as PEFT does
        "pattern": "serves",  # and follows alpha_pattern per module
        "big": "fails",
        "mlp": "partial",  # gate_proj/down_proj are not wrapped under --lora-target-modules q_proj v_proj
        "multimodal": "silent_noop",  # model.language_model.* matches no module of the causal LM
    }
    by = {a.name: a for a in report}
    assert by["big"].stage == "load" and by["big"].exc_type == "ValueError"
    assert (
        by["big"].message == "LoRA rank 64 is greater than max_lora_rank 32." and "--max-lora-rank 64" in by["big"].fix
    )
    assert {m.rsplit(".", 1)[-1] for m, _ in by["mlp"].dropped} == {"gate_proj", "down_proj"}
    assert any("down_proj gate_proj q_proj v_proj" in f for f in by["mlp"].fix)
    assert by["multimodal"].applied == 0 and by["multimodal"].modules > 0
    assert not report.ok and report.counts()["serves"] == 3 and set(report.counts()) == set(VERDICTS)


def test_vllm_030_ignores_alpha_pattern(fleet: dict[str, Path]) -> None:
    report = lorafast.preflight(vllm_cmd(fleet, names=("plain", "pattern")), engine_version="0.30.0")
    by = {a.name: a for a in report}
    assert by["plain"].verdict == "serves" and by["pattern"].verdict == "scale_differs"
    q = next(s for s in by["pattern"].scales if s.module.endswith("q_proj"))
    assert (q.trained, q.served) == (4.0, 2.0)  # PEFT: 32 / 8; vLLM 0.30: lora_alpha / r = 16 / 8


def test_sglang_scales_every_module_by_alpha_over_r(fleet: dict[str, Path]) -> None:
    paths = " ".join(f"{n}={fleet[n]}" for n in ("plain", "rslora", "pattern"))
    cmd = f"python -m sglang.launch_server --model-path {fleet['llama']} --enable-lora --lora-paths {paths}"
    report = lorafast.preflight(cmd, engine_version="0.5.23")
    by = {a.name: a for a in report}
    assert by["plain"].verdict == "serves"
    assert by["rslora"].verdict == "scale_differs"  # SGLang: 32 / 16 = 2; PEFT rsLoRA: 32 / sqrt(16) = 8
    assert {(s.trained, s.served) for s in by["rslora"].scales} == {(8.0, 2.0)}
    assert by["pattern"].verdict == "scale_differs"
    assert all("lorafast merge" in " ".join(a.fix) for a in report if a.verdict == "scale_differs")


def test_no_base_is_unknown_never_serves(fleet: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "not-here"
    cmd = ["vllm", "serve", str(missing), "--enable-lora", "--lora-modules", f"plain={fleet['plain']}"]
    report = lorafast.preflight(cmd, engine_version="0.34.0")
    (row,) = report.adapters
    assert report.base is None and "does not exist" in (report.base_note or "")
    assert row.verdict == "unknown" and any("--base" in u for u in row.undecided)
    # a Hub id that is not in the local cache says so
    report = lorafast.preflight(["vllm", "serve", "org/absent-model", "--enable-lora",
                                 "--lora-modules", f"plain={fleet['plain']}"], engine_version="0.34.0")  # fmt: skip
    assert "not in the local Hugging Face cache" in (report.base_note or "")
    assert report.adapters[0].verdict == "unknown"


def test_base_from_the_hf_cache(fleet: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / "abc123"
    snap.parent.mkdir(parents=True)
    os.symlink(fleet["llama"], snap)
    (tmp_path / "hub" / "models--org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny-llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cmd = ["vllm", "serve", "org/tiny-llama", "--enable-lora", "--lora-modules", f"plain={fleet['plain']}"]
    report = lorafast.preflight(cmd, engine_version="0.34.0")
    assert report.base == str(snap) and report.adapters[0].verdict == "serves"


def test_unverified_version_is_unknown(fleet: dict[str, Path]) -> None:
    with pytest.warns(lorafast.UnverifiedEngineVersion):
        report = lorafast.preflight(vllm_cmd(fleet, names=("plain",)), engine_version="0.35.0")
    assert report.adapters[0].verdict == "unknown" and report.server_starts is None
    assert "0.35.0" in report.adapters[0].undecided[-1]


def test_dynamic_adapters_and_exports(fleet: dict[str, Path], tmp_path: Path) -> None:
    report = lorafast.preflight(vllm_cmd(fleet, "--max-lora-rank", "32"), [fleet["plain"], fleet["big"]],
                                engine_version="0.34.0")  # fmt: skip
    assert {(a.name, a.source, a.verdict) for a in report} == {("plain", "dynamic", "serves"),
                                                               ("big", "dynamic", "fails")}  # fmt: skip
    cols = report.columns()
    assert list(cols["verdict"]) == [a.verdict for a in report] and cols["modules"].dtype.kind == "i"
    assert cols["exc_type"][[a.name for a in report].index("plain")] is None  # never a default that looks like data
    assert report.to_pandas().shape[0] == 2 and report.to_arrow().num_rows == 2 and report.to_polars().height == 2
    report.to_parquet(tmp_path / "v.parquet")
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "v.parquet").column("verdict").to_pylist() == list(cols["verdict"])
    assert json.loads(report.to_json())["counts"]["fails"] == 1


def test_cli(fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cmd = vllm_cmd(fleet, "--max-lora-rank", "32", names=("plain", "big"))
    assert main(["preflight", "--engine-version", "0.34.0", "--", *cmd]) == 1
    out = capsys.readouterr().out
    assert "2 adapters, the server starts: 1 fails, 1 serves" in out and "fix: --max-lora-rank 64" in out
    assert main(["preflight", "--engine-version", "0.34.0", "--json", "--", *cmd]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [a["verdict"] for a in data["adapters"]] == ["serves", "fails"]
    ok = vllm_cmd(fleet, "--max-lora-rank", "64", names=("plain", "big"))
    assert main(["preflight", "--engine-version", "0.34.0", "--", *ok]) == 0
    assert "2 serves" in capsys.readouterr().out
    assert main(["preflight", "--", "nginx", "-g", "daemon off;"]) == 2
    assert "launch command" in capsys.readouterr().err


def _many(report: Any) -> None:  # pragma: no cover - helper for debugging failures
    print(report.summary())


def test_sglang_diffusion_two_adapters_on_one_target(tmp_path: Path) -> None:
    dit = cf.make_dit_pipeline(tmp_path / "pipe")
    a = cf.diffusers_lora(dit, tmp_path / "a", "transformer", ["to_q", "to_k"])
    b = cf.diffusers_lora(dit, tmp_path / "b", "transformer", ["to_q", "to_v"])
    launch = f"sglang serve --model-path {tmp_path / 'pipe'} --lora-path {a} --lora-nickname a --lora-merge-mode"
    report = lorafast.preflight(f"{launch} dynamic", [b], engine_version="0.5.23")
    assert [(r.name, r.source, r.verdict) for r in report] == [("a", "command", "fails"), ("b", "dynamic", "fails")]
    row = report.adapters[0]
    assert row.exc_type == "ValueError" and row.message == lorafast.planner.DYNAMIC_MULTI_ADAPTER_ERROR
    assert row.fix[0].startswith("--lora-merge-mode merge")
    assert {r.verdict for r in lorafast.preflight(f"{launch} merge", [b], engine_version="0.5.23")} == {"serves"}
