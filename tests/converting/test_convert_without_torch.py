"""Conversions move bits and need no torch: each one, run in a child process where `import torch` fails, writes
the same bytes as in this process (where torch is loaded), and each refusal gives the same code and message.
The values numpy reads instead of torch (a kohya alpha, a lossy refusal's max difference) are checked against
torch's for every dtype."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import lorafast  # noqa: E402
from lorafast.converting import bits  # noqa: E402
from lorafast.formats.safetensors import DTYPES  # noqa: E402
from lorafast.tensors import TensorFile, torch_dtype  # noqa: E402
from test_convert import (  # noqa: E402
    H,
    _kohya,
    numbered_adapter,
    stacked_adapter,
    target_parameters_adapter,
)
from test_convert_gpt_oss import gpt_oss_adapter  # noqa: E402
from test_convert_kohya import FLUX_BFL, _flux_bfl  # noqa: E402

CHILD = r"""
import json, sys
sys.modules["torch"] = None  # from here on `import torch` raises ImportError
import lorafast
done = []
for src, to, out, options in json.loads(sys.argv[1]):
    try:
        lorafast.convert(src, to, out, **options)
        done.append(None)
    except lorafast.ConvertError as exc:
        done.append([exc.code, str(exc)])
assert sys.modules["torch"] is None
print(json.dumps(done))
"""


def _cast(build: Callable[[Path], str], dtype: torch.dtype) -> Callable[[Path], str]:
    """`build`'s adapter with every tensor in `dtype`."""

    def cast(folder: Path) -> str:
        src = build(folder / "f32")
        weights = os.path.join(src, "adapter_model.safetensors")
        t = {k: v.to(dtype) for k, v in safetensors_torch.load_file(weights).items()}
        folder.mkdir(exist_ok=True)
        safetensors_torch.save_file(t, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(Path(src, "adapter_config.json").read_text())
        return str(folder)

    return cast


def _diffusers_legacy(folder: Path) -> str:
    gen = torch.Generator().manual_seed(9)
    pre = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor"
    folder.mkdir()
    path = folder / "pytorch_lora_weights.safetensors"
    t = {f"{pre}.to_q_lora.down.weight": torch.randn(2, H, generator=gen),
         f"{pre}.to_q_lora.up.weight": torch.randn(H, 2, generator=gen)}  # fmt: skip
    safetensors_torch.save_file(t, str(path))
    return str(path)


def _numbered_identical_outer(folder: Path) -> str:
    """Numbered experts whose gate/up lora_A and down lora_B are the same in every expert: shared-outer takes them
    through fusion (concatenated A, block-diagonal B) and rank padding (zeros)."""
    src = numbered_adapter(folder / "src", 31)
    weights = os.path.join(src, "adapter_model.safetensors")
    t = safetensors_torch.load_file(weights)
    outer = re.compile(r"\.experts\.\d+\.((gate_proj|up_proj)\.lora_A|down_proj\.lora_B)\.weight$")
    for k in t:
        if outer.search(k):
            t[k] = t[re.sub(r"\.experts\.\d+\.", ".experts.0.", k)].clone()
    safetensors_torch.save_file(t, weights, metadata={"format": "pt"})
    return src


def _bfl(folder: Path) -> str:
    return _flux_bfl(folder, FLUX_BFL)


#: (source, target layout, options): every row of the layout table, refusals, bf16 and f16 sources
CASES: list[tuple[Callable[[Path], str], str, dict[str, str]]] = [
    (lambda f: stacked_adapter(f, 1, shared_outer=True), "stacked_3d", {}),
    (lambda f: stacked_adapter(f, 1, shared_outer=True), "per_expert_2d", {}),
    (lambda f: stacked_adapter(f, 1, shared_outer=True), "peft_target_parameters", {}),
    (lambda f: stacked_adapter(f, 2, shared_outer=False, identical_outer=True), "shared_outer", {}),
    (lambda f: stacked_adapter(f, 3, shared_outer=False), "shared_outer", {}),  # lossy
    (lambda f: stacked_adapter(f, 3, shared_outer=False), "per_expert_2d", {}),
    (lambda f: stacked_adapter(f, 3, shared_outer=False), "peft_target_parameters", {"gate_up": "interleaved"}),
    (lambda f: target_parameters_adapter(f, 4), "stacked_3d", {}),
    (lambda f: target_parameters_adapter(f, 4), "per_expert_2d", {}),
    (lambda f: gpt_oss_adapter(f, 5), "stacked_3d", {}),
    (lambda f: numbered_adapter(f, 6), "stacked_3d", {}),
    (lambda f: numbered_adapter(f, 6), "shared_outer", {}),  # lossy: the experts' outer factors differ
    (lambda f: numbered_adapter(f, 7, mixtral=True), "transformers5", {}),
    (_numbered_identical_outer, "shared_outer", {}),
    (_kohya, "peft", {}),
    (_bfl, "peft", {}),
    (_diffusers_legacy, "peft", {}),
    (_cast(lambda f: stacked_adapter(f, 8, shared_outer=True), torch.bfloat16), "stacked_3d", {}),
    (_cast(lambda f: stacked_adapter(f, 9, shared_outer=False), torch.bfloat16), "shared_outer", {}),  # lossy
    (_cast(lambda f: target_parameters_adapter(f, 10), torch.float16), "stacked_3d", {}),
    (lambda f: stacked_adapter(f, 1, shared_outer=True), "shared_outer", {}),  # already there
]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_every_conversion_runs_without_torch_and_writes_the_same_bytes(tmp_path: Path) -> None:
    jobs = []
    for i, (build, to, options) in enumerate(CASES):
        jobs.append((build(tmp_path / f"src{i}"), to, str(tmp_path / f"child{i}"), options))
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(jobs)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    child = json.loads(run.stdout)
    refused = 0
    for i, ((src, to, _, options), got) in enumerate(zip(jobs, child, strict=True)):
        try:
            lorafast.convert(src, to, tmp_path / f"here{i}", **options)
            here = None
        except lorafast.ConvertError as exc:
            here = [exc.code, str(exc)]
        assert got == here, (src, to)
        if here is None:
            assert _files(tmp_path / f"child{i}") == _files(tmp_path / f"here{i}"), (src, to)
        else:
            refused += 1
            assert not (tmp_path / f"child{i}").exists()
    assert refused == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lossy_refusal_reports_the_max_difference_torch_computes(tmp_path: Path, dtype: torch.dtype) -> None:
    src = _cast(lambda f: stacked_adapter(f, 3, shared_outer=False), dtype)(tmp_path / "s")
    with pytest.raises(lorafast.ConvertError) as info:
        lorafast.convert(src, "shared_outer", tmp_path / "out")
    assert info.value.code == "lossy"
    factor = str(info.value).split(":")[0]  # the refused outer factor
    b = safetensors_torch.load_file(os.path.join(src, "adapter_model.safetensors"))[factor + ".weight"]
    worst = float((b.double() - b[0].double()).abs().max())
    assert worst > 0 and f"(max difference {worst:.6g})" in str(info.value)


def _torch_dtypes() -> list[str]:
    return [d for d in DTYPES if getattr(torch, DTYPES[d].torch or "", None) is not None]


@pytest.mark.parametrize("dtype", _torch_dtypes())
def test_values_read_without_torch_equal_torchs(tmp_path: Path, dtype: str) -> None:
    """`bits.as_float64` (a lossy refusal's difference) and `bits.scalar` (a kohya alpha) give torch's values, on
    random bit patterns (NaNs, infinities and subnormals included) of each dtype."""
    width = DTYPES[dtype].bits // 8
    rng = np.random.default_rng(width)
    raw = rng.integers(0, 256, 4096 * width, dtype=np.uint8)
    if dtype == "BOOL":
        raw &= 1
    pattern = raw.view(bits.UINT[width])
    try:
        want = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch_dtype(dtype)).double().numpy()
    except (RuntimeError, TypeError) as exc:  # torch has the dtype but cannot widen it (old uint support)
        pytest.skip(f"torch cannot convert {dtype} to float64: {exc}")
    np.testing.assert_array_equal(bits.as_float64(pattern, dtype), want)
    one = tmp_path / "one.safetensors"
    header = json.dumps({"a": {"dtype": dtype, "shape": [], "data_offsets": [0, width]}}).encode()
    one.write_bytes(len(header).to_bytes(8, "little") + header + raw[width * 7 : width * 8].tobytes())
    with TensorFile(one) as tf:
        got, ref = bits.scalar(tf, "a"), tf.load_scalar("a")
    assert got == ref or (np.isnan(got) and np.isnan(ref))
