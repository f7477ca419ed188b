"""`lorafast.plan` against SGLang's own `LoRAPipeline.set_lora`, per released version.

The wheel's `set_lora` runs to the end in a child interpreter (tests/oracle/sglang_plan_runner.py), with its
config-match skip rule, 0.5.23's quantized-layer rule and auto-merge rounding-loss rule (`merge_rounding_norms`
on real base weights), over sequences of calls on one pipeline. `lorafast.plan` plans the same calls from the
same files, each against the previous plan's `next_state`, with the base weights given as `base_weights=`.
After every call the outcome must agree: the exception type and exact text, or the merged state per component,
the applied configuration, the loaded paths and alphas, which components the call applied to (the skip rule),
and the rounding loss per component. A missing wheel fails (run `make engines`); it never skips.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafast.planner import PipelineState, plan_set_lora
from lorafast.testing import write_peft_adapter
from safetensors.torch import save_file

from oracle import engines

VERSIONS = engines.PINNED["sglang"]
LAYERS = ("blocks.0.attn.to_q", "blocks.0.attn.to_k", "blocks.1.ff.proj")
SHAPE = (24, 16)  # out, in
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8}


def write_base(path: Path, dtype: str, gen: torch.Generator) -> str:
    weights = {}
    for name in LAYERS:
        w = torch.randn(SHAPE, generator=gen)
        weights[name + ".weight"] = (w * 40).to(torch.int8) if dtype == "int8" else w.to(DTYPES[dtype])
    save_file(weights, str(path))
    return str(path)


def write_random_adapter(folder: Path, rng: random.Random, gen: torch.Generator, scale: float) -> str:
    """A PEFT-style adapter in the standard format: `X.lora_A/B.weight` on some layers, a config with r and
    lora_alpha, sometimes per-layer `.alpha` tensors. The update's size decides the rounding loss: tiny updates
    round away in 16-bit weights, large ones do not."""
    rank = rng.choice([2, 4, 8])
    layers = [n for n in LAYERS if rng.random() < 0.8] or [LAYERS[0]]
    tensors = {}
    for name in layers:
        tensors[f"{name}.lora_A.weight"] = torch.randn(rank, SHAPE[1], generator=gen) * scale
        tensors[f"{name}.lora_B.weight"] = torch.randn(SHAPE[0], rank, generator=gen)
        if rng.random() < 0.15:
            tensors[f"{name}.alpha"] = torch.tensor(float(rng.choice([1, rank, 4 * rank])))
    write_peft_adapter(folder, tensors, r=rank, lora_alpha=rng.choice([rank, 2 * rank, 1]), target_modules=[])
    return str(folder / "adapter_model.safetensors")


def one_call(rng: random.Random, adapters: dict[str, list[str]], modules: list[str]) -> dict[str, Any]:
    n = rng.choice([1, 1, 1, 2, 3])
    nicks = rng.sample(sorted(adapters), n)
    paths = [rng.choice(adapters[k]) if rng.random() < 0.8 else None for k in nicks]
    targets = ["all", "transformer", "transformer_2", "critic"]
    target: Any = rng.choice(targets) if rng.random() < 0.8 else [rng.choice(targets) for _ in nicks]
    if rng.random() < 0.02:
        target = "text_encoder"
    strength: Any = rng.choice([1.0, 0.5, 2.0]) if rng.random() < 0.8 else [rng.choice([1.0, 0.7]) for _ in nicks]
    alpha: Any = None if rng.random() < 0.7 else rng.choice([4, 16, [4] * n])
    mode = rng.choice([None, None, "auto", "auto", "merge", "dynamic", "bogus" if rng.random() < 0.1 else None])
    weights = rng.choice([None, None, None, True, False])
    return {
        "nickname": nicks[0] if n == 1 and rng.random() < 0.7 else nicks,
        "path": paths[0] if n == 1 and isinstance(nicks, list) and rng.random() < 0.5 else paths,
        "target": target, "strength": strength, "merge_weights": weights, "merge_mode": mode, "lora_alpha": alpha,
    }  # fmt: skip


def scenarios(root: Path, count: int = 250) -> list[dict[str, Any]]:
    rng = random.Random(1123)
    gen = torch.Generator().manual_seed(1123)
    scales = iter([1e-5, 1e-2, 1.0, 1e-4, 3e-3, 0.1])  # from all of the update rounded away to almost none
    adapters = {k: [write_random_adapter(root / f"{k}{i}", rng, gen, next(scales)) for i in range(2)] for k in "abc"}
    out = []
    for s in range(count):
        names = ["transformer"] + [m for m in ("transformer_2", "critic") if rng.random() < 0.35]
        modules = {}
        for m in names:
            dtype = rng.choice(["bf16", "bf16", "fp16", "fp32", "int8"])
            modules[m] = {"file": write_base(root / f"base{s}-{m}.safetensors", dtype, gen), "dtype": dtype,
                          "dtensor": rng.random() < 0.1}  # fmt: skip
        calls = [one_call(rng, adapters, names) for _ in range(rng.choice([1, 2, 3, 4]))]
        if rng.random() < 0.5:
            calls.append(dict(calls[-1]))  # the same call again: the skip rule, the loss cache, reactivation
        if calls[0]["path"] is None or (isinstance(calls[0]["path"], list) and None in calls[0]["path"]):
            nick = calls[0]["nickname"]
            calls[0]["path"] = adapters[nick][0] if isinstance(nick, str) else [adapters[k][0] for k in nick]
        out.append({"id": f"s{s}", "server_mode": rng.choice(["auto", "auto", "merge", "dynamic"]),
                    "modules": modules, "calls": calls})  # fmt: skip
    return out


def lorafast_outcomes(scenario: dict[str, Any], version: str) -> list[dict[str, Any]]:
    mods = scenario["modules"]
    state = PipelineState(modules=tuple(mods), server_merge_mode=scenario["server_mode"])
    options = {
        "weights_sharded": {m: bool(spec["dtensor"]) for m, spec in mods.items()},
        "quantized": {m: spec["dtype"] == "int8" for m, spec in mods.items()},
        "base_weights": {m: spec["file"] for m, spec in mods.items()},
        "engine_version": version,
    }
    out: list[dict[str, Any]] = []
    for a in scenario["calls"]:
        try:
            p = plan_set_lora(a["nickname"], a["path"], a["target"], a["strength"], a["merge_weights"],
                              a["merge_mode"], a["lora_alpha"], current=state, **options)  # fmt: skip
        except Exception as exc:  # compared with the engine's exception type and text
            out.append({"err": [type(exc).__name__, str(exc)]})
            continue
        state = p.next_state
        losses: dict[str, float | None] = {}
        for t in p.targets:
            losses.update(t.rounding_loss)
        assert not p.undecided, "every base weight was given: nothing may stay undecided"
        out.append({"ok": {
            "merged": dict(state.merged),
            "config": {m: [list(n), list(s)] for m, (n, s) in state.applied.items()},
            "paths": dict(state.loaded_paths),
            "alphas": dict(state.loaded_alphas),
            "touched": sorted({m for t in p.targets for m, act in t.module_actions.items() if act.value != "skip"}),
            "losses": losses,
        }})  # fmt: skip
    return out


def until_first_error(outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A call that raises leaves SGLang's pipeline with what it loaded before the error, and `plan()` raises
    without a next state: a scenario is compared up to and including its first error."""
    for i, o in enumerate(outcomes):
        if "err" in o:
            return outcomes[: i + 1]
    return outcomes


@pytest.mark.parametrize("version", VERSIONS)
def test_plan_agrees_with_sglang_set_lora(version: str, tmp_path: Path) -> None:
    cases = scenarios(tmp_path)
    engine = engines.run("sglang_plan_runner", "sglang", version, cases)
    compared = errors = rounding = kept_dynamic = skipped = quantized_errors = quantized_dynamic = 0
    diffs = []
    for case in cases:
        theirs = until_first_error(engine[case["id"]])
        mine = until_first_error(lorafast_outcomes(case, version))
        for i, (t, m) in enumerate(zip(theirs, mine, strict=False)):
            compared += 1
            if t != m:
                diffs.append((case["id"], i, case["calls"][i], t, m))
            elif "err" in t:
                errors += 1
                quantized_errors += "quantized weights cannot be updated in place" in t["err"][1]
            else:
                quantized_dynamic += sum(
                    1 for mod, merged in t["ok"]["merged"].items()
                    if case["modules"][mod]["dtype"] == "int8" and not merged
                )  # fmt: skip
                rounding += len(t["ok"]["losses"])
                kept_dynamic += sum(1 for v in t["ok"]["losses"].values() if v is not None and v > 0.5)
                skipped += len(t["ok"]["touched"]) == 0
        if len(theirs) != len(mine):
            diffs.append((case["id"], "length", len(theirs), len(mine)))
    assert not diffs, f"{len(diffs)} of {compared} calls disagree; first: {diffs[:3]}"
    # the generated calls reach every rule: errors, rounding-loss measurements on both sides of the threshold, skips
    counts = (errors, quantized_errors, quantized_dynamic, rounding, kept_dynamic, skipped)
    assert errors > 10 and quantized_errors and quantized_dynamic and skipped > 3, counts
    assert rounding > 50 and 10 < kept_dynamic < rounding - 10, counts
    print(f"sglang {version}: {compared} set_lora calls agree ({errors} errors, {quantized_errors} of them on "
          f"quantized layers; {rounding} rounding-loss measurements, {kept_dynamic} kept dynamic; {skipped} calls "
          "applied nothing)")  # fmt: skip


if __name__ == "__main__":  # debugging aid: list the disagreements by kind
    import collections
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp())
    cases = scenarios(root)
    engine = engines.run("sglang_plan_runner", "sglang", VERSIONS[0], cases)
    kinds: collections.Counter = collections.Counter()
    for case in cases:
        theirs = until_first_error(engine[case["id"]])
        mine = until_first_error(lorafast_outcomes(case, VERSIONS[0]))
        for i, (t, m) in enumerate(zip(theirs, mine, strict=False)):
            if t == m:
                continue
            if "err" in t or "err" in m:
                kind = ("err", str(t.get("err", "ok"))[:90], str(m.get("err", "ok"))[:90])
            else:
                kind = tuple(k for k in t["ok"] if t["ok"][k] != m["ok"][k])
            if kinds[kind] == 0 and "-v" in sys.argv:
                print(kind, case["id"], i, case["modules"], case["calls"][: i + 1], t, m, sep="\n  ")
            kinds[kind] += 1
    for kind, n in kinds.most_common():
        print(n, kind)
