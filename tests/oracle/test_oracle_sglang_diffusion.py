"""lorafast.compat.diffusion against SGLang's own diffusion LoRA code, per released version.

The wheel's `pipelines_core/lora/` modules run unmodified in a child interpreter (tests/oracle/
sglang_diffusion_runner.py) on every case of tests/oracle/cases_diffusion.py; compat answers the same cases
from headers. Each stage's outcome must agree: the return value, or the exception type and exact message.
A missing wheel fails (run `make engines`); it never skips.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lorafast.compat import diffusion as df

from oracle import cases_diffusion, engines

VERSIONS = engines.PINNED["sglang"]


def outcome(fn, *args, **kwargs) -> dict:
    try:
        return {"ok": json.loads(json.dumps(fn(*args, **kwargs)))}
    except Exception as exc:  # compared with the engine's exception type and text
        return {"err": [type(exc).__name__, str(exc)]}


def describe(tensors: dict[str, df.Tensor]) -> dict:
    alphas = {}
    for name, t in tensors.items():
        if name.endswith(".alpha") and math.prod(t.shape) == 1:
            value = float(t.value)
            alphas[name] = value if math.isfinite(value) else str(value)
    return {"keys": list(tensors), "shapes": [list(t.shape) for t in tensors.values()], "alphas": alphas}


def state_of(spec: list) -> dict[str, df.Tensor]:
    """The runner's tensors as compat takes them: shapes, `.alpha` values, and the (zero) arrays themselves."""
    out = {}
    for name, shape, value in spec:
        scalar = value if math.prod(shape) == 1 else None
        out[name] = df.Tensor(tuple(shape), scalar, np.full(shape, value or 0.0))
    return out


def compat_file(case: dict, v: str) -> dict:
    path = case["path"]
    res: dict[str, Any] = {"load_file": outcome(lambda: list(df.read_file(path)[0]))}
    res.update(compat_state(df.read_file(path)[0], None, v))
    res["load_peft_config"] = outcome(df.load_peft_config, path, engine_version=v)
    if "ok" in res["load_peft_config"]:
        config = df.load_peft_config(path, engine_version=v)
        res["normalize"] = outcome(lambda: describe(df.normalize_lora_state_dict(path, config, engine_version=v)))
        if case.get("lora_alpha") is not None:
            res["alpha"] = {"ok": case["lora_alpha"]}
        else:
            res["alpha"] = outcome(df.get_peft_lora_alpha, config, engine_version=v)
    return res


def compat_state(state: dict, config: dict | None, v: str) -> dict:
    res = {"detect_raw": outcome(lambda: df.detect_lora_format(state, engine_version=v).value)}
    res["normalize_peft_keys"] = outcome(lambda: list(df.normalize_peft_keys(state, engine_version=v)))
    if "ok" in res["normalize_peft_keys"]:
        normal = df.normalize_peft_keys(state, engine_version=v)
        res["detect"] = outcome(lambda: df.detect_lora_format(normal, engine_version=v).value)
    if config is not None:
        res["normalize"] = outcome(lambda: describe(df.normalize_lora_state_dict(state, config, engine_version=v)))
    return res


def compat(case: dict, v: str) -> dict:
    kind = case["kind"]
    if kind == "file":
        return compat_file(case, v)
    if kind == "state":
        return compat_state(state_of(case["tensors"]), case.get("config", {}), v)
    if kind == "set_lora":
        a, mods = case["args"], case["modules"]
        return {"set_lora": outcome(lambda: df.check_set_lora(
            a["nickname"], a["path"], a["target"], a["strength"], a["merge_weights"], a["merge_mode"], a["lora_alpha"],
            server_mode=case["server_mode"], loaded=case["loaded"], modules=[m for m, layer in mods.items() if layer],
            fsdp_sharded=[m for m, (d, _) in mods.items() if d], quantized=[m for m, (_, c) in mods.items() if not c],
            engine_version=v)._asdict())}  # fmt: skip
    if kind == "constants":
        return {"valid_targets": {"ok": df.VALID_TARGETS}}
    if kind == "alpha":
        return {"alpha": outcome(df.get_peft_lora_alpha, case["config"], engine_version=v)}
    if kind == "params":
        a = case["args"]
        return {"params": outcome(lambda: list(df.normalize_lora_params(
            a["nickname"], a["path"], a["strength"], a["target"], a["lora_alpha"], engine_version=v)))}  # fmt: skip
    if kind == "merge_mode":
        return {"merge_mode": outcome(df.resolve_lora_merge_mode, case["merge_weights"], case["merge_mode"],
                                      case["server_mode"], engine_version=v)}  # fmt: skip
    if kind == "should_merge":
        layers = case["layers"]
        return {"should_merge": outcome(df.should_merge_lora, case["merge_mode"], module_name=case["module"],
                                        fsdp_sharded=any(d for d, _ in layers),
                                        quantized=any(not c for _, c in layers), engine_version=v)}  # fmt: skip
    raise ValueError(kind)


def load_composite(engine: dict) -> dict:
    """The outcome of `load_lora_adapter` (before the model's name mapping): the first failing stage, else all."""
    for stage in ("load_file", "load_peft_config", "normalize", "alpha"):
        if "err" in engine[stage]:
            return engine[stage]
    return {"ok": [engine["detect"]["ok"], engine["normalize"]["ok"], engine["alpha"]["ok"]]}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return cases_diffusion.build(Path(tmp_path_factory.mktemp("diffusion_cases")))


@pytest.mark.parametrize("version", VERSIONS)
def test_compat_diffusion_agrees_with_sglang(version: str, cases: list[dict]) -> None:
    engine = engines.run("sglang_diffusion_runner", "sglang", version, cases)
    stages = outcomes = 0
    errors = 0
    disagreements: list[str] = []
    for case in cases:
        ours = compat(case, version)
        theirs = engine[case["id"]]
        if case["kind"] == "file" and "normalize" in theirs and "load_peft_config" in theirs:
            theirs["load"] = load_composite(theirs)
            ours["load"] = outcome(lambda c=case: _loaded(c, version))
        assert set(ours) == set(theirs), (case["id"], sorted(ours), sorted(theirs))
        for stage, expected in theirs.items():
            stages += 1
            errors += "err" in expected
            if ours[stage] != expected:
                disagreements.append(f"{case['id']} [{stage}]\n  sglang: {expected}\n  compat: {ours[stage]}")
        outcomes += 1
    agreed = stages - len(disagreements)
    assert len(cases) >= 500
    assert not disagreements, (
        f"sglang=={version} diffusion: {agreed}/{stages} stage outcomes agree over {outcomes} cases "
        f"({errors} engine errors); {len(disagreements)} disagree:\n" + "\n".join(disagreements[:40])
    )


def _loaded(case: dict, version: str) -> list:
    loaded = df.load_lora_adapter(case["path"], case.get("lora_alpha"), engine_version=version)
    return [loaded.format.value, describe(loaded.tensors), loaded.lora_alpha]


def test_missing_wheel_fails_not_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "CACHE", tmp_path)
    with pytest.raises(engines.MissingWheel, match="make engines"):
        engines.run("sglang_diffusion_runner", "sglang", "0.0.0", [])


def answers(adapter: Any, path: str) -> list[dict]:
    return [
        outcome(lambda: df.detect_lora_format(adapter).value),
        outcome(lambda: list(df.normalize_peft_keys(adapter))),
        outcome(lambda: describe(df.check_peft_config(adapter, df.load_peft_config(path)))),
    ]


def test_input_forms_agree_with_paths(cases: list[dict]) -> None:
    """A scanned Adapter and an AdapterView of a file get the answers its path gets (the path's are proven above)."""
    import lorafast
    from lorafast.compat import AdapterView

    files = [c for c in cases if c["kind"] == "file"][::10]
    for case in files:
        path = case["path"]
        expected = answers(path, path)
        for form in (lorafast.inspect(path), AdapterView.from_path(path)):
            assert answers(form, path) == expected, (case["id"], type(form).__name__)
    assert len(files) > 50
