"""`preflight`: will the server that this launch command starts serve these adapters as they were trained?

The input is what a platform team has: the engine's launch command (`vllm serve MODEL --enable-lora ...`,
`python -m sglang.launch_server --model-path M --lora-paths ...`), the adapters it names, any adapters loaded
later through the engine's dynamic-load path, and the base model the command names. Each part is answered by the
piece of lorafast that owns it, all from headers:

- the command, with the engine's own flags, defaults and start-up validation (`compat.launch`);
- the engine's load path and start-up and first-use checks, with its exception types and texts
  (`compat.vllm.preflight`, `compat.sglang.preflight`, `validate_new_adapter`);
- which modules the engine wraps (`--lora-target-modules`: vLLM's `is_in_target_modules`, SGLang's normalized
  targets and the weights its memory pool takes) and which match the base model at all (`check`);
- the scale each module is served at (vLLM's `get_rank_and_scaling`, SGLang's one `lora_alpha / r` per adapter)
  against the scale PEFT trained it at (`LoraModule`: `lora_alpha / r`, rsLoRA's `/ sqrt(r)`, the patterns).

One verdict per adapter, from `VERDICTS`, each with its reasons and the way out. What cannot be decided (no
readable base, an engine version lorafast has not verified) is `unknown`, naming the input that would decide it;
it is never `serves`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorafast.serving._verdicts import PreflightReport

if TYPE_CHECKING:
    from lorafast.adapter import Adapter
    from lorafast.base import BaseModel
    from lorafast.compat.launch import LaunchCommand
    from lorafast.scanning import ScanReport

# ---------------------------------------------------------------------------------------------------------------
# The base model the command names


def _hf_cache_snapshot(repo_id: str) -> str | None:
    """The local snapshot folder of a Hub repo id, as huggingface_hub lays out its cache (never downloads)."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub"
    )
    repo, _, revision = repo_id.partition("@")
    folder = os.path.join(hub, "models--" + repo.replace("/", "--"))
    ref = os.path.join(folder, "refs", revision or "main")
    snapshots = os.path.join(folder, "snapshots")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
        if os.path.isdir(os.path.join(snapshots, commit)):
            return os.path.join(snapshots, commit)
    if revision and os.path.isdir(os.path.join(snapshots, revision)):
        return os.path.join(snapshots, revision)
    if not revision and os.path.isdir(snapshots):
        found = sorted(os.scandir(snapshots), key=lambda e: e.stat().st_mtime, reverse=True)
        return found[0].path if found else None
    return None


def resolve_base(
    model: str | None, storage_options: Mapping[str, Any] | None = None, timeout: float | None = None
) -> tuple[BaseModel | None, str | None]:
    """(the base read from headers, None) or (None, why not and what would supply it)."""
    from lorafast.base import read_base
    from lorafast.errors import LorafastError

    if not model:
        return None, "the command names no model (vLLM: serve MODEL or --model; SGLang: --model-path)"
    path = model
    if "://" not in model and not os.path.exists(model):
        if model.count("/") == 1 and not model.startswith((".", "/")):
            path = _hf_cache_snapshot(model) or ""
            if not path:
                return None, (
                    f"{model!r} is a Hub repo id that is not in the local Hugging Face cache; download it, "
                    "or give its folder or an hf:// URL with --base"
                )
        else:
            return None, f"the model path {model!r} does not exist here; give the base with --base"
    try:
        return read_base(path, storage_options=storage_options, timeout=timeout), None
    except (LorafastError, OSError, ValueError) as e:
        return None, f"the base model {model!r} could not be read ({e}); give a readable one with --base"


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def preflight(
    command: str | Sequence[str] | LaunchCommand,
    adapters: Iterable[str | os.PathLike[str]] | str | os.PathLike[str] | ScanReport = (),
    *,
    base: BaseModel | str | os.PathLike[str] | None = None,
    engine_version: str | None = None,
    strict_version: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    threads: int | None = None,
    progress: bool | None = False,
) -> PreflightReport:
    """Will the server `command` starts serve each adapter as trained? `adapters` are loaded later, through the
    engine's dynamic-load path (paths, folders and URLs expand as in `scan`, or a `ScanReport`, such as
    `lorafast.Index(...).scan(...)` of the fleet); those the
    command names are loaded at start-up. `base` overrides the model the command names (a `BaseModel`, a path or
    a URL read with `read_base`).

    Returns a `PreflightReport`: one verdict per adapter from `VERDICTS`, whether the server starts, and the way
    out of every verdict other than `serves`. `engine_version` / `strict_version` as for every compat answer.
    """
    from lorafast.compat.launch import LaunchCommand, parse_launch

    launch = (
        command
        if isinstance(command, LaunchCommand)
        else parse_launch(command, engine_version=engine_version, strict_version=strict_version)
    )
    if isinstance(base, (str, os.PathLike)):
        base_model, note = resolve_base(os.fspath(base), storage_options, timeout)
    elif base is not None:
        base_model, note = base, None
    else:
        base_model, note = resolve_base(launch.model, storage_options, timeout)
    fleet = Fleet.read(launch, adapters, threads, storage_options, timeout, progress)
    from lorafast.serving._engines import judge

    return judge(launch, fleet, base_model, note)


def _name_of(path: str) -> str:
    """An adapter's name from its path: the folder, or the file's stem unless it is a standard weight-file name."""
    stem = os.path.basename(path.rstrip("/")).removesuffix(".safetensors")
    if stem in ("adapter_model", "pytorch_lora_weights") and os.path.dirname(path.rstrip("/")):
        return os.path.basename(os.path.dirname(path.rstrip("/")))
    return stem


@dataclass
class Fleet:
    """The adapters to judge: (name, path, source) in order, their scanned `Adapter` (None when unreadable)."""

    entries: list[tuple[str, str, str]] = field(default_factory=list)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    errors: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def read(
        cls,
        launch: LaunchCommand,
        extra: Any,
        threads: int | None,
        storage_options: Mapping[str, Any] | None,
        timeout: float | None,
        progress: bool | None,
    ) -> Fleet:
        from lorafast.scanning import ScanReport, scan

        fleet = cls()
        for name, path in launch.lora_adapters:
            fleet.entries.append((name, path, "command"))
        report: Any = None
        if isinstance(extra, ScanReport):  # a scan or an `Index.scan` of the fleet: nothing is read again
            report = extra
        else:
            items = [extra] if isinstance(extra, (str, os.PathLike)) else list(extra)
            if items:
                report = scan(
                    [os.fspath(p) for p in items],
                    threads=threads,
                    progress=progress,
                    storage_options=storage_options,
                    timeout=timeout,
                )
        named = {p for _, p, _ in fleet.entries}
        if report is not None:
            for path in report.paths:
                if path not in named:
                    fleet.entries.append((_name_of(path), path, "dynamic"))
            for adapter in report:
                fleet.adapters[adapter.path] = adapter
            for path, code, message in report.errors:
                fleet.errors[path] = (code, message)
        # The command's own adapters, read the way scan reads them (a Hub id that is not a path stays unread).
        local = [p for _, p, s in fleet.entries if s == "command" and p not in fleet.adapters]
        readable = [p for p in local if "://" in p or os.path.exists(p)]
        if readable:
            report = scan(readable, threads=threads, progress=False, storage_options=storage_options, timeout=timeout)
            by_input = {os.path.normpath(p): p for p in readable}
            for adapter in report:
                fleet.adapters[by_input.get(os.path.normpath(adapter.path), adapter.path)] = adapter
            for path, code, message in report.errors:
                fleet.errors[by_input.get(os.path.normpath(path), path)] = (code, message)
        return fleet
