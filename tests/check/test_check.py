"""lorafast.check / read_base / identify: adapters against base models, from headers only.

The bases and adapters are tiny models made here by transformers, diffusers and PEFT. Every LLM verdict is
compared with PEFT loading the adapter onto a meta-device model built from the base config.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lorafast
import pytest
from lorafast.base import BaseModelError, read_base
from lorafast.checker import VERDICTS, check
from lorafast.cli import main
from lorafast.families import identify, rank_families
from lorafast.testing import write_safetensors

pytestmark = pytest.mark.slow

cf = pytest.importorskip("helpers.check_fixtures")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    torch.manual_seed(0)
    llama, qwen = cf.make_llama(root / "llama"), cf.make_qwen2(root / "qwen2")
    llava, moe = cf.make_llava(root / "llava"), cf.make_moe(root / "moe")
    z = {name: root / name for name in ("llama", "qwen2", "llava", "moe")}
    z["a_llama"] = cf.peft_adapter(llama, root / "a_llama", ["q_proj", "v_proj", "down_proj"])
    z["a_qwen"] = cf.peft_adapter(qwen, root / "a_qwen", ["q_proj", "v_proj"])
    z["a_llava"] = cf.peft_adapter(llava, root / "a_llava", r".*language_model.*\.(q_proj|v_proj)")
    z["a_moe"] = cf.peft_adapter(moe, root / "a_moe", ["q_proj", "k_proj"])
    z["a_moe_experts"] = cf.peft_adapter(moe, root / "a_moe_experts", ["q_proj"],
                                         target_parameters=["experts.gate_up_proj"])  # fmt: skip
    return z


LLM_BASES = ("llama", "qwen2", "llava", "moe")
LLM_ADAPTERS = ("a_llama", "a_qwen", "a_llava", "a_moe", "a_moe_experts")
#: (adapter, base) -> verdict; everything not listed is checked against PEFT only
EXPECTED = {
    ("a_llama", "llama"): "ok", ("a_qwen", "qwen2"): "ok", ("a_llava", "llava"): "ok", ("a_moe", "moe"): "ok",
    ("a_moe_experts", "moe"): "ok",
    ("a_qwen", "llama"): "shape_mismatch", ("a_llama", "qwen2"): "shape_mismatch",
    ("a_llama", "llava"): "no_match",  # the CausalLM adapter on the multimodal wrapper
    ("a_llava", "llama"): "no_match",
    ("a_llama", "moe"): "partial",  # down_proj is inside the experts there
    ("a_moe", "llama"): "ok",  # same attention shapes: q/k fit a Llama of the same width
}  # fmt: skip


def peft_verdict(base_dir: Path, adapter_dir: Path) -> str:
    """What PEFT does: inject the adapter into a meta-device model of the base config and load its tensors."""
    import transformers
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    lcfg = LoraConfig.from_pretrained(adapter_dir)
    try:
        with warnings.catch_warnings():  # PEFT warns about target_parameters it cannot find; what loads decides
            warnings.simplefilter("ignore", RuntimeWarning)
            inject_adapter_in_model(lcfg, model, low_cpu_mem_usage=True)
    except ValueError as e:
        if "not found" in str(e) or "match" in str(e):
            return "no_match"
        raise
    sd = load_file(adapter_dir / "adapter_model.safetensors")
    try:
        res = set_peft_model_state_dict(model, sd, low_cpu_mem_usage=True)
    except RuntimeError as e:
        assert "size mismatch" in str(e)
        return "shape_mismatch"
    lora_keys = [k for k in sd if "lora_" in k]
    unexpected = [k for k in res.unexpected_keys if "lora_" in k]
    if not unexpected:
        return "ok"
    return "no_match" if len(unexpected) == len(lora_keys) else "partial"


def test_llm_verdicts_agree_with_peft(zoo: dict[str, Path]) -> None:
    report = check([zoo[a] for a in LLM_ADAPTERS], [zoo[b] for b in LLM_BASES])
    assert len(report) == len(LLM_ADAPTERS) * len(LLM_BASES)
    for r in report:
        a = Path(r.adapter).name
        b = Path(r.base).name
        if (a, b) in EXPECTED:
            assert r.verdict == EXPECTED[a, b], (a, b, r.hint)
        ours = r.verdict
        peft = peft_verdict(zoo[b], zoo[a])
        # no size mismatch exactly when lorafast says ok or partial (or no_match: nothing is loaded at all)
        assert (peft == "shape_mismatch") == (ours == "shape_mismatch"), (a, b, peft, ours, r.hint)
        if ours != "shape_mismatch":
            assert peft == ours, (a, b, peft, ours, r.hint)


def test_multimodal_prefix_caught(zoo: dict[str, Path]) -> None:
    r = next(iter(check(zoo["a_llama"], zoo["llava"])))
    assert r.verdict == "no_match" and r.matched == 0
    assert "'model.language_model.'" in (r.hint or "") and "'model.'" in (r.hint or "")
    mod = r.modules[0]
    assert mod.status == "prefix_only" and mod.weight is not None and mod.weight.startswith("model.language_model.")
    assert mod.expected == mod.actual  # the shapes would fit: only the path is wrong
    # the adapter made on the wrapper itself fits; the engine accepts the CausalLM one and serves the base model
    assert next(iter(check(zoo["a_llava"], zoo["llava"]))).verdict == "ok"
    eng = next(iter(check(zoo["a_llama"], zoo["llava"], engine="vllm"))).engine
    assert eng is not None and eng.outcome == "not_applied" and "serves the base model" in (eng.note or "")


def test_module_detail_and_shapes(zoo: dict[str, Path]) -> None:
    r = next(iter(check(zoo["a_qwen"], zoo["llama"])))
    bad = [m for m in r.modules if m.status == "shape_mismatch"]
    assert bad and bad[0].expected == (48, 48) and bad[0].actual == (32, 32)
    assert bad[0].weight == "model.layers.0.self_attn.q_proj.weight"
    r = next(iter(check(zoo["a_moe_experts"], zoo["moe"])))
    experts = [m for m in r.modules if "experts" in m.module]
    assert experts and all(m.status == "ok" for m in experts)
    assert experts[0].actual == (4, 96, 32)  # fused from the per-expert w1/w3 the checkpoint stores


def test_fleet_columns_and_best_base(zoo: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    fleet = tmp_path / "fleet"
    for i in range(6):  # copies share one structure: classified once
        shutil.copytree(zoo[LLM_ADAPTERS[i % 3]], fleet / f"a{i}")
    (fleet / "broken").mkdir()
    (fleet / "broken" / "adapter_config.json").write_text("{}")
    bases = [read_base(zoo[b]) for b in LLM_BASES]
    report = lorafast.check(lorafast.scan(fleet), bases=bases)
    cols = report.columns()
    n = len(report.adapters)
    assert n == 7 and all(len(c) == n * len(bases) for c in cols.values())
    names = [Path(p).name for p in report.adapters]
    v = report.verdicts()
    assert v.shape == (7, 4)
    for i, name in enumerate(names):
        if name == "broken":
            assert set(v[i].tolist()) == {VERDICTS.index("error")}
            assert report.best_base[i] is None
            continue
        src = LLM_ADAPTERS[int(name[1:]) % 3]
        want = {"a_llama": "llama", "a_qwen": "qwen2", "a_llava": "llava"}[src]
        assert Path(report.best_base[i] or "").name == want
    assert report.failed
    assert report.summary()["verdicts"]["ok"] == 6


def test_diffusers_pipelines(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    unet = cf.make_unet_pipeline(tmp_path / "sd")
    dit = cf.make_dit_pipeline(tmp_path / "flux")
    sd = read_base(tmp_path / "sd")
    assert sd.kind == "pipeline" and set(sd.components) == {"unet", "text_encoder"}
    assert sd.components["unet"].kind == "sharded"
    assert any(k.startswith("unet.down_blocks.0.attentions.0") for k in sd.weights)
    good = cf.diffusers_lora(unet, tmp_path / "l_unet", "unet", ["to_q", "to_k", "to_v"])
    flux_lora = cf.diffusers_lora(dit, tmp_path / "l_flux", "transformer", ["to_q", "to_k"])
    kohya = cf.kohya_unet_lora(unet, tmp_path / "kohya.safetensors")
    kohya_xl = cf.kohya_unet_lora(unet, tmp_path / "kohya_other_width.safetensors", scale_in=2)
    report = check([good, flux_lora, kohya, kohya_xl], [tmp_path / "sd", tmp_path / "flux"])
    got = {(Path(r.adapter).parent.name if r.adapter.endswith("weights.safetensors") else Path(r.adapter).stem,
            Path(r.base).name): r for r in report}  # fmt: skip
    assert got["l_unet", "sd"].verdict == "ok"
    assert got["kohya", "sd"].verdict == "ok"
    # a LoRA for another cross-attention width (SD 1.5 on SDXL): attn2.to_k/to_v do not fit
    r = got["kohya_other_width", "sd"]
    assert r.verdict == "shape_mismatch" and all("attn2" in m.module for m in r.modules if m.status != "ok")
    assert got["l_flux", "flux"].verdict == "ok"
    # keys naming a component the pipeline lacks map nowhere
    r = got["l_flux", "sd"]
    assert r.verdict == "no_match" and "no transformer component" in (r.hint or "")
    assert got["l_unet", "flux"].verdict == "no_match"

    # PEFT on a meta-device UNet of the pipeline's config agrees, for the right LoRA and for one made on a UNet
    # of another cross-attention width
    wide = cf.diffusers_lora(cf.tiny_unet(cross_attention_dim=24), tmp_path / "l_wide", "unet", ["to_k", "to_v"])
    r = next(iter(check(wide, sd)))
    assert r.verdict == "shape_mismatch" and {m.status for m in r.modules} == {"ok", "shape_mismatch"}
    assert peft_unet_verdict(tmp_path / "sd" / "unet", wide) == "shape_mismatch"
    assert peft_unet_verdict(tmp_path / "sd" / "unet", good) == "ok"


def peft_unet_verdict(unet_dir: Path, lora: Path) -> str:
    """PEFT's load of a diffusers-format UNet LoRA (its `unet.` keys) onto a meta-device UNet of that config."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(unet_dir))
    sd = {k.removeprefix("unet."): v for k, v in load_file(lora).items()}
    r = next(iter(sd.values())).shape[0]
    inject_adapter_in_model(LoraConfig(r=r, target_modules=["to_q", "to_k", "to_v"]), unet, low_cpu_mem_usage=True)
    try:
        res = set_peft_model_state_dict(unet, sd, low_cpu_mem_usage=True)
    except RuntimeError as e:
        assert "size mismatch" in str(e)
        return "shape_mismatch"
    return "no_match" if any("lora_" in k for k in res.unexpected_keys) else "ok"


def test_single_file_diffusion_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "sd15.safetensors"
    write_safetensors(ckpt, {
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": ("F16", (320, 768)),
        "model.diffusion_model.input_blocks.1.1.proj_in.weight": ("F16", (320, 320, 1, 1)),
        "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight": ("F16", (768, 768)),
        "first_stage_model.decoder.conv_in.weight": ("F16", (512, 4, 3, 3)),
    })  # fmt: skip
    base = read_base(ckpt)
    assert base.kind == "single_file_diffusion" and set(base.components) == {"unet", "text_encoder", "vae"}
    lora = tmp_path / "lora.safetensors"
    key = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn2_to_k"
    te = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    write_safetensors(
        lora,
        {
            f"{key}.lora_down.weight": ("F16", (4, 768)),
            f"{key}.lora_up.weight": ("F16", (320, 4)),
            f"{te}.lora_down.weight": ("F16", (4, 768)),
            f"{te}.lora_up.weight": ("F16", (768, 4)),
        },
    )
    r = next(iter(check(lora, base)))
    assert r.verdict == "ok", r.modules


def test_quantized_weights_reported(tmp_path: Path) -> None:
    d = tmp_path / "q"
    d.mkdir()
    write_safetensors(d / "model.safetensors", {
        "model.layers.0.self_attn.q_proj.weight": ("F8_E4M3", (64, 64)),
        "model.layers.0.self_attn.q_proj.weight_scale_inv": ("F32", (1, 1)),
        "model.layers.0.self_attn.k_proj.qweight": ("I32", (8, 32)),
        "model.layers.0.self_attn.k_proj.scales": ("F16", (1, 32)),
        "model.layers.0.mlp.experts.gate_up_proj_blocks": ("U8", (4, 256, 2, 16)),
        "model.layers.0.mlp.experts.gate_up_proj_scales": ("U8", (4, 256, 2)),
        "model.layers.0.self_attn.v_proj.weight": ("U8", (512, 1)),  # bitsandbytes 4-bit: no shape in the header
        "model.layers.0.self_attn.v_proj.weight.absmax": ("F32", (16,)),
    })  # fmt: skip
    (d / "config.json").write_text(json.dumps({"architectures": ["X"], "quantization_config": {
        "quant_method": "gptq", "bits": 4}}))  # fmt: skip
    base = read_base(d)
    w = base.weights
    assert w["model.layers.0.self_attn.q_proj.weight"].quantized == "fp8"
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # GPTQ: 8 int4 per int32 along in
    assert w["model.layers.0.self_attn.k_proj.weight"].quantized == "int4"
    assert w["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 256, 64)
    assert w["model.layers.0.mlp.experts.gate_up_proj"].quantized == "mxfp4"
    lora = tmp_path / "a.safetensors"
    k = "base_model.model.model.layers.0.self_attn.k_proj"
    write_safetensors(lora, {f"{k}.lora_A.weight": ("BF16", (4, 64)), f"{k}.lora_B.weight": ("BF16", (32, 4))})
    assert next(iter(check(lora, base))).verdict == "ok"
    assert w["model.layers.0.self_attn.v_proj.weight"].quantized == "bnb_4bit"
    assert w["model.layers.0.self_attn.v_proj.weight"].shape is None
    v = "base_model.model.model.layers.0.self_attn.v_proj"
    write_safetensors(lora, {f"{v}.lora_A.weight": ("BF16", (4, 64)), f"{v}.lora_B.weight": ("BF16", (64, 4))})
    r = next(iter(check(lora, base)))
    assert r.verdict == "ok" and r.modules[0].status == "unverified" and "bnb_4bit" in (r.modules[0].hint or "")


def test_bad_bases_name_the_file(zoo: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(zoo["llama"], dst)
        return dst

    d = copy("missing_shard")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(BaseModelError, match=shard.name) as e:
        read_base(d)
    assert e.value.code == "missing_shard"
    d = copy("index_absent")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(BaseModelError, match="model-99999-of-99999"):
        read_base(d)
    d = copy("no_config")
    (d / "config.json").unlink()
    with pytest.raises(BaseModelError, match="config.json") as e:
        read_base(d)
    assert e.value.code == "missing_config"
    d = copy("bad_header")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(lorafast.HeaderError, match=shard.name):
        read_base(d)
    with pytest.raises(FileNotFoundError):
        read_base(tmp_path / "nowhere")


def test_large_base_header(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    write_safetensors(path, {f"model.layers.{i // 10}.mlp.m{i % 10}.weight": ("BF16", (2, 2)) for i in range(100_000)})
    base = read_base(path)
    assert base.num_weights == 100_000 and base.kind == "checkpoint"


def _synthetic(tmp_path: Path, name: str, dims: dict[str, tuple[int, int]], layers: int = 2,
               extra: dict[str, Any] | None = None) -> Path:  # fmt: skip
    t: dict[str, Any] = {}
    for layer in range(layers):
        for m, (fin, fout) in dims.items():
            blk = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            k = f"base_model.model.model.layers.{layer}.{blk}.{m}"
            t[f"{k}.lora_A.weight"] = ("BF16", (8, fin))
            t[f"{k}.lora_B.weight"] = ("BF16", (fout, 8))
    t.update(extra or {})
    path = tmp_path / f"{name}.safetensors"
    write_safetensors(path, t)
    return path


def test_identify_families(tmp_path: Path) -> None:
    eight_b = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "gate_proj": (4096, 14336)}
    a = _synthetic(tmp_path, "8b", eight_b)
    adapter = lorafast.inspect(a)
    assert adapter.fingerprint == {"hidden": 4096, "q_out": 4096, "kv_out": 1024, "intermediate": 14336, "layers": 2}
    ident = identify(adapter)
    assert ident.best is None and set(ident.ambiguous) == {"Llama-3.1-8B", "Mistral-7B-v0.3"}
    emb = "base_model.model.model.embed_tokens"
    a = _synthetic(tmp_path, "8b_emb", eight_b, extra={f"{emb}.lora_embedding_A": ("BF16", (8, 128256)),
                                                       f"{emb}.lora_embedding_B": ("BF16", (4096, 8))})  # fmt: skip
    assert identify(lorafast.inspect(a)).best == "Llama-3.1-8B"
    a = _synthetic(tmp_path, "qwen3_8b", {"q_proj": (4096, 4096), "gate_proj": (4096, 12288)})
    assert identify(lorafast.inspect(a)).best == "Qwen3-8B"
    assert identify(lorafast.inspect(_synthetic(tmp_path, "none", {"q_proj": (100, 100)}))).candidates == ()
    # DiTs: FLUX.1 and HunyuanVideo share widths; the block counts tell them apart
    assert set(rank_families({"dit_hidden": 3072, "dit_ff": 12288}).ambiguous) >= {"FLUX.1", "HunyuanVideo"}
    assert rank_families({"dit_hidden": 3072, "dit_ff": 12288, "dit_blocks": 20, "dit_single_blocks": 40}).best == (
        "HunyuanVideo"
    )
    assert rank_families({"cross_attention": 2048}).best == "SDXL"


def test_cli_exit_codes(zoo: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    assert main(["check", "--base", str(zoo["llama"]), str(zoo["a_llama"])]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["check", "--base", str(zoo["llava"]), str(zoo["a_llama"]), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["pairs"][0]["verdict"] == "no_match" and "model.language_model." in out["pairs"][0]["hint"]
    assert main(["check", "--base", str(zoo["llama"]), str(zoo["a_llama"]), "--engine", "sglang"]) == 0
    assert "sglang: accepted" in capsys.readouterr().out
    assert main(["check", "--base", os.fspath(zoo["llama"]) + "-missing", str(zoo["a_llama"])]) == 1
    capsys.readouterr()
    assert main(["check", str(zoo["a_llama"]), "--json"]) == 0  # no base: the likely families, from shapes
    ident = json.loads(capsys.readouterr().out)["identified"][0]
    assert ident["fingerprint"]["hidden"] == 32 and ident["candidates"] == []


def test_remote_bases_over_http_and_hf(zoo: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    servers = pytest.importorskip("helpers.servers")
    site = tmp_path / "site"
    shutil.copytree(zoo["llava"], site / "llava")
    shutil.copytree(zoo["llama"], site / "org" / "llama")
    server = servers.RangeServer(str(site), delay=1.0)
    try:
        local = read_base(zoo["llava"])
        remote = read_base(f"{server.url}/ok/llava", timeout=5)
        assert remote.kind == "sharded" and remote.weights.keys() == local.weights.keys()
        assert [w.shape for w in remote.weights.values()] == [w.shape for w in local.weights.values()]
        assert remote.config == local.config
        r = next(iter(check(zoo["a_llama"], remote)))
        assert r.verdict == "no_match" and "model.language_model." in (r.hint or "")
        monkeypatch.setenv("HF_ENDPOINT", f"{server.url}/hf")
        hub = read_base("hf://org/llama@main", timeout=5)
        assert hub.weights.keys() == read_base(zoo["llama"]).weights.keys()
        assert next(iter(check(zoo["a_llama"], hub))).verdict == "ok"
        with pytest.raises(FileNotFoundError):
            read_base(f"{server.url}/ok/nothing-here.safetensors", timeout=5)
    finally:
        server.stop()


def test_engine_rejection_text_per_adapter(zoo: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    for name in ("d1", "d2"):  # two copies: one structure, one engine run, each named in its own message
        shutil.copytree(zoo["a_llama"], tmp_path / name)
        cfg = json.loads((tmp_path / name / "adapter_config.json").read_text())
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    report = check([tmp_path / "d1", tmp_path / "d2"], zoo["llama"], engine="sglang")
    results = list(report)
    assert [r.verdict for r in results] == ["ok", "ok"]  # the shapes fit; the engine refuses DoRA
    for r in results:
        assert r.engine is not None and r.engine.outcome == "rejected"
        assert any("DoRA" in e or "dora" in e for e in r.engine.errors)
        other = "d2" if r.adapter.endswith("d1") else "d1"
        assert all(other not in e for e in r.engine.errors), r.engine.errors
        assert any(Path(r.adapter).name in e for e in r.engine.errors)
    assert report.failed


def test_engine_outcome_uses_the_servers_rank_limit(zoo: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's default --max-lora-rank is 16: a rank-32 adapter is rejected unless the server says otherwise."""
    import lorafast.testing

    big = tmp_path / "big"
    a = lorafast.inspect(zoo["a_llama"])
    tensors = {}
    for m in a.modules:
        tensors[m.a_key] = ("F32", (32, m.a_shape[1]))
        tensors[m.b_key] = ("F32", (m.b_shape[0], 32))
    lorafast.testing.write_peft_adapter(big, tensors, r=32, lora_alpha=64, target_modules=list(a.target_modules))
    (pair,) = list(check([big], zoo["llama"], engine="vllm", engine_version="0.34.0"))
    assert pair.verdict == "ok" and pair.engine is not None and pair.engine.outcome == "rejected"
    assert pair.engine.errors == ("LoRA rank 32 is greater than max_lora_rank 16.",)
    (pair,) = list(check([big], zoo["llama"], engine="vllm", engine_version="0.34.0", max_lora_rank=32))
    assert pair.engine is not None and pair.engine.outcome == "accepted"
    assert main(["check", str(big), "--engine", "vllm"]) == 2  # --engine needs --base
