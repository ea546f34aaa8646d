"""The Parquet warehouse: fixed schemas, atomic local writes, any fsspec filesystem."""

import os

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq
import pytest
from upath import UPath

from filter_pipeline.definitions import build_defs
from filter_pipeline.jobs import ACROSS_RUNS_ASSETS
from filter_pipeline.judging import JudgeResource
from filter_pipeline.schemas import SCHEMAS, empty_frame, to_arrow
from filter_pipeline import warehouse
from filter_pipeline.warehouse import read_parquet, write_parquet
from filter_pipeline_tests.builders import attempt, jsonl, task


def materialize_all(data_path: str, run_id: str) -> dg.ExecuteInProcessResult:
    defs = build_defs(data_path, JudgeResource(), caps={})
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("run_id", [run_id])
    return defs.resolve_job_def("filter_job").execute_in_process(instance=instance, partition_key=run_id)


def test_whole_graph_on_fsspec_memory_filesystem():
    root = UPath("memory://filter-test/data")
    run = root / "runs" / "m1"
    run.mkdir(parents=True, exist_ok=True)
    (run / "tasks.jsonl").write_text(jsonl([task("a"), task("b", key=["s", "#el", "a"])]))
    (run / "executions.jsonl").write_text(jsonl([attempt("a"), attempt("b"), attempt("b", 2, ok=False, error="x")]))

    assert materialize_all(str(root), "m1").success

    kept = read_parquet(root / "warehouse" / "kept" / "m1.parquet")
    surplus = read_parquet(root / "warehouse" / "surplus" / "m1.parquet")
    pool = read_parquet(root / "warehouse" / "failure_pool" / "m1.parquet")
    assert kept["task_id"].tolist() == ["a"]
    assert surplus[["task_id", "dropped", "dup_of_task_id"]].values.tolist() == [["b", "duplicate", "a"]]
    assert pool["reason"].tolist() == ["script_error"]
    assert not list((root / "warehouse" / "kept").glob(".*"))
    assert not os.path.exists("memory:")  # nothing leaked onto local disk


def test_every_asset_file_has_its_fixed_schema_even_when_empty(tmp_path):
    run = tmp_path / "runs" / "e1"
    run.mkdir(parents=True)
    (run / "tasks.jsonl").write_text(jsonl([task("a")]))
    (run / "executions.jsonl").write_text(jsonl([attempt("a", ok=False, error=None)]))
    assert materialize_all(str(tmp_path), "e1").success
    for asset, schema in SCHEMAS.items():
        if asset in ACROSS_RUNS_ASSETS:  # one file for every run, not one per run
            continue
        path = tmp_path / "warehouse" / asset / "e1.parquet"
        assert pq.read_schema(path).remove_metadata() == schema, asset


def test_whole_asset_folder_reads_as_one_frame_with_real_nulls(tmp_path):
    folder = UPath(tmp_path) / "warehouse" / "failure_pool"
    with_nulls = pd.DataFrame([{"task_id": "a", "reason": "unknown", "detail": None, "backend_ok": None, "run_id": "r1"}])
    write_parquet(to_arrow(with_nulls, "failure_pool"), folder / "r1.parquet")
    write_parquet(to_arrow(empty_frame("failure_pool"), "failure_pool"), folder / "r2.parquet")
    frame = pd.read_parquet(tmp_path / "warehouse" / "failure_pool")
    assert frame["task_id"].tolist() == ["a"]
    assert frame["detail"].isna().all()
    assert read_parquet(folder / "r1.parquet")["backend_ok"].dtype == "boolean"


def test_local_write_is_atomic_and_cleans_temp_files_of_a_killed_write(tmp_path, monkeypatch):
    target = UPath(tmp_path) / "kept" / "r1.parquet"
    write_parquet(to_arrow(empty_frame("kept"), "kept"), target)
    stale = tmp_path / "kept" / ".r1.parquet.deadbeef.tmp"
    stale.write_bytes(b"half a parquet file")

    def dies_midway(table, where):
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(warehouse.pq, "write_table", dies_midway)
    with pytest.raises(OSError, match="disk full"):
        write_parquet(to_arrow(empty_frame("kept"), "kept"), target)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["r1.parquet"]
    assert pq.read_table(target).num_rows == 0  # the old file is intact

    rows = pd.DataFrame([{"task_id": "a", "run_id": "r1"}])
    write_parquet(to_arrow(rows, "kept"), target)
    assert pq.read_table(target).column("task_id").to_pylist() == ["a"]
