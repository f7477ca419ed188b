"""Adapters for the oracle tests: real PEFT outputs, `lorafast sample` adapters, the real fixtures, and broken
variants of each. Engine-neutral: `write_cases(root, n)` returns `Case`s (a path, the model family the adapter
was made for, and what the case is); each engine's test decides how its engine is set up for a family.

Variants are written directly (configs as text, weights hard-linked, new headers with zero data), so several
hundred cases take a second or two; only the PEFT bases need torch, transformers and peft.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafast.testing import write_safetensors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"
ST = "adapter_model.safetensors"

# Real fixtures (tests/fixtures/make_fixtures.py, made by PEFT) and the family of their base model.
FIXTURE_FAMILIES = {
    "peft_llama_dora": "llama", "peft_llama_embeddings": "llama", "peft_llama_patterns": "llama",
    "peft_llama_unsorted_patterns": "llama", "peft_llama_trainable_tokens": "llama", "peft_llama_loha": "llama",
    "peft_llama_seqcls_bias": "llama_seqcls", "peft_mixtral_v4_experts": "mixtral",
    "peft_qwen2moe_v4_experts": "qwen2_moe", "peft_qwen3moe_target_parameters": "qwen3_moe",
}  # fmt: skip
# `lorafast sample` kinds that are PEFT folders, and the family their names follow.
SAMPLE_FAMILIES = {
    "peft_dense": "llama", "peft_dora": "llama", "peft_embeddings": "llama", "peft_modules_to_save": "llama",
    "peft_lora_bias": "llama", "peft_moe_2d_qwen": "qwen2_moe", "peft_moe_2d_mixtral": "mixtral",
    "peft_moe_stacked_3d": "qwen3_moe", "peft_moe_shared_outer": "qwen3_moe",
    "peft_moe_target_parameters": "qwen3_moe",
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    path: str
    family: str
    kind: str


def read_header(file: str | os.PathLike[str]) -> dict[str, Any]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def make_peft_bases(root: Path) -> dict[str, tuple[str, str]]:
    """Real PEFT adapters for tiny Qwen2, Mistral, GPT-2 and a Llama classifier: {name: (path, family)}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    dims = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out: dict[str, tuple[str, str]] = {}

    def save(name: str, family: str, model: Any, config: Any) -> None:
        path = root / name
        get_peft_model(model, config).save_pretrained(path)
        out[name] = (str(path), family)

    save("peft_qwen2", "qwen2", AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **dims)),
         LoraConfig(r=8, lora_alpha=16, target_modules=all_linear))  # fmt: skip
    save("peft_qwen2_rslora", "qwen2", AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **dims)),
         LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "embed_tokens"]))  # fmt: skip
    save("peft_mistral", "mistral", AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", **dims)),
         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    gpt2 = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                bos_token_id=0, eos_token_id=0)  # fmt: skip
    save("peft_gpt2", "gpt2", AutoModelForCausalLM.from_config(gpt2),
         LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))  # fmt: skip
    cls = AutoConfig.for_model("llama", num_labels=3, **dims)
    save("peft_llama_seqcls", "llama_seqcls", AutoModelForSequenceClassification.from_config(cls),
         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))  # fmt: skip
    # "dense" also reaches bert.pooler.dense, a plain nn.Linear in vLLM's BERT (0.34: "not a LoRA layer").
    bert = AutoConfig.for_model("bert", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                vocab_size=128, max_position_embeddings=64, num_labels=3)  # fmt: skip
    save("peft_bert_seqcls", "bert_seqcls", AutoModelForSequenceClassification.from_config(bert),
         LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], task_type="SEQ_CLS"))  # fmt: skip
    return out


# --- config variants: name -> (config -> new config, or raw text) ----------------------------------------

Mutation = Callable[[dict[str, Any]], Any]


def _set(**fields: Any) -> Mutation:
    return lambda c: {**c, **fields}


def _drop(*keys: str) -> Mutation:
    return lambda c: {k: v for k, v in c.items() if k not in keys}


CONFIG_VARIANTS: dict[str, Mutation] = {
    "as_is": lambda c: c,
    "r_float": lambda c: {**c, "r": float(c.get("r") or 4)},
    "r_float_half": _set(r=4.5),
    "r_bool": _set(r=True),
    "r_string": _set(r="8"),
    "r_null": _set(r=None),
    "r_zero": _set(r=0),
    "r_negative": _set(r=-4),
    "r_list": _set(r=[8]),
    "r_missing": _drop("r"),
    "alpha_missing": _drop("lora_alpha"),
    "targets_missing": _drop("target_modules"),
    "all_required_missing": _drop("r", "lora_alpha", "target_modules"),
    "alpha_null": _set(lora_alpha=None),
    "alpha_string": _set(lora_alpha="16"),
    "alpha_float": _set(lora_alpha=7.5),
    "alpha_null_rslora": _set(lora_alpha=None, use_rslora=True),
    "rslora": _set(use_rslora=True),
    "r_64": _set(r=64),
    "r_32_bias_all": _set(r=32, bias="all"),
    "mts_score": _set(modules_to_save=["score"]),
    "mts_classifier_score": _set(modules_to_save=["classifier", "score"]),
    "mts_lm_head": _set(modules_to_save=["lm_head"]),
    "mts_score_lm_head": _set(modules_to_save=["score", "lm_head"]),
    "mts_string": _set(modules_to_save="score"),
    "mts_empty": _set(modules_to_save=[]),
    "mts_null": _set(modules_to_save=None),
    "mts_missing": _drop("modules_to_save"),
    "mts_classifier": _set(modules_to_save=["classifier"]),
    "mts_int": _set(modules_to_save=5),
    "mts_true": _set(modules_to_save=True),
    # vLLM 0.34 adds classifier and score to modules_to_save for these two tasks (PEFT does when it loads).
    "task_seq_cls": _set(task_type="SEQ_CLS"),
    "task_token_cls": _set(task_type="TOKEN_CLS", modules_to_save=None),
    "task_causal_lm": _set(task_type="CAUSAL_LM", modules_to_save=None),
    "task_seq_cls_lm_head": _set(task_type="SEQ_CLS", modules_to_save=["lm_head"]),
    "task_seq_cls_mts_int": _set(task_type="SEQ_CLS", modules_to_save=5),
    "task_seq_cls_mts_string": _set(task_type="SEQ_CLS", modules_to_save="score"),
    "dora": _set(use_dora=True),
    "lora_bias": _set(lora_bias=True),
    "init_pissa": _set(init_lora_weights="pissa"),
    "init_pissa_niter": _set(init_lora_weights="pissa_niter_4"),
    "init_olora": _set(init_lora_weights="olora"),
    "init_corda": _set(init_lora_weights="corda"),
    "init_loftq": _set(init_lora_weights="loftq"),
    "init_gaussian": _set(init_lora_weights="Gaussian"),
    "init_eva": _set(init_lora_weights="eva"),
    "init_false": _set(init_lora_weights=False),
    "alora": _set(alora_invocation_tokens=[1, 2]),
    "alora_empty": _set(alora_invocation_tokens=[]),
    "layer_replication": _set(layer_replication=[[0, 1], [0, 1]]),
    "bdlora": _set(use_bdlora={"target_modules_bd_a": ["q_proj"]}),
    "qalora": _set(use_qalora=True),
    "rank_pattern_64": _set(rank_pattern={"q_proj": 64}),
    "rank_pattern_zero": _set(rank_pattern={"q_proj": 0}),
    "rank_pattern_float": _set(rank_pattern={"q_proj": 4.0}),
    "rank_pattern_bool": _set(rank_pattern={"q_proj": True}),
    "rank_pattern_string": _set(rank_pattern={"v_proj": "8"}),
    "rank_pattern_null": _set(rank_pattern=None),
    "rank_pattern_list": _set(rank_pattern=["q_proj"]),
    "alpha_pattern": _set(alpha_pattern={"q_proj": 32, "down_proj": 2}),
    # Keys that vLLM's `regex` package reads and Python's `re` does not, or reads differently.
    "rank_pattern_lookbehind": _set(rank_pattern={r"(?<=layers\.\d+\.self_attn\.)q_proj": 2}),
    "rank_pattern_lookbehind_fixed": _set(rank_pattern={r"(?<=self_attn\.)v_proj": 2}),
    "rank_pattern_backref": _set(rank_pattern={r"(q|v)_pro(j)(?!\4)": 2}),
    "rank_pattern_bad_group": _set(rank_pattern={r"\9_proj": 2}),
    "alpha_pattern_inline_flag": _set(alpha_pattern={"(?i)Q_PROJ": 64}),
    "alpha_pattern_posix": _set(alpha_pattern={"[[:alpha:]]_proj": 64}),
    "alpha_pattern_unicode_class": _set(alpha_pattern={r"\p{Ll}_proj": 64}),
    "bias_null": _set(bias=None),
    "bias_all": _set(bias="all"),
    "bias_lora_only": _set(bias="lora_only"),
    "everything_wrong": _set(
        modules_to_save=["lm_head"],
        use_dora=True,
        lora_bias=True,
        init_lora_weights="olora",
        use_qalora=True,
        r=128,
        bias="all",
    ),  # fmt: skip
}

RAW_CONFIGS: dict[str, str] = {
    "config_invalid_json": '{"r": 8, "lora_alpha": ',
    "config_bom": '\ufeff{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}',
    "config_array": '[{"r": 8}]',
    "config_string": '"r=8"',
    "config_null": "null",
    "config_number": "8",
    "config_empty": "",
    "config_non_peft": '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32}',
}


def _link(src: str, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        dst.write_bytes(Path(src).read_bytes())


class _Writer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.cases: list[Case] = []

    def folder(self, name: str) -> Path:
        path = self.root / f"{len(self.cases):04d}-{name}"
        path.mkdir(parents=True)
        return path

    def add(self, path: Path | str, family: str, kind: str) -> None:
        self.cases.append(Case(str(path), family, kind))

    def variant(self, base: str, family: str, kind: str, config: Any, weights: dict[str, str]) -> None:
        folder = self.folder(f"{Path(base).name}-{kind}")
        if config is not None:
            text = config if isinstance(config, str) else json.dumps(config)
            (folder / "adapter_config.json").write_text(text, encoding="utf-8")
        for name, src in weights.items():
            _link(src, folder / name)
        self.add(folder, family, kind)

    def tensors(self, base: str, family: str, kind: str, config: dict[str, Any], entries: dict[str, Any]) -> None:
        folder = self.folder(f"{Path(base).name}-{kind}")
        (folder / "adapter_config.json").write_text(json.dumps(config))
        write_safetensors(folder / ST, entries)
        self.add(folder, family, kind)


def _raw(header: bytes, data: int = 0, length: int | None = None) -> bytes:
    """A safetensors file written by hand: the length prefix (`length`, default the header's size), the header
    text and `data` zero bytes."""
    return struct.pack("<Q", len(header) if length is None else length) + header + b"\0" * data


def _torch_save(path: Path, entries: dict[str, Any]) -> None:
    import torch

    torch.save({k: torch.zeros(tuple(shape)) for k, (_, shape) in entries.items()}, path)


def _tensor_variants(w: _Writer, base: str, family: str, config: dict[str, Any], header: dict[str, Any]) -> None:
    entries = {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
    a_key = next((k for k in entries if k.endswith("lora_A.weight")), None)
    r = entries[a_key][1][0] if a_key else 4
    hidden = entries[a_key][1][1] if a_key else 32
    dtype = next(iter(entries.values()))[0]
    vision = {"base_model.model.visual.blocks.0.attn.qkv.lora_A.weight": (dtype, (r, hidden)),
              "base_model.model.visual.blocks.0.attn.qkv.lora_B.weight": (dtype, (3 * hidden, r))}  # fmt: skip
    w.tensors(base, family, "unexpected_module", config, {**entries, **vision})
    w.tensors(base, family, "magnitude_vector", config,
              {**entries, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": (dtype, (hidden,))})  # fmt: skip
    w.tensors(base, family, "no_prefix", config, {k.removeprefix("base_model.model."): v for k, v in entries.items()})
    score = {"base_model.model.score.weight": (dtype, (3, hidden)), "base_model.model.score.bias": (dtype, (3,))}
    for mts in (["score"], ["classifier", "score"], None):
        cfg = {**config, "modules_to_save": mts}
        w.tensors(base, family, f"score_full_{'-'.join(mts or ['none'])}", cfg, {**entries, **score})
    w.tensors(base, family, "score_wrong_shape", {**config, "modules_to_save": ["score"]},
              {**entries, "base_model.model.score.weight": (dtype, (3, hidden + 1))})  # fmt: skip
    w.tensors(base, family, "score_too_many_labels", {**config, "modules_to_save": ["score"]},
              {**entries, "base_model.model.score.weight": (dtype, (9, hidden))})  # fmt: skip
    w.tensors(base, family, "score_bad_bias", {**config, "modules_to_save": ["score"]},
              {**entries, "base_model.model.score.weight": (dtype, (3, hidden)),
               "base_model.model.score.bias": (dtype, (4,))})  # fmt: skip
    w.tensors(base, family, "score_bias_only", {**config, "modules_to_save": ["score"]},
              {**entries, "base_model.model.score.bias": (dtype, (3,))})  # fmt: skip
    w.tensors(base, family, "classifier_and_score", {**config, "modules_to_save": ["classifier", "score"]},
              {**entries, **score, "base_model.model.classifier.weight": (dtype, (3, hidden))})  # fmt: skip
    emb = {"base_model.model.model.embed_tokens.lora_embedding_A": (dtype, (r, 129)),
           "base_model.model.model.embed_tokens.lora_embedding_B": (dtype, (hidden, r))}  # fmt: skip
    w.tensors(base, family, "embedding_vocab_mismatch", config, {**entries, **emb})
    emb_ok = {**emb, "base_model.model.model.embed_tokens.lora_embedding_A": (dtype, (r, 128))}
    w.tensors(base, family, "embedding_ok", config, {**entries, **emb_ok})
    only_b = {k: v for k, v in entries.items() if not k.endswith("lora_A.weight") or k != a_key}
    w.tensors(base, family, "missing_one_lora_a", config, only_b)
    # PEFT's classification tasks (vLLM 0.34 adds classifier/score to modules_to_save) with a saved score head.
    for mts in (None, "missing", [], ["classifier"]):
        cfg = {**config, "task_type": "SEQ_CLS", "modules_to_save": mts}
        if mts == "missing":
            del cfg["modules_to_save"]
        label = "none" if mts is None else mts if isinstance(mts, str) else "-".join(mts) or "empty"
        w.tensors(base, family, f"task_seq_cls_score_{label}", cfg, {**entries, **score})
    w.tensors(base, family, "task_token_cls_score", {**config, "task_type": "TOKEN_CLS", "modules_to_save": None},
              {**entries, **score})  # fmt: skip
    # kohya `.alpha` scalars, in PEFT names and in kohya names, 0 (kohya: alpha = rank) and not
    import numpy as np

    modules = sorted({k.rsplit(".", 2)[0] for k in entries if k.endswith(("lora_A.weight", "lora_B.weight"))})
    for value in (0.0, 8.0):
        alphas = {f"{m}.alpha": np.array(value, np.float32) for m in modules}
        w.tensors(base, family, f"kohya_alpha_{value:g}", config, {**entries, **alphas})
    kohya = {"lora_unet_blocks_0_attn_to_q.lora_down.weight": (dtype, (r, hidden)),
             "lora_unet_blocks_0_attn_to_q.lora_up.weight": (dtype, (hidden, r)),
             "lora_unet_blocks_0_attn_to_q.alpha": np.array(0.0, np.float32)}  # fmt: skip
    w.tensors(base, family, "kohya_names_alpha_0", config, kohya)
    # A config in the weights' metadata only (diffusers' lora_adapter_metadata): vLLM reads adapter_config.json.
    folder = w.folder(f"{Path(base).name}-config_in_metadata")
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    write_safetensors(folder / ST, entries, metadata=meta)
    w.add(folder, family, "config_in_metadata")
    # vLLM reads adapter_model.safetensors alone: another .safetensors beside it is never read.
    folder = w.folder(f"{Path(base).name}-extra_safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(folder / ST, entries)
    write_safetensors(folder / "vision.safetensors", vision)
    w.add(folder, family, "extra_safetensors")
    folder = w.folder(f"{Path(base).name}-extra_safetensors_only")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", entries)
    w.add(folder, family, "extra_safetensors_only")
    # Broken weight headers, as safetensors' `safe_open` (vLLM's reader) refuses them, and one it accepts.
    size = 4 * r * hidden
    one = json.dumps({a_key: {"dtype": "F32", "shape": [r, hidden], "data_offsets": [0, size]}}).encode()
    twice = one[:-1] + b", " + one[1:]  # the same name twice: safe_open keeps the last
    broken = {
        "weights_empty": b"", "weights_short": b"\x01\x02", "weights_header_too_large": _raw(b"{}", length=1 << 40),
        "weights_length_past_end": _raw(b"{}", length=1000), "weights_bad_json": _raw(b"{abc}"),
        "weights_not_utf8": _raw(b"\xff\xfe{}"), "weights_header_list": _raw(b"[]"),
        "weights_short_data": _raw(one, 4), "weights_trailing_nul": _raw(one + b"\0\0", size),
        "weights_bad_dtype": _raw(one.replace(b"F32", b"X9"), size), "weights_duplicate_name": _raw(twice, size),
    }  # fmt: skip
    for kind, data in broken.items():
        folder = w.folder(f"{Path(base).name}-{kind}")
        (folder / "adapter_config.json").write_text(json.dumps(config))
        (folder / ST).write_bytes(data)
        w.add(folder, family, kind)
    # Weight files as vLLM picks them: safetensors, else .bin, else .pt.
    cfg_text = json.dumps(config)
    folder = w.folder(f"{Path(base).name}-bin_only")
    (folder / "adapter_config.json").write_text(cfg_text)
    _torch_save(folder / "adapter_model.bin", entries)
    w.add(folder, family, "bin_only")
    folder = w.folder(f"{Path(base).name}-pt_only_unexpected")
    (folder / "adapter_config.json").write_text(cfg_text)
    _torch_save(folder / "adapter_model.pt", {**entries, **vision})
    w.add(folder, family, "pt_only_unexpected")
    folder = w.folder(f"{Path(base).name}-bin_over_pt")
    (folder / "adapter_config.json").write_text(cfg_text)
    _torch_save(folder / "adapter_model.bin", entries)
    _torch_save(folder / "adapter_model.pt", {**entries, **vision})
    w.add(folder, family, "bin_over_pt")
    folder = w.folder(f"{Path(base).name}-safetensors_over_bin")
    (folder / "adapter_config.json").write_text(cfg_text)
    write_safetensors(folder / ST, entries)
    _torch_save(folder / "adapter_model.bin", {**entries, **vision})
    w.add(folder, family, "safetensors_over_bin")


def write_cases(root: str | os.PathLike[str], n: int = 600, *, peft_bases: dict[str, tuple[str, str]] | None = None,
                samples: int = 150) -> list[Case]:  # fmt: skip
    """At least `n` cases under `root`: every base as it is, every config and file variant of each base,
    tensor-name variants of a few, and `lorafast sample` PEFT adapters. Deterministic."""
    from lorafast.sample import sample_kind_of, write_samples

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    bases = {name: (str(FIXTURES / name), fam) for name, fam in FIXTURE_FAMILIES.items()}
    bases.update(peft_bases if peft_bases is not None else make_peft_bases(root / "peft"))
    w = _Writer(root / "cases")
    for name, (path, family) in bases.items():
        config = json.loads(Path(path, "adapter_config.json").read_text())
        weights = {ST: str(Path(path, ST))}
        for kind, mutate in CONFIG_VARIANTS.items():
            w.variant(path, family, kind, mutate(dict(config)), weights)
        for kind, text in RAW_CONFIGS.items():
            w.variant(path, family, kind, text, weights)
        w.variant(path, family, "no_config", None, weights)
        w.variant(path, family, "no_weights", config, {})
        w.add(Path(path, ST), family, "file_not_folder")
        w.add(Path(root, "missing", name), family, "missing_folder")
    tensor_bases = ("peft_llama_patterns", "peft_qwen2", "peft_mixtral_v4_experts", "peft_llama_seqcls", "peft_gpt2",
                    "peft_qwen2moe_v4_experts", "peft_qwen3moe_target_parameters")  # fmt: skip
    for name in tensor_bases:
        path, family = bases[name]
        config = json.loads(Path(path, "adapter_config.json").read_text())
        _tensor_variants(w, path, family, config, read_header(Path(path, ST)))
    for path in write_samples(root / "samples", samples, seed=3, hidden=32):
        kind = sample_kind_of(path)
        if kind in SAMPLE_FAMILIES and os.path.isdir(path):
            w.add(path, SAMPLE_FAMILIES[kind], f"sample_{kind}")
    i = 0
    names = list(bases)
    while len(w.cases) < n:  # more as-is loads under other families' setups, until n
        path, _ = bases[names[i % len(names)]]
        w.add(path, bases[names[(i * 7 + 3) % len(names)]][1], "cross_family")
        i += 1
    return w.cases
