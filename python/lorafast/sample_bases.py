"""`lorafast sample --with-bases`: tiny base models and adapters that really fit them, so that every check that
needs a base (`preflight -- <launch command>`, `check`, `merge`) can be tried on sample data.

What it writes under OUT (numpy only; values are random, so merges change the weights):

    bases/llama/        a 2-layer Llama (hidden 64): config.json + model.safetensors, loadable by transformers
    bases/qwen3moe/     a 2-layer Qwen3-MoE (hidden 32, 4 experts; headers only, per-expert weights as checkpoints hold them)
    bases/flux/         a diffusers pipeline folder with a one-block Flux transformer
    adapters/llama-plain    r=8 on q_proj, v_proj: serves everywhere
    adapters/llama-r64      r=64: above a server's --max-lora-rank 32
    adapters/llama-rslora   r=16, use_rslora: SGLang serves it at lora_alpha / r, 4x weaker than trained
    adapters/llama-mlp      r=8 on attention and MLP: partly dropped under --lora-target-modules q_proj v_proj
    adapters/qwen2-plain    an adapter of another base (hidden 48): its factors fit no Llama weight
    adapters/moe-stacked    Qwen3-MoE experts, per-expert (stacked 3-D)
    adapters/moe-shared     Qwen3-MoE experts, shared outer factors: SGLang refuses it beside moe-stacked
    adapters/flux-a, flux-b two diffusers LoRAs on the Flux transformer: one set_lora target, two adapters
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .testing import write_peft_adapter, write_safetensors

# Llama: hidden 64, 4 heads of 16, 2 KV heads, MLP 128, vocab 128.
LLAMA = {"hidden": 64, "heads": 4, "kv": 2, "head_dim": 16, "inter": 128, "layers": 2, "vocab": 128}
# Qwen3-MoE: hidden 32, 4 heads of 8, 2 KV heads, 4 experts of intermediate 16.
MOE = {"hidden": 32, "heads": 4, "kv": 2, "head_dim": 8, "inter": 64, "moe_inter": 16, "experts": 4, "layers": 2,
       "vocab": 128}  # fmt: skip


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _linear_shapes(d: dict[str, int], mlp: bool = True) -> dict[str, tuple[int, int]]:
    kv = d["kv"] * d["head_dim"]
    shapes = {
        "self_attn.q_proj": (d["heads"] * d["head_dim"], d["hidden"]),
        "self_attn.k_proj": (kv, d["hidden"]),
        "self_attn.v_proj": (kv, d["hidden"]),
        "self_attn.o_proj": (d["hidden"], d["heads"] * d["head_dim"]),
    }
    if mlp:
        shapes |= {
            "mlp.gate_proj": (d["inter"], d["hidden"]),
            "mlp.up_proj": (d["inter"], d["hidden"]),
            "mlp.down_proj": (d["hidden"], d["inter"]),
        }
    return shapes


def _write_llama(folder: str, seed: int) -> None:
    d, rng = LLAMA, _rng(seed)
    t: dict[str, Any] = {
        "model.embed_tokens.weight": rng.standard_normal((d["vocab"], d["hidden"]), dtype=np.float32) * 0.02,
        "model.norm.weight": np.ones(d["hidden"], dtype=np.float32),
        "lm_head.weight": rng.standard_normal((d["vocab"], d["hidden"]), dtype=np.float32) * 0.02,
    }
    for layer in range(d["layers"]):
        p = f"model.layers.{layer}."
        for name, shape in _linear_shapes(d).items():
            t[f"{p}{name}.weight"] = rng.standard_normal(shape, dtype=np.float32) * 0.02
        t[f"{p}input_layernorm.weight"] = np.ones(d["hidden"], dtype=np.float32)
        t[f"{p}post_attention_layernorm.weight"] = np.ones(d["hidden"], dtype=np.float32)
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "model.safetensors"), t, metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d["hidden"],
        "intermediate_size": d["inter"], "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv"], "head_dim": d["head_dim"], "vocab_size": d["vocab"],
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "torch_dtype": "float32", "tie_word_embeddings": False,
    }  # fmt: skip
    _json(os.path.join(folder, "config.json"), config)


def _write_moe_base(folder: str) -> None:
    """Headers only (zero-filled): the MoE base is for the engines' checks, not for merging."""
    d = MOE
    t: dict[str, Any] = {
        "model.embed_tokens.weight": ("BF16", (d["vocab"], d["hidden"])),
        "model.norm.weight": ("BF16", (d["hidden"],)),
        "lm_head.weight": ("BF16", (d["vocab"], d["hidden"])),
    }
    for layer in range(d["layers"]):
        p = f"model.layers.{layer}."
        for name, shape in _linear_shapes(d, mlp=False).items():
            t[f"{p}{name}.weight"] = ("BF16", shape)
        for e in range(d["experts"]):
            for proj, shape in (("gate_proj", (d["moe_inter"], d["hidden"])), ("up_proj", (d["moe_inter"], d["hidden"])),
                                ("down_proj", (d["hidden"], d["moe_inter"]))):  # fmt: skip
                t[f"{p}mlp.experts.{e}.{proj}.weight"] = ("BF16", shape)
        t[f"{p}mlp.gate.weight"] = ("BF16", (d["experts"], d["hidden"]))
        t[f"{p}input_layernorm.weight"] = ("BF16", (d["hidden"],))
        t[f"{p}post_attention_layernorm.weight"] = ("BF16", (d["hidden"],))
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "model.safetensors"), t)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": d["hidden"],
        "intermediate_size": d["inter"], "moe_intermediate_size": d["moe_inter"], "num_experts": d["experts"],
        "num_experts_per_tok": 2, "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv"], "head_dim": d["head_dim"], "vocab_size": d["vocab"],
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    _json(os.path.join(folder, "config.json"), config)


def _write_flux(folder: str) -> None:
    hidden = 16
    t: dict[str, Any] = {}
    for proj in ("to_q", "to_k", "to_v"):
        t[f"transformer_blocks.0.attn.{proj}.weight"] = ("BF16", (hidden, hidden))
    t["transformer_blocks.0.attn.to_out.0.weight"] = ("BF16", (hidden, hidden))
    sub = os.path.join(folder, "transformer")
    os.makedirs(sub, exist_ok=True)
    write_safetensors(os.path.join(sub, "diffusion_pytorch_model.safetensors"), t)
    _json(os.path.join(sub, "config.json"), {"_class_name": "FluxTransformer2DModel", "num_layers": 1,
                                             "attention_head_dim": 8, "num_attention_heads": 2})  # fmt: skip
    _json(os.path.join(folder, "model_index.json"), {"_class_name": "FluxPipeline",
                                                    "transformer": ["diffusers", "FluxTransformer2DModel"]})  # fmt: skip


def _json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def _lora(
    rng: np.random.Generator, shapes: dict[str, tuple[int, int]], r: int, prefix: str = "base_model.model.model.layers"
) -> dict[str, Any]:
    t: dict[str, Any] = {}
    for layer in range(2):
        for name, (out, inp) in shapes.items():
            key = f"{prefix}.{layer}.{name}"
            t[f"{key}.lora_A.weight"] = rng.standard_normal((r, inp), dtype=np.float32) * 0.1
            t[f"{key}.lora_B.weight"] = rng.standard_normal((out, r), dtype=np.float32) * 0.1
    return t


def _moe_adapter(folder: str, shared: bool, r: int = 8) -> None:
    d = MOE
    e, h, i = d["experts"], d["hidden"], d["moe_inter"]
    outer = 1 if shared else e
    t: dict[str, Any] = {}
    for layer in range(d["layers"]):
        pre = f"base_model.model.model.layers.{layer}"
        for proj in ("q_proj", "v_proj"):
            out = d["heads"] * d["head_dim"] if proj == "q_proj" else d["kv"] * d["head_dim"]
            t[f"{pre}.self_attn.{proj}.lora_A.weight"] = ("BF16", (r, h))
            t[f"{pre}.self_attn.{proj}.lora_B.weight"] = ("BF16", (out, r))
        x = f"{pre}.mlp.experts"
        t[f"{x}.gate_up_proj.lora_A.weight"] = ("BF16", (outer, r, h))
        t[f"{x}.gate_up_proj.lora_B.weight"] = ("BF16", (e, 2 * i, r))
        t[f"{x}.down_proj.lora_A.weight"] = ("BF16", (e, r, i))
        t[f"{x}.down_proj.lora_B.weight"] = ("BF16", (outer, h, r))
    write_peft_adapter(folder, t, r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "gate_up_proj", "down_proj"],
                       base_model_name_or_path="sample/qwen3moe")  # fmt: skip


def _flux_lora(path: str, rng: np.random.Generator, projs: tuple[str, ...], r: int = 4) -> None:
    t: dict[str, Any] = {}
    for proj in projs:
        key = f"transformer.transformer_blocks.0.attn.{proj}"
        t[f"{key}.lora_A.weight"] = rng.standard_normal((r, 16), dtype=np.float32) * 0.1
        t[f"{key}.lora_B.weight"] = rng.standard_normal((16, r), dtype=np.float32) * 0.1
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_safetensors(path, t)


def write_with_bases(out_dir: str | os.PathLike[str], seed: int = 0) -> dict[str, str]:
    """Write the bases and adapters listed in the module docstring under `out_dir`; return {name: path}."""
    out = os.fspath(out_dir)
    bases, adapters = os.path.join(out, "bases"), os.path.join(out, "adapters")
    paths = {"llama": os.path.join(bases, "llama"), "qwen3moe": os.path.join(bases, "qwen3moe"),
             "flux": os.path.join(bases, "flux")}  # fmt: skip
    _write_llama(paths["llama"], seed)
    _write_moe_base(paths["qwen3moe"])
    _write_flux(paths["flux"])
    rng = _rng(seed + 1)
    attn = {k: v for k, v in _linear_shapes(LLAMA).items() if k.endswith(("q_proj", "v_proj"))}
    common = {"base_model_name_or_path": "sample/llama", "task_type": "CAUSAL_LM"}
    for name, shapes, r, extra in (
        ("llama-plain", attn, 8, {}),
        ("llama-r64", attn, 64, {}),
        ("llama-rslora", attn, 16, {"use_rslora": True}),
        ("llama-mlp", _linear_shapes(LLAMA), 8, {}),
    ):
        folder = os.path.join(adapters, name)
        targets = sorted({k.rsplit(".", 1)[-1] for k in shapes})
        write_peft_adapter(folder, _lora(rng, shapes, r), r=r, lora_alpha=2 * r, target_modules=targets,
                           **common, **extra)  # fmt: skip
        paths[name] = folder
    qwen2 = {"hidden": 48, "heads": 4, "kv": 2, "head_dim": 12, "inter": 96}
    q2 = {k: v for k, v in _linear_shapes(qwen2).items() if k.endswith(("q_proj", "v_proj"))}
    paths["qwen2-plain"] = write_peft_adapter(os.path.join(adapters, "qwen2-plain"), _lora(rng, q2, 8), r=8,
                                              lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                              base_model_name_or_path="sample/qwen2")  # fmt: skip
    for name, shared in (("moe-stacked", False), ("moe-shared", True)):
        paths[name] = os.path.join(adapters, name)
        _moe_adapter(paths[name], shared)
    for name, projs in (("flux-a", ("to_q", "to_k")), ("flux-b", ("to_q", "to_v"))):
        paths[name] = os.path.join(adapters, name, "pytorch_lora_weights.safetensors")
        _flux_lora(paths[name], rng, projs)
    return paths
