"""`lorafast.preflight` on a fleet with a base: the verdict per adapter for an SGLang and a vLLM launch command,
against the engine's own load path in the same run.

Writes a tiny Llama-shaped base (safetensors header + config.json, 4 layers, hidden 64 or --hidden) and N PEFT adapters
(default 10,000) that fit it: ranks 8/16/32/64 in turn, every fourth one rsLoRA (so SGLang serves it at another
scale) and every tenth one also on gate/up/down (so `--lora-target-modules q_proj k_proj v_proj o_proj` drops
modules). Then times, on a warm page cache:

  lorafast  `lorafast.preflight(command, adapters, base=...)` for
            `python -m sglang.launch_server --model-path BASE --enable-lora --max-lora-rank 32 --lora-target-modules
            q_proj k_proj v_proj o_proj` and for `vllm serve BASE --enable-lora --max-lora-rank 32 ...`: the command
            parsed, the base read, every adapter scanned, judged by the engine's rules, and the report built;
  engine    SGLang's own start-up load path for the same adapters (`LoRAManager.init_state`, every tensor read to
            CPU and normalized; tests/oracle/sglang_load_bench_runner.py in a child interpreter on the released
            wheel), on the first `--engine-n` adapters (default 500: the load is far slower), per adapter.

Prints each run's median and spread over `--passes` (default 5) and the per-adapter ratio, engine / lorafast.
`--before DIR` also times both preflights with the build installed in DIR (`make baseline`: 255a378) and with this
one, alternated, each in a fresh process per pass (benches/_compare.py), with the ratio to it and to the engine's
load; 255a378 has no `lorafast.preflight`, so against it there is no reference ratio.
Usage: python benches/bench_serving.py [--n 10000] [--engine-n 500] [--passes 5] [--keep DIR] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import lorafast
import lorafast._core
from _compare import CHILD_PRELUDE, add_options, compare, report
from lorafast.testing import write_peft_adapter, write_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "oracle"))

LAYERS, HEADS, KV = 4, 8, 4
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
HIDDEN = 64
SHAPES: dict[str, tuple[int, int]] = {}


def set_hidden(hidden: int) -> None:
    """Module shapes of a Llama of this width (intermediate 2x, 8 heads, 4 KV heads)."""
    global HIDDEN, INTER
    HIDDEN, INTER = hidden, 2 * hidden
    kv = KV * (hidden // HEADS)
    SHAPES.update({"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                   "o_proj": (hidden, hidden), "gate_proj": (INTER, hidden), "up_proj": (INTER, hidden),
                   "down_proj": (hidden, INTER)})  # fmt: skip


set_hidden(HIDDEN)


def write_base(root: str) -> str:
    folder = os.path.join(root, "base")
    os.makedirs(folder)
    t: dict[str, tuple[str, tuple[int, ...]]] = {"model.embed_tokens.weight": ("BF16", (256, HIDDEN)),
                                                  "lm_head.weight": ("BF16", (256, HIDDEN))}  # fmt: skip
    for layer in range(LAYERS):
        for proj, shape in SHAPES.items():
            part = "self_attn" if proj in ATTN else "mlp"
            t[f"model.layers.{layer}.{part}.{proj}.weight"] = ("BF16", shape)
    write_safetensors(os.path.join(folder, "model.safetensors"), t)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
              "num_hidden_layers": LAYERS, "vocab_size": 256, "torch_dtype": "bfloat16"}  # fmt: skip
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def write_fleet(root: str, n: int) -> list[str]:
    paths = []
    for i in range(n):
        r = (8, 16, 32, 64)[i % 4]
        targets = ATTN + (["gate_proj", "up_proj", "down_proj"] if i % 10 == 0 else [])
        t = {}
        for layer in range(LAYERS):
            for proj in targets:
                out, inp = SHAPES[proj]
                part = "self_attn" if proj in ATTN else "mlp"
                p = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                t[f"{p}.lora_A.weight"] = ("BF16", (r, inp))
                t[f"{p}.lora_B.weight"] = ("BF16", (out, r))
        folder = os.path.join(root, "fleet", f"a{i:05d}")
        write_peft_adapter(folder, t, r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=i % 4 == 1,
                           peft_type="LORA")  # fmt: skip
        paths.append(folder)
    return paths


def timed(passes: int, fn: object) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(passes):
        t0 = time.perf_counter()
        result = fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return times, result


def spread(times: list[float]) -> str:
    return f"median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f}, {len(times)} passes)"


# --before: one build's preflight of both commands in a fresh process (benches/_compare.py), each the best of
# `repeat` calls after a warm-up (as the passes above, in-process caches kept). 255a378 has no lorafast.preflight.
COMPARE_CODE = (
    CHILD_PRELUDE
    + r"""
fleet, commands, repeat = ARGS[0], json.loads(ARGS[1]), int(ARGS[2])
claims, missing = {}, {}
gone = missing_api("preflight")
for name, (command, version) in commands.items():
    if gone:
        missing[name] = gone
    else:
        claims[name] = best_of(lambda: lorafast.preflight(command, [fleet], engine_version=version), repeat)
child_result(claims, missing)
"""
)


def compare_builds(
    fleet: str, commands: dict[str, tuple[str, str]], args: argparse.Namespace, fixed: dict[str, float]
) -> None:
    """Both preflights, this build against the one in --before, alternated in fresh processes."""
    claims = {f"lorafast preflight, {e} {v}": (c, v) for e, (c, v) in commands.items()}
    child_args = [fleet, json.dumps(claims), 1]
    comp = compare(COMPARE_CODE, child_args, args.before, args.passes, label=f"\nagainst {args.before}: ")
    sglang = {c: list(fixed) for c in claims if ", sglang " in c}  # SGLang's load is the sglang run's baseline
    report(comp, claims, baselines=sglang, fixed=fixed, per=args.n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10000)
    parser.add_argument("--engine-n", type=int, default=500, help="adapters in SGLang's own load (0: skip it)")
    add_options(parser)
    parser.add_argument("--engine-version", default="0.5.23")
    parser.add_argument("--hidden", type=int, default=64, help="model width (tiny tensors favour the engine's load)")
    parser.add_argument("--keep", help="write the fleet here and keep it")
    args = parser.parse_args()
    set_hidden(args.hidden)
    build = getattr(lorafast._core, "build_profile", "?")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; lorafast._core build: {build}")
    root = args.keep or tempfile.mkdtemp(prefix="lorafast-bench-serving-")
    try:
        t0 = time.perf_counter()
        base = write_base(root)
        paths = write_fleet(root, args.n)
        print(f"wrote a base and {len(paths)} adapters in {time.perf_counter() - t0:.1f} s")
        fleet = os.path.join(root, "fleet")
        targets = " ".join(ATTN)
        commands = {
            "sglang": f"python -m sglang.launch_server --model-path {base} --enable-lora --max-lora-rank 32 "
            f"--lora-target-modules {targets}",
            "vllm": f"vllm serve {base} --enable-lora --max-lora-rank 32 --lora-target-modules {targets}",
        }
        results = {}
        versions = {"sglang": args.engine_version, "vllm": "0.34.0"}
        fixed: dict[str, float] = {}
        for engine, command in commands.items():
            version = versions[engine]
            times, report = timed(
                args.passes, lambda c=command, v=version: lorafast.preflight(c, [fleet], engine_version=v)
            )
            results[engine] = statistics.median(times)
            print(f"lorafast preflight, {engine} {version}: {spread(times)}; "
                  f"{statistics.median(times) / args.n * 1e6:.0f} us/adapter; {report.counts()}")  # fmt: skip
        if args.engine_n:
            import engines

            sub = paths[: args.engine_n]
            cfg = json.load(open(os.path.join(base, "config.json")))
            out = engines.run("sglang_load_bench_runner", "sglang", args.engine_version,
                              {"base": cfg, "paths": sub, "repeat": min(args.passes, 3)}, timeout=3600)  # fmt: skip
            engine_per = statistics.median(out["seconds"]) / len(sub)
            print(f"SGLang {args.engine_version} LoRAManager.init_state on {len(sub)} adapters: "
                  f"{spread(out['seconds'])}; {engine_per * 1e6:.0f} us/adapter")  # fmt: skip
            ours = results["sglang"] / args.n
            print(f"ratio per adapter, SGLang's load / lorafast preflight (sglang): {engine_per / ours:.1f}x")
            fixed[f"SGLang {args.engine_version} load (per adapter, x {args.n})"] = engine_per * args.n
        if args.before:
            compare_builds(fleet, {e: (c, versions[e]) for e, c in commands.items()}, args, fixed)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
