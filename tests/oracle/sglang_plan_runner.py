"""Oracle runner for planning: SGLang's diffusion `LoRAPipeline.set_lora`, run to the end, over call sequences.

Run by `engines.run("sglang_plan_runner", "sglang", version, scenarios)` in a child interpreter. It reuses
`sglang_diffusion_runner` (its stub setup, `stage`) and compiles the rest of `set_lora`'s methods and the LoRA
layer's bookkeeping unmodified from the wheel (`stubs.py`, SGLang diffusion section, stub 4, lists what is
stood in for, and why). Each scenario is one pipeline: its components' base weights (one safetensors file per
component, an int8 weight standing for a quantized one, optionally wrapped as FSDP `DTensor`s) and a sequence of
`set_lora` calls. After each call: the exception (type, text), or the pipeline's bookkeeping (merged state,
applied configuration, loaded paths and alphas), the components it applied to, and the rounding loss it measured.
"""

from __future__ import annotations

import json
import sys
import types
from collections import defaultdict

import sglang_diffusion_runner as sdr  # installs the diffusion stubs (tests/oracle/sglang_diffusion_runner.py)
import stubs
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

Pipeline = stubs.sglang_diffusion_pipeline_class(sdr.ROOT, stubs.SGLANG_DIFFUSION_PLAN_METHODS)
LayerBase = stubs.sglang_diffusion_layer_class(sdr.ROOT)


class Layer(LayerBase):
    """A LoRA layer: the engine's bookkeeping and `merge_rounding_norms`; merging only sets `merged` (stub 4)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.base_layer = types.SimpleNamespace(weight=weight)
        self.merged = False
        self.disable_lora = True
        self.lora_rank = None
        self.lora_alpha = None
        self.lora_weights_list = []
        self.lora_path = None
        self.strength = 1.0
        self.lora_A = None
        self.lora_B = None
        self.lora_output_offset = None
        self.has_lora_output_offset = False

    def merge_lora_weights(self, strength=None) -> None:
        if strength is not None:
            self.strength = strength
        if not self.disable_lora:
            self.merged = True

    def unmerge_lora_weights(self) -> None:
        self.merged = False


def layers_of(spec: dict) -> dict:
    out = {}
    for name, weight in load_file(spec["file"]).items():
        if spec.get("dtensor"):
            weight = torch.Tensor._make_subclass(DTensor, weight)
        out[name.removesuffix(".weight")] = Layer(weight)
    return out


class PlanPipelineShell(Pipeline):
    def __init__(self, scenario: dict) -> None:
        self.server_args = types.SimpleNamespace(
            lora_merge_mode=scenario.get("server_mode", "auto"), lora_alpha=None, model_path=""
        )
        self.lora_initialized = True
        self.lora_adapters = defaultdict(dict)
        self.loaded_adapter_paths = {}
        self.loaded_adapter_alphas = {}
        self.cur_adapter_name = {}
        self.cur_adapter_path = {}
        self.cur_adapter_strength = {}
        self.cur_adapter_config = {}
        self.is_lora_merged = {}
        self.auto_merge_rounding_loss = {}
        self.device = torch.device("cpu")
        layers = {m: layers_of(spec) for m, spec in scenario["modules"].items()}
        self.lora_layers = layers.get("transformer", {})
        self.lora_layers_transformer_2 = layers.get("transformer_2", {})
        self.lora_layers_critic = layers.get("critic", {})
        self.module_of = {id(d): m for m, d in layers.items()}
        self.touched: list = []
        self.losses: dict = {}

    def _invalidate_lora_conditioning(self) -> None:
        pass

    def _reject_lora_on_packed_weights(self) -> None:
        pass

    def _needs_lora_weight_update_context(self, target_modules, merge_weights_by_module) -> bool:
        return False

    def load_lora_adapter(self, lora_path, lora_nickname, rank, weight_name=None, lora_alpha=None) -> None:
        raw = load_file(lora_path)
        config = sdr.pa.load_peft_config(lora_path)
        state = sdr.fa.normalize_lora_state_dict(raw, adapter_config=config)
        alpha = lora_alpha if lora_alpha is not None else sdr.pa.get_peft_lora_alpha(config)
        self.lora_adapters[lora_nickname].clear()
        for name, weight in state.items():
            self.lora_adapters[lora_nickname][name.replace("diffusion_model.", "").replace(".weight", "")] = weight
        self.loaded_adapter_paths[lora_nickname] = lora_path
        self.loaded_adapter_alphas[lora_nickname] = alpha

    def _apply_lora_to_layers(self, lora_layers, *args, merge_weights=True, **kwargs):
        self.touched.append([self.module_of[id(lora_layers)], "merge" if merge_weights else "dynamic"])
        return super()._apply_lora_to_layers(lora_layers, *args, merge_weights=merge_weights, **kwargs)

    def _reactivate_cached_dynamic_lora_layers(self, lora_layers, *args):
        count = super()._reactivate_cached_dynamic_lora_layers(lora_layers, *args)
        if count is not None:
            self.touched.append([self.module_of[id(lora_layers)], "reactivate"])
        return count

    def _auto_merge_rounds_away(self, module_name, lora_layers, nicknames, paths, rank, strengths) -> bool:
        verdict = super()._auto_merge_rounds_away(module_name, lora_layers, nicknames, paths, rank, strengths)
        key = (module_name, tuple(paths), tuple(strengths), tuple(self.loaded_adapter_alphas.get(n) for n in nicknames))
        self.losses[module_name] = self.auto_merge_rounding_loss[key]
        return verdict


def call(shell: PlanPipelineShell, a: dict) -> dict:
    shell.touched, shell.losses = [], {}
    shell.set_lora(a["nickname"], a["path"], a["target"], a["strength"], a["merge_weights"], a["merge_mode"],
                   a["lora_alpha"])  # fmt: skip
    return {
        "merged": dict(shell.is_lora_merged),
        "config": {m: [list(n), list(s)] for m, (n, s) in shell.cur_adapter_config.items()},
        "paths": dict(shell.loaded_adapter_paths),
        "alphas": dict(shell.loaded_adapter_alphas),
        "touched": sorted({m for m, _ in shell.touched}),
        "losses": shell.losses,
    }


def run(scenario: dict) -> list:
    shell = PlanPipelineShell(scenario)
    return [sdr.stage(call, shell, a) for a in scenario["calls"]]


def main() -> None:
    scenarios = json.load(sys.stdin)
    json.dump({s["id"]: run(s) for s in scenarios}, sys.stdout)


if __name__ == "__main__":
    main()
