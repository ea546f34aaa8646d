"""Beyond one machine, with real servers on loopback: the Dagster instance on PostgreSQL
(deploy/dagster-postgres.yaml), the warehouse and batches on an S3-compatible server, `dagster-daemon`
driving the sensor and the run queue, each step in its own process (multiprocess executor). The outputs
must equal, row by row, those of the default local run (`filter-pipeline materialize` on local disk)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from filter_pipeline.rules.schemas import SCHEMAS
from filter_pipeline.shell.jobs import ACROSS_RUNS_ASSETS
from filter_pipeline.shell.sensors import coverage_run_key
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.history import read_commits
from filter_pipeline_tests.conftest import REPO, assert_verified
from filter_pipeline_tests.servers import stop_process_group

pytestmark = pytest.mark.slow

SAMPLE = REPO / "data"
FIRST, SECOND = "2026-11-28", "2026-11-29"
DEADLINE_SECONDS = 420
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED]  # fmt: skip


def copy_sample(target: Path) -> None:
    """The sample data root without any outputs: runs/ (one legacy kept.jsonl, two batches) and labels."""
    shutil.copytree(SAMPLE / "runs", target / "runs")
    shutil.copy(SAMPLE / "labels.jsonl", target / "labels.jsonl")


def wait_until(condition, what: str, log: Path, seconds: float = DEADLINE_SECONDS) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return
        time.sleep(2)
    raise TimeoutError(f"{what} did not happen within {seconds} s; daemon log tail:\n{log.read_text()[-4000:]}")


@pytest.fixture
def local_warehouse(tmp_path, cli) -> Path:
    """The reference: the sample data filtered the default way (local disk, SQLite instance, CLI)."""
    data = tmp_path / "local"
    copy_sample(data)
    result = cli(env={"FILTER_PIPELINE_DATA": str(data)})
    assert result.returncode == 0, result.stderr[-3000:]
    return data / "warehouse"


class Daemon:
    """`dagster-daemon run` on the workspace, the way a deployment runs it (no webserver needed)."""

    def __init__(self, home: Path, env: dict):
        self.log_path = home / "daemon.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def stop(self) -> None:
        stop_process_group(self.proc, grace_seconds=60)
        self.log.close()


def test_two_batches_on_s3_through_the_daemon_on_postgres_equal_the_local_run(
    tmp_path, local_warehouse, s3_bucket, s3_server, postgres_server, monkeypatch
):
    url = f"s3://{s3_bucket}/data"
    s3 = s3_server.filesystem()
    staged = tmp_path / "staged"
    copy_sample(staged)
    (staged / "runs" / SECOND / "_SUCCESS").unlink()  # the second batch is still being written
    s3.put(f"{staged}/", f"{s3_bucket}/data/", recursive=True)

    home = tmp_path / "pg_home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster-postgres.yaml", home / "dagster.yaml")
    for name, value in postgres_server.env.items():
        monkeypatch.setenv(name, value)
    env = {
        **os.environ,  # the AWS and DAGSTER_PG_* variables set above
        "DAGSTER_HOME": str(home),
        "FILTER_PIPELINE_DATA": url,
        "FILTER_PIPELINE_EXECUTOR": "multiprocess",
    }
    data = DataRoot(path=url)
    daemon = Daemon(home, env)
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        kept_file = lambda run_id: data.asset_file("kept", run_id).exists()  # noqa: E731
        wait_until(lambda: kept_file(FIRST), f"kept of {FIRST} on S3", daemon.log_path)
        (data.run_dir(SECOND) / "_SUCCESS").write_text("")  # the harness finishes the second batch
        wait_until(lambda: kept_file(SECOND), f"kept of {SECOND} on S3", daemon.log_path)

        def coverage_is_current() -> bool:
            """the sensor's refresh after the last walk done, and no run left in flight."""
            key = coverage_run_key(read_commits(data.warehouse))
            done = instance.get_run_records(
                dg.RunsFilter(tags={"dagster/run_key": key}, statuses=[dg.DagsterRunStatus.SUCCESS])
            )
            return bool(done) and not instance.get_run_records(dg.RunsFilter(statuses=IN_FLIGHT))

        wait_until(coverage_is_current, "coverage over both batches", daemon.log_path)
        runs = instance.get_run_records(dg.RunsFilter())
    finally:
        daemon.stop()

    # the instance really is PostgreSQL, and every run it recorded succeeded
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    assert {r.dagster_run.status for r in runs} == {dg.DagsterRunStatus.SUCCESS}, [
        (r.dagster_run.job_name, r.dagster_run.status) for r in runs
    ]
    by_job = lambda job: sorted((r for r in runs if r.dagster_run.job_name == job), key=lambda r: r.start_time)  # noqa: E731
    assert [r.dagster_run.tags["dagster/partition"] for r in by_job("judge_job")] == [FIRST, SECOND]
    ledger_runs = by_job("ledger_job")
    assert [r.dagster_run.tags["dagster/partition"] for r in ledger_runs] == [FIRST, SECOND]
    assert ledger_runs[0].end_time <= ledger_runs[1].start_time

    # multiprocess executor: each step ran in a process of its own, not in the run worker
    judge_run = by_job("judge_job")[0].dagster_run.run_id
    events = [e.dagster_event for e in instance.all_logs(judge_run) if e.is_dagster_event]
    step_pids = {e.step_key: e.pid for e in events if e.event_type == dg.DagsterEventType.STEP_START}
    worker_pids = {e.pid for e in events if e.event_type == dg.DagsterEventType.RUN_START}
    assert step_pids and len(set(step_pids.values())) == len(step_pids)
    assert not set(step_pids.values()) & worker_pids
    instance.dispose()

    # the outputs: every asset file of the local run exists on S3 with the same rows
    compared = 0
    for asset in sorted(SCHEMAS):
        names = (
            [f"{asset}.parquet"]
            if asset in ACROSS_RUNS_ASSETS
            else [f"{asset}/{FIRST}.parquet", f"{asset}/{SECOND}.parquet"]
        )
        for name in names:
            local = pd.read_parquet(local_warehouse / name)
            remote = pd.read_parquet(f"{url}/warehouse/{name}")
            pd.testing.assert_frame_equal(remote, local, check_like=False, obj=name)
            compared += 1
    assert compared == 2 * (len(SCHEMAS) - len(ACROSS_RUNS_ASSETS)) + len(ACROSS_RUNS_ASSETS)
    assert_verified(data.root)
    assert len(pd.read_parquet(local_warehouse / "kept")) > 0
