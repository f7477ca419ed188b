"""Released engine wheels as test oracles: where they are cached, how they are unpacked, how they are run.

`make engines` (part of `make setup`) fetches each pinned wheel with `pip download --no-deps` into
`.cache/engines/`. The wheels are never installed: `unpacked()` extracts only their Python sources (no compiled
extensions, no CUDA kernels) into `.cache/engines/<name>-<version>/`, and `run()` imports them in a child
process, with the stubs of `tests/oracle/stubs.py`, so that two versions of one engine never meet in one
interpreter and no stub leaks into the rest of the test suite. Tests make no network call: a missing wheel is a
failure that says to run `make engines`, never a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from lorafast.compat import VERIFIED_VERSIONS

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LORAFAST_ENGINE_CACHE", ROOT / ".cache" / "engines"))

# Every pinned release the oracle tests run against, newest first: lorafast's one list of verified versions
# (the Makefile's `engines` target fetches the same list).
PINNED: dict[str, tuple[str, ...]] = {engine: tuple(reversed(v)) for engine, v in VERIFIED_VERSIONS.items()}

_KEEP_SUFFIXES = (".py", ".json", ".txt", ".jinja", ".yaml", ".yml")


class MissingWheel(RuntimeError):
    pass


def wheel(name: str, version: str) -> Path:
    found = sorted(CACHE.glob(f"{name}-{version}-*.whl"))
    if not found:
        raise MissingWheel(f"{name}=={version} wheel not in {CACHE}; run `make engines` (pip download --no-deps)")
    return found[0]


def unpacked(name: str, version: str) -> Path:
    """The folder holding the wheel's Python sources; extracted once, atomically (safe across processes)."""
    dest = CACHE / f"{name}-{version}"
    if (dest / ".complete").exists():
        return dest
    whl = wheel(name, version)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{version}-", dir=CACHE))
    with zipfile.ZipFile(whl) as zf:
        for info in zf.infolist():
            if info.filename.endswith(_KEEP_SUFFIXES) and ".dist-info/" not in info.filename:
                zf.extract(info, tmp)
    (tmp / ".complete").write_text(whl.name)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process won the race; use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def run(runner: str, name: str, version: str, payload: Any, *, timeout: float = 600) -> Any:
    """Run `tests/oracle/<runner>.py` in a child interpreter with the engine's sources first on sys.path.

    The runner reads a JSON payload on stdin and writes a JSON result on stdout.
    """
    src = unpacked(name, version)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT / "tests" / "oracle"), env.get("PYTHONPATH", "")])
    env["LORAFAST_ORACLE_ENGINE"] = f"{name}=={version}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "oracle" / f"{runner}.py")],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"oracle runner {runner} ({name}=={version}) failed:\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout)
