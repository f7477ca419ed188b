"""What a diffusion pipeline holds before and after a `set_lora` call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lorafast.compat.diffusion import PIPELINE_MODULES
from lorafast.planner._format import fmt_config


@dataclass(frozen=True)
class PipelineState:
    """What a diffusion pipeline holds before (or after) a `set_lora` call.

    Mirrors `LoRAPipeline`: `loaded_paths` / `loaded_alphas` are `loaded_adapter_paths` / `loaded_adapter_alphas`
    (nickname -> path / adapter-level alpha), `applied` is `cur_adapter_config` (module -> (nicknames,
    strengths)), `merged` is `is_lora_merged`. `modules` are the components present ("transformer" always;
    "transformer_2" for Wan2.2-style pipelines; "critic" with a fake-score transformer).
    """

    modules: tuple[str, ...] = ("transformer",)
    loaded_paths: Mapping[str, str] = field(default_factory=dict)
    loaded_alphas: Mapping[str, float | None] = field(default_factory=dict)
    applied: Mapping[str, tuple[tuple[str, ...], tuple[float, ...]]] = field(default_factory=dict)
    merged: Mapping[str, bool] = field(default_factory=dict)
    server_merge_mode: str = "auto"

    def __post_init__(self) -> None:
        modules = tuple(self.modules)
        unknown = [m for m in modules if m not in PIPELINE_MODULES]
        if unknown or "transformer" not in modules:
            raise ValueError(f"modules must include 'transformer' and be among {list(PIPELINE_MODULES)}: {modules}")
        object.__setattr__(self, "modules", tuple(m for m in PIPELINE_MODULES if m in modules))
        object.__setattr__(self, "loaded_paths", {str(k): str(v) for k, v in self.loaded_paths.items()})
        object.__setattr__(self, "loaded_alphas", dict(self.loaded_alphas))
        applied = {m: (tuple(cfg[0]), tuple(float(s) for s in cfg[1])) for m, cfg in self.applied.items()}
        object.__setattr__(self, "applied", applied)
        object.__setattr__(self, "merged", {m: bool(v) for m, v in self.merged.items()})

    @classmethod
    def from_pipeline(cls, pipeline: Any) -> PipelineState:
        """Read the state of a live SGLang `LoRAPipeline` (duck-typed: only its bookkeeping attributes)."""
        modules = ["transformer"]
        if getattr(pipeline, "lora_layers_transformer_2", None):
            modules.append("transformer_2")
        if getattr(pipeline, "lora_layers_critic", None):
            modules.append("critic")
        server_args = getattr(pipeline, "server_args", None)
        return cls(
            modules=tuple(modules),
            loaded_paths=dict(getattr(pipeline, "loaded_adapter_paths", {}) or {}),
            loaded_alphas=dict(getattr(pipeline, "loaded_adapter_alphas", {}) or {}),
            applied=dict(getattr(pipeline, "cur_adapter_config", {}) or {}),
            merged=dict(getattr(pipeline, "is_lora_merged", {}) or {}),
            server_merge_mode=getattr(server_args, "lora_merge_mode", None) or "auto",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "modules": list(self.modules),
            "loaded_paths": dict(self.loaded_paths),
            "loaded_alphas": dict(self.loaded_alphas),
            "applied": {m: {"nicknames": list(n), "strengths": list(s)} for m, (n, s) in self.applied.items()},
            "merged": dict(self.merged),
            "server_merge_mode": self.server_merge_mode,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineState:
        applied: dict[str, tuple[Sequence[str], Sequence[float]]] = {}
        for module, cfg in (data.get("applied") or {}).items():
            applied[module] = (cfg["nicknames"], cfg["strengths"]) if isinstance(cfg, Mapping) else (cfg[0], cfg[1])
        return cls(
            modules=tuple(data.get("modules") or ("transformer",)),
            loaded_paths=data.get("loaded_paths") or {},
            loaded_alphas=data.get("loaded_alphas") or {},
            applied=applied,  # type: ignore[arg-type]
            merged=data.get("merged") or {},
            server_merge_mode=data.get("server_merge_mode") or "auto",
        )

    def describe(self, module: str) -> str:
        cfg = self.applied.get(module)
        if cfg is None:
            return "nothing applied"
        state = "merged" if self.merged.get(module, False) else "dynamic"
        return f"{state} {fmt_config(cfg[0], cfg[1])}"
