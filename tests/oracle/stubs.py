"""Every stub the oracle runners install, in one place, each with why.

The engines' LoRA logic runs unmodified. What is replaced here is only what needs a GPU, a process group,
compiled kernels, or parts of the engine that the LoRA code imports but the tested paths never call.
Each engine has one section; a runner calls exactly one `install_*` function before importing the engine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# --- vLLM ------------------------------------------------------------------------------------------------
# What runs for real (tests/oracle/vllm_runner.py): `vllm.lora.peft_helper`, `lora_model`, `lora_weights`,
# `utils` (`parse_fine_tuned_lora_name`, `get_adapter_absolute_path`), `worker_manager`
# (`WorkerLoRAManager._load_adapter`), the manager's `_validate_moe_lora_format` and
# `_validate_classification_head_lora` (0.33), `WeightsMapper`, `vllm.exceptions`, `vllm.logger`, `vllm.envs`,
# `vllm.platforms`, `vllm.utils.torch_utils`, with real torch and safetensors on CPU.
# Stubs, each with why:
#
# 1. `VLLM_INERT_MODULES`: modules the LoRA files import whose import needs CUDA kernels, process groups, zmq,
#    cbor2, msgspec or cachetools, or pulls in the whole model zoo (`vllm.distributed.parallel_state` is asked
#    only by `logger.info_once` whether this is the first rank: an inert instance is truthy, so it logs). The tested paths never call into them; they
#    only import names (layer classes for isinstance checks, decorators). Each becomes a module whose every
#    attribute is an inert class; a package keeps its real `__path__`, so real submodules (such as
#    `vllm.model_executor.models.utils`, home of `WeightsMapper`) still load from the wheel.
# 2. `LoRAConfig` (pydantic, validated against the platform and kernel config): `validate_legal` and
#    `_load_adapter` read only `max_lora_rank` and `lora_dtype`, so a plain object carries those two.
# 3. `LoRARequest` (a msgspec struct): a plain object with `lora_name`, `lora_int_id`, `lora_path` and
#    `is_3d_lora_weight`.
# 4. The worker and its adapter manager: `create_lora_manager` needs a model built on a GPU. The runner calls
#    the real `WorkerLoRAManager._load_adapter` on an object holding what `__init__` and the manager set:
#    `supported_lora_modules`, `packed_modules_mapping` (built as `process_packed_modules_mapping` does for
#    the model family), the model's `hf_to_vllm_mapper` (a real `WeightsMapper`), vocab size, max positions,
#    `moe_ep_load_spec=None`, and the manager's own validation methods, unbound from the real class. The
#    manager's `modules` hold inert `FusedMoEWithLoRA` instances at the MoE layers (2-D wrappers), and its
#    classification head is an inert `ClassificationHeadWithLoRA` with `max_lora_cls_labels`/`input_size`.
#    0.34's `unsupported_lora_modules` (set by `_create_lora_modules` from the model's unwrapped layers whose
#    leaf is a LoRA module) is given by the case's setup.
# 5. `LoRAModel.from_lora_tensors`, in the runner's "unexpected" op only (restored after it): returns None, so
#    that `from_local_checkpoint` runs its file choice, name check and file read and stops there; that step is
#    what `compat.vllm.check_unexpected_modules` answers. The "load" op runs the real one.
VLLM_INERT_MODULES = (
    "vllm.config", "vllm.config.lora", "vllm.utils.hashing", "vllm.utils.cache", "vllm.lora.request",
    "vllm.lora.layers", "vllm.lora.punica_wrapper", "vllm.model_executor", "vllm.model_executor.custom_op",
    "vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe", "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding", "vllm.model_executor.layers.pooler",
    "vllm.model_executor.layers.pooler.tokwise", "vllm.model_executor.utils", "vllm.transformers_utils.repo_utils",
    "vllm.distributed", "vllm.distributed.parallel_state", "vllm.model_executor.model_loader", "vllm.model_executor.model_loader.reload",
    "vllm.model_executor.model_loader.weight_utils", "vllm.model_executor.models",
    "vllm.model_executor.models.interfaces", "vllm.multimodal", "vllm.multimodal.encoder_budget", "vllm.sequence",
)  # fmt: skip


class _InertModule(types.ModuleType):
    """A module whose every public attribute is an inert class (usable in isinstance, as a base, a decorator
    or a generic alias), created on first access."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"__module__": self.__name__, "__init__": _accept_anything,
                              "__class_getitem__": classmethod(lambda c, _item: c)})  # fmt: skip
        setattr(self, name, cls)
        return cls


def _engine_import_to_stub(me: object, name: str, path: object, target: object, engine: str, root: str) -> bool:
    """Whether a finder stubs `name`: not the engine's own package or the standard library, found by no other
    finder on sys.meta_path, and imported by one of the engine's own files (under `root`)."""
    top = name.split(".")[0]
    if top == engine or top in sys.stdlib_module_names:
        return False
    for finder in sys.meta_path:
        if finder is me:
            continue
        try:
            if finder.find_spec(name, path, target) is not None:  # type: ignore[attr-defined]
                return False
        except Exception:  # a broken finder is not our concern
            pass
    frame = sys._getframe(2)  # the caller of find_spec, past the import machinery
    while frame and (frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(root)


def _accept_anything(self: object, *args: object, **kwargs: object) -> None:
    pass


class _InertFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = frozenset(names)

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.names:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)  # type: ignore[arg-type]
        locations = None if real is None else real.submodule_search_locations
        spec = importlib.machinery.ModuleSpec(name, self, is_package=locations is not None)
        if locations is not None:
            spec.submodule_search_locations = list(locations)
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _InertModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_vllm() -> None:
    """Stub 1 (the inert modules); stubs 2-4 are plain objects built by the runner."""
    sys.meta_path.insert(0, _InertFinder(VLLM_INERT_MODULES))


# --- SGLang (LLM: config, adapter, manager, memory pool, loader) -----------------------------------------
# What runs for real (tests/oracle/sglang_runner.py): `lora_config`, `lora`, `lora_manager`, `mem_pool`, `utils`,
# `layers` (the wrappers' slice methods), `DefaultModelLoader`, `LoadConfig`, `LoRARef`, transformers' configs.
# Stubs, each with why:
#
# 1. Third-party modules the engine imports but the LoRA paths never call (zmq, starlette, flashinfer, sgl_kernel,
#    triton_kernels, IPython, ...): when, and only when, an import made from the engine's own files finds no
#    such module, it gets a module whose every attribute is an inert class. `dill.dumps` returns b"" (a config
#    module serializes a logit processor at import time). Real `msgspec` and `pybase64` are needed (server
#    args are msgspec structs): `make engines` installs them into .cache/engines/sglang-deps.
# 2. `sglang.kernels` (JIT CUDA kernels; its import looks for compiled sources) and `sglang.srt.entrypoints`
#    (the HTTP API; pydantic models over openai types) are replaced by inert modules.
# 3. `sglang/__init__.py` (imports the whole runtime front end) is not run: `sglang` is a bare package.
# 4. `LoRAManager.__init__` needs a GPU backend and published parallel state: the manager is built with
#    `__new__` and given the attributes `__init__` sets (CPU device, no attention DP, lru eviction, the
#    experts-shared-outer override and strict-loading flags). `init_state` then runs unmodified except
#    `lora_backend.validate_lora_targets` (kernel backend) and `_validate_replicated_q_targets` (decode
#    context parallel; off at TP 1), which are no-ops, and `update_lora_info` (hands buffers to kernels).
# 5. Process-group topology: `mem_pool.get_parallel()` answers TP 1 / EP 1 / PP last rank.
# 6. Base-model layers (`QKVParallelLinear`, `MergedColumnParallelLinear`, `RowParallelLinear`, `FusedMoE`,
#    `VocabParallelEmbedding`, `ParallelLMHead`, `ReplicatedLinear`): their constructors need process groups,
#    so instances of the real classes are made with `__new__` and carry the attributes the LoRA code reads
#    (partition sizes from the HF config, `moe_runner_config.is_gated`, a small weight). The module tree
#    follows SGLang's Llama/Qwen2/Mixtral/Qwen2-MoE/Qwen3-MoE models (`model.layers.N.self_attn.qkv_proj`,
#    `mlp.experts`, `mlp.shared_expert.gate_up_proj`, `block_sparse_moe.experts`, ...).
# 7. LoRA wrappers: `set_lora_module` builds the real wrapper class chosen by `get_lora_layer`'s table with
#    `__new__` (their constructors allocate kernel-backend state) and installs it with the real
#    `replace_submodule`; the slice methods that `load_lora_weight_to_buffer` calls are the wheel's own.
# 8. Published server args: `DefaultModelLoader` reads `get_server_args()` (None: nothing published, so no
#    checksum verification) and four `get_model()` loader flags, given their ServerArgs defaults.

SGLANG_REPLACED = ("sglang.kernels", "sglang.srt.entrypoints")
SGLANG_SPECIAL = {"dill": {"dumps": lambda *a, **k: b""}}


def _sglang_stub_class(name: str) -> type:
    import abc

    class _Meta(abc.ABCMeta):  # ABCMeta: engine classes mix stubs with ABC bases
        def __getattr__(cls, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _sglang_stub_class(attr)

    return _Meta(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None,
                            "__init_subclass__": classmethod(lambda cls, **k: None),
                            "__getattr__": lambda self, attr: _sglang_stub_class(attr)})  # fmt: skip


def install_sglang_llm() -> None:
    """Stubs 1-3, for importing `sglang.srt.lora.*` from the unpacked wheel first on sys.path."""
    import importlib.abc
    import importlib.machinery
    import os
    import sys
    import types

    spec = importlib.machinery.PathFinder.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the unpacked sglang wheel is not on sys.path")
    package_dir = list(spec.submodule_search_locations)[0]
    root = os.path.dirname(package_dir)
    deps = os.path.join(os.path.dirname(root), "sglang-deps")
    if not os.path.isdir(deps):
        raise RuntimeError(f"{deps} missing; run `make engines` (installs msgspec and pybase64 there)")
    sys.path.insert(1, deps)

    class Inert(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = _sglang_stub_class(attr)
            setattr(self, attr, value)
            return value

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            replaced = any(name == p or name.startswith(p + ".") for p in SGLANG_REPLACED)
            if not replaced and not _engine_import_to_stub(self, name, path, target, "sglang", root):
                return None
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            module = Inert(spec.name)
            module.__path__ = []
            module.__dict__.update(SGLANG_SPECIAL.get(spec.name, {}))
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
    bare = types.ModuleType("sglang")
    bare.__path__ = [package_dir]
    sys.modules["sglang"] = bare


def _shell(cls, **attrs):
    """An instance of a real engine class without its constructor (which needs process groups or a GPU)."""
    import torch

    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    for key, value in attrs.items():
        setattr(obj, key, value)
    return obj


def sglang_manager_shell(manager_cls, model, hf_config, *, max_loras_per_batch, load_config, experts_shared_outer,
                         strict_loading):  # fmt: skip
    """Stubs 4, 5 and 7: a LoRAManager as `__init__` leaves it on one CPU rank."""
    import types

    import torch
    from sglang.srt.lora import layers as lora_layers
    from sglang.srt.lora import mem_pool
    from sglang.srt.utils import replace_submodule

    mem_pool.get_parallel = lambda: types.SimpleNamespace(
        tp_size=1, tp_rank=0, attn_tp_size=1, moe_ep_size=1, moe_ep_rank=0, moe_tp_size=1, moe_tp_rank=0,
        pp_group=types.SimpleNamespace(is_last_rank=True),
    )  # fmt: skip
    from sglang.srt.model_loader import loader

    loader.get_server_args = lambda: None
    loader.get_model = lambda: types.SimpleNamespace(
        weight_loader_disable_mmap=False, weight_loader_prefetch_checkpoints=False,
        weight_loader_prefetch_num_threads=4, weight_loader_drop_cache_after_load=False, model_checksum=None,
    )  # fmt: skip
    mgr = manager_cls.__new__(manager_cls)
    mgr.base_model = model
    mgr.base_hf_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    mgr.max_loras_per_batch = max_loras_per_batch
    mgr.load_config = load_config
    mgr.dtype = torch.float32
    mgr.device = torch.device("cpu")
    mgr.attn_tp_size = 1
    mgr.lora_added_tokens_size = None
    mgr.enable_lora_overlap_loading = False
    mgr.attn_dp_enabled = False
    mgr.pending_lora_load_events = {}
    mgr.eviction_policy = "lru"
    mgr._experts_shared_outer_override = experts_shared_outer
    mgr.moe_lora_runner_backend = None
    mgr.lora_use_virtual_experts = False
    mgr.lora_strict_loading = strict_loading
    mgr.speculative_algorithm = None
    mgr.lora_backend = types.SimpleNamespace(validate_lora_targets=lambda **kw: None, name="triton")
    mgr._validate_replicated_q_targets = lambda target_modules: None
    mgr.update_lora_info = lambda: None

    table = (
        (lora_layers.FusedMoE, lora_layers.FusedMoEWithLoRA),
        (lora_layers.ParallelLMHead, lora_layers.ParallelLMHeadWithLoRA),
        (lora_layers.VocabParallelEmbedding, lora_layers.VocabParallelEmbeddingWithLoRA),
        (lora_layers.ReplicatedLinear, lora_layers.ReplicatedLinearWithLoRA),
        (lora_layers.QKVParallelLinear, lora_layers.QKVParallelLinearWithLoRA),
        (lora_layers.MergedColumnParallelLinear, lora_layers.MergedColumnParallelLinearWithLoRA),
        (lora_layers.ColumnParallelLinear, lora_layers.ColumnParallelLinearWithLoRA),
        (lora_layers.RowParallelLinear, lora_layers.RowParallelLinearWithLoRA),
    )

    def set_lora_module(module_name, module, **kwargs):
        wrapper_cls = next(w for base, w in table if isinstance(module, base))
        attrs = {"base_layer": module, "set_lora": False, "lora_backend": mgr.lora_backend}
        if wrapper_cls is lora_layers.FusedMoEWithLoRA:
            attrs.update(tp_size=1, intermediate_size_per_partition=module.intermediate_size_per_partition,
                         _uses_interleaved_gate_up=False)  # fmt: skip
        wrapper = _shell(wrapper_cls, **attrs)
        replace_submodule(model, module_name, wrapper)
        return wrapper

    mgr.set_lora_module = set_lora_module
    return mgr


def _deepseek_layer(layer, config, layer_id, linear, mlp, experts, replicated_cls):
    """SGLang's DeepseekV2/V3 decoder layer: fused q_a/kv_a (replicated), q_b/kv_b (column), o (row); MoE after
    `first_k_dense_replace` with `mlp.shared_experts`."""
    from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear

    heads, hidden = config.num_attention_heads, config.hidden_size
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    kv_a = config.kv_lora_rank + config.qk_rope_head_dim
    attn = layer.self_attn
    attn.fused_qkv_a_proj_with_mqa = linear(replicated_cls, hidden, (config.q_lora_rank + kv_a,))
    attn.q_b_proj = linear(ColumnParallelLinear, config.q_lora_rank, (heads * qk,))
    attn.kv_b_proj = linear(ColumnParallelLinear, config.kv_lora_rank,
                            (heads * (config.qk_nope_head_dim + config.v_head_dim),))  # fmt: skip
    attn.o_proj = linear(RowParallelLinear, heads * config.v_head_dim, (hidden,))
    if layer_id < (config.first_k_dense_replace or 0):
        layer.mlp = mlp(config.intermediate_size)
    else:
        import torch

        layer.mlp = torch.nn.Module()
        layer.mlp.experts = experts(config.moe_intermediate_size)
        if config.n_shared_experts:
            layer.mlp.shared_experts = mlp(config.moe_intermediate_size * config.n_shared_experts)


def sglang_tiny_model(config):
    """Stub 6: the module tree of SGLang's model for `config`, built from shells of the real layer classes."""
    import types

    import torch
    from sglang.srt.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    nn = torch.nn
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weight = lambda: nn.Parameter(torch.zeros(1), requires_grad=False)  # noqa: E731 - shapes are read elsewhere

    def linear(cls, in_dim, outs, **extra):
        return _shell(cls, input_size=in_dim, input_size_per_partition=in_dim, output_sizes=list(outs),
                      output_partition_sizes=list(outs), output_size=sum(outs), tp_group=None, bias=None,
                      skip_bias_add=False, weight=weight(), **extra)  # fmt: skip

    def mlp(inter):
        m = nn.Module()
        m.gate_up_proj = linear(MergedColumnParallelLinear, hidden, (inter, inter))
        m.down_proj = linear(RowParallelLinear, inter, (hidden,))
        return m

    def experts(inter):
        return _shell(FusedMoE, moe_runner_config=types.SimpleNamespace(is_gated=True), is_shared_fused_moe=False,
                      moe_tp_rank=0, moe_tp_size=1, intermediate_size_per_partition=inter, weight=weight())  # fmt: skip

    n_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    routed = getattr(config, "n_routed_experts", None)  # DeepSeek: MLA attention, first dense layers, shared experts
    model_type = config.model_type
    root = nn.Module()
    root.config = config
    root.model = nn.Module()
    root.model.embed_tokens = _shell(VocabParallelEmbedding, org_vocab_size=config.vocab_size,
                                     embedding_dim=hidden, weight=weight())  # fmt: skip
    layers = nn.ModuleList()
    for layer_id in range(config.num_hidden_layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        if routed:
            _deepseek_layer(layer, config, layer_id, linear, mlp, experts, ReplicatedLinear)
            layers.append(layer)
            continue
        layer.self_attn.qkv_proj = linear(
            QKVParallelLinear, hidden, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
            q_proj_shard_size=heads * head_dim, kv_proj_shard_size=kv_heads * head_dim, num_kv_head_replicas=1,
            kv_tp_group=None, total_num_heads=heads, total_num_kv_heads=kv_heads, head_size=head_dim,
        )  # fmt: skip
        layer.self_attn.o_proj = linear(RowParallelLinear, heads * head_dim, (hidden,))
        if not n_experts:
            layer.mlp = mlp(config.intermediate_size)
        elif model_type == "mixtral":
            layer.block_sparse_moe = nn.Module()
            layer.block_sparse_moe.gate = linear(ReplicatedLinear, hidden, (n_experts,))
            layer.block_sparse_moe.experts = experts(config.intermediate_size)
        else:
            layer.mlp = nn.Module()
            layer.mlp.gate = linear(ReplicatedLinear, hidden, (n_experts,))
            layer.mlp.experts = experts(config.moe_intermediate_size)
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            if shared:
                layer.mlp.shared_expert = mlp(shared)
        layers.append(layer)
        del layer_id
    root.model.layers = layers
    root.lm_head = _shell(ParallelLMHead, org_vocab_size=config.vocab_size, embedding_dim=hidden,
                          weight=weight(), shard_indices=None)  # fmt: skip
    return root


# --- SGLang diffusion (the lora/ package of the multimodal generator) ------------------------------------
# What runs for real: `format_adapter.py` and `peft_adapter.py`, imported as modules, with their real imports
# (torch, safetensors, diffusers' lora_conversion_utils). Stubs:
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
# 3. For `set_lora` itself (compiled the same way), `SglangDiffusionPipelineShell` in the runner stands in for what
#    needs a live pipeline: `_invalidate_lora_conditioning` (caches of loaded encoders: nothing to drop),
#    `_reject_lora_on_packed_weights` (walks the loaded model's parameters for GGUF `qweight`: no model),
#    `load_lora_adapter` (records path and alpha; the file loading is proven on its own), and
#    `_check_lora_config_matches` (returns True, so `set_lora` stops after its decisions instead of writing
#    weights). `_should_merge_lora_for_layers` is the real method, wrapped to record each decision. `dist` is a
#    one-process group (rank 0), and `layerwise_offload` a module whose `finish_offload_writeback` has nothing to
#    write back.
# 4. For planning (tests/oracle/sglang_plan_runner.py), `set_lora` runs to the end over several calls, with the
#    real `_check_lora_config_matches`, `_auto_merge_rounds_away` (0.5.23's rounding-loss rule, with the module
#    function `merge_rounding_loss` and `AUTO_MERGE_MAX_ROUNDING_LOSS`), `_apply_lora_to_layers`,
#    `_reactivate_cached_dynamic_lora_layers` and `_merge_cache_for` (`SGLANG_DIFFUSION_PLAN_METHODS`). The LoRA
#    layers are instances of a class compiled the same way from layers/lora/linear.py's `BaseLayerWithLoRA`
#    (`SGLANG_DIFFUSION_LAYER_METHODS`: `set_lora_weights`, `merge_rounding_norms`, `can_merge_base_weight`, ...)
#    over a plain base layer holding a CPU weight (an int8 weight is a quantized one: `can_merge_base_weight` is
#    False for it). Stubbed there: `merge_lora_weights`/`unmerge_lora_weights` only set `merged` (the merge
#    arithmetic is not a planning decision and is proven by lorafast.merge's own tests); `load_lora_adapter` reads
#    the file with the engine's own `load_file`, `load_peft_config`, `normalize_lora_state_dict` and
#    `get_peft_lora_alpha`, strips names as it does, and maps them one to one (the model's name mapping needs a
#    DiT's arch config; a hub download needs the network); `_needs_lora_weight_update_context` is False (it only
#    decides whether layerwise offload is paused); `layerwise_offload._refresh_packed_from_manager` does nothing
#    (no offload manager). `get_local_torch_device` is the CPU.

SGLANG_DIFFUSION_METHODS = (
    "VALID_TARGETS",
    "_normalize_lora_params",
    "_resolve_lora_merge_mode",
    "_should_merge_lora_for_layers",
    "_uses_dtensor_weights",
    "_get_target_lora_layers",
    "set_lora",
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


SGLANG_DIFFUSION_PLAN_METHODS = (
    *SGLANG_DIFFUSION_METHODS,
    "_check_lora_config_matches",
    "_auto_merge_rounds_away",
    "_apply_lora_to_layers",
    "_reactivate_cached_dynamic_lora_layers",
    "_merge_cache_for",
    "merge_rounding_loss",
    "AUTO_MERGE_MAX_ROUNDING_LOSS",
)
SGLANG_DIFFUSION_LAYER_METHODS = (
    "weight",
    "can_merge_base_weight",
    "slice_lora_a_weights",
    "slice_lora_b_weights",
    "set_lora_weights",
    "clear_lora_weights",
    "_active_lora_list",
    "_materialized_weight_src",
    "merge_rounding_norms",
)


def compile_members(path: str, class_name: str, names, namespace: dict, new_name: str | None = None) -> type:
    """A class of the members `names` of `class_name` in the file `path`, compiled unmodified from its source
    text (found by name with `ast`) into `namespace`. A name that is a module-level function or assignment of
    the file is compiled into `namespace` too. Fails when a name is missing."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)

    def name_of(node) -> str | None:
        if isinstance(node, ast.Assign):
            return next((t.id for t in node.targets if isinstance(t, ast.Name)), None)
        return getattr(node, "name", None) or getattr(getattr(node, "target", None), "id", None)

    members = [n for n in cls.body if name_of(n) in names]
    module_level = [n for n in tree.body if name_of(n) in names and not isinstance(n, ast.ClassDef)]
    missing = set(names) - {name_of(n) for n in members + module_level}
    if missing:
        raise RuntimeError(f"{class_name} in {path} lacks {sorted(missing)}")
    body = ast.Module([*module_level, ast.ClassDef(new_name or class_name, [], [], members, [])], [])
    ast.fix_missing_locations(body)
    exec(compile(body, path, "exec"), namespace)
    return namespace[new_name or class_name]


def sglang_diffusion_layer_class(root: str) -> type:
    """`SGLANG_DIFFUSION_LAYER_METHODS` of `BaseLayerWithLoRA`, compiled unmodified from the wheel's linear.py."""
    import os

    import torch

    namespace: dict = {
        "torch": torch,
        "LoRAWeightEntry": tuple,
        "LinearBase": type("LinearBase", (), {}),  # the base layers here are plain objects, not LinearBase
        "UnquantizedLinearMethod": type("UnquantizedLinearMethod", (), {}),
        "get_local_torch_device": lambda: torch.device("cpu"),
    }
    path = os.path.join(root, "sglang", "multimodal_gen", "runtime", "layers", "lora", "linear.py")
    return compile_members(path, "BaseLayerWithLoRA", SGLANG_DIFFUSION_LAYER_METHODS, namespace)


def sglang_diffusion_pipeline_class(root: str, methods=SGLANG_DIFFUSION_METHODS) -> type:
    """A class holding `methods` (default `SGLANG_DIFFUSION_METHODS`), compiled unmodified from the wheel's
    pipeline.py; module-level names among them are compiled into the class's globals."""
    import ast
    import collections
    import contextlib
    import logging
    import os
    import sys
    import types
    import typing
    from collections.abc import Hashable

    import torch
    from torch.distributed.tensor import DTensor

    base = os.path.join(root, "sglang", "multimodal_gen", "runtime")
    namespace: dict = {
        "logger": logging.getLogger("sglang_diffusion_oracle"),
        "DTensor": DTensor,
        "BaseLayerWithLoRA": type("BaseLayerWithLoRA", (), {}),
        "LoraMergeCache": type("LoraMergeCache", (), {}),  # only named in annotations when caching is off
        "dist": types.SimpleNamespace(get_rank=lambda: 0, is_initialized=lambda: False),
        "torch": torch,
        "nullcontext": contextlib.nullcontext,
        "defaultdict": collections.defaultdict,
        "Hashable": Hashable,
        "Any": typing.Any,
    }
    offload = "sglang.multimodal_gen.runtime.managers.memory_managers.layerwise_offload"
    sys.modules[offload] = types.ModuleType(offload)
    sys.modules[offload].finish_offload_writeback = lambda: None
    sys.modules[offload]._refresh_packed_from_manager = lambda layer: None  # stub 4: no offload manager
    args_file = os.path.join(base, "server_args", "server_args.py")
    with open(args_file, encoding="utf-8") as f:
        args_source = f.read()
    for node in ast.parse(args_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LORA_MERGE_MODES" for t in node.targets):
            exec(compile(ast.Module([node], []), args_file, "exec"), namespace)
    pipeline_file = os.path.join(base, "pipelines_core", "lora", "pipeline.py")
    return compile_members(pipeline_file, "LoRAPipeline", methods, namespace)


# --- Launch commands (tests/oracle/launch_runner.py: the engines' own argument parsers) ------------------
# What runs for real: vLLM's `FlexibleArgumentParser`, `make_arg_parser` (every frontend and `EngineArgs` flag),
# the `vllm serve` subcommand parser, `AsyncEngineArgs.from_cli_args` and the pydantic `LoRAConfig`; SGLang's
# `prepare_server_args` (`ServerArgs.add_cli_args`, `from_cli_args`), `check_lora_server_args`, and `sglang
# serve`'s top-level parser and argv normalization. Stubs, each with why:
#
# 1. vLLM (`install_vllm_cli`): the third-party modules that the CLI modules import but parsing never calls
#    (fastapi, openai's types, zmq, prometheus_client, opentelemetry, xgrammar, ...). When, and only when, an
#    import made from the engine's own files finds no such module, it gets one whose attributes are inert
#    classes that pydantic accepts as `Any` (request models are built at import time over openai's types),
#    and whose instances' methods do nothing (`@router.get(...)` hands the function back).
#    `msgspec` is real, from `.cache/engines/sglang-deps` (`SamplingParams` is a msgspec struct).
# 2. SGLang (`install_sglang_cli`): `install_sglang_llm`'s stubs, except that
#    `sglang.kernels.ops.kv_canary.consts` (an enum naming the choices of `--kv-canary-real-data`) is the
#    wheel's own file, loaded alone: the rest of `sglang.kernels` stays inert.


def _engine_root(name: str) -> str:
    import importlib.machinery
    import os

    spec = importlib.machinery.PathFinder.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the unpacked {name} wheel is not on sys.path")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def _inert_callable(*args: object, **kwargs: object) -> object:
    """What an inert instance's methods return: a decorator call (`@router.get("/health")`) gets the function back."""
    return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _inert_callable


def install_vllm_cli() -> None:
    """Stub 1 of the launch section, for importing vLLM's CLI argument parsers from the unpacked wheel."""
    import os

    from pydantic_core import core_schema

    root = _engine_root("vllm")
    sys.path.insert(1, os.path.join(os.path.dirname(root), "sglang-deps"))
    any_schema = classmethod(lambda cls, source, handler: core_schema.any_schema())

    class Meta(type):
        def __getattr__(cls, attr: str) -> type:  # enum members and nested names (ReasoningEffort.HIGH)
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Meta(attr, (), {"__init__": _accept_anything, "__get_pydantic_core_schema__": any_schema})

    class Inert(types.ModuleType):
        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            cls = Meta(name, (), {"__module__": self.__name__, "__init__": _accept_anything,
                                  "__class_getitem__": classmethod(lambda c, _item: c),
                                  "__get_pydantic_core_schema__": any_schema,
                                  "__getattr__": lambda obj, attr: _inert_callable})  # fmt: skip
            setattr(self, name, cls)
            return cls

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if not _engine_import_to_stub(self, name, path, target, "vllm", root):
                return None
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):  # type: ignore[no-untyped-def]
            module = Inert(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):  # type: ignore[no-untyped-def]
            pass

    sys.meta_path.insert(0, Finder())


def install_sglang_cli() -> None:
    """Stub 2 of the launch section."""
    import importlib.util
    import os

    install_sglang_llm()
    name = "sglang.kernels.ops.kv_canary.consts"
    path = os.path.join(sys.modules["sglang"].__path__[0], "kernels", "ops", "kv_canary", "consts.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
