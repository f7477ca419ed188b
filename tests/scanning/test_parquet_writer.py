"""The core's Parquet writer (`rust/report/parquet.rs`, behind `ScanReport.to_parquet`), read back by pyarrow's reader:
random columns of every kind the report tables hold, with nulls, over page and row-group boundaries."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.fuzzing import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from lorafast import _core  # noqa: E402
from lorafast.scanning.report import _parquet_column  # noqa: E402

NUMBER_DTYPES = [np.bool_, np.uint32, np.uint64, np.int32, np.int64, np.float32, np.float64]


def _write(path, columns: dict, statistics=("row",)) -> None:
    pairs = [_parquet_column(name, col) for name, col in columns.items()]
    schema = pa.schema([pa.field(name, t) for name, (_, t) in zip(columns, pairs, strict=True)])
    import base64

    meta = [("ARROW:schema", base64.b64encode(schema.serialize().to_pybytes()))]
    _core.write_parquet(path, [c for c, _ in pairs], meta, list(statistics))


def _arrow(col):
    """What `to_arrow` makes of a column (the expected table)."""
    kind = col[0]
    if kind == "num":
        return pa.array(col[1])
    if kind == "nullable":
        return pa.array(col[1], mask=~col[2])
    if kind == "dict":
        codes = col[1]
        return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), pa.array(col[2], pa.string()))
    return pa.array(col[1], pa.string())


@st.composite
def tables(draw):
    n = draw(st.sampled_from([0, 1, 7, 8, 9, 300, 70_000]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    columns = {}
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["num", "nullable", "dict", "str"]))
        # Runs as well as noise, so that both halves of the RLE/bit-packing hybrid are exercised.
        runs = draw(st.booleans())
        if kind in ("num", "nullable"):
            dtype = draw(st.sampled_from(NUMBER_DTYPES))
            if dtype == np.bool_:
                values = rng.integers(0, 2, n).astype(bool)
            elif np.issubdtype(dtype, np.floating):
                values = rng.normal(size=n).astype(dtype)
            else:
                info = np.iinfo(dtype)
                values = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
            if runs:
                values = np.sort(values)
            if kind == "num":
                columns[f"c{i}"] = ("num", values)
            else:
                columns[f"c{i}"] = ("nullable", values, rng.random(n) < draw(st.sampled_from([0.0, 0.5, 1.0])))
        elif kind == "dict":
            names = draw(st.lists(st.text(max_size=12), max_size=300, unique=True))
            codes = rng.integers(-1 if draw(st.booleans()) else 0, max(len(names), 1), n).astype(np.int32)
            codes[codes >= len(names)] = -1
            columns[f"c{i}"] = ("dict", np.sort(codes) if runs else codes, names)
        else:
            pool = draw(st.lists(st.one_of(st.none(), st.text(max_size=40)), min_size=1, max_size=20))
            columns[f"c{i}"] = ("str", [pool[k] for k in rng.integers(0, len(pool), n)])
    return columns


@settings(max_examples=scaled(40), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(columns=tables())
def test_random_tables_read_back_as_written(tmp_path, columns):
    path = os.path.join(tmp_path, "t.parquet")
    _write(path, columns)
    want = pa.table({name: _arrow(col) for name, col in columns.items()})
    got = pq.read_table(path)
    assert got.schema.equals(want.schema, check_metadata=False)
    assert got.equals(want), (got, want)


def test_a_table_past_a_row_group_reads_back_with_statistics_per_group(tmp_path):
    n = (1 << 20) + 1000
    rows = np.arange(n, dtype=np.uint32) // 3
    codes = (np.arange(n) % 5).astype(np.int32)
    codes[::7] = -1
    columns = {"row": ("num", rows), "name": ("dict", codes, ["a", "bb", "", "é", "x" * 100])}
    path = os.path.join(tmp_path, "big.parquet")
    _write(path, columns)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 2
    first, second = (meta.row_group(i).column(0).statistics for i in range(2))
    assert (first.min, first.max) == (0, rows[(1 << 20) - 1])
    assert (second.min, second.max, second.null_count) == (rows[1 << 20], rows[-1], 0)
    assert pq.read_table(path).equals(pa.table({name: _arrow(col) for name, col in columns.items()}))


def test_statistics_order_unsigned_values_as_unsigned(tmp_path):
    values = np.array([1, 2**63, 2**64 - 1, 5], dtype=np.uint64)
    path = os.path.join(tmp_path, "u.parquet")
    _write(path, {"row": ("nullable", values, np.array([True, True, True, False]))})
    stats = pq.ParquetFile(path).metadata.row_group(0).column(0).statistics
    assert (stats.min, stats.max, stats.null_count) == (1, 2**64 - 1, 1)


def test_long_strings_are_split_into_pages_and_read_back(tmp_path):
    values = [f"s{i}-" + "y" * 50_000 for i in range(100)]  # 5 MB: pages of about 256 KiB
    path = os.path.join(tmp_path, "s.parquet")
    _write(path, {"s": ("str", values)})
    assert pq.read_table(path).column("s").to_pylist() == values


@pytest.mark.parametrize(
    "columns, message",
    [
        ({"a": ("dict", np.array([0, 2], np.int32), ["x"])}, "past its dictionary"),
        ({"a": ("num", np.zeros(2, np.uint32)), "b": ("num", np.zeros(3, np.uint32))}, "rows, the table has 2"),
        ({"a": ("nullable", np.zeros(2, np.uint32), np.ones(3, bool))}, "one per row"),
    ],
)
def test_inconsistent_columns_are_a_value_error_and_write_nothing_bad(tmp_path, columns, message):
    path = os.path.join(tmp_path, "bad.parquet")
    with open(path, "wb") as f:
        f.write(b"kept")
    with pytest.raises(ValueError, match=message):
        _write(path, columns)
    with open(path, "rb") as f:
        assert f.read() == b"kept"  # refused before the file was opened


def test_bad_offsets_and_dtypes_are_refused(tmp_path):
    path = os.path.join(tmp_path, "bad.parquet")
    offsets = np.array([0, 4, 2], np.int32)
    with pytest.raises(ValueError, match="offsets"):
        _core.write_parquet(path, [("s", "utf8", offsets, np.zeros(4, np.uint8), np.ones(2, bool))], [], [])
    with pytest.raises(TypeError, match="numpy array"):
        _core.write_parquet(path, [("s", "num", np.zeros(2, np.float16))], [], [])
    with pytest.raises(ValueError, match="contiguous"):
        _core.write_parquet(path, [("s", "num", np.zeros(4, np.uint32)[::2])], [], [])
    with pytest.raises(ValueError, match="not a column"):
        _core.write_parquet(path, [("s", "what", np.zeros(2, np.uint32))], [], [])


def test_an_unwritable_path_is_an_os_error_naming_it(tmp_path):
    path = os.path.join(tmp_path, "no-such-dir", "t.parquet")
    with pytest.raises(FileNotFoundError) as e:
        _write(path, {"a": ("num", np.zeros(2, np.uint32))})
    assert e.value.filename == path
