"""Which engine version a compat answer is for.

Every compat entry point takes `engine_version=`. Without it, the answer is for the engine installed in the
same environment (read from its distribution metadata, never imported), else for the newest version lorafast
supports. The per-version rule differences live next to the rules themselves; this module only names versions.
"""

from __future__ import annotations

import functools
from importlib import metadata

# Released versions whose code the oracle tests (tests/oracle) run; newest last.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "sglang": ("0.5.23",),
    "vllm": ("0.30.0", "0.33.0"),
}


def parse(version: str) -> tuple[int, ...]:
    """`"0.5.23"` -> `(0, 5, 23)`; local and pre-release suffixes (`.dev3`, `+cu128`, `rc1`) are ignored."""
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"not an engine version: {version!r}")
    return tuple(parts)


def resolve(engine: str, engine_version: str | None = None) -> tuple[int, ...]:
    """The version an answer is for, as a comparable tuple."""
    if engine_version is not None:
        if not isinstance(engine_version, str):
            raise TypeError(f"engine_version must be a string such as '0.5.23', not {type(engine_version).__name__}")
        return parse(engine_version)
    return _default(engine)


@functools.cache
def _default(engine: str) -> tuple[int, ...]:
    """The installed engine's version, else the newest supported one. Looked up once per process: a metadata
    search stats every entry of sys.path, and rules ask for the version per tensor (a 1,000-adapter preflight
    spent half its time here)."""
    try:
        return parse(metadata.version(engine))
    except (metadata.PackageNotFoundError, ValueError):
        return parse(SUPPORTED[engine][-1])


def at_least(engine: str, engine_version: str | None, minimum: str) -> bool:
    return resolve(engine, engine_version) >= parse(minimum)
