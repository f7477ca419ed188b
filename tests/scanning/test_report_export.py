"""A scan report at column speed: iteration builds `Adapter`s from what the scan kept
(never reading a file again) and equals a fresh `inspect` field by field; `to_json` streams the text
`json.dumps` gives; the Arrow, pandas, polars and Parquet tables come from the Rust columns."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import lorafast
import numpy as np
import pytest
from helpers.fleets import write_failed
from lorafast.sample import write_samples
from lorafast.testing import write_attention_adapter as peft
from lorafast.testing import write_safetensors


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Samples of every kind, copies of them (remembered headers, `rust/scan/memo.rs`), kohya metadata that differs
    per copy, and failed rows."""
    root = tmp_path_factory.mktemp("fleet")
    write_samples(str(root / "samples"), 120)
    os.makedirs(root / "copies")
    for i, name in enumerate(sorted(os.listdir(root / "samples"))[:30]):
        src = root / "samples" / name
        if src.is_dir():
            shutil.copytree(src, root / "copies" / f"{name}-{i}")
        else:
            shutil.copy(src, root / "copies" / f"c{i}-{name}")
    tensors = {
        "lora_unet_down_0.lora_down.weight": ("F16", (4, 16)),
        "lora_unet_down_0.lora_up.weight": ("F16", (16, 4)),
    }
    os.makedirs(root / "kohya")
    for i in range(6):
        write_safetensors(str(root / "kohya" / f"k{i}.safetensors"), tensors, metadata={"ss_seed": str(i)})
    peft(root / "peft_a", r=4)
    write_failed(root / "broken", "tiny", "zeros")
    return root


def field_values(obj: object) -> dict:
    """A dataclass instance's fields (a `LoraModule` has slots, no `__dict__`)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]


def test_iteration_equals_fresh_inspect_field_by_field(fleet):
    report = lorafast.scan([fleet], threads=2)
    assert report.errors  # the broken files are rows too
    got = list(report)
    assert [a.path for a in got] == report.ok_paths
    assert len(got) > 150
    for a in got:
        want = lorafast.inspect(a.path)
        fa, fw = field_values(a), field_values(want)
        for name in fw:
            assert fa[name] == fw[name], (a.path, name)
            assert type(fa[name]) is type(fw[name]), (a.path, name)
        # The core builds these objects without the dataclass __init__: same instance dict, same order.
        assert type(a) is lorafast.Adapter and list(vars(a)) == list(vars(want)) and a == want
        assert repr(a) == repr(want)
        assert len(a.modules) == len(want.modules)
        for ma, mw in zip(a.modules, want.modules, strict=True):
            assert dataclasses.asdict(ma) == dataclasses.asdict(mw), (a.path, mw.name)
            assert type(ma) is type(mw) and not hasattr(ma, "__dict__")
            assert [type(v) for v in field_values(ma).values()] == [type(v) for v in field_values(mw).values()]
        for pa, pw in zip(a.problems, want.problems, strict=True):
            assert type(pa) is type(pw) and vars(pa) == vars(pw)
        assert [type(v) for v in a.dtypes + a.target_modules + a.variants] == [
            type(v) for v in want.dtypes + want.target_modules + want.variants
        ]
    # Per-copy metadata is each adapter's own, though the copies share one remembered classification.
    seeds = sorted(a.metadata["ss_seed"] for a in got if a.metadata and "ss_seed" in a.metadata)
    assert seeds == [str(i) for i in range(6)]


def test_adapters_sharing_a_classification_share_no_mutable_field(fleet):
    """Copies share one remembered classification, whose immutable parts (tuples, enums, problems) the objects may
    share; every dict (config, patterns, metadata, extra) and every module is the adapter's own."""
    report = lorafast.scan([fleet / "copies", fleet / "samples"], threads=1)
    same: dict[tuple, list[lorafast.Adapter]] = {}  # a sample and its copy: the same header and config
    for a in report:
        modules = tuple((m.key, m.a_shape, m.b_shape, m.dtype) for m in a.modules)
        same.setdefault((a.format, a.num_tensors, modules, repr(a.config)), []).append(a)
    pairs = [(x, y) for group in same.values() for x, y in zip(group, group[1:], strict=False) if x.modules]
    assert len(pairs) >= 20
    assert any(x.dtypes is y.dtypes for x, y in pairs)  # some do share a classification's parts
    for x, y in pairs:
        for name in ("config", "rank_pattern", "alpha_pattern", "metadata", "extra"):
            vx, vy = getattr(x, name), getattr(y, name)
            assert vx is None or vx is not vy, name
        assert not {id(m) for m in x.modules} & {id(m) for m in y.modules}
    x, y = pairs[0]
    x.extra["mine"] = 1  # type: ignore[index]
    assert "mine" not in y.extra


def test_modules_built_on_first_access_survive_copies_pickles_and_the_report(fleet):
    """Iteration builds an adapter's modules when they are first read: a copy, a pickle or a `replace` of an
    adapter whose modules were never read equals `inspect`'s, and so do modules first read after the report is gone."""
    report = lorafast.scan([fleet], threads=2)
    wants = {p: lorafast.inspect(p) for p in report.ok_paths}
    makers = [copy.copy, copy.deepcopy, lambda a: pickle.loads(pickle.dumps(a)), dataclasses.replace]
    for make in makers:
        for a in report:
            b, want = make(a), wants[a.path]
            assert b == want and list(vars(b)) == list(vars(want)) and list(vars(a)) == list(vars(want))
    fresh = list(report)
    del report
    gc.collect()
    assert [a.modules for a in fresh] == [wants[a.path].modules for a in fresh]
    assert sum(len(a.modules) for a in fresh) > 1000
    with pytest.raises(AttributeError, match="'Adapter' object has no attribute 'nope'"):
        fresh[0].nope  # noqa: B018


def test_modules_of_distinct_headers_that_name_the_same_modules(tmp_path):
    """Adapters whose headers all differ (tensors in another order, one of 10 ranks: more variants of a module than
    a batch remembers) but name the same modules: the core builds each module once per batch and copies it. Every
    module still equals `inspect`'s, an object of its own, with its own `weight_file`."""
    keys = [f"base_model.model.model.layers.{i}.self_attn.{m}" for i in range(3) for m in ("q_proj", "v_proj")]
    for n in range(24):
        r = 2 + n % 10
        tensors = {}
        for k in keys[n % len(keys) :] + keys[: n % len(keys)]:
            tensors[f"{k}.lora_A.weight"] = ("F16", (r, 16))
            tensors[f"{k}.lora_B.weight"] = ("F16", (16, r))
        write_safetensors(str(tmp_path / f"a{n:02d}.safetensors"), tensors)
    report = lorafast.scan([tmp_path], threads=2)
    got = list(report)
    assert len(got) == 24 and len({a.modules[0].key for a in got}) == len(keys)
    for a in got:
        want = lorafast.inspect(a.path)
        assert a.modules == want.modules and a == want
        for ma, mw in zip(a.modules, want.modules, strict=True):
            assert repr(ma) == repr(mw)
            assert [type(v) for v in field_values(ma).values()] == [type(v) for v in field_values(mw).values()]
            assert ma.weight_file == a.path
    modules = [m for a in got for m in a.modules]
    assert len({id(m) for m in modules}) == len(modules)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got[5].modules[0].rank = 1  # type: ignore[misc]


class _WithoutObjects:
    """A scan result without `adapter_objects`, as a merged distributed result: iteration converts dicts."""

    def __init__(self, result):
        self._result = result

    def __getattr__(self, name):
        if name == "adapter_objects":
            raise AttributeError(name)
        return getattr(self._result, name)


def test_iteration_does_not_hold_the_adapters_it_handed_over(fleet):
    """An adapter the caller drops dies at once with its modules (by reference count, no collection): the batch it
    came from does not keep it, so a loop over a large report leaves no module objects for the collector."""
    import weakref

    from lorafast.adapter import LoraModule

    def live_modules() -> int:  # a LoraModule has slots and no weak references; the collector lists it
        return sum(type(o) is LoraModule for o in gc.get_objects())

    report = lorafast.scan([fleet], threads=2)
    it = iter(report)
    first = next(it)
    before = live_modules()
    while not first.modules:
        first = next(it)
    assert live_modules() == before + len(first.modules)
    ref = weakref.ref(first)
    del first
    next(it)  # its modules are not read: none is built
    assert ref() is None and live_modules() == before


def test_iteration_from_dicts_equals_iteration_from_objects(fleet):
    report = lorafast.scan([fleet], threads=2)
    plain = lorafast.ScanReport(_WithoutObjects(report._result))
    got, want = list(report), list(plain)
    assert len(got) == len(want) > 150
    for a, w in zip(got, want, strict=True):
        assert a == w and list(vars(a)) == list(vars(w))


def test_iteration_reads_no_file(tmp_path, fleet):
    root = tmp_path / "fleet"
    shutil.copytree(fleet, root)
    report = lorafast.scan([root], threads=2)
    want = [field_values(lorafast.inspect(p)) for p in report.ok_paths]
    shutil.rmtree(root)  # every file gone: iteration must not need them
    assert [field_values(a) for a in report] == want


def test_iteration_of_a_remembered_header_with_metadata_elsewhere(tmp_path):
    """A header whose `__metadata__` is not its first entry: the memo cannot split it off, so such a row is
    read whole, metadata included."""
    entries = {"a.lora_A.weight": {"dtype": "F16", "shape": [2, 4], "data_offsets": [0, 16]}}
    for i in range(3):
        header = json.dumps({**entries, "__metadata__": {"run": str(i)}}).encode()
        header += b" " * (-len(header) % 8)
        with open(tmp_path / f"m{i}.safetensors", "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    got = {os.path.basename(a.path): a.metadata for a in lorafast.scan([tmp_path], threads=1)}
    assert got == {f"m{i}.safetensors": {"run": str(i)} for i in range(3)}


def reference_json(report: lorafast.ScanReport, indent, records: bool) -> str:
    out = {"summary": report.summary(), "errors": [{"path": p, "code": c, "message": m} for p, c, m in report.errors]}
    if records:
        rows = []
        for i in range(len(report)):
            rec = report.record(i)
            if rec is not None:
                rec.pop("config_json", None)
                rows.append(rec)
        out["adapters"] = rows
    return json.dumps(out, indent=indent)


@pytest.mark.parametrize("indent", [None, 0, 2, "\t"])
@pytest.mark.parametrize("records", [True, False])
def test_to_json_is_json_dumps_of_the_report(fleet, indent, records):
    report = lorafast.scan([fleet], threads=2)
    want = reference_json(report, indent, records)
    assert report.to_json(indent=indent, records=records) == want
    buf = io.StringIO()
    assert report.to_json(buf, indent=indent, records=records) is None
    assert buf.getvalue() == want
    json.loads(want)


def test_to_json_streams_in_batches(tmp_path, monkeypatch):
    from lorafast.scanning import report as report_mod

    for i in range(7):
        peft(tmp_path / f"a{i}", r=4 + i)
    monkeypatch.setattr(report_mod, "JSON_BATCH", 2)
    report = lorafast.scan([tmp_path], threads=1)
    writes: list[str] = []

    class Sink:
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    report.to_json(Sink())  # type: ignore[arg-type]
    batches = [w for w in writes if '"path"' in w]
    assert len(batches) == 4  # 7 records, 2 at a time: the text is written as it is made
    assert "".join(writes) == reference_json(report, None, True)
    monkeypatch.setattr(report_mod, "JSON_TEXT_BATCH", 3)  # the returned text grows from batches of its own size
    for indent in (None, 2):
        assert report.to_json(indent=indent) == reference_json(report, indent, True)


def test_empty_report_json(tmp_path):
    report = lorafast.scan([tmp_path])
    for indent in (None, 2):
        assert report.to_json(indent=indent) == reference_json(report, indent, True)


def test_arrow_tables_match_the_columns_and_the_adapters(fleet):
    pa = pytest.importorskip("pyarrow")
    report = lorafast.scan([fleet], threads=2)
    cols = report.columns()
    table = report.to_arrow()
    assert isinstance(table, pa.Table)
    assert table.num_rows == len(report)
    assert table["row"].to_pylist() == cols["path_index"].tolist()
    assert table["path"].to_pylist() == report.paths
    read = cols["status"] != lorafast.scanning.STATUS_ERROR  # failed rows are null (test_export_nulls.py)
    assert table["rank"].to_pylist() == [r if ok else None for r, ok in zip(cols["rank"].tolist(), read, strict=True)]
    assert table["format"].to_pylist() == [
        lorafast.scanning.FORMATS[c] if ok else None for c, ok in zip(cols["format"].tolist(), read, strict=True)
    ]
    assert table["status"].to_pylist().count("error") == len(report.errors)
    errors = {p: c for p, c, _ in report.errors}
    assert {
        p: c for p, c in zip(table["path"].to_pylist(), table["error_code"].to_pylist(), strict=True) if c
    } == errors
    by_path = {a.path: a for a in report}
    rows = table.to_pylist()
    for row in rows:
        a = by_path.get(row["path"])
        if a is None:
            assert row["status"] == "error" and row["header_size"] is None
            continue
        assert row["peft_type"] == a.peft_type
        assert row["base_model_name_or_path"] == a.base_model_name_or_path
        assert row["weight_file"] == a.weight_files[0]
        assert row["config_path"] == a.config_path
        assert {f for f in lorafast.scanning.FLAGS if row[f"flag_{f}"]} == set(a.flags)
        assert row["num_problems"] == len(a.problems)

    modules = report.to_arrow("modules")
    # The dictionary columns are made without pyarrow's bounds check: a full validation checks every code.
    table.validate(full=True)
    modules.validate(full=True)
    want = [
        (report.paths.index(a.path), m.name, m.key, m.leaf, m.kind, m.layer, m.expert, m.num_experts, m.rank,
         m.in_features, m.out_features, m.dtype, m.alpha, m.scale, m.config_rank, m.use_rslora, m.a_key, m.b_key)
        for a in report for m in a.modules
    ]  # fmt: skip
    names = ["row", "name", "key", "leaf", "kind", "layer", "expert", "num_experts", "rank", "in_features",
             "out_features", "dtype", "alpha", "scale", "config_rank", "use_rslora", "a_key", "b_key"]  # fmt: skip
    assert modules.column_names == names
    got = list(zip(*(modules[n].to_pylist() for n in names), strict=True))
    assert len(got) == len(want) > 1000
    for g, w in zip(got, want, strict=True):
        assert g == w  # `scale` too: the core divides as `LoraModule.scale` does


def test_module_columns_outlive_the_report(fleet):
    """The module table's numpy columns are views of one block of memory the core made; they keep it alive after
    the report, the result and every other column are gone."""
    import gc

    report = lorafast.scan([fleet], threads=2)
    raw = report._result.module_table()
    copies = {n: tuple(np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in v)
              if isinstance(v, tuple) else np.array(v, copy=True) for n, v in raw.items()}  # fmt: skip
    rank_values = raw["rank"][0]
    del report, raw
    gc.collect()
    for _ in range(3):  # new allocations that would reuse freed memory
        lorafast.scan([fleet], threads=2)._result.module_table()
    assert len(rank_values) > 1000
    assert np.array_equal(rank_values, copies["rank"][0])


def test_pandas_and_polars_equal_arrow(fleet):
    pytest.importorskip("pyarrow")
    report = lorafast.scan([fleet], threads=2)
    for table in ("adapters", "modules"):
        want = report.to_arrow(table).to_pylist()
        pd = pytest.importorskip("pandas")
        df = report.to_pandas(table)
        assert isinstance(df, pd.DataFrame)
        got = [{k: (None if v is pd.NA or (isinstance(v, float) and np.isnan(v)) else v) for k, v in r.items()}
               for r in df.to_dict("records")]  # fmt: skip
        for g, w in zip(got, want, strict=True):
            assert g == {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in w.items()}
        assert len(got) == len(want)
        pl = pytest.importorskip("polars")
        pf = report.to_polars(table)
        assert isinstance(pf, pl.DataFrame)
        assert pf.columns == list(want[0])
        assert pf.to_dicts() == want


def test_parquet_round_trip(fleet, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    report = lorafast.scan([fleet], threads=2)
    report.to_parquet(tmp_path / "a.parquet", modules_path=tmp_path / "m.parquet")
    assert pq.read_table(tmp_path / "a.parquet").to_pylist() == report.to_arrow().to_pylist()
    assert pq.read_table(tmp_path / "m.parquet").to_pylist() == report.to_arrow("modules").to_pylist()
    report.to_parquet(tmp_path / "only.parquet")
    assert pq.read_table(tmp_path / "only.parquet").num_rows == len(report)


def test_non_utf8_paths_in_tables(tmp_path):
    pa = pytest.importorskip("pyarrow")
    name = os.fsdecode(b"bad-\xff")
    peft(tmp_path / name, r=4)
    report = lorafast.scan([tmp_path])
    [adapter] = list(report)
    assert adapter.path == os.fsdecode(os.path.join(os.fsencode(tmp_path), b"bad-\xff"))
    assert report.to_arrow()["path"].to_pylist()[0].endswith("bad-\\xff")
    assert isinstance(report.to_arrow("modules"), pa.Table)
    assert report.to_json() == reference_json(report, None, True)


@pytest.mark.parametrize("content_hash", [False, True])
def test_arrow_string_columns_made_by_the_core_equal_the_lists(tmp_path, content_hash):
    """The Arrow string columns come from the core's buffers, not lists of str: the same values, nulls where the
    lists have None, and non-UTF-8 bytes of paths as `\\xNN`, as `_utf8` writes them."""
    pytest.importorskip("pyarrow")
    from lorafast.scanning.report import STRING_COLUMNS, _utf8

    tensors = {"lora_unet_x.lora_down.weight": ("F16", (4, 8)), "lora_unet_x.lora_up.weight": ("F16", (8, 4))}
    for name in ["plain", "ünï☃de 🎉", os.fsdecode(b"raw-\xff\xfe"), os.fsdecode(b"cut-\xe2\x82")]:
        write_safetensors(str(tmp_path / f"{name}.safetensors"), tensors)
    peft(tmp_path / os.fsdecode(b"peft-\xff"), r=4)
    (tmp_path / os.fsdecode(b"bad-\xfe.safetensors")).write_bytes(b"\x01")
    report = lorafast.scan([tmp_path], content_hash=content_hash)
    assert len(report) == 6 and len(report.errors) == 1
    lists = {"path": report.paths, **report._result.table()}
    table = report.to_arrow()
    for name in STRING_COLUMNS:
        assert table[name].to_pylist() == _utf8(lists[name]), name
        assert table[name].null_count == lists[name].count(None)
    assert any(p.endswith("raw-\\xff\\xfe.safetensors") for p in table["path"].to_pylist())
    assert table["content_hash"].null_count == (1 if content_hash else 6)
    # pandas: the dtype and values pandas gives each list, from the buffers where no byte needed an escape; a
    # column with a path that is not UTF-8 (which pandas' own inference raises on) is object, its str as
    # `os.fsdecode` gives them.
    pd = pytest.importorskip("pandas")
    df = report.to_pandas()
    for name in STRING_COLUMNS:
        try:
            want = pd.Series(lists[name], name=name)
        except UnicodeEncodeError:
            want = pd.Series(lists[name], name=name, dtype=object)
        pd.testing.assert_series_equal(df[name], want)
        assert list(df[name]) == list(want)
    assert df["path"].dtype == object and df["error_message"].dtype == pd.Series(["a"]).dtype


def test_string_buffers_reject_an_unknown_column(tmp_path):
    for report in (lorafast.scan([tmp_path]), lorafast.scan([tmp_path / "missing"])):
        with pytest.raises(ValueError, match="no string column"):
            report._result.string_buffers("rank")


def test_empty_tables(tmp_path):
    pytest.importorskip("pyarrow")
    report = lorafast.scan([tmp_path])
    assert report.to_arrow().num_rows == 0
    assert report.to_arrow("modules").num_rows == 0
    assert len(report.to_pandas("modules")) == 0
    with pytest.raises(ValueError, match="table must be"):
        report.to_arrow("nope")  # type: ignore[arg-type]


def test_to_json_of_reports_without_records(tmp_path):
    """The core's whole-text path with no successful adapter: nothing found, or only errors."""
    assert lorafast.scan([tmp_path]).to_json() == reference_json(lorafast.scan([tmp_path]), None, True)
    (tmp_path / "bad.safetensors").write_bytes(b"\x01")
    report = lorafast.scan([tmp_path])
    assert len(report.errors) == 1
    assert report.to_json() == reference_json(report, None, True)
    assert json.loads(report.to_json())["adapters"] == []


def test_json_text_of_odd_strings(tmp_path):
    """The core writes the records' JSON itself: every escape `json.dumps` makes (quotes, backslashes, control
    characters, DEL, non-ASCII, characters past U+FFFF, lone surrogates of non-UTF-8 names) must come out the same."""
    odd = 'q"b\\s\n\r\t\b\f\x01\x1f\x7f é ☃ 🎉 \u2028'
    tensors = {"lora_unet_x.lora_down.weight": ("F16", (4, 8)), "lora_unet_x.lora_up.weight": ("F16", (8, 4))}
    for i, name in enumerate(["plain", "ünï☃de 🎉", os.fsdecode(b"raw-\xff\xfe")]):
        write_safetensors(str(tmp_path / f"{name}.safetensors"), tensors, metadata={odd: odd + str(i), "k": "v"})
    peft(tmp_path / "peft 🎉", r=4)
    (tmp_path / "bad\x7f.safetensors").write_bytes(b"\x01")
    report = lorafast.scan([tmp_path])
    assert len(report) == 5 and len(report.errors) == 1
    for indent in (None, 2):
        assert report.to_json(indent=indent) == reference_json(report, indent, True)


def test_pandas_string_columns_have_the_dtype_pandas_infers(fleet):
    """Columns of str (built from Arrow where pandas' str dtype is Arrow-backed) keep the dtype pandas itself gives
    the list: `str` in pandas 3, object before; a column of None stays object."""
    pd = pytest.importorskip("pandas")
    report = lorafast.scan([fleet], threads=2)
    df = report.to_pandas()
    table = report._result.table()
    columns = {"path": report.paths, **{n: table[n] for n in ("weight_file", "config_path", "error_message")}}
    assert any(v is None for v in columns["config_path"]) and any(v is not None for v in columns["config_path"])
    for name, values in columns.items():
        want = pd.Series(values)
        assert df[name].dtype == want.dtype, name
        assert df[name].isna().tolist() == want.isna().tolist(), name
        assert df[name].dropna().tolist() == want.dropna().tolist(), name


def test_parquet_keeps_statistics_of_the_row_key_and_dictionaries_of_dictionary_columns(fleet, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    report = lorafast.scan([fleet], threads=2)
    report.to_parquet(tmp_path / "a.parquet", modules_path=tmp_path / "m.parquet")
    for name, want in (("a.parquet", report.to_arrow()), ("m.parquet", report.to_arrow("modules"))):
        meta = pq.ParquetFile(tmp_path / name).metadata
        group = meta.row_group(0)
        columns = {group.column(i).path_in_schema: group.column(i) for i in range(meta.num_columns)}
        assert [c for c, col in columns.items() if col.is_stats_set] == ["row"]
        for field in want.schema:
            dictionary_pages = columns[field.name].has_dictionary_page
            assert dictionary_pages == pa.types.is_dictionary(field.type), (name, field.name)
        assert pq.read_table(tmp_path / name).schema.equals(want.schema, check_metadata=False)


def test_polars_through_arrow_equals_polars_alone(fleet, tmp_path):
    """`to_polars` goes through Arrow when pyarrow is installed; polars alone builds the same frame."""
    pytest.importorskip("pyarrow")
    pl = pytest.importorskip("polars")
    from lorafast.scanning.report import polars_from_columns

    for report in (lorafast.scan([fleet], threads=2), lorafast.scan([tmp_path])):
        for table in ("adapters", "modules"):
            through_arrow, alone = report.to_polars(table), polars_from_columns(report, table)
            assert through_arrow.schema == alone.schema
            assert through_arrow.equals(alone)
            assert through_arrow.null_count().row(0) == alone.null_count().row(0)
            assert alone.height == len(report.to_arrow(table))
            assert isinstance(alone, pl.DataFrame)


def test_arrow_columns_without_nulls_carry_no_validity_bitmap(fleet):
    pa = pytest.importorskip("pyarrow")
    report = lorafast.scan([fleet], threads=2)
    for table in ("adapters", "modules"):
        t = report.to_arrow(table)
        assert any(c.null_count for c in t.columns) and any(not c.null_count for c in t.columns)
        for name, column in zip(t.column_names, t.columns, strict=True):
            [chunk] = column.chunks
            if pa.types.is_dictionary(chunk.type):
                chunk = chunk.indices
            assert (chunk.buffers()[0] is None) == (chunk.null_count == 0), (table, name)


class _WithoutStringBuffers(_WithoutObjects):
    """A scan result whose string columns come as lists of str, as a merged distributed result's do."""

    def __getattr__(self, name):
        if name == "string_buffers":
            raise AttributeError(name)
        return super().__getattr__(name)


def test_parquet_from_lists_of_str_equals_parquet_from_buffers(fleet, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    report = lorafast.scan([fleet], threads=2)
    plain = lorafast.ScanReport(_WithoutStringBuffers(report._result))
    report.to_parquet(tmp_path / "a.parquet")
    plain.to_parquet(tmp_path / "b.parquet")
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert a.equals(report.to_arrow()) and b.equals(a)
    assert a.column("path").null_count == 0 and b.column("error_message").null_count < len(report)


def test_module_table_past_a_huge_page(tmp_path):
    """A table of more than 2 MiB is laid out from a huge-page boundary (`rust/report/module_table.rs` `Arena`): every
    column still holds each adapter's modules in order."""
    mods = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for i in range(110):
        peft(tmp_path / f"a{i:03d}", r=(4, 8, 16)[i % 3], layers=32, modules=mods)
    report = lorafast.scan([tmp_path], threads=2)
    raw = report._result.module_table()
    assert sum(v.nbytes for c in raw.values() for v in (c if isinstance(c, tuple) else (c,))
               if isinstance(v, np.ndarray)) > 2 << 20  # fmt: skip
    want = [(report.paths.index(a.path), m.name, m.rank, m.layer, m.in_features, m.scale)
            for a in report for m in a.modules]  # fmt: skip
    names = raw["name"][1]
    got = list(zip(raw["row"].tolist(), [names[c] for c in raw["name"][0].tolist()], raw["rank"][0].tolist(),
                   raw["layer"][0].tolist(), raw["in_features"][0].tolist(), raw["scale"].tolist(), strict=True))  # fmt: skip
    assert len(got) == 110 * 224
    assert got == want
    assert raw["layer"][1].all() and raw["rank"][1].all()


def test_exports_after_fork_do_not_hang(fleet, tmp_path):
    """The module table and the Parquet writer run parallel loops; in a forked child the parent's pools have no
    threads, and a loop on one of them (rayon's global pool, once the parent's `to_parquet` had started it) hung
    the child for good."""
    pytest.importorskip("pyarrow")
    code = (
        "import os, signal, sys, lorafast\n"
        "report = lorafast.scan([sys.argv[1]])\n"
        "report.to_parquet(sys.argv[2] + '/a.pq', sys.argv[2] + '/m.pq')\n"  # the pools start in the parent
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(50)\n"  # a hung child ends itself, after the parent's wait has failed the test
        "    report.to_parquet(sys.argv[2] + '/ca.pq', sys.argv[2] + '/cm.pq')\n"
        "    n = report.to_arrow('modules').num_rows\n"
        "    os._exit(0 if n == report.to_arrow('modules').num_rows > 0 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(fleet), str(tmp_path)], capture_output=True, text=True,
                         timeout=40, check=True)  # fmt: skip
    assert out.stdout.strip() == "0"
    pq = pytest.importorskip("pyarrow.parquet")
    assert pq.read_table(tmp_path / "cm.pq").equals(pq.read_table(tmp_path / "m.pq"))
