"""One name rule for `merge` and `check`: the same module path resolves to the same weight in both.

`merge` resolves adapter module paths onto weights with `naming.NameTable.match`, and `check` uses the
same function, so the two never disagree: a module the base has only below another prefix is `prefix_only` in
`check` (verdict `no_match`) and a `MergeError` code `prefix_only` in `merge`, unless `allow_prefix=True`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from lorafast.base import Weight, renamed_on_load
from lorafast.checker import check
from lorafast.naming import NameTable
from lorafast.testing import write_peft_adapter

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
from lorafast.merging import MergeError, merge, merge_file  # noqa: E402  (needs torch)

pytestmark = pytest.mark.slow

R = 2
N = 8


def _peft(folder: Path, modules: list[str], seed: int = 0) -> Path:
    """A PEFT adapter with one rank-2 (8x8) lora_A/lora_B pair per module path."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for m in modules:
        tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(R, N, generator=gen)
        tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(N, R, generator=gen)
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    return Path(write_peft_adapter(folder, tensors, r=R, lora_alpha=R, target_modules=targets))


def _base(path: Path, names: list[str]) -> Path:
    st.save_file({n: torch.zeros(N, N) for n in names}, str(path))
    return path


Q = "model.layers.0.self_attn.q_proj"
WQ = "model.language_model.layers.0.self_attn.q_proj"
#: (base weight names, adapter module path, the weight both must name, (adapter prefix, base prefix) or None: exact)
CASES: dict[str, tuple[list[str], str, str | None, tuple[str, str] | None]] = {
    "exact": ([f"{Q}.weight", "lm_head.weight"], Q, f"{Q}.weight", None),
    # transformers 5 saves a Llava-style wrapper as `language_model.model.layers.N…`: it ends with the path
    "wrapper_suffix": ([f"language_model.{Q}.weight"], Q, f"language_model.{Q}.weight", ("", "language_model")),
    # the loaded form of that wrapper: `model.language_model.layers.N…`, neither path ends with the other
    "wrapper_loaded": (["model.language_model.layers.0.self_attn.q_proj.weight"], Q,
                       "model.language_model.layers.0.self_attn.q_proj.weight", ("model", "model.language_model")),
    # a CausalLM adapter on the inner LlamaModel (`layers.N…`)
    "inner_model": (["layers.0.self_attn.q_proj.weight"], Q, "layers.0.self_attn.q_proj.weight", ("model", "")),
    "short_path": (["language_model.lm_head.weight"], "lm_head", "language_model.lm_head.weight",
                   ("", "language_model")),
    # two wrappers end with the path equally well: nothing to choose
    "ambiguous": ([f"a.{Q}.weight", f"b.{Q}.weight"], Q, None, ("", "")),
    # another layer is no match, below any prefix
    "absent": (["model.layers.1.self_attn.q_proj.weight"], Q, None, ("", "")),
    # the exact weight wins over a longer name that ends with the path
    "exact_beats_suffix": ([f"{Q}.weight", f"language_model.{Q}.weight"], Q, f"{Q}.weight", None),
    # an adapter made on the transformers-5 wrapper (`model.language_model.…`), on the wrapper's checkpoint file
    # saved as `language_model.model.…` with its config.json beside it: both look the name up as transformers 5
    # renames it on load (`base.renamed_on_load`), so it is exact; merge_file writes the stored tensor
    "wrapper_file_loaded_names": ([f"language_model.{Q}.weight"], WQ, f"{WQ}.weight", None),
    # the same file without its config: nothing says it is a wrapper, so only the stored names count
    "wrapper_file_no_config": ([f"language_model.{Q}.weight"], WQ, f"language_model.{Q}.weight",
                               ("model.language_model", "language_model.model")),
}  # fmt: skip
#: the cases whose base file has a Llava-style config.json beside it
LLAVA_CONFIG = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
                "text_config": {"model_type": "llama"}, "vision_config": {"model_type": "clip_vision_model"}}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {"wrapper_file_loaded_names": LLAVA_CONFIG}


def _said(prefix: str) -> str:
    return f"'{prefix}.'" if prefix else "no prefix"


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_and_merge_agree_on_names(case: str, tmp_path: Path) -> None:
    names, module, weight, prefixes = CASES[case]
    base = _base(tmp_path / "base.safetensors", names)
    adapter = _peft(tmp_path / "a", [module])
    out = tmp_path / "out.safetensors"
    config = CONFIGS.get(case)
    renamed: dict[str, str] = {}
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        renamed = renamed_on_load({n: Weight("F32", (N, N), str(base)) for n in names}, config)
        assert renamed  # the config makes a difference

    # the one rule both go by, on the names as stored and as loaded
    match = NameTable([*names, *renamed], hidden=set(renamed.values())).match(module, ".weight")
    r = next(iter(check(adapter, base)))
    mod = r.modules[0]
    if prefixes is None:
        assert match.weight == weight
        assert r.verdict == "ok" and mod.status == "ok" and mod.weight == weight
        summary = merge_file(base, adapter, out)
        assert summary["targets"] == 1 and summary["prefixes"] == []
        assert st.load_file(str(out))[renamed.get(weight, weight)].abs().sum() > 0  # the stored name
        return
    assert match.weight is None and match.prefixed == weight
    assert r.verdict == "no_match" and r.matched == 0
    with pytest.raises(MergeError) as err:
        merge_file(base, adapter, out)
    assert not out.exists()
    assert err.value.module == module
    if weight is None:  # check has nothing to hint at; merge refuses with or without allow_prefix
        assert mod.status == "missing" and mod.weight is None
        assert err.value.code == "missing_module"
        with pytest.raises(MergeError) as again:
            merge_file(base, adapter, out, allow_prefix=True)
        assert again.value.code == ("ambiguous_module" if case == "ambiguous" else "missing_module")
        assert (case == "ambiguous") == bool(match.ambiguous)
        return
    # a suffix-only match: check names it and the prefix; merge refuses naming the same, and takes it on request
    ours, theirs = prefixes
    assert (match.ours, match.theirs) == prefixes
    said = f"start with {_said(ours)} where the base has {_said(theirs)}"
    assert mod.status == "prefix_only" and mod.weight == weight and said in (mod.hint or "")
    assert err.value.code == "prefix_only" and repr(weight) in str(err.value) and said in str(err.value)
    summary = merge_file(base, adapter, out, allow_prefix=True)
    assert summary["targets"] == 1
    assert summary["prefixes"] == [{"adapter": "a", "adapter_prefix": ours, "base_prefix": theirs, "modules": 1}]
    assert st.load_file(str(out))[weight].abs().sum() > 0  # the delta went into the weight check named


# ---------------------------------------------------------------------------------------------------------------
# The case, with real models: a LlamaForCausalLM adapter on a Llava-style wrapper


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    cf = pytest.importorskip("helpers.check_fixtures")
    root = tmp_path_factory.mktemp("wrapper")
    torch.manual_seed(0)
    llama = cf.make_llama(root / "llama")
    adapter = cf.peft_adapter(llama, root / "a_llama", ["q_proj", "v_proj"])
    llava = cf.make_llava(root / "llava")
    sd = {k: v.detach().clone() for k, v in llava.state_dict().items()}
    return {"root": root, "adapter": adapter, "llava": root / "llava", "llama": llama, "llava_sd": sd}


def _expected_delta(adapter: Path, module: str) -> Any:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    t = st.load_file(str(adapter / "adapter_model.safetensors"))
    a = t[f"base_model.model.{module}.lora_A.weight"].float()
    b = t[f"base_model.model.{module}.lora_B.weight"].float()
    return (b @ a) * (cfg["lora_alpha"] / cfg["r"])


def test_causal_lm_adapter_on_wrapper_refused_unless_allow_prefix(wrapper: dict[str, Any]) -> None:
    adapter, sd = wrapper["adapter"], dict(wrapper["llava_sd"])
    r = next(iter(check(adapter, wrapper["llava"])))
    assert r.verdict == "no_match"
    with pytest.raises(MergeError) as err:
        merge(sd, [adapter])
    e = err.value
    assert e.code == "prefix_only" and e.module is not None and e.module.endswith("q_proj")
    assert "'model.' where the base has 'model.language_model.'" in str(e) and "allow_prefix=True" in str(e)
    # the same modules check reports as prefix_only are the ones merge refuses
    assert len(e.problems) == sum(m.status == "prefix_only" for m in r.modules) == 4
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    before = sd[q].clone()
    h = merge(sd, [adapter], allow_prefix=True)
    assert h.prefixes == [
        {"adapter": "a_llama", "adapter_prefix": "model", "base_prefix": "model.language_model", "modules": 4}
    ]
    assert all(t.name.startswith("model.language_model.layers.") for t in h.targets)
    delta = sd[q].float() - before.float()
    torch.testing.assert_close(delta, _expected_delta(adapter, "model.layers.0.self_attn.q_proj"), rtol=1e-4, atol=1e-5)
    h.unmerge()
    assert torch.equal(sd[q], before)


def test_merge_cli_allow_prefix_on_saved_wrapper(wrapper: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    """The wrapper as the issue names it (`language_model.model.layers.N…`), one file, through the CLI."""
    from lorafast.cli import main

    base = tmp_path / "wrapper.safetensors"
    st.save_file({f"language_model.{k}": v.contiguous() for k, v in wrapper["llama"].state_dict().items()}, str(base))
    adapter, out = wrapper["adapter"], tmp_path / "merged.safetensors"
    r = next(iter(check(adapter, base)))
    assert r.verdict == "no_match" and "where the base has 'language_model.'" in (r.hint or "")
    args = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)]
    assert main(args) == 1 and not out.exists()
    err = capsys.readouterr().err
    assert "--allow-prefix" in err and "where the base has 'language_model.'" in err
    assert main([*args, "--allow-prefix"]) == 0
    err = capsys.readouterr().err
    assert "'(none)' -> 'language_model'" in err
    merged = st.load_file(str(out))
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    delta = merged[q].float() - wrapper["llama"].state_dict()["model.layers.0.self_attn.q_proj.weight"].float()
    torch.testing.assert_close(delta, _expected_delta(adapter, "model.layers.0.self_attn.q_proj"), rtol=1e-4, atol=1e-5)
