"""Layout conversion throughput: `lorafast.convert` against the Python way (`safetensors.torch.load_file`, torch
ops, `save_file`), on the same adapters in the same run, and against the machine's floor.

Two conversions of a Qwen3-30B-A3B-shaped MoE adapter (bf16, H 2048, I 768, 128 experts, rank 16):
- shared-outer -> stacked 3-D: the outer factors are repeated along the expert axis (the output is ~2.7x the
  source: 0.23 GB in, 0.63 GB out for 24 layers);
- PEFT target_parameters -> stacked 3-D: lora_A passes through, lora_B is transposed from rank-major columns
  (0.63 GB in and out).

"Adapter data" is the converted adapter's tensor data (the output's data section); GB/s is that over wall time,
and the source's size is shown beside it. The floor writes the same number of bytes from memory into the same
folder and fsyncs them: the memory copy and disk cost that no converter avoids. Each method runs `--repeat` times
and the best time counts (the machine is shared); CPU seconds (all threads) are shown, with the load average.
The source is read once before timing, so every method starts from the page cache, and all of them fsync.
The "fresh process" row runs `lorafast convert` in a new interpreter, as a user does: its imports count (it was
6.7 s on a 7.5 MB adapter while conversions imported torch; they import none now), and so does the rate the
command prints.

    python benches/bench_convert.py                 # 24 layers (~0.6 GB written per conversion)
    python benches/bench_convert.py --layers 8 --repeat 5 --json
    python benches/bench_convert.py --layers 3 --experts 32    # a 7.5 MB shared-outer adapter (19.7 MB written)
    python benches/bench_convert.py --before .cache/baseline-255a378 --passes 5

`--before DIR` also runs both conversions with the build installed in DIR (`make baseline`: 255a378, the fixed
reference build) and with this one, alternated, each in a fresh process per pass, for --passes passes
(default 5; benches/_compare.py; each pass the best of --repeat runs, the Python way and the floor in this build's
process): the median and spread in GB/s out, the ratio to the reference and to the Python way and the floor, and
the load average at the start and end. 255a378 has no `lorafast.convert`: no reference ratio against it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from _compare import CHILD_PRELUDE, add_options, compare, report, this_build

ROOT = Path(__file__).resolve().parents[1]

H, IM, E, R = 2048, 768, 128, 16
PEFT = "base_model.model.model.layers"


def write_adapter(folder: Path, layers: int, layout: str, e: int = E) -> str:
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
            t[f"{pre}.gate_up_proj.lora_B.weight"] = rnd(e, 2 * IM, R)
            t[f"{pre}.down_proj.lora_A.weight"] = rnd(e, R, IM)
            t[f"{pre}.down_proj.lora_B.weight"] = rnd(1, H, R)
        else:
            t[f"{pre}.base_layer.lora_A.weight"] = rnd(R * e, H)
            t[f"{pre}.base_layer.lora_B.weight"] = rnd(2 * IM, R * e)
            t[f"{pre}.lora_A.weight"] = rnd(R * e, IM)
            t[f"{pre}.lora_B.weight"] = rnd(H, R * e)
    folder.mkdir(parents=True)
    save_file(t, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "target_modules": ["gate_up_proj", "down_proj"]}
    if layout != "shared_outer":
        cfg = {**cfg, "target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return str(folder)


def python_way(src: str, layout: str, out: Path, e: int = E) -> int:
    """What a user writes today: load everything, reshape with torch, save everything."""
    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(src, "adapter_model.safetensors"))
    new: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if layout == "shared_outer":
            new[name] = t.expand(e, -1, -1).contiguous() if t.shape[0] == 1 else t
        else:
            owner = name.rsplit(".lora_", 1)[0]
            proj = "gate_up_proj" if owner.endswith(".base_layer") else "down_proj"
            key = owner.removesuffix(".base_layer") + f".{proj}.lora_{name.rsplit('.lora_', 1)[1]}"
            if ".lora_A." in name:
                new[key] = t.view(e, R, t.shape[1])
            else:
                new[key] = t.view(t.shape[0], R, e).permute(2, 0, 1).contiguous()
    out.mkdir()
    save_file(new, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    fd = os.open(out / "adapter_model.safetensors", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return sum(t.numel() * t.element_size() for t in new.values())


def fresh_process(src: str, out: Path) -> dict[str, Any]:
    """`lorafast convert` as a user runs it: a new interpreter, so every import it needs is paid for."""
    cmd = [sys.executable, "-m", "lorafast", "convert", src, "--to", "stacked_3d", "--out", str(out), "--json"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": this_build()}
    )
    return dict(json.loads(done.stdout))


def floor(nbytes: int, out: Path) -> None:
    """Write `nbytes` from memory into a new file and fsync it: what any converter pays for its output."""
    import numpy as np

    buf = np.ones(64 << 20, dtype=np.uint8)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, memoryview(buf)[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)


def source_sha256(src: str) -> str:
    """The source hash `convert` records, computed alone: the part of its CPU time the Python way does not spend."""
    from lorafast.converting.api import _content_hash
    from lorafast.tensors import TensorFile

    box: list[Any] = []
    with TensorFile(os.path.join(src, "adapter_model.safetensors")) as tf:
        _content_hash(os.dup(tf.fileno()), tf.data_start, box)  # closes its descriptor
    return str(box[0])


def timed(fn: Any, repeat: int, out: Path) -> tuple[float, float, Any]:
    """Best wall time of `repeat` runs, the CPU seconds of that run, and its result; `out` removed between runs."""
    best: tuple[float, float, Any] | None = None
    for _ in range(repeat):
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.sync()  # no dirty pages from the previous run throttle this one
        c0, t0 = time.process_time(), time.perf_counter()
        got = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or wall < best[0]:
            best = (wall, cpu, got)
    assert best is not None
    return best


LAYOUTS = ("shared_outer", "peft_target_parameters")

# --before: one build's conversions of both sources in a fresh process (benches/_compare.py), each the best of
# `repeat` runs; the Python way and the floor in this build's process only (they need no lorafast).
COMPARE_CODE = (
    CHILD_PRELUDE
    + r"""
import shutil, tempfile
from functools import partial
from pathlib import Path
import bench_convert as bc
src_root, repeat, experts = ARGS[0], int(ARGS[1]), int(ARGS[2])
if ROLE == "this":
    import torch, safetensors.torch  # imported before anything is timed, as in the parent's table
claims, missing = {}, {}
gone = bc.lorafast_convert_missing()
for layout in bc.LAYOUTS:
    src = os.path.join(src_root, layout)
    work = Path(tempfile.mkdtemp(prefix=f"{ROLE}-", dir=src_root))
    lf, cli = f"{layout}: lorafast.convert", f"{layout}: lorafast convert (fresh process)"
    nbytes = None
    if gone:
        missing.update({lf: gone, cli: gone})
    else:
        out = work / "lorafast"
        claims[lf], _, res = bc.timed(partial(lorafast.convert, src, "stacked_3d", out, overwrite=True), repeat, out)
        claims[cli] = bc.timed(partial(bc.fresh_process, src, work / "cli"), repeat, work / "cli")[0]
        nbytes = res.bytes
    if ROLE == "this":
        out = work / "python"
        claims[f"{layout}: load_file+torch+save_file"], _, nbytes = bc.timed(
            partial(bc.python_way, src, layout, out, experts), repeat, out)
        claims[f"{layout}: floor (write + fsync)"] = bc.timed(partial(bc.floor, nbytes, work / "f"), repeat, work / "f")[0]
        claims[f"{layout}: bytes"] = nbytes
    shutil.rmtree(work, True)
child_result(claims, missing)
"""
)


def lorafast_convert_missing() -> str | None:
    """Why this lorafast cannot convert (255a378 has no `lorafast.convert`), or None."""
    from _compare import missing_api

    return missing_api("convert")


def compare_builds(tmp: str, args: argparse.Namespace) -> None:
    """Both conversions, this build against the one in --before, alternated in fresh processes."""
    comp = compare(COMPARE_CODE, [tmp, args.repeat, args.experts], args.before, args.passes, label="\nconvert: ")
    for layout in LAYOUTS:
        gb = comp.times("this", f"{layout}: bytes")[0] / 1e9
        print(f"{layout} -> stacked_3d, {gb:.2f} GB out:")
        claims = [f"{layout}: lorafast.convert", f"{layout}: lorafast convert (fresh process)"]
        bases = [f"{layout}: load_file+torch+save_file", f"{layout}: floor (write + fsync)"]
        report(comp, claims, baselines={c: bases for c in claims}, per=gb, unit="GB", rate_fmt=".2f")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=E, help="experts per layer")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    add_options(parser)
    args = parser.parse_args()

    import lorafast

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        for layout in LAYOUTS:
            src = write_adapter(Path(tmp) / layout, args.layers, layout, args.experts)
            with open(os.path.join(src, "adapter_model.safetensors"), "rb") as f:  # warm the page cache
                while f.read(64 << 20):
                    pass
            out = Path(tmp) / f"{layout}-lorafast"
            t_lf, cpu_lf, res = timed(
                partial(lorafast.convert, src, "stacked_3d", out, overwrite=True), args.repeat, out
            )
            pyout = Path(tmp) / f"{layout}-python"
            t_py, cpu_py, nbytes = timed(partial(python_way, src, layout, pyout, args.experts), args.repeat, pyout)
            assert nbytes == res.bytes, (nbytes, res.bytes)
            cliout = Path(tmp) / f"{layout}-cli"
            t_cli, _, cli = timed(partial(fresh_process, src, cliout), args.repeat, cliout)
            fl = Path(tmp) / "floor.bin"
            t_fl, _, _ = timed(partial(floor, res.bytes, fl), args.repeat, fl)
            fl.unlink()
            t_sha, cpu_sha, _ = timed(partial(source_sha256, src), args.repeat, Path(tmp) / "none")
            rows.append({"conversion": f"{layout} -> stacked_3d", "bytes_written": res.bytes,
                         "source_bytes": res.source_bytes, "lorafast_s": t_lf, "lorafast_cpu_s": cpu_lf,
                         "python_s": t_py, "python_cpu_s": cpu_py, "floor_s": t_fl,
                         "lorafast_gbps": res.bytes / t_lf / 1e9, "python_gbps": nbytes / t_py / 1e9,
                         "floor_gbps": res.bytes / t_fl / 1e9, "speedup": t_py / t_lf,
                         "cli_s": t_cli, "cli_gbps": res.bytes / t_cli / 1e9,
                         "cli_reported_gbps": res.bytes / cli["seconds"] / 1e9,
                         "sha256_s": t_sha, "sha256_cpu_s": cpu_sha,
                         "of_floor": t_fl / t_lf, "load_average": os.getloadavg()[0]})  # fmt: skip
        if args.before:
            compare_builds(tmp, args)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['conversion']}: {r['source_bytes'] / 1e9:.2f} GB in, {r['bytes_written'] / 1e9:.2f} GB out "
                  f"(load average {r['load_average']:.1f})\n"
                  f"  lorafast                  {r['lorafast_gbps']:5.2f} GB/s out ({r['lorafast_s']:.2f} s, "
                  f"{r['lorafast_cpu_s']:.2f} s CPU)  {r['of_floor']:.2f} of the floor\n"
                  f"  lorafast convert (fresh)  {r['cli_gbps']:5.2f} GB/s out ({r['cli_s']:.2f} s; it "
                  f"prints {r['cli_reported_gbps']:.2f} GB/s)\n"
                  f"  load_file+torch+save_file {r['python_gbps']:5.2f} GB/s out ({r['python_s']:.2f} s, "
                  f"{r['python_cpu_s']:.2f} s CPU)  lorafast x{r['speedup']:.2f}\n"
                  f"  floor (write + fsync)     {r['floor_gbps']:5.2f} GB/s\n"
                  f"  of which lorafast's source sha256 alone (a thread of its own): {r['sha256_s']:.2f} s, "
                  f"{r['sha256_cpu_s']:.2f} s CPU")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
