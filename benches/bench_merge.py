"""Merge several adapters into Llama-7B-shaped weights: lorafast.merge against PEFT merge_and_unload.

All 7 linear modules (q, k, v, o: hidden x hidden; gate, up: inter x hidden; down: hidden x inter) per layer, as
in a 7B model. On CPU the layer count is scaled down (default 2); on CUDA the default is all 32. Both methods
start from the same weights in the same run: lorafast merges, checks its unmerge is bit-exact, then PEFT merges
the same adapters at the same strengths into the very same tensors, and the two results are compared.

GB/s counts the minimum traffic of a merge, one read and one write of every merged weight. On CUDA the script
also prints that rate as a percentage of the device's HBM bandwidth (H200: 4.8 TB/s; --hbm-gbps to change).

    python benches/bench_merge.py                     # CPU, 2 layers, 3 adapters of rank 16
    python benches/bench_merge.py --device cuda       # 32 layers on the GPU
    python benches/bench_merge.py --layers 1 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {
        "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
        "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter),
    }  # fmt: skip


def build_model(layers: int, hidden: int, inter: int, dtype, device):
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp = torch.nn.Module(), torch.nn.Module()
            for proj, (out, inp) in shapes(hidden, inter).items():
                parent, leaf = proj.split(".")
                setattr(getattr(self, parent), leaf, torch.nn.Linear(inp, out, bias=False, device="meta"))

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Block() for _ in range(layers)])
    gen = torch.Generator(device="cpu").manual_seed(0)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = torch.empty(mod.out_features, mod.in_features, dtype=dtype, device=device)
            w.copy_((torch.rand(w.shape[0], 1, generator=gen) - 0.5).to(device=device) * 0.04)  # cheap, varied
            w.add_(torch.randn(1, w.shape[1], generator=gen).to(device=device, dtype=dtype) * 0.01)
            mod.weight = torch.nn.Parameter(w, requires_grad=False)
    return model


def write_adapters(root: Path, n: int, layers: int, hidden: int, inter: int, rank: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    out = []
    gen = torch.Generator().manual_seed(1)
    for i in range(n):
        folder = root / f"adapter{i}"
        folder.mkdir()
        tensors = {}
        for layer in range(layers):
            for proj, (o, inp) in shapes(hidden, inter).items():
                key = f"base_model.model.model.layers.{layer}.{proj}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen) * 0.02).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(o, rank, generator=gen) * 0.02).bfloat16()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        cfg = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": [p.split(".")[1] for p in PROJ],
        }
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
        out.append(folder)
    return out


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=None, help="default: 2 on CPU, 32 on CUDA")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="lorafast runs (best is reported)")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="device memory bandwidth for the percentage")
    ap.add_argument("--peft-repeat", type=int, default=2, help="PEFT runs (best is reported)")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch
    from lorafast.merging import merge

    device = args.device
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    layers = args.layers or (32 if cuda else 2)
    strengths = [0.7, -0.3, 1.2, 0.5, 0.9, -0.8][: args.adapters] + [1.0] * max(0, args.adapters - 6)
    model = build_model(layers, args.hidden, args.intermediate, torch.bfloat16, device)
    params = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    traffic = 2 * weight_bytes  # one read + one write of every merged weight
    rows: list[dict] = []

    def row(method: str, seconds: float, note: str = "") -> None:
        rows.append({"method": method, "seconds": seconds, "gbps": traffic / seconds / 1e9, "note": note})

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp), args.adapters, layers, args.hidden, args.intermediate, args.rank)
        requests = list(zip(paths, strengths, strict=True))
        probe = [p.detach()[:64].clone() for p in params]
        merged_probe = None
        unmerge_s = float("inf")
        modes = [("cpu", True), ("subtract", True)]
        if cuda:  # snapshot on the device; and the bare merge (no snapshot, no NaN test) for the bandwidth figure
            modes = [("device", True), ("subtract", True), ("subtract", False)]
        for mode, safe in modes:
            best = float("inf")
            for _ in range(args.repeat):
                gc.collect()
                sync(device)
                t0 = time.perf_counter()
                h = merge(model, requests, snapshot=mode, safe=safe)
                sync(device)
                best = min(best, time.perf_counter() - t0)
                if os.environ.get("BENCH_VERBOSE"):
                    print(f"  {mode}: {time.perf_counter() - t0:.3f}s", file=sys.stderr)
                if merged_probe is None:
                    merged_probe = [p.detach()[:64].clone() for p in params]
                sync(device)
                t0 = time.perf_counter()
                h.unmerge()  # exact from a snapshot; by subtraction (within an ulp) in subtract mode
                sync(device)
                if mode != "subtract":
                    unmerge_s = min(unmerge_s, time.perf_counter() - t0)
                    assert all(torch.equal(p.detach()[:64], q) for p, q in zip(params, probe, strict=True)), (
                        "unmerge not exact"
                    )
            label = f"lorafast merge (snapshot={mode}{'' if safe else ', safe=False'})"
            row(label, best, f"best of {args.repeat}")
        row("lorafast unmerge (restore snapshot)", unmerge_s, "bit-exact")
        diff = float("nan")
        if not args.no_peft:
            from peft import PeftModel
            from peft.tuners.lora import LoraLayer

            best = float("inf")
            for _ in range(args.peft_repeat):
                del model, params
                gc.collect()
                model = build_model(layers, args.hidden, args.intermediate, torch.bfloat16, device)  # pristine
                params = list(model.parameters())
                pm = PeftModel.from_pretrained(model, str(paths[0]), adapter_name="a0")
                for i, p in enumerate(paths[1:], start=1):
                    pm.load_adapter(str(p), adapter_name=f"a{i}")
                for module in pm.modules():
                    if isinstance(module, LoraLayer):
                        for i, s in enumerate(strengths):
                            module.set_scale(f"a{i}", s)
                gc.collect()
                sync(device)
                t0 = time.perf_counter()
                merged = pm.merge_and_unload(adapter_names=[f"a{i}" for i in range(len(paths))])
                sync(device)
                best = min(best, time.perf_counter() - t0)
                if os.environ.get("BENCH_VERBOSE"):
                    print(f"  peft: {time.perf_counter() - t0:.3f}s", file=sys.stderr)
                del pm
            row("peft merge_and_unload", best, f"best of {args.peft_repeat}")
            # PEFT rounds each adapter's delta to bf16 before adding it, lorafast rounds once: compare in units of
            # the bf16 spacing at each tensor's largest weight
            diff = max(
                float((a.float() - b.float()).abs().max() / (b.float().abs().max() * 2.0**-7))
                for a, b in zip(merged_probe or [], [p.detach()[:64] for p in merged.parameters()], strict=True)
            )
    peft_s = next((r["seconds"] for r in rows if r["method"].startswith("peft")), None)
    for r in rows:
        r["vs_peft"] = peft_s / r["seconds"] if peft_s else None
        if cuda:
            r["hbm_pct"] = 100 * r["gbps"] / args.hbm_gbps
    info = {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "layers": layers, "hidden": args.hidden, "intermediate": args.intermediate, "adapters": args.adapters,
        "rank": args.rank, "dtype": "bfloat16", "weight_gb": weight_bytes / 1e9,
        "max_diff_vs_peft": diff, "rows": rows,
    }  # fmt: skip
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"{layers} layers x 7 linear modules, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.adapters} adapters of rank {args.rank}, bf16 weights ({weight_bytes / 1e9:.2f} GB), {info['device']}"
    )
    head = f"{'method':38} {'seconds':>9} {'GB/s':>8} {'vs PEFT':>8}" + (f" {'% HBM':>7}" if cuda else "")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r['vs_peft']:.2f}x" if r["vs_peft"] else "-"
        hbm = f" {r['hbm_pct']:6.1f}%" if cuda else ""
        print(f"{r['method']:38} {r['seconds']:9.3f} {r['gbps']:8.2f} {ratio:>8}{hbm}")
    print(
        f"largest |lorafast - PEFT|: {diff:.2f} bf16 ulps of each tensor's largest weight "
        "(PEFT rounds after each adapter, lorafast once)"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
