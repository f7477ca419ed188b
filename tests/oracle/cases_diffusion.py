"""Cases for the SGLang diffusion oracle: adapter files, in-memory state dicts and `set_lora` arguments.

`build(folder)` writes every file case into its own sub-folder (SGLang reads `adapter_config.json` next to the
weights) and returns the case list the runner and the test share. Sources:

* real files: the diffusers/PEFT and kohya fixtures in tests/fixtures/real, and `lorafast sample` diffusion kinds;
* synthetic key sets of every format SGLang's loader tells apart (PEFT DiT, kohya SD, kohya Flux at Flux's real
  sizes, XLabs, kohya MiniMax-H3, Wan, Qwen-Image, ai-toolkit Flux);
* broken variants of each class of defect: tensors written in a data order unlike the header's, configs
  that are JSON lists (and other non-objects), kohya names met by PEFT config checks after conversion,
  ai-toolkit detection edges, metadata alphas (`lora_adapter_metadata`, global alpha keys) and `lora_alpha`.

Generation is deterministic and takes about a second and a half (2,000-odd cases, 50 MB of small files): tensors
are small, and zeros except `.alpha` values and a few up weights.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "tests" / "fixtures" / "real"

Spec = tuple[str, tuple[int, ...], Any]  # name, shape, value (only for .alpha scalars) or None

_SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def _encode(dtype: str, value: float) -> bytes:
    if dtype == "F32":
        return struct.pack("<f", value)
    if dtype == "F16":
        return struct.pack("<e", value)
    return struct.pack("<f", value)[2:]  # BF16: the high half of the float32


def write(path: Path, tensors: list[Spec], metadata: dict[str, str] | None = None, dtype: str = "BF16") -> None:
    """Data in the list's order; header entries in name order, so the two orders differ."""
    entries: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, shape, value in tensors:
        count = 1
        for d in shape:
            count *= d
        data = _encode(dtype, value) * count if value is not None else bytes(count * _SIZES[dtype])
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata is not None else {}
    header.update(sorted(entries.items()))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))


# --- key families ------------------------------------------------------------------------------------------


def _pair(prefix: str, r: int, fin: int, fout: int, a: str = "lora_A", b: str = "lora_B") -> list[Spec]:
    return [(f"{prefix}.{a}.weight", (r, fin), None), (f"{prefix}.{b}.weight", (fout, r), None)]


def peft_dit(r: int = 2, d: int = 8, blocks: int = 2, root: str = "transformer_blocks") -> list[Spec]:
    out: list[Spec] = []
    for i in range(blocks):
        for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"):
            out += _pair(f"{root}.{i}.{m}", r, d, d)
    return out


def kohya_sd(r: int = 2, d: int = 8, alpha: float | None = 4.0) -> list[Spec]:
    out: list[Spec] = []
    for name in ("lora_unet_down_blocks_0_attentions_0_proj_in", "lora_unet_mid_block_attentions_0_proj_out",
                 "lora_te_text_model_encoder_layers_0_self_attn_q_proj"):  # fmt: skip
        out += _pair(name, r, d, d, "lora_down", "lora_up")
        if alpha is not None:
            out.append((f"{name}.alpha", (), alpha))
    return out


def kohya_flux(r: int = 1, alpha: float | None = 2.0, h: int = 3072) -> list[Spec]:
    """kohya sd-scripts Flux names at Flux's real widths (diffusers' converter splits by them)."""
    out: list[Spec] = []
    mods = (("lora_unet_double_blocks_0_img_attn_qkv", h, 3 * h), ("lora_unet_double_blocks_0_img_attn_proj", h, h),
            ("lora_unet_single_blocks_0_linear2", 5 * h, h))  # fmt: skip
    for name, fin, fout in mods:
        out += _pair(name, r, fin, fout, "lora_down", "lora_up")
        if alpha is not None:
            out.append((f"{name}.alpha", (), alpha))
    return out


def xlabs(r: int = 2, h: int = 3072) -> list[Spec]:
    out: list[Spec] = []
    for i in range(2):
        root = f"double_blocks.{i}.processor"
        out += _pair(f"{root}.proj_lora1", r, h, h, "down", "up") + _pair(f"{root}.proj_lora2", r, h, h, "down", "up")
        out += _pair(f"{root}.qkv_lora1", r, h, 3 * h, "down", "up")
        out += _pair(f"{root}.qkv_lora2", r, h, 3 * h, "down", "up")
    return out


def minimax_h3(r: int = 2, d: int = 8, alpha: float | None = 4.0, suffix: str = ".weight") -> list[Spec]:
    out: list[Spec] = []
    for i in range(2):
        for m in ("attn_qkv_proj", "attn_out_proj", "mlp_fc1", "mlp_fc2"):
            name = f"lora_unet_blocks_{i}_{m}"
            out += [(f"{name}.lora_down{suffix}", (r, d), None), (f"{name}.lora_up{suffix}", (d, r), None)]
            if alpha is not None:
                out.append((f"{name}.alpha", (), alpha))
    return out


def wan(r: int = 2, d: int = 8, root: str = "diffusion_model.blocks") -> list[Spec]:
    out: list[Spec] = []
    for m in ("self_attn.q", "cross_attn.k", "ffn.0"):
        out += _pair(f"{root}.0.{m}", r, d, d, "lora_down", "lora_up")
        out.append((f"{root}.0.{m}.alpha", (), 2.0))
    return out


def qwen_image(r: int = 2, d: int = 8, root: str = "transformer.transformer_blocks") -> list[Spec]:
    out: list[Spec] = []
    for m in ("attn.to_q", "attn.add_k_proj", "img_mlp.net.0.proj"):
        out += _pair(f"{root}.0.{m}", r, d, d, "lora.down", "lora.up")
    return out


def ai_toolkit(r: int = 2, d: int = 8, qkv_out: int | None = None, prefix: str = "", extra: bool = True) -> list[Spec]:
    qkv_out = 3 * d if qkv_out is None else qkv_out
    out: list[Spec] = []
    for i in range(2):
        out += _pair(f"{prefix}double_blocks.{i}.img_attn.qkv", r, d, qkv_out)
        out += _pair(f"{prefix}double_blocks.{i}.txt_attn.qkv", r, d, qkv_out)
        out += _pair(f"{prefix}double_blocks.{i}.img_attn.proj", r, d, d)
        out += _pair(f"{prefix}double_blocks.{i}.txt_attn.proj", r, d, d)
        out += _pair(f"{prefix}double_blocks.{i}.img_mlp.0", r, d, 4 * d)
    out += _pair(f"{prefix}single_blocks.0.linear1", r, d, 7 * d) + _pair(
        f"{prefix}single_blocks.0.linear2", r, 5 * d, d
    )
    if extra:
        for name in ("img_in", "txt_in", "time_in.in_layer", "final_layer.linear", "final_layer.adaLN_modulation.1",
                     "single_blocks.0.modulation.lin", "double_stream_modulation_img.lin"):  # fmt: skip
            out += _pair(f"{prefix}{name}", r, d, d)
    return out


# --- mutations ---------------------------------------------------------------------------------------------


def renamed(specs: list[Spec], fn) -> list[Spec]:
    return [(fn(n), s, v) for n, s, v in specs]


def with_slot(specs: list[Spec], slot: str) -> list[Spec]:
    return renamed(specs, lambda n: n.replace(".lora_A.weight", f".lora_A.{slot}.weight").replace(
        ".lora_B.weight", f".lora_B.{slot}.weight"))  # fmt: skip


def shuffled(specs: list[Spec], seed: int) -> list[Spec]:
    out = list(specs)
    random.Random(seed).shuffle(out)
    return out


def bases() -> dict[str, list[Spec]]:
    """Named key sets, valid and broken, before config and metadata variants."""
    dit = peft_dit()
    b: dict[str, list[Spec]] = {
        "peft_dit": dit,
        "peft_dit_wrapped": renamed(dit, lambda n: "base_model.model." + n),
        "peft_dit_peft_model": renamed(dit, lambda n: "peft_model.base_model.model." + n),
        "peft_dit_partial_wrap": renamed(dit[:4], lambda n: "base_model.model." + n) + dit[4:],
        "peft_dit_slot": with_slot(renamed(dit, lambda n: "base_model.model." + n), "default"),
        "peft_dit_two_slots": with_slot(dit[:8], "one") + with_slot(dit[8:], "two"),
        "peft_dit_mixed_slots": with_slot(dit[:8], "one") + dit[8:],
        "peft_dit_dup_slot": dit[:2] + with_slot(dit[:2], "default"),
        "peft_dit_dup_late": dit + with_slot(dit[4:6], "x"),
        "peft_dit_shuffled": shuffled(dit, 1),
        "peft_dit_mixed_rank": peft_dit(r=2, blocks=1) + peft_dit(r=4, blocks=2)[8:],
        "peft_dit_dora": dit + [("transformer_blocks.0.attn.to_q.lora_magnitude_vector", (8,), None)],
        "peft_dit_dora_scale": dit + [("transformer_blocks.0.attn.to_q.dora_scale", (8, 1), None)],
        "peft_dit_aux": dit
        + [(f"emb{i}.lora_embedding_A", (2, 4), None) for i in range(10)]
        + [("head.modules_to_save.default.weight", (4, 4), None), ("x.trainable_tokens_delta", (2, 4), None)],
        "peft_dit_alpha_tensor": dit + [("transformer_blocks.0.attn.to_q.alpha", (), 16.0)],
        "peft_dit_no_b": [s for s in dit if ".lora_B." not in s[0]],
        "peft_dit_1d_a": [
            ("transformer_blocks.0.attn.to_q.lora_A.weight", (2,), None),
            ("transformer_blocks.0.attn.to_q.lora_B.weight", (8, 2), None),
        ],  # fmt: skip
        "kohya_sd": kohya_sd(),
        "kohya_sd_no_alpha": kohya_sd(alpha=None),
        "kohya_sd_shuffled": shuffled(kohya_sd(), 2),
        "kohya_sd_mixed_rank": kohya_sd(r=2)[:3] + kohya_sd(r=4)[3:],
        "kohya_sd_dora_scale": kohya_sd() + [("lora_unet_down_blocks_0_attentions_0_proj_in.dora_scale", (8, 1), None)],
        "kohya_sd_fractional_alpha": kohya_sd(alpha=2.5),
        "kohya_sd_te_aux": kohya_sd() + [("lora_te_text_model_embeddings.lora_embedding_A", (2, 8), None)],
        "kohya_sd_foreign_key": kohya_sd() + _pair("unet.proj", 2, 8, 8, "lora_down", "lora_up"),
        "kohya_flux": kohya_flux(),
        "kohya_flux_no_alpha": kohya_flux(alpha=None),
        "kohya_flux_small": kohya_flux(r=2, h=8),
        "kohya_flux_rank3_sparse": kohya_flux(r=3),
        "kohya_flux_rank4": kohya_flux(r=4, alpha=None),
        "kohya_flux_rank3_dense": [
            (n, s, 0.5 if n.endswith("qkv.lora_up.weight") else v) for n, s, v in kohya_flux(r=3)
        ],
        "kohya_flux_shuffled": shuffled(kohya_flux(), 3),
        "kohya_flux_te": kohya_flux()
        + _pair("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 1, 768, 768, "lora_down", "lora_up")
        + [("lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha", (), 1.0)],
        "kohya_flux_unknown_module": kohya_flux()
        + _pair("lora_unet_double_blocks_0_foo", 1, 8, 8, "lora_down", "lora_up"),
        "kohya_flux_dora_scale": kohya_flux()
        + [("lora_unet_double_blocks_0_img_attn_proj.dora_scale", (3072, 1), None)],
        "kohya_flux_partial_alpha": [s for s in kohya_flux() if s[0] != "lora_unet_single_blocks_0_linear2.alpha"],
        "kohya_flux_diff_b": kohya_flux() + [("lora_unet_double_blocks_0_img_attn_proj.diff_b", (3072,), None)],
        "xlabs": xlabs(),
        "xlabs_small": xlabs(h=8),
        "xlabs_diffusion_model": renamed(xlabs(), lambda n: "diffusion_model." + n),
        "xlabs_extra_key": xlabs() + _pair("double_blocks.0.processor.other_lora", 2, 8, 8, "down", "up"),
        "xlabs_single_blocks": renamed(xlabs(), lambda n: n.replace("double_blocks", "single_blocks")),
        "minimax_h3": minimax_h3(),
        "minimax_h3_no_weight_suffix": minimax_h3(suffix=""),
        "minimax_h3_unmatched": minimax_h3() + _pair("lora_unet_blocks_0_attn_norm", 2, 8, 8, "lora_down", "lora_up"),
        "minimax_h3_foreign": minimax_h3() + _pair("lora_te_proj", 2, 8, 8, "lora_down", "lora_up"),
        "minimax_h3_out_only": [s for s in minimax_h3() if "attn_qkv_proj" not in s[0]],
        "minimax_h3_shuffled": shuffled(minimax_h3(), 4),
        "wan": wan(),
        "wan_no_prefix": wan(root="blocks"),
        "wan_norm3": _pair("diffusion_model.blocks.0.norm3", 2, 8, 8, "lora_down", "lora_up"),
        "wan_other_part": _pair("diffusion_model.blocks.0.modulation", 2, 8, 8, "lora_down", "lora_up"),
        "qwen_image": qwen_image(),
        "qwen_image_no_prefix": qwen_image(root="transformer_blocks"),
        "qwen_image_lightning": renamed(
            qwen_image(root="transformer_blocks"),
            lambda n: n.replace("lora.down", "lora_down").replace("lora.up", "lora_up"),
        ),
        "ai_toolkit": ai_toolkit(),
        "ai_toolkit_diffusion_model": ai_toolkit(prefix="diffusion_model."),
        "ai_toolkit_wrapped": ai_toolkit(prefix="base_model.model."),
        "ai_toolkit_wrapped_slot": with_slot(ai_toolkit(prefix="base_model.model."), "default"),
        "ai_toolkit_qkv_4": ai_toolkit(qkv_out=4),
        "ai_toolkit_qkv_7": ai_toolkit(qkv_out=7),
        "ai_toolkit_qkv_1": ai_toolkit(qkv_out=1),
        "ai_toolkit_single_only": _pair("single_blocks.3.linear1", 2, 8, 56)
        + _pair("single_blocks.3.linear2", 2, 40, 8),
        "ai_toolkit_single_modulation": _pair("single_blocks.0.modulation.lin", 2, 8, 8),
        "ai_toolkit_single_prefixed": _pair("base_model.model.single_blocks.0.linear2", 2, 40, 8)
        + _pair("other.proj", 2, 8, 8),
        "ai_toolkit_double_no_ab": _pair("double_blocks.0.img_attn.proj", 2, 8, 8, "lora_down", "lora_up"),
        "ai_toolkit_a_only": [s for s in ai_toolkit(extra=False) if ".lora_A." in s[0]],
        "ai_toolkit_shuffled": shuffled(ai_toolkit(), 5),
        "ai_toolkit_bad_block": _pair("double_blocks.x.img_attn.proj", 2, 8, 8)
        + _pair("double_blocks.1.img_attn.qkv", 2, 8, 24),
        "lycoris_like": [
            ("lora_unet_proj.hada_w1_a", (8, 2), None),
            ("lora_unet_proj.hada_w1_b", (2, 8), None),
            ("lora_unet_proj.alpha", (), 2.0),
        ],  # fmt: skip
        "empty_like": [("some.weight", (2, 2), None)],
    }
    return b


CONFIGS: dict[str, str | bytes | None] = {
    "none": None,
    "empty": "{}",
    "list": "[]",
    "list_of_object": '[{"r": 4, "lora_alpha": 8}]',
    "null": "null",
    "string": '"adapter"',
    "number": "4",
    "invalid_json": '{"r": 4,',
    "bom": b"\xef\xbb\xbf{}",
    "bad_utf8": b'{"r": "\xff"}',
    "alpha8": '{"r": 2, "lora_alpha": 8}',
    "alpha8_float": '{"lora_alpha": 8.0}',
    "alpha_frac": '{"lora_alpha": 8.5}',
    "alpha0": '{"lora_alpha": 0}',
    "alpha_neg": '{"lora_alpha": -4}',
    "alpha_str": '{"lora_alpha": "8"}',
    "alpha_bool": '{"lora_alpha": true}',
    "alpha_null": '{"lora_alpha": null}',
    "alpha_huge": '{"lora_alpha": 1e300}',
    "dora": '{"use_dora": true}',
    "dora_false": '{"use_dora": false, "bias": "none"}',
    "bias_all": '{"bias": "all"}',
    "bias_null": '{"bias": null}',
    "features": '{"bias": "lora_only", "fan_in_fan_out": true, "modules_to_save": ["x"], "use_qalora": true}',
    "lora_bias": '{"lora_bias": true}',
    "empty_features": '{"target_parameters": [], "modules_to_save": null, "layer_replication": []}',
    "trainable_tokens": '{"trainable_token_indices": [1, 2], "alora_invocation_tokens": [3]}',
    "pattern_attn": '{"lora_alpha": 4, "alpha_pattern": {"attn.to_q": 16}}',
    "pattern_kohya": '{"alpha_pattern": {"lora_unet_.*": 4}}',
    "pattern_all8": '{"alpha_pattern": {".*": 8}}',
    "pattern_all4": '{"alpha_pattern": {".*": 4}}',
    "pattern_all2": '{"alpha_pattern": {".*": 2}}',
    "pattern_blocks": '{"alpha_pattern": {"blocks.0.attn.qkv_proj": 6, "transformer_blocks.0.attn.to_q": 3}}',
    "pattern_list": '{"alpha_pattern": ["to_q"]}',
    "pattern_bad_re": '{"alpha_pattern": {"(": 4}}',
    "pattern_zero": '{"alpha_pattern": {"to_q": 0}}',
    "pattern_null": '{"alpha_pattern": {"to_q": null}}',
    "pattern_frac": '{"alpha_pattern": {"to_q": 2.5}}',
    "pattern_str": '{"alpha_pattern": {"to_q": "4"}}',
    "rslora": '{"use_rslora": true}',
    "rslora_str": '{"use_rslora": "true"}',
    "rslora_int": '{"use_rslora": 1}',
    "rslora_pattern": '{"lora_alpha": 8, "use_rslora": true, "alpha_pattern": {"to_q": 4}}',
}


def _meta(fields: dict[str, Any]) -> str:
    return json.dumps(fields)


METADATA: dict[str, dict[str, str] | None] = {
    "none": None,
    "format_pt": {"format": "pt"},
    "diffusers": {
        "lora_adapter_metadata": _meta(
            {
                "transformer.r": 2,
                "transformer.lora_alpha": 4,
                "transformer.use_dora": False,
                "text_encoder.lora_alpha": 99,
            }
        )
    },
    "diffusers_te_only": {"lora_adapter_metadata": _meta({"text_encoder.lora_alpha": 0, "unet.use_dora": True})},
    "diffusers_invalid_json": {"lora_adapter_metadata": "{not json"},
    "diffusers_list": {"lora_adapter_metadata": "[1, 2]"},
    "diffusers_bad_alpha": {"lora_adapter_metadata": _meta({"transformer.lora_alpha": 0})},
    "diffusers_str_alpha": {"lora_adapter_metadata": _meta({"transformer.lora_alpha": "4"})},
    "diffusers_dora": {"lora_adapter_metadata": _meta({"transformer.use_dora": True})},
    "diffusers_pattern": {"lora_adapter_metadata": _meta({"transformer.alpha_pattern": {"to_q": 6}})},
    "global_lora_alpha": {"lora_alpha": "8"},
    "global_network_alpha": {"network_alpha": "8.0"},
    "global_alpha_exp": {"alpha": "1e1"},
    "global_alpha_word": {"alpha": "abc"},
    "global_alpha_nan": {"alpha": "nan"},
    "global_alpha_inf": {"network_alpha": "inf"},
    "global_alpha_zero": {"lora_alpha": "0"},
    "global_alpha_neg": {"lora_alpha": "-2"},
    "global_alpha_frac": {"network_alpha": "8.5"},
    "global_alpha_spaces": {"alpha": " 4 "},
    "global_alpha_underscore": {"alpha": "1_6"},
    "global_conflict": {"lora_alpha": "8", "network_alpha": "16"},
    "global_agree": {"lora_alpha": "8", "network_alpha": "8.0", "alpha": "8"},
    "global_vs_diffusers": {"lora_alpha": "8", "lora_adapter_metadata": _meta({"transformer.lora_alpha": 4})},
    "global_and_diffusers_agree": {"alpha": "4", "lora_adapter_metadata": _meta({"transformer.lora_alpha": 4})},
    "global_bad_diffusers": {"alpha": "4", "lora_adapter_metadata": _meta({"transformer.lora_alpha": 2.5})},
    "ss_network_alpha": {"ss_network_alpha": "8.0", "ss_network_dim": "2"},
}

# Which configs and metadata each base meets: every base gets the common sets, a few get all.
_COMMON_CONFIGS = (
    "none",
    "list",
    "alpha8",
    "pattern_all8",
    "pattern_all4",
    "rslora",
    "dora",
    "features",
    "pattern_kohya",
)
_COMMON_METADATA = ("none", "global_lora_alpha", "diffusers")
_FULL = ("peft_dit", "peft_dit_slot", "kohya_sd", "peft_dit_mixed_rank", "minimax_h3", "ai_toolkit")


def _write_case(folder: Path, specs: list[Spec], config: str | bytes | None, metadata: dict[str, str] | None,
                name: str = "adapter.safetensors", dtype: str = "BF16") -> Path:  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    write(path, specs, metadata, dtype)
    if config is not None:
        data = config if isinstance(config, bytes) else config.encode()
        (folder / "adapter_config.json").write_bytes(data)
    return path


def file_cases(root: Path) -> list[dict]:
    cases: list[dict] = []

    def add(cid: str, path: Path, **extra: Any) -> None:
        cases.append({"id": cid, "kind": "file", "path": str(path), **extra})

    for bname, specs in bases().items():
        configs = CONFIGS if bname in _FULL else _COMMON_CONFIGS
        metas = METADATA if bname in _FULL else _COMMON_METADATA
        for cname in configs:
            add(f"{bname}/config={cname}", _write_case(root / bname / f"c-{cname}", specs, CONFIGS[cname], None))
        for mname in metas:
            if mname == "none":
                continue
            add(f"{bname}/meta={mname}", _write_case(root / bname / f"m-{mname}", specs, None, METADATA[mname]))
    # metadata and adapter_config.json together: lora_alpha conflicts and fills
    for cname in ("alpha8", "alpha_frac", "alpha_str", "empty", "dora_false", "pattern_attn"):
        for mname in ("diffusers", "global_lora_alpha", "global_network_alpha", "diffusers_pattern", "diffusers_dora"):
            folder = root / "both" / f"{cname}-{mname}"
            add(f"both/{cname}+{mname}", _write_case(folder, peft_dit(), CONFIGS[cname], METADATA[mname]))
    # dtypes of kohya alpha scalars, and an explicit lora_alpha argument
    for dtype in ("F32", "F16", "BF16"):
        for alpha in (4.0, 2.5, 0.0):
            folder = root / "dtype" / f"{dtype}-{alpha}"
            specs = kohya_sd(alpha=alpha)
            add(f"dtype/{dtype}/{alpha}", _write_case(folder, specs, CONFIGS["pattern_all4"], None, dtype=dtype))
    for alpha in (4, 16):
        add(f"lora_alpha_arg/{alpha}", _write_case(root / "arg" / str(alpha), peft_dit(), CONFIGS["alpha8"], None),
            lora_alpha=alpha)  # fmt: skip
    # a name not ending .safetensors: no metadata is read
    add("suffix/.SAFETENSORS", _write_case(root / "suffix", peft_dit(), None, METADATA["global_lora_alpha"],
                                           name="adapter.SAFETENSORS"))  # fmt: skip
    add("suffix/.st", _write_case(root / "suffix2", peft_dit(), None, METADATA["global_alpha_word"], name="adapter.st"))
    # real files: fixtures made by diffusers/PEFT and kohya conversion, and lorafast sample diffusion kinds
    for folder in (
        "diffusers_flux_transformer",
        "diffusers_sd_unet_te",
        "kohya_from_diffusers",
        "kohya_sdscripts_style",
    ):
        for file in sorted((REAL / folder).glob("*.safetensors")):
            for cname in ("none", "list", "alpha8", "pattern_all8", "rslora", "pattern_kohya"):
                dest = root / "real" / folder / cname
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(file, dest / file.name)
                if CONFIGS[cname] is not None:
                    (dest / "adapter_config.json").write_text(str(CONFIGS[cname]))
                add(f"real/{folder}/config={cname}", dest / file.name)
    from lorafast.sample import write_samples

    samples = root / "samples"
    kinds = ("diffusers_peft", "diffusers_legacy", "kohya_sd", "kohya_flux", "lycoris", "xlabs_flux", "ai_toolkit_flux")
    for path in write_samples(samples, 36, seed=7, hidden=16):
        p = Path(path)
        if not any(k in p.name for k in kinds):
            continue
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
        for file in files:
            dest = root / "sample" / p.name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, dest / file.name)
            add(f"sample/{p.name}", dest / file.name)
    shutil.rmtree(samples)
    return cases


# --- in-memory state dicts, lora_alpha, set_lora arguments --------------------------------------------------

_TOKENS = ("double_blocks.0.", "single_blocks.1.", "base_model.model.", "diffusion_model.", "transformer.",
           "transformer_blocks.0.", "blocks.2.", "lora_unet_", "lora_te_", "lora_te1_", "lora_te2_",
           "lora_unet_blocks_3_", "lora_unet_double_blocks_0_", "lora_unet_single_blocks_0_")  # fmt: skip
_MIDDLES = ("img_attn.qkv", "linear1", "linear2", "processor.proj_lora1", "processor.qkv_lora2", "self_attn.q",
            "cross_attn.k", "ffn.0", "norm3", "attn.to_q", "attn_qkv_proj", "mlp_fc1", "proj_in", "modulation.lin")  # fmt: skip
_ENDS = (".lora_A.weight", ".lora_B.weight", ".lora_A.default.weight", ".lora_down.weight", ".lora_up.weight",
         ".lora.down.weight", ".lora.up.weight", ".down.weight", ".up.weight", ".alpha", ".lora_down", ".diff")  # fmt: skip


def state_cases(n: int = 300) -> list[dict]:
    """Random key sets from format-marking pieces: detection, key normalization and conversion edges."""
    rng = random.Random(11)
    cases = []
    # Every named key set in memory too (its own order), and empty tensors, whose file order SGLang leaves to
    # a hash: in a file, tensors of one data offset have no defined order.
    named = dict(bases())
    named["zero_rank"] = _pair("transformer_blocks.0.attn.to_q", 0, 8, 8)
    named["ai_toolkit_qkv_0"] = ai_toolkit(qkv_out=0)
    for bname, specs in named.items():
        tensors = [[name, list(shape), value] for name, shape, value in specs]
        for cname in ("empty", "pattern_all4", "rslora"):
            config = json.loads(str(CONFIGS[cname]))
            cases.append({"id": f"state/{bname}/{cname}", "kind": "state", "tensors": tensors, "config": config})
    for i in range(n):
        tensors = []
        for _ in range(rng.randint(1, 5)):
            name = rng.choice(_TOKENS) + rng.choice(_MIDDLES) + rng.choice(_ENDS)
            if name.endswith(".alpha"):
                tensors.append([name, [], float(rng.choice((2, 4, 8)))])
            else:
                tensors.append([name, [rng.choice((0, 1, 2, 4, 5, 6)), 4], None])
        unique = list({t[0]: t for t in tensors}.values())
        config = json.loads(str(CONFIGS[rng.choice(("empty", "pattern_all4", "rslora", "alpha8", "pattern_blocks"))]))
        cases.append({"id": f"state/random/{i}", "kind": "state", "tensors": unique, "config": config})
    return cases


def argument_cases() -> list[dict]:
    cases: list[dict] = [{"id": "constants", "kind": "constants"}]
    alphas = (None, 8, 8.5, 0, -1, [4, None], [4], [None, 0], True, 1e-9)
    for i, alpha in enumerate(alphas):
        cases.append({"id": f"alpha/{i}", "kind": "alpha", "config": {"lora_alpha": alpha}})
    cases.append({"id": "alpha/absent", "kind": "alpha", "config": {}})
    params = [
        ("a", "p", 1.0, "all", None),
        (["a", "b"], ["p", "q"], 1, "transformer", None),
        (["a", "b"], "p", 1.0, "all", None),
        (["a", "b"], ["p", None], [1.0], "all", None),
        (["a", "b"], ["p", "q"], [1, 0.5], ["all"], None),
        (["a", "b"], ["p", "q"], 0.5, ["all", "critic"], [4]),
        (["a", "b"], ["p", "q"], 0.5, "all", [4, 0]),
        ("a", "p", 1.0, "all", -3),
        ("a", "p", 1.0, "all", 0),
        ("a", None, 2, "bogus", 8),
        ("a", "p", "1.0", "all", None),
        ("a", "p", [None], "all", None),
        ("a", ["p", "q"], 1.0, "all", None),
        ([], [], [], [], []),
        ("a", "p", True, "all", None),
        ("a", "p", 1.0, "all", [1, 2]),
        ("a", "p", 1.0, "all", "8"),
        ("a", "p", 1.0, "all", [None, 2.5]),
        (["a"], ["p"], [1.0], ["transformer_2"], [None]),
    ]
    for i, (nick, path, strength, target, alpha) in enumerate(params):
        args = {"nickname": nick, "path": path, "strength": strength, "target": target, "lora_alpha": alpha}
        cases.append({"id": f"params/{i}", "kind": "params", "args": args})
    i = 0
    for server in ("auto", "merge", "dynamic", "bogus"):
        for mode in (None, "auto", "merge", "dynamic", "fast", ""):
            for weights in (None, True, False):
                cases.append({"id": f"merge_mode/{i}", "kind": "merge_mode", "server_mode": server,
                              "merge_mode": mode, "merge_weights": weights})  # fmt: skip
                i += 1
    layer_sets = ([[False, True]], [[True, True]], [[False, False]], [[True, False]], [[False, True], [True, True]],
                  [[False, True], [False, False]], [])  # fmt: skip
    i = 0
    for mode in ("auto", "merge", "dynamic"):
        for layers in layer_sets:
            cases.append({"id": f"should_merge/{i}", "kind": "should_merge", "module": "transformer_2",
                          "merge_mode": mode, "layers": layers})  # fmt: skip
            i += 1
    return cases


def set_lora_cases(n: int = 240) -> list[dict]:
    """`set_lora` calls on pipelines of one to three DiTs, plain, FSDP-sharded or quantized, with adapters loaded
    or not: argument errors in their order, the one-adapter rule, and each module's merge decision."""
    rng = random.Random(13)
    calls = [
        ("a", "p", "all", 1.0, None), (["a", "b"], ["p", "q"], "all", 1.0, None),
        (["a", "b"], ["p", "q"], ["transformer", "transformer_2"], [1.0, 0.5], None),
        (["a", "b"], ["p", None], "transformer", 1.0, None), (["a", "c"], [None, None], "all", 1.0, None),
        ("a", None, "critic", 1.0, 8), (["a", "a"], ["p", "p2"], ["all", "critic"], 1.0, [4, None]),
        (["a", "b", "c"], ["p", "q", "r"], ["all", "transformer", "all"], 1.0, None),
        ("a", "p", "bogus", 1.0, None), (["a", "b"], ["p", "q"], ["all", "bogus"], 1.0, None),
        (["a", "b"], ["p"], "all", 1.0, None), ("a", "p", "all", 1.0, 0), ("a", "p", "transformer_2", 1.0, None),
    ]  # fmt: skip
    module_sets = [
        {"transformer": [False, True]}, {"transformer": [True, True]}, {"transformer": [False, False]},
        {"transformer": [False, True], "transformer_2": [False, False]},
        {"transformer": [False, True], "critic": [True, True]},
        {"transformer": [False, False], "transformer_2": [True, True], "critic": [False, True]}, {},
    ]  # fmt: skip
    loaded_sets = [{}, {"a": "p"}, {"a": "old", "b": "q"}]
    cases = []
    for i in range(n):
        nick, path, target, strength, alpha = rng.choice(calls)
        args = {"nickname": nick, "path": path, "target": target, "strength": strength, "lora_alpha": alpha,
                "merge_weights": rng.choice((None, None, True, False)),
                "merge_mode": rng.choice((None, None, "auto", "merge", "dynamic", "fast"))}  # fmt: skip
        cases.append({"id": f"set_lora/{i}", "kind": "set_lora", "args": args,
                      "server_mode": rng.choice(("auto", "merge", "dynamic")), "loaded": rng.choice(loaded_sets),
                      "modules": rng.choice(module_sets)})  # fmt: skip
    return cases


def build(root: Path) -> list[dict]:
    return file_cases(root) + state_cases() + argument_cases() + set_lora_cases()
