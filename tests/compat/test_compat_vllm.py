"""lorafast.compat.vllm: vLLM's adapter checks from headers, with vLLM's messages as literal strings."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lorafast import AdapterError
from lorafast.compat import AdapterView
from lorafast.compat import vllm as vl

P = "base_model.model.model.layers.0."


#: The config every `peft(...)` adapter of this file starts from (conftest): ATTN is rank 8.
PEFT_CONFIG = {"r": 8, "lora_alpha": 16}
ATTN = {
    P + "self_attn.q_proj.lora_A.weight": (8, 32), P + "self_attn.q_proj.lora_B.weight": (32, 8),
    P + "self_attn.v_proj.lora_A.weight": (8, 32), P + "self_attn.v_proj.lora_B.weight": (16, 8),
}  # fmt: skip
EXPECTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]


def test_parse_fine_tuned_lora_name() -> None:
    assert vl.parse_fine_tuned_lora_name(P + "self_attn.q_proj.lora_A.weight") == (
        "model.layers.0.self_attn.q_proj",
        True,
    )
    assert vl.parse_fine_tuned_lora_name("model.embed_tokens.lora_embedding_B") == ("model.embed_tokens", False)
    mapped = vl.parse_fine_tuned_lora_name(P + "mlp.w1.lora_B.weight", lambda n: n.replace(".w1.", ".gate_proj."))
    assert mapped == ("model.layers.0.mlp.gate_proj", False)
    # Without a mapper vLLM drops `base_model.model.` from the name it prints; with one, it keeps it.
    with pytest.raises(ValueError) as info:
        vl.parse_fine_tuned_lora_name("base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector")
    assert str(info.value) == "model.layers.0.mlp.down_proj.lora_magnitude_vector is unsupported LoRA weight"
    with pytest.raises(ValueError) as info:
        vl.parse_fine_tuned_lora_name("base_model.model.lm_head.weight", lambda n: n)
    assert str(info.value) == "base_model.model.lm_head.weight is unsupported LoRA weight"
    with pytest.raises(ValueError) as info:
        vl.parse_fine_tuned_lora_name("base_model.model.x.lora_A.weight", lambda n: None)
    assert str(info.value) == "Mapped LoRA weight name cannot be None."
    # 0.33 names the classification head's full weights; 0.30 rejects them.
    assert vl.parse_fine_tuned_lora_name("base_model.model.score.bias", engine_version="0.33.0") == ("score", False)
    with pytest.raises(ValueError) as info:
        vl.parse_fine_tuned_lora_name("base_model.model.score.bias", engine_version="0.30.0")
    assert str(info.value) == "score.bias is unsupported LoRA weight"
    mapper = vl.WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."})
    assert vl.parse_fine_tuned_lora_name(P + "mlp.up_proj.lora_A.weight", mapper) == (
        "language_model.model.layers.0.mlp.up_proj", True)  # fmt: skip


def test_check_unexpected_modules(peft: Callable[..., str]) -> None:
    vision = {**ATTN, "base_model.model.visual.blocks.0.attn.qkv.lora_A.weight": (8, 32),
              "base_model.model.visual.blocks.0.attn.qkv.lora_B.weight": (96, 8)}  # fmt: skip
    path = peft("vl", vision)
    vl.check_unexpected_modules(peft("ok", ATTN), EXPECTED)
    with pytest.raises(ValueError) as info:
        vl.check_unexpected_modules(path, EXPECTED)
    assert str(info.value) == (
        f"While loading {path}, expected target modules in ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', "
        "'up_proj', 'down_proj', 'embed_tokens', 'lm_head'] but received ['visual.blocks.0.attn.qkv', "
        "'visual.blocks.0.attn.qkv']. Please verify that the loaded LoRA module is correct"
    )
    # Experts compare from `experts` on; base_layer keys (PEFT target_parameters, saved embeddings) are skipped.
    moe = {P + "mlp.experts.0.gate_proj.lora_A.weight": (8, 32), P + "mlp.experts.base_layer.lora_A.weight": (32, 32),
           P + "mlp.experts.7.w1.lora_A.weight": (8, 32)}  # fmt: skip
    with pytest.raises(ValueError) as info:
        vl.check_unexpected_modules(AdapterView.from_tensors(moe, path="/moe"), ["experts.0.gate_proj"])
    assert "but received ['model.layers.0.mlp.experts.7.w1']." in str(info.value)
    with pytest.raises(ValueError) as info:
        vl.check_unexpected_modules(
            AdapterView.from_tensors({**ATTN, "base_model.model.x.lora_magnitude_vector": (8,)}), EXPECTED
        )
    assert str(info.value) == "x.lora_magnitude_vector is unsupported LoRA weight"


def test_expected_lora_modules() -> None:
    assert vl.expected_lora_modules(["qkv_proj", "o_proj", "gate_up_proj"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
    }  # fmt: skip
    # MoE models: `experts` itself is expected next to the per-expert names.
    assert vl.expected_lora_modules(["experts"], {"experts": ["experts.0.w1"]}) == {"experts.0.w1", "experts"}


def test_validate_legal_messages() -> None:
    def v(**cfg: Any) -> AdapterView:
        return AdapterView.from_tensors(ATTN, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **cfg})

    def message(view: AdapterView, version: str, max_rank: int = 16) -> str:
        with pytest.raises(ValueError) as info:
            vl.validate_legal(view, max_rank, engine_version=version)
        return str(info.value)

    vl.validate_legal(v(), 16)
    assert message(v(r=64), "0.33.0") == "LoRA rank 64 is greater than max_lora_rank 16."
    assert message(v(use_dora=True), "0.33.0") == "vLLM does not yet support DoRA."
    assert message(v(modules_to_save=["lm_head"]), "0.30.0") == "vLLM only supports modules_to_save being None."
    assert message(v(modules_to_save=["score", "lm_head"]), "0.33.0") == (
        'vLLM only supports modules_to_save being either None or ["classifier", "score"] for classification '
        "models. Unsupported modules_to_save: ['lm_head']"
    )
    vl.validate_legal(v(modules_to_save=["classifier", "score"]), 16, engine_version="0.33.0")
    assert message(v(modules_to_save=["score"], use_dora=True, r=32, bias="lora_only"), "0.30.0") == (
        "vLLM only supports modules_to_save being None. vLLM does not yet support DoRA. "
        "LoRA rank 32 is greater than max_lora_rank 16. Adapter bias is not supported."
    )
    # 0.33: rank_pattern counts towards the rank; 0.30 ignores it. `bias: null` is not "none".
    assert message(v(rank_pattern={"q_proj": 32}), "0.33.0") == "LoRA rank 32 is greater than max_lora_rank 16."
    vl.validate_legal(v(rank_pattern={"q_proj": 32}), 16, engine_version="0.30.0")
    assert message(v(bias=None), "0.30.0") == "Adapter bias is not supported."
    assert message(v(lora_bias=True, init_lora_weights="pissa", use_qalora=True), "0.33.0") == (
        "vLLM does not support LoRA bias (lora_bias). vLLM does not support init_lora_weights='pissa'. Inits "
        "such as PiSSA, OLoRA, CorDA and LoftQ modify the base model weights when PEFT loads the adapter. "
        "Convert it to a regular LoRA adapter with PEFT's path_initial_model_for_weight_conversion, or set "
        "init_lora_weights to true if the served base model already contains the modified weights. "
        "vLLM does not support QALoRA."
    )
    vl.validate_legal(v(lora_bias=True, init_lora_weights="pissa", use_qalora=True), 16, engine_version="0.30.0")


def test_peft_helper_and_ranks(peft: Callable[..., str]) -> None:
    with pytest.raises(ValueError) as info:
        vl.check_peft_helper(peft("no-r", ATTN, r=None))
    assert str(info.value) == "Missing required configuration fields: {'r'}"
    with pytest.raises(ValueError) as info:
        vl.check_peft_helper(peft("zero", ATTN, r=0))
    assert str(info.value) == "LoRA rank `r` must be a positive integer, got 0."
    assert vl.VLLM_MAX_LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)
    a, b = peft("a", ATTN), peft("b", ATTN, r=300)
    assert vl.smallest_max_lora_rank([a]) == 8
    assert vl.smallest_max_lora_rank([a, b]) == 320
    assert vl.smallest_max_lora_rank([peft("huge", ATTN, r=1024)]) is None
    patterned = peft("patterned", ATTN, rank_pattern={"q_proj": 64})
    assert vl.smallest_max_lora_rank([patterned], engine_version="0.33.0") == 64
    assert vl.smallest_max_lora_rank([patterned], engine_version="0.30.0") == 8


def test_preflight(peft: Callable[..., str]) -> None:
    good = peft("good", ATTN)
    big = peft("big", ATTN, r=64)
    dora = peft("dora", ATTN, use_dora=True)
    plan = vl.preflight([good], expected_lora_modules=EXPECTED)
    assert plan.ok and plan.max_rank == 8 and plan.suggested_max_lora_rank == 8
    with pytest.raises(ValueError) as info:
        vl.preflight([good, big, dora], max_lora_rank=16)
    assert str(info.value) == "LoRA rank 64 is greater than max_lora_rank 16."
    plan = vl.preflight([good, big, dora], max_lora_rank=12, collect=True)
    assert [p.message for p in plan.problems] == [
        "lorafast: vLLM accepts --max-lora-rank in [1, 8, 16, 32, 64, 128, 256, 320, 512], not 12",
        "LoRA rank 64 is greater than max_lora_rank 12.",
        "vLLM does not yet support DoRA.",
    ]
    assert plan.suggested_max_lora_rank == 64 and not plan.ok


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"
LLAMA = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"]


def test_load_adapter_versions(tmp_path: Path) -> None:
    path = str(FIXTURES / "peft_llama_patterns")  # rank_pattern {"down_proj": 4, ...}, r=8
    new = vl.load_adapter(path, supported_lora_modules=LLAMA, engine_version="0.33.0")
    old = vl.load_adapter(path, supported_lora_modules=LLAMA, engine_version="0.30.0")
    down = "model.layers.0.mlp.down_proj"
    assert new.loras[down].rank == 4 and old.loras[down].rank == 8
    assert new.loras[down].lora_a_shape == (4, 48) and new.rank == old.rank == 8
    with pytest.raises(vl.LoRAAdapterNotFoundError) as info:
        vl.load_adapter(str(tmp_path / "nothing"), supported_lora_modules=LLAMA, lora_name="x")
    assert str(info.value) == f"Loading lora x failed: No adapter found for {tmp_path / 'nothing'}"
    with pytest.raises(ValueError) as info:
        vl.load_adapter(path, supported_lora_modules=["qkv_proj"], engine_version="0.33.0")
    assert str(info.value).startswith(f"While loading {path}, expected target modules in {{")


def test_bin_weights_read_without_running_the_pickle(tmp_path: Path) -> None:
    import pickle
    import zipfile

    torch = pytest.importorskip("torch")
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    torch.save({P + "self_attn.q_proj.lora_A.weight": torch.zeros(8, 32),
                P + "self_attn.q_proj.lora_B.weight": torch.zeros(32, 8)}, folder / "adapter_model.bin")  # fmt: skip
    lora = vl.load_adapter(str(folder), supported_lora_modules=LLAMA)
    assert lora.loras["model.layers.0.self_attn.q_proj"].lora_b_shape == (32, 8)

    class Hostile:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(tmp_path / "pwned"), "w"))

    with zipfile.ZipFile(folder / "adapter_model.bin", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"x": Hostile()}, protocol=2))
    with pytest.raises(AdapterError, match="is not allowed") as info:
        vl.load_adapter(str(folder), supported_lora_modules=LLAMA)
    assert info.value.code == "unsafe_pickle" and not (tmp_path / "pwned").exists()


def test_cli_engine_version(peft: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    from lorafast.cli import main

    # modules_to_save ["score"]: 0.33.0 allows it (classification heads), 0.30.0 rejects it
    head = peft("head", ATTN, modules_to_save=["score"])
    assert main(["preflight", "vllm", f"h={head}", "--engine-version", "0.30.0", "--json"]) == 1
    (problem,) = json.loads(capsys.readouterr().out)["problems"]
    assert problem["message"] == "vLLM only supports modules_to_save being None." and problem["adapter"] == "h"
    assert main(["preflight", "vllm", f"h={head}", "--engine-version", "0.33.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == ["expected_modules", "moe_format", "classification_head"]


def test_preflight_is_the_load_path(peft: Callable[..., str]) -> None:
    # A full `score` module on a model without a classification head: validate_legal passes (0.33), the
    # manager's head check rejects it; preflight says what load_adapter raises.
    head = peft("head", {**ATTN, "base_model.model.score.weight": (3, 32)}, modules_to_save=["score"])
    with pytest.raises(ValueError) as info:
        vl.load_adapter(head, supported_lora_modules=LLAMA, engine_version="0.33.0")
    plan = vl.preflight([head], supported_lora_modules=LLAMA, collect=True, engine_version="0.33.0")
    assert not plan.ok and plan.skipped == () and [p.message for p in plan.problems] == [str(info.value)]
    good = peft("good", ATTN)
    plan = vl.preflight({"g": good}, supported_lora_modules=LLAMA, engine_version="0.33.0")
    assert plan.ok and plan.loras["g"] == vl.load_adapter(good, supported_lora_modules=LLAMA, engine_version="0.33.0")
    view = AdapterView.from_tensors(ATTN, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, name="mem")
    assert vl.preflight(view, supported_lora_modules=LLAMA).loras["mem"] == plan.loras["g"]


def test_034_classification_task_type(peft: Callable[..., str]) -> None:
    # 0.34 adds classifier and score to a SEQ_CLS/TOKEN_CLS adapter's modules_to_save, as PEFT does on load.
    seq_cls = peft("seq", {**ATTN, "base_model.model.score.weight": (3, 32)}, task_type="SEQ_CLS")
    assert vl.check_peft_helper(seq_cls, engine_version="0.34.0")["modules_to_save"] == ["classifier", "score"]
    assert "task_type" not in vl.check_peft_helper(seq_cls, engine_version="0.33.0")
    vl.check_unexpected_modules(seq_cls, vl.expected_lora_modules(LLAMA), engine_version="0.34.0")
    with pytest.raises(ValueError, match=r"but received \['score'\]"):
        vl.check_unexpected_modules(seq_cls, vl.expected_lora_modules(LLAMA), engine_version="0.33.0")
    with pytest.raises(TypeError) as info:
        vl.check_peft_helper(peft("five", ATTN, task_type="TOKEN_CLS", modules_to_save=5), engine_version="0.34.0")
    assert str(info.value) == "Value after * must be an iterable, not int"


def test_034_unwrapped_layers() -> None:
    # BERT's bert.pooler.dense shares the leaf `dense` with LoRA layers but is a plain nn.Linear in vLLM.
    pooler = "base_model.model.bert.pooler.dense."
    view = AdapterView.from_tensors({pooler + "lora_A.weight": (8, 32), pooler + "lora_B.weight": (32, 8)},
                                    {"r": 8, "lora_alpha": 16, "target_modules": ["dense"]}, path="/bert")  # fmt: skip
    model = {"supported_lora_modules": ["dense"], "unsupported_lora_modules": ["bert.pooler.dense"]}
    plan = vl.preflight(view, collect=True, engine_version="0.34.0", **model)  # type: ignore[arg-type]
    assert [p.message for p in plan.problems] == [
        "While loading /bert, expected target modules in {'dense'} but received ['bert.pooler.dense (not a LoRA "
        "layer)', 'bert.pooler.dense (not a LoRA layer)']. Please verify that the loaded LoRA module is correct"
    ]
    assert vl.preflight(view, engine_version="0.33.0", **model).ok  # type: ignore[arg-type]


def test_pattern_keys_only_regex_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM matches rank_pattern keys with the `regex` package; a variable-width lookbehind is its syntax only.
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    behind = AdapterView.from_tensors(ATTN, {**config, "rank_pattern": {r"(?<=layers\.\d+\.self_attn\.)q_proj": 4}})
    plain = AdapterView.from_tensors(ATTN, {**config, "rank_pattern": {"q_proj": 4}})
    q = "model.layers.0.self_attn.q_proj"
    for view in (behind, plain):
        plan = vl.preflight({"a": view}, supported_lora_modules=LLAMA, engine_version="0.34.0")
        assert plan.loras["a"].loras[q].rank == 4
    monkeypatch.setitem(sys.modules, "regex", None)  # not installed: `re` answers only what it reads as regex does
    assert vl.preflight({"a": plain}, supported_lora_modules=LLAMA).loras["a"].loras[q].rank == 4
    with pytest.raises(vl.UnknownPatternError, match="without the `regex` package"):
        vl.preflight({"a": behind}, supported_lora_modules=LLAMA)


def test_weights_as_vllm_reads_them(peft: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafast import HeaderError
    from lorafast.testing import write_safetensors

    folder = Path(peft("broken", ATTN))
    write_safetensors(folder / "vision.safetensors", {"base_model.model.visual.x.lora_A.weight": ("F32", (8, 32))})
    vl.check_unexpected_modules(str(folder), EXPECTED)  # vLLM never reads a second .safetensors file
    (folder / "adapter_model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{abc}")
    from safetensors import SafetensorError, safe_open

    with pytest.raises(SafetensorError) as theirs:
        safe_open(str(folder / "adapter_model.safetensors"), framework="pt")  # what vLLM's loader calls
    with pytest.raises(SafetensorError) as info:
        vl.check_unexpected_modules(str(folder), EXPECTED)
    assert str(info.value) == str(theirs.value) and "invalid JSON in header" in str(info.value)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # without the package: lorafast's own error
    with pytest.raises(HeaderError):
        vl.check_unexpected_modules(str(folder), EXPECTED)
