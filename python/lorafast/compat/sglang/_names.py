"""SGLang's target-module name rules and message texts (sglang-lora.md §5, §6, §8, §9, §11).

Kept apart from the checks so the pure name functions can be imported and tested on their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lorafast.compat import _versions

#: `get_normalized_target_modules`: the last dotted part of a PEFT target name -> SGLang's fused module.
PARAMS_MAPPING: Mapping[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "out_proj": "out_proj",
    "embed_tokens": "embed_tokens",
    "vocab_emb": "embed_tokens",
    "embeddings": "embed_tokens",
    "word_embeddings": "embed_tokens",
    "lm_head": "lm_head",
    "output": "lm_head",
    "unembed_tokens": "lm_head",
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
    "wq_b": "indexer.wq_b",
    "wk": "indexer.wk",
    "weights_proj": "indexer.weights_proj",
}

#: `get_stacked_multiply` defaults: how many LoRA-A blocks a fused module stacks along the rank axis.
STACKED_MULTIPLY: Mapping[str, int] = {
    "qkv_proj": 3,
    "in_proj_qkvz": 4,
    "gate_up_proj": 2,
    "gate_up_proj_moe": 2,
    "gate_up_proj_shared_moe": 2,
    "in_proj": 2,
    "fused_qkv_a_proj_with_mqa": 2,
}

DSA_INDEXER_LORA_NAMES = frozenset({"indexer.wq_b", "indexer.wk", "indexer.weights_proj"})

#: `_KNOWN_LORA_TARGET_MODULES`: what `auto_detect_lora_target_modules` may return.
KNOWN_LORA_TARGET_MODULES = DSA_INDEXER_LORA_NAMES | frozenset(
    {
        "qkv_proj",
        "qkvr",
        "o_proj",
        "wo_ud",
        "out_proj",
        "in_proj",
        "in_proj_qkvz",
        "up_proj",
        "gate_up_proj",
        "down_proj",
        "fc1_latent_proj",
        "fc2_latent_proj",
        "embed_tokens",
        "lm_head",
        "fused_qkv_a_proj_with_mqa",
        "q_b_proj",
        "kv_b_proj",
    }
)

EMBEDDING_NAMES = ("embed_tokens", "lm_head")

#: argparse choices of `--lora-target-modules` (plus "all").
SUPPORTED_LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
    "qkvr",
    "wo_ud",
)

#: Modules whose LoRA-A input dimension is split across tensor-parallel ranks.
ROW_PARALLEL_MODULES = frozenset({"o_proj", "out_proj", "down_proj", "down_proj_moe", "down_proj_shared_moe", "wo_ud"})

# --- message texts, verbatim -------------------------------------------------------------------------

MSG_MIXED_SHARED_OUTER = (
    "Mixed shared-outer LoRA formats detected across loaded adapters (conflict in adapter '{adapter_id}'). "
    "All MoE adapters must either all use shared outer experts (expert_dim=1) or all use per-expert weights."
)
MSG_ONLY_ALL_STRING = "Only 'all' or 'all-linear' can be used as the string for target module"
MSG_NO_TARGET_NAME = "Cannot find target module name for {name} in {target_modules}"
MSG_UNRECOGNIZED_STRING = (
    "SGLang does not recognize target_modules='{tm}'. Please use a list of module name suffixes in the "
    "adapter's PEFT config, or explicitly specify --lora-target-modules during server startup."
)
MSG_ONLY_LIST = (
    "SGLang currently only supports inferring LoRA target modules when a list of suffixes is provided in "
    "`target_modules` field of PEFT config. Please explicitly specify `--lora-target-modules` during server "
    "startup. You can specify `all` to enable all support modules types. "
)
MSG_NOT_SUBSET = (
    "LoRA adapter '{name}' contains target modules {missing} that are not included in the specified "
    "--lora-target-modules {have}. Please update --lora-target-modules to include all required modules: "
    "{union}, or use 'all' to enable all supported modules."
)
MSG_DSA_FUSION = (
    "LoRA targets the DSA indexer ({names}), which is incompatible with DSA indexer Q/K fusion. "
    "Set SGLANG_DISABLE_DSA_INDEXER_FUSION=1 to disable fusion and use indexer LoRA."
)
MSG_NEED_RANK_AND_TARGETS = (
    "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
    "--lora-target-modules for LoRA initialization."
)
MSG_ALL_ALONE = "If 'all' is specified in --lora-target-modules, it should be the only module specified."
MSG_MAX_LORAS_POSITIVE = "max_loras_per_batch must be positive"
MSG_ADDED_TOKENS = (
    "Failed to load {name} because LoRA serving currently doesn't support adapters that add tokens to the vocabulary"
)
MSG_DORA = "Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
MSG_ALREADY_LOADED = "Failed to load LoRA adapter {name} because it is already loaded"
MSG_SAME_PATH = "{path} is already loaded with name: {old}, but another copy is being loaded with name: {new}"
MSG_INCOMPATIBLE = (
    "LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory pool configuration. "
    "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the "
    "target modules are included in `--lora-target-modules`."
)
MSG_PINNED = (
    "Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots in the LoRA "
    "memory pool to avoid starvation for unpinned adapters and base models. Please increase your "
    "`--max-loras-per-batch` or load it as unpinned LoRA adapters."
)
MSG_ID_LOADED = (
    "LoRA adapter with ID {lora_id} is already loaded. This should have been verified before request is sent "
    "to the backend."
)
MSG_LOAD_FAILED = "Failed to load LoRA adapter {name}: {error}"
MSG_NO_WEIGHTS = "Cannot find any model weights with `{path}`"
MSG_ADDED_TOKENS_SHAPE = (
    "LoRA adapter {uid} has lora_added_tokens_size {n} specified in the config, but the loaded weight '{name}' "
    "has shape {m} in first dimension"
)
MSG_SKIPPED = (
    "LoRA adapter '{uid}': {n} weight(s) skipped because they did not match any target module in {targets}. "
    "Skipped weights: {names}. This likely indicates a mismatch between the adapter's target modules and the "
    "base model architecture."
)
MSG_SHARED_OUTER_EXPERT_DIM = (
    "experts_shared_outer_loras is enabled but {buffer} lora_{ab} has expert_dim={e} (expected 1)."
)
MSG_SHARED_OUTER_DICT = (
    "experts_shared_outer_loras is enabled but {buffer} lora_{ab} dict has {n} entries (expected 1)."
)
MSG_HIDDEN_DIM = "get_hidden_dim not implemented for "
MSG_SHARED_OUTER_LOG = (
    "Shared outer LoRA mode enabled: gate_up lora_A and down lora_B will be shared across experts (expert_dim=1)."
)
MSG_PATHS_DICT_KEYS = (
    "When providing LoRA paths as a list of dict, each dict should contain 'lora_name' and 'lora_path' keys. "
    "Got: {item}"
)
MSG_PATHS_ITEM_TYPE = "Invalid type for item in --lora-paths list: {type}. Expected a string or a dictionary."
MSG_PATHS_TYPE = "Invalid type for --lora-paths: {type}. Expected a list or a dictionary."


# --- the pure name functions ---------------------------------------------------------------------------


def get_normalized_target_modules(
    target_modules: str | Iterable[str], *, engine_version: str | None = None
) -> set[str]:
    """SGLang's normalization of PEFT `target_modules` to its fused module names.

    "all" / "all-linear" give `{"all"}`; any other string (a PEFT regex) raises ValueError. For a list,
    each entry's last dotted part goes through `PARAMS_MAPPING` (unknown names pass through unchanged).
    """
    _versions.resolve("sglang", engine_version)
    if isinstance(target_modules, str):
        if target_modules in ("all", "all-linear"):
            return {"all"}
        raise ValueError(MSG_ONLY_ALL_STRING)
    result: set[str] = set()
    for name in target_modules:
        leaf = name.split(".")[-1]
        result.add(PARAMS_MAPPING.get(leaf, leaf))
    return result


def get_stacked_multiply(module_name: str, base_model: Any = None, *, engine_version: str | None = None) -> int:
    """How many LoRA-A blocks `module_name` stacks; a base model's own `get_stacked_multiply` wins.

    `base_model` may be anything with a `get_stacked_multiply(name)` method, or a mapping of overrides.
    """
    _versions.resolve("sglang", engine_version)
    if isinstance(base_model, Mapping):
        if module_name in base_model:
            return int(base_model[module_name])
    elif base_model is not None and hasattr(base_model, "get_stacked_multiply"):
        return int(base_model.get_stacked_multiply(module_name))
    return STACKED_MULTIPLY.get(module_name, 1)


def get_target_module_name(
    full_module_name: str, target_modules: Iterable[str], *, engine_version: str | None = None
) -> str:
    """The longest target that is a substring of `full_module_name` (the first such, in iteration order)."""
    _versions.resolve("sglang", engine_version)
    matches = [target for target in target_modules if target in full_module_name]
    if not matches:
        raise ValueError(MSG_NO_TARGET_NAME.format(name=full_module_name, target_modules=target_modules))
    return max(matches, key=len)


def auto_detect_lora_target_modules(
    base_model_modules: Iterable[str], supported_lora_modules: Iterable[str] = (), *, engine_version: str | None = None
) -> set[str]:
    """SGLang's `auto_detect_lora_target_modules`, from the base model's module names instead of the model.

    `base_model_modules` lists module names as SGLang's walk sees them: the leaf names of linear layers
    (`qkv_proj`, `o_proj`, `gate_up_proj`, ...), `gate_up_proj`/`down_proj` for a FusedMoE, `lm_head`,
    `embed_tokens`. Full dotted names work too; DSA indexer leaves count only under an `indexer.` parent.
    """
    _versions.resolve("sglang", engine_version)
    indexer_leaves = {"wq_b", "wk", "weights_proj"}
    names: set[str] = set()
    for full in base_model_modules:
        parts = full.split(".")
        leaf = parts[-1]
        if leaf in indexer_leaves:
            if len(parts) < 2 or parts[-2] != "indexer":
                continue
            names.add(f"indexer.{leaf}")
            continue
        names.add(leaf)
    result = get_normalized_target_modules(names) & KNOWN_LORA_TARGET_MODULES
    # A model's `supported_lora_modules` are added even when the walk did not find them (sglang 0.5.23).
    result.update(set(supported_lora_modules) & KNOWN_LORA_TARGET_MODULES)
    return result
