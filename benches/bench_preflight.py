"""SGLang start-up checks for 1,000 MoE adapters: lorafast's header-only preflight vs loading everything.

Generates N MoE PEFT adapters (default 1,000; BF16, 4 layers, 8 experts, hidden 64, expert intermediate 32,
rank 8, plus attention LoRA; tiny tensors, which favours the loaders, not lorafast): half per-expert numbered 2D (`experts.N.gate_proj/up_proj/down_proj`, 208 tensors
each), half stacked 3D (`experts.gate_up_proj` [E, r, H], 32 tensors each). Then times, on a warm page cache:

  lorafast   `lorafast.compat.sglang.preflight(paths, base_config=...)`: every check of an SGLang start-up
             (config, validation, target modules, max rank, shared-outer detection, buffer shapes, first-use
             checks), reading headers only; also timed from a `lorafast.scan` report (Adapter objects);
  engine     SGLang's own start-up load path, from the released wheel (default 0.5.23, unpacked in
             `.cache/engines/` by `make engines`): `LoRAManager.init_state`, which loads every adapter with
             `LoRAAdapter.initialize_weights` (every tensor read to CPU and normalized), infers target modules and
             max rank, detects the shared-outer mode and builds the memory pool on CPU. It runs in a child
             interpreter with the oracle's stubs (tests/oracle/sglang_load_bench_runner.py, which reuses
             tests/oracle/sglang_runner.py); only `init_state` is timed, not the interpreter or the engine import;
  reference  a plain re-implementation of that load: read every tensor of every adapter to CPU (safetensors, in
             `safe_open().keys()` order), route by layer, normalize (q/k/v and gate/up `torch.cat`, fused lora_A
             `repeat`), then run the shared-outer detection on the loaded tensors.

All must reach the same decision (target modules, max rank, shared-outer mode; with the engine also the memory
pool's buffer shapes). Prints the times and the ratios (the target: preflight at least 20x faster than the
engine's own load path). `--no-engine` skips the engine run.

`--before DIR` also times preflight(paths) and scan + preflight(report) with the build installed in DIR (`make
baseline`: 255a378, the fixed reference build) and with this one, alternated, each in a fresh process per
pass (caches empty, after a warm-up preflight of two other adapters), for --passes passes (default 5;
benches/_compare.py): the median and spread, the ratio to the reference and to the reference load and the engine
above (each measured once), and the load average at the start and end.
Usage: python benches/bench_preflight.py [--n 1000] [--hidden 64] [--engine-version 0.5.23] [--keep DIR]
[--before DIR] [--passes N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import lorafast
import lorafast._core
from _compare import CHILD_PRELUDE, add_options, compare, report
from lorafast.compat import sglang as sg
from lorafast.testing import write_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "oracle"))

LAYERS, EXPERTS, RANK = 4, 8, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_config(hidden: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden, "intermediate_size": 4 * hidden,
        "moe_intermediate_size": hidden // 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": hidden // 8, "num_hidden_layers": LAYERS, "num_experts": EXPERTS, "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    }  # fmt: skip


def make_adapters(root: str, n: int, hidden: int) -> list[str]:
    inter, head = hidden // 2, hidden // 8
    paths = []
    for i in range(n):
        folder = os.path.join(root, f"moe-{i:05d}")
        os.makedirs(folder)
        t: dict[str, tuple[str, tuple[int, ...]]] = {}
        for layer in range(LAYERS):
            p = f"base_model.model.model.layers.{layer}."
            for proj, out in (("q_proj", 8 * head), ("k_proj", 4 * head), ("v_proj", 4 * head)):
                t[p + f"self_attn.{proj}.lora_A.weight"] = ("BF16", (RANK, hidden))
                t[p + f"self_attn.{proj}.lora_B.weight"] = ("BF16", (out, RANK))
            t[p + "self_attn.o_proj.lora_A.weight"] = ("BF16", (RANK, 8 * head))
            t[p + "self_attn.o_proj.lora_B.weight"] = ("BF16", (hidden, RANK))
            if i % 2 == 0:  # per-expert, numbered 2D
                for e in range(EXPERTS):
                    x = f"{p}mlp.experts.{e}."
                    for proj in ("gate_proj", "up_proj"):
                        t[x + f"{proj}.lora_A.weight"] = ("BF16", (RANK, hidden))
                        t[x + f"{proj}.lora_B.weight"] = ("BF16", (inter, RANK))
                    t[x + "down_proj.lora_A.weight"] = ("BF16", (RANK, inter))
                    t[x + "down_proj.lora_B.weight"] = ("BF16", (hidden, RANK))
            else:  # stacked 3D, fused gate_up
                x = f"{p}mlp.experts."
                t[x + "gate_up_proj.lora_A.weight"] = ("BF16", (EXPERTS, RANK, hidden))
                t[x + "gate_up_proj.lora_B.weight"] = ("BF16", (EXPERTS, 2 * inter, RANK))
                t[x + "down_proj.lora_A.weight"] = ("BF16", (EXPERTS, RANK, inter))
                t[x + "down_proj.lora_B.weight"] = ("BF16", (EXPERTS, hidden, RANK))
        write_safetensors(os.path.join(folder, "adapter_model.safetensors"), t)
        cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": TARGETS}
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
        paths.append(folder)
    return paths


# --- the load-everything reference (what SGLang's LoRAAdapter.initialize_weights does) ------------------------


def load_everything(folder: str, num_layers: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import torch
    from safetensors import safe_open

    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    layers: list[dict[str, Any]] = [{} for _ in range(num_layers)]
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            for name in handle.keys():
                match = re.search(r"layers\.(\d+)\.", name)
                if match:
                    layers[int(match.group(1))][name] = handle.get_tensor(name).cpu()
    for w in layers:
        names = list(w)
        for n in names:
            if "q_proj" in n:
                k, v = n.replace("q_proj", "k_proj"), n.replace("q_proj", "v_proj")
                w[n.replace("q_proj", "qkv_proj")] = torch.cat((w[n], w[k], w[v]), 0)
                del w[n], w[k], w[v]
        for n in list(w):
            if "gate_proj" in n:
                up = n.replace("gate_proj", "up_proj")
                w[n.replace("gate_proj", "gate_up_proj")] = torch.cat((w[n], w[up]), w[n].dim() - 2)
                del w[n], w[up]
            elif "gate_up_proj" in n and "lora_A" in n:
                reps = [1] * w[n].dim()
                reps[-2] = 2
                w[n] = w[n].repeat(*reps)
    return config, layers


def reference(paths: list[str], num_layers: int) -> tuple[set[str], int, bool]:
    targets: set[str] = set()
    rank = 0
    shared: bool | None = None
    for folder in paths:
        config, layers = load_everything(folder, num_layers)
        targets |= sg.get_normalized_target_modules(config["target_modules"])
        rank = max(rank, config["r"])
        for layer in layers:
            for name, weight in layer.items():
                if "gate_up_proj" not in name or "lora_A" not in name:
                    continue
                if weight.dim() == 3:
                    is_shared = weight.shape[0] == 1
                elif re.search(r"(?:shared_)?experts\.\d+\.", name):
                    is_shared = False
                else:
                    continue
                if shared is None:
                    shared = is_shared
                elif shared != is_shared:
                    raise RuntimeError(f"mixed in {folder}")
    return targets, rank, bool(shared)


def cold_caches() -> None:
    """Empty lorafast's in-process caches (headers, normalized adapters and layers) before a timed run."""
    from lorafast.compat import _inputs
    from lorafast.compat.sglang import _weights as _sglang_weights

    _inputs._HEADER_CACHE.clear()
    _inputs._header_cache_used = 0
    for cache in (_sglang_weights._ADAPTER_CACHE, _sglang_weights._LAYER_CACHE):
        cache.data.clear()
        cache.used = 0


def engine_load(paths: list[str], hidden: int, version: str) -> tuple[float, dict[str, Any]]:
    """SGLang's own `LoRAManager.init_state` on `paths` (child interpreter); its seconds and decision."""
    from oracle import engines

    base = {"model_type": "qwen3_moe", **base_config(hidden)}
    out = engines.run("sglang_load_bench_runner", "sglang", version, {"base": base, "paths": paths}, timeout=3600)
    return min(out["seconds"]), out["startup"]


# --before: one claim of one build in a fresh process (benches/_compare.py). Its in-process caches start empty, as a
# server's do: after a warm-up preflight of two other adapters (imports, allocator), the fleet is timed once.
# Only public names; `engine_version` where the build's preflight takes it (255a378's does not).
COMPARE_CODE = (
    CHILD_PRELUDE
    + r"""
import inspect
from lorafast.compat import sglang as sg
root, warm, what, cfg, version = ARGS[0], ARGS[1], ARGS[2], json.loads(ARGS[3]), ARGS[4]
kw = {"engine_version": version} if "engine_version" in inspect.signature(sg.preflight).parameters else {}

def run(folder):
    paths = sorted(os.path.join(folder, d) for d in os.listdir(folder))
    adapters = paths if what == "preflight(paths)" else list(lorafast.scan(paths, progress=False))
    return sg.preflight(adapters, base_config=cfg, collect=True, **kw)

def timed():  # the scan of "scan + preflight(report)" is inside the clock
    t = time.perf_counter()
    plan = run(root)
    return time.perf_counter() - t, plan

run(warm)
secs, plan = timed()
assert not plan.errors, plan.errors[:3]
child_result({what: secs})
"""
)


def compare_builds(root: str, cfg: dict[str, Any], args: argparse.Namespace, fixed: dict[str, float]) -> None:
    """preflight(paths) and scan + preflight(report), this build against the one in --before, alternated."""
    fleet, warm = os.path.join(root, "fleet"), os.path.join(root, "warm")
    claims = ["preflight(paths)"] + ([] if args.no_scan else ["scan + preflight(report)"])
    for claim in claims:
        child_args = [fleet, warm, claim, json.dumps(cfg), args.engine_version]
        comp = compare(COMPARE_CODE, child_args, args.before, args.passes, label=f"\n{claim}, against {args.before}: ")
        report(comp, [claim], baselines={claim: list(fixed)}, fixed=fixed, per=args.n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--engine-version", default="0.5.23", help="SGLang release whose load path is timed")
    parser.add_argument("--no-engine", action="store_true", help="skip SGLang's own load path")
    parser.add_argument("--keep", help="write the adapters here and keep them")
    parser.add_argument("--no-scan", action="store_true", help="skip the lorafast.scan + preflight(report) timing")
    add_options(parser)
    args = parser.parse_args()
    build = getattr(lorafast._core, "build_profile", "?")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; lorafast._core build: {build}")

    root = args.keep or tempfile.mkdtemp(prefix="lorafast-bench-preflight-")
    try:
        t0 = time.perf_counter()
        paths = make_adapters(os.path.join(root, "fleet"), args.n, args.hidden)
        make_adapters(os.path.join(root, "warm"), 2, args.hidden)  # the --before children's warm-up
        size = sum(os.path.getsize(os.path.join(p, "adapter_model.safetensors")) for p in paths)
        print(f"wrote {len(paths)} MoE adapters ({size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
        cfg = base_config(args.hidden)

        # lorafast is timed three times (best run); the reference once (tens of seconds). Both read warm files.
        # Each lorafast run starts with its in-process caches empty: nothing is carried over from an earlier run.
        fast = fast_paths = float("inf")
        for _ in range(3):
            cold_caches()
            t0 = time.perf_counter()
            plan_from_paths = sg.preflight(paths, base_config=cfg, collect=True, engine_version=args.engine_version)
            fast_paths = min(fast_paths, time.perf_counter() - t0)
            if not args.no_scan:
                cold_caches()
                t0 = time.perf_counter()
                plan = sg.preflight(
                    list(lorafast.scan(paths)), base_config=cfg, collect=True, engine_version=args.engine_version
                )
                fast = min(fast, time.perf_counter() - t0)
        if args.no_scan:
            plan = plan_from_paths

        t0 = time.perf_counter()
        ref = reference(paths, LAYERS)
        slow = time.perf_counter() - t0
        if not args.no_engine:
            engine, engine_startup = engine_load(paths, args.hidden, args.engine_version)
        if args.before:
            fixed = {"load-everything reference": slow}
            if not args.no_engine:
                fixed[f"SGLang {args.engine_version} load"] = engine
            compare_builds(root, cfg, args, fixed)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    mine = (set(plan.target_modules), plan.max_lora_rank, plan.experts_shared_outer)
    same = mine == ref and plan.errors == [] and plan_from_paths.target_modules == plan.target_modules
    if not args.no_engine:
        from sglang_lorafast import _buffers

        engine_decision = {k: engine_startup.get(k) for k in ("target_modules", "max_lora_rank", "shared_outer")}
        engine_decision["buffers"] = engine_startup.get("buffers")
        mine_decision = {"target_modules": sorted(mine[0]), "max_lora_rank": mine[1], "shared_outer": mine[2],
                         "buffers": _buffers(plan_from_paths)}  # fmt: skip
        engine_same = engine_decision == mine_decision
        if not engine_same:
            print(f"engine decision differs: {engine_decision} != {mine_decision}")
        same = same and engine_same
        print(f"SGLang {args.engine_version} agrees (target modules, max rank, shared-outer, buffers): {engine_same}")
    print(f"decision: target_modules={sorted(mine[0])} max_lora_rank={mine[1]} shared_outer={mine[2]} "
          f"buffers={(plan.buffer_bytes or 0) / 2**20:.1f} MiB  (reference agrees: {same})")  # fmt: skip
    print(f"lorafast preflight(paths)          {fast_paths:8.3f} s  {fast_paths / args.n * 1e6:9.0f} us/adapter")
    if not args.no_scan:
        print(f"lorafast scan + preflight(report)  {fast:8.3f} s  {fast / args.n * 1e6:9.0f} us/adapter")
    print(f"load-everything reference          {slow:8.3f} s  {slow / args.n * 1e6:9.0f} us/adapter")
    if not args.no_engine:
        print(f"SGLang {args.engine_version} LoRAManager.init_state  {engine:8.3f} s  "
              f"{engine / args.n * 1e6:9.0f} us/adapter")  # fmt: skip
    print(f"ratio reference / preflight(paths):         {slow / fast_paths:8.1f}x")
    if not args.no_scan:
        print(f"ratio reference / scan + preflight(report): {slow / fast:8.1f}x")
    if not args.no_engine:
        print(
            f"ratio SGLang {args.engine_version} load / preflight(paths): {engine / fast_paths:8.1f}x (target: >= 20x)"
        )
        if not args.no_scan:
            print(f"ratio SGLang {args.engine_version} load / scan + preflight(report): {engine / fast:8.1f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
