"""vLLM's LoRA adapter checks, answered from safetensors headers (lora-formats.md §2).

* `check_peft_helper`: `PEFTHelper.from_dict` (required fields, positive rank);
* `validate_legal`: modules_to_save, DoRA, rank vs `max_lora_rank`, bias, joined into one ValueError;
* `parse_fine_tuned_lora_name` and `check_unexpected_modules`: the unsupported-weight-name error and the
  expected-target-modules check (leaf-name comparison; expert suffixes from `experts` on);
* `VLLM_MAX_LORA_RANKS` and `smallest_max_lora_rank`: the values `--max-lora-rank` accepts;
* `preflight`: all of the above for many adapters, raising the first error or collecting them all.

vLLM's error texts vary between versions; these follow the files named in lora-formats.md §0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafast.compat._common import Collector, CompatProblem
from lorafast.compat._inputs import AdapterView, resolve_adapters

__all__ = [
    "DEFAULT_PACKED_MODULES_MAPPING",
    "VLLM_MAX_LORA_RANKS",
    "VLLMPlan",
    "check_peft_helper",
    "check_unexpected_modules",
    "expected_lora_modules",
    "parse_fine_tuned_lora_name",
    "preflight",
    "smallest_max_lora_rank",
    "validate_legal",
]  # fmt: skip

#: `LoRAConfig.max_lora_rank: Literal[...]` in `vllm/config/lora.py`.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_PACKED_MODULES_MAPPING: Mapping[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

MSG_UNSUPPORTED_WEIGHT = "{name} is unsupported LoRA weight"
MSG_UNEXPECTED_MODULES = (
    "While loading {lora_dir}, expected target modules in {expected} but received {unexpected}. "
    "Please verify that the loaded LoRA module is correct"
)
MSG_RANK_TOO_BIG = "LoRA rank {r} is greater than max_lora_rank {max_lora_rank}."
MSG_MODULES_TO_SAVE = "vLLM only supports modules_to_save being None."
MSG_DORA = "vLLM does not yet support DoRA."
MSG_BIAS = "Adapter bias is not supported."
MSG_BIAS_DISABLED = "Adapter bias cannot be used without bias_enabled."
MSG_MISSING_FIELDS = "Missing required configuration fields: {missing}"
MSG_RANK_POSITIVE = "LoRA rank `r` must be a positive integer, got {r}."
MSG_NO_TENSORS = "{lora_dir} doesn't contain tensors"

_PREFIX = "base_model.model."


def _map(name: str, weights_mapper: Any) -> str:
    if weights_mapper is None:
        return name
    if hasattr(weights_mapper, "_map_name"):
        return weights_mapper._map_name(name)
    return weights_mapper(name)


def parse_fine_tuned_lora_name(name: str, weights_mapper: Callable[[str], str] | Any = None) -> tuple[str, bool]:
    """`(module name, is_lora_a)` for a LoRA tensor name, or vLLM's "... is unsupported LoRA weight" ValueError.

    `base_model.model.` is dropped from the module name; `weights_mapper` (a callable, or vLLM's
    `WeightsMapper`) is applied to the rest, as vLLM does.
    """
    if name.startswith(_PREFIX):
        name = _PREFIX + _map(name.replace(_PREFIX, ""), weights_mapper)
    else:
        name = _map(name, weights_mapper)
    start = 2 if name.startswith(_PREFIX) else 0
    parts = name.split(".")
    if parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[start:-2]), parts[-2] == "lora_A"
    if parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        return ".".join(parts[start:-1]), parts[-1] == "lora_embedding_A"
    raise ValueError(MSG_UNSUPPORTED_WEIGHT.format(name=name))


def expected_lora_modules(
    supported_lora_modules: Iterable[str], packed_modules_mapping: Mapping[str, list[str]] | None = None
) -> list[str]:
    """vLLM's `expected_lora_modules`: the model's LoRA module leaves with packed names expanded."""
    packed = DEFAULT_PACKED_MODULES_MAPPING if packed_modules_mapping is None else packed_modules_mapping
    out: list[str] = []
    for module in supported_lora_modules:
        out.extend(packed.get(module, [module]))
    return out


def _one(adapter: Any) -> AdapterView:
    (view,) = resolve_adapters([adapter])
    return view


def check_unexpected_modules(
    adapter: Any,
    expected_lora_modules: list[str],
    *,
    weights_mapper: Any = None,
    lora_dir: str | None = None,
) -> None:
    """`LoRAModel.from_local_checkpoint`'s header check, before any tensor is read.

    Keys containing `base_layer` are skipped; an expert module is compared from `experts` on, any other
    module by its last component only. Unknown tensor names raise "... is unsupported LoRA weight".
    `expected_lora_modules` is printed as given in the message, so pass a list as vLLM does.
    """
    view = _one(adapter)
    unexpected: list[str] = []
    for key in view.tensors:
        if key.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")) or "base_layer" in key:
            continue
        module, _ = parse_fine_tuned_lora_name(key, weights_mapper)
        if ".experts" in module:
            suffix = module[module.find(".experts") + 1 :]
            if suffix not in expected_lora_modules:
                unexpected.append(module)
        elif module.rsplit(".", 1)[-1] not in expected_lora_modules:
            unexpected.append(module)
    if unexpected:
        directory = view.path if lora_dir is None else lora_dir
        raise ValueError(
            MSG_UNEXPECTED_MODULES.format(lora_dir=directory, expected=expected_lora_modules, unexpected=unexpected)
        )


def check_peft_helper(adapter: Any) -> Mapping[str, Any]:
    """`PEFTHelper.from_dict`: required fields (a set, printed as vLLM prints it) and a positive `r`."""
    view = _one(adapter)
    config = dict(view.config or {})
    required = {"r", "lora_alpha", "target_modules"}
    missing = required - config.keys()
    if missing:
        raise ValueError(MSG_MISSING_FIELDS.format(missing=missing))
    r = config["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(MSG_RANK_POSITIVE.format(r=r))
    return config


def validate_legal(adapter: Any, max_lora_rank: int = 16, *, bias_enabled: bool | None = None) -> None:
    """`PEFTHelper.validate_legal`: every failed rule, joined with spaces, in one ValueError.

    Order: modules_to_save, DoRA, rank above `max_lora_rank`, bias. `bias_enabled=None` is current vLLM
    ("Adapter bias is not supported."); False/True are older versions with the `--enable-lora-bias` flag.
    """
    config = _one(adapter).config or {}
    errors: list[str] = []
    if config.get("modules_to_save"):
        errors.append(MSG_MODULES_TO_SAVE)
    if config.get("use_dora", False):
        errors.append(MSG_DORA)
    r = config.get("r")
    if isinstance(r, (int, float)) and r > max_lora_rank:
        errors.append(MSG_RANK_TOO_BIG.format(r=r, max_lora_rank=max_lora_rank))
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        if bias_enabled is None:
            errors.append(MSG_BIAS)
        elif not bias_enabled:
            errors.append(MSG_BIAS_DISABLED)
    if errors:
        raise ValueError(" ".join(errors))


def smallest_max_lora_rank(adapters: Any) -> int | None:
    """The smallest `--max-lora-rank` vLLM accepts that fits every adapter's `r` (None: above 512)."""
    ranks = [int((v.config or {}).get("r") or 0) for v in resolve_adapters(adapters)]
    need = max(ranks, default=0)
    return next((value for value in VLLM_MAX_LORA_RANKS if value >= need), None)


@dataclass(frozen=True)
class VLLMPlan:
    """The result of `preflight`: the rank the set needs and every problem found."""

    max_rank: int
    suggested_max_lora_rank: int | None
    problems: tuple[CompatProblem, ...]

    @property
    def ok(self) -> bool:
        return not any(p.fatal for p in self.problems)


def preflight(
    adapters: Any,
    *,
    max_lora_rank: int = 16,
    expected_lora_modules: list[str] | None = None,
    bias_enabled: bool | None = None,
    weights_mapper: Any = None,
    collect: bool = False,
) -> VLLMPlan:
    """vLLM's per-adapter load checks for a whole set, in vLLM's order for each adapter:
    `PEFTHelper.from_dict`, `validate_legal`, then (with `expected_lora_modules`) the header check.

    `max_lora_rank` outside `VLLM_MAX_LORA_RANKS` is reported first (vLLM's config validation rejects it).
    Raises the first error unless `collect=True`; then every problem is in `VLLMPlan.problems`.
    """
    col = Collector(collect)
    if max_lora_rank not in VLLM_MAX_LORA_RANKS:
        col.fail("vllm_max_lora_rank_value", ValueError(
            f"lorafast: vLLM accepts --max-lora-rank in {list(VLLM_MAX_LORA_RANKS)}, not {max_lora_rank}"
        ), stage="config")  # fmt: skip
    views = resolve_adapters(adapters)
    ranks = []
    for view in views:
        ids = {"adapter_id": view.lora_id, "adapter_name": view.name}
        try:
            config = check_peft_helper(view)
            ranks.append(int(config["r"]))
            validate_legal(view, max_lora_rank, bias_enabled=bias_enabled)
            if not view.tensors:
                raise ValueError(MSG_NO_TENSORS.format(lora_dir=view.path))
            if expected_lora_modules is not None:
                check_unexpected_modules(view, expected_lora_modules, weights_mapper=weights_mapper)
        except ValueError as exc:
            col.fail("vllm_load", exc, stage="load", **ids)
    need = max(ranks, default=0)
    suggested = next((value for value in VLLM_MAX_LORA_RANKS if value >= need), None)
    return VLLMPlan(max_rank=need, suggested_max_lora_rank=suggested, problems=tuple(col.problems))
