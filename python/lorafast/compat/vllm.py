"""vLLM's LoRA adapter checks, answered from safetensors headers, version by version (vLLM 0.30.0, 0.33.0, 0.34.0).

The rules follow vLLM's released code (`vllm/lora/peft_helper.py`, `lora_model.py`, `utils.py`,
`worker_manager.py`, `model_manager.py`), and the oracle tests (`tests/test_oracle_vllm.py`) run that code on
the same adapters. Every entry point takes `engine_version=` (default: the installed vLLM, else the newest
supported).

* `load_adapter`: `WorkerLoRAManager._load_adapter` as a whole: config, `validate_legal`, weight-file choice,
  the expected-module check, tensor names, and (0.33) the MoE-format and classification-head checks. It
  returns what vLLM builds (ranks, scalings, shapes) or raises what vLLM raises (same type name, same text);
* `peft_helper` (`PEFTHelper.from_local_dir`/`from_dict`), `validate_legal`, `parse_fine_tuned_lora_name`,
  `expected_lora_modules`, `check_unexpected_modules`: the single steps;
* `preflight`: `load_adapter`'s code on every adapter of a set, problems collected per adapter;
  `VLLM_MAX_LORA_RANKS`, `smallest_max_lora_rank`.

Messages that print a Python set (the expected modules, the missing config fields) are built from the same
strings in the same order as vLLM builds them, so the text equals vLLM's in the same interpreter.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat import _versions
from lorafast.compat._common import Collector, CompatProblem, LoraRef, lora_id
from lorafast.compat._inputs import AdapterView, _is_adapter, _read_names_and_shapes, _view_of, resolve_adapters
from lorafast.errors import HeaderError

__all__ = [
    "DEFAULT_PACKED_MODULES_MAPPING",
    "VLLM_MAX_LORA_RANKS",
    "LoRAAdapterNotFoundError",
    "UnknownPatternError",
    "LoraWeights",
    "VLLMLoRA",
    "VLLMPlan",
    "WeightsMapper",
    "check_peft_helper",
    "check_unexpected_modules",
    "expected_lora_modules",
    "load_adapter",
    "parse_fine_tuned_lora_name",
    "peft_helper",
    "preflight",
    "smallest_max_lora_rank",
    "validate_legal",
]

#: `LoRAConfig.max_lora_rank: Literal[...]` in `vllm/config/lora.py` (0.30.0 and 0.33.0).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_PACKED_MODULES_MAPPING: Mapping[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

_PREFIX = "base_model.model."
_CLASSIFIERS = ["classifier", "score"]
# PEFTHelper's dataclass fields, in declaration order, per version; the first three are required.
_PEFT_FIELDS = ("r", "lora_alpha", "target_modules", "bias", "modules_to_save", "use_rslora", "use_dora")
_VLLM_FIELDS = ("vllm_lora_scaling_factor", "vllm_max_position_embeddings")
_FIELDS_030 = (*_PEFT_FIELDS, *_VLLM_FIELDS)
_FIELDS_033 = (
    *_PEFT_FIELDS,
    "lora_bias",
    "init_lora_weights",
    "alora_invocation_tokens",
    "layer_replication",
    "use_bdlora",
    "use_qalora",
    "rank_pattern",
    "alpha_pattern",
    *_VLLM_FIELDS,
)
# 0.34 reads PEFT's task_type: a SEQ_CLS/TOKEN_CLS adapter's modules_to_save gains classifier and score.
_FIELDS_034 = (*_FIELDS_033[:5], "task_type", *_FIELDS_033[5:])
_CLS_TASKS = ("SEQ_CLS", "TOKEN_CLS")
_REQUIRED = ("r", "lora_alpha", "target_modules")
_DEFAULTS: dict[str, Any] = {
    "bias": "none",
    "modules_to_save": None,
    "task_type": None,
    "use_rslora": False,
    "use_dora": False,
    "lora_bias": False,
    "init_lora_weights": True,
    "alora_invocation_tokens": None,
    "layer_replication": None,
    "use_bdlora": None,
    "use_qalora": False,
    "rank_pattern": None,
    "alpha_pattern": None,
    "vllm_lora_scaling_factor": 1.0,
    "vllm_max_position_embeddings": False,
}
# init_lora_weights strings 0.33 accepts: they only set the initial weights (peft_helper._init_is_supported).
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
_INIT_TEXT = (
    "vLLM does not support init_lora_weights={init!r}. Inits such as PiSSA, OLoRA, CorDA and LoftQ modify the "
    "base model weights when PEFT loads the adapter. Convert it to a regular LoRA adapter with PEFT's "
    "path_initial_model_for_weight_conversion, or set init_lora_weights to true if the served base model "
    "already contains the modified weights."
)


class LoRAAdapterNotFoundError(Exception):
    """vLLM's `vllm.exceptions.LoRAAdapterNotFoundError` (same name, same text)."""

    def __init__(self, lora_name: str, lora_path: str) -> None:
        self.message = f"Loading lora {lora_name} failed: No adapter found for {lora_path}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def _is_033(engine_version: str | None) -> bool:
    # Only 0.30.0 and 0.33.0 are checked against vLLM's code; versions in between get the 0.33.0 rules.
    return _versions.at_least("vllm", engine_version, "0.31.0")


def _is_034(engine_version: str | None) -> bool:
    return _versions.at_least("vllm", engine_version, "0.34.0")


# --- names -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsMapper:
    """The renaming part of vLLM's `WeightsMapper` (substrings, then prefixes, then suffixes; a None target
    drops the name), for describing a model's `hf_to_vllm_mapper` without vLLM installed."""

    orig_to_new_substr: Mapping[str, str | None] = None  # type: ignore[assignment]
    orig_to_new_prefix: Mapping[str, str | None] = None  # type: ignore[assignment]
    orig_to_new_suffix: Mapping[str, str | None] = None  # type: ignore[assignment]

    def _map_name(self, key: str) -> str | None:
        for substr, new in (self.orig_to_new_substr or {}).items():
            if substr in key:
                if new is None:
                    return None
                key = key.replace(substr, new, 1)
        for prefix, new in (self.orig_to_new_prefix or {}).items():
            if key.startswith(prefix):
                if new is None:
                    return None
                key = key.replace(prefix, new, 1)
        for suffix, new in (self.orig_to_new_suffix or {}).items():
            if key.endswith(suffix):
                if new is None:
                    return None
                key = new.join(key.rsplit(suffix, 1))
        return key

    def get_rename_mapper(self) -> WeightsMapper:
        """vLLM's rename-only variant: targets of None are dropped (what `_load_adapter` applies)."""

        def keep(d: Mapping[str, str | None] | None) -> dict[str, str | None]:
            return {k: v for k, v in (d or {}).items() if v is not None}

        return WeightsMapper(
            keep(self.orig_to_new_substr), keep(self.orig_to_new_prefix), keep(self.orig_to_new_suffix)
        )


def _map(name: str, weights_mapper: Any) -> str:
    mapped = weights_mapper._map_name(name) if hasattr(weights_mapper, "_map_name") else weights_mapper(name)
    if mapped is None:
        raise ValueError("Mapped LoRA weight name cannot be None.")
    return mapped


def parse_fine_tuned_lora_name(
    name: str, weights_mapper: Callable[[str], str | None] | Any = None, *, engine_version: str | None = None
) -> tuple[str, bool]:
    """`(module name, is_lora_a)` for a LoRA tensor name, or vLLM's "... is unsupported LoRA weight" ValueError.

    `base_model.model.` is dropped from the module name; `weights_mapper` (a callable, vLLM's `WeightsMapper`
    or this module's) is applied to the rest. From 0.33, `score`/`classifier` weights and biases name the
    classification head (`modules_to_save`).
    """
    if name.startswith(_PREFIX):
        name = name.replace(_PREFIX, "")
        if weights_mapper:
            name = _PREFIX + _map(name, weights_mapper)
    elif weights_mapper:
        name = _map(name, weights_mapper)
    start = 2 if name.startswith(_PREFIX) else 0
    parts = name.split(".")
    if _is_033(engine_version):
        if parts[-1] in ("weight", "bias") and len(parts) >= 2:
            if parts[-2] in ("lora_A", "lora_B") and parts[-1] == "weight":
                return ".".join(parts[start:-2]), parts[-2] == "lora_A"
            if parts[-2] in _CLASSIFIERS:
                return parts[-2], False
    elif parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[start:-2]), parts[-2] == "lora_A"
    if parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        return ".".join(parts[start:-1]), parts[-1] == "lora_embedding_A"
    raise ValueError(f"{name} is unsupported LoRA weight")


def expected_lora_modules(
    supported_lora_modules: Iterable[str],
    packed_modules_mapping: Mapping[str, list[str]] | None = None,
    *,
    engine_version: str | None = None,
) -> set[str]:
    """`_load_adapter`'s expected modules: the model's LoRA module leaves with packed names expanded, plus
    `experts` itself for MoE models, as a set built in vLLM's order (its repr is the one vLLM prints).
    The rule is the same in 0.30.0 and 0.33.0."""
    _versions.resolve("vllm", engine_version)
    packed = DEFAULT_PACKED_MODULES_MAPPING if packed_modules_mapping is None else packed_modules_mapping
    out: list[str] = []
    for module in supported_lora_modules:
        if module in packed:
            out.extend(packed[module])
        else:
            out.append(module)
        if module == "experts":
            out.append(module)
    return set(out)


_expected_modules = expected_lora_modules  # `preflight` has a parameter of that name


def is_in_target_modules(
    module_name: str, target_modules: list[str] | None, packed_modules_mapping: Mapping[str, list[str]] | None = None
) -> bool:
    """`vllm.lora.utils.is_in_target_modules`: does a module pass `--lora-target-modules`, the deployment-time
    filter of which modules `LoRAModelManager` wraps? (`_load_adapter` never consults it: an adapter module that
    fails it loads and is silently not applied.) Its suffix, or its whole name, must be listed, or a packed parent
    or child of it."""
    if target_modules is None:
        return True
    wanted = set(target_modules)
    suffix = module_name.split(".")[-1]
    if suffix in wanted or module_name in wanted:
        return True
    if not packed_modules_mapping:
        return False
    children = packed_modules_mapping.get(suffix)
    if children and any(child in wanted for child in children):
        return True
    return any(suffix in kids and parent in wanted for parent, kids in packed_modules_mapping.items())


def _is_base_embedding(name: str) -> bool:
    return name.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight"))


# --- PEFTHelper --------------------------------------------------------------------------------------------


@dataclass
class PEFTHelper:
    """The fields of vLLM's `PEFTHelper` after `from_dict` and `__post_init__` (values as in the JSON)."""

    fields: dict[str, Any]
    scaling: float

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None


def _peft_helper_from_dict(config: Any, engine_version: str | None) -> PEFTHelper:
    new = _is_033(engine_version)
    names = (_FIELDS_034 if _is_034(engine_version) else _FIELDS_033) if new else _FIELDS_030
    required = {name for name in names if name in _REQUIRED}
    missing = required - set(config.keys())
    if missing:
        raise ValueError(f"Missing required configuration fields: {missing}")
    fields: dict[str, Any] = {name: _DEFAULTS.get(name) for name in names}
    fields.update({k: v for k, v in config.items() if k in names})
    r = fields["r"]
    if r <= 0:
        raise ValueError(f"LoRA rank `r` must be a positive integer, got {r}.")
    if new:
        fields["rank_pattern"] = fields["rank_pattern"] or {}
        fields["alpha_pattern"] = fields["alpha_pattern"] or {}
        for key, rank in fields["rank_pattern"].items():
            if not isinstance(rank, int) or rank <= 0:
                raise ValueError(f"LoRA rank for `{key}` in `rank_pattern` must be a positive integer, got {rank}.")
    if fields.get("task_type") in _CLS_TASKS:  # 0.34's __post_init__, same expression (a `5` is its TypeError)
        fields["modules_to_save"] = list(dict.fromkeys([*(fields["modules_to_save"] or []), *_CLASSIFIERS]))
    alpha = fields["lora_alpha"]
    scaling = alpha / math.sqrt(r) if fields["use_rslora"] else alpha / r
    fields["vllm_lora_scaling_factor"] = scaling
    return PEFTHelper(fields, scaling)


def peft_helper(
    path: str, max_position_embeddings: int | None = None, *, engine_version: str | None = None
) -> PEFTHelper:
    """`PEFTHelper.from_local_dir`: reads `adapter_config.json` as vLLM does (same exceptions)."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    return _helper_from_config(config, max_position_embeddings, engine_version)


def _helper_from_config(config: Any, max_position_embeddings: int | None, engine_version: str | None) -> PEFTHelper:
    config["vllm_max_position_embeddings"] = max_position_embeddings
    return _peft_helper_from_dict(config, engine_version)


def _validate_features(helper: PEFTHelper, new: bool) -> list[str]:
    errors: list[str] = []
    if helper.modules_to_save:
        if not new:
            errors.append("vLLM only supports modules_to_save being None.")
        else:
            unsupported = [m for m in helper.modules_to_save if m not in _CLASSIFIERS]
            if unsupported:
                errors.append(
                    "vLLM only supports modules_to_save being either None "
                    'or ["classifier", "score"] for classification models. '
                    f"Unsupported modules_to_save: {unsupported}"
                )
    if helper.use_dora:
        errors.append("vLLM does not yet support DoRA.")
    if not new:
        return errors
    if helper.lora_bias:
        errors.append("vLLM does not support LoRA bias (lora_bias).")
    init = helper.init_lora_weights
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        errors.append(_INIT_TEXT.format(init=init))
    if helper.alora_invocation_tokens:
        errors.append("vLLM does not support Activated LoRA (aLoRA).")
    if helper.layer_replication:
        errors.append("vLLM does not support layer_replication.")
    if helper.use_bdlora:
        errors.append("vLLM does not support block-diagonal LoRA (BD-LoRA).")
    if helper.use_qalora:
        errors.append("vLLM does not support QALoRA.")
    return errors


def _validate_legal(helper: PEFTHelper, max_lora_rank: int, engine_version: str | None) -> None:
    new = _is_033(engine_version)
    errors = _validate_features(helper, new)
    rank = max([helper.r, *helper.rank_pattern.values()]) if new else helper.r
    if rank > max_lora_rank:
        errors.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    if helper.bias != "none":
        errors.append("Adapter bias is not supported.")
    if errors:
        raise ValueError(" ".join(errors))


def _source(adapter: Any) -> tuple[str, AdapterView | None]:
    """(path, None) for one adapter on disk (a path, or a scanned adapter whose path exists), which is read as
    vLLM reads that folder, whatever a scan made of it; (path, view) for one held in memory."""
    ((_, _, path, view),) = _entries(adapter)
    return path, view


def _helper_of(path: str, view: AdapterView | None, engine_version: str | None) -> PEFTHelper:
    """`PEFTHelper.from_local_dir(path)` (a missing, broken or non-PEFT `adapter_config.json`, or a file given
    for a folder, raises what vLLM raises), or the helper of an in-memory view's config."""
    if view is None:
        return peft_helper(path, engine_version=engine_version)
    return _helper_from_config(dict(view.config or {}), None, engine_version)


def check_peft_helper(adapter: Any, *, engine_version: str | None = None) -> Mapping[str, Any]:
    """`PEFTHelper.from_local_dir` (`from_dict` for an adapter in memory): the config file as vLLM reads it,
    required fields, rank (and 0.33's rank_pattern) checks, 0.34's classification `task_type`.

    Returns the helper's fields (config values with vLLM's defaults, and `vllm_lora_scaling_factor`).
    """
    return _helper_of(*_source(adapter), engine_version).fields


def validate_legal(adapter: Any, max_lora_rank: int = 16, *, engine_version: str | None = None) -> None:
    """`PEFTHelper.validate_legal`: every failed rule, joined with spaces, in one ValueError.

    0.30: modules_to_save, DoRA, `r` above `max_lora_rank`, bias. 0.33 adds `["classifier", "score"]` as
    allowed modules_to_save, lora_bias, PiSSA-like inits, aLoRA, layer_replication, BD-LoRA and QALoRA, and
    takes the rank as the max over `r` and the `rank_pattern` values.
    """
    _validate_legal(_helper_of(*_source(adapter), engine_version), max_lora_rank, engine_version)


# --- LoRAModel.from_local_checkpoint -----------------------------------------------------------------------


def _unexpected_modules(
    names: Iterable[str],
    expected: Any,
    modules_to_save: Any,
    weights_mapper: Any,
    unsupported: Iterable[str],
    engine_version: str | None,
) -> list[str]:
    unexpected: list[str] = []
    # 0.34: layers whose leaf name is expected but that vLLM does not wrap (BERT's pooler.dense)
    unwrapped = frozenset(unsupported) if _is_034(engine_version) else frozenset()
    for key in names:
        if _is_base_embedding(key) or "base_layer" in key:
            continue
        module, _ = parse_fine_tuned_lora_name(key, weights_mapper, engine_version=engine_version)
        base = module.rsplit(".", 1)[-1]
        if ".experts" in module:
            if module[module.find(".experts") + 1 :] not in expected:
                unexpected.append(module)
        elif base not in expected and (not _is_033(engine_version) or base not in (modules_to_save or ())):
            unexpected.append(module)
        elif module in unwrapped:
            unexpected.append(f"{module} (not a LoRA layer)")
    return unexpected


def _unexpected_error(lora_dir: str, expected: Any, unexpected: list[str]) -> ValueError:
    return ValueError(
        f"While loading {lora_dir}, expected target modules in {expected} but received {unexpected}. "
        "Please verify that the loaded LoRA module is correct"
    )


def check_unexpected_modules(
    adapter: Any,
    expected_lora_modules: Any,
    *,
    weights_mapper: Any = None,
    unsupported_lora_modules: Iterable[str] = (),
    lora_dir: str | None = None,
    engine_version: str | None = None,
) -> None:
    """`LoRAModel.from_local_checkpoint`'s name check, on the helper `PEFTHelper.from_local_dir` builds (its
    errors first) and the tensor names of the one file vLLM reads (its errors next).

    Keys containing `base_layer` are skipped; an expert module is compared from `experts` on, any other
    module by its last component (0.33: or a `modules_to_save` name; 0.34: a module named in
    `unsupported_lora_modules`, the model's unwrapped layers, is "(not a LoRA layer)"). `expected_lora_modules`
    is printed as given: pass the set `expected_lora_modules()` builds, as vLLM does.
    """
    path, view = _source(adapter)
    tensors: Mapping[str, tuple[int, ...] | None]
    if view is None:
        saved, tensors = _helper_of(path, None, engine_version).modules_to_save, _weights(path)
    else:  # in memory: its config, when it has one, names the saved modules
        saved = None if view.config is None else _helper_of(path, view, engine_version).modules_to_save
        tensors = _memory_tensors(view)(path)
    unexpected = _unexpected_modules(
        tensors, expected_lora_modules, saved, weights_mapper, unsupported_lora_modules, engine_version
    )
    if unexpected:
        raise _unexpected_error(path if lora_dir is None else lora_dir, expected_lora_modules, unexpected)


@dataclass(frozen=True)
class LoraWeights:
    """One entry of `LoRAModel.loras`: rank and scaling as vLLM computes them, and the tensor shapes."""

    rank: int
    scaling: float
    lora_a_shape: tuple[int, ...] | None
    lora_b_shape: tuple[int, ...] | None


@dataclass(frozen=True)
class VLLMLoRA:
    """What `_load_adapter` returns: the `LoRAModel`'s rank, its LoRA modules and (0.33) its full modules."""

    rank: Any
    loras: dict[str, LoraWeights]
    modules_to_save: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]]


def _pattern_value(pattern: Mapping[str, Any], name: str) -> Any:
    """`PEFTHelper._match_pattern`. vLLM matches with the `regex` package, which differs from `re` on keys
    (variable-width lookbehind, `\\p{L}`, inline flags, error texts), so `regex` answers when installed (it is a
    vLLM dependency); without it, a key `re` cannot read as `regex` would is refused, never guessed."""
    for key, value in pattern.items():
        if _regex_match(rf"(.*\.)?({key})$", name):
            return value
    return None


class UnknownPatternError(ValueError):
    """A `rank_pattern`/`alpha_pattern` key that only vLLM's `regex` package can evaluate, and it is not installed:
    lorafast cannot tell what vLLM decides."""


def _regex_match(pattern: str, name: str) -> bool:
    try:
        import regex
    except ImportError:
        return _re_match(pattern, name)
    return regex.match(pattern, name) is not None


def _re_match(pattern: str, name: str) -> bool:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # `re`'s FutureWarning marks syntax that `regex` reads differently
            return re.match(pattern, name) is not None
    except (re.error, FutureWarning) as exc:
        raise UnknownPatternError(
            f"lorafast: cannot evaluate the pattern {pattern!r} as vLLM does without the `regex` package ({exc})"
        ) from None


def _rank_and_scaling(helper: PEFTHelper, module_name: str) -> tuple[Any, float]:
    """0.33's `PEFTHelper.get_rank_and_scaling`."""
    if not helper.rank_pattern and not helper.alpha_pattern:
        return helper.r, helper.scaling
    if module_name.endswith(".experts.base_layer"):
        module_name = module_name.removesuffix(".base_layer") + ".gate_up_proj"
    elif module_name.endswith(".experts"):
        module_name += ".down_proj"
    rank = _pattern_value(helper.rank_pattern, module_name)
    rank = helper.r if rank is None else rank
    alpha = _pattern_value(helper.alpha_pattern, module_name)
    alpha = helper.lora_alpha if alpha is None else alpha
    return rank, (alpha / math.sqrt(rank) if helper.use_rslora else alpha / rank)


def _weights(lora_dir: str) -> dict[str, tuple[int, ...] | None]:
    """Tensor names and shapes of the one file vLLM reads (`adapter_model.safetensors`, else `.bin`, else `.pt`;
    other files in the folder are never read), headers only; vLLM's ValueError when there is none."""
    st = os.path.join(lora_dir, "adapter_model.safetensors")
    if os.path.isfile(st):
        return _safetensors_header(st)
    for name in ("adapter_model.bin", "adapter_model.pt"):
        file = os.path.join(lora_dir, name)
        if os.path.isfile(file):
            # The core's restricted reader: names and shapes in the saved order, the pickle never run.
            from lorafast import read_torch_header

            return {key: tuple(info.shape) for key, info in read_torch_header(file).tensors.items()}
    raise ValueError(f"{lora_dir} doesn't contain tensors")


def _safetensors_header(file: str) -> dict[str, tuple[int, ...] | None]:
    """Names and shapes as vLLM's `safetensors.safe_open` reads them. The core is stricter than safetensors (a
    repeated name) and words its errors its own way, so a header it refuses is read again, header only, by the
    `safetensors` package when installed (it always is beside vLLM): that raises vLLM's `SafetensorError`, text
    and all, or gives what vLLM loads. Without the package the core's HeaderError stands."""
    try:
        return _read_names_and_shapes(file)
    except HeaderError as exc:
        try:
            from safetensors import safe_open
        except ImportError:
            raise exc from None
        with safe_open(file, framework="numpy") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def _build(
    tensors: Mapping[str, tuple[int, ...] | None],
    helper: PEFTHelper,
    vocab_size: int | None,
    weights_mapper: Any,
    engine_version: str | None,
) -> VLLMLoRA:
    """`LoRAModel.from_lora_tensors` on names and shapes."""
    new = _is_033(engine_version)
    saved_names = (helper.modules_to_save or []) if new else []
    full: dict[str, dict[str, tuple[int, ...] | None]] = {}
    loras: dict[str, list[Any]] = {}
    for key, shape in tensors.items():
        if _is_base_embedding(key):
            continue
        module, is_a = parse_fine_tuned_lora_name(key, weights_mapper, engine_version=engine_version)
        if module in saved_names:
            full.setdefault(module, {})[key.split(".")[-1]] = shape
            continue
        if module not in loras:
            if new:
                peft_name, _ = parse_fine_tuned_lora_name(key, engine_version=engine_version)
                rank, scaling = _rank_and_scaling(helper, peft_name)
            else:
                rank, scaling = helper.r, helper.scaling
            loras[module] = [rank, scaling, None, None]
        if is_a:
            if "lora_embedding_A" in key and vocab_size is not None and vocab_size != (shape or ())[1]:
                raise RuntimeError(
                    f"The embedding LoRA size({shape[1]}) must be consistent"  # type: ignore[index]
                    f" with the base model's vocabulary size({vocab_size})."
                )
            loras[module][2] = shape
        else:
            loras[module][3] = shape
    saved: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
    for module, params in full.items():
        weight = params.get("weight")
        if weight is None:
            raise ValueError(f"Full module {module!r} is missing weight.")
        saved[module] = (weight, params.get("bias"))
    if len(saved) > 1:
        raise ValueError(f"Only one full classification module is supported per adapter, received {sorted(saved)}.")
    return VLLMLoRA(helper.r, {k: LoraWeights(*v) for k, v in loras.items()}, saved)


# --- WorkerLoRAManager._load_adapter ----------------------------------------------------------------------


@dataclass(frozen=True)
class ClassificationHead:
    """The model's unique classification head as vLLM's LoRA manager sees it (0.33)."""

    name: str
    max_labels: int
    input_size: int
    pooling_task: str = "classify"


def _lora_of(lora: VLLMLoRA, module_name: str, is_pooling_model: bool) -> LoraWeights | None:
    """`LoRAModelManager._get_lora_layer_weights` for a text-only model."""
    name = module_name
    if is_pooling_model and name not in lora.loras and module_name.removeprefix("model.") in lora.loras:
        name = module_name.removeprefix("model.")
    return lora.loras.get(name)


def _check_moe_format(lora: VLLMLoRA, lora_id: int, moe_modules: Iterable[str], is_pooling_model: bool) -> None:
    """`_validate_moe_lora_format` (0.33): a fused (target_parameters) MoE LoRA under a 2-D MoE wrapper."""
    for module_name in moe_modules:
        weights = _lora_of(lora, module_name, is_pooling_model)
        if weights is not None and weights.lora_a_shape is not None:
            raise ValueError(
                f"LoRA adapter {lora_id} contains fused 3D MoE weights for {module_name!r}, but the model uses a "
                "2D MoE LoRA wrapper. Start the engine with enable_mixed_moe_lora_format=True "
                "(--enable-mixed-moe-lora-format) and set is_3d_lora_weight=True on the LoRA request."
            )


def _check_classification_head(lora: VLLMLoRA, head: ClassificationHead | None, is_pooling_model: bool) -> None:
    """`_validate_classification_head_lora` (0.33)."""
    if head is None:
        if lora.modules_to_save:
            raise ValueError(
                f"Cannot load full module {next(iter(lora.modules_to_save))!r}: the model does not expose a "
                "unique classification head."
            )
        return
    name = head.name
    full = lora.modules_to_save.get(name)
    if full is None:
        full = lora.modules_to_save.get(name.removeprefix("model."))
    head_lora = _lora_of(lora, name, is_pooling_model)
    if head.pooling_task == "token_classify" and (full is not None or head_lora is not None):
        raise ValueError(
            f"Classification head {name!r} uses request routing; token_classify requires a token-routed "
            "classification head."
        )
    if not lora.modules_to_save:
        return
    saved = next(iter(lora.modules_to_save))
    if full is None:
        raise ValueError(f"Full module {saved!r} does not match the model's classification head {name!r}.")
    weight, bias = full
    if len(weight) != 2 or weight[0] < 1 or weight[0] > head.max_labels or weight[1] != head.input_size:
        raise ValueError(
            f"Full module {saved!r} for {name!r} has an incompatible weight shape: expected "
            f"(1..{head.max_labels}, {head.input_size}), received {tuple(weight)}."
        )
    if bias is not None and tuple(bias) != (weight[0],):
        raise ValueError(
            f"Full module {saved!r} for {name!r} has an incompatible bias shape: expected "
            f"{(weight[0],)}, received {tuple(bias)}."
        )


@dataclass(frozen=True)
class _Model:
    """What `_load_adapter` reads from the model and the worker (see `load_adapter`)."""

    expected: Any
    max_lora_rank: int
    max_position_embeddings: int | None
    vocab_size: int | None
    mapper: Any
    moe_modules: tuple[str, ...]
    classification_head: ClassificationHead | None
    is_pooling_model: bool
    unsupported: frozenset[str] = frozenset()
    """0.34's `unsupported_lora_modules`: full names of layers vLLM leaves unwrapped."""
    check_model: bool = True
    """False: the model is not described; the model-dependent steps are skipped."""


def _rename_mapper(hf_to_vllm_mapper: Any) -> Any:
    mapper = hf_to_vllm_mapper.get_rename_mapper() if hasattr(hf_to_vllm_mapper, "get_rename_mapper") else None
    return hf_to_vllm_mapper if mapper is None else mapper


def _read_helper(path: str, lora_name: str, model: _Model, engine_version: str | None) -> tuple[str, PEFTHelper]:
    """`_load_adapter` up to `PEFTHelper.from_local_dir`: the absolute path and the helper (vLLM's errors)."""
    lora_path = path
    if not os.path.isabs(lora_path) and os.path.exists(lora_path):  # get_adapter_absolute_path
        lora_path = os.path.abspath(lora_path)
    try:
        helper = peft_helper(lora_path, model.max_position_embeddings, engine_version=engine_version)
    except FileNotFoundError as exc:
        raise LoRAAdapterNotFoundError(lora_name, path) from exc
    return lora_path, helper


def _load_rest(
    lora_path: str,
    helper: PEFTHelper,
    lora_int_id: int,
    model: _Model,
    engine_version: str | None,
    tensors_of: Callable[[str], Mapping[str, tuple[int, ...] | None]] | None = None,
) -> VLLMLoRA:
    """`_load_adapter` after the helper: `validate_legal`, the weight file, the expected-module check,
    `LoRAModel.from_lora_tensors` and (0.33) the manager's MoE-format and classification-head checks.
    `tensors_of` replaces the folder's weight file for an in-memory adapter (`preflight` on an `AdapterView`)."""
    _validate_legal(helper, model.max_lora_rank, engine_version)
    tensors = _weights(lora_path) if tensors_of is None else tensors_of(lora_path)
    if model.check_model:
        unexpected = _unexpected_modules(
            tensors, model.expected, helper.modules_to_save, model.mapper, model.unsupported, engine_version
        )
        if unexpected:
            raise _unexpected_error(lora_path, model.expected, unexpected)
    lora = _build(tensors, helper, model.vocab_size, model.mapper, engine_version)
    if _is_033(engine_version) and model.check_model:
        _check_moe_format(lora, lora_int_id, model.moe_modules, model.is_pooling_model)
        _check_classification_head(lora, model.classification_head, model.is_pooling_model)
    return lora


def load_adapter(
    path: str | os.PathLike[str],
    *,
    supported_lora_modules: Iterable[str],
    packed_modules_mapping: Mapping[str, list[str]] | None = None,
    max_lora_rank: int = 16,
    max_position_embeddings: int | None = None,
    vocab_size: int | None = None,
    hf_to_vllm_mapper: Any = None,
    lora_name: str | None = None,
    lora_int_id: int = 1,
    moe_modules: Iterable[str] = (),
    classification_head: ClassificationHead | None = None,
    is_pooling_model: bool = False,
    unsupported_lora_modules: Iterable[str] = (),
    engine_version: str | None = None,
) -> VLLMLoRA:
    """`WorkerLoRAManager._load_adapter` for one adapter folder, from its config and weight headers.

    The model is described by what vLLM's LoRA manager reads from it: `supported_lora_modules` (module
    leaves), `packed_modules_mapping` (including `experts` for MoE models; None: Llama's qkv/gate_up
    packing), `hf_to_vllm_mapper` (vLLM's
    `WeightsMapper` or this module's; its renames are applied), `vocab_size`, `max_position_embeddings`,
    the MoE layers' names under 2-D wrappers (`moe_modules`), the classification head and (0.34) the full
    names of layers whose leaf is a LoRA module but that vLLM does not wrap (`unsupported_lora_modules`, the
    manager's set of that name: BERT's `bert.pooler.dense`).
    """
    given = os.fspath(path)
    name = os.path.basename(given.rstrip("/")) if lora_name is None else lora_name
    model = _Model(
        expected_lora_modules(supported_lora_modules, packed_modules_mapping),
        max_lora_rank,
        max_position_embeddings,
        vocab_size,
        _rename_mapper(hf_to_vllm_mapper),
        tuple(moe_modules),
        classification_head,
        is_pooling_model,
        frozenset(unsupported_lora_modules),
    )
    lora_path, helper = _read_helper(given, name, model, engine_version)
    return _load_rest(lora_path, helper, lora_int_id, model, engine_version)


# --- sets of adapters -------------------------------------------------------------------------------------


def smallest_max_lora_rank(adapters: Any, *, engine_version: str | None = None) -> int | None:
    """The smallest `--max-lora-rank` vLLM accepts that fits every adapter (None: above 512). The rank is `r`,
    and from 0.33 the largest `rank_pattern` value too, as `validate_legal` takes it."""
    new = _is_033(engine_version)
    ranks = []
    for view in resolve_adapters(adapters):
        config = view.config or {}
        pattern = (config.get("rank_pattern") or {}) if new else {}
        ranks.append(int(max([config.get("r") or 0, *pattern.values()])))
    need = max(ranks, default=0)
    return next((value for value in VLLM_MAX_LORA_RANKS if value >= need), None)


@dataclass(frozen=True)
class VLLMPlan:
    """The result of `preflight`: the rank the set needs, every problem found, and what each adapter loads as.

    `loras` maps each adapter's name to what `_load_adapter` builds for it (adapters vLLM rejects are absent).
    `skipped` names the load steps that need the model and were not run because it was not described
    (`supported_lora_modules` or `expected_lora_modules`); empty when the verdict is vLLM's whole load path.
    """

    max_rank: int
    suggested_max_lora_rank: int | None
    problems: tuple[CompatProblem, ...]
    loras: Mapping[str, VLLMLoRA] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    engine_version: _versions.EngineRules | None = field(default=None, compare=False)
    """The vLLM version answered for, and whether lorafast verified it (`status`)."""

    @property
    def ok(self) -> bool:
        return not any(p.fatal for p in self.problems)

    @property
    def verdict(self) -> str:
        """`"ok"`, `"fails"`, or `"unknown"` when the set would load but the version is not verified."""
        if not self.ok:
            return "fails"
        return "ok" if self.engine_version is None or self.engine_version.verified else "unknown"


_MODEL_STEPS = ("expected_modules", "moe_format", "classification_head")


def _entries(adapters: Any) -> list[tuple[str, str, str, AdapterView | None]]:
    """(name, id, path, in-memory view or None) per adapter. Paths are not read here: vLLM's load path reads
    them (its own weight-file choice); an Adapter or AdapterView whose path is not on disk is loaded from memory."""

    def one(
        obj: Any, name: str | None = None, adapter_id: str | None = None
    ) -> tuple[str, str, str, AdapterView | None]:
        if isinstance(obj, LoraRef) and obj.adapter is None:
            return name or obj.name, adapter_id or obj.lora_id, obj.path, None
        if isinstance(obj, (str, os.PathLike)):
            path = os.fspath(obj)
            name = name or os.path.basename(path.rstrip("/")).removesuffix(".safetensors")
            return name, adapter_id or lora_id(name, path), path, None
        if _is_adapter(obj) and os.path.exists(str(obj.path)):  # a scanned Adapter: vLLM reads its folder
            path = str(obj.path)
            name = name or obj.name
            return name, adapter_id or lora_id(name, path), path, None
        (view,) = resolve_adapters([obj]) if name is None else [_view_of(obj, name=name, adapter_id=adapter_id)]
        on_disk = bool(view.path) and os.path.exists(view.path)
        return view.name, view.lora_id, view.path, None if on_disk else view

    if isinstance(adapters, (str, os.PathLike, AdapterView, LoraRef)) or _is_adapter(adapters):
        return [one(adapters)]
    if isinstance(adapters, Mapping):
        return [one(value, str(key), str(key)) for key, value in adapters.items()]
    return [one(item) for item in adapters]


def preflight(
    adapters: Any,
    *,
    max_lora_rank: int = 16,
    supported_lora_modules: Iterable[str] | None = None,
    packed_modules_mapping: Mapping[str, list[str]] | None = None,
    expected_lora_modules: Any = None,
    max_position_embeddings: int | None = None,
    vocab_size: int | None = None,
    hf_to_vllm_mapper: Any = None,
    weights_mapper: Any = None,
    moe_modules: Iterable[str] = (),
    classification_head: ClassificationHead | None = None,
    is_pooling_model: bool = False,
    unsupported_lora_modules: Iterable[str] = (),
    first_lora_int_id: int = 1,
    collect: bool = False,
    engine_version: str | None = None,
    strict_version: bool = False,
) -> VLLMPlan:
    """`WorkerLoRAManager._load_adapter` for every adapter of a set: each adapter is decided by the code of
    `load_adapter` (config, `validate_legal`, weight file, expected modules, `from_lora_tensors`, and in 0.33
    the MoE-format and classification-head checks), so a rejection has vLLM's exception type and text.

    The model is described as for `load_adapter` (`supported_lora_modules`, `packed_modules_mapping`, ...), or
    by `expected_lora_modules` (the expanded module set itself). Without either, the model-dependent steps are
    skipped and listed in `VLLMPlan.skipped`. `weights_mapper` is an older name of `hf_to_vllm_mapper`.
    Adapters get vLLM int ids `first_lora_int_id`, +1, ... in order (only the MoE-format message prints one).
    `max_lora_rank` outside `VLLM_MAX_LORA_RANKS` is reported first (vLLM's config validation rejects it).
    Raises the first error unless `collect=True`; then every problem is in `VLLMPlan.problems`.
    `VLLMPlan.engine_version` says which version answered and whether lorafast verified it; an unverified one
    warns `UnverifiedEngineVersion` and `strict_version=True` raises `UnverifiedEngineVersionError` instead.
    """
    rules = _versions.rules_for("vllm", engine_version, strict=strict_version)
    col = Collector(collect)
    if max_lora_rank not in VLLM_MAX_LORA_RANKS:
        col.fail(
            "vllm_max_lora_rank_value",
            ValueError(f"lorafast: vLLM accepts --max-lora-rank in {list(VLLM_MAX_LORA_RANKS)}, not {max_lora_rank}"),
            stage="config",
        )
    if supported_lora_modules is not None:
        expected: Any = _expected_modules(supported_lora_modules, packed_modules_mapping)
    elif expected_lora_modules is not None:
        expected = expected_lora_modules if isinstance(expected_lora_modules, set) else set(expected_lora_modules)
    else:
        expected = None
    model = _Model(
        expected,
        max_lora_rank,
        max_position_embeddings,
        vocab_size,
        _rename_mapper(hf_to_vllm_mapper if hf_to_vllm_mapper is not None else weights_mapper),
        tuple(moe_modules),
        classification_head,
        is_pooling_model,
        frozenset(unsupported_lora_modules),
        check_model=expected is not None,
    )
    ranks: list[Any] = []
    loras: dict[str, VLLMLoRA] = {}
    for i, (name, adapter_id, path, view) in enumerate(_entries(adapters)):
        try:
            if view is None:
                lora_path, helper = _read_helper(path, name, model, engine_version)
                tensors_of = None
            else:
                if view.config is None:
                    raise LoRAAdapterNotFoundError(name, path)
                lora_path = path
                helper = _helper_from_config(dict(view.config), max_position_embeddings, engine_version)
                tensors_of = _memory_tensors(view)
            ranks.append(max([helper.r, *(helper.fields.get("rank_pattern") or {}).values()]))
            loras[name] = _load_rest(lora_path, helper, first_lora_int_id + i, model, engine_version, tensors_of)
        except Exception as exc:  # whatever vLLM's load path raises is its verdict on this adapter
            col.fail("vllm_load", exc, stage="load", adapter_id=adapter_id, adapter_name=name)
    need = int(max(ranks, default=0))
    suggested = next((value for value in VLLM_MAX_LORA_RANKS if value >= need), None)
    skipped = () if model.check_model else _MODEL_STEPS
    return VLLMPlan(need, suggested, tuple(col.problems), loras, skipped, engine_version=rules)


def _memory_tensors(view: AdapterView) -> Callable[[str], Mapping[str, tuple[int, ...] | None]]:
    def tensors_of(path: str) -> Mapping[str, tuple[int, ...] | None]:
        if view.tensors or view.has_weights:
            return view.tensors
        raise ValueError(f"{path} doesn't contain tensors")

    return tensors_of
