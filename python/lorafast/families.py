"""Which public base model an adapter was trained on, from its shapes alone.

`fingerprint(adapter)` reads the dimensions an adapter's factor shapes reveal (hidden and intermediate size,
attention widths, layer count, experts, vocab, UNet cross-attention width, DiT widths and block counts).
`identify(adapter)` ranks the families of `FAMILIES` that agree with every visible dimension and names the
ambiguity when several agree equally (Llama 3.1 8B and Mistral 7B share every linear shape, for instance).

Each family's numbers are copied from its public `config.json` (diffusers: the component's `config.json`),
named in `source`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.adapter import module_dimensions


@dataclass(frozen=True)
class Family:
    name: str
    source: str
    """The public config the numbers come from."""
    dims: Mapping[str, int]
    """Fingerprint field -> value."""


def _llm(
    name: str,
    source: str,
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv: int,
    head_dim: int,
    vocab: int,
    experts: int = 0,
    expert_inter: int = 0,
) -> Family:
    dims = {"hidden": hidden, "layers": layers, "q_out": heads * head_dim, "kv_out": kv * head_dim, "vocab": vocab}
    if inter:
        dims["intermediate"] = inter
    if experts:
        dims["experts"] = experts
        dims["expert_intermediate"] = expert_inter
    return Family(name, source, dims)


def _unet(name: str, repo: str, cross_attention: int, channels: int, attn_down_blocks: int) -> Family:
    dims = {"cross_attention": cross_attention, "unet_channels": channels, "unet_attn_down_blocks": attn_down_blocks}
    return Family(name, f"https://huggingface.co/{repo}/blob/main/unet/config.json", dims)


def _dit(name: str, repo: str, hidden: int, ff: int, blocks: int, single_blocks: int = 0, context: int = 0) -> Family:
    dims = {"dit_hidden": hidden, "dit_ff": ff, "dit_blocks": blocks}
    if single_blocks:
        dims["dit_single_blocks"] = single_blocks
    if context:
        dims["dit_context"] = context
    return Family(name, f"https://huggingface.co/{repo}/blob/main/transformer/config.json", dims)


_HF = "https://huggingface.co/{}/blob/main/config.json"

#: Public architectures, dimensions from each repository's config.json.
FAMILIES: tuple[Family, ...] = (
    _llm("Llama-3.2-1B", _HF.format("meta-llama/Llama-3.2-1B"), 2048, 8192, 16, 32, 8, 64, 128256),
    _llm("Llama-3.2-3B", _HF.format("meta-llama/Llama-3.2-3B"), 3072, 8192, 28, 24, 8, 128, 128256),
    _llm("Llama-3.1-8B", _HF.format("meta-llama/Llama-3.1-8B"), 4096, 14336, 32, 32, 8, 128, 128256),
    _llm("Llama-3.1-70B", _HF.format("meta-llama/Llama-3.1-70B"), 8192, 28672, 80, 64, 8, 128, 128256),
    _llm("Qwen2.5-0.5B", _HF.format("Qwen/Qwen2.5-0.5B"), 896, 4864, 24, 14, 2, 64, 151936),
    _llm("Qwen2.5-1.5B", _HF.format("Qwen/Qwen2.5-1.5B"), 1536, 8960, 28, 12, 2, 128, 151936),
    _llm("Qwen2.5-3B", _HF.format("Qwen/Qwen2.5-3B"), 2048, 11008, 36, 16, 2, 128, 151936),
    _llm("Qwen2.5-7B", _HF.format("Qwen/Qwen2.5-7B"), 3584, 18944, 28, 28, 4, 128, 152064),
    _llm("Qwen2.5-14B", _HF.format("Qwen/Qwen2.5-14B"), 5120, 13824, 48, 40, 8, 128, 152064),
    _llm("Qwen2.5-32B", _HF.format("Qwen/Qwen2.5-32B"), 5120, 27648, 64, 40, 8, 128, 152064),
    _llm("Qwen2.5-72B", _HF.format("Qwen/Qwen2.5-72B"), 8192, 29568, 80, 64, 8, 128, 152064),
    _llm("Qwen3-0.6B", _HF.format("Qwen/Qwen3-0.6B"), 1024, 3072, 28, 16, 8, 128, 151936),
    _llm("Qwen3-1.7B", _HF.format("Qwen/Qwen3-1.7B"), 2048, 6144, 28, 16, 8, 128, 151936),
    _llm("Qwen3-4B", _HF.format("Qwen/Qwen3-4B"), 2560, 9728, 36, 32, 8, 128, 151936),
    _llm("Qwen3-8B", _HF.format("Qwen/Qwen3-8B"), 4096, 12288, 36, 32, 8, 128, 151936),
    _llm("Qwen3-14B", _HF.format("Qwen/Qwen3-14B"), 5120, 17408, 40, 40, 8, 128, 151936),
    _llm("Qwen3-32B", _HF.format("Qwen/Qwen3-32B"), 5120, 25600, 64, 64, 8, 128, 151936),
    _llm("Qwen3-30B-A3B", _HF.format("Qwen/Qwen3-30B-A3B"), 2048, 0, 48, 32, 4, 128, 151936, 128, 768),
    _llm("Qwen3-235B-A22B", _HF.format("Qwen/Qwen3-235B-A22B"), 4096, 0, 94, 64, 4, 128, 151936, 128, 1536),
    _llm("Mistral-7B-v0.3", _HF.format("mistralai/Mistral-7B-v0.3"), 4096, 14336, 32, 32, 8, 128, 32768),
    _llm("Mixtral-8x7B", _HF.format("mistralai/Mixtral-8x7B-v0.1"), 4096, 0, 32, 32, 8, 128, 32000, 8, 14336),
    Family(
        "DeepSeek-V3",
        _HF.format("deepseek-ai/DeepSeek-V3"),
        {
            "hidden": 7168,
            "intermediate": 18432,
            "layers": 61,
            "q_lora_rank": 1536,
            "kv_a_out": 576,
            "vocab": 129280,
            "experts": 256,
            "expert_intermediate": 2048,
        },
    ),
    _llm("gpt-oss-20b", _HF.format("openai/gpt-oss-20b"), 2880, 0, 24, 64, 8, 64, 201088, 32, 2880),
    _llm("gpt-oss-120b", _HF.format("openai/gpt-oss-120b"), 2880, 0, 36, 64, 8, 64, 201088, 128, 2880),
    _llm("Gemma-3-1B", _HF.format("google/gemma-3-1b-pt"), 1152, 6912, 26, 4, 1, 256, 262144),
    _llm("Gemma-3-4B", _HF.format("google/gemma-3-4b-pt"), 2560, 10240, 34, 8, 4, 256, 262208),
    _llm("Gemma-3-12B", _HF.format("google/gemma-3-12b-pt"), 3840, 15360, 48, 16, 8, 256, 262208),
    _llm("Gemma-3-27B", _HF.format("google/gemma-3-27b-pt"), 5376, 21504, 62, 32, 16, 128, 262208),
    # UNets: cross-attention width (text encoder), the channels of the last down block, its attention down blocks.
    _unet("SD-1.5", "stable-diffusion-v1-5/stable-diffusion-v1-5", 768, 1280, 3),
    _unet("SD-2.x", "stabilityai/stable-diffusion-2-1", 1024, 1280, 3),
    _unet("SDXL", "stabilityai/stable-diffusion-xl-base-1.0", 2048, 1280, 2),
    # DiTs: hidden width, feed-forward width, joint/double and single block counts, text width.
    _dit("SD-3.5-Large", "stabilityai/stable-diffusion-3.5-large", 2432, 9728, 38),
    _dit("SD-3.5-Medium", "stabilityai/stable-diffusion-3.5-medium", 1536, 6144, 24),
    _dit("FLUX.1", "black-forest-labs/FLUX.1-dev", 3072, 12288, 19, single_blocks=38),
    _dit("HunyuanVideo", "hunyuanvideo-community/HunyuanVideo", 3072, 12288, 20, single_blocks=40),
    _dit("Qwen-Image", "Qwen/Qwen-Image", 3072, 12288, 60, context=3584),
    _dit("Wan-2.1-14B", "Wan-AI/Wan2.1-T2V-14B-Diffusers", 5120, 13824, 40),
    _dit("Wan-2.2-A14B", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", 5120, 13824, 40),
    _dit("Wan-2.1-1.3B", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 1536, 8960, 30),
    _dit("Wan-2.2-5B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", 3072, 14336, 30),
)

#: fields where the adapter shows a lower bound only (it may adapt fewer layers or blocks than the model has)
_AT_LEAST = frozenset({"layers", "dit_blocks", "dit_single_blocks", "unet_attn_down_blocks"})


@dataclass(frozen=True)
class Identification:
    """`candidates`: families agreeing with every visible dimension, best first, as (name, matched dims)."""

    fingerprint: Mapping[str, int]
    candidates: tuple[tuple[str, int], ...]
    ambiguous: tuple[str, ...] = field(default=())
    """The families tied for first place, when more than one."""

    @property
    def best(self) -> str | None:
        return self.candidates[0][0] if self.candidates and not self.ambiguous else None

    def describe(self) -> str:
        if not self.candidates:
            return "no known family matches these shapes"
        if self.ambiguous:
            return f"ambiguous: {', '.join(self.ambiguous)} share every visible dimension"
        return f"{self.candidates[0][0]}"


def fingerprint(adapter: Any) -> dict[str, int]:
    """The base-model dimensions an adapter's shapes reveal (an `Adapter`, or a path to inspect)."""
    if not hasattr(adapter, "modules"):
        from lorafast.scanning import inspect

        adapter = inspect(adapter)
    return dict(adapter.fingerprint)


def rank_families(fp: Mapping[str, int], families: Iterable[Family] = FAMILIES) -> Identification:
    scored: list[tuple[str, int]] = []
    for fam in families:
        matched = 0
        ok = True
        shared = [k for k in fp if k in fam.dims]
        if not shared:
            continue
        for k in shared:
            have, want = fp[k], fam.dims[k]
            if k in _AT_LEAST:
                if have > want:
                    ok = False
                    break
                matched += have == want
            elif have != want:
                ok = False
                break
            else:
                matched += 1
        if ok and matched:
            scored.append((fam.name, matched))
    scored.sort(key=lambda s: -s[1])
    top = tuple(n for n, s in scored if scored and s == scored[0][1])
    return Identification(dict(fp), tuple(scored), top if len(top) > 1 else ())


def identify(adapter: Any, families: Iterable[Family] = FAMILIES) -> Identification:
    """Rank the known base families for an adapter, from its shapes alone (its config's
    `base_model_name_or_path` is not consulted, so a missing or wrong one does not matter)."""
    return rank_families(fingerprint(adapter), families)


def identify_weights(components: Mapping[str, Any]) -> str | None:
    """A family name for a base model's components (`BaseModel`s), or None when not unique."""
    rows = []
    for comp in components.values():
        for name, w in comp.weights.items():
            if not name.endswith(".weight") or w.shape is None or len(w.shape) < 2:
                continue
            path = name[: -len(".weight")]
            leaf = path.rsplit(".", 1)[-1]
            rows.append((path, leaf, None, w.shape[1], w.shape[0], None))
    return rank_families(module_dimensions(rows)).best


__all__ = ["FAMILIES", "Family", "Identification", "fingerprint", "identify", "rank_families"]
