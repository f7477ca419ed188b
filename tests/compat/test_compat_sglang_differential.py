"""Differential test: lorafast's header-only SGLang answers vs a reference that loads every tensor.

`RefLoRAAdapter` below is a test-only re-statement of what SGLang's `LoRAAdapter` does (sglang-lora.md §4):
read every tensor with safetensors (in `safe_open(...).keys()` order, as SGLang's loader does), route it by
name, then normalize each layer with real torch ops (cat, repeat, zeros_like). `ref_detect` is §7 on the
loaded tensors. Hypothesis generates hundreds of adapter sets (dense, numbered 2D, stacked 3D, shared-outer,
mixed inside one adapter, `.w1/.w3/.w2` names, fused gate_up_proj, and broken ones) and lorafast must give the
same weights, the same result, the same exception type and the same message.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import lorafast
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lorafast.compat import sglang as sg
from lorafast.testing import write_peft_adapter
from safetensors import safe_open

pytestmark = pytest.mark.fuzz

NUM_LAYERS = 4
H, INTER = 4, 3  # hidden and (expert) intermediate sizes: tiny, only shapes matter

# --- the reference: SGLang's loading, on real tensors -------------------------------------------------------


def ref_normalized_targets(target_modules: Any) -> set[str]:
    mapping = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj", "embed_tokens": "embed_tokens", "lm_head": "lm_head"}  # fmt: skip
    if isinstance(target_modules, str):
        if target_modules in ("all", "all-linear"):
            return {"all"}
        raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
    return {mapping.get(t.split(".")[-1], t.split(".")[-1]) for t in target_modules}


class RefLoRAAdapter:
    """What SGLang holds for one adapter after `initialize_weights()`, computed on loaded tensors."""

    def __init__(self, folder: Path) -> None:
        config = json.loads((folder / "adapter_config.json").read_text())
        self.target_modules = config["target_modules"]
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(NUM_LAYERS)]
        self.embedding_layers: dict[str, torch.Tensor] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    self.process_weight(name, handle.get_tensor(name))
        for layer in self.layers:
            self.normalize(layer)

    def process_weight(self, name: str, tensor: torch.Tensor) -> None:
        targets = ref_normalized_targets(self.target_modules)
        name = name.replace("unembed_tokens", "lm_head")
        match = re.search(r"layers\.(\d+)\.", name)
        if match:
            self.layers[int(match.group(1))][name] = tensor.cpu()
        elif "embed_tokens" in name or "lm_head" in name:
            module = "embed_tokens" if "embed_tokens" in name else "lm_head"
            if "all" in targets or module in targets:
                self.embedding_layers[name] = tensor

    @staticmethod
    def normalize(w: dict[str, torch.Tensor]) -> None:
        # 1. q/k/v -> qkv_proj (k may be absent: zeros like v); an already fused qkv lora_A is repeated x3.
        names = list(w)
        seen = {p for n in names for p in ("k_proj", "q_proj", "v_proj", "qkv_proj") if p in n}
        if seen:
            for n in names:
                if "q_proj" in n:
                    k, v, qkv = (n.replace("q_proj", p) for p in ("k_proj", "v_proj", "qkv_proj"))
                    k_tensor = w[k] if "k_proj" in seen else torch.zeros_like(w[v])
                    w[qkv] = torch.cat((w[n], k_tensor, w[v]), 0)
                    del w[n]
                    if "k_proj" in seen:
                        del w[k]
                    del w[v]
                elif "qkv_proj" in n and "lora_A" in n:
                    w[n] = w[n].repeat(3, 1)
        # 4. .w1./.w3./.w2. -> gate/up/down (anywhere in the name)
        renames = {}
        for n in list(w):
            for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
                if old in n:
                    renames[n] = n.replace(old, new)
                    break
        for old, new in renames.items():
            w[new] = w.pop(old)
        # 5. Mamba gate_proj + x_proj -> in_proj
        for n in list(w):
            x = n.replace("gate_proj", "x_proj")
            if "gate_proj" in n and x in w:
                w[n.replace("gate_proj", "in_proj")] = torch.cat((w[n], w[x]), w[n].dim() - 2)
                del w[n], w[x]
        # 7. gate + up -> gate_up_proj along the rank (A) / output (B) axis; fused lora_A repeated x2
        for n in list(w):
            if "gate_proj" in n:
                up = n.replace("gate_proj", "up_proj")
                if up not in w or w[up].numel() == 0:
                    w[up] = torch.zeros_like(w[n])
                w[n.replace("gate_proj", "gate_up_proj")] = torch.cat((w[n], w[up]), w[n].dim() - 2)
                del w[n], w[up]
            elif "gate_up_proj" in n and "lora_A" in n:
                reps = [1] * w[n].dim()
                reps[w[n].dim() - 2] = 2
                w[n] = w[n].repeat(*reps)

    def shapes(self) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
        return {i: [(n, tuple(t.shape)) for n, t in layer.items()] for i, layer in enumerate(self.layers) if layer}


def ref_detect(adapters: dict[str, RefLoRAAdapter], *, legacy: bool = False) -> bool:
    shared_outer = None
    for adapter_id, adapter in adapters.items():
        done = False
        for layer in adapter.layers:
            for name, weight in layer.items():
                if "gate_up_proj" not in name or "lora_A" not in name:
                    continue
                if weight.dim() == 3:
                    is_shared = weight.shape[0] == 1
                elif not legacy and re.search(r"(?:shared_)?experts\.\d+\.", name):
                    is_shared = False
                else:
                    continue
                if shared_outer is None:
                    shared_outer = is_shared
                elif shared_outer != is_shared:
                    raise RuntimeError(
                        "Mixed shared-outer LoRA formats detected across loaded adapters (conflict in adapter "
                        f"'{adapter_id}'). All MoE adapters must either all use shared outer experts (expert_dim=1) "
                        "or all use per-expert weights."
                    )
                if legacy:
                    done = True
                    break
            if done:
                break
    return bool(shared_outer) if shared_outer is not None else False


def ref_skipped(adapter: RefLoRAAdapter, targets: set[str]) -> list[str]:
    names = [n for layer in adapter.layers for n in layer] + list(adapter.embedding_layers)
    return sorted(n for n in names if not any(t in n for t in targets))


# --- adapter generators ------------------------------------------------------------------------------------

Tensors = dict[str, tuple[int, ...]]


@st.composite
def layer_block(draw: st.DrawFn, layer: int) -> Tensors:
    r = draw(st.sampled_from([1, 2]))
    e = draw(st.sampled_from([2, 3]))
    prefix = draw(st.sampled_from(["base_model.model.model.layers.", "model.layers."])) + f"{layer}."
    moe = prefix + draw(st.sampled_from(["mlp.experts.", "block_sparse_moe.experts.", "mlp.shared_experts."]))
    kind = draw(st.sampled_from(["dense", "numbered", "w123", "stacked", "fused3d", "shared", "shared_split",
                                 "fused2d", "attn", "broken"]))  # fmt: skip
    t: Tensors = {}
    if kind == "dense":
        t[prefix + "mlp.gate_proj.lora_A.weight"] = (r, H)
        t[prefix + "mlp.gate_proj.lora_B.weight"] = (INTER, r)
        if draw(st.booleans()):
            t[prefix + "mlp.up_proj.lora_A.weight"] = (r, H)
            t[prefix + "mlp.up_proj.lora_B.weight"] = (INTER, r)
        t[prefix + "mlp.down_proj.lora_A.weight"] = (r, INTER)
    elif kind in ("numbered", "w123"):
        names = ("w1", "w3", "w2") if kind == "w123" else ("gate_proj", "up_proj", "down_proj")
        for x in draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)):
            t[f"{moe}{x}.{names[0]}.lora_A.weight"] = (r, H)
            t[f"{moe}{x}.{names[0]}.lora_B.weight"] = (INTER, r)
            if draw(st.booleans()):
                t[f"{moe}{x}.{names[1]}.lora_A.weight"] = (r, H)
            t[f"{moe}{x}.{names[2]}.lora_B.weight"] = (H, r)
    elif kind == "stacked":
        t[moe + "gate_proj.lora_A.weight"] = (e, r, H)
        t[moe + "up_proj.lora_A.weight"] = (e, r, H)
        t[moe + "gate_proj.lora_B.weight"] = (e, INTER, r)
        t[moe + "up_proj.lora_B.weight"] = (e, INTER, r)
        t[moe + "down_proj.lora_A.weight"] = (e, r, INTER)
    elif kind in ("fused3d", "shared"):
        outer = 1 if kind == "shared" else e
        t[moe + "gate_up_proj.lora_A.weight"] = (outer, r, H)
        t[moe + "gate_up_proj.lora_B.weight"] = (e, 2 * INTER, r)
        t[moe + "down_proj.lora_A.weight"] = (e, r, INTER)
        t[moe + "down_proj.lora_B.weight"] = (outer, H, r)
    elif kind == "shared_split":
        t[moe + "w1.lora_A.weight"] = (1, r, H)
        t[moe + "w3.lora_A.weight"] = (1, r, H)
        t[moe + "w1.lora_B.weight"] = (e, INTER, r)
    elif kind == "fused2d":
        t[prefix + "mlp.gate_up_proj.lora_A.weight"] = (r, H)
        t[prefix + "mlp.gate_up_proj.lora_B.weight"] = (2 * INTER, r)
    elif kind == "attn":
        for p in draw(st.sampled_from([("q", "k", "v"), ("q", "v"), ("qkv",)])):
            t[prefix + f"self_attn.{p}_proj.lora_A.weight"] = (r, H)
            t[prefix + f"self_attn.{p}_proj.lora_B.weight"] = (H if p == "q" else 2, r)
    else:  # broken: SGLang raises while normalizing
        case = draw(st.sampled_from(["cat", "rank", "no_v", "qkv3d", "up_empty", "ndim"]))
        if case == "cat":
            t[moe + "gate_proj.lora_A.weight"] = (1, r, H)
            t[moe + "up_proj.lora_A.weight"] = (e, r, H)
        elif case == "rank":
            t[prefix + "mlp.gate_proj.lora_B.weight"] = (INTER, r)
            t[prefix + "mlp.up_proj.lora_B.weight"] = (INTER, r + 1)
        elif case == "no_v":
            t[prefix + "self_attn.q_proj.lora_A.weight"] = (r, H)
        elif case == "qkv3d":
            t[prefix + "self_attn.qkv_proj.lora_A.weight"] = (e, r, H)
        elif case == "up_empty":
            t[prefix + "mlp.gate_proj.lora_A.weight"] = (r, H)
            t[prefix + "mlp.up_proj.lora_A.weight"] = (0, H)
        else:
            t[moe + "gate_proj.lora_A.weight"] = (r, H)
            t[moe + "up_proj.lora_A.weight"] = (e, r, H)
    return t


@st.composite
def adapter_tensors(draw: st.DrawFn) -> Tensors:
    layers = draw(st.lists(st.integers(0, NUM_LAYERS - 1), min_size=1, max_size=3, unique=True))
    tensors: Tensors = {}
    for layer in layers:
        tensors.update(draw(layer_block(layer)))
    if draw(st.booleans()):
        tensors["base_model.model.lm_head.lora_A.weight"] = (2, H)
        tensors["base_model.model.model.norm.weight"] = (H,)  # no layer id, not an embedding: dropped
    order = draw(st.permutations(sorted(tensors)))  # file order differs from SGLang's (sorted) read order
    return {name: tensors[name] for name in order}


TARGETS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def write_zero_adapter(folder: Path, tensors: Tensors) -> str:
    """A PEFT folder of zero-filled F32 `tensors` (name -> shape), rank 2, alpha 4, on TARGETS."""
    specs = {name: ("F32", tuple(shape)) for name, shape in tensors.items()}
    return write_peft_adapter(folder, specs, r=2, lora_alpha=4, target_modules=TARGETS)


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc), str(exc))


# --- the tests -----------------------------------------------------------------------------------------------


@given(st.lists(adapter_tensors(), min_size=1, max_size=4))
def test_header_only_matches_loaded_reference(adapter_sets: list[Tensors]) -> None:
    base_config = {"num_hidden_layers": NUM_LAYERS}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f"a{i}": write_zero_adapter(Path(tmp) / f"a{i}", t) for i, t in enumerate(adapter_sets)}

        # Per adapter: the same weights after normalization (names, shapes, order), or the same error.
        refs: dict[str, RefLoRAAdapter] = {}
        for adapter_id, path in paths.items():
            ref = outcome(lambda p=path: RefLoRAAdapter(Path(p)))
            mine = outcome(lambda p=path: sg.predict_loaded_weights(p, base_config=base_config))
            # The same answer from a scanned Adapter (its module list) as from the path (its header).
            scanned = outcome(lambda p=path: sg.predict_loaded_weights(lorafast.inspect(p), base_config=base_config))
            assert scanned == mine or (scanned[0] == mine[0] == "ok" and scanned[1].layers == mine[1].layers)
            if ref[0] == "ok":
                assert mine[0] == "ok", mine
                refs[adapter_id] = ref[1]
                got = {i: list(layer.items()) for i, layer in mine[1].layers.items()}
                assert got == ref[1].shapes()
                assert list(mine[1].embedding) == list(ref[1].embedding_layers)
                targets = {"qkv_proj", "gate_up_proj"}
                assert sg.check_skipped_weights(path, targets) == ref_skipped(ref[1], targets)
            else:
                assert mine == ref

        # The set: the same detection result (current and legacy rule), the same exception and message.
        for legacy in (False, True):
            expected = outcome(lambda lg=legacy: ref_detect({k: RefLoRAAdapter(Path(p)) for k, p in paths.items()},
                                                          legacy=lg))  # fmt: skip
            got = outcome(lambda lg=legacy: sg.detect_shared_outer_loras(paths, legacy=lg, base_config=base_config))
            assert got == expected


@pytest.mark.parametrize(
    ("tensors", "expected"),
    [
        ({"model.layers.0.mlp.experts.gate_up_proj.lora_A.weight": (1, 8, 4)}, ("ok", True)),
        ({"model.layers.0.mlp.experts.0.gate_up_proj.lora_A.weight": (4, 4)}, ("ok", False)),
        (
            {
                "model.layers.0.mlp.experts.w1.lora_A.weight": (1, 2, 4),
                "model.layers.0.mlp.experts.w3.lora_A.weight": (1, 2, 4),
            },
            ("ok", True),
        ),
    ],
)
def test_reference_agrees_on_sglang_unit_cases(tmp_path: Path, tensors: Tensors, expected: tuple[Any, ...]) -> None:
    path = write_zero_adapter(tmp_path / "x", tensors)
    assert outcome(lambda: ref_detect({"x": RefLoRAAdapter(Path(path))})) == expected
    assert outcome(lambda: sg.detect_shared_outer_loras({"x": path})) == expected
