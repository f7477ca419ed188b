"""A scan report's tables for Arrow, pandas, polars and Parquet, built from the Rust columns.

Two tables: `adapters` (one row per adapter, failed ones included, null in every column that describes content;
`row` is the report's row) and `modules` (one row per module of every adapter that was read; `row` names its
adapter). Repeated strings (formats, module names, keys, dtypes) come from the core dictionary-encoded, as codes
and their distinct values, so no Python object is made per row for them. pyarrow, pandas and polars are
optional: each export imports its library when called (`pip install lorafast[arrow]`, `[pandas]`, `[polars]`).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from lorafast.scanning.results import ScanReport

Table = Literal["adapters", "modules"]
#: How string columns come: lists of str (None), Arrow buffers ("arrow"), or buffers where no escape was needed
#: ("exact").
Utf8 = Literal[None, "arrow", "exact"]

#: A column before conversion: ("num", values) | ("nullable", values, valid) | ("dict", codes, names)
#: | ("str", list of str or None) | ("utf8", offsets, bytes, valid, escaped): Arrow's buffers of a string column,
#: made by the core (`escaped`: a path's bytes that are not UTF-8 are written `\xNN`). Dictionary code -1 and valid
#: False are nulls.
Column = tuple[Any, ...]

STATUS_NAMES = ("ok", "problems", "error")


#: The adapter table's columns of unique strings.
STRING_COLUMNS = ("path", "weight_file", "config_path", "content_hash", "error_message")


def adapter_columns(report: ScanReport, utf8: Utf8 = None) -> Iterator[tuple[str, Column]]:
    """The adapter table's columns, in order. `utf8`: the string columns as Arrow's buffers where the core makes
    them, rather than lists of str (20,000 small adapters: a list of paths is 2.6 MB of str objects for 1.4 MB of
    text); with "exact", only a column that needed no escape (a path that is not UTF-8 stays a str of
    `os.fsdecode`, in a list). Each string column is made when it is reached, so that an export which copies it
    (polars) lets it go before the next one is made."""
    from lorafast.scanning._common import FLAGS, FORMATS, MOE_LAYOUTS, STATUS_ERROR

    cols = report.columns()
    # A failed row is null in every column that tells what the adapter holds: the core's columns have 0, "unknown"
    # and "dense" there, which a filter would take for data. One mask, from the status column, for every export.
    read = cols["status"] != STATUS_ERROR
    buffers = getattr(report._result, "string_buffers", None) if utf8 else None  # None: a merged result
    extra = report._result.table() if buffers is None else report._result.table(strings=False)

    def strings(name: str) -> Column:
        got = buffers(name) if buffers is not None else None
        if got is not None and not (utf8 == "exact" and got[3]):
            return ("utf8", *got)
        if name not in extra:  # past 2 GiB of text: the list after all
            extra.update(report._result.table())
        return ("str", report.paths if name == "path" else extra[name])

    def content(name: str) -> Column:
        return ("nullable", cols[name], read)

    def codes(name: str, names: tuple[str, ...]) -> Column:
        values = cols[name].astype(np.int32)
        values[~read] = -1  # code -1: null
        return ("dict", values, list(names))

    yield "row", ("num", cols["path_index"])
    yield "path", strings("path")
    yield "status", ("dict", cols["status"].astype(np.int32), list(STATUS_NAMES))
    yield "format", codes("format", FORMATS)
    yield "peft_type", ("dict", *extra["peft_type"])  # the core's own nulls: -1 for failed rows
    yield "base_model_name_or_path", ("dict", *extra["base_model_name_or_path"])
    yield "rank", content("rank")
    yield "num_tensors", content("num_tensors")
    yield "moe_layout", codes("moe_layout", MOE_LAYOUTS)
    yield "num_experts", content("num_experts")
    yield "num_layers", content("num_layers")
    yield "flags", content("flags")
    for bit, name in enumerate(FLAGS):
        yield f"flag_{name}", ("nullable", ((cols["flags"] >> bit) & 1).astype(bool), read)
    yield "num_problems", content("num_problems")
    yield "weight_file", strings("weight_file")
    yield "config_path", strings("config_path")
    yield "header_size", ("nullable", *extra["header_size"])
    yield "file_size", ("nullable", *extra["file_size"])
    yield "content_hash", strings("content_hash")
    yield "error_code", ("dict", *extra["error_code"])
    yield "error_message", strings("error_message")


def module_columns(report: ScanReport) -> Iterator[tuple[str, Column]]:
    for name, value in report._result.module_table().items():
        if not isinstance(value, tuple):  # row, scale (`LoraModule.scale`, computed by the core), use_rslora
            yield name, ("num", value)
        elif isinstance(value[1], list):
            yield name, ("dict", *value)
        else:
            yield name, ("nullable", *value)


def _columns(report: ScanReport, table: Table, utf8: Utf8 = None) -> Iterator[tuple[str, Column]]:
    """The table's columns, one at a time (the table is checked at the call, not at the first column)."""
    if table == "adapters":
        return adapter_columns(report, utf8)
    if table == "modules":
        return module_columns(report)
    raise ValueError(f"table must be 'adapters' or 'modules', not {table!r}")


def _utf8(values: list[str | None]) -> list[str | None]:
    """Paths that are not UTF-8 (surrogate-escaped by `os.fsdecode`) with their odd bytes as `\\xNN`, since
    Arrow strings must be UTF-8."""
    out: list[str | None] = []
    for v in values:
        if v is not None:
            try:
                v.encode()
            except UnicodeEncodeError:
                v = v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        out.append(v)
    return out


def _nulls(mask: np.ndarray) -> np.ndarray | None:
    """The mask, or None where nothing is null: pyarrow packed each mask into a bitmap even when empty (dense
    module table: 0.17 ms a column, about 2.5 ms of the table's 7.5 ms)."""
    return mask if mask.any() else None


def to_arrow(report: ScanReport, table: Table = "adapters") -> Any:
    import pyarrow as pa

    return pa.table(dict(_arrow_arrays(report, table)))


def _arrow_arrays(report: ScanReport, table: Table) -> Iterator[tuple[str, Any]]:
    """The table's columns as Arrow arrays, one at a time."""
    import pyarrow as pa

    # The system allocator, not pyarrow's default (mimalloc): these buffers are made once, and mimalloc's
    # reserved segments doubled the peak memory of an export (20,000 small adapters: 11.2 MB -> 5.7 MB for
    # 5.4 MB of tables). Number columns without nulls are numpy's buffers, not copies.
    pool = pa.system_memory_pool()
    for name, col in _columns(report, table, "arrow"):
        kind = col[0]
        if kind == "num":
            yield name, pa.array(col[1], memory_pool=pool)
        elif kind == "utf8":
            yield name, _arrow_utf8(col)
        elif kind == "nullable":
            yield name, pa.array(col[1], mask=_nulls(~col[2]), memory_pool=pool)
        elif kind == "dict":
            codes = col[1]
            indices = pa.array(codes, mask=_nulls(codes < 0), memory_pool=pool)
            values = pa.array(_utf8(col[2]), pa.string(), memory_pool=pool)
            # Not `safe`: the core's codes index its own names (null where -1), and checking the bounds of
            # 224,000 of them took 0.12 ms a column.
            yield name, pa.DictionaryArray.from_arrays(indices, values, safe=False, memory_pool=pool)
        else:
            try:
                yield name, pa.array(col[1], pa.string(), memory_pool=pool)
            except UnicodeEncodeError:
                yield name, pa.array(_utf8(col[1]), pa.string(), memory_pool=pool)


def _arrow_utf8(col: Column) -> Any:
    import pyarrow as pa

    offsets, data, valid = col[1:4]
    nulls = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.StringArray.from_buffers(len(valid), pa.py_buffer(offsets), pa.py_buffer(data), nulls)


def to_pandas(report: ScanReport, table: Table = "adapters") -> Any:
    import pandas as pd

    # Where pandas' str dtype is Arrow-backed (pandas 3 with pyarrow), a column of str is made from the core's
    # Arrow buffers, as `_pandas_strings` makes it from a list.
    str_dtype = pd.Series(["a"]).dtype  # what pandas makes of a column of str
    arrow_backed = getattr(str_dtype, "storage", None) == "pyarrow"
    data: dict[str, Any] = {}
    for name, col in _columns(report, table, "exact" if arrow_backed else None):
        kind = col[0]
        if kind == "num":
            data[name] = col[1]
        elif kind == "nullable":
            values, valid = col[1], col[2]
            if values.dtype.kind == "f":
                data[name] = pd.arrays.FloatingArray(values, ~valid)
            elif values.dtype.kind == "b":
                data[name] = pd.arrays.BooleanArray(values, ~valid)
            else:
                data[name] = pd.arrays.IntegerArray(values, ~valid)
        elif kind == "dict":
            data[name] = pd.Categorical.from_codes(col[1], categories=pd.Index(col[2], dtype=object))
        elif kind == "utf8":
            valid = col[3]
            # A column of None only: object, as pandas makes it from the list.
            data[name] = (
                pd.array(_arrow_utf8(col), dtype=str_dtype)
                if valid.any()
                else pd.array([None] * len(valid), dtype=object)
            )
        else:
            data[name] = _pandas_strings(pd, col[1])
    # copy=False: the columns are fresh, and consolidating them into 2D blocks copied every one.
    return pd.DataFrame(data, copy=False)


def _pandas_strings(pd: Any, values: list[str | None]) -> Any:
    """A column of str as pandas makes it from the list (pandas 3: its `str` dtype where every value is a str or
    None; object before), but where that dtype is Arrow-backed, made straight from an Arrow array: pandas' own
    inference went through an object copy of the column first (20,000 paths: 6.3 -> 3.8 MB added)."""
    column = pd.array(values, dtype=object)
    dtype = pd.Series(["a"]).dtype  # what pandas makes of a column of str
    if getattr(dtype, "storage", None) != "pyarrow" or pd.api.types.infer_dtype(values, skipna=True) != "string":
        return column
    import pyarrow as pa

    try:
        return pd.array(pa.array(values, pa.string(), memory_pool=pa.system_memory_pool()), dtype=dtype)
    except UnicodeEncodeError:
        # A path that is not UTF-8 (surrogate-escaped by `os.fsdecode`) cannot be Arrow's, and pandas' own
        # inference raises on it (pandas 3.1: `pd.Series(values)` raises UnicodeEncodeError): an object column,
        # in a Series so that the frame does not infer its dtype again.
        return pd.Series(column, dtype=object, copy=False)


def to_polars(report: ScanReport, table: Table = "adapters") -> Any:
    import polars as pl

    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return polars_from_columns(report, table)
    # From Arrow, taken over by polars mostly without a copy: on the dense module table (224,000 rows) this took
    # 9.3 ms, building each polars column from the core's columns 13.6 ms (masking nulls and picking categoricals
    # are a polars expression per column). Both give the same frame. A column at a time, so that the Arrow copy of
    # a string column is dropped once polars has its own (20,000 small adapters, with the core's string buffers
    # too: 14.3 -> 12.0 MB added for both tables, one run each; the measurement moves by about 2 MB).
    return pl.DataFrame([pl.Series(name, array) for name, array in _arrow_arrays(report, table)])


def polars_from_columns(report: ScanReport, table: Table = "adapters") -> Any:
    """`to_polars` with polars alone (without pyarrow)."""
    import polars as pl

    series = []
    for name, col in _columns(report, table):
        kind = col[0]
        if kind == "num":
            series.append(pl.Series(name, col[1]))
        elif kind == "nullable":
            s = pl.Series(name, col[1])
            series.append(pl.select(pl.when(pl.Series(col[2])).then(s).otherwise(None).alias(name)).to_series())
        elif kind == "dict":
            # The distinct values become a categorical first, and its rows are picked by code (null for -1), so no
            # string is made per row (gathering strings, then casting, cost most of a module table's time).
            codes = pl.Series(col[1])
            if len(col[2]):
                index = pl.select(pl.when(codes >= 0).then(codes)).to_series()
                s = pl.Series(name, col[2], dtype=pl.String).cast(pl.Categorical).gather(index)
            else:
                s = pl.Series(name, [None] * len(codes), dtype=pl.String).cast(pl.Categorical)
            series.append(s.alias(name))
        else:
            series.append(pl.Series(name, _utf8(col[1]), dtype=pl.String))
    return pl.DataFrame(series)


#: Columns whose Parquet statistics (null count, min, max) are written: the key a reader filters and joins on.
PARQUET_STATISTICS = ["row"]


def _parquet_column(name: str, col: Column) -> tuple[tuple[Any, ...], Any]:
    """The column as `_core.write_parquet` takes it, and its Arrow type (as `to_arrow` makes it)."""
    import pyarrow as pa

    kind = col[0]
    if kind == "num":
        return (name, "num", np.ascontiguousarray(col[1])), pa.from_numpy_dtype(col[1].dtype)
    if kind == "nullable":
        values, valid = np.ascontiguousarray(col[1]), np.ascontiguousarray(col[2])
        return (name, "nullable", values, valid), pa.from_numpy_dtype(values.dtype)
    if kind == "dict":
        codes = np.ascontiguousarray(col[1], dtype=np.int32)
        return (name, "dict", codes, _utf8(col[2])), pa.dictionary(pa.int32(), pa.string())
    if kind == "utf8":
        return (name, "utf8", col[1], col[2], col[3]), pa.string()
    # A list of str (a merged distributed result, or past 2 GiB of text): Arrow's buffers of it.
    array = pa.array(_utf8(col[1]), pa.large_string(), memory_pool=pa.system_memory_pool())
    _, offsets, data = array.buffers()
    return (
        name,
        "utf8",
        np.frombuffer(offsets, np.int64, len(array) + 1),
        np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8),
        array.is_valid().to_numpy(zero_copy_only=False),
    ), pa.string()


def _write_parquet(report: ScanReport, table: Table, path: str) -> None:
    """Written by the core (`rust/report/parquet.rs`) from the columns, with the Arrow schema `to_arrow` gives in the
    footer, as pyarrow stores it, so that Arrow readers get the same table back. pyarrow's own writer, one thread,
    took longer than the scan on module-heavy fleets (224,000 modules: 16-22 ms against a 12.5 ms scan)."""
    import pyarrow as pa

    from lorafast import _core

    columns, fields = [], []
    for name, col in _columns(report, table, "arrow"):
        column, arrow_type = _parquet_column(name, col)
        columns.append(column)
        fields.append(pa.field(name, arrow_type))
    schema = base64.b64encode(pa.schema(fields).serialize().to_pybytes())
    _core.write_parquet(path, columns, [("ARROW:schema", schema)], PARQUET_STATISTICS)


def to_parquet(report: ScanReport, path: str, modules_path: str | None = None) -> None:
    _write_parquet(report, "adapters", path)
    if modules_path is not None:
        _write_parquet(report, "modules", modules_path)


#: Records per batch that cross from Rust and are written at once, streaming to a file. Each batch's text is
#: held twice while it crosses (the core's buffer and the str): 20,000 small adapters streamed added 0.28x-0.31x
#: the columns at 1,024 a batch and 0.15x-0.19x at 256 (eight runs each), in the same time.
JSON_BATCH = 256
#: The same when the text is returned by pieces (indented, or from a merged distributed result): there 1,024 gave
#: 1.93x-1.98x the columns and 256 gave 2.13x-3.62x (eight runs each). Growing the text, glibc moved it more often
#: among the smaller batches' freed blocks. The compact text of a scan's own result is written whole by the core.
JSON_TEXT_BATCH = 1024


def _records(report: ScanReport, size: int) -> Iterator[list[dict[str, Any]]]:
    n = len(report)
    for start in range(0, n, size):
        batch = report._result.records(start, start + size)
        for rec in batch:
            rec.pop("config_json", None)
        if batch:
            yield batch


def _records_text(report: ScanReport, size: int) -> Iterator[str]:
    """The compact JSON of the records, a batch at a time: written by the core when it can (the text `json.dumps`
    gives, without a Python object per row), else by `json.dumps`."""
    result = report._result
    if not hasattr(result, "records_json"):  # a merged distributed result
        for batch in _records(report, size):
            yield json.dumps(batch)[1:-1]
        return
    for start in range(0, len(report), size):
        text = result.records_json(start, start + size)
        if text:
            yield text


def _errors(report: ScanReport) -> list[dict[str, str]]:
    return [{"path": p, "code": c, "message": m} for p, c, m in report.errors]


def _compact_head(report: ScanReport) -> str:
    """The compact text up to the adapters: `{"summary": ..., "errors": [...]`."""
    return '{"summary": ' + json.dumps(report.summary()) + ', "errors": ' + json.dumps(_errors(report))


def json_chunks(report: ScanReport, indent: int | str | None, records: bool, size: int) -> Iterator[str]:
    """Exactly `json.dumps({"summary", "errors"[, "adapters"]}, indent=indent)` in pieces, the adapters `size` at
    a time, so the whole text is never held."""
    if indent is None:
        yield _compact_head(report)
        if records:
            yield ', "adapters": ['
            first = True
            for text in _records_text(report, size):
                if not first:
                    yield ", "  # apart, not `", " + text`: that copied each batch's text once more
                yield text
                first = False
            yield "]"
        yield "}"
        return
    step = " " * indent if isinstance(indent, int) else indent

    def nested(value: Any, level: int) -> str:
        return json.dumps(value, indent=indent).replace("\n", "\n" + step * level)

    yield "{\n" + step + '"summary": ' + nested(report.summary(), 1)
    yield ",\n" + step + '"errors": ' + nested(_errors(report), 1)
    if records:
        yield ",\n" + step + '"adapters": ['
        first = True
        for batch in _records(report, size):
            parts = [step * 2 + nested(rec, 2) for rec in batch]
            yield ("\n" if first else ",\n") + ",\n".join(parts)
            first = False
        yield "]" if first else "\n" + step + "]"
    yield "\n}"


def json_text(report: ScanReport, indent: int | str | None, records: bool) -> str:
    result = report._result
    if indent is None and records and hasattr(result, "json_text"):
        # The core makes the str at its final length and writes the records into it: the text is held once.
        return str(result.json_text(_compact_head(report) + ', "adapters": [', "]}"))
    # `text += chunk` on a str nothing else refers to grows it in place in CPython (a realloc, no copy), so the
    # text is held once unless the allocator moves it; joining a list of the chunks held it twice (20,000 small
    # adapters: 20.6 -> 13.2 MB added for a 9.8 MB text). An io.StringIO copies its buffer again in getvalue().
    text = ""
    for chunk in json_chunks(report, indent, records, JSON_TEXT_BATCH):
        text += chunk
    return text


def json_to(report: ScanReport, fp: IO[str], indent: int | str | None, records: bool) -> None:
    for chunk in json_chunks(report, indent, records, JSON_BATCH):
        fp.write(chunk)
