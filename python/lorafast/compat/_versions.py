"""Which engine version a compat answer is for, and whether lorafast verified that version.

Every compat entry point takes `engine_version=`. Without it, the answer is for the engine installed in the
same environment (read from its distribution metadata, never imported), else for the newest version lorafast
supports. The per-version rule differences live next to the rules themselves; this module only names versions.

`SUPPORTED` is the one list of verified versions: the Makefile's `engines` target, the oracle tests, the README
table and `lorafast engines` all follow it (`python python/lorafast/compat/_versions.py --wheels` prints the
pins; this file imports nothing of lorafast so that the Makefile can run it before anything is built).

A version that is not in the list is still answered, with the rules of the verified version the code treats it
like (`EngineRules.rules`), and every answer says so: a `lorafast.UnverifiedEngineVersion` warning, the status
`"nearest: 0.34.0"` in results, `unknown` in preflight verdicts, and `strict_version=True` refuses it.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from importlib import metadata
from typing import NamedTuple

# Released versions whose code the oracle tests (tests/oracle) run; newest last.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "sglang": ("0.5.23",),
    "vllm": ("0.30.0", "0.33.0", "0.34.0"),
}

# What each verified release changed in the LoRA rules lorafast implements, against the verified release
# before it (`lorafast engines`). The details and the oracle cases are in docs/compat.md.
CHANGES: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang": {"0.5.23": ("the first verified release",)},
    "vllm": {
        "0.30.0": ("the first verified release",),
        "0.33.0": (
            "PEFTHelper takes lora_bias, init_lora_weights, aLoRA, layer_replication, BD-LoRA, QALoRA, "
            "rank_pattern and alpha_pattern",
            "modules_to_save may name classifier/score (the classification head's full weights)",
            "the rank checked against --max-lora-rank includes rank_pattern values",
            "per-module rank and scaling follow rank_pattern/alpha_pattern (PEFT's first match)",
            "fused (target_parameters) MoE LoRA on a 2-D MoE model is refused",
        ),
        "0.34.0": (
            "PEFTHelper takes task_type: SEQ_CLS and TOKEN_CLS adapters get classifier and score in modules_to_save",
            "a modules_to_save that is not iterable raises TypeError while the config is built",
            "modules that are not LoRA layers are reported as '<name> (not a LoRA layer)'",
        ),
    },
}

# N(.N)* with an optional PEP 440 pre-, post- or dev-release part and a local label (`+cu128`).
_VERSION = re.compile(
    r"v?(?P<release>\d+(?:\.\d+)*)(?P<suffix>(?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview|post|rev|r|dev)[-_.]?\d*)*)"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?",
    re.IGNORECASE,
)


class UnverifiedEngineVersion(UserWarning):
    """An engine version that lorafast's oracle tests have not run: the answer uses the rules of the nearest
    verified version (`EngineRules.rules`) and may be wrong where that release changed its LoRA code."""


class UnverifiedEngineVersionError(ValueError):
    """`strict_version=True` (`--strict-version`) and the engine version is not one lorafast verified."""


class EngineRules(NamedTuple):
    """The version an answer is for: what was asked (or found installed), and the verified rules that answer it."""

    engine: str
    requested: str
    rules: str
    verified: bool

    @property
    def status(self) -> str:
        """`"verified"`, `"nearest: 0.34.0"` (answered with that release's rules), or `"older than 0.5.23"`
        (answered with the older rules lorafast knows, which no oracle has run)."""
        if self.verified:
            return "verified"
        if parse(self.requested) < parse(SUPPORTED[self.engine][0]):
            return f"older than {self.rules}"
        return f"nearest: {self.rules}"

    def note(self) -> str:
        """One line for text output."""
        if self.verified:
            return f"{self.engine} {self.requested} (verified)"
        return f"{self.engine} {self.requested} is not verified by lorafast ({self.status}): the answer may differ"

    def at_least(self, minimum: str) -> bool:
        """Do these rules include a change made in `minimum`? (`at_least` for the version asked.)"""
        return at_least(self.engine, self.requested, minimum)

    def to_dict(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "requested": self.requested,
            "rules": self.rules,
            "verified": self.verified,
            "status": self.status,
        }


def parse(version: str) -> tuple[int, ...]:
    """`"0.5.23"` -> `(0, 5, 23)`; pre-release, dev and local suffixes (`rc1`, `.dev3`, `+cu128`) are dropped
    here (`is_verified` looks at them). Anything else is a `ValueError`."""
    m = _match(version)
    return tuple(int(p) for p in m.group("release").split("."))


def _match(version: str) -> re.Match[str]:
    if not isinstance(version, str):
        raise TypeError(f"engine_version must be a string such as '0.5.23', not {type(version).__name__}")
    m = _VERSION.fullmatch(version.strip())
    if m is None:
        raise ValueError(f"not an engine version: {version!r} (expected a release such as '0.5.23')")
    return m


def _padded(v: tuple[int, ...]) -> tuple[int, ...]:
    return v + (0,) * (3 - len(v)) if len(v) < 3 else v


def resolve(engine: str, engine_version: str | None = None) -> tuple[int, ...]:
    """The version an answer is for, as a comparable tuple (the requested one, not the rules' one); warns
    `UnverifiedEngineVersion` for a version lorafast has not verified (`rules_for`)."""
    return parse(rules_for(engine, engine_version).requested)


@functools.cache
def default_version(engine: str) -> str:
    """The installed engine's version, else the newest supported one. Looked up once per process: a metadata
    search stats every entry of sys.path, and rules ask for the version per tensor (a 1,000-adapter preflight
    spent half its time here)."""
    try:
        found = metadata.version(engine)
        parse(found)
        return found
    except (metadata.PackageNotFoundError, ValueError):
        return SUPPORTED[engine][-1]


@functools.cache
def _rules(engine: str, requested: str) -> EngineRules:
    m = _match(requested)
    asked = _padded(parse(requested))
    exact = not m.group("suffix")  # a local label (+cu128) is the same release; rc/dev/post are not
    known = [(_padded(parse(v)), v) for v in SUPPORTED[engine]]
    for v, name in known:
        if v == asked and exact:
            return EngineRules(engine, requested, name, True)
    # The code's version gates sit at the verified releases: a version between two of them, or a pre-release
    # of one, is answered like the next verified release up; one past the newest like the newest.
    above = [name for v, name in known if v >= asked]
    return EngineRules(engine, requested, above[0] if above else known[-1][1], False)


def rules_for(engine: str, engine_version: str | None = None, *, strict: bool = False) -> EngineRules:
    """The rules that answer `engine_version` (default: installed, else newest), warning once per call site
    with `UnverifiedEngineVersion` when it is not verified, or raising `UnverifiedEngineVersionError` with
    `strict=True`. Raises `ValueError` for a string that is not a version."""
    rules = _rules(engine, engine_version if engine_version is not None else default_version(engine))
    if not rules.verified:
        verified = ", ".join(SUPPORTED[engine])
        text = (
            f"{engine} {rules.requested} is not a version lorafast has verified against the engine's code "
            f"(verified: {verified}); "
            + (
                f"answering with the rules before {rules.rules} that lorafast keeps, which no oracle test has run"
                if rules.status.startswith("older")
                else f"answering with the rules of {rules.rules}"
            )
        )
        if strict:
            raise UnverifiedEngineVersionError(text.split(";")[0] + " (strict_version=True refuses it)")
        warnings.warn(text, UnverifiedEngineVersion, stacklevel=3)
    return rules


def at_least(engine: str, engine_version: str | None, minimum: str) -> bool:
    """Do the rules that answer `engine_version` include a change made in `minimum`? Versions between two
    verified releases take the newer one's rules (see `_rules`); versions before the oldest verified release
    are compared as they are, for the older rules lorafast keeps."""
    return _at_least(engine, engine_version if engine_version is not None else default_version(engine), minimum)


@functools.cache
def _at_least(engine: str, requested: str, minimum: str) -> bool:
    # Cached: rules ask per tensor name (a 500-adapter vLLM preflight made 35,000 calls).
    asked = parse(requested)
    if asked >= parse(SUPPORTED[engine][0]):
        asked = parse(_rules(engine, requested).rules)
    return asked >= parse(minimum)


def wheels() -> list[str]:
    """`name==version` of every verified release: the wheels the oracle tests run (`make engines`)."""
    return [f"{engine}=={v}" for engine, versions in SUPPORTED.items() for v in versions]


if __name__ == "__main__":  # `python _versions.py --wheels`: the Makefile's pins
    if sys.argv[1:] != ["--wheels"]:
        sys.exit("usage: python _versions.py --wheels")
    print(" ".join(wheels()))
