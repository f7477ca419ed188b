"""Failed rows are null in every export: a file that could not be read has no format, rank,
layout, flags or sizes in the Arrow, pandas, polars and Parquet tables (nulls, not the core's placeholders 0,
"unknown" and "dense", which a filter would take for data) and no record in `to_json`'s adapters; its path,
status, error code and error message are kept. The module table has no rows for it."""

from __future__ import annotations

import json

import lorafast
import numpy as np
import pytest
from helpers.fleets import write_failed
from lorafast.sample import KINDS, write_samples
from lorafast.scanning import FLAGS, FORMATS, MOE_LAYOUTS, STATUS_ERROR
from lorafast.testing import write_attention_adapter as peft

#: Columns a failed row keeps; every other column of the adapter table describes content and is null there.
KEPT = {"row", "path", "status", "error_code", "error_message"}
TENSORS = {"lora_unet_x.lora_down.weight": ("F16", (4, 8)), "lora_unet_x.lora_up.weight": ("F16", (8, 4))}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Good adapters of every sample kind, and failed files of several kinds."""
    root = tmp_path_factory.mktemp("nulls")
    write_samples(str(root / "samples"), len(KINDS))
    peft(root / "peft_a", r=4)
    write_failed(root / "bad", "not_safetensors", "truncated", "bad_config", "no_weights", "dangling", "loop", "fifo",
                 "locked")  # fmt: skip
    return root


@pytest.fixture(scope="module")
def report(fleet):
    report = lorafast.scan([fleet], threads=2)
    codes = {c for _, c, _ in report.errors}
    want = {"header_too_large", "incomplete_buffer", "invalid_config", "missing_weights", "dangling_link"}
    assert want | {"symlink_loop", "not_regular_file"} <= codes
    return report


def failed_paths(report) -> set[str]:
    return {p for p, _, _ in report.errors}


def check_rows(report, rows: list[dict]) -> None:
    """Rows of the adapter table (as dicts, nulls as None): failed rows null in every content column, with their
    path, status, code and message; good rows with the values a fresh `inspect` gives."""
    errors = {p: (c, m) for p, c, m in report.errors}
    assert [r["path"] for r in rows] == report.paths
    assert [r["row"] for r in rows] == list(range(len(report)))
    for r in rows:
        if r["path"] in errors:
            assert r["status"] == "error" and (r["error_code"], r["error_message"]) == errors[r["path"]]
            assert {k: v for k, v in r.items() if k not in KEPT and v is not None} == {}, r["path"]
            continue
        a = lorafast.inspect(r["path"])
        assert r["status"] == ("problems" if a.problems else "ok")
        assert r["error_code"] is None and r["error_message"] is None
        want = {
            "format": a.format.value,
            "peft_type": a.peft_type,
            "base_model_name_or_path": a.base_model_name_or_path,
            "rank": a.rank,
            "num_tensors": a.num_tensors,
            "moe_layout": a.moe_layout.value,
            "num_experts": a.num_experts,
            "num_layers": len(a.layers),
            "flags": sum(1 << bit for bit, f in enumerate(FLAGS) if f in a.flags),
            **{f"flag_{f}": f in a.flags for f in FLAGS},
            "num_problems": len(a.problems),
            "weight_file": a.weight_files[0],
            "config_path": a.config_path,
        }
        assert {k: r[k] for k in want} == want, r["path"]
        assert r["header_size"] > 0 and r["file_size"] >= r["header_size"]


def check_dense_filter(report, dense_paths) -> None:
    """`moe_layout == "dense"` picks the good dense adapters only."""
    dense_paths = list(dense_paths)
    assert dense_paths and not set(dense_paths) & failed_paths(report)
    assert dense_paths == [a.path for a in report if a.moe_layout.value == "dense"]


def test_arrow(report):
    pa = pytest.importorskip("pyarrow")
    pc = pytest.importorskip("pyarrow.compute")
    table = report.to_arrow()
    table.validate(full=True)
    check_rows(report, table.to_pylist())
    for name in set(table.column_names) - KEPT:
        assert table[name].null_count >= len(report.errors), name
    dense = table.filter(pc.equal(table["moe_layout"].cast(pa.string()), "dense"))
    check_dense_filter(report, dense["path"].to_pylist())
    assert table.filter(pc.equal(table["rank"], 0))["path"].to_pylist() == []


def test_pandas(report):
    pd = pytest.importorskip("pandas")
    df = report.to_pandas()
    rows = [{k: None if pd.isna(v) else v for k, v in r.items()} for r in df.to_dict("records")]
    check_rows(report, rows)
    failed = (df["status"] == "error").to_numpy()
    for name in df.columns:
        if name not in KEPT:
            assert df[name].isna().to_numpy()[failed].all(), name
    assert df["rank"].dtype == "UInt32" and df["flag_dora"].dtype == "boolean"
    check_dense_filter(report, df[df["moe_layout"] == "dense"]["path"])
    assert df[df["format"] == "unknown"]["path"].isin(failed_paths(report)).sum() == 0


@pytest.mark.parametrize("through_arrow", [True, False])
def test_polars(report, through_arrow):
    pl = pytest.importorskip("polars")
    from lorafast.scanning.report import polars_from_columns

    pf = report.to_polars() if through_arrow else polars_from_columns(report)
    check_rows(report, pf.to_dicts())
    check_dense_filter(report, pf.filter(pl.col("moe_layout") == "dense")["path"].to_list())
    failed = pf.filter(pl.col("status") == "error").drop(sorted(KEPT))
    assert failed.height == len(report.errors) and failed.null_count().row(0) == (failed.height,) * failed.width


def test_parquet(report, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pl = pytest.importorskip("polars")
    report.to_parquet(tmp_path / "a.parquet", modules_path=tmp_path / "m.parquet")
    check_rows(report, pq.read_table(tmp_path / "a.parquet").to_pylist())
    dense = pq.read_table(tmp_path / "a.parquet", filters=[("moe_layout", "=", "dense")])
    check_dense_filter(report, dense["path"].to_pylist())
    # polars' own reader sees the same nulls.
    check_rows(report, pl.read_parquet(tmp_path / "a.parquet").to_dicts())
    failed = {i for i, p in enumerate(report.paths) if p in failed_paths(report)}
    assert not failed & set(pq.read_table(tmp_path / "m.parquet")["row"].to_pylist())


def test_json(report):
    """JSON has no record for a failed row (so no value of it to filter); it is in `errors`, with its path, code
    and message, and the summary counts only what was read."""
    data = json.loads(report.to_json())
    failed = failed_paths(report)
    assert [e["path"] for e in data["errors"]] == [p for p, _, _ in report.errors]
    assert {(e["path"], e["code"], e["message"]) for e in data["errors"]} == set(report.errors)
    assert [a["path"] for a in data["adapters"]] == report.ok_paths
    check_dense_filter(report, [a["path"] for a in data["adapters"] if a["moe_layout"] == "dense"])
    summary = data["summary"]
    good = len(report) - len(failed)
    assert summary["failed"] == len(failed)
    for counts in ("formats", "moe_layouts", "rank_histogram"):
        assert sum(summary[counts].values()) == good, counts
    assert json.loads(report.to_json(indent=2)) == data


def test_numpy_columns_keep_placeholders_masked_by_status(report):
    """numpy has no nulls: `columns()` keeps the status, and a failed row's other columns hold placeholders (0,
    format "unknown", layout "dense") that the tables turn into nulls."""
    cols = report.columns()
    failed = cols["status"] == STATUS_ERROR
    assert [report.paths[i] for i in np.flatnonzero(failed)] == [p for p, _, _ in report.errors]
    assert (cols["format"][failed] == FORMATS.index("unknown")).all()
    assert (cols["moe_layout"][failed] == MOE_LAYOUTS.index("dense")).all()
    for name in ("rank", "num_tensors", "num_experts", "num_layers", "flags", "num_problems"):
        assert (cols[name][failed] == 0).all(), name
    table = report.to_arrow()
    assert table["rank"].is_null().to_numpy(zero_copy_only=False).tolist() == failed.tolist()


def test_module_table_has_no_rows_for_failed_adapters(report):
    pytest.importorskip("pyarrow")
    modules = report.to_arrow("modules")
    rows = modules["row"].to_numpy()
    failed = {i for i, p in enumerate(report.paths) if p in failed_paths(report)}
    assert not failed & set(rows.tolist())
    counts = np.bincount(rows, minlength=len(report))
    assert {p: int(counts[i]) for i, p in enumerate(report.paths) if i not in failed} == {
        a.path: len(lorafast.inspect(a.path).modules) for a in report
    }


def test_a_report_without_failures_has_the_same_types_and_no_nulls(fleet):
    pytest.importorskip("pyarrow")
    pd = pytest.importorskip("pandas")
    good = lorafast.scan([fleet / "samples", fleet / "peft_a"], threads=2)
    assert not good.errors
    table, with_failures = good.to_arrow(), lorafast.scan([fleet], threads=2).to_arrow()
    assert table.schema == with_failures.schema
    for name in ("format", "rank", "moe_layout", "flags", "flag_dora", "num_problems"):
        assert table[name].null_count == 0, name
    # pandas: the nullable dtypes whether or not a row failed (string and categorical columns follow their values).
    numbers = ["rank", "num_tensors", "num_experts", "num_layers", "flags", *(f"flag_{f}" for f in FLAGS)]
    numbers += ["num_problems", "header_size", "file_size"]
    df, df_failures = good.to_pandas(), lorafast.scan([fleet], threads=2).to_pandas()
    assert [df[n].dtype for n in numbers] == [df_failures[n].dtype for n in numbers]
    assert df["rank"].dtype == pd.UInt32Dtype() and df["flag_dora"].dtype == pd.BooleanDtype()


def test_distributed_merge_and_index_give_the_same_nulls(fleet, report, tmp_path):
    """A merged result of shards (as `backend="ray"` makes it, here without Ray) and an index's report, first
    scan and rescan, give the same table."""
    pytest.importorskip("pyarrow")
    from lorafast import _core
    from lorafast.scanning.distributed import MergedResult, _scan_shard, _shards

    want = report.to_arrow().to_pylist()
    items = _core.discover_targets([str(fleet)], True, None, None, None, None)
    parts = [_scan_shard(shard, "pread", False, None, None, None, 1) for shard in _shards(items, 3)]
    merged = lorafast.ScanReport(MergedResult(parts))
    assert merged.to_arrow().to_pylist() == want
    index = lorafast.Index(str(tmp_path / "fleet.db"))
    for _ in range(2):
        assert index.scan([fleet], threads=2).to_arrow().to_pylist() == want
