"""As a user would: `dagster dev -w workspace.yaml` on loopback, batches dropped into the data root, the
sensor doing the rest; lineage and materializations read back through the webserver's GraphQL API."""

import time

import dagster as dg
import pandas as pd
import pytest

from filter_pipeline.shell.jobs import ACROSS_RUNS_ASSETS, FIRST_WALK_TAG
from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import assert_verified
from filter_pipeline_tests.dagster_dev import DagsterDev

pytestmark = pytest.mark.slow

DEADLINE_SECONDS = 300


@pytest.fixture(scope="module")
def dagster_dev(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    (root / "data" / "runs").mkdir(parents=True)
    with DagsterDev(root / "home", root / "data") as server:
        yield server


def wait_for_kept(server: DagsterDev, run_ids: list[str]) -> None:
    deadline = time.time() + DEADLINE_SECONDS
    while time.time() < deadline:
        if all((server.data / "warehouse" / "kept" / f"{r}.parquet").exists() for r in run_ids):
            with dg.DagsterInstance.from_config(str(server.home)) as instance:
                if not instance.get_run_records(
                    dg.RunsFilter(
                        statuses=[dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING]
                    )
                ):
                    return
        time.sleep(2)
    raise TimeoutError(f"sensor did not filter {run_ids}; log tail:\n" + server.log_tail(3000))


def test_a_dropped_batch_is_filtered_with_no_clicks_and_lineage_is_visible(dagster_dev):
    write_batch(dagster_dev.data, "b0", [task("a"), task("b")], [attempt("a"), attempt("b", ok=False, error="x")])
    wait_for_kept(dagster_dev, ["b0"])

    nodes = dagster_dev.graphql("{ assetNodes { assetKey { path } dependencyKeys { path } groupName } }")["assetNodes"]
    deps = {n["assetKey"]["path"][-1]: sorted(d["path"][-1] for d in n["dependencyKeys"]) for n in nodes}
    assert "batch_tasks" in deps["judge_verdicts"] and "batch_attempts" in deps["judge_verdicts"]
    assert "judge_verdicts" in deps["failure_pool"]
    for asset in ("kept", "surplus"):
        assert {"judge_verdicts", "prior_dedup_index"} <= set(deps[asset])

    query = """query($key: AssetKeyInput!) { assetOrError(assetKey: $key) {
        ... on Asset { assetMaterializations(partitions: ["b0"]) { partition runId } } } }"""
    for asset in set(deps) - set(ACROSS_RUNS_ASSETS):
        materializations = dagster_dev.graphql(query, {"key": {"path": [asset]}})["assetOrError"][
            "assetMaterializations"
        ]
        assert [m["partition"] for m in materializations] == ["b0"], asset

    report = dagster_dev.graphql(
        """{ assetOrError(assetKey: {path: ["filter_report"]}) { ... on Asset { assetMaterializations(partitions: ["b0"]) {
            metadataEntries { label ... on MarkdownMetadataEntry { mdStr } } } } } }"""
    )["assetOrError"]["assetMaterializations"][0]["metadataEntries"]
    [markdown] = [e["mdStr"] for e in report if e["label"] == "report"]
    assert markdown.count("](data:image/svg+xml;base64,") == 2  # the funnel and reasons-per-site charts

    coverage = dagster_dev.data / "warehouse" / "coverage.parquet"
    deadline = time.time() + 90
    while not coverage.exists() and time.time() < deadline:
        time.sleep(2)
    kept = pd.read_parquet(dagster_dev.data / "warehouse" / "kept")
    table = pd.read_parquet(coverage)
    assert table.loc[table["level"] == "site", "kept"].sum() == len(kept)
    entries = dagster_dev.graphql(
        """{ assetOrError(assetKey: {path: ["coverage"]}) { ... on Asset { assetMaterializations(limit: 1) {
            metadataEntries { label ... on MarkdownMetadataEntry { mdStr } } } } } }"""
    )["assetOrError"]["assetMaterializations"][0]["metadataEntries"]
    assert [e["mdStr"].count("](data:image/svg+xml;base64,") for e in entries if e["label"] == "coverage"] == [1]

    repos = dagster_dev.graphql(
        "{ repositoriesOrError { ... on RepositoryConnection { nodes { sensors { name sensorState { status } } } } } }"
    )["repositoriesOrError"]["nodes"]
    sensors = [(s["name"], s["sensorState"]["status"]) for repo in repos for s in repo["sensors"]]
    assert sorted(sensors) == [("batch_sensor", "RUNNING"), ("labels_sensor", "RUNNING"), ("retired_sensor", "RUNNING")]
    assert_verified(dagster_dev.data)


def test_eight_batches_at_once_are_walked_one_ledger_run_at_a_time_in_run_id_order(dagster_dev):
    run_ids = [f"c{i}" for i in range(8)]
    for run_id in reversed(run_ids):
        tasks = [task(f"{run_id}-{i}", site=f"s{i % 3}", key=["shared", i]) for i in range(12)]
        write_batch(dagster_dev.data, run_id, tasks, [attempt(t["task_id"]) for t in tasks])
    wait_for_kept(dagster_dev, run_ids)

    kept = pd.read_parquet(dagster_dev.data / "warehouse" / "kept")
    assert kept["dedup_key"].is_unique
    assert kept.groupby(["macro", "site"]).size().max() <= 3
    # the first batch walked takes every key it can; run_id order means that is c0
    assert set(kept.loc[kept["run_id"].str.startswith("c"), "run_id"]) == {"c0"}

    with dg.DagsterInstance.from_config(str(dagster_dev.home)) as instance:
        ledger_runs = instance.get_run_records(dg.RunsFilter(job_name="ledger_job"))
        judge_runs = instance.get_run_records(dg.RunsFilter(job_name="judge_job"))
    # b0's ledger run, then c0..c7 in as many runs as the judge runs' finishing let the sensor see them ready
    assert len(judge_runs) == 9 and 2 <= len(ledger_runs) <= 9
    in_start_order = sorted(ledger_runs, key=lambda r: r.start_time)
    walked = [w for r in in_start_order for w in r.dagster_run.tags[FIRST_WALK_TAG].split()]
    assert [w for w in walked if w.startswith("c")] == run_ids
    spans = sorted((r.start_time, r.end_time) for r in ledger_runs)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert_verified(dagster_dev.data)
