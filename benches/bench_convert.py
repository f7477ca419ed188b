"""Layout conversion throughput: `lorafast.convert` against the Python way (`safetensors.torch.load_file`, torch
ops, `save_file`), on the same adapters in the same run.

Two conversions of a Qwen3-30B-A3B-shaped MoE adapter (bf16, H 2048, I 768, 128 experts, rank 16):
- shared-outer -> stacked 3-D: the outer factors are repeated along the expert axis (copies);
- PEFT target_parameters -> stacked 3-D: lora_B is permuted from rank-major columns (a strided copy).

GB/s counts the tensor data written (the converted adapter's data section). The source is read once before
timing, so both methods start from the page cache; each method writes its own output folder, fsynced.

    python benches/bench_convert.py                 # 24 layers (~0.6 GB written per conversion)
    python benches/bench_convert.py --layers 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

H, IM, E, R = 2048, 768, 128, 16
PEFT = "base_model.model.model.layers"


def write_adapter(folder: Path, layers: int, layout: str) -> str:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    t: dict[str, torch.Tensor] = {}

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    for layer in range(layers):
        pre = f"{PEFT}.{layer}.mlp.experts"
        if layout == "shared_outer":
            t[f"{pre}.gate_up_proj.lora_A.weight"] = rnd(1, R, H)
            t[f"{pre}.gate_up_proj.lora_B.weight"] = rnd(E, 2 * IM, R)
            t[f"{pre}.down_proj.lora_A.weight"] = rnd(E, R, IM)
            t[f"{pre}.down_proj.lora_B.weight"] = rnd(1, H, R)
        else:
            t[f"{pre}.base_layer.lora_A.weight"] = rnd(R * E, H)
            t[f"{pre}.base_layer.lora_B.weight"] = rnd(2 * IM, R * E)
            t[f"{pre}.lora_A.weight"] = rnd(R * E, IM)
            t[f"{pre}.lora_B.weight"] = rnd(H, R * E)
    folder.mkdir(parents=True)
    save_file(t, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "target_modules": ["gate_up_proj", "down_proj"]}
    if layout != "shared_outer":
        cfg = {**cfg, "target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return str(folder)


def python_way(src: str, layout: str, out: Path) -> int:
    """What a user writes today: load everything, reshape with torch, save everything."""
    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(src, "adapter_model.safetensors"))
    new: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if layout == "shared_outer":
            new[name] = t.expand(E, -1, -1).contiguous() if t.shape[0] == 1 else t
        else:
            owner = name.rsplit(".lora_", 1)[0]
            proj = "gate_up_proj" if owner.endswith(".base_layer") else "down_proj"
            key = owner.removesuffix(".base_layer") + f".{proj}.lora_{name.rsplit('.lora_', 1)[1]}"
            if ".lora_A." in name:
                new[key] = t.view(E, R, t.shape[1])
            else:
                new[key] = t.view(t.shape[0], R, E).permute(2, 0, 1).contiguous()
    out.mkdir()
    save_file(new, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    fd = os.open(out / "adapter_model.safetensors", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return sum(t.numel() * t.element_size() for t in new.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import lorafast

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        for layout in ("shared_outer", "peft_target_parameters"):
            src = write_adapter(Path(tmp) / layout, args.layers, layout)
            with open(os.path.join(src, "adapter_model.safetensors"), "rb") as f:  # warm the page cache
                while f.read(64 << 20):
                    pass
            t0 = time.perf_counter()
            res = lorafast.convert(src, "stacked_3d", Path(tmp) / f"{layout}-lorafast")
            t_lf = time.perf_counter() - t0
            t0 = time.perf_counter()
            nbytes = python_way(src, layout, Path(tmp) / f"{layout}-python")
            t_py = time.perf_counter() - t0
            assert nbytes == res.bytes, (nbytes, res.bytes)
            rows.append({"conversion": f"{layout} -> stacked_3d", "bytes_written": res.bytes,
                         "source_bytes": res.source_bytes, "lorafast_s": t_lf, "python_s": t_py,
                         "lorafast_gbps": res.bytes / t_lf / 1e9, "python_gbps": nbytes / t_py / 1e9,
                         "speedup": t_py / t_lf})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['conversion']:40s} {r['bytes_written'] / 1e9:6.2f} GB written   lorafast {r['lorafast_gbps']:5.2f} "
                  f"GB/s ({r['lorafast_s']:.2f} s)   load_file+torch+save_file {r['python_gbps']:5.2f} GB/s "
                  f"({r['python_s']:.2f} s)   x{r['speedup']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
