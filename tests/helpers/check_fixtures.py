"""Tiny base models and adapters for tests/check/ and tests/serving/, made at test time with transformers,
diffusers and PEFT.

Bases are saved with a small `max_shard_size`, so each has a `model.safetensors.index.json`. Adapters are made by
PEFT on their own base; kohya files are written from a UNet's module names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lorafast.testing import write_safetensors

SHARD = "40KB"


def _llama_cfg(**over: Any) -> Any:
    from transformers import LlamaConfig

    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    kw.update(over)
    return LlamaConfig(**kw)


def make_llama(root: Path) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_llama_cfg())
    model.save_pretrained(root, max_shard_size=SHARD)
    return model


def make_qwen2(root: Path) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(root, max_shard_size=SHARD)
    return model


def make_llava(root: Path) -> Any:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8, projection_dim=16)  # fmt: skip
    cfg = LlavaConfig(vision_config=vision, text_config=_llama_cfg(), image_token_index=5)
    model = LlavaForConditionalGeneration(cfg)
    model.save_pretrained(root, max_shard_size=SHARD)
    return model


def make_moe(root: Path) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)  # fmt: skip
    model = MixtralForCausalLM(cfg)
    model.save_pretrained(root, max_shard_size=SHARD)
    return model


def _qwen3_moe_cfg() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128, num_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip


def make_qwen3_moe(root: Path) -> Any:
    """A tiny Qwen3-MoE. transformers 5 holds its experts fused (`mlp.experts.gate_up_proj`, 3-D) and saves them
    back per expert (`mlp.experts.N.gate_proj.weight`), as the Hub's Qwen3-MoE checkpoints are."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(_qwen3_moe_cfg())
    model.save_pretrained(root, max_shard_size=SHARD)
    return model


def qwen3_moe_v4_tree() -> Any:
    """`make_qwen3_moe`'s model as transformers 4 built it: one `nn.Linear` per expert projection
    (`model.layers.N.mlp.experts.E.gate_proj`), the names and shapes of its saved checkpoint. PEFT wraps it into
    the per-expert adapter layout that a transformers-5 model can no longer give (see
    /work/shared/reference/fixture-notes.md)."""
    import torch

    cfg = _qwen3_moe_cfg()
    nn, hidden, head = torch.nn, cfg.hidden_size, cfg.head_dim

    def lin(i: int, o: int) -> Any:
        return nn.Linear(i, o, bias=False)

    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(cfg.vocab_size, hidden)
    root.model.layers = nn.ModuleList()
    for _ in range(cfg.num_hidden_layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.q_proj = lin(hidden, cfg.num_attention_heads * head)
        layer.self_attn.k_proj = lin(hidden, cfg.num_key_value_heads * head)
        layer.self_attn.v_proj = lin(hidden, cfg.num_key_value_heads * head)
        layer.self_attn.o_proj = lin(cfg.num_attention_heads * head, hidden)
        layer.mlp = nn.Module()
        layer.mlp.gate = lin(hidden, cfg.num_experts)
        layer.mlp.experts = nn.ModuleList()
        for _ in range(cfg.num_experts):
            expert = nn.Module()
            expert.gate_proj = lin(hidden, cfg.moe_intermediate_size)
            expert.up_proj = lin(hidden, cfg.moe_intermediate_size)
            expert.down_proj = lin(cfg.moe_intermediate_size, hidden)
            layer.mlp.experts.append(expert)
        root.model.layers.append(layer)
    root.lm_head = lin(hidden, cfg.vocab_size)
    return root


def peft_adapter(model: Any, out: Path, targets: list[str], r: int = 4, **kw: Any) -> Path:
    """A PEFT adapter trained (well, initialised) on `model`, saved the usual way."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, **kw))
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:  # non-zero B, so a merge would change something
            torch.nn.init.normal_(p)
    peft_model.save_pretrained(out)
    peft_model.unload()  # give the base back unwrapped for the next adapter
    return out


def tiny_unet(cross_attention_dim: int = 12) -> Any:
    """A two-block UNet; another `cross_attention_dim` is the SD 1.5 (768) vs SDXL (2048) difference in small."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim, attention_head_dim=2, norm_num_groups=4,
    )  # fmt: skip


def make_unet_pipeline(root: Path) -> Any:
    """A diffusers folder: model_index.json, unet/ and text_encoder/ (each saved with save_pretrained)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    unet = tiny_unet()
    unet.save_pretrained(root / "unet", max_shard_size=SHARD)
    te = CLIPTextModel(CLIPTextConfig(hidden_size=12, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=64, projection_dim=12))  # fmt: skip
    te.save_pretrained(root / "text_encoder")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDIMScheduler"}))
    index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.42.1",
             "unet": ["diffusers", "UNet2DConditionModel"], "text_encoder": ["transformers", "CLIPTextModel"],
             "scheduler": ["diffusers", "DDIMScheduler"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "safety_checker": [None, None]}  # fmt: skip
    (root / "model_index.json").write_text(json.dumps(index))
    return unet


def make_dit_pipeline(root: Path) -> Any:
    from diffusers import FluxTransformer2DModel

    dit = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                 axes_dims_rope=(2, 2, 4))  # fmt: skip
    dit.save_pretrained(root / "transformer", max_shard_size=SHARD)
    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}  # fmt: skip
    (root / "model_index.json").write_text(json.dumps(index))
    return dit


def diffusers_lora(model: Any, out: Path, component: str, targets: list[str], r: int = 2) -> Path:
    """A diffusers-format LoRA (`<component>.<module>.lora_A.weight`), as `save_lora_weights` writes it."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model.add_adapter(LoraConfig(r=r, lora_alpha=r, target_modules=targets))
    sd = get_peft_model_state_dict(model)
    model.delete_adapters("default") if hasattr(model, "delete_adapters") else None
    tensors = {f"{component}.{k}": ("F32", tuple(v.shape)) for k, v in sd.items()}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pytorch_lora_weights.safetensors"
    write_safetensors(path, tensors)
    return path


def kohya_unet_lora(model: Any, out: Path, r: int = 2, scale_in: int = 1) -> Path:
    """A kohya file for every attention projection of a UNet (`lora_unet_<path_with_underscores>`);
    `scale_in` multiplies in_features (a LoRA made for another cross-attention width)."""
    import torch

    tensors: dict[str, Any] = {}
    for name, mod in model.named_modules():
        mod = getattr(mod, "base_layer", mod)  # a module PEFT wrapped for an earlier adapter
        if (
            isinstance(mod, torch.nn.Linear)
            and "lora_" not in name
            and ".base_layer" not in name
            and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v")
        ):
            key = "lora_unet_" + name.replace(".", "_")
            fin = mod.in_features * (scale_in if "attn2" in name and name.endswith(("to_k", "to_v")) else 1)
            tensors[f"{key}.lora_down.weight"] = ("F16", (r, fin))
            tensors[f"{key}.lora_up.weight"] = ("F16", (mod.out_features, r))
            tensors[f"{key}.alpha"] = ("F16", ())
    os.makedirs(out.parent, exist_ok=True)
    write_safetensors(out, tensors)
    return out
