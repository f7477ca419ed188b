"""What changed in an engine's LoRA code between two released wheels: `make engine-diff OLD=vllm==0.33.0
NEW=vllm==0.34.0` (the wheels are fetched with `pip download --no-deps` first, as `make engines` does).

Lists the LoRA-path files that were added, removed or changed, then the unified diff of each changed one
(`--names-only` stops after the list). The LoRA path is the files lorafast's rules are read from: for vLLM
`vllm/lora/`, the LoRA parts of `vllm/config/` and `vllm/engine/arg_utils.py`; for SGLang `sglang/srt/lora/`,
the LoRA server-argument hooks, and the diffusion runtime's LoRA files.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import sys
import zipfile

import engines

LORA_PATHS: dict[str, tuple[str, ...]] = {
    "vllm": (
        "vllm/lora/*",
        "vllm/config/lora.py",
        "vllm/engine/arg_utils.py",
        "vllm/model_executor/models/interfaces.py",
    ),
    "sglang": (
        "sglang/srt/lora/*",
        "sglang/srt/arg_groups/lora*",
        "sglang/srt/server_args.py",
        "sglang/multimodal_gen/*lora*",
    ),
}


def lora_files(engine: str, version: str) -> dict[str, str]:
    """Path -> text of every LoRA-path Python file in the wheel."""
    patterns = LORA_PATHS[engine]
    out: dict[str, str] = {}
    with zipfile.ZipFile(engines.wheel(engine, version)) as zf:
        for name in zf.namelist():
            if name.endswith(".py") and any(fnmatch.fnmatch(name, p) for p in patterns):
                out[name] = zf.read(name).decode("utf-8", errors="replace")
    return out


def diff(engine: str, old: str, new: str, names_only: bool = False) -> str:
    a, b = lora_files(engine, old), lora_files(engine, new)
    added = sorted(set(b) - set(a))
    removed = sorted(set(a) - set(b))
    changed = sorted(n for n in set(a) & set(b) if a[n] != b[n])
    lines = [f"{engine} {old} -> {new}: {len(changed)} changed, {len(added)} added, {len(removed)} removed LoRA files"]
    lines += [f"  changed {n}" for n in changed] + [f"  added   {n}" for n in added]
    lines += [f"  removed {n}" for n in removed]
    if not names_only:
        for n in changed + added:
            lines.extend(
                difflib.unified_diff(
                    a.get(n, "").splitlines(),
                    b[n].splitlines(),
                    f"{engine}-{old}/{n}",
                    f"{engine}-{new}/{n}",
                    lineterm="",
                )
            )
    return "\n".join(lines) + "\n"


def _pin(text: str) -> tuple[str, str]:
    name, sep, version = text.partition("==")
    if not sep or name not in LORA_PATHS or not version:
        raise argparse.ArgumentTypeError(f"expected sglang==VERSION or vllm==VERSION, not {text!r}")
    return name, version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=_pin, help="the released wheel to compare from, e.g. vllm==0.33.0")
    parser.add_argument("new", type=_pin, help="the released wheel to compare to, e.g. vllm==0.34.0")
    parser.add_argument("--names-only", action="store_true", help="list the files, without their diffs")
    args = parser.parse_args(argv)
    if args.old[0] != args.new[0]:
        parser.error("both wheels must be of one engine")
    try:
        sys.stdout.write(diff(args.old[0], args.old[1], args.new[1], args.names_only))
    except engines.MissingWheel as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
