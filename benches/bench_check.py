"""Adapter x base compatibility for a fleet: lorafast.check against the Python way, in one run.

Writes N dense PEFT adapters (32 layers x 7 modules, four ranks; benches/bench_scan.py's "dense" set) and three
header-only bases: a sharded Llama of the adapters' dimensions, a Qwen2 of other dimensions and a Llava-style
wrapper whose language model is that Llama (`language_model.model.` in the checkpoint), plus a smaller set whose
headers all differ (bench_scan.py's "unique"). Then times:

  lorafast.check(paths, bases=[3 base folders])   (bases read inside, once each; target: 10,000 x 3 < 2 s)
  the Python way: per (adapter, base) pair, PEFT `inject_adapter_in_model` on a meta-device model built from
  the base config, `load_file` of the adapter, `set_peft_model_state_dict`, errors caught; timed on a subset
  and given per pair.

Prints pairs/s for both and the ratio. Usage: python benches/bench_check.py [-n 10000] [--baseline 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import lorafast
from bench_scan import make_dense
from lorafast.testing import write_safetensors

LAYERS = 32


def _llama_weights(prefix: str, hidden: int, inter: int, kv: int, vocab: int = 256) -> dict[str, Any]:
    t: dict[str, Any] = {f"{prefix}embed_tokens.weight": ("BF16", (vocab, hidden))}
    for layer in range(LAYERS):
        p = f"{prefix}layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = ("BF16", (hidden, hidden))
        t[p + "self_attn.k_proj.weight"] = ("BF16", (kv, hidden))
        t[p + "self_attn.v_proj.weight"] = ("BF16", (kv, hidden))
        t[p + "self_attn.o_proj.weight"] = ("BF16", (hidden, hidden))
        t[p + "mlp.gate_proj.weight"] = ("BF16", (inter, hidden))
        t[p + "mlp.up_proj.weight"] = ("BF16", (inter, hidden))
        t[p + "mlp.down_proj.weight"] = ("BF16", (hidden, inter))
        t[p + "input_layernorm.weight"] = ("BF16", (hidden,))
    t[f"{prefix}norm.weight"] = ("BF16", (hidden,))
    return t


def _save_sharded(folder: str, tensors: dict[str, Any], config: dict[str, Any], shards: int = 4) -> None:
    os.makedirs(folder)
    names = list(tensors)
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
        write_safetensors(os.path.join(folder, fname), part)
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def _llama_config(hidden: int, inter: int, kv_heads: int, arch: str = "LlamaForCausalLM") -> dict[str, Any]:
    return {"architectures": [arch], "model_type": "llama" if "Llama" in arch else "qwen2", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
            "num_key_value_heads": kv_heads, "vocab_size": 256, "max_position_embeddings": 64,
            "tie_word_embeddings": False}  # fmt: skip


def make_bases(root: str) -> list[str]:
    llama = os.path.join(root, "llama")
    _save_sharded(llama, {**_llama_weights("model.", 64, 172, 16), "lm_head.weight": ("BF16", (256, 64))},
                  _llama_config(64, 172, 1))  # fmt: skip
    qwen = os.path.join(root, "qwen2")
    _save_sharded(qwen, {**_llama_weights("model.", 96, 256, 48), "lm_head.weight": ("BF16", (256, 96))},
                  _llama_config(96, 256, 2, "Qwen2ForCausalLM"))  # fmt: skip
    llava = os.path.join(root, "llava")
    vision = {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 16, "patch_size": 8, "projection_dim": 16}  # fmt: skip
    text = _llama_config(64, 172, 1)
    text.pop("architectures")
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
           "vision_config": vision, "image_token_index": 5}  # fmt: skip
    tensors = {**_llama_weights("language_model.model.", 64, 172, 16), "language_model.lm_head.weight": ("BF16",
               (256, 64)), "multi_modal_projector.linear_1.weight": ("BF16", (64, 16))}  # fmt: skip
    _save_sharded(llava, tensors, cfg)
    return [llama, qwen, llava]


def peft_way(pairs: list[tuple[str, str]]) -> list[str]:
    """The Python way, one pair at a time: meta-device model, inject, load the adapter's tensors, catch."""
    import torch
    import transformers
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    out = []
    for adapter, base in pairs:
        config = transformers.AutoConfig.from_pretrained(base)
        with torch.device("meta"):
            model = getattr(transformers, config.architectures[0])(config)
        try:
            inject_adapter_in_model(LoraConfig.from_pretrained(adapter), model, low_cpu_mem_usage=True)
            sd = load_file(os.path.join(adapter, "adapter_model.safetensors"))
            res = set_peft_model_state_dict(model, sd, low_cpu_mem_usage=True)
            out.append("no_match" if any("lora_" in k for k in res.unexpected_keys) else "ok")
        except (RuntimeError, ValueError) as e:
            out.append("shape_mismatch" if "size mismatch" in str(e) else "error")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10_000)
    ap.add_argument("--baseline", type=int, default=30, help="adapters the PEFT way is timed on (x 3 bases)")
    ap.add_argument("--unique", type=int, default=500, help="adapters of the every-header-different set")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        paths = make_dense(os.path.join(tmp, "fleet"), args.n)
        bases = make_bases(os.path.join(tmp, "bases"))
        print(f"wrote {args.n} adapters and 3 bases in {time.perf_counter() - t:.1f} s")
        lorafast.check(paths[:8], bases)  # imports and first-call costs out of the timing
        best = cpu = float("inf")
        for _ in range(3):
            t, c = time.perf_counter(), time.process_time()
            report = lorafast.check(paths, bases)
            best, cpu = min(best, time.perf_counter() - t), min(cpu, time.process_time() - c)
        s = report.summary()
        pairs = len(report)
        print(f"lorafast.check: {args.n} adapters x 3 bases = {pairs} pairs in {best:.3f} s "
              f"({pairs / best:,.0f} pairs/s; {cpu:.3f} s of CPU); verdicts {s['verdicts']}")  # fmt: skip
        print(f"load average while timing: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        sub = [(a, b) for a in paths[: args.baseline] for b in bases]
        t = time.perf_counter()
        ref = peft_way(sub)
        took = time.perf_counter() - t
        ours = [report.result(i, j).verdict for i in range(args.baseline) for j in range(3)]
        agree = sum(r == o for r, o in zip(ref, ours, strict=True))
        rate = len(sub) / took
        print(f"PEFT inject_adapter_in_model on meta models: {len(sub)} pairs in {took:.2f} s ({rate:,.1f} pairs/s);"
              f" verdicts agree on {agree}/{len(sub)}")  # fmt: skip
        print(f"lorafast.check is faster by {pairs / best / rate:,.0f}x; the PEFT way would take "
              f"{pairs / rate:,.0f} s for the whole fleet")  # fmt: skip
        if args.unique:
            # every header different (tensor order varies): each adapter is its own structure
            upaths = make_dense(os.path.join(tmp, "unique"), args.unique, unique=True)
            t, c = time.perf_counter(), time.process_time()
            lorafast.check(upaths, bases)
            took_u, cpu_u = time.perf_counter() - t, time.process_time() - c
            print(f"unique headers: {args.unique} adapters x 3 bases in {took_u:.3f} s ({cpu_u:.3f} s of CPU), "
                  f"{args.unique * 3 / took_u:,.0f} pairs/s")  # fmt: skip
        big = os.path.join(tmp, "big.safetensors")
        write_safetensors(
            big, {f"model.layers.{i // 10}.mlp.m{i % 10}.weight": ("BF16", (2, 2)) for i in range(100_000)}
        )
        t = time.perf_counter()
        n_big = lorafast.read_base(big).num_weights
        print(f"read_base of a {n_big:,}-tensor checkpoint: {time.perf_counter() - t:.3f} s")
        print(f"target 10,000 x 3 < 2 s: {'met' if best < 2.0 else 'not met'} ({best:.3f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
