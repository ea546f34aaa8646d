"""Runs filtered elsewhere show as materialized, never as missing: legacy runs (runs/<run>/kept.jsonl of the
earlier script), and runs another instance or the CLI committed to the same warehouse."""

import json

import dagster as dg

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.assets import run_id_partitions
from filter_pipeline.shell.sensors import PARTITIONED_ASSETS, build_batch_sensor
from filter_pipeline_tests.builders import (
    LogLines,
    Pipeline,
    attempt,
    sensor_context,
    task,
    write_batch,
    write_legacy_kept,
)


def test_the_recorded_assets_are_every_run_id_partitioned_asset():
    graph = build_defs("data", JudgeResource(), caps={}).resolve_asset_graph()
    partitioned = {k.path[-1] for k in graph.get_all_asset_keys() if graph.get(k).partitions_def is not None}
    assert set(PARTITIONED_ASSETS) == partitioned


def test_a_legacy_run_is_materialized_with_its_row_count_once_and_not_missing(instance, data_root):
    write_batch(data_root, "legacy", [task("a")], [attempt("a")])
    write_legacy_kept(data_root, "legacy", ("a", ["k1"], "m", "s"), ("b", ["k2"], "m", "s"))
    write_batch(data_root, "new", [task("c")], [attempt("c")])
    sensor = build_batch_sensor()
    context = lambda: sensor_context(instance, data_root)  # noqa: E731
    first = context()
    said = LogLines()
    first.log.addHandler(said)
    result = sensor(first)
    sensor(context())  # a second tick records nothing more
    assert said.lines[:2] == ["registered 1 legacy run(s) (filtered by the earlier script)",
                              "legacy: recorded as materialized (legacy kept.jsonl)"]  # fmt: skip
    assert said.lines[-1].startswith("registered 1 new batch(es), judging 1;")

    assert [r.partition_key for r in result.run_requests if r.job_name == "judge_job"] == ["new"]
    assert set(instance.get_dynamic_partitions("run_id")) >= {"legacy"}
    for asset in PARTITIONED_ASSETS:
        status = instance.get_status_by_partition(dg.AssetKey(asset), ["legacy", "new"], run_id_partitions)
        assert status["legacy"] == dg.AssetPartitionStatus.MATERIALIZED, asset
        assert status.get("new") != dg.AssetPartitionStatus.MATERIALIZED, (
            asset
        )  # "missing": what a missing selection targets
    events = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("kept"), asset_partitions=["legacy"]), limit=10
    )
    [record] = events.records
    metadata = record.asset_materialization.metadata
    assert metadata["dagster/row_count"].value == 2 and metadata["source"].value == "legacy kept.jsonl"


def kept_materializations(instance, run_id: str) -> list:
    filter = dg.AssetRecordsFilter(asset_key=dg.AssetKey("kept"), asset_partitions=[run_id])
    return [r.asset_materialization for r in instance.fetch_materializations(filter, limit=10).records]


def test_a_run_another_instance_committed_is_recorded_as_materialized_once_from_its_commit(instance, data_root):
    write_batch(data_root, "r1", [task("a"), task("b", key=["s", "#b", 2])], [attempt("a"), attempt("b")])
    with dg.DagsterInstance.ephemeral() as deployment:  # (the CLI's instance, say, on the same warehouse)
        Pipeline(data_root, deployment).run(JudgeResource(), "r1")
        sensor_context_there = sensor_context(deployment, data_root)
        build_batch_sensor()(sensor_context_there)
        assert len(kept_materializations(deployment, "r1")) == 1  # its own walk's: nothing recorded there
    sensor = build_batch_sensor()
    instance.add_dynamic_partitions("run_id", ["r1"])  # (registered by this instance's first tick)
    first = sensor_context(instance, data_root)
    said = LogLines()
    first.log.addHandler(said)
    result = sensor(first)
    sensor(sensor_context(instance, data_root))  # a second tick records nothing more
    assert "r1: recorded as materialized (committed by a walk this instance has no record of)" in said.lines
    assert [r.job_name for r in result.run_requests] == ["across_runs_job"]  # nothing judged or walked again
    for asset in PARTITIONED_ASSETS:
        status = instance.get_status_by_partition(dg.AssetKey(asset), ["r1"], run_id_partitions)
        assert status["r1"] == dg.AssetPartitionStatus.MATERIALIZED, asset
    [kept] = kept_materializations(instance, "r1")
    record = json.loads((data_root / "warehouse" / "_commits" / "r1.json").read_text())
    assert kept.metadata["dagster/row_count"].value == 2 == record["files"]["kept"]["rows"]
    assert kept.metadata["sha256"].value == record["files"]["kept"]["sha256"]
    assert "warehouse/_commits/r1.json" in kept.metadata["source"].value


def test_a_committed_run_whose_last_attempt_here_failed_is_left_failed(instance, data_root):
    @dg.asset(name="kept", partitions_def=run_id_partitions)
    def failing_kept():
        raise RuntimeError("a walk that failed on this instance")

    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    with dg.DagsterInstance.ephemeral() as elsewhere:
        Pipeline(data_root, elsewhere).run(JudgeResource(), "r1")  # committed by another instance
    instance.add_dynamic_partitions("run_id", ["r1"])
    assert not dg.materialize([failing_kept], instance=instance, partition_key="r1", raise_on_error=False).success
    said = LogLines()
    context = sensor_context(instance, data_root)
    context.log.addHandler(said)
    build_batch_sensor()(context)
    assert not any("recorded as materialized" in line for line in said.lines)
    status = instance.get_status_by_partition(dg.AssetKey("kept"), ["r1"], run_id_partitions)
    assert status["r1"] == dg.AssetPartitionStatus.FAILED
