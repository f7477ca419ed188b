"""`convert_lora_state_dict_by_format`: each key format's conversion to SGLang's standard names (diffusers'
converters for XLabs and kohya Flux, run on shape-only tensors)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from lorafast.compat.diffusion._formats import LoRAFormat, is_qwen_image
from lorafast.compat.diffusion._reading import Tensor

_KOHYA_H3_KEY = re.compile(
    r"^lora_unet_blocks_(\d+)_(attn_qkv_proj|attn_out_proj|mlp_fc1|mlp_fc2)\.(lora_down|lora_up|alpha)(?:\.weight)?$"
)
_KOHYA_H3_MODULES = {
    "attn_qkv_proj": "attn.qkv_proj",
    "attn_out_proj": "attn.out_proj",
    "mlp_fc1": "mlp.fc1",
    "mlp_fc2": "mlp.fc2",
}
_KOHYA_H3_SUFFIXES = {"lora_down": "lora_A", "lora_up": "lora_B", "alpha": "alpha"}


# --- key conversion per format ------------------------------------------------------------------------------


#: (how the key is tested: "in" or "end", old text, new text): the first rule that holds renames, as SGLang's
#: if/elif chains do
_QWEN_IMAGE_RULES = (("end", ".lora.down.weight", ".lora_A.weight"), ("end", ".lora.up.weight", ".lora_B.weight"))
_DOWN_UP_RULES = (
    ("in", "lora_down.weight", "lora_A.weight"),
    ("in", "lora_up.weight", "lora_B.weight"),
    ("end", ".lora_down", ".lora_A"),
    ("end", ".lora_up", ".lora_B"),
)


def _rename_first(name: str, rules: tuple[tuple[str, str, str], ...]) -> str:
    for how, old, new in rules:
        if (old in name) if how == "in" else name.endswith(old):
            return name.replace(old, new)
    return name


def _convert_qwen_image(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Qwen-Image keys: without `transformer.`, lora.down/lora.up -> lora_A/lora_B."""
    return {_rename_first(name.removeprefix("transformer."), _QWEN_IMAGE_RULES): t for name, t in state.items()}


def _convert_down_up(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`_convert_non_diffusers_sd_simple`: lora_down/lora_up -> lora_A/lora_B, first matching rule only."""
    return {_rename_first(name, _DOWN_UP_RULES): t for name, t in state.items()}


def _convert_minimax_h3(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        match = _KOHYA_H3_KEY.match(name)
        if match is None:
            out[name] = tensor  # kept as is (SGLang logs them as unmatched)
            continue
        layer, module, suffix = match.groups()
        out[f"blocks.{layer}.{_KOHYA_H3_MODULES[module]}.{_KOHYA_H3_SUFFIXES[suffix]}"] = tensor
    return out


def _chunk3(tensor: Tensor) -> list[Tensor]:
    """`torch.chunk(t, 3, dim=0)` on shapes, unpacked into three as SGLang does."""
    if not tensor.shape:
        raise IndexError("tuple index out of range")
    n = tensor.shape[0]
    size = -(-n // 3)
    sizes = [0, 0, 0] if n == 0 else [min(size, n - i) for i in range(0, n, size)]
    if len(sizes) != 3:
        raise ValueError(f"not enough values to unpack (expected 3, got {len(sizes)})")
    return [Tensor((s, *tensor.shape[1:])) for s in sizes]


_AI_TOOLKIT_EXTRA = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
}


def _convert_ai_toolkit(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`_convert_ai_toolkit_flux_lora`: BFL Flux block names -> diffusers names; fused qkv B split in three."""
    original: dict[str, Tensor] = {}
    for name, tensor in state.items():
        original[name.removeprefix("diffusion_model.").removeprefix("base_model.model.")] = tensor
    num_double = num_single = 0
    for key in original:
        parts = key.split(".")
        if len(parts) > 1 and parts[1].isdigit():
            if parts[0] == "single_blocks":
                num_single = max(num_single, int(parts[1]) + 1)
            elif parts[0] == "double_blocks":
                num_double = max(num_double, int(parts[1]) + 1)
    out: dict[str, Tensor] = {}
    for block in range(num_single):
        for ab in ("lora_A", "lora_B"):
            for src, dst in (("linear1", "to_qkv_mlp_proj"), ("linear2", "to_out")):
                key = f"single_blocks.{block}.{src}.{ab}.weight"
                if key in original:
                    out[f"single_transformer_blocks.{block}.attn.{dst}.{ab}.weight"] = original.pop(key)
    for block in range(num_double):
        prefix = f"transformer_blocks.{block}.attn"
        for ab in ("lora_A", "lora_B"):
            for attn in ("img_attn", "txt_attn"):
                key = f"double_blocks.{block}.{attn}.qkv.{ab}.weight"
                if key not in original:
                    continue
                fused = original.pop(key)
                projs = ("to_q", "to_k", "to_v") if attn == "img_attn" else ("add_q_proj", "add_k_proj", "add_v_proj")
                pieces = [fused] * 3 if ab == "lora_A" else _chunk3(fused)
                for proj, part in zip(projs, pieces, strict=True):
                    out[f"{prefix}.{proj}.{ab}.weight"] = part
        for src, dst in (("img_attn.proj", "attn.to_out.0"), ("txt_attn.proj", "attn.to_add_out")):
            for ab in ("lora_A", "lora_B"):
                key = f"double_blocks.{block}.{src}.{ab}.weight"
                if key in original:
                    out[f"transformer_blocks.{block}.{dst}.{ab}.weight"] = original.pop(key)
    for key, tensor in original.items():
        out[
            key.replace("double_blocks.", "transformer_blocks.").replace("single_blocks.", "single_transformer_blocks.")
        ] = tensor
    final: dict[str, Tensor] = {}
    for key, tensor in out.items():
        new = key
        for src, dst in _AI_TOOLKIT_EXTRA.items():
            if key.startswith(src):
                new = key.replace(src, dst, 1)
                break
        final[new] = tensor
    return final


_DIFFUSERS_CONVERTERS = {
    LoRAFormat.XLABS_FLUX: (
        "_convert_xlabs_flux_lora_to_diffusers",
        "convert_xlabs_lora_state_dict_to_diffusers",
        "convert_xlabs_lora_to_diffusers",
        "convert_xlabs_flux_lora_to_diffusers",
    ),
    LoRAFormat.KOHYA_FLUX: ("_convert_kohya_flux_lora_to_diffusers", "convert_kohya_flux_lora_to_diffusers"),
}


def _kohya_up_needs_values(name: str, state: Mapping[str, Tensor]) -> bool:
    """diffusers splits a fused kohya Flux up weight (qkv in 3, single-block linear1 in 4) by rank when its
    off-diagonal blocks are all zero: for a rank that 3 or 4 divides, the split depends on the values."""
    if not name.endswith(".lora_up.weight"):
        return False
    down = state.get(name.removesuffix(".lora_up.weight") + ".lora_down.weight")
    rank = down.shape[0] if down is not None and down.shape else 0
    return rank > 0 and (rank % 3 == 0 or rank % 4 == 0)


def _convert_with_diffusers(state: Mapping[str, Tensor], fmt: LoRAFormat) -> dict[str, Tensor]:
    """XLabs and kohya Flux: SGLang calls diffusers' converter, and keeps the keys when every candidate fails.

    The converter runs here too, on shape-only (meta) tensors, with the real `.alpha` values, so names,
    shapes and failures are diffusers' own. Kohya up weights whose split depends on their values (see
    `_kohya_up_needs_values`) are read; `.diff`/`.diff_b` tensors, whose values diffusers only logs about,
    are zeros. Needs torch and diffusers, as SGLang does.
    """
    import torch
    from diffusers.loaders import lora_conversion_utils as lcu

    converters = [getattr(lcu, n) for n in _DIFFUSERS_CONVERTERS[fmt] if callable(getattr(lcu, n, None))]
    meta = {}
    for name, t in state.items():
        real = t.values() if fmt == LoRAFormat.KOHYA_FLUX and _kohya_up_needs_values(name, state) else None
        if real is not None:
            meta[name] = real
        elif t.value is not None:
            meta[name] = torch.tensor(t.value).reshape(t.shape)
        elif ".diff" in name:
            meta[name] = torch.zeros(()).expand(t.shape)
        else:
            meta[name] = torch.empty(t.shape, device="meta")
        module = name.removesuffix(".lora_down.weight")
        if fmt == LoRAFormat.KOHYA_FLUX and module != name and f"{module}.alpha" not in state and t.shape:
            # diffusers' default alpha is the rank, made on the weight's device: a real scalar keeps .item() working
            meta[f"{module}.alpha"] = torch.tensor(float(t.shape[0]))
    for fn in converters:
        try:
            out = fn(dict(meta))
            if isinstance(out, tuple) and isinstance(out[0], dict):
                out = out[0]
            if not isinstance(out, dict):
                raise TypeError(f"Converter returned {type(out)}")
        except Exception:  # SGLang tries the next candidate, then keeps the input
            continue
        return {
            k: Tensor(tuple(v.shape), v.item() if v.device.type != "meta" and v.numel() == 1 else None)
            for k, v in out.items()
        }
    return dict(state)


def convert(state: dict[str, Tensor], fmt: LoRAFormat) -> dict[str, Tensor]:
    """`convert_lora_state_dict_by_format`. diffusers has no `maybe_convert_state_dict`, so the standard,
    Wan and SD paths keep keys before their own renames."""
    if fmt == LoRAFormat.AI_TOOLKIT_FLUX:
        return _convert_ai_toolkit(state)
    if fmt in (LoRAFormat.XLABS_FLUX, LoRAFormat.KOHYA_FLUX):
        return _convert_down_up(_convert_with_diffusers(state, fmt))
    if fmt == LoRAFormat.KOHYA_MINIMAX_H3:
        return _convert_minimax_h3(state)
    if fmt in (LoRAFormat.WAN, LoRAFormat.NON_DIFFUSERS_SD):
        return _convert_down_up(state)
    if fmt == LoRAFormat.QWEN_IMAGE_STANDARD or is_qwen_image(list(state)):
        return _convert_qwen_image(state)
    return dict(state)
