"""Legacy runs (runs/<run>/kept.jsonl of the earlier script) show as materialized, never as missing."""

import dagster as dg
import pytest

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.assets import run_id_partitions
from filter_pipeline.shell.sensors import PARTITIONED_ASSETS, build_batch_sensor
from filter_pipeline_tests.builders import LogLines, attempt, sensor_context, task, write_batch, write_legacy_kept


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


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
