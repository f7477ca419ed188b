"""Oracle runner: SGLang's diffusion LoRA code (multimodal_gen `pipelines_core/lora/`) on the generated cases.

Run by `engines.run("sglang_diffusion_runner", "sglang", version, cases)` in a child interpreter with the
unpacked wheel first on sys.path. Reads a JSON list of cases on stdin and writes one JSON result per case:
per stage, `{"ok": value}` or `{"err": [exception type, message]}`. Stubs: `stubs.py`, SGLang diffusion section.
"""

from __future__ import annotations

import json
import math
import os
import sys
import types

from stubs import install_sglang_diffusion, sglang_diffusion_pipeline_class

ROOT = next(p for p in sys.path if os.path.isdir(os.path.join(p, "sglang", "multimodal_gen")))
install_sglang_diffusion(ROOT)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sglang.multimodal_gen.runtime.pipelines_core.lora import format_adapter as fa  # noqa: E402
from sglang.multimodal_gen.runtime.pipelines_core.lora import peft_adapter as pa  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

Pipeline = sglang_diffusion_pipeline_class(ROOT)


def stage(fn, *args, **kwargs):
    try:
        return {"ok": fn(*args, **kwargs)}
    except Exception as exc:  # the oracle records every failure: type and exact text
        return {"err": [type(exc).__name__, str(exc)]}


def describe(state) -> dict:
    """Names in order, shapes, and the value of every one-element `.alpha` tensor."""
    alphas = {}
    for name, tensor in state.items():
        if name.endswith(".alpha") and tensor.numel() == 1:
            value = float(tensor.item())
            alphas[name] = value if math.isfinite(value) else str(value)
    return {"keys": list(state), "shapes": [list(t.shape) for t in state.values()], "alphas": alphas}


def tensors_of(spec: list) -> dict:
    """`[[name, shape, value or None], ...]` -> a state dict of small CPU tensors (zeros unless a value)."""
    out = {}
    for name, shape, value in spec:
        out[name] = torch.full(shape, float(value)) if value is not None else torch.zeros(shape)
    return out


def file_case(case: dict) -> dict:
    res: dict = {"load_file": stage(lambda: list(load_file(case["path"])))}
    if "err" in res["load_file"]:
        return res
    raw = load_file(case["path"])
    res.update(state_stages(raw))
    res["load_peft_config"] = stage(pa.load_peft_config, case["path"])
    if "ok" in res["load_peft_config"]:
        config = pa.load_peft_config(case["path"])
        res["normalize"] = stage(lambda: describe(fa.normalize_lora_state_dict(raw, adapter_config=config)))
        if case.get("lora_alpha") is not None:
            res["alpha"] = {"ok": case["lora_alpha"]}
        else:
            res["alpha"] = stage(pa.get_peft_lora_alpha, config)
    return res


def state_stages(state: dict, config: dict | None = None) -> dict:
    res = {"detect_raw": stage(lambda: fa.detect_lora_format_from_state_dict(state).value)}
    res["normalize_peft_keys"] = stage(lambda: list(pa.normalize_peft_keys(state)))
    if "ok" in res["normalize_peft_keys"]:
        normal = pa.normalize_peft_keys(state)
        res["detect"] = stage(lambda: fa.detect_lora_format_from_state_dict(normal).value)
    if config is not None:
        res["normalize"] = stage(lambda: describe(fa.normalize_lora_state_dict(state, adapter_config=config)))
    return res


def layer(dtensor: bool, can_merge: bool) -> types.SimpleNamespace:
    """A LoRA layer as `_should_merge_lora_for_layers` reads it: weight type and `can_merge_base_weight`."""
    # A DTensor without a device mesh: the method only asks isinstance(weight, DTensor).
    weight = torch.Tensor._make_subclass(DTensor, torch.zeros(1)) if dtensor else torch.zeros(1)
    return types.SimpleNamespace(weight=weight, can_merge_base_weight=can_merge)


class SglangDiffusionPipelineShell(Pipeline):
    """`set_lora` runs for real on this; the four methods below are the stubs listed in stubs.py (section 3)."""

    def __init__(self, case: dict) -> None:
        self.server_args = types.SimpleNamespace(lora_merge_mode=case.get("server_mode", "auto"))
        self.lora_initialized = True
        self.lora_adapters = {n: {} for n in case["loaded"]}
        self.loaded_adapter_paths = dict(case["loaded"])
        self.loaded_adapter_alphas = {n: None for n in case["loaded"]}
        layers = {m: {"l0": layer(*flags)} for m, flags in case["modules"].items()}
        self.lora_layers = layers.get("transformer", {})
        self.lora_layers_transformer_2 = layers.get("transformer_2", {})
        self.lora_layers_critic = layers.get("critic", {})
        self.decisions: list = []
        self.loads: list = []

    def _invalidate_lora_conditioning(self) -> None:
        pass

    def _reject_lora_on_packed_weights(self) -> None:
        pass

    def load_lora_adapter(self, path, nickname, rank, lora_alpha=None) -> None:
        self.loads.append([nickname, path, lora_alpha])
        self.lora_adapters[nickname] = {}
        self.loaded_adapter_paths[nickname] = path
        self.loaded_adapter_alphas[nickname] = lora_alpha

    def _should_merge_lora_for_layers(self, module_name, lora_layers, merge_mode):
        merge = super()._should_merge_lora_for_layers(module_name, lora_layers, merge_mode)
        self.decisions.append([module_name, merge])  # recorded, not changed
        return merge

    def _check_lora_config_matches(self, *args) -> bool:
        return True


def set_lora(case: dict) -> dict:
    shell = SglangDiffusionPipelineShell(case)
    a = case["args"]
    shell.set_lora(a["nickname"], a["path"], a["target"], a["strength"], a["merge_weights"], a["merge_mode"],
                   a["lora_alpha"])  # fmt: skip
    return {"decisions": shell.decisions, "loads": shell.loads}


def run(case: dict) -> dict:
    kind = case["kind"]
    if kind == "file":
        return file_case(case)
    if kind == "state":
        return state_stages(tensors_of(case["tensors"]), case.get("config", {}))
    if kind == "alpha":
        return {"alpha": stage(pa.get_peft_lora_alpha, case["config"])}
    if kind == "set_lora":
        return {"set_lora": stage(set_lora, case)}
    if kind == "constants":
        return {"valid_targets": {"ok": Pipeline.VALID_TARGETS}}
    pipe = Pipeline()
    pipe.server_args = types.SimpleNamespace(lora_merge_mode=case.get("server_mode", "auto"))
    if kind == "params":
        a = case["args"]
        return {"params": stage(lambda: list(pipe._normalize_lora_params(
            a["nickname"], a["path"], a["strength"], a["target"], a["lora_alpha"])))}  # fmt: skip
    if kind == "merge_mode":
        return {"merge_mode": stage(pipe._resolve_lora_merge_mode, case["merge_weights"], case["merge_mode"])}
    if kind == "should_merge":
        layers = {f"l{i}": layer(d, c) for i, (d, c) in enumerate(case["layers"])}
        return {"should_merge": stage(pipe._should_merge_lora_for_layers, case["module"], layers, case["merge_mode"])}
    raise ValueError(f"unknown case kind {kind!r}")


def main() -> None:
    cases = json.load(sys.stdin)
    json.dump({case["id"]: run(case) for case in cases}, sys.stdout)


if __name__ == "__main__":
    main()
