"""PEFT's `adapter_config.json` rules that lorafast applies in several places, one copy each."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any


def peft_pattern_key(patterns: Iterable[str], name: str) -> str | None:
    """PEFT `get_pattern_key`: the first `rank_pattern`/`alpha_pattern` key, in saved order, for which
    `re.match(rf"(.*\\.)?({key})$", name)` holds on the prefix-free module name; None when none does."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", name):
                return key
        except re.error:  # PEFT would fail on it too; it matches nothing here
            continue
    return None


def peft_pattern_value(patterns: Mapping[str, Any], name: str) -> Any:
    """PEFT's first-match rule: the value of the first pattern key (in order) that matches the end of `name`."""
    key = peft_pattern_key(patterns, name)
    return None if key is None else patterns[key]
