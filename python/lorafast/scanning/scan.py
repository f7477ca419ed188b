"""`inspect` (one adapter) and `scan` (many, in parallel) with their typed results."""

from __future__ import annotations

import json
import operator
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal, overload

from . import _core
from .adapter import _ADAPTER_FIELDS, Adapter, AdapterFormat, LoraModule, MoeLayout, Problem

if TYPE_CHECKING:
    import numpy as np

PathLike = str | os.PathLike[str]

#: Codes of the `status` column.
STATUS_OK, STATUS_PROBLEMS, STATUS_ERROR = 0, 1, 2
#: Column code -> name, in code order.
FORMATS: tuple[str, ...] = tuple(_core.FORMATS)
MOE_LAYOUTS: tuple[str, ...] = tuple(_core.MOE_LAYOUTS)
FLAGS: tuple[str, ...] = tuple(_core.FLAGS)

#: Scans of at least this many adapters show a progress bar when stderr is a terminal.
PROGRESS_THRESHOLD = 5000


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


def _adapter(raw: _core.RawAdapter) -> Adapter:
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


#: What the core builds report iteration's objects from (`ScanResult.adapter_objects`): the classes, the enum
#: members in column-code order, and `Adapter`'s field names in order.
_ADAPTER_TYPES = (
    Adapter,
    LoraModule,
    Problem,
    tuple(AdapterFormat(name) for name in FORMATS),
    tuple(MoeLayout(name) for name in MOE_LAYOUTS),
    _ADAPTER_FIELDS,
)


def _storage_items(storage_options: Mapping[str, Any] | None) -> list[tuple[str, str]] | None:
    """Store options as the strings object stores take (`True` -> "true"; a mapping, such as `headers`, as JSON)."""
    if storage_options is None:
        return None
    return [(str(k), _option_text(v)) for k, v in storage_options.items()]


def _option_text(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return json.dumps(dict(v)) if isinstance(v, Mapping) else str(v)


def _check_threads(threads: Any) -> int | None:
    """`threads` as the core takes it: None or a positive int (not a bool, a float or 0, which the core would
    otherwise read as "all cores" or truncate)."""
    if threads is None:
        return None
    try:
        if isinstance(threads, bool):
            raise TypeError
        n = operator.index(threads)  # int and numpy integers; not float
    except TypeError:
        raise TypeError(f"threads must be a positive int or None, not {type(threads).__name__} {threads!r}") from None
    if n < 1:
        raise ValueError(f"threads must be at least 1, not {n}")
    return n


def inspect(
    path: PathLike,
    *,
    content_hash: bool = False,
    mode: Literal["pread", "mmap"] = "pread",
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Adapter:
    """Classify one adapter: a PEFT folder, a folder holding one `.safetensors`, or a `.safetensors` file.

    Reads `adapter_config.json` and the safetensors header (plus kohya's few-byte `.alpha`
    scalars); never the tensor data, unless `content_hash=True` asks for the sha256 of the data
    section. `path` may be a URL (s3://, gs://, az://, http(s)://, hf://; see `scan`).
    Raises `HeaderError`, `AdapterError` or an `OSError` subclass.
    """
    raw = _core.inspect(os.fsdecode(path), mode, content_hash, _storage_items(storage_options), timeout)
    return _adapter(raw)


def inspect_many(
    paths: PathLike | bytes | Sequence[PathLike],
    *,
    content_hash: bool = False,
    threads: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    concurrency: int | None = None,
) -> list[Adapter | Exception]:
    """`inspect` for many paths or URLs in parallel; a failure comes back as its exception, in place.

    A single path (str, bytes or os.PathLike) is one adapter, as in `scan`, not a sequence of characters.
    """
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [os.fsdecode(paths)]
    elif not isinstance(paths, Iterable):
        raise TypeError(f"paths must be a path or a sequence of paths, not {type(paths).__name__}")
    plist = [os.fsdecode(p) for p in paths]
    raw = _core.inspect_many(
        plist, "pread", content_hash, _check_threads(threads), _storage_items(storage_options), timeout, concurrency
    )
    return [r if isinstance(r, Exception) else _adapter(r) for r in raw]


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
                yield from map(_adapter, self._result.adapters(start, stop))
            else:
                adapters, configs = build(start, stop, _ADAPTER_TYPES)
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
        from .report import json_text, json_to

        if fp is None:
            return json_text(self, indent, records)
        json_to(self, fp, indent, records)
        return None

    def to_arrow(self, table: Literal["adapters", "modules"] = "adapters") -> Any:
        """A `pyarrow.Table` (`pip install lorafast[arrow]`): `table="adapters"`, one row per adapter (`row` is
        the report's row, failed rows included and null in every column but `row`, `path`, `status`, `error_code`
        and `error_message`, repeated strings dictionary-encoded, a `flag_*` column per flag); or
        `table="modules"`, one row per module of every adapter read, `row` naming its adapter."""
        from .report import to_arrow

        return to_arrow(self, table)

    def to_pandas(self, table: Literal["adapters", "modules"] = "adapters") -> Any:
        """The table of `to_arrow` as a `pandas.DataFrame` (categoricals and nullable integers), built with
        pandas alone."""
        from .report import to_pandas

        return to_pandas(self, table)

    def to_polars(self, table: Literal["adapters", "modules"] = "adapters") -> Any:
        """The table of `to_arrow` as a `polars.DataFrame` (through Arrow when pyarrow is installed, else from the
        columns with polars alone)."""
        from .report import to_polars

        return to_polars(self, table)

    def to_parquet(self, path: PathLike, modules_path: PathLike | None = None) -> None:
        """Writes the adapter table to `path` and, when given, the module table to `modules_path`, as Parquet (written
        by the core; pyarrow gives the Arrow schema stored with it, so read back they equal `to_arrow`'s)."""
        from .report import to_parquet

        to_parquet(self, os.fspath(path), None if modules_path is None else os.fspath(modules_path))


def _want_progress(progress: bool | None, n_hint: int) -> bool:
    if progress is not None:
        return progress
    return n_hint >= PROGRESS_THRESHOLD and sys.stderr.isatty()


def scan(
    paths: PathLike | Iterable[PathLike],
    *,
    recursive: bool = True,
    threads: int | None = None,
    progress: bool | None = None,
    content_hash: bool = False,
    mode: Literal["pread", "mmap"] = "pread",
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    concurrency: int | None = None,
    backend: Literal["local", "ray"] = "local",
    ray_address: str | None = None,
) -> ScanReport:
    """Find and classify every adapter under `paths` in parallel, with the GIL released.

    One bad adapter never stops the scan: it becomes a row with status `STATUS_ERROR` and an
    entry in `.errors`. `threads` defaults to `LORAFAST_NUM_THREADS` or the available cores. A scan uses at
    most 256 threads, whatever is asked, and no more than the paths given when none of them is a folder.
    `progress=None` shows a bar on stderr for long scans when stderr is a terminal. `threads` must be a positive
    int (`TypeError` for a bool or float, `ValueError` for 0 or less).

    Paths may be URLs: `s3://bucket/prefix/`, `gs://`, `az://`, `http(s)://` and
    `hf://org/repo[@revision]/path`. Only headers and configs are fetched, with range requests,
    `concurrency` (default 64) at a time. `storage_options` go to the store (`endpoint`, `region`,
    `allow_http`, ...); credentials come from each store's usual environment. `timeout` (seconds,
    default 10) bounds each request; transient failures are retried with backoff.

    `backend="ray"` splits the adapters into shards scanned by Ray tasks (`lorafast[ray]`,
    see `lorafast.distributed`); the report is identical to a local scan's.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    plist = [os.fsdecode(p) for p in paths]
    threads = _check_threads(threads)
    remote: dict[str, Any] = {"storage_options": storage_options, "timeout": timeout, "concurrency": concurrency}
    if backend == "ray":
        from .distributed import scan as ray_scan

        return ray_scan(
            plist,
            recursive=recursive,
            content_hash=content_hash,
            mode=mode,
            address=ray_address,
            storage_options=storage_options,
            timeout=timeout,
            concurrency=concurrency,
        )
    if backend != "local":
        raise ValueError(f"backend must be 'local' or 'ray', not {backend!r}")
    show = _want_progress(progress, PROGRESS_THRESHOLD if progress is None and sys.stderr.isatty() else 0)
    result = _core.scan(
        plist, recursive, threads, mode, content_hash, show, _storage_items(storage_options), timeout, concurrency
    )
    return ScanReport(result, remote=remote)
