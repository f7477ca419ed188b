"""`ScanReport`, a scan's result as columns, and the typed `Adapter`s built from the core's rows."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal, overload

from lorafast import _core
from lorafast.adapter import ADAPTER_TYPES, Adapter, AdapterFormat, LoraModule, MoeLayout, Problem
from lorafast.scanning._common import FLAGS, FORMATS, MOE_LAYOUTS, STATUS_ERROR, STATUS_OK, STATUS_PROBLEMS, PathLike

if TYPE_CHECKING:
    import numpy as np


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _object(value: Any) -> dict[str, Any]:
    # A wrong-typed config field reads as absent, as in the core (which reports invalid_config_field).
    return dict(value) if isinstance(value, dict) else {}


def _config_fields(config_json: str | None, config_path: str | None) -> dict[str, Any]:
    """The `Adapter` fields read from the config text: `config`, `r`, `lora_alpha`, `use_rslora`, `rank_pattern`
    and `alpha_pattern`. Shared by `inspect` and report iteration, so both give the same adapter."""
    config = json.loads(config_json) if config_json else None
    if config is not None and not isinstance(config, dict):
        config = None
    # diffusers keeps a component-prefixed config in metadata; expose it without the prefix.
    if config is not None and config_path is None:
        prefix = next((k[: -len("r")] for k in config if k.endswith(".r")), "")
        config = {k[len(prefix) :]: v for k, v in config.items() if k.startswith(prefix)}
    cfg = config or {}
    return {
        "config": config,
        "r": _count(cfg.get("r")),
        "lora_alpha": _number(cfg.get("lora_alpha", cfg.get("alpha"))),  # PEFT LoHa/LoKr call it `alpha`
        "use_rslora": cfg.get("use_rslora") is True,
        "rank_pattern": _object(cfg.get("rank_pattern")),
        "alpha_pattern": _object(cfg.get("alpha_pattern")),
    }


def _counts(codes: Any, names: Sequence[str]) -> dict[str, int]:
    """How many of `codes` (a numpy array of indices into `names`) are each name, for the names that occur."""
    import numpy as np

    return {names[i]: n for i, n in enumerate(np.bincount(codes, minlength=len(names)).tolist()) if n}


def adapter_from_raw(raw: _core.RawAdapter) -> Adapter:
    modules: tuple[LoraModule, ...] = _core.make_modules(LoraModule, raw["modules"])
    return Adapter(
        path=raw["path"],
        weight_files=tuple(raw["weight_files"]),
        config_path=raw["config_path"],
        format=AdapterFormat(raw["format"]),
        peft_type=raw["peft_type"],
        num_tensors=raw["num_tensors"],
        dtypes=tuple(raw["dtypes"]),
        layers=tuple(raw["layers"]),
        base_model_name_or_path=raw["base_model_name_or_path"],
        target_modules=tuple(raw["target_modules"]),
        **_config_fields(raw["config_json"], raw["config_path"]),
        modules=modules,
        rank=raw["rank"],
        moe_layout=MoeLayout(raw["moe_layout"]),
        num_experts=raw["num_experts"],
        flags=frozenset(raw["flags"]),
        variants=tuple(raw["variants"]),
        full_weight_tensors=tuple(raw["full_weight_tensors"]),
        problems=tuple(Problem(*p) for p in raw["problems"]),
        content_hash=raw["content_hash"],
        metadata=raw["metadata"],
    )


class ScanReport:
    """The result of `scan`: one row per adapter found, failed ones included.

    Bulk data stays in Rust until asked for: `columns()` gives numpy arrays; `to_arrow()`, `to_pandas()`,
    `to_polars()` and `to_parquet()` give the adapter table and the per-module table; iterating gives
    `Adapter`s, built in batches from what the scan kept (no file is read again).
    """

    def __init__(self, result: Any, *, remote: Mapping[str, Any] | None = None) -> None:
        self._result = result
        self.paths: list[str] = result.paths()
        self._errors = result.errors()
        # How the scan reached URLs (storage_options, timeout, concurrency).
        self._remote: dict[str, Any] = dict(remote or {})

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def errors(self) -> list[tuple[str, str, str]]:
        """(path, code, message) for every adapter that could not be read."""
        return [(path, code, message) for _, path, code, message in self._errors]

    @property
    def ok_paths(self) -> list[str]:
        failed = {row for row, *_ in self._errors}
        return [p for i, p in enumerate(self.paths) if i not in failed]

    def __iter__(self) -> Iterator[Adapter]:
        """The adapters that were read, in scan order (failed rows are in `.errors`). Built from the scan's
        results in batches (at most 512 adapters or about 32,768 tensors): equal, field by field, to what
        `inspect` of each path gives, without reading any file again. An adapter's `modules` are built when first
        read (or when it is copied or pickled)."""
        import numpy as np

        n = len(self)
        if n == 0:
            return
        # Batch ends: every 512 rows, and wherever the running tensor count crosses a multiple of 32,768.
        tensors = np.cumsum(self.columns()["num_tensors"], dtype=np.int64)
        ends = set(range(512, n, 512)) | set((np.flatnonzero(np.diff(tensors // 32768)) + 1).tolist())
        build = getattr(self._result, "adapter_objects", None)  # None: a merged distributed result
        start = 0
        for stop in [*sorted(ends), n]:
            if build is None:
                yield from map(adapter_from_raw, self._result.adapters(start, stop))
            else:
                adapters, configs = build(start, stop, ADAPTER_TYPES)
                for i, text in configs:
                    adapters[i].__dict__.update(_config_fields(text, adapters[i].config_path))
                # Handed over, not held: an adapter the caller drops dies with its modules, young. Kept in the
                # batch, a batch's modules (16,000 on a dense fleet) outlived the young collections and
                # triggered full ones, over every object of the process (pandas' included).
                adapters.reverse()
                while adapters:
                    yield adapters.pop()
            start = stop

    def columns(self) -> dict[str, np.ndarray]:
        """Columns as numpy arrays, one row per adapter: path_index, status, format, rank,
        num_tensors, moe_layout, num_experts, num_layers, flags (bits, see `FLAGS`), num_problems.

        numpy has no nulls: a failed row (status `STATUS_ERROR`) holds placeholders that are not data (0 in every
        number column, format "unknown", layout "dense"). Mask them with `status != STATUS_ERROR`, as the table
        exports do, where those rows are null."""
        return self._result.columns()

    def record(self, i: int) -> dict[str, Any] | None:
        """Summary of row `i` as a dict (no per-module detail); None for a failed row."""
        return self._result.record(i)

    def summary(self) -> dict[str, Any]:
        """Counts per format and layout, a rank histogram, problems and the union of target modules."""
        import numpy as np

        cols = self.columns()
        ok = cols["status"] != STATUS_ERROR
        # Counted by numpy: lists of every row's values were most of the summary's memory, held on by the
        # allocator while `to_json` then wrote its text.
        fmt = _counts(cols["format"][ok], FORMATS)
        moe = _counts(cols["moe_layout"][ok], MOE_LAYOUTS)
        values, counts = np.unique(cols["rank"][ok], return_counts=True)
        ranks = dict(zip(values.tolist(), counts.tolist(), strict=True))
        flag_counts = {name: int(((cols["flags"][ok] >> bit) & 1).sum()) for bit, name in enumerate(FLAGS)}
        used = sorted(self._result.target_modules(per_row=False)[0])  # every name is some adapter's
        return {
            "adapters": len(self),
            "ok": int((cols["status"] == STATUS_OK).sum()),
            "with_problems": int((cols["status"] == STATUS_PROBLEMS).sum()),
            "failed": int((cols["status"] == STATUS_ERROR).sum()),
            "formats": dict(sorted(fmt.items())),
            "moe_layouts": dict(sorted(moe.items())),
            "rank_histogram": {str(k): v for k, v in sorted(ranks.items())},
            "flags": {k: v for k, v in flag_counts.items() if v},
            "target_modules": used,
            "errors_by_code": dict(Counter(code for _, code, _ in self.errors)),
        }

    @overload
    def to_json(self, fp: None = None, *, indent: int | str | None = None, records: bool = True) -> str: ...

    @overload
    def to_json(self, fp: IO[str], *, indent: int | str | None = None, records: bool = True) -> None: ...

    def to_json(
        self, fp: IO[str] | None = None, *, indent: int | str | None = None, records: bool = True
    ) -> str | None:
        """The summary, the errors and (with `records`) one summary record per adapter, as JSON: the text of
        `json.dumps` of that dict. With `fp`, a text file object, it is written there a batch of records at a
        time and never held whole; without, it is returned."""
        from lorafast.scanning.report import json_text, json_to

        if fp is None:
            return json_text(self, indent, records)
        json_to(self, fp, indent, records)
        return None

    def to_arrow(self, table: Literal["adapters", "modules"] = "adapters") -> Any:
        """A `pyarrow.Table` (`pip install lorafast[arrow]`): `table="adapters"`, one row per adapter (`row` is
        the report's row, failed rows included and null in every column but `row`, `path`, `status`, `error_code`
        and `error_message`, repeated strings dictionary-encoded, a `flag_*` column per flag); or
        `table="modules"`, one row per module of every adapter read, `row` naming its adapter."""
        from lorafast.scanning.report import to_arrow

        return to_arrow(self, table)

    def to_pandas(self, table: Literal["adapters", "modules"] = "adapters") -> Any:
        """The table of `to_arrow` as a `pandas.DataFrame` (categoricals and nullable integers), built with
        pandas alone."""
        from lorafast.scanning.report import to_pandas

        return to_pandas(self, table)

    def to_polars(self, table: Literal["adapters", "modules"] = "adapters") -> Any:
        """The table of `to_arrow` as a `polars.DataFrame` (through Arrow when pyarrow is installed, else from the
        columns with polars alone)."""
        from lorafast.scanning.report import to_polars

        return to_polars(self, table)

    def to_parquet(self, path: PathLike, modules_path: PathLike | None = None) -> None:
        """Writes the adapter table to `path` and, when given, the module table to `modules_path`, as Parquet (written
        by the core; pyarrow gives the Arrow schema stored with it, so read back they equal `to_arrow`'s)."""
        from lorafast.scanning.report import to_parquet

        to_parquet(self, os.fspath(path), None if modules_path is None else os.fspath(modules_path))
