"""How vLLM is set up for each model family of `cases.py`, and the vLLM oracle cases built from them.

A setup is what vLLM's LoRA manager reads from the model: the LoRA module leaves (`supported_lora_modules`),
`packed_modules_mapping` as `process_packed_modules_mapping` builds it (with `experts` expanded per expert
for 2-D MoE models), the model's `hf_to_vllm_mapper`, vocab size, max positions, the MoE layers and the
classification head, and the layers vLLM leaves unwrapped though their leaf is a LoRA module (0.34's
`unsupported_lora_modules`). The values follow vllm/model_executor/models/{llama,qwen2,mistral,gpt2,mixtral,
qwen2_moe,qwen3_moe,bert}.py of 0.30.0/0.33.0/0.34.0 (the same in all three for these families).
"""

from __future__ import annotations

from typing import Any

from cases import Case

QKV = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
GATE_UP = {"gate_up_proj": ["gate_proj", "up_proj"]}
EXPERTS = 8
LAYERS = 2


def _experts(gate: str, down: str, up: str) -> list[str]:
    # FusedMoE.make_expert_params_mapping order: per expert, gate (w1), down (w2), up (w3)
    return [f"experts.{e}.{name}" for e in range(EXPERTS) for name in (gate, down, up)]


def _setup(modules: list[str], packed: dict[str, list[str]], **extra: Any) -> dict[str, Any]:
    return {"supported": modules, "packed": packed, "vocab_size": 128, "max_position_embeddings": 64,
            "mapper": None, "moe_modules": [], "classification_head": None, "is_pooling_model": False,
            "unsupported": [], **extra}  # fmt: skip


def _moe_layers(block: str) -> list[str]:
    return [f"model.layers.{i}.{block}.experts" for i in range(LAYERS)]


DENSE = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
EMBEDDINGS = ["embed_tokens", "lm_head"]
SETUPS: dict[str, dict[str, Any]] = {
    "llama": _setup(DENSE + EMBEDDINGS, {**QKV, **GATE_UP}),
    "qwen2": _setup(DENSE + EMBEDDINGS, {**QKV, **GATE_UP}),
    "mistral": _setup(DENSE, {**QKV, **GATE_UP}),
    "gpt2": _setup(["c_attn", "c_proj", "c_fc"], {},
                   mapper={"substr": {".attn.bias": None, ".attn.masked_bias": None}}),  # fmt: skip
    "mixtral": _setup(["qkv_proj", "o_proj", "gate", "experts", *EMBEDDINGS],
                      {**QKV, "experts": _experts("w1", "w2", "w3")}, moe_modules=_moe_layers("block_sparse_moe")),  # fmt: skip
    "qwen2_moe": _setup(["qkv_proj", "o_proj", "gate", "experts", "shared_expert_gate", "gate_up_proj", "down_proj"],
                        {**QKV, "experts": _experts("gate_proj", "down_proj", "up_proj")},
                        moe_modules=_moe_layers("mlp")),  # fmt: skip
    "qwen3_moe": _setup(["qkv_proj", "o_proj", "gate", "experts", *EMBEDDINGS],
                        {**QKV, "experts": _experts("gate_proj", "down_proj", "up_proj")},
                        moe_modules=_moe_layers("mlp")),  # fmt: skip
    "llama_seqcls": _setup(DENSE + ["score"], {**QKV, **GATE_UP}, is_pooling_model=True,
                           classification_head={"name": "score", "max_labels": 3, "input_size": 32}),  # fmt: skip
    # BertForSequenceClassification: qkv_proj/dense/classifier are vLLM linear layers, bert.pooler.dense a torch
    # nn.Linear (unwrapped; 0.34 refuses LoRA on it), `classifier` the classification head.
    "bert_seqcls": _setup(["qkv_proj", "dense", "classifier"], {"qkv_proj": ["query", "key", "value"]},
                          is_pooling_model=True, unsupported=["bert.pooler.dense"],
                          classification_head={"name": "classifier", "max_labels": 3, "input_size": 32}),
    # A Qwen2-VL-like wrapper: the language model under `language_model.` (a prefix mapper).
    "qwen2_vl": _setup(DENSE, {**QKV, **GATE_UP},
                       mapper={"prefix": {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}}),
}  # fmt: skip

# Tensor names for `parse_fine_tuned_lora_name` on its own, each with no mapper and with a prefix mapper.
PARSE_NAMES = [
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    "model.layers.0.mlp.down_proj.lora_B.weight",
    "base_model.model.model.embed_tokens.lora_embedding_A",
    "base_model.model.lm_head.lora_embedding_B",
    "base_model.model.score.weight",
    "base_model.model.score.bias",
    "base_model.model.classifier.weight",
    "score.bias",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
    "base_model.model.lm_head.weight",
    "lora_A.weight",
    "weight",
    "base_model.model.transformer.h.0.attn.bias",
    "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight",
    "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight",
    "base_model.model.base_model.model.x.lora_A.weight",
]
PARSE_MAPPERS = [
    None,
    {"prefix": {"model.": "language_model.model."}},
    {"substr": {".attn.bias": None}},
    {"suffix": {".weight": ".w"}},
]


def load_cases(cases: list[Case], max_lora_rank: int = 16) -> list[dict[str, Any]]:
    """One `_load_adapter` case per adapter, under its family's setup (and the Qwen2-VL mapper for Qwen2)."""
    out = []
    for i, case in enumerate(cases):
        family = "qwen2_vl" if case.family == "qwen2" and i % 2 else case.family
        # Every fifth case under a small --max-lora-rank; `lorafast sample` ranks reach 64.
        rank = 8 if i % 5 == 0 else 64 if case.kind.startswith("sample_") else max_lora_rank
        out.append({"op": "load", "path": case.path, "lora_name": f"{case.kind}-{i}", "lora_int_id": i + 1,
                    "max_lora_rank": rank, "setup": SETUPS[family], "kind": case.kind, "family": family})  # fmt: skip
    return out


def step_cases(loads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The single steps on each load case's adapter: `PEFTHelper.from_local_dir` (once per path) and
    `from_local_checkpoint`'s name check and file read under the load case's setup."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for case in loads:
        where = {"path": case["path"], "kind": case["kind"], "family": case["family"]}
        if case["path"] not in seen:
            seen.add(case["path"])
            out.append({"op": "peft_helper", **where})
        out.append({"op": "unexpected", "setup": case["setup"], **where})
    return out


def parse_cases() -> list[dict[str, Any]]:
    return [{"op": "parse", "name": n, "mapper": m, "kind": "parse"} for n in PARSE_NAMES for m in PARSE_MAPPERS]
