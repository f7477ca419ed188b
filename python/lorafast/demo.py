"""`python -m lorafast.demo [OUT]` (`make demo`): what lorafast is for, on a fleet it writes itself.

Each step is a real `lorafast` command, printed before its output: the launch commands of a vLLM and an SGLang
server are checked from headers, the engines' own errors are caught with their exact texts, the way out is
applied (flag values, a layout conversion, the merge mode), and the re-check serves. With torch installed, one
adapter is merged into its tiny base and compared with PEFT's own merge. Exits 1 if any step does not give the
answer the demo expects (the demo is also a smoke test), else 0.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
import time

from .cli import main as cli

_failures: list[str] = []


def _run(title: str, argv: list[str], expect: int, must: tuple[str, ...] = (), keep: int = 14) -> str:
    """Print the step, run `lorafast ARGV`, show its first `keep` lines, and check its exit status and texts."""
    print(f"\n== {title}")
    print("$ lorafast " + " ".join(shlex.quote(a) for a in argv))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    for line in lines[:keep]:
        print("  " + (line if len(line) <= 150 else line[:147] + "..."))
    if len(lines) > keep:
        print(f"  ... ({len(lines) - keep} more lines)")
    text = out.getvalue() + err.getvalue()
    missing = [m for m in must if m not in text]
    if status != expect or missing:
        _failures.append(f"{title}: exit {status} (expected {expect}); missing {missing}")
    return text


def _merge_against_peft(paths: dict[str, str], out: str) -> None:
    try:
        import peft  # noqa: F401
        import torch
        from safetensors.torch import load_file
    except ImportError:
        print("\n== merge into the tiny base and compare with PEFT: skipped (needs torch and peft: make test installs"
              " them)")  # fmt: skip
        return
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", module="transformers")  # their deprecation notes are not the demo's
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    merged = os.path.join(out, "merged", "llama-rslora")
    _run("the way out of a served-at-another-scale adapter: merge it into the base",
         ["merge", "--base", paths["llama"], "--adapter", f"{paths['llama-rslora']}:1.0", "--out", merged], 0)  # fmt: skip
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["llama"]), paths["llama-rslora"])
    reference = {k: v for k, v in model.merge_and_unload().state_dict().items() if k.endswith("_proj.weight")}
    ours = {}
    for name in os.listdir(merged):
        if name.endswith(".safetensors"):
            ours.update(load_file(os.path.join(merged, name)))
    worst = max(float((ours[k].float() - v.float()).abs().max()) for k, v in reference.items())
    print(f"  PEFT's merge_and_unload and lorafast's merged weights differ by at most {worst:.2e}")
    if worst > 1e-5:
        _failures.append(f"merge differs from PEFT by {worst}")
    del torch


def run(out: str) -> int:
    t0 = time.perf_counter()
    _failures.clear()
    from .sample_bases import write_with_bases

    p = write_with_bases(out)
    a = {k: v for k, v in p.items()}
    print(f"wrote tiny bases and {len(p) - 3} adapters to {out} (lorafast sample --with-bases --out {out})")

    vllm = ["--", "vllm", "serve", p["llama"], "--enable-lora"]
    mods = [f"plain={a['llama-plain']}", f"r64={a['llama-r64']}", f"mlp={a['llama-mlp']}",
            f"qwen2={a['qwen2-plain']}"]  # fmt: skip
    _run("vLLM 0.34.0: will this server serve these adapters as trained?",
         ["preflight", "--engine-version", "0.34.0", *vllm, "--max-lora-rank", "32", "--lora-target-modules", "q_proj",
          "v_proj", "--lora-modules", *mods], 1,
         ("LoRA rank 64 is greater than max_lora_rank 32.", "partial", "do not fit the base"))  # fmt: skip
    _run("the way out: the flags it names (and qwen2-plain goes to a server of its own base)",
         ["preflight", "--engine-version", "0.34.0", *vllm, "--max-lora-rank", "64", "--lora-target-modules", "q_proj",
          "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "--lora-modules", *mods[:3]], 0,
         ("3 serves",))  # fmt: skip

    sglang = ["--", "python", "-m", "sglang.launch_server", "--enable-lora", "--model-path", p["qwen3moe"]]
    _run("SGLang 0.5.23, one MoE base, two adapters in two MoE layouts",
         ["preflight", "--engine-version", "0.5.23", *sglang, "--lora-paths", f"stacked={a['moe-stacked']}",
          f"shared={a['moe-shared']}"], 1,
         ("Mixed shared-outer LoRA formats detected across loaded adapters", "lorafast convert"))  # fmt: skip
    converted = os.path.join(out, "converted", "moe-shared-stacked_3d")
    _run(
        "the way out: convert the shared-outer adapter to per-expert weights (exact)",
        ["convert", a["moe-shared"], "--to", "stacked_3d", "--out", converted],
        0,
        keep=3,
    )
    _run("the re-check serves both on one server",
         ["preflight", "--engine-version", "0.5.23", *sglang, "--lora-paths", f"stacked={a['moe-stacked']}",
          f"shared={converted}"], 0, ("2 serves",))  # fmt: skip

    _run("SGLang 0.5.23 on the Llama base: loads, but at another scale than trained",
         ["preflight", "--engine-version", "0.5.23", "--", "python", "-m", "sglang.launch_server", "--model-path",
          p["llama"], "--lora-paths", f"plain={a['llama-plain']}", f"rslora={a['llama-rslora']}"], 1,
         ("scale_differs", "trained 8, served 2"))  # fmt: skip
    _merge_against_peft(p, out)

    flux = ["--", "sglang", "serve", "--model-path", p["flux"], "--lora-path", a["flux-a"], "--lora-nickname", "a"]
    _run("SGLang diffusion: two adapters on one set_lora target, dynamic mode",
         ["preflight", a["flux-b"], "--engine-version", "0.5.23", *flux, "--lora-merge-mode", "dynamic"], 1,
         ("Dynamic LoRA currently supports only one adapter per target. Use merge_mode='merge' for multiple "
          "adapters.",))  # fmt: skip
    _run("the way out: --lora-merge-mode merge",
         ["preflight", a["flux-b"], "--engine-version", "0.5.23", *flux, "--lora-merge-mode", "merge"], 0,
         ("2 serves",))  # fmt: skip

    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s" + (f"; {len(_failures)} step(s) did not give the "
          "expected answer:" if _failures else ": every step gave the expected answer"))  # fmt: skip
    for f in _failures:
        print("  " + f)
    return 1 if _failures else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1] if len(sys.argv) > 1 else "demo-fleet"))
