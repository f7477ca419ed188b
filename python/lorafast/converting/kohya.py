"""kohya (`lora_down`/`lora_up`/`.alpha`) and old diffusers (`to_q_lora.down`, `lora_linear_layer`) to a PEFT folder.

Keys are renamed to `<component>.<module>.lora_A.weight` / `lora_B.weight`; the tensors are copied unchanged,
as byte ranges of the source (no torch).
Each module's alpha (kohya's `.alpha` tensor; 0 or none means alpha = rank) goes into the config: the most
common (rank, alpha) become `r`/`lora_alpha`, the others `rank_pattern`/`alpha_pattern` entries, so every
module keeps its exact scale.

kohya flattens the module path with `_` (`lora_unet_down_blocks_0_attentions_0_proj_in`), and some module names
hold a `_` themselves (`down_blocks`, `proj_in`, `to_q`). The dots are put back as diffusers'
`_convert_unet_lora_key`/`_convert_text_encoder_lora_key` do for the models whose names kohya writes in
diffusers' spelling: the SD 1.x/2.x UNet, the CLIP text encoders (`te`, `te1`, `te2`) and diffusers-named
transformers (Flux's `transformer_blocks`/`single_transformer_blocks`): each name is split at every `_` and
the pieces are joined back into the longest known module name (`_JOINED`). SDXL's UNet, which kohya names as
sgm does (`input_blocks_4_1_...`), is mapped block by block as diffusers maps it for SDXL (`sgm_unflatten`).
Flux in BFL's names (sd-scripts' `lora_unet_double_blocks_0_img_attn_qkv`) is mapped module by module as
diffusers' `_convert_kohya_flux_lora_to_diffusers` maps it (`bfl_split`): a fused output (qkv, single blocks'
`linear1` = q, k, v, proj_mlp) is split into its diffusers modules, each with the same lora_down and its rows of
lora_up, which is exact (rows of B @ A are those rows of B times A), and the final layer's (shift, scale)
modulation rows are swapped to diffusers' (scale, shift). That is done only when every piece of every module of
the adapter is then a known module name or an index, so a guess never renames a module. Otherwise (anything
unknown), the architecture cannot be told from the names alone, and every name keeps its flattened form under
the component prefix (`transformer.foo_0_...`): `lorafast.merge` resolves those against a base as it resolves
kohya names, PEFT and the engines do not. `ConvertResult` and the metadata say which was done.
"""

from __future__ import annotations

import re
from functools import partial

from lorafast.adapter import Adapter, AdapterFormat
from lorafast.converting import bits
from lorafast.converting.errors import ConvertError
from lorafast.converting.peftconfig import Want
from lorafast.converting.writer import OutTensor, SourceBytes
from lorafast.naming import strip_prefixes
from lorafast.tensors import TensorFile

#: kohya prefix -> the component prefix diffusers' PEFT keys use
_KOHYA_COMPONENTS = (
    ("lora_unet_", "unet."),
    ("lora_te1_", "text_encoder."),
    ("lora_te2_", "text_encoder_2."),
    ("lora_te_", "text_encoder."),
    ("lora_transformer_", "transformer."),
    ("lora_prior_unet_", "prior."),
)
SOURCE_FORMATS = (AdapterFormat.KOHYA, AdapterFormat.DIFFUSERS_LEGACY)

#: module names that hold a `_` (diffusers UNet and transformer blocks, CLIP text encoders)
_JOINED = frozenset(
    """down_blocks up_blocks mid_block transformer_blocks single_transformer_blocks proj_in proj_out to_q to_k to_v
    to_out conv_in conv_out conv_shortcut conv_norm_out time_emb_proj time_embedding linear_1 linear_2
    add_embedding add_q_proj add_k_proj add_v_proj to_add_out proj_mlp norm1_context ff_context norm_out
    norm_q norm_k norm_added_q norm_added_k x_embedder context_embedder time_text_embed timestep_embedder
    guidance_embedder text_embedder text_model self_attn q_proj k_proj v_proj out_proj text_projection
    final_layer_norm layer_norm1 layer_norm2 token_embedding position_embedding""".split()
)
#: module names without a `_` that those models have
_SINGLE = frozenset(
    """attentions resnets downsamplers upsamplers conv conv1 conv2 attn attn1 attn2 ff net proj norm norm1 norm2
    norm3 linear encoder layers mlp fc1 fc2 embeddings""".split()
)
_LONGEST = max(len(w.split("_")) for w in _JOINED)
#: `ConvertResult.notes` entry when the names could not be unflattened
FLATTENED_NOTE = (
    "kohya module names kept in their flattened form (unknown architecture): lorafast.merge resolves them, "
    "PEFT and the engines do not"
)


def unflatten(flat: str) -> str | None:
    """kohya's flattened module path with its dots back (`down_blocks_0_proj_in` -> `down_blocks.0.proj_in`),
    or None when a piece is not a known module name: the path cannot be told without the model."""
    pieces = flat.split("_")
    out: list[str] = []
    i = 0
    while i < len(pieces):
        for n in range(min(_LONGEST, len(pieces) - i), 0, -1):  # the longest known name first
            word = "_".join(pieces[i : i + n])
            if (n > 1 and word in _JOINED) or (n == 1 and (word in _SINGLE or word.isdigit())):
                out.append(word)
                i += n
                break
        else:
            return None
    return ".".join(out)


#: SDXL's sgm UNet (kohya's SDXL names) has 2 layers per block, and a downsampler or upsampler as the third
_SGM_LAYERS = 3
#: sgm names of a resnet's layers -> diffusers'
_SGM_RESNET = {
    "in_layers_2": "conv1",
    "out_layers_3": "conv2",
    "emb_layers_1": "time_emb_proj",
    "skip_connection": "conv_shortcut",
}
#: sgm modules outside the blocks -> diffusers'
_SGM_TOP = {
    "input_blocks_0_0": "conv_in",
    "out_2": "conv_out",
    "time_embed_0": "time_embedding.linear_1",
    "time_embed_2": "time_embedding.linear_2",
    "label_emb_0_0": "add_embedding.linear_1",
    "label_emb_0_2": "add_embedding.linear_2",
}
_SGM_BLOCK = re.compile(r"^(input_blocks|middle_block|output_blocks)_(\d+)_(?:(\d+)_)?(.+)$")


def sgm_unflatten(flat: str) -> str | None:
    """An SDXL sgm UNet path (`input_blocks_4_1_transformer_blocks_0_attn1_to_q`) as diffusers' SDXL UNet names it
    (`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`), mapped as diffusers'
    `_maybe_map_sgm_blocks_to_diffusers` maps it with SDXL's 2 layers per block; None when it is not one."""
    if flat in _SGM_TOP:
        return _SGM_TOP[flat]
    hit = _SGM_BLOCK.match(flat)
    if hit is None:
        return None
    kind, i, j, rest = hit.group(1), int(hit.group(2)), hit.group(3), hit.group(4)
    if kind == "middle_block":  # no inner index: middle_block_1_proj_in
        rest = rest if j is None else f"{j}_{rest}"
        head = {0: "mid_block.resnets.0", 1: "mid_block.attentions.0", 2: "mid_block.resnets.1"}.get(i)
    elif j is None:
        return None
    elif kind == "input_blocks":
        if i == 0:
            return None
        block, layer = divmod(i - 1, _SGM_LAYERS)
        if rest == "op":
            return f"down_blocks.{block}.downsamplers.0.conv"
        head = {"0": f"down_blocks.{block}.resnets.{layer}", "1": f"down_blocks.{block}.attentions.{layer}"}.get(j)
    else:
        block, layer = divmod(i, _SGM_LAYERS)
        head = {
            "0": f"up_blocks.{block}.resnets.{layer}",
            "1": f"up_blocks.{block}.attentions.{layer}",
            "2": f"up_blocks.{block}.upsamplers.0",
        }.get(j)
    if head is None:
        return None
    tail = _SGM_RESNET.get(rest) if ".resnets." in head else unflatten(rest)
    return None if tail is None else f"{head}.{tail}"


#: a kohya module as diffusers modules: (units its lora_up's rows are cut in, ((module, ((first unit, units),
#: ...)), ...)): each module takes those row blocks of lora_up, in that order, and the whole lora_down
Split = tuple[int, tuple[tuple[str, tuple[tuple[int, int], ...]], ...]]


def _renamed(name: str) -> Split:
    return 1, ((name, ((0, 1),)),)


def _fused(*parts: tuple[str, int]) -> Split:
    """A fused output whose rows are the modules' outputs one after the other, each `units` wide."""
    out, at = [], 0
    for name, units in parts:
        out.append((name, ((at, units),)))
        at += units
    return at, tuple(out)


#: Flux's BFL module names -> diffusers' FluxTransformer2DModel modules, as `_convert_kohya_flux_lora_to_diffusers`
_BFL_DOUBLE = {
    "img_attn_qkv": _fused(("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1)),
    "img_attn_proj": _renamed("attn.to_out.0"),
    "img_mlp_0": _renamed("ff.net.0.proj"),
    "img_mlp_2": _renamed("ff.net.2"),
    "img_mod_lin": _renamed("norm1.linear"),
    "txt_attn_qkv": _fused(("attn.add_q_proj", 1), ("attn.add_k_proj", 1), ("attn.add_v_proj", 1)),
    "txt_attn_proj": _renamed("attn.to_add_out"),
    "txt_mlp_0": _renamed("ff_context.net.0.proj"),
    "txt_mlp_2": _renamed("ff_context.net.2"),
    "txt_mod_lin": _renamed("norm1_context.linear"),
}
#: linear1's rows: q, k, v (hidden each), then the MLP's input (4 x hidden): diffusers' 3072, 3072, 3072, 12288
_BFL_SINGLE = {
    "linear1": _fused(("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1), ("proj_mlp", 4)),
    "linear2": _renamed("proj_out"),
    "modulation_lin": _renamed("norm.linear"),
}
_BFL_TOP = {
    "img_in": _renamed("x_embedder"),
    "txt_in": _renamed("context_embedder"),
    "time_in_in_layer": _renamed("time_text_embed.timestep_embedder.linear_1"),
    "time_in_out_layer": _renamed("time_text_embed.timestep_embedder.linear_2"),
    "vector_in_in_layer": _renamed("time_text_embed.text_embedder.linear_1"),
    "vector_in_out_layer": _renamed("time_text_embed.text_embedder.linear_2"),
    "guidance_in_in_layer": _renamed("time_text_embed.guidance_embedder.linear_1"),
    "guidance_in_out_layer": _renamed("time_text_embed.guidance_embedder.linear_2"),
    "final_layer_linear": _renamed("proj_out"),
    # BFL's final modulation outputs (shift, scale), diffusers' norm_out (scale, shift): diffusers'
    # swap_scale_shift
    "final_layer_adaLN_modulation_1": (2, (("norm_out.linear", ((1, 1), (0, 1))),)),
}
_BFL_BLOCK = re.compile(r"^(double|single)_blocks_(\d+)_(.+)$")


def bfl_split(flat: str) -> Split | None:
    """Flux's BFL module path (`double_blocks_0_img_attn_qkv`) as diffusers' modules under `transformer.`, or
    None when it is not one."""
    hit = _BFL_BLOCK.match(flat)
    if hit is None:
        split = _BFL_TOP.get(flat)
        head = "transformer."
    else:
        double = hit.group(1) == "double"
        split = (_BFL_DOUBLE if double else _BFL_SINGLE).get(hit.group(3))
        head = f"transformer.{'transformer_blocks' if double else 'single_transformer_blocks'}.{hit.group(2)}."
    if split is None:
        return None
    units, parts = split
    return units, tuple((head + name, rows) for name, rows in parts)


def _kohya_split(key: str) -> tuple[str, str]:
    """(component prefix, flattened module path) of a kohya module key."""
    for old, new in _KOHYA_COMPONENTS:
        if key.startswith(old):
            return new, key[len(old) :]
    return "", key


def _is_sgm(flat: str) -> bool:
    return flat.startswith(("input_blocks_", "middle_block_", "output_blocks_", "time_embed_", "label_emb_", "out_"))


def kohya_targets(keys: list[str]) -> dict[str, Split] | None:
    """Every kohya module key's diffusers modules (dotted PEFT names with the component prefix), or None when one
    of them cannot be unflattened. sd-scripts writes Flux under `lora_unet_` in BFL's names: when one module is
    named so, every `lora_unet_` module must be."""
    targets: dict[str, Split] = {}
    bfl = set()
    for key in keys:
        prefix, flat = _kohya_split(key)
        split = bfl_split(flat) if key.startswith("lora_unet_") else None
        if prefix == "unet.":
            bfl.add(split is not None)
        if split is None:
            dotted = unflatten(flat) if prefix != "unet." or not _is_sgm(flat) else sgm_unflatten(flat)
            if not prefix or dotted is None:
                return None
            split = _renamed(prefix + dotted)
        targets[key] = split
    return None if len(bfl) > 1 else targets


def _peft_targets(fmt: AdapterFormat, key: str, targets: dict[str, Split] | None) -> Split:
    if fmt == AdapterFormat.KOHYA:
        if targets is not None:
            return targets[key]
        prefix, flat = _kohya_split(key)
        return _renamed(prefix + flat)
    # old diffusers attention processors: `attn1.processor.to_q_lora` sits on `attn1.to_q`, and `to_out` on `to_out.0`
    parts = [p for p in key.split(".") if p != "processor"]
    if parts and parts[-1] == "to_out":
        parts.append("0")
    return _renamed(".".join(parts))


def _rows(tf: TensorFile, key: str, name: str, units: int, blocks: tuple[tuple[int, int], ...]) -> OutTensor:
    """Output tensor `name`: row blocks (in units of its rows / `units`) of source tensor `key`, in that order,
    as byte ranges of the source (a block of rows of a row-major matrix is one range)."""
    e = tf.entry(key)
    rows = e.shape[0] if e.shape else 0
    if units > 1 and (rows == 0 or rows % units):
        raise ConvertError(
            f"{tf.path}: {key} has {rows} rows, which do not split into the {units} equal parts of its fused module",
            "unsupported",
            tf.path,
        )
    unit = rows // units
    row_bytes = (e.end - e.begin) // rows if rows else 0
    parts = tuple(SourceBytes(tf, key, first * unit * row_bytes, n * unit * row_bytes) for first, n in blocks)
    shape = (sum(n for _, n in blocks) * unit, *e.shape[1:])
    return OutTensor(name, e.dtype, shape, partial(iter, parts))


def plan_peft(adapter: Adapter, tf: TensorFile) -> tuple[list[OutTensor], list[Want], bool]:
    """The tensors and config wants of the PEFT folder, and whether kohya names were unflattened."""
    if adapter.variants or "dora" in adapter.flags:
        what = ", ".join([*adapter.variants, *(["dora"] if "dora" in adapter.flags else [])])
        raise ConvertError(f"{adapter.path}: {what} modules have no plain PEFT LoRA form", "unsupported", adapter.path)
    tensors: list[OutTensor] = []
    wants: list[Want] = []
    used: set[str] = set()
    kohya = adapter.format == AdapterFormat.KOHYA
    targets = kohya_targets([m.key for m in adapter.modules]) if kohya else None
    for m in adapter.modules:
        if m.kind not in ("linear", "conv") or m.a_key is None or m.b_key is None or m.a_shape is None:
            raise ConvertError(f"{m.key}: a {m.kind} module has no PEFT LoRA form", "unsupported", adapter.path)
        units, parts = _peft_targets(adapter.format, m.key, targets)
        used.update((m.a_key, m.b_key))
        rank = m.a_shape[0]
        alpha = m.alpha if m.alpha else None  # sd-scripts: 0 or no `.alpha` means alpha = rank
        if m.alpha_key is not None and m.alpha_key in tf:
            used.add(m.alpha_key)
            if m.alpha:  # the exact value the merge reads (the tensor's, not a rounded copy)
                alpha = bits.scalar(tf, m.alpha_key)
        for key, blocks in parts:  # each part: the whole lora_down, its rows of lora_up, the original's alpha
            tensors.append(_rows(tf, m.a_key, f"{key}.lora_A.weight", 1, ((0, 1),)))
            tensors.append(_rows(tf, m.b_key, f"{key}.lora_B.weight", units, blocks))
            wants.append(Want(key, strip_prefixes(key), rank, alpha))
    left = sorted(set(tf.tensors) - used)
    if left:
        raise ConvertError(
            f"{adapter.path}: tensors {left[:4]} belong to no LoRA module; converting would drop them",
            "lossy",
            adapter.path,
        )
    return tensors, wants, targets is not None or not kohya
