"""lorafast.merge against the reference implementations, on adapters those libraries made themselves:
PEFT `merge_and_unload` (tiny Llama with rsLoRA, rank_pattern, alpha_pattern, embeddings, lora_bias, DoRA and
several adapters at different strengths; tiny Mixtral with `target_parameters`; per-expert 2-D experts; GPT-2
Conv1D; conv 1x1 and 3x3) and diffusers `fuse_lora` (tiny UNet, linear and conv LoRA).

Everything is fp32 so that the comparison checks the math (scales, patterns, layouts) and not rounding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import lorafast
import pytest
import torch
from lorafast.merging import merge

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
LoraConfig = peft.LoraConfig
PeftModel = peft.PeftModel
get_peft_model = peft.get_peft_model
LoraLayer = peft.tuners.lora.LoraLayer

ATOL = 2e-5


def assert_same_weights(ours: torch.nn.Module, theirs: torch.nn.Module, changed_at_least: int) -> None:
    """Every parameter of `theirs` (PEFT-unloaded, original names) matches ours; count the ones that moved."""
    ours_p = dict(ours.named_parameters())
    theirs_p = dict(theirs.named_parameters())
    assert set(ours_p) == set(theirs_p)
    for name, p in theirs_p.items():
        assert torch.allclose(ours_p[name], p, atol=ATOL, rtol=1e-5), (name, (ours_p[name] - p).abs().max().item())
    assert changed_at_least > 0


def peft_reference(base: torch.nn.Module, adapters: list[tuple[str, Path, float]]) -> torch.nn.Module:
    """PEFT's merge of `adapters` (name, folder, strength) into a copy of `base`, in order."""
    model = copy.deepcopy(base)
    name0, path0, _ = adapters[0]
    pm = PeftModel.from_pretrained(model, str(path0), adapter_name=name0)
    for name, path, _ in adapters[1:]:
        pm.load_adapter(str(path), adapter_name=name)
    for module in pm.modules():
        if isinstance(module, LoraLayer):
            for name, _, strength in adapters:
                if name in module.scaling:
                    module.set_scale(name, strength)  # scaling = strength * alpha / r
    return pm.merge_and_unload(adapter_names=[a[0] for a in adapters])


def save_peft(base: torch.nn.Module, config: LoraConfig, folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(base), config)
    pm.save_pretrained(str(folder))
    return folder


def moved(before: torch.nn.Module, after: torch.nn.Module) -> int:
    b = dict(before.named_parameters())
    return sum(not torch.equal(b[n], p) for n, p in after.named_parameters())


# ---------------------------------------------------------------------------------------------------------------
# tiny Llama


#: The size of the reference tests' models: two layers, grouped-query attention, a 64-token vocabulary.
TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY, intermediate_size=48, attention_bias=True, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def llama_adapters(llama: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    configs = {
        "rs": LoraConfig(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=linear,
            init_lora_weights=False,
            rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 2},
            alpha_pattern={"v_proj": 3.0, "layers.0.mlp.up_proj": 24.0},
        ),
        "emb": LoraConfig(
            r=2, lora_alpha=16, target_modules=["q_proj", "v_proj", "embed_tokens"], init_lora_weights=False
        ),
        "bias": LoraConfig(
            r=3, lora_alpha=3, target_modules=["o_proj", "k_proj"], lora_bias=True, init_lora_weights=False
        ),
        "dora": LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], use_dora=True, init_lora_weights=False
        ),
    }
    out = {}
    for seed, (name, cfg) in enumerate(configs.items(), start=1):
        out[name] = save_peft(llama, cfg, root / name, seed)
        if name == "bias":  # PEFT initialises lora_B.bias to zero; give it values so the test means something
            from safetensors.torch import load_file, save_file

            f = out[name] / "adapter_model.safetensors"
            t = load_file(str(f))
            for k in t:
                if k.endswith("lora_B.bias"):
                    t[k] = torch.randn_like(t[k])
            save_file(t, str(f))
    return out


@pytest.mark.parametrize("name", ["rs", "emb", "bias", "dora"])
def test_single_peft_adapter_matches_merge_and_unload(llama, llama_adapters, name: str) -> None:
    ours = copy.deepcopy(llama)
    handle = merge(ours, [(llama_adapters[name], 1.0)])
    theirs = peft_reference(llama, [(name, llama_adapters[name], 1.0)])
    assert_same_weights(ours, theirs, moved(llama, ours))
    assert moved(llama, ours) == moved(llama, theirs) > 0
    handle.unmerge()
    assert moved(llama, ours) == 0


def test_several_peft_adapters_at_different_strengths(llama, llama_adapters) -> None:
    plan = [
        ("rs", llama_adapters["rs"], 0.7),
        ("emb", llama_adapters["emb"], -0.3),
        ("bias", llama_adapters["bias"], 1.5),
        ("dora", llama_adapters["dora"], 0.8),
    ]
    ours = copy.deepcopy(llama)
    handle = merge(ours, [(path, s) for _, path, s in plan])
    theirs = peft_reference(llama, plan)
    assert_same_weights(ours, theirs, moved(llama, ours))
    q = next(t for t in handle.targets if t.name == "model.layers.0.self_attn.q_proj.weight")
    assert [x.adapter for x in q.terms] == ["rs", "emb", "dora"]  # in request order; DoRA applied last, alone
    assert q.terms[0].coefficient == pytest.approx(0.7 * 8 / 8**0.5)  # rank_pattern q_proj: 8, rsLoRA


# ---------------------------------------------------------------------------------------------------------------
# MoE


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
def test_mixtral_target_parameters_matches_peft(tmp_path: Path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(**TINY, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    base = MixtralForCausalLM(cfg).float().eval()
    tp = ["experts.gate_up_proj", "experts.down_proj"]
    one = save_peft(
        base,
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=tp, init_lora_weights=False),
        tmp_path / "one",
        1,
    )
    two = save_peft(
        base,
        LoraConfig(
            r=3,
            lora_alpha=3,
            target_modules=[],
            target_parameters=tp,
            rank_pattern={"gate_up_proj": 2},
            alpha_pattern={"down_proj": 9},
            init_lora_weights=False,
        ),
        tmp_path / "two",
        2,
    )
    for adapters in ([("one", one, 1.0)], [("one", one, 0.6), ("two", two, -1.2)]):
        ours = copy.deepcopy(base)
        handle = merge(ours, [(p, s) for _, p, s in adapters])
        theirs = peft_reference(base, adapters)
        assert_same_weights(ours, theirs, moved(base, ours))
        forms = {t.name.rsplit(".", 1)[-1]: t.terms[0].form for t in handle.targets}
        assert forms["gate_up_proj"] == forms["down_proj"] == "tp"
        assert moved(base, ours) == moved(base, theirs) == 6  # q_proj, gate_up_proj, down_proj x 2 layers


class _Expert(torch.nn.Module):
    def __init__(self, h: int, im: int) -> None:
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(h, im, bias=False), torch.nn.Linear(h, im, bias=False)
        self.w2 = torch.nn.Linear(im, h, bias=False)


class _V4Moe(torch.nn.Module):
    """transformers 4.x Mixtral naming: model.layers.N.block_sparse_moe.experts.E.w1/w2/w3."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.block_sparse_moe = torch.nn.Module()
        layer.block_sparse_moe.experts = torch.nn.ModuleList([_Expert(16, 24) for _ in range(3)])
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])


def test_per_expert_2d_matches_peft(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = _V4Moe()
    path = save_peft(
        base,
        LoraConfig(r=2, lora_alpha=6, target_modules=["w1", "w2", "w3"], init_lora_weights=False),
        tmp_path / "e",
        3,
    )
    ours = copy.deepcopy(base)
    handle = merge(ours, [(path, 0.5)])
    theirs = peft_reference(base, [("e", path, 0.5)])
    assert_same_weights(ours, theirs, moved(base, ours))
    assert moved(base, ours) == 9
    assert {m.kind for s in handle.sources for m in s.adapter.modules} == {"expert_2d"}


# ---------------------------------------------------------------------------------------------------------------
# fan_in_fan_out and convolutions


def test_gpt2_conv1d_fan_in_fan_out_matches_peft(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)).float().eval()
    path = save_peft(
        base,
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, init_lora_weights=False
        ),
        tmp_path / "g",
        4,
    )
    ours = copy.deepcopy(base)
    merge(ours, [(path, 1.3)])
    theirs = peft_reference(base, [("g", path, 1.3)])
    assert_same_weights(ours, theirs, moved(base, ours))


class _Convs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = torch.nn.Conv2d(8, 12, 1)
        self.conv1 = torch.nn.Conv2d(12, 12, 3, padding=1)


def test_conv_1x1_and_3x3_match_peft(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = _Convs()
    path = save_peft(
        base,
        LoraConfig(r=4, lora_alpha=2, target_modules=["proj_in", "conv1"], init_lora_weights=False),
        tmp_path / "c",
        5,
    )
    ours = copy.deepcopy(base)
    merge(ours, [(path, 0.9)])
    theirs = peft_reference(base, [("c", path, 0.9)])
    assert_same_weights(ours, theirs, moved(base, ours))
    assert moved(base, ours) == 2


# ---------------------------------------------------------------------------------------------------------------
# diffusers


def test_diffusers_fuse_lora_on_a_tiny_unet(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft.utils import get_peft_model_state_dict

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return (
            UNet2DConditionModel(
                sample_size=8,
                in_channels=4,
                out_channels=4,
                layers_per_block=1,
                block_out_channels=(8, 16),
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                cross_attention_dim=8,
                norm_num_groups=4,
                attention_head_dim=2,
            )
            .float()
            .eval()
        )

    trained = make()
    torch.manual_seed(6)
    cfg = LoraConfig(
        r=2,
        lora_alpha=5,
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1"],
        init_lora_weights=False,
    )
    trained.add_adapter(cfg)
    layers = get_peft_model_state_dict(trained)
    StableDiffusionPipeline.save_lora_weights(
        tmp_path / "unet_lora", unet_lora_layers=layers, unet_lora_adapter_metadata=cfg.to_dict()
    )
    path = tmp_path / "unet_lora" / "pytorch_lora_weights.safetensors"

    # the pipeline-level reader returns the lora_adapter_metadata (lora_alpha=5); the model-level loader alone
    # would fall back to alpha = rank
    state, alphas, metadata = StableDiffusionPipeline.lora_state_dict(str(path), return_lora_metadata=True)
    assert metadata["unet.lora_alpha"] == 5
    theirs = make()
    StableDiffusionPipeline.load_lora_into_unet(state, alphas, theirs, adapter_name="x", metadata=metadata)
    theirs.fuse_lora(lora_scale=0.7)
    theirs.unload_lora()

    base = make()
    ours = make()
    handle = merge(ours, [(path, 0.7)])
    assert_same_weights(ours, theirs, moved(base, ours))
    assert moved(base, ours) == moved(base, theirs) == len(handle.targets) > 10
    assert {t.terms[0].form for t in handle.targets} == {"BA"}
    assert lorafast.inspect(str(path)).modules[0].scale == pytest.approx(5 / 2)
