"""Adapters and adapter sets for the SGLang LLM oracle (tests/oracle/test_oracle_sglang.py).

Every adapter is a folder on disk (safetensors headers with sparse zero data, an `adapter_config.json`), built
for one of six tiny base models. Sources: real PEFT `save_pretrained` output for tiny Llama, Qwen2, Mistral,
Mixtral, Qwen2-MoE and Qwen3-MoE models; `lorafast sample` adapters; tests/fixtures/real; and hand-made variants
of every class of SGLang failure (loader rules, Inkling shared experts, first-use failures, added tokens, ...).
Sets combine them with the server flags (`--max-lora-rank`, `--lora-target-modules`, shared-outer override,
strict loading, `--max-loras-per-batch`) plus later dynamic loads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from lorafast.testing import write_safetensors

ROOT = Path(__file__).resolve().parents[2]
H, HEADS, KV, INTER, LAYERS, VOCAB = 16, 4, 2, 24, 2, 64
HEAD_DIM = H // HEADS
E, MOE_INTER, SHARED_INTER = 4, 8, 12

_COMMON = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV, "intermediate_size": INTER,
           "num_hidden_layers": LAYERS, "vocab_size": VOCAB}  # fmt: skip
BASES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **_COMMON},
    "qwen2": {"model_type": "qwen2", **_COMMON},
    "mistral": {"model_type": "mistral", **_COMMON},
    "mixtral": {"model_type": "mixtral", **_COMMON, "num_local_experts": E, "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", **_COMMON, "num_experts": E, "moe_intermediate_size": MOE_INTER,
                  "shared_expert_intermediate_size": SHARED_INTER, "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", **_COMMON, "num_experts": E, "moe_intermediate_size": MOE_INTER,
                  "num_experts_per_tok": 2, "head_dim": HEAD_DIM},
    # Inkling's shared-sink normalization is keyed on the architecture name; the tree is Qwen2-MoE's.
    "inkling": {"model_type": "qwen2_moe", **_COMMON, "num_experts": E, "moe_intermediate_size": MOE_INTER,
                "shared_expert_intermediate_size": SHARED_INTER, "num_experts_per_tok": 2, "n_shared_experts": 2,
                "architectures": ["InklingForCausalLM"]},
}  # fmt: skip
BASES["deepseek_v3"] = {
    "model_type": "deepseek_v3", "hidden_size": H, "intermediate_size": INTER, "moe_intermediate_size": MOE_INTER,
    "n_routed_experts": E, "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": 12, "kv_lora_rank": 8,
    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4, "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "num_experts_per_tok": 2,
}  # fmt: skip
for _n in (0, 1, 3):  # Inkling with other shared-expert counts (0: SGLang skips the normalization)
    BASES[f"inkling{_n}"] = {**BASES["inkling"], "n_shared_experts": _n}
MOE_BASES = ("mixtral", "qwen2_moe", "qwen3_moe", "inkling", "inkling0", "inkling1", "inkling3")

ATTN = {"q_proj": (H, HEADS * HEAD_DIM), "k_proj": (H, KV * HEAD_DIM), "v_proj": (H, KV * HEAD_DIM),
        "o_proj": (HEADS * HEAD_DIM, H)}  # fmt: skip
MLP = {"gate_proj": (H, INTER), "up_proj": (H, INTER), "down_proj": (INTER, H)}
PRE = "base_model.model.model.layers"
# Realistic target sets (q without v is one: SGLang's q/k/v fusion then fails on the missing v_proj).
LEAF_SETS = (
    ("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), ("o_proj",), ("down_proj",),
    ("gate_proj", "up_proj", "down_proj"), ("gate_proj",), ("k_proj", "v_proj"), ("q_proj",), ("up_proj", "o_proj"),
)  # fmt: skip


def _pair(t: dict, key: str, r: int, fin: int, fout: int, a: str = "lora_A", b: str = "lora_B") -> None:
    t[f"{key}.{a}.weight"] = ("F32", (r, fin))
    t[f"{key}.{b}.weight"] = ("F32", (fout, r))


def write_adapter(folder: Path, tensors: dict | None, config: Any, *, files: dict[str, str] | None = None,
                  weights_name: str = "adapter_model.safetensors") -> str:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    if tensors is not None:
        write_safetensors(folder / weights_name, tensors)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (folder / "adapter_config.json").write_text(text)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    return str(folder)


# Torch weight files per class: file -> its tensors ("adapter": the adapter's, "other": another module's,
# "none": an empty dict, as a training_args.bin stand-in).
TORCH_FILES = {
    "bin_only": {"adapter_model.bin": "adapter"}, "pt_only": {"adapter_model.pt": "adapter"},
    "bin_and_pt": {"adapter_model.bin": "adapter", "adapter_model.pt": "other"},
    "training_args_and_pt": {"training_args.bin": "none", "adapter_model.pt": "adapter"},
    "only_training_args": {"training_args.bin": "none"},
}  # fmt: skip


def _torch_save(path: Path, tensors: dict) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: torch.zeros(shape) for k, (_, shape) in tensors.items()}, path)


def _config(r: Any, targets: Any, **extra: Any) -> dict:
    return {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r if isinstance(r, int) else 8, "target_modules": targets,
            "bias": "none", "task_type": "CAUSAL_LM", **extra}  # fmt: skip


# --- hand-made adapters --------------------------------------------------------------------------------------


def _dense_tensors(rng: random.Random, leaves: list[str], r: int, layers: list[int], fused: bool) -> dict:
    t: dict = {}
    for layer in layers:
        for leaf in leaves:
            parent = "self_attn" if leaf in ATTN else "mlp"
            fin, fout = {**ATTN, **MLP}[leaf]
            _pair(t, f"{PRE}.{layer}.{parent}.{leaf}", r, fin, fout)
        if fused:
            _pair(t, f"{PRE}.{layer}.self_attn.qkv_proj", r, H, (HEADS + 2 * KV) * HEAD_DIM)
            _pair(t, f"{PRE}.{layer}.mlp.gate_up_proj", r, H, 2 * INTER)
    return t


def _moe_tensors(base: str, r: int, layers: list[int], *, layout: str, experts: int = E, style: str = "") -> dict:
    """Routed-expert LoRA: `2d` numbered experts, `3d` stacked per expert, `outer` shared-outer 3D."""
    t: dict = {}
    inter = INTER if base == "mixtral" else MOE_INTER
    block = "block_sparse_moe" if base == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if (style or ("w" if base == "mixtral" else "")) == "w" else (
        "gate_proj", "up_proj", "down_proj")  # fmt: skip
    for layer in layers:
        pre = f"{PRE}.{layer}.{block}.experts"
        if layout == "2d":
            for e in range(experts):
                _pair(t, f"{pre}.{e}.{names[0]}", r, H, inter)
                _pair(t, f"{pre}.{e}.{names[1]}", r, H, inter)
                _pair(t, f"{pre}.{e}.{names[2]}", r, inter, H)
        else:
            outer = 1 if layout == "outer" else experts
            t[f"{pre}.gate_up_proj.lora_A.weight"] = ("F32", (outer, r, H))
            t[f"{pre}.gate_up_proj.lora_B.weight"] = ("F32", (experts, 2 * inter, r))
            t[f"{pre}.down_proj.lora_A.weight"] = ("F32", (experts, r, inter))
            t[f"{pre}.down_proj.lora_B.weight"] = ("F32", (outer, H, r))
    return t


def _hand_made(rng: random.Random, out: Path, base: str, n: int) -> list[tuple[str, str]]:
    """`n` adapters for `base`, cycling through good and broken classes; returns (class, path)."""
    made: list[tuple[str, str]] = []
    moe = base in MOE_BASES
    classes = [
        "dense", "dense", "fused", "embed", "subset_config", "rank_below_weights", "rank_above_weights",
        "missing_b", "one_d", "layer_out_of_range", "float_r", "str_r", "dora", "loha", "no_r", "no_targets",
        "regex_targets", "all_linear", "dict_targets", "added_tokens", "fake_added_tokens", "bad_added_tokens",
        "index_missing_shard", "index_no_weight_map", "consolidated", "config_list", "config_invalid",
        "no_weights", "no_config", "unembed", "bias_tensor", "big_rank",
        # the loader's choice without .safetensors: *.bin, else *.pt, then training files dropped
        "bin_only", "pt_only", "bin_and_pt", "training_args_and_pt", "only_training_args", "zero_size",
    ]  # fmt: skip
    if moe:
        classes += ["moe_2d", "moe_2d", "moe_3d", "moe_outer", "moe_outer", "moe_too_many", "moe_2d_w",
                    "numbered_shared", "shared_expert", "moe_mixed", "inkling_flat", "moe_too_few"]  # fmt: skip
    for i in range(n):
        kind = classes[i % len(classes)]
        folder = out / f"{base}-{i:03d}-{kind}"
        r = rng.choice((2, 4, 8))
        layers = sorted(rng.sample(range(LAYERS), rng.choice((1, 2))))
        leaves = list(rng.choice(LEAF_SETS))
        if moe:
            leaves = [x for x in leaves if x in ATTN] or ["q_proj"]
        t = _dense_tensors(rng, leaves, r, layers, fused=False)
        targets = list(leaves)
        cfg: Any = None
        files: dict[str, str] = {}
        name = "adapter_model.safetensors"
        if kind == "fused":
            t = _dense_tensors(rng, [], r, layers, fused=True)
            targets = ["qkv_proj", "gate_up_proj"]
        elif kind == "embed":
            t["base_model.model.model.embed_tokens.lora_embedding_A"] = ("F32", (r, VOCAB))
            t["base_model.model.model.embed_tokens.lora_embedding_B"] = ("F32", (H, r))
            t["base_model.model.lm_head.lora_A.weight"] = ("F32", (r, H))
            t["base_model.model.lm_head.lora_B.weight"] = ("F32", (VOCAB, r))
            targets = targets + rng.choice((["embed_tokens", "lm_head"], ["embed_tokens"], ["lm_head"], []))
        elif kind == "subset_config" and len(targets) > 1:
            targets = targets[:1]  # weights of the other modules are outside the target modules
        elif kind == "unembed":
            t["base_model.model.model.unembed_tokens.lora_A.weight"] = ("F32", (r, H))
            t["base_model.model.model.unembed_tokens.lora_B.weight"] = ("F32", (VOCAB, r))
            targets = targets + ["lm_head"]
        elif kind == "bias_tensor":
            key = next(iter(t)).replace("lora_A.weight", "lora_B.bias")
            t[key] = ("F32", (8,))
        elif kind == "missing_b":
            t.pop(next(k for k in t if "lora_B" in k))
        elif kind == "one_d":
            key = next(k for k in t if "lora_A" in k)
            t[key] = ("F32", (t[key][1][1],))
        elif kind == "layer_out_of_range":
            _pair(t, f"{PRE}.{LAYERS + 3}.self_attn.q_proj", r, H, H)
        elif kind == "moe_2d":
            t.update(_moe_tensors(base, r, layers, layout="2d"))
        elif kind == "moe_2d_w":
            t.update(_moe_tensors(base, r, layers, layout="2d", style="w"))
        elif kind == "moe_3d":
            t.update(_moe_tensors(base, r, layers, layout="3d"))
        elif kind == "moe_outer":
            t.update(_moe_tensors(base, r, layers, layout="outer"))
        elif kind == "moe_too_many":
            t.update(_moe_tensors(base, r, layers, layout=rng.choice(("2d", "3d", "outer")), experts=E + 2))
        elif kind == "moe_too_few":
            t.update(_moe_tensors(base, r, layers, layout=rng.choice(("2d", "3d")), experts=E - 1))
        elif kind == "moe_mixed":
            t.update(_moe_tensors(base, r, layers[:1], layout="2d"))
            t.update(_moe_tensors(base, r, [1], layout="outer"))
            layers = sorted(set(layers) | {1})
        elif kind == "numbered_shared":
            for layer in layers:
                for e in range(2):
                    _pair(t, f"{PRE}.{layer}.mlp.shared_experts.{e}.gate_proj", r, H, MOE_INTER)
                    _pair(t, f"{PRE}.{layer}.mlp.shared_experts.{e}.down_proj", r, MOE_INTER, H)
        elif kind == "shared_expert":
            for layer in layers:
                _pair(t, f"{PRE}.{layer}.mlp.shared_expert.gate_proj", r, H, SHARED_INTER)
                _pair(t, f"{PRE}.{layer}.mlp.shared_expert.up_proj", r, H, SHARED_INTER)
                _pair(t, f"{PRE}.{layer}.mlp.shared_expert.down_proj", r, SHARED_INTER, H)
        elif kind == "inkling_flat":
            n_shared = rng.choice((1, 2, 3))
            for layer in layers:
                pre = f"{PRE}.{layer}.mlp.shared_experts"
                leaf = rng.choice((("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")))
                _pair(t, f"{pre}.{leaf[0]}", r, H, MOE_INTER * n_shared)
                _pair(t, f"{pre}.{leaf[1]}", r, H, MOE_INTER * n_shared)
                _pair(t, f"{pre}.{leaf[2]}", r, MOE_INTER * n_shared, H)
        if kind.startswith(("moe", "numbered_shared", "shared_expert", "inkling")):
            targets = targets + rng.choice((["gate_proj", "up_proj", "down_proj"], ["w1", "w2", "w3"],
                                            ["gate_up_proj", "down_proj"], ["down_proj"]))  # fmt: skip
        cfg = _config(r, targets)
        if kind == "rank_below_weights":
            cfg["r"] = max(1, r // 2)
        elif kind == "rank_above_weights":
            cfg["r"] = r * 2
        elif kind == "big_rank":
            t = _dense_tensors(rng, leaves, 16, layers, fused=False)
            cfg["r"] = 16
        elif kind == "float_r":
            cfg["r"] = float(r)
        elif kind == "str_r":
            cfg["r"] = str(r)
        elif kind == "dora":
            cfg["use_dora"] = True
        elif kind == "loha":
            cfg["peft_type"] = "LOHA"
        elif kind == "no_r":
            del cfg["r"]
        elif kind == "no_targets":
            del cfg["target_modules"]
        elif kind == "regex_targets":
            cfg["target_modules"] = r".*\.(q_proj|v_proj)"
        elif kind == "all_linear":
            cfg["target_modules"] = rng.choice(("all-linear", "all"))
        elif kind == "dict_targets":
            cfg["target_modules"] = {t_: 1 for t_ in targets}
        elif kind == "added_tokens":
            files["added_tokens.json"] = json.dumps({"<x>": VOCAB, "<y>": VOCAB + 1})
        elif kind == "fake_added_tokens":
            files["added_tokens.json"] = json.dumps({"<x>": 3, "<y>": VOCAB - 1})
        elif kind == "bad_added_tokens":
            files["added_tokens.json"] = "{not json"
        elif kind == "index_missing_shard":
            files["model.safetensors.index.json"] = json.dumps({"weight_map": {k: "missing.safetensors" for k in t}})
        elif kind == "index_no_weight_map":
            files["model.safetensors.index.json"] = json.dumps({"metadata": {}})
        elif kind == "consolidated":
            write_adapter(folder, {k: v for k, v in list(t.items())[:2]}, None, weights_name="consolidated.safetensors")
            name = "model.safetensors"
        elif kind == "config_list":
            cfg = json.dumps([cfg])
        elif kind == "config_invalid":
            cfg = '{"r": 4,'
        elif kind == "no_weights":
            t = None  # type: ignore[assignment]
        elif kind == "no_config":
            cfg = None
        elif kind == "zero_size":  # empty tensors share one data offset; their order is the loader's
            t.update({f"{PRE}.{layers[0]}.self_attn.{n}.lora_A.weight": ("F32", (0, H)) for n in ("zb", "za", "zc")})
        elif kind in TORCH_FILES:
            for file, which in TORCH_FILES[kind].items():
                _torch_save(folder / file, t if which == "adapter" else _dense_tensors(rng, ["o_proj"], r, [0], False)
                            if which == "other" else {})  # fmt: skip
            t = None  # type: ignore[assignment]
        made.append((kind, write_adapter(folder, t, cfg, files=files, weights_name=name)))
    return made


def _inkling(rng: random.Random, out: Path, base: str, n: int) -> list[tuple[str, str]]:
    """Flat 2D `shared_experts.` factors (Inkling's shared sink) in every naming and size, on an Inkling base."""
    made = []
    for i in range(n):
        r = rng.choice((2, 4))
        n_flat = rng.choice((1, 2, 3))
        inter = MOE_INTER * n_flat + rng.choice((0, 0, 0, 1))  # sometimes a size no shared count divides
        names = rng.choice((("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("gate_up_proj", None,
                                                                                         "down_proj")))  # fmt: skip
        t = _dense_tensors(rng, ["q_proj", "k_proj", "v_proj"], r, [0, 1], fused=False)
        for layer in range(LAYERS):
            pre = f"{PRE}.{layer}.mlp.shared_experts"
            if names[1] is None:
                _pair(t, f"{pre}.{names[0]}", r, H, 2 * inter)
            else:
                _pair(t, f"{pre}.{names[0]}", r, H, inter)
                _pair(t, f"{pre}.{names[1]}", r, H, inter)
            _pair(t, f"{pre}.{names[2]}", r, inter, H)
            if rng.random() < 0.2:
                _pair(t, f"{pre}.0.{names[0]}", r, H, inter)  # a numbered factor beside the flat ones
        targets = ["q_proj", "k_proj", "v_proj"] + rng.choice((["gate_proj", "up_proj", "down_proj"],
                                                               ["gate_up_proj", "down_proj"], ["w1", "w2", "w3"]))  # fmt: skip
        path = write_adapter(out / f"{base}-inkling-{i:02d}", t, _config(r, targets))
        made.append(("inkling_shared", path))
    return made


def _deepseek(rng: random.Random, out: Path, n: int) -> list[tuple[str, str]]:
    """DeepSeek-V3 adapters: MLA projections (q_a/kv_a fused by SGLang), routed and shared experts."""
    b = BASES["deepseek_v3"]
    qk = b["qk_nope_head_dim"] + b["qk_rope_head_dim"]
    dims = {"q_a_proj": (H, b["q_lora_rank"]), "kv_a_proj_with_mqa": (H, b["kv_lora_rank"] + b["qk_rope_head_dim"]),
            "q_b_proj": (b["q_lora_rank"], HEADS * qk), "o_proj": (HEADS * b["v_head_dim"], H),
            "kv_b_proj": (b["kv_lora_rank"], HEADS * (b["qk_nope_head_dim"] + b["v_head_dim"]))}  # fmt: skip
    made = []
    for i in range(n):
        r = rng.choice((2, 4))
        leaves = rng.choice((sorted(dims), ["q_a_proj", "q_b_proj"], ["kv_b_proj", "o_proj"], ["q_a_proj"]))
        t: dict = {}
        for layer in range(LAYERS):
            for leaf in leaves:
                _pair(t, f"{PRE}.{layer}.self_attn.{leaf}", r, *dims[leaf])
        kind = rng.choice(("mla", "dense_mlp", "experts", "shared", "numbered_shared"))
        targets = list(leaves)
        if kind == "dense_mlp":
            _pair(t, f"{PRE}.0.mlp.gate_proj", r, H, INTER)
            _pair(t, f"{PRE}.0.mlp.down_proj", r, INTER, H)
            targets += ["gate_proj", "down_proj"]
        elif kind == "experts":
            for e in range(rng.choice((E, E + 1))):
                _pair(t, f"{PRE}.1.mlp.experts.{e}.gate_proj", r, H, MOE_INTER)
                _pair(t, f"{PRE}.1.mlp.experts.{e}.down_proj", r, MOE_INTER, H)
            targets += ["gate_proj", "down_proj"]
        elif kind == "shared":
            _pair(t, f"{PRE}.1.mlp.shared_experts.gate_proj", r, H, 2 * MOE_INTER)
            _pair(t, f"{PRE}.1.mlp.shared_experts.up_proj", r, H, 2 * MOE_INTER)
            _pair(t, f"{PRE}.1.mlp.shared_experts.down_proj", r, 2 * MOE_INTER, H)
            targets += ["gate_proj", "up_proj", "down_proj"]
        else:
            _pair(t, f"{PRE}.1.mlp.shared_experts.0.gate_proj", r, H, MOE_INTER)
            targets += ["gate_proj", "down_proj"]
        made.append((f"deepseek_{kind}", write_adapter(out / f"deepseek-{i:02d}-{kind}", t, _config(r, targets))))
    return made


def _sharded(rng: random.Random, out: Path, n: int) -> list[tuple[str, str]]:
    """Adapters split over two shards with a `model.safetensors.index.json`, as large checkpoints are."""
    made = []
    for i in range(n):
        base = rng.choice(("llama", "qwen2_moe"))
        leaves = ["q_proj", "k_proj", "v_proj", "o_proj"]
        r = rng.choice((2, 4))
        t = _dense_tensors(rng, leaves, r, [0, 1], fused=False)
        if base == "qwen2_moe":
            t.update(_moe_tensors(base, r, [0, 1], layout=rng.choice(("2d", "3d", "outer"))))
            leaves = leaves + ["gate_proj", "up_proj", "down_proj"]
        names = sorted(t)
        cut = rng.randint(1, len(names) - 1)
        shards = {"model-00002-of-00002.safetensors": names[:cut], "model-00001-of-00002.safetensors": names[cut:]}
        folder = out / f"sharded-{i:02d}"
        folder.mkdir(parents=True)
        for file, keys in shards.items():
            write_safetensors(folder / file, {k: t[k] for k in keys})
        index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        (folder / "adapter_config.json").write_text(json.dumps(_config(r, leaves)))
        made.append((base, str(folder)))
    return made


# --- real PEFT output ------------------------------------------------------------------------------------------


def _peft_adapters(out: Path, rng: random.Random, n_per_base: int) -> list[tuple[str, str, str]]:
    """`save_pretrained` of real PEFT LoRA on tiny transformers models of each base: (base, class, path)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    made = []
    torch.manual_seed(0)
    for base in ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"):
        config = AutoConfig.for_model(**{k: v for k, v in BASES[base].items() if k != "architectures"})
        model = AutoModelForCausalLM.from_config(config)
        for i in range(n_per_base):
            targets = sorted(rng.sample(sorted({**ATTN, **MLP} if base in ("llama", "qwen2", "mistral") else ATTN),
                                        rng.randint(1, 4)))  # fmt: skip
            extra: dict[str, Any] = {}
            if base in ("qwen3_moe", "qwen2_moe", "mixtral") and i % 3 == 1:
                extra["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
            if i % 5 == 4:
                targets = targets + ["embed_tokens", "lm_head"]
            r = rng.choice((2, 4, 8))
            try:
                peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, **extra))
            except Exception:  # a target PEFT refuses on this model: try without target_parameters
                continue
            folder = out / f"peft-{base}-{i:02d}"
            peft_model.save_pretrained(str(folder))
            model = peft_model.unload()
            made.append((base, "peft", str(folder)))
    return made


# --- the whole data set ------------------------------------------------------------------------------------------


def build(out: Path, seed: int = 11) -> dict[str, Any]:
    """Write every adapter under `out`; return {"adapters": [(base, class, path)], "cases": [...]}."""
    rng = random.Random(seed)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    adapters: list[tuple[str, str, str]] = []
    for base in BASES:
        count = 75 if base in MOE_BASES else 55
        if base in ("inkling0", "inkling1", "inkling3"):
            count = 0
        adapters += [(base, kind, path) for kind, path in _hand_made(rng, out / "hand", base, count)]
        if base.startswith("inkling"):
            adapters += [(base, kind, path) for kind, path in _inkling(rng, out / "inkling", base, 12)]
    adapters += [("deepseek_v3", kind, path) for kind, path in _deepseek(rng, out / "deepseek", 30)]
    adapters += [(base, "sharded", path) for base, path in _sharded(rng, out / "sharded", 12)]
    adapters += _peft_adapters(out / "peft", rng, 6)
    fixtures = ROOT / "tests" / "fixtures" / "real"
    for folder in sorted(fixtures.iterdir()):
        if folder.is_dir() and folder.name.startswith("peft_"):
            base = {"peft_mixtral_v4_experts": "mixtral", "peft_qwen2moe_v4_experts": "qwen2_moe",
                    "peft_qwen3moe_target_parameters": "qwen3_moe"}.get(folder.name, "llama")  # fmt: skip
            adapters.append((base, "fixture", str(folder)))
    adapters += _samples(out / "samples")
    adapters += _mutants(rng, out / "mutants", adapters, 80)
    adapters.append(("llama", "not_a_folder", str(out / "does-not-exist")))
    adapters.append(("llama", "hub_id", "not a valid/repo id!"))
    # Empty tensors at one data offset, in a file of their own: the loader's order (its iterators, directly).
    empty = out / "empty-tensors" / "adapter_model.safetensors"
    empty.parent.mkdir()
    write_safetensors(empty, {f"{PRE}.0.self_attn.{m}.lora_A.weight": ("F32", (4, H) if m == "o_proj" else (0, H))
                              for m in ("zc", "o_proj", "za", "zb")})  # fmt: skip
    functions = [*_functions(adapters), {"fn": "iterate", "path": str(empty)}]
    return {"adapters": adapters, "cases": _cases(rng, adapters), "functions": functions}


def _functions(adapters: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Direct calls of SGLang's name rules: every distinct config `target_modules`, and auto-detection."""
    calls: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _base, _kind, path in adapters:
        config = Path(path) / "adapter_config.json"
        try:
            tm = json.loads(config.read_text())["target_modules"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        key = json.dumps(tm, sort_keys=True)
        if key not in seen:
            seen.add(key)
            calls.append({"fn": "normalized", "target_modules": tm})
    supported = (None, [], ["up_proj"], ["in_proj", "qkv_proj"], ["not_a_module", "lm_head"], ["indexer.wk"])
    for base in BASES.values():
        calls += [{"fn": "auto_detect", "base": base, "supported": s} for s in supported]
    # `LoRAAdapter.initialize_weights` alone, per adapter (compat's `predict_loaded_weights`)
    calls += [{"fn": "loaded_weights", "base": BASES[base], "path": path} for base, _kind, path in adapters]
    return calls


def _mutants(rng: random.Random, out: Path, adapters: list[tuple[str, str, str]], n: int) -> list[tuple[str, str, str]]:
    """Working adapters with one random change to one tensor: a dimension off by a few, a dropped or extra
    dimension, a tensor removed or renamed to another module. First use is where most of these surface."""
    from lorafast import read_header

    good = [(b, p) for b, k, p in adapters if k in ("dense", "fused", "embed", "moe_2d", "moe_3d", "moe_outer",
                                                     "peft", "shared_expert", "inkling_shared")]  # fmt: skip
    made = []
    for i in range(n):
        base, path = rng.choice(good)
        header = read_header(Path(path) / "adapter_model.safetensors")
        t = {name: ("F32", tuple(info.shape)) for name, info in header.tensors.items()}
        name = rng.choice(sorted(t))
        shape = t[name][1]
        change = rng.choice(("grow", "shrink", "flatten", "extra_dim", "drop", "rename"))
        if change == "grow":
            axis = rng.randrange(len(shape))
            t[name] = ("F32", tuple(d + rng.choice((1, 2, 8)) if j == axis else d for j, d in enumerate(shape)))
        elif change == "shrink":
            axis = rng.randrange(len(shape))
            t[name] = ("F32", tuple(max(1, d - 1) if j == axis else d for j, d in enumerate(shape)))
        elif change == "flatten":
            t[name] = ("F32", (shape[-1],))
        elif change == "extra_dim":
            t[name] = ("F32", (1, *shape))
        elif change == "drop":
            del t[name]
        else:
            for a, b in (
                ("q_proj", "o_proj"),
                ("down_proj", "up_proj"),
                ("v_proj", "k_proj"),
                ("gate_proj", "up_proj"),
            ):
                if a in name:
                    t[name.replace(a, b)] = t.pop(name)
                    break
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        made.append((base, f"mutant_{change}", write_adapter(out / f"mutant-{i:02d}-{change}", t, config)))
    return made


def _samples(out: Path) -> list[tuple[str, str, str]]:
    """`lorafast sample` LLM adapters (hidden 16), each on a tiny base (fewer layers: SGLang's IndexError) and on
    a base of its own shape (the sample's layer and expert counts, registered in BASES)."""
    import re

    from lorafast import read_header
    from lorafast.sample import sample_kind_of, write_samples

    made = []
    for path in write_samples(out, 40, seed=3, hidden=16):
        kind = sample_kind_of(path)
        if not kind.startswith("peft_"):
            continue
        base = "qwen3_moe" if "moe" in kind else "llama"
        if kind == "peft_moe_2d_mixtral":
            base = "mixtral"
        elif kind == "peft_moe_2d_qwen":
            base = "qwen2_moe"
        made.append((base, f"sample_{kind}", os.fspath(path)))
        names = list(read_header(Path(path) / "adapter_model.safetensors").tensors)
        layers = 1 + max(int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n)))
        experts = 1 + max((int(m.group(1)) for n in names if (m := re.search(r"experts\.(\d+)\.", n))), default=7)
        own = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 1,
               "intermediate_size": 43, "num_hidden_layers": layers, "vocab_size": 128}  # fmt: skip
        if base == "mixtral":
            own |= {"model_type": "mixtral", "num_local_experts": experts, "intermediate_size": 8}
        elif base == "qwen2_moe":
            own |= {"model_type": "qwen2_moe", "num_experts": experts, "moe_intermediate_size": 8,
                    "shared_expert_intermediate_size": 32}  # fmt: skip
        elif base == "qwen3_moe":
            if "3d" in kind or "outer" in kind:
                experts = max(t[0] for n, t in ((n, read_header(Path(path) / "adapter_model.safetensors").tensors[n]
                                                 .shape) for n in names) if len(t) == 3)  # fmt: skip
            own |= {"model_type": "qwen3_moe", "num_experts": experts, "moe_intermediate_size": 8, "head_dim": 4}
        name = f"sample-{Path(path).name}"
        BASES[name] = own
        made.append((name, f"sample_{kind}", os.fspath(path)))
    return made


def _flags(rng: random.Random, base: str) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.15:
        flags["max_lora_rank"] = rng.choice((2, 4, 8, 16))
    if rng.random() < 0.15:
        flags["target_modules"] = rng.choice((["all"], ["q_proj", "v_proj"], ["qkv_proj", "o_proj", "gate_up_proj",
                                              "down_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                              "up_proj", "down_proj", "embed_tokens", "lm_head"]))  # fmt: skip
        if "max_lora_rank" not in flags and rng.random() < 0.5:
            flags["max_lora_rank"] = 8
    if (base in MOE_BASES or "num_experts" in BASES[base] or "num_local_experts" in BASES[base]) and rng.random() < 0.3:
        flags["experts_shared_outer"] = rng.choice((True, False))
    if rng.random() < 0.15:
        flags["strict_loading"] = True
    if rng.random() < 0.1:
        flags["max_loras_per_batch"] = rng.choice((1, 2, 4))
    return flags


def _cases(rng: random.Random, adapters: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Every adapter alone (so a failure of one never hides another), then sets of 2-3 with later loads."""
    cases = []
    by_base: dict[str, list[str]] = {}
    for base, _kind, path in adapters:
        by_base.setdefault(base, []).append(path)
    for i, (base, _kind, path) in enumerate(adapters):
        flags = _flags(rng, base) if i % 2 else {}
        cases.append({"id": f"one-{i}", "base": BASES[base], "adapters": [{"name": f"a{i}", "path": path}], **flags})
    for i in range(220):
        base = rng.choice(sorted(by_base))
        pool = by_base[base]
        chosen = rng.sample(pool, min(len(pool), rng.choice((2, 2, 3))))
        entries = [{"name": f"s{i}-{j}", "path": p, "pinned": rng.random() < 0.1} for j, p in enumerate(chosen)]
        if rng.random() < 0.1:
            entries.append({"name": entries[0]["name"], "path": entries[0]["path"]})  # same name twice
        dynamic = [{"name": f"d{i}-{j}", "path": p} for j, p in enumerate(rng.sample(pool, min(len(pool), 2)))]
        if rng.random() < 0.2:
            dynamic.append({"name": entries[0]["name"], "path": entries[0]["path"]})
        case = {"id": f"set-{i}", "base": BASES[base], "adapters": entries, "dynamic": dynamic, **_flags(rng, base)}
        if rng.random() < 0.05:
            case["adapters"] = []
            case.setdefault("max_lora_rank", 8)
            case.setdefault("target_modules", ["q_proj", "v_proj"])
        cases.append(case)
    return cases
