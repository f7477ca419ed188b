"""kohya (`lora_down`/`lora_up`/`.alpha`) and old diffusers (`to_q_lora.down`, `lora_linear_layer`) to a PEFT folder.

Keys are renamed to `<component>.<module>.lora_A.weight` / `lora_B.weight`; the tensors are copied unchanged.
Each module's alpha (kohya's `.alpha` tensor; 0 or none means alpha = rank) goes into the config: the most
common (rank, alpha) become `r`/`lora_alpha`, the others `rank_pattern`/`alpha_pattern` entries, so every
module keeps its exact scale. kohya names flatten the module path with `_`, which cannot be undone without the
model; the names keep that form and resolve as kohya names do (the merge engine matches them to the
base's weights the same way).
"""

from __future__ import annotations

from functools import partial

from lorafast.adapter import Adapter, AdapterFormat
from lorafast.converting.errors import ConvertError
from lorafast.converting.moe import _one
from lorafast.converting.peftconfig import Want
from lorafast.converting.writer import OutTensor, SourceBytes
from lorafast.merging.targets import strip_prefixes
from lorafast.tensors import TensorFile

#: kohya prefix -> the component prefix diffusers' PEFT keys use
_KOHYA_COMPONENTS = (("lora_unet_", "unet."), ("lora_te1_", "text_encoder."), ("lora_te2_", "text_encoder_2."),
                     ("lora_te_", "text_encoder."), ("lora_transformer_", "transformer."),
                     ("lora_prior_unet_", "prior."))  # fmt: skip
SOURCE_FORMATS = (AdapterFormat.KOHYA, AdapterFormat.DIFFUSERS_LEGACY)


def _peft_key(fmt: AdapterFormat, key: str) -> str:
    if fmt == AdapterFormat.KOHYA:
        for old, new in _KOHYA_COMPONENTS:
            if key.startswith(old):
                return new + key[len(old) :]
        return key
    # old diffusers attention processors: `attn1.processor.to_q_lora` sits on `attn1.to_q`, and `to_out` on `to_out.0`
    parts = [p for p in key.split(".") if p != "processor"]
    if parts and parts[-1] == "to_out":
        parts.append("0")
    return ".".join(parts)


def plan_peft(adapter: Adapter, tf: TensorFile) -> tuple[list[OutTensor], list[Want]]:
    if adapter.variants or "dora" in adapter.flags:
        what = ", ".join([*adapter.variants, *(["dora"] if "dora" in adapter.flags else [])])
        raise ConvertError(f"{adapter.path}: {what} modules have no plain PEFT LoRA form", "unsupported", adapter.path)
    tensors: list[OutTensor] = []
    wants: list[Want] = []
    used: set[str] = set()
    for m in adapter.modules:
        if m.kind not in ("linear", "conv") or m.a_key is None or m.b_key is None or m.a_shape is None:
            raise ConvertError(f"{m.key}: a {m.kind} module has no PEFT LoRA form", "unsupported", adapter.path)
        key = _peft_key(adapter.format, m.key)
        for src, dst in ((m.a_key, f"{key}.lora_A.weight"), (m.b_key, f"{key}.lora_B.weight")):
            e = tf.entry(src)
            tensors.append(OutTensor(dst, e.dtype, e.shape, partial(_one, partial(SourceBytes, tf, src))))
            used.add(src)
        rank = m.a_shape[0]
        alpha = m.alpha if m.alpha else None  # sd-scripts: 0 or no `.alpha` means alpha = rank
        if m.alpha_key is not None and m.alpha_key in tf:
            used.add(m.alpha_key)
            if m.alpha:  # the exact value the merge reads (the tensor's, not a rounded copy)
                alpha = tf.load_scalar(m.alpha_key)
        name = strip_prefixes(key)
        wants.append(Want(name, name, rank, alpha))
    left = sorted(set(tf.tensors) - used)
    if left:
        raise ConvertError(f"{adapter.path}: tensors {left[:4]} belong to no LoRA module; converting would drop "
                           "them", "lossy", adapter.path)  # fmt: skip
    return tensors, wants
