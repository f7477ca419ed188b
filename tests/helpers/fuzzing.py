"""Test sizes that follow the hypothesis profile (tests/conftest.py), and the settings of the differential fuzz
passes.

- `scaled(n)`: `n` examples under the `default` profile, scaled with the loaded one (`dev` a tenth, `fuzz` ten
  times), for a test whose examples cost more than the profile's size allows;
- `seeded_pass(name, tmp_path, seconds)`: a short seeded libFuzzer pass of the atheris harness
  tests/fuzz/fuzz_<name>.py in a child process, from its seeds and the kept corpus tests/fuzz-corpus/<name>/; fails
  on any saved finding;
- `probe(name, code, tmp_path, timeout)`: `code` run in a child after `f = fuzz_<name>` and `h = f.Harness(tmp_path)`;
- `fuzz(short)`: the settings of a differential fuzz pass (test_convert_fuzz.py, test_index_fuzz.py,
  test_base_fuzz.py): `scaled(short)` inputs, derandomized, in the suite; `LORAFAST_FUZZ_CASES=N` for N inputs and
  `LORAFAST_FUZZ_SEED` for a seed of its own, as `make fuzz` runs the core's harnesses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, seed, settings

#: The folder of the atheris harnesses, and the one of their kept corpora.
FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
CORPUS = FUZZ.parent / "fuzz-corpus"

#: The `default` profile's max_examples (tests/conftest.py), the size `scaled` is relative to.
DEFAULT_EXAMPLES = 200


def scaled(n: int) -> int:
    return max(1, n * settings.default.max_examples // DEFAULT_EXAMPLES)


def fuzz(short: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    cases = int(os.environ.get("LORAFAST_FUZZ_CASES") or scaled(short))
    chosen = os.environ.get("LORAFAST_FUZZ_SEED")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = settings(
            max_examples=cases,
            deadline=None,
            derandomize=chosen is None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(fn)
        return seed(int(chosen))(fn) if chosen is not None else fn

    return wrap


def seeded_pass(name: str, tmp_path: Path, seconds: int) -> tuple[int, int, int]:
    """Run `fuzz_<name>.py --seeds` then `seconds` of libFuzzer (seed 1) over a new folder, the seeds and the kept
    corpus (the committed corpus stays as it is: libFuzzer writes new inputs into the first folder); assert that it
    ended cleanly with no crash, hang, timeout, out-of-memory or finding saved. Returns (seeds written, kept inputs,
    runs done)."""
    harness, kept = FUZZ / f"fuzz_{name}.py", CORPUS / name
    seeds = tmp_path / "seeds"
    subprocess.run([sys.executable, str(harness), "--seeds", str(seeds)], check=True, timeout=300)
    n_seeds = len(list(seeds.iterdir()))
    new = tmp_path / "new"
    new.mkdir()
    argv = [sys.executable, str(harness), "-seed=1", f"-max_total_time={seconds}", "-timeout=60",
            "-rss_limit_mb=4096", f"-artifact_prefix={tmp_path}/", str(new), str(seeds), str(kept)]  # fmt: skip
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=seconds + 240,
        env={**os.environ, "LORAFAST_FUZZ_OUT": str(tmp_path)},
    )
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    found = [
        p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "hang-", "timeout-", "oom-", "finding-"))
    ]
    assert not found, tail
    runs = re.search(r"Done (\d+) runs", proc.stderr)
    assert runs is not None, tail
    return n_seeds, len(list(kept.iterdir())), int(runs.group(1))


def probe(name: str, code: str, tmp_path: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    start = f"import sys\nfrom pathlib import Path\nsys.path.insert(0, {str(FUZZ)!r})\nimport fuzz_{name} as f\n"
    code = f"{start}h = f.Harness(Path({str(tmp_path)!r}))\n{code}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
