"""adapter_config.json as SGLang's LoRAConfig reads it, and the weights it holds after normalization.

One module per SGLang stage; `lorafast.compat.sglang` re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector
from lorafast.compat._inputs import AdapterView, resolve_adapters
from lorafast.compat.sglang._names import MSG_NO_WEIGHTS
from lorafast.compat.sglang._weights import NO_CONFIG, LoadedWeights, load_adapter_weights

logger = logging.getLogger("lorafast.compat.sglang")


EXPERT_ID = re.compile(r"experts\.(\d+)\.")


SHARED_OUTER_SLOTS = (("gate_up_proj_moe", "A"), ("down_proj_moe", "B"))


@dataclass(frozen=True)
class AdapterConfig:
    hf_config: Mapping[str, Any]
    target_modules: Any
    r: Any
    lora_alpha: Any
    use_dora: bool
    lora_added_tokens_size: int


def read_lora_config(
    view: AdapterView, base_vocab_size: int | None = None, col: Collector | None = None
) -> AdapterConfig:
    """`LoRAConfig(path)`: a missing required key raises a plain KeyError, in SGLang's order."""
    error = view.config_error()
    if error is not None:
        raise error
    hf = view.config
    assert hf is not None
    target_modules = hf["target_modules"]
    r = hf["r"]
    lora_alpha = hf["lora_alpha"]
    added = 0
    if view.added_tokens_error is not None:
        message = f"Failed to parse added_tokens.json: {view.added_tokens_error}"
        logger.warning(message)
        if col is not None:
            col.warn("sglang_added_tokens_json", message, stage="load", adapter_id=view.lora_id, adapter_name=view.name)
    elif view.added_tokens:
        # Ids below the base vocabulary are "fake" added tokens and dropped.
        added = sum(1 for v in view.added_tokens.values() if base_vocab_size is None or v >= base_vocab_size)
    return AdapterConfig(hf, target_modules, r, lora_alpha, bool(hf.get("use_dora", False)), added)


# `filter_files_not_needed_for_inference` (sglang 0.5.23): names ending so are dropped after the file choice.
_NOT_FOR_INFERENCE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


def _loader_view(view: AdapterView) -> AdapterView:
    """`view` with the weights `DefaultModelLoader` reads from a folder that has no `.safetensors` file: the
    first of `*.bin`, `*.pt` that matches any file wins, then files not needed for inference are dropped (so
    `training_args.bin` beside an `adapter_model.pt` leaves no weights at all: "Cannot find any model weights").
    Each file's tensors are read header-only by the core's torch reader, in saved order, files in name order;
    a file the reader refuses leaves the view's tensors unseen (`weights_readable` False), as before."""
    if view.tensors or view.load_error is not None or not view.path or not os.path.isdir(view.path):
        return view
    names = sorted(n for n in os.listdir(view.path) if not n.startswith("."))  # glob skips hidden files
    if any(n.endswith(".safetensors") for n in names):
        return view
    chosen = next(([n for n in names if n.endswith(ext)] for ext in (".bin", ".pt") if any(
        n.endswith(ext) for n in names)), [])  # fmt: skip
    files = [os.path.join(view.path, n) for n in chosen if not n.endswith(_NOT_FOR_INFERENCE)]
    from lorafast.header import read_torch_header

    tensors: dict[str, tuple[int, ...] | None] = {}
    try:
        for file in files:
            tensors.update((k, tuple(info.shape)) for k, info in read_torch_header(file).tensors.items())
    except Exception:  # torch.load reads what the restricted reader refuses (a legacy file, an unsafe pickle)
        return dataclasses.replace(view, has_weights=bool(files), weights_readable=False)
    return dataclasses.replace(view, tensors=tensors, has_weights=bool(files), weights_readable=True)


def resolve_views(adapters: Any) -> list[AdapterView]:
    """`resolve_adapters`, with each folder's weights as SGLang's loader chooses them (`_loader_view`)."""
    return [_loader_view(view) for view in resolve_adapters(adapters)]


def text_config_of(base_config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """`base_hf_config.get_text_config()` for multimodal configs."""
    if base_config is None:
        return None
    for key in ("text_config", "language_config", "llm_config"):
        sub = base_config.get(key)
        if isinstance(sub, Mapping):
            return sub
    return base_config


def predict_loaded_weights(
    adapter: Any, *, base_config: Mapping[str, Any] | None = None, engine_version: str | None = None
) -> LoadedWeights:
    """The per-layer `{name: shape}` dicts SGLang holds after `initialize_weights()` for one adapter.

    Fused gate/up (`[E, r, H]` + `[E, r, H]` -> `[E, 2r, H]`), `.w1/.w3/.w2` renames, q/k/v fusion and the
    repeat of an already fused lora_A are all applied, with SGLang's errors.
    """
    _versions.resolve("sglang", engine_version)
    (view,) = resolve_views([adapter])
    shared = load_weights(view, base_config=text_config_of(base_config))
    # A private copy: the normalized dicts are cached and shared between adapters of the same structure.
    return LoadedWeights(
        shared.lora_id,
        {i: dict(w) for i, w in shared.layers.items()},
        dict(shared.embedding),
        dict(shared.added_tokens),
    )


def load_weights(
    view: AdapterView,
    *,
    config: AdapterConfig | None = None,
    base_config: Mapping[str, Any] | None = None,
    lora_added_tokens_size: int = 0,
) -> LoadedWeights:
    """`LoRAAdapter.initialize_weights` on a view from `resolve_views`: SGLang's error when its loader finds no weights
    file, else the normalized weights."""
    if not view.has_weights:
        raise RuntimeError(MSG_NO_WEIGHTS.format(path=view.path))
    if config is None and view.config is not None and view.config_file:
        target_modules = view.config.get("target_modules", NO_CONFIG)
        rank = view.config.get("r")
    elif config is not None:
        target_modules, rank = config.target_modules, config.r
    else:
        target_modules, rank = NO_CONFIG, None
    return load_adapter_weights(
        view,
        target_modules=target_modules,
        rank=rank if isinstance(rank, int) else None,
        base_config=base_config,
        lora_added_tokens_size=lora_added_tokens_size,
    )


def memoized(memo: dict[Any, Any] | None, key: Any, compute: Any) -> Any:
    """Per-preflight reuse of a result for adapters that share one normalized structure (same dict objects)."""
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]
