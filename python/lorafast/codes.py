"""One `Literal` alias and one tuple per code list lorafast reports.

The lists that live in Rust (header, adapter and torch error codes, problem codes, flags: the enums of
`rust/codes.rs`; module kinds: `ModuleKind` in `rust/classify/classification.rs`) are exported by the extension, and the tuples
here are those lists; the aliases spell the same values for type
checkers. Merge forms live in Python (`lorafast.merging`), so their tuple is the alias's arguments.
`tests/formats/test_codes.py` checks, list by list, that the Rust list, the alias and the documented list are the
same set.
"""

from __future__ import annotations

from typing import Literal, get_args

from lorafast import _core

HeaderErrorCode = Literal[
    "header_too_small",
    "header_too_large",
    "invalid_header_length",
    "invalid_utf8",
    "invalid_json",
    "header_not_object",
    "invalid_metadata",
    "invalid_tensor_entry",
    "unknown_dtype",
    "invalid_offset",
    "overflow",
    "misaligned_slice",
    "tensor_size_mismatch",
    "incomplete_buffer",
    "duplicate_tensor",
    "duplicate_key",
]
"""`HeaderError.code`: the safetensors rule a header breaks."""

AdapterErrorCode = Literal[
    "not_found",
    "permission_denied",
    "io_error",
    "not_regular_file",
    "dangling_link",
    "symlink_loop",
    "no_adapter",
    "ambiguous_adapter",
    "missing_weights",
    "invalid_config",
    "internal",
    # URLs only
    "timeout",
    "connection_error",
    "remote_error",
    "short_read",
    "file_changed",
    "invalid_url",
    "store_config",
    "remote_unsupported",
]
"""The code of a failed adapter that is not a header rule (`AdapterError.code`, a report's `errors`)."""

TorchErrorCode = Literal[
    "legacy_torch_format",
    "invalid_zip",
    "invalid_pickle",
    "unsafe_pickle",
    "pickle_limit",
    "invalid_torch_tensor",
    "not_a_state_dict",
    "unsupported_byteorder",
]
"""Why a torch `.bin`/`.pt` file is refused (`AdapterError.code`)."""

ProblemCode = Literal[
    "missing_lora_a",
    "missing_lora_b",
    "orphan_tensor",
    "duplicate_factor",
    "rank_mismatch",
    "invalid_factor_shape",
    "config_rank_mismatch",
    "dtype_mismatch",
    "target_modules_mismatch",
    "unknown_tensor",
    "invalid_alpha",
    "moe_rank_not_divisible",
    "unsupported_pattern",
    "invalid_config_field",
    "unknown_field",
    "misaligned_offset",
    "non_tensor_value",
    "too_many_problems",
]
"""`Problem.code`: one inconsistency found in a readable adapter."""

Flag = Literal[
    "dora",
    "embeddings",
    "modules_to_save",
    "lora_bias",
    "trainable_tokens",
    "full_weights",
    "conv",
    "kohya_alpha",
    "non_additive",
    "has_config",
    "unsupported_features",
]
"""An entry of `Adapter.flags`; bit i of a report's `flags` column is `FLAGS[i]`."""

ModuleKind = Literal[
    "linear",
    "conv",
    "embedding",
    "expert_2d",
    "stacked_3d",
    "target_parameters",
    # LyCORIS and other non-LoRA variants
    "loha",
    "lokr",
    "oft",
    "boft",
    "ia3",
    "glora",
    "diff",
    "incomplete",
]
"""`LoraModule.kind`."""

MergeForm = Literal[
    "BA",
    "AtBt",
    "stacked",
    "stacked_t",
    "tp",
    "tp_t",
    "expert_slot",
    "stacked_slot",
    "dora",
    "bias",
]
"""How a module's factors meet a weight in a merge (`MergedTerm.form`): `BA` (W += B·A), `AtBt` (fan_in_fan_out
and embeddings: W += Aᵀ·Bᵀ), `stacked`/`stacked_t` (3-D expert stacks), `tp`/`tp_t` (PEFT `target_parameters`),
`expert_slot`/`stacked_slot` (one expert or projection inside a fused expert weight), `dora` and `bias`."""

HEADER_ERROR_CODES: tuple[HeaderErrorCode, ...] = tuple(_core.HEADER_ERROR_CODES)  # type: ignore[arg-type]
ADAPTER_ERROR_CODES: tuple[AdapterErrorCode, ...] = tuple(_core.ADAPTER_ERROR_CODES)  # type: ignore[arg-type]
TORCH_ERROR_CODES: tuple[TorchErrorCode, ...] = tuple(_core.TORCH_ERROR_CODES)  # type: ignore[arg-type]
PROBLEM_CODES: tuple[ProblemCode, ...] = tuple(_core.PROBLEM_CODES)  # type: ignore[arg-type]
FLAGS: tuple[Flag, ...] = tuple(_core.FLAGS)  # type: ignore[arg-type]
MODULE_KINDS: tuple[ModuleKind, ...] = tuple(_core.MODULE_KINDS)  # type: ignore[arg-type]
MERGE_FORMS: tuple[MergeForm, ...] = get_args(MergeForm)

__all__ = [
    "ADAPTER_ERROR_CODES",
    "FLAGS",
    "HEADER_ERROR_CODES",
    "MERGE_FORMS",
    "MODULE_KINDS",
    "PROBLEM_CODES",
    "TORCH_ERROR_CODES",
    "AdapterErrorCode",
    "Flag",
    "HeaderErrorCode",
    "MergeForm",
    "ModuleKind",
    "ProblemCode",
    "TorchErrorCode",
]
