"""Engine checks answered from safetensors headers: drop-in replacements for SGLang's and vLLM's LoRA checks.

* `lorafast.compat.sglang`: SGLang's LLM server (`sglang.srt.lora`): shared-outer detection, target-module
  and rank inference, adapter validation, memory-pool planning, and `preflight` for a whole set;
* `lorafast.compat.diffusion`: SGLang's diffusion pipeline (format detection, PEFT key and config checks);
* `lorafast.compat.vllm`: vLLM's adapter checks;
* `diff_versions`: what an engine upgrade changes for each adapter; `engine_rules`: which verified version
  answers a version string (`parse_engine_version` reads one), and `VERIFIED_VERSIONS`, the releases the oracle
  tests run, with `VERSION_CHANGES`, what each changed; `UnverifiedEngineVersion` (warning) and
  `UnverifiedEngineVersionError` (`strict_version=True`).

They return the engine's answers and raise the engine's exceptions (same type, same message) without
loading a tensor. Importing this package imports only the standard library.
"""

from __future__ import annotations

from lorafast.compat._common import CompatProblem, LoraRef, lora_id
from lorafast.compat._inputs import AdapterView, resolve_adapters
from lorafast.compat._upgrade import AdapterOutcome, VersionChange, VersionDiff, diff_versions
from lorafast.compat._versions import CHANGES as VERSION_CHANGES
from lorafast.compat._versions import SUPPORTED as VERIFIED_VERSIONS
from lorafast.compat._versions import EngineRules, UnverifiedEngineVersion, UnverifiedEngineVersionError
from lorafast.compat._versions import parse as parse_engine_version
from lorafast.compat._versions import rules_for as engine_rules

__all__ = [
    "VERIFIED_VERSIONS",
    "VERSION_CHANGES",
    "AdapterOutcome",
    "AdapterView",
    "CompatProblem",
    "EngineRules",
    "LoraRef",
    "UnverifiedEngineVersion",
    "UnverifiedEngineVersionError",
    "VersionChange",
    "VersionDiff",
    "diff_versions",
    "engine_rules",
    "lora_id",
    "parse_engine_version",
    "resolve_adapters",
]
