"""The fleet and launch commands of test_oracle_serving.py: real PEFT adapters of tiny Llama, Qwen2, Llava,
Mixtral and Qwen3-MoE models (helpers/check_fixtures.py), with the scale PEFT trained each module at, and how vLLM's
model files describe each base to the LoRA manager.

Every adapter is made by PEFT (`get_peft_model` on the tiny model, B initialised non-zero, `save_pretrained`);
its trained scale per module is PEFT's own `LoraLayer.scaling["default"]`, read from that `PeftModel` before it is
saved. The classes: plain, rsLoRA, `alpha_pattern`, `rank_pattern`, MLP or attention-only modules (which a
`--lora-target-modules` may leave unwrapped), an adapter of the multimodal Llava on the causal Llama and the
reverse (Llava's language model has Llama's shapes), a rank above the server's limit, DoRA, `lora_bias`,
`modules_to_save`, LoRA on `embed_tokens` and `lm_head`, and adapters the engines refuse at load. On Qwen3-MoE:
attention only, attention with the experts fused as transformers 5 holds them (`target_parameters`), and attention
with per-expert modules (`mlp.experts.N.gate_proj`, PEFT on `check_fixtures.qwen3_moe_v4_tree`, the transformers-4
layout of the same checkpoint, which adapters in the wild mostly have).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for check_fixtures

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LM_QV = r".*language_model.*\.(q_proj|v_proj)"  # Llava: the language model only, not the vision tower

# name: (base family it is trained on, target_modules, LoraConfig kwargs)
ADAPTERS: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "l_plain": ("llama", ["q_proj", "v_proj"], {"r": 8}),
    "l_all": ("llama", ALL_LINEAR, {"r": 8}),
    "l_rslora": ("llama", ["q_proj", "v_proj"], {"r": 16, "use_rslora": True}),
    "l_alpha": ("llama", ["q_proj", "v_proj"], {"r": 8, "alpha_pattern": {"q_proj": 32}}),
    "l_alpha_mlp": ("llama", ["q_proj", "v_proj", "down_proj"], {"r": 8, "alpha_pattern": {"down_proj": 4}}),
    "l_rank": ("llama", ["q_proj", "v_proj"], {"r": 8, "rank_pattern": {"v_proj": 4}}),
    "l_rank_o": ("llama", ["q_proj", "v_proj", "o_proj"], {"r": 8, "rank_pattern": {"o_proj": 4}}),
    "l_mlp": ("llama", ["q_proj", "v_proj", "gate_proj", "down_proj"], {"r": 8}),
    "l_o_down": ("llama", ["o_proj", "down_proj"], {"r": 4}),
    "l_big": ("llama", ["q_proj", "v_proj"], {"r": 64}),
    "l_dora": ("llama", ["q_proj", "v_proj"], {"r": 8, "use_dora": True}),
    "l_lora_bias": ("llama", ["q_proj", "v_proj"], {"r": 8, "lora_bias": True}),
    "l_mts": ("llama", ["q_proj", "v_proj"], {"r": 8, "modules_to_save": ["lm_head"]}),
    "q_all": ("qwen2", ALL_LINEAR, {"r": 4}),
    "q_rslora": ("qwen2", ["q_proj", "v_proj"], {"r": 4, "use_rslora": True}),
    "v_qv": ("llava", ["q_proj", "v_proj"], {"r": 8}),
    "v_lm": ("llava", LM_QV, {"r": 8}),
    "v_lm_rslora": ("llava", LM_QV, {"r": 16, "use_rslora": True}),
    "m_attn": ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"], {"r": 4}),
    "m_alpha": ("mixtral", ["q_proj", "v_proj"], {"r": 4, "alpha_pattern": {"v_proj": 16}}),
    # transformers 5 fuses Mixtral's experts into 3-D parameters: PEFT reaches them with target_parameters
    "m_experts": ("mixtral", ["q_proj"], {"r": 4, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}),
    "l_mlp_only": ("llama", ["gate_proj", "up_proj", "down_proj"], {"r": 4}),
    # LoRA on the embedding and the head (PEFT saves the embedding's full weight too: save_embedding_layers)
    "l_embed": ("llama", ["embed_tokens", "lm_head", "q_proj", "v_proj"], {"r": 8}),
    "q3_attn": ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"], {"r": 8}),
    "q3_alpha": ("qwen3_moe", ["q_proj", "v_proj"], {"r": 8, "alpha_pattern": {"v_proj": 32}}),
    "q3_big": ("qwen3_moe", ["q_proj", "v_proj"], {"r": 64}),
    # transformers 5 fuses Qwen3-MoE's experts too (`mlp.experts.gate_up_proj`, 3-D): target_parameters
    "q3_experts": (
        "qwen3_moe",
        ["q_proj", "v_proj"],
        {"r": 4, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
    ),
    # the per-expert layout (transformers 4's module tree of the same checkpoint)
    "q3_experts_2d": ("qwen3_moe_v4", ALL_LINEAR, {"r": 4}),
    "q3_embed": ("qwen3_moe", ["embed_tokens", "lm_head", "q_proj", "v_proj"], {"r": 4}),
}
# Broken copies of real adapters, as the oracle tests of the loaders have them: (copied from, what changes).
VARIANTS: dict[str, tuple[str, str]] = {
    "l_no_weights": ("l_plain", "no_weights"),
    "l_r_string": ("l_plain", "r_string"),
}
# Which adapters each base is asked to serve: its own, and the multimodal/causal pairs of one language model.
SERVED_ON: dict[str, list[str]] = {
    "llama": [n for n, (f, _, _) in ADAPTERS.items() if f in ("llama", "llava")] + list(VARIANTS),
    "qwen2": [n for n, (f, _, _) in ADAPTERS.items() if f == "qwen2"],
    "llava": [n for n, (f, _, _) in ADAPTERS.items() if f in ("llava", "llama")],
    # Mixtral's attention has Llama's shapes: a dense-MLP adapter meets a model whose MLP is its experts
    "mixtral": [n for n, (f, _, _) in ADAPTERS.items() if f == "mixtral"] + ["l_o_down", "l_mlp_only"],
    # Qwen3-MoE's attention has Llama's shapes too (head_dim 8), and every layer's MLP is its experts
    "qwen3_moe": [n for n, (f, _, _) in ADAPTERS.items() if f.startswith("qwen3_moe")] + ["l_o_down", "l_mlp_only"],
}


@dataclass
class Fleet:
    bases: dict[str, Path] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    adapters: dict[str, Path] = field(default_factory=dict)
    trained: dict[str, dict[str, float]] = field(default_factory=dict)
    """PEFT's `LoraLayer.scaling` per module (names without `base_model.model.`), per adapter."""
    saved: dict[str, list[str]] = field(default_factory=dict)
    """The other trained parts per adapter: `modules_to_save` modules (full weights) and, with `lora_bias`, each
    module's `<module>.lora_B.bias`."""


def _peft_adapter(model: Any, out: Path, targets: Any, r: int, **kw: Any) -> tuple[dict[str, float], list[str]]:
    """`check_fixtures.peft_adapter`, returning the PeftModel's own scaling of every LoRA layer and its
    `modules_to_save` modules."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, **kw))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:  # non-zero B: what a server applies is visible in it
            torch.nn.init.normal_(p)
    scales = {
        n.removeprefix("base_model.model."): float(m.scaling["default"])
        for n, m in peft_model.named_modules()
        if isinstance(m, LoraLayer) and "default" in m.scaling
    }
    saved = [n.removeprefix("base_model.model.") for n, m in peft_model.named_modules()
             if isinstance(m, ModulesToSaveWrapper)]  # fmt: skip
    saved += [f"{n.removeprefix('base_model.model.')}.lora_B.bias" for n, m in peft_model.named_modules()
              if isinstance(m, LoraLayer) and "default" in m.lora_B and m.lora_B["default"].bias is not None]  # fmt: skip
    peft_model.save_pretrained(out)
    peft_model.unload()
    return scales, saved


def build_fleet(root: Path) -> Fleet:
    import torch
    from helpers import check_fixtures as cf

    torch.manual_seed(0)
    fleet = Fleet()
    makers = {"llama": cf.make_llama, "qwen2": cf.make_qwen2, "llava": cf.make_llava, "mixtral": cf.make_moe,
              "qwen3_moe": cf.make_qwen3_moe}  # fmt: skip
    models = {}
    for family, make in makers.items():
        folder = root / "bases" / family
        models[family] = make(folder)
        config = json.loads((folder / "config.json").read_text())
        if "head_dim" in config and config["head_dim"] is None:
            # transformers 5 writes Mixtral's head_dim as null, which SGLang's buffer sizing multiplies; real
            # Mixtral configs give it (or leave it out for a transformers that derives it).
            config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
            (folder / "config.json").write_text(json.dumps(config, indent=2))
        fleet.bases[family] = folder
        fleet.configs[family] = config
    models["qwen3_moe_v4"] = cf.qwen3_moe_v4_tree()  # adapters only: served on the qwen3_moe base
    for name, (family, targets, kw) in ADAPTERS.items():
        out = root / "adapters" / name
        fleet.trained[name], fleet.saved[name] = _peft_adapter(models[family], out, targets, **kw)
        fleet.adapters[name] = out
    for name, (source, change) in VARIANTS.items():
        out = root / "adapters" / name
        shutil.copytree(fleet.adapters[source], out)
        if change == "no_weights":
            (out / "adapter_model.safetensors").unlink()
        else:
            config = json.loads((out / "adapter_config.json").read_text())
            (out / "adapter_config.json").write_text(json.dumps({**config, "r": str(config["r"])}))
        fleet.adapters[name] = out
        fleet.trained[name], fleet.saved[name] = fleet.trained[source], fleet.saved[source]
    return fleet


# --- vLLM: each base as vLLM's model files describe it to the LoRA manager ----------------------------------
# vllm/model_executor/models/{llama,qwen2,llava,mixtral,qwen3_moe}.py, the same in 0.30.0, 0.33.0 and 0.34.0: the
# modules the manager can wrap (LinearBase/FusedMoE/embedding layers, in model order), their leaves
# (`get_supported_lora_modules`), `packed_modules_mapping` (the experts of a 2-D MoE model expanded as
# `RoutedExperts.get_expert_mapping` orders them: expert-major, (gate, down, up) in the checkpoint's names), the
# weights mapper (its rename part, which the LoRA loader applies) and the multimodal mapping.


def _decoder(prefix: str, layers: int, mlp: list[str]) -> list[str]:
    out = [f"{prefix}embed_tokens"]
    for i in range(layers):
        out += [f"{prefix}layers.{i}.self_attn.qkv_proj", f"{prefix}layers.{i}.self_attn.o_proj"]
        out += [f"{prefix}layers.{i}.{m}" for m in mlp]
    return out


def vllm_model(family: str, config: dict[str, Any]) -> dict[str, Any]:
    """(the `vllm_runner` load setup, the serving runner's `serve` block without target modules)."""
    qkv = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    gate_up = {"gate_up_proj": ["gate_proj", "up_proj"]}
    setup: dict[str, Any] = {"vocab_size": 128, "max_position_embeddings": 64, "mapper": None, "moe_modules": [],
                             "classification_head": None, "is_pooling_model": False, "unsupported": []}  # fmt: skip
    serve: dict[str, Any] = {"moe_modules": [], "mm": None}
    dense_mlp = ["mlp.gate_up_proj", "mlp.down_proj"]
    if family in ("llama", "qwen2"):
        modules = _decoder("model.", config["num_hidden_layers"], dense_mlp) + ["lm_head"]
        setup.update(supported=["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"],
                     packed={**qkv, **gate_up})  # fmt: skip
    elif family == "mixtral":
        layers, experts = config["num_hidden_layers"], config["num_local_experts"]
        modules = _decoder("model.", layers, ["block_sparse_moe.gate", "block_sparse_moe.experts"]) + ["lm_head"]
        moe = [f"model.layers.{i}.block_sparse_moe.experts" for i in range(layers)]
        packed_experts = [f"experts.{e}.{w}" for e in range(experts) for w in ("w1", "w2", "w3")]
        setup.update(supported=["qkv_proj", "o_proj", "gate", "experts", "embed_tokens", "lm_head"],
                     packed={**qkv, "experts": packed_experts}, moe_modules=moe,
                     mapper={"substr": {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}})  # fmt: skip
        serve["moe_modules"] = moe
    elif family == "qwen3_moe":
        # Qwen3MoeForCausalLM: `mlp.gate` (ReplicatedLinear; 0.33 on GateLinear, one of them), `mlp.experts`
        # (FusedMoE, 2-D: `is_3d_moe_weight` is False), packing qkv only (gate_up_proj only with mlp_only_layers);
        # its hf_to_vllm_mapper is stacked names only, which `get_rename_mapper` drops: no renames.
        layers, experts = config["num_hidden_layers"], config["num_local_experts"]
        assert not config.get("mlp_only_layers") and config.get("decoder_sparse_step", 1) == 1
        modules = _decoder("model.", layers, ["mlp.gate", "mlp.experts"]) + ["lm_head"]
        moe = [f"model.layers.{i}.mlp.experts" for i in range(layers)]
        packed_experts = [f"experts.{e}.{w}" for e in range(experts) for w in ("gate_proj", "down_proj", "up_proj")]
        setup.update(supported=["qkv_proj", "o_proj", "gate", "experts", "embed_tokens", "lm_head"],
                     packed={**qkv, "experts": packed_experts}, moe_modules=moe)  # fmt: skip
        serve["moe_modules"] = moe
    elif family == "llava":
        text = config["text_config"]
        modules = _decoder("language_model.model.", text["num_hidden_layers"], dense_mlp)
        modules.append("language_model.lm_head")
        for i in range(config["vision_config"]["num_hidden_layers"]):
            p = f"vision_tower.vision_model.encoder.layers.{i}."
            modules += [p + "self_attn.qkv_proj", p + "self_attn.out_proj", p + "mlp.fc1", p + "mlp.fc2"]
        modules += ["multi_modal_projector.linear_1", "multi_modal_projector.linear_2"]
        setup.update(
            supported=["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "out_proj", "fc1", "fc2", "linear_1",
                       "linear_2", "embed_tokens", "lm_head"],
            packed={**qkv, **gate_up},
            mapper={"prefix": {"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.",
                               "model.multi_modal_projector.": "multi_modal_projector.",
                               "lm_head.": "language_model.lm_head."}},
        )  # fmt: skip
        serve["mm"] = {"language_model": "language_model", "connector": "multi_modal_projector",
                       "tower_model": "vision_tower"}  # fmt: skip
    else:
        raise ValueError(family)
    serve["modules"] = modules
    return {"setup": setup, "serve": serve}


# Launch flags per engine: (label, flags). Every command also names the base and enables LoRA.
VLLM_LAUNCHES: list[tuple[str, list[str]]] = [
    ("default", ["--max-lora-rank", "32"]),
    ("targets_q_v", ["--max-lora-rank", "32", "--lora-target-modules", "q_proj", "v_proj"]),
    ("targets_qkv_o", ["--max-lora-rank", "32", "--lora-target-modules", "qkv_proj", "o_proj"]),
    ("targets_mlp", ["--max-lora-rank", "32", "--lora-target-modules", "o_proj", "gate_up_proj", "down_proj"]),
]
# Launches for one base only: (label, flags), after the common ones.
VLLM_BASE_LAUNCHES: dict[str, list[tuple[str, list[str]]]] = {
    # a MoE server that wraps the experts and takes rank 64
    "qwen3_moe": [
        ("rank64_attn_experts", ["--max-lora-rank", "64", "--lora-target-modules", "qkv_proj", "o_proj", "experts"])
    ],  # fmt: skip
}
SGLANG_LAUNCHES: list[tuple[str, list[str], str]] = [
    # (label, flags, how the adapters come: "startup" one per server in --lora-paths, or "dynamic" loads)
    ("startup", ["--max-lora-rank", "32"], "startup"),
    ("startup_targets_q_v", ["--max-lora-rank", "32", "--lora-target-modules", "q_proj", "v_proj"], "startup"),
    ("dynamic_all", ["--max-lora-rank", "32", "--lora-target-modules", "all"], "dynamic"),
]
SGLANG_BASE_LAUNCHES: dict[str, list[tuple[str, list[str], str]]] = {
    "qwen3_moe": [
        ("startup_rank64_all", ["--max-lora-rank", "64", "--lora-target-modules", "all"], "startup"),
        ("startup_rank64_attn", ["--max-lora-rank", "64", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
                                 "o_proj"], "startup"),
    ],
}  # fmt: skip
SGLANG_BASES = ("llama", "qwen2", "mixtral", "qwen3_moe")  # the module trees tests/oracle/stubs.py builds for SGLang
