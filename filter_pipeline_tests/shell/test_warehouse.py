"""The Parquet warehouse: fixed schemas, atomic local writes, any fsspec filesystem."""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq
import pytest
from upath import UPath

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules.schemas import SCHEMAS, empty_frame, to_arrow
from filter_pipeline.shell import warehouse
from filter_pipeline.shell.jobs import ACROSS_RUNS_ASSETS
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage import files
from filter_pipeline.storage.parquet import read_parquet, write_parquet
from filter_pipeline_tests.builders import attempt, jsonl, task, write_batch, write_legacy_kept


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
    (run / "_SUCCESS").write_text("")

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
    (run / "_SUCCESS").write_text("")
    assert materialize_all(str(tmp_path), "e1").success
    for asset, schema in SCHEMAS.items():
        if asset in ACROSS_RUNS_ASSETS:  # one file for every run, not one per run
            continue
        path = tmp_path / "warehouse" / asset / "e1.parquet"
        assert pq.read_schema(path).remove_metadata() == schema, asset


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_whole_graph_on_an_s3_compatible_server_with_history_and_retired_found_there(s3_bucket):
    url = f"s3://{s3_bucket}/data"
    root = DataRoot(path=url).root
    write_legacy_kept(
        root, "r0", ("old", ["s", "#el", "legacy"], "m", "s"), ("gone", ["s", "#el", "retired"], "m", "s")
    )
    (root / "retired.json").write_text(json.dumps([{"run_id": "r0", "task_ids": ["gone"], "reason": "bad"}]))
    write_batch(
        root, "r1",
        [task("a", key=["s", "#el", "legacy"]), task("b", key=["s", "#el", "retired"]), task("c")],
        [attempt("a"), attempt("b"), attempt("c", ok=False, error="policy violation: x")],
    )  # fmt: skip

    assert materialize_all(url, "r1").success

    # read back as a user would, with pandas and the standard AWS variables (set by the fixture)
    kept = pd.read_parquet(f"{url}/warehouse/kept/r1.parquet")
    surplus = pd.read_parquet(f"{url}/warehouse/surplus")
    pool = pd.read_parquet(f"{url}/warehouse/failure_pool/r1.parquet")
    assert kept["task_id"].tolist() == ["b"]  # its key was kept only by a retired row
    assert surplus[["task_id", "dropped", "dup_of_run_id"]].values.tolist() == [["a", "duplicate", "r0"]]
    assert pool["reason"].tolist() == ["policy_violation"]


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_an_endpoint_url_names_the_s3_server_without_any_aws_endpoint_variable(s3_server, monkeypatch):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3_server.filesystem().mkdir("endpoint-setting")
    monkeypatch.setenv(warehouse.ENDPOINT_ENV, s3_server.endpoint)
    data = DataRoot.from_env("s3://endpoint-setting/data")
    (data.root / "probe.txt").write_text("here")
    assert s3_server.filesystem().cat("endpoint-setting/data/probe.txt") == b"here"


def test_a_write_in_progress_elsewhere_is_left_alone(tmp_path):
    target = UPath(tmp_path) / "coverage.parquet"
    in_progress = tmp_path / ".coverage.parquet.0123abcd.tmp"  # another process is writing it right now
    in_progress.write_bytes(b"PAR1 so far")
    write_parquet(to_arrow(empty_frame("coverage"), "coverage"), target)
    assert in_progress.exists()


def test_a_dead_writers_temp_file_goes_at_once_and_a_live_ones_stays(tmp_path):
    target = UPath(tmp_path) / "kept" / "r1.parquet"
    (tmp_path / "kept").mkdir()
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid no longer runs
    dead = tmp_path / "kept" / f"{files.writer_named('.r1.parquet', finished.pid)}.tmp"
    live = tmp_path / "kept" / f"{files.writer_named('.r1.parquet')}.tmp"
    # the same hostname in another PID namespace (a container on the host's network): its pid may be free here
    theirs = tmp_path / "kept" / f".r1.parquet.{files.writer_tag(files.HOST, 'another boot:1')}.{finished.pid}.00dd.tmp"
    for file in (dead, live, theirs):
        file.write_bytes(b"half a file")
    write_parquet(to_arrow(empty_frame("kept"), "kept"), target)
    assert not dead.exists() and live.exists() and theirs.exists()


def test_two_writers_of_the_same_file_both_succeed(tmp_path):
    # two runs refreshing an across-runs asset at the same moment (two CLI calls); one file, the last wins
    target = UPath(tmp_path) / "coverage.parquet"
    table = to_arrow(empty_frame("coverage"), "coverage")
    with ThreadPoolExecutor(max_workers=2) as writers:
        done = [writers.submit(write_parquet, table, target) for _ in range(40)]
        for write in done:
            write.result()  # raises if one writer removed the other's temp file
    assert pq.read_table(target).num_rows == 0
    assert [p.name for p in tmp_path.iterdir()] == ["coverage.parquet"]


def test_an_endpoint_url_on_a_local_data_root_is_refused(tmp_path):
    with pytest.raises(ValueError, match="applies to an s3:// data root"):
        DataRoot(path=str(tmp_path), endpoint_url="http://127.0.0.1:9").root


def kept_file_columns(tmp_path) -> dict:
    """Column name -> the Parquet column-chunk metadata of `kept` after a two-task batch d1 is filtered."""
    run = tmp_path / "runs" / "d1"
    run.mkdir(parents=True)
    (run / "tasks.jsonl").write_text(jsonl([task("a"), task("b")]))
    (run / "executions.jsonl").write_text(jsonl([attempt("a"), attempt("b")]))
    (run / "_SUCCESS").write_text("")
    assert materialize_all(str(tmp_path), "d1").success
    meta = pq.ParquetFile(tmp_path / "warehouse" / "kept" / "d1.parquet").metadata.row_group(0)
    return {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}


def test_low_cardinality_columns_are_dictionary_encoded_and_unique_ones_are_not(tmp_path):
    encodings = {name: column.encodings for name, column in kept_file_columns(tmp_path).items()}
    # the history scan counts (macro, site) by dictionary code
    assert all("RLE_DICTIONARY" in encodings[c] for c in ("macro", "site", "run_id"))
    assert not any("RLE_DICTIONARY" in encodings[c] for c in ("task_id", "dedup_key", "dir"))


def test_statistics_are_written_where_they_can_skip_a_file(tmp_path):
    stats = {name: column.statistics for name, column in kept_file_columns(tmp_path).items()}
    assert stats["run_id"].min == stats["run_id"].max == "d1"  # a query for another run skips this file
    assert (stats["task_id"].min, stats["task_id"].max) == ("a", "b")
    assert all(stats[c] is not None and stats[c].has_min_max for c in ("dir", "attempt", "key_hash", "passed"))
    assert all(stats[c] is None for c in ("dedup_key", "instruction", "macro", "site", "why"))


def verdict_frame() -> pd.DataFrame:
    """judge_verdicts rows with every kind of column: text, nullable bool and int, float with a null."""
    from filter_pipeline_tests.builders import verdicts

    return verdicts({"task_id": "a"}, {"task_id": "b", "passed": None, "status": "error"}).assign(
        latency_ms=[1.5, None]
    )


def test_a_step_loads_what_the_run_just_wrote_exactly_as_the_file_reads(tmp_path):
    manager = warehouse.ParquetWarehouseIOManager(base_path=UPath(tmp_path))
    path = UPath(tmp_path) / "judge_verdicts" / "r1.parquet"
    context = dg.build_output_context(asset_key="judge_verdicts")
    manager.dump_to_path(context, verdict_frame(), path)
    assert manager.get_metadata(context, verdict_frame()) == {"dagster/row_count": 2}
    from_file = read_parquet(path)
    pd.testing.assert_frame_equal(manager.load_from_path(dg.build_input_context(), path), from_file)


def test_a_file_replaced_since_the_write_is_read_from_disk(tmp_path):
    manager = warehouse.ParquetWarehouseIOManager(base_path=UPath(tmp_path))
    path = UPath(tmp_path) / "judge_verdicts" / "r1.parquet"
    manager.dump_to_path(dg.build_output_context(asset_key="judge_verdicts"), verdict_frame(), path)
    other = warehouse.ParquetWarehouseIOManager(base_path=UPath(tmp_path))  # another process rewrites it
    other.dump_to_path(dg.build_output_context(asset_key="judge_verdicts"), verdict_frame().iloc[:1], path)
    assert manager.load_from_path(dg.build_input_context(), path)["task_id"].tolist() == ["a"]
