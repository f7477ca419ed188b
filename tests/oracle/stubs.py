"""Every stub the oracle runners install, in one place, each with why.

The engines' LoRA logic runs unmodified. What is replaced here is only what needs a GPU, a process group,
compiled kernels, or parts of the engine that the LoRA code imports but the tested paths never call.
Each engine has one section; a runner calls exactly one `install_*` function before importing the engine.
"""

from __future__ import annotations

# --- vLLM ------------------------------------------------------------------------------------------------

# --- SGLang (LLM: config, adapter, manager, memory pool, loader) -----------------------------------------

# --- SGLang diffusion (the lora/ package of the multimodal generator) ------------------------------------
# What runs for real: `format_adapter.py` and `peft_adapter.py`, imported as modules, with their real imports
# (torch, safetensors, diffusers' lora_conversion_utils). Two stubs:
#
# 1. Bare package objects for `sglang`, `sglang.multimodal_gen` and `...runtime.pipelines_core`. Their
#    `__init__.py` files import the whole engine (srt utils, zmq, pybase64, the composed pipeline base); the
#    lora/ modules under test import none of that. Each stub has the real folder as `__path__`, so every
#    submodule below it is the wheel's own file.
# 2. `pipeline.py` itself cannot be imported without the distributed runtime, offload managers and model
#    loaders. The few `LoRAPipeline` methods the oracle calls are compiled from the wheel's source text, byte for
#    byte (found by name with `ast`), into a class whose instance carries only what they read: `server_args`
#    (`lora_merge_mode`) and, for `_should_merge_lora_for_layers`, layers with `weight` and
#    `can_merge_base_weight`. `BaseLayerWithLoRA` is a placeholder: pipeline.py names it only in annotations.
#    `LORA_MERGE_MODES` is compiled the same way from `server_args/server_args.py`.

SGLANG_DIFFUSION_METHODS = (
    "VALID_TARGETS",
    "_normalize_lora_params",
    "_resolve_lora_merge_mode",
    "_should_merge_lora_for_layers",
    "_uses_dtensor_weights",
)


def install_sglang_diffusion(root: str) -> None:
    """Make `sglang.multimodal_gen.runtime.pipelines_core.lora.*` importable from the unpacked wheel at `root`."""
    import os
    import sys
    import types

    for name in ("sglang", "sglang.multimodal_gen", "sglang.multimodal_gen.runtime.pipelines_core"):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = module


def sglang_diffusion_pipeline_class(root: str) -> type:
    """A class holding `SGLANG_DIFFUSION_METHODS`, compiled unmodified from the wheel's pipeline.py."""
    import ast
    import logging
    import os

    from torch.distributed.tensor import DTensor

    base = os.path.join(root, "sglang", "multimodal_gen", "runtime")
    namespace: dict = {
        "logger": logging.getLogger("sglang_diffusion_oracle"),
        "DTensor": DTensor,
        "BaseLayerWithLoRA": type("BaseLayerWithLoRA", (), {}),
    }
    args_file = os.path.join(base, "server_args", "server_args.py")
    with open(args_file, encoding="utf-8") as f:
        args_source = f.read()
    for node in ast.parse(args_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LORA_MERGE_MODES" for t in node.targets):
            exec(compile(ast.Module([node], []), args_file, "exec"), namespace)
    pipeline_file = os.path.join(base, "pipelines_core", "lora", "pipeline.py")
    with open(pipeline_file, encoding="utf-8") as f:
        source = f.read()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "LoRAPipeline")
    wanted = []
    for node in cls.body:
        name = getattr(node, "name", None) or getattr(getattr(node, "target", None), "id", None)
        if name in SGLANG_DIFFUSION_METHODS:
            wanted.append(node)
    found = {getattr(n, "name", None) or n.target.id for n in wanted}
    missing = set(SGLANG_DIFFUSION_METHODS) - found
    if missing:
        raise RuntimeError(f"LoRAPipeline in {pipeline_file} lacks {sorted(missing)}")
    body = ast.Module([ast.ClassDef("LoRAPipeline", [], [], wanted, [])], [])
    ast.fix_missing_locations(body)
    exec(compile(body, pipeline_file, "exec"), namespace)
    return namespace["LoRAPipeline"]
