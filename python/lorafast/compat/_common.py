"""Shared pieces of the engine checks: adapter references, ids and collected problems."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafast.adapter import Adapter
    from lorafast.compat._inputs import AdapterView


def lora_id(name: str, path: str) -> str:
    """The id SGLang gives an adapter loaded as `--lora-paths NAME=PATH` (`LoRARef.deterministic_id`)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


@dataclass(frozen=True)
class LoraRef:
    """One adapter as an engine refers to it: a name, a path, and SGLang's id for the pair.

    `adapter` may carry an already scanned `lorafast.Adapter` (or an `AdapterView`) so nothing is read
    again; otherwise `path` is scanned. `lora_id` defaults to SGLang's uuid5 of `name` and `path`.
    """

    name: str
    path: str
    pinned: bool = False
    lora_id: str = ""
    adapter: Adapter | AdapterView | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.lora_id:
            object.__setattr__(self, "lora_id", lora_id(self.name, self.path))


@dataclass(frozen=True)
class CompatProblem:
    """One thing an engine would reject (or silently get wrong) for one adapter.

    `error` is the exception the engine raises, with its exact type and message; `fatal` is False for
    what the engine only logs (a warning) or does not notice at all (lorafast's own findings).
    """

    code: str
    message: str
    error: BaseException | None = None
    adapter_id: str | None = None
    adapter_name: str | None = None
    stage: str = ""
    fatal: bool = True

    @property
    def exc_type(self) -> str:
        return type(self.error).__name__ if self.error is not None else ""

    def raise_(self) -> None:
        if self.error is None:
            raise RuntimeError(self.message)
        raise self.error


class Collector:
    """Gathers problems; when not collecting, the first fatal one is raised at once (engine order)."""

    def __init__(self, collect: bool) -> None:
        self.collect = collect
        self.problems: list[CompatProblem] = []

    def add(self, problem: CompatProblem) -> None:
        self.problems.append(problem)
        if problem.fatal and not self.collect:
            problem.raise_()

    def fail(
        self,
        code: str,
        error: BaseException,
        *,
        stage: str,
        adapter_id: str | None = None,
        adapter_name: str | None = None,
    ) -> None:
        self.add(CompatProblem(code, str(error), error, adapter_id, adapter_name, stage, True))

    def warn(
        self, code: str, message: str, *, stage: str, adapter_id: str | None = None, adapter_name: str | None = None
    ) -> None:
        self.add(CompatProblem(code, message, None, adapter_id, adapter_name, stage, False))
