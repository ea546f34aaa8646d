"""The ledger keeps run_id order whoever launches it (CONTRACT §4), without `dagster dev`: runs launched
out of order on one instance, a ranged (single-run backfill) step, a blocked step that retries while the lower
run walks, and one that gives up with one line."""

import json
import os
import shutil
import threading
import time
import uuid

import dagster as dg
import pandas as pd
import pytest
from upath import UPath

from filter_pipeline.cli.summary import failure_reason
from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.settings import (
    ORDER_MAX_WAIT_SECONDS_ENV,
    ORDER_QUEUED_SECONDS_ENV,
    ORDER_RETRY_SECONDS_ENV,
    materialize_command,
)
from filter_pipeline.shell.jobs import FIRST_WALK_TAG, PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG
from filter_pipeline.shell.waiting import DEFERRED_TAG, ORDER_MAX_WAIT_TAG, PARENT_RUN_TAG, WALKED_BEFORE_WAITING_TAG
from filter_pipeline.storage.failures import read_failures
from filter_pipeline_tests.builders import attempt, task, write_batch

REGISTERED = ["b2", "b0", "b3", "b1"]  # the order the batches arrive in; run_id order differs
LEDGER_ASSETS = ["prior_dedup_index", "prior_kept_counts", "kept", "surplus", "dpo_pairs", "filter_report"]


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setenv(ORDER_RETRY_SECONDS_ENV, "1")
    monkeypatch.setenv(ORDER_MAX_WAIT_SECONDS_ENV, "120")


def overlapping(data_root, run_ids=REGISTERED, n=8):
    """Batches whose keys and (macro, site) counts overlap, so a walk's result depends on the runs before it."""
    for run_id in run_ids:
        shift = int(run_id[1:])
        tasks = [task(f"{run_id}-{i}", site=f"s{i % 2}", key=["s", "#el", i + 2 * shift]) for i in range(n)]
        write_batch(data_root, run_id, tasks, [attempt(t["task_id"]) for t in tasks])


def defs_for(data_root):
    return build_defs(str(data_root), JudgeResource(), caps={})


def run_job(defs, instance, name, run_id, **kw):
    return defs.resolve_job_def(name).execute_in_process(
        instance=instance, partition_key=run_id, raise_on_error=False, **kw
    )


def ledger_rows(data_root, run_ids) -> dict:
    return {
        (asset, r): pd.read_parquet(data_root / "warehouse" / asset / f"{r}.parquet")
        for asset in ("kept", "surplus") for r in run_ids
    }  # fmt: skip


def reference(tmp_path, data_root, run_ids) -> dict:
    """kept and surplus as the CLI makes them: each run's whole graph, one after the other in run_id order."""
    copy = tmp_path / "reference"
    shutil.copytree(data_root, copy)
    defs = defs_for(copy)
    with dg.DagsterInstance.ephemeral() as other:
        other.add_dynamic_partitions("run_id", sorted(run_ids))
        for r in sorted(run_ids):
            assert run_job(defs, other, "filter_job", r).success
    return ledger_rows(copy, run_ids)


def assert_same(found: dict, expected: dict):
    for key, frame in expected.items():
        pd.testing.assert_frame_equal(found[key], frame, obj=str(key))


def steps(instance, run_id, event_type) -> list[str]:
    return [e.step_key for e in instance.all_logs(run_id, of_type=event_type)]


# one process per run, as a backfill's runs are launched: filter_job for one partition on the instance at DAGSTER_HOME
LAUNCH = """
import sys, dagster as dg
from filter_pipeline.cli.materialize import cli_filter_job
with dg.DagsterInstance.get() as instance:
    with dg.execute_job(dg.reconstructable(cli_filter_job), instance, tags={"dagster/partition": sys.argv[1]}) as result:
        print(result.run_id)
        sys.exit(0 if result.success else 1)
"""


@pytest.mark.slow
def test_runs_launched_in_registration_order_at_once_give_the_run_id_order_results(data_root, tmp_path, dagster_home):
    import subprocess
    import sys

    from filter_pipeline_tests.conftest import REPO

    overlapping(data_root)
    expected = reference(tmp_path, data_root, REGISTERED)
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "FILTER_PIPELINE_DATA": str(data_root),
           ORDER_RETRY_SECONDS_ENV: "1", ORDER_MAX_WAIT_SECONDS_ENV: "300"}  # fmt: skip
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        instance.add_dynamic_partitions("run_id", REGISTERED)
    procs = {}
    for run_id in REGISTERED:  # as a backfill of filter_job submits them, all at once
        procs[run_id] = subprocess.Popen([sys.executable, "-c", LAUNCH, run_id], env=env, cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(0.3)
    runs = {}
    for run_id, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        runs[run_id] = out.strip().splitlines()[-1]
    assert_same(ledger_rows(data_root, REGISTERED), expected)
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        # some runs did wait: their ledger step was retried rather than walking out of order
        assert any(steps(instance, rid, dg.DagsterEventType.STEP_UP_FOR_RETRY) for rid in runs.values())


def test_a_ranged_ledger_step_walks_its_partitions_in_run_id_order(instance, data_root, tmp_path):
    overlapping(data_root)
    expected = reference(tmp_path, data_root, REGISTERED)
    instance.add_dynamic_partitions("run_id", REGISTERED)
    defs = defs_for(data_root)
    for run_id in REGISTERED:
        assert run_job(defs, instance, "judge_job", run_id).success
    job = ranged_ledger(defs)
    # the whole range in registration order, as a single-run backfill tags its run
    result = job.execute_in_process(instance=instance, tags={RANGE_START_TAG: "b2", RANGE_END_TAG: "b1"})
    assert result.success
    assert_same(ledger_rows(data_root, REGISTERED), expected)
    walked = [e.user_message for e in instance.all_logs(result.run_id) if e.user_message.startswith("walking ")]
    assert [m.split()[1] for m in walked] == ["b0", "b1", "b2", "b3"]
    # each partition materialized on its own, with its own file's row count
    for run_id in REGISTERED:
        [materialization] = materializations(instance, result.run_id, "kept", run_id)
        rows = materialization.metadata["dagster/row_count"].value
        assert rows == len(ledger_rows(data_root, [run_id])[("kept", run_id)])
    assert partition_status(instance, defs, REGISTERED) == dict.fromkeys(
        REGISTERED, dg.AssetPartitionStatus.MATERIALIZED
    )


# one process per ranged ledger run, as an asset backfill launches its runs: the range is argv[1]..argv[2]
LAUNCH_RANGE = """
import os, sys, dagster as dg
from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.jobs import RANGE_END_TAG, RANGE_START_TAG
defs = build_defs(os.environ["FILTER_PIPELINE_DATA"], JudgeResource(), caps={})
ranged = dg.define_asset_job("ranged_ledger", selection=dg.AssetSelection.assets(*sys.argv[3:]))
job = dg.Definitions.merge(defs, dg.Definitions(jobs=[ranged])).resolve_job_def("ranged_ledger")
with dg.DagsterInstance.get() as instance:
    tags = {RANGE_START_TAG: sys.argv[1], RANGE_END_TAG: sys.argv[2]}
    result = job.execute_in_process(instance=instance, tags=tags, raise_on_error=False)
    print(result.run_id)
    sys.exit(0 if result.success else 1)
"""


@pytest.mark.slow
def test_two_ranged_ledger_steps_each_holding_a_run_the_other_waits_for_both_walk_in_run_id_order(
    data_root, tmp_path, dagster_home
):
    import subprocess
    import sys

    from filter_pipeline_tests.conftest import REPO

    # registered b0, b2, b1, b3: a backfill's ranges follow registration order, [b0, b2] and [b1, b3], so each
    # range holds a run that waits for a run of the other
    run_ids = ["b0", "b1", "b2", "b3"]
    overlapping(data_root, run_ids)
    expected = reference(tmp_path, data_root, run_ids)
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        instance.add_dynamic_partitions("run_id", ["b0", "b2", "b1", "b3"])
        defs = defs_for(data_root)
        for run_id in run_ids:
            assert run_job(defs, instance, "judge_job", run_id).success
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "FILTER_PIPELINE_DATA": str(data_root),
           ORDER_RETRY_SECONDS_ENV: "1", ORDER_MAX_WAIT_SECONDS_ENV: "300"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LAUNCH_RANGE, start, end, *LEDGER_ASSETS],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for start, end in (("b0", "b2"), ("b1", "b3"))
    ]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        runs.append(out.strip().splitlines()[-1] if out.strip() else None)
        assert proc.returncode == 0, err[-3000:]
    assert_same(ledger_rows(data_root, run_ids), expected)
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        # each range must walk its lower run, then wait for the other's: its next try reports that run as its own
        for dagster_run, lower in zip(runs, ("b0", "b1")):
            logged = [e.user_message for e in instance.all_logs(dagster_run)]
            said = [line.split(" (")[0] for line in logged if line.startswith(f"{lower}: already filtered")]
            assert said == [f"{lower}: already filtered by this run"]
            assert f"walking {lower} (1 of 2 in run_id order)" in logged  # (counted in its range, first try)
            assert (
                instance.get_run_by_id(dagster_run).tags[WALKED_BEFORE_WAITING_TAG] == f"{lower} in run {dagster_run}"
            )
        # every partition materialized once a walk committed it, though each range was walked over two tries
        assert partition_status(instance, defs, run_ids) == dict.fromkeys(run_ids, dg.AssetPartitionStatus.MATERIALIZED)


def ranged_ledger(defs) -> dg.JobDefinition:
    """The ledger's assets as one job, which a range's tags run as a single-run backfill does."""
    ranged = dg.define_asset_job("ranged_ledger", selection=dg.AssetSelection.assets(*LEDGER_ASSETS))
    return dg.Definitions.merge(defs, dg.Definitions(jobs=[ranged])).resolve_job_def("ranged_ledger")


def judged_range_around_b1(data_root, instance) -> dg.JobDefinition:
    """b0, b1 and b2 complete and registered; b0 and b2 judged, b1 not: a range [b0, b2] may walk b0 only."""
    overlapping(data_root, ["b0", "b1", "b2"])
    instance.add_dynamic_partitions("run_id", ["b0", "b2", "b1"])
    defs = defs_for(data_root)
    for run_id in ("b0", "b2"):
        assert run_job(defs, instance, "judge_job", run_id).success
    return ranged_ledger(defs)


def test_a_range_whose_later_run_waits_in_vain_fails_after_committing_the_runs_before_it(instance, data_root):
    job = judged_range_around_b1(data_root, instance)
    tags = {RANGE_START_TAG: "b0", RANGE_END_TAG: "b2", ORDER_MAX_WAIT_TAG: "0"}
    result = job.execute_in_process(instance=instance, tags=tags, raise_on_error=False)
    reason = failure_reason(result)
    assert not result.success and "the first walk of b2 waits for b1" in reason
    assert "; committed, but not recorded as materialized (materializing again walks them again): b0" in reason
    said = [e.user_message for e in instance.all_logs(result.run_id) if e.user_message.startswith("walked and")]
    assert said == ["walked and committed b0; the rest of the range (b2) waits"]
    assert (data_root / "warehouse" / "_commits" / "b0.json").exists()
    assert not (data_root / "warehouse" / "kept" / "b2.parquet").exists()
    # none of the range is materialized, as when a check stops a range (a backfill waits on a range done in part)
    assert not materializations(instance, result.run_id, "kept", "b0")


@pytest.mark.slow
def test_a_range_that_defers_on_a_later_try_reports_the_runs_its_first_try_walked(data_root, dagster_home):
    import subprocess
    import sys

    from filter_pipeline_tests.conftest import REPO

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        judged_range_around_b1(data_root, instance)
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "FILTER_PIPELINE_DATA": str(data_root),
           ORDER_RETRY_SECONDS_ENV: "1", ORDER_MAX_WAIT_SECONDS_ENV: "300", ORDER_QUEUED_SECONDS_ENV: "0"}  # fmt: skip
    ranged = subprocess.Popen([sys.executable, "-c", LAUNCH_RANGE, "b0", "b2", *LEDGER_ASSETS], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (data_root / "warehouse" / "_commits" / "b0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    queue_run(dagster_home, data_root, "judge_job", {PARTITION_TAG: "b1"})  # b1's run, stuck: no daemon
    out, err = ranged.communicate(timeout=300)
    assert ranged.returncode == 0, err[-3000:]
    dagster_run = out.strip().splitlines()[-1]
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        assert steps(instance, dagster_run, dg.DagsterEventType.STEP_UP_FOR_RETRY)  # deferred on a later try
        assert "b2 waits for b1" in instance.get_run_by_id(dagster_run).tags[DEFERRED_TAG]
        [materialization] = materializations(instance, dagster_run, "kept", "b0")
        assert not materializations(instance, dagster_run, "kept", "b2")


@pytest.mark.slow
def test_a_range_that_fails_on_a_later_try_names_the_runs_its_first_try_committed(data_root, dagster_home):
    import subprocess
    import sys

    from filter_pipeline_tests.conftest import REPO

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        judged_range_around_b1(data_root, instance)
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "FILTER_PIPELINE_DATA": str(data_root),
           ORDER_RETRY_SECONDS_ENV: "1", ORDER_MAX_WAIT_SECONDS_ENV: "300"}  # fmt: skip
    ranged = subprocess.Popen([sys.executable, "-c", LAUNCH_RANGE, "b0", "b2", *LEDGER_ASSETS], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (data_root / "warehouse" / "_commits" / "b0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    (data_root / "retired.json").write_text('{"run_id": "b1"}')  # broken while the step waits: no retry mends it
    out, _ = ranged.communicate(timeout=300)
    assert ranged.returncode == 1
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        [failure] = instance.all_logs(out.strip().splitlines()[-1], of_type=dg.DagsterEventType.STEP_FAILURE)
    message = failure.dagster_event.step_failure_data.error.message
    assert "retired.json" in message
    assert "committed, but not recorded as materialized (materializing again walks them again): b0" in message


@pytest.mark.slow
def test_a_range_whose_later_run_waits_for_a_run_stuck_in_the_queue_defers_it_and_reports_the_runs_it_walked(
    data_root, dagster_home, monkeypatch
):
    monkeypatch.setenv(ORDER_QUEUED_SECONDS_ENV, "0")
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        job = judged_range_around_b1(data_root, instance)
    queue_run(dagster_home, data_root, "judge_job", {PARTITION_TAG: "b1"})
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        result = job.execute_in_process(instance=instance, tags={RANGE_START_TAG: "b0", RANGE_END_TAG: "b2"})
        assert result.success
        tags = instance.get_run_by_id(result.run_id).tags
        assert (
            "b2 waits for b1" in tags[DEFERRED_TAG] and tags[WALKED_BEFORE_WAITING_TAG] == f"b0 in run {result.run_id}"
        )
        [materialization] = materializations(instance, result.run_id, "kept", "b0")
        assert not materializations(instance, result.run_id, "kept", "b2")
    assert not (data_root / "warehouse" / "kept" / "b2.parquet").exists()


def test_a_range_retried_after_walking_its_first_runs_knows_them_by_its_tag_not_by_the_clocks(instance, data_root):
    # b0 committed by this run's first try, at a moment the run storage's clock puts before the run was created
    job = judged_range_around_b1(data_root, instance)
    assert run_job(job_defs := defs_for(data_root), instance, "ledger_job", "b0").success
    commit = (data_root / "warehouse" / "_commits" / "b0.json").read_bytes()
    assert (
        run_job(job_defs, instance, "judge_job", "b1").success
        and run_job(job_defs, instance, "ledger_job", "b1").success
    )
    run_id = str(uuid.uuid4())  # (Dagster run ids are UUIDs)
    tags = {RANGE_START_TAG: "b0", RANGE_END_TAG: "b2", WALKED_BEFORE_WAITING_TAG: f"b0 in run {run_id}"}

    result = job.execute_in_process(instance=instance, tags=tags, run_id=run_id)

    said = [e.user_message for e in instance.all_logs(result.run_id) if e.user_message.startswith("b0: already")]
    assert [line.split(" (")[0] for line in said] == ["b0: already filtered by this run"]
    assert (data_root / "warehouse" / "_commits" / "b0.json").read_bytes() == commit  # not walked again
    assert (data_root / "warehouse" / "_commits" / "b2.json").exists()


def materializations(instance, dagster_run_id: str, asset: str, partition: str) -> list:
    return [
        e.asset_materialization
        for e in instance.all_logs(dagster_run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        if e.asset_materialization.asset_key == dg.AssetKey(asset) and e.asset_materialization.partition == partition
    ]


def partition_status(instance, defs, run_ids: list[str]) -> dict:
    kept = defs.resolve_assets_def("kept")
    return instance.get_status_by_partition(dg.AssetKey("kept"), run_ids, kept.partitions_def)


@pytest.mark.slow
def test_a_blocked_ledger_step_retries_and_walks_once_the_lower_run_is_filtered_meanwhile(
    data_root, tmp_path, quick_retries
):
    # (an instance in a folder: two runs write to it from two threads, which Dagster's in-memory run storage
    # does not take)
    with dg.instance_for_test() as instance:
        _blocked_then_walked(instance, data_root, tmp_path)


def _blocked_then_walked(instance, data_root, tmp_path):
    overlapping(data_root, ["b0", "b1"])
    expected = reference(tmp_path, data_root, ["b0", "b1"])
    instance.add_dynamic_partitions("run_id", ["b1", "b0"])
    defs = defs_for(data_root)
    for run_id in ("b1", "b0"):
        assert run_job(defs, instance, "judge_job", run_id).success
    outcome = {}
    waiting = threading.Thread(target=lambda: outcome.setdefault("b1", run_job(defs, instance, "ledger_job", "b1")))
    waiting.start()
    deadline = time.time() + 120
    ledger_b1 = dg.RunsFilter(job_name="ledger_job", tags={PARTITION_TAG: "b1"})
    while time.time() < deadline and not instance.get_run_records(ledger_b1):
        time.sleep(0.2)
    [record] = instance.get_run_records(ledger_b1)
    while time.time() < deadline and not steps(
        instance, record.dagster_run.run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY
    ):
        time.sleep(0.2)
    assert not (data_root / "warehouse" / "kept" / "b1.parquet").exists()  # it did not walk
    waits = [e.user_message for e in instance.all_logs(record.dagster_run.run_id) if "waits for" in e.user_message]
    assert waits and "the first walk of b1 waits for b0" in waits[0]

    # while b1 waits for its retry, b0's ledger runs (no pool: a waiting step holds no slot anything else needs),
    # and b1's next try walks after it
    assert defs.resolve_assets_def("kept").op.pool is None
    assert run_job(defs, instance, "ledger_job", "b0").success
    waiting.join(timeout=300)
    assert outcome["b1"].success
    assert_same(ledger_rows(data_root, ["b0", "b1"]), expected)


def test_when_the_wait_runs_out_the_step_fails_with_one_line_naming_the_run(instance, data_root, monkeypatch):
    monkeypatch.setenv(ORDER_RETRY_SECONDS_ENV, "1")
    monkeypatch.setenv(ORDER_MAX_WAIT_SECONDS_ENV, "2")
    overlapping(data_root, ["b0", "b1"])
    instance.add_dynamic_partitions("run_id", ["b0", "b1"])
    defs = defs_for(data_root)
    assert run_job(defs, instance, "judge_job", "b1").success  # b0 is complete but never judged
    result = run_job(defs, instance, "ledger_job", "b1")
    assert not result.success
    assert len(steps(instance, result.run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY)) == 2
    reason = failure_reason(result)
    assert reason.startswith("step ledger: the first walk of b1 waits for b0: ")
    assert f"gave up after waiting 2 s ({ORDER_MAX_WAIT_SECONDS_ENV})" in reason and "\n" not in reason
    assert not (data_root / "warehouse" / "kept" / "b1.parquet").exists()
    # a launcher that waits for nothing (the CLI) tags its runs: the line names the tag, not the setting
    untried = run_job(defs, instance, "ledger_job", "b1", tags={ORDER_MAX_WAIT_TAG: "0"})
    assert f"gave up without waiting (this run's tag {ORDER_MAX_WAIT_TAG})" in failure_reason(untried)


def queue_run(dagster_home, data_root, job: str, tags: dict) -> None:
    """A run of `job` submitted as the UI, a backfill or the sensor submits one: it waits in the run queue (no
    daemon gives it a slot)."""
    import subprocess

    from filter_pipeline_tests.conftest import REPO

    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "FILTER_PIPELINE_DATA": str(data_root)}
    launch = [str(REPO / ".venv" / "bin" / "dagster"), "job", "launch", "-m", "filter_pipeline.definitions",
              "-j", job, "--tags", json.dumps(tags)]  # fmt: skip
    subprocess.run(launch, env=env, cwd=REPO, capture_output=True, check=True, timeout=120)


def judged_b1_of_two(data_root, dagster_home) -> None:
    """b0 and b1 complete and registered; b1 judged, b0 not walked."""
    overlapping(data_root, ["b0", "b1"])
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        instance.add_dynamic_partitions("run_id", ["b0", "b1"])
        assert run_job(defs_for(data_root), instance, "judge_job", "b1").success


@pytest.mark.slow
def test_a_run_that_waits_for_nothing_fails_naming_the_run_even_when_that_run_is_stuck_in_the_queue(
    data_root, dagster_home, monkeypatch
):
    monkeypatch.setenv(ORDER_QUEUED_SECONDS_ENV, "0")
    judged_b1_of_two(data_root, dagster_home)
    queue_run(dagster_home, data_root, "judge_job", {PARTITION_TAG: "b0"})
    defs = defs_for(data_root)
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        [queued] = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED]))
        assert queued.dagster_run.tags[PARTITION_TAG] == "b0"
        deferred = run_job(defs, instance, "ledger_job", "b1")  # a run that would wait lets its slot go to b0's
        assert deferred.success and DEFERRED_TAG in instance.get_run_by_id(deferred.run_id).tags
        untried = run_job(defs, instance, "ledger_job", "b1", tags={ORDER_MAX_WAIT_TAG: "0"})  # as the CLI tags it
        assert not untried.success and DEFERRED_TAG not in instance.get_run_by_id(untried.run_id).tags
        assert failure_reason(untried).startswith("step ledger: the first walk of b1 waits for b0: ")
    assert not (data_root / "warehouse" / "kept" / "b1.parquet").exists()


@pytest.mark.slow
def test_a_waiting_run_lets_its_slot_go_to_an_asset_backfills_ledger_run_queued_over_the_run_it_waits_for(
    data_root, dagster_home, monkeypatch
):
    monkeypatch.setenv(ORDER_QUEUED_SECONDS_ENV, "0")
    monkeypatch.setenv(ORDER_RETRY_SECONDS_ENV, "1")
    monkeypatch.setenv(ORDER_MAX_WAIT_SECONDS_ENV, "2")
    judged_b1_of_two(data_root, dagster_home)
    # "Materialize all" of the ledger's assets over b0: one run for the range, with no partition tag
    queue_run(dagster_home, data_root, "ledger_job", {RANGE_START_TAG: "b0", RANGE_END_TAG: "b0"})
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        deferred = run_job(defs_for(data_root), instance, "ledger_job", "b1")
        assert deferred.success, failure_reason(deferred)
        assert "waits for b0" in instance.get_run_by_id(deferred.run_id).tags[DEFERRED_TAG]


def test_a_batch_that_fails_validation_is_recorded_and_holds_later_ones_back_no_longer(
    instance, data_root, monkeypatch
):
    monkeypatch.setenv(ORDER_MAX_WAIT_SECONDS_ENV, "0")  # any wait would fail the later run at once
    write_batch(data_root, "b0", [], [])
    overlapping(data_root, ["b1"])
    instance.add_dynamic_partitions("run_id", ["b0", "b1"])
    defs = defs_for(data_root)
    failed = run_job(defs, instance, "filter_job", "b0")
    assert not failed.success
    assert read_failures(UPath(str(data_root)) / "warehouse") == {"b0": "runs/b0/tasks.jsonl holds no valid task"}
    assert run_job(defs, instance, "filter_job", "b1").success

    overlapping(data_root, ["b0"])  # fixed: its walk is a late one, and removes the record
    assert run_job(defs, instance, "filter_job", "b0").success
    assert read_failures(UPath(str(data_root)) / "warehouse") == {}


def test_a_rewalk_of_a_filtered_run_never_waits(instance, data_root, monkeypatch):
    monkeypatch.setenv(ORDER_MAX_WAIT_SECONDS_ENV, "0")
    overlapping(data_root, ["b1"])
    instance.add_dynamic_partitions("run_id", ["b1"])
    defs = defs_for(data_root)
    assert run_job(defs, instance, "filter_job", "b1").success
    overlapping(data_root, ["b0"])  # a lower batch arrives after b1 was walked: b1's re-walk does not wait
    assert run_job(defs, instance, "ledger_job", "b1").success


def test_a_ranged_ledger_step_stops_at_a_run_its_checks_left_uncommitted(instance, data_root, monkeypatch):
    from filter_pipeline.rules import checks

    overlapping(data_root, ["b0", "b1", "b2"])
    instance.add_dynamic_partitions("run_id", ["b0", "b1", "b2"])
    defs = defs_for(data_root)
    for run_id in ("b0", "b1", "b2"):
        assert run_job(defs, instance, "judge_job", run_id).success
    holds, calls = checks.caps_respected, []

    def broken_for_b1(kept, prior_counts, caps):  # the second walk (b1's) breaks an invariant
        calls.append(len(kept))
        outcome = holds(kept, prior_counts, caps)
        return checks.CheckOutcome(False, outcome.metadata, "over") if len(calls) == 2 else outcome

    monkeypatch.setattr(checks, "caps_respected", broken_for_b1)
    result = defs.resolve_job_def("ledger_job").execute_in_process(
        instance=instance, tags={RANGE_START_TAG: "b0", RANGE_END_TAG: "b2"}, raise_on_error=False
    )
    assert not result.success and len(calls) == 2
    committed = sorted(p.stem for p in (data_root / "warehouse" / "_commits").glob("*.json"))
    assert committed == ["b0"]  # b1 was not committed, so b2 was not walked before it
    assert not (data_root / "warehouse" / "kept" / "b2.parquet").exists()
    errors = [e.user_message for e in instance.all_logs(result.run_id) if "not committed" in e.user_message]
    assert errors == [
        "b1: not committed (caps_respected failed): nothing of this walk is kept",
        "b1 was not committed; not walked, to keep run_id order: b2; committed, but not recorded as materialized "
        "(materializing again walks them again): b0",
    ]
    # none of the range is materialized: b1's files were never published, b2 was not walked, and a range
    # materialized in part would leave an asset backfill waiting forever on Dagster 1.12
    assert not instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
    status = partition_status(instance, defs, ["b0", "b1", "b2"])
    assert dg.AssetPartitionStatus.MATERIALIZED not in status.values()


def test_a_run_queued_for_several_walks_counts_as_queued_for_each_when_a_step_decides_to_defer():
    from filter_pipeline.shell.jobs import FIRST_WALK_TAG, partitions_of

    # the sensor's ledger run over several batches has no partition tag: its range is in registration order
    assert partitions_of({FIRST_WALK_TAG: "b0 b1", RANGE_START_TAG: "b1", RANGE_END_TAG: "b0"}) == ["b0", "b1"]
    assert partitions_of({PARTITION_TAG: "b2", FIRST_WALK_TAG: "b2"}) == ["b2"]
    assert partitions_of({PARTITION_TAG: "b3"}) == ["b3"] and partitions_of({}) == []
    # an asset backfill's ranged run names no walks: its range, in registration order
    ranged = {RANGE_START_TAG: "b1", RANGE_END_TAG: "b0"}
    assert partitions_of(ranged, ["b2", "b1", "b0"]) == ["b1", "b0"] and partitions_of(ranged) == []


def test_a_sensor_ledger_run_over_several_reports_each_run_another_walk_committed_meanwhile(instance, data_root):
    from filter_pipeline.shell.jobs import FIRST_WALK_TAG

    overlapping(data_root, ["b0", "b1", "b2"])
    instance.add_dynamic_partitions("run_id", ["b0", "b1", "b2"])
    defs = defs_for(data_root)
    for run_id in ("b0", "b1", "b2"):
        assert run_job(defs, instance, "judge_job", run_id).success
    # launched by the sensor for b0..b2 (none committed then); b0 and b1 are walked by others before it starts
    for run_id in ("b0", "b1"):
        assert run_job(defs, instance, "ledger_job", run_id).success
    commits = data_root / "warehouse" / "_commits"
    before = {r: (commits / f"{r}.json").read_bytes() for r in ("b0", "b1")}

    result = defs.resolve_job_def("ledger_job").execute_in_process(
        instance=instance, tags={FIRST_WALK_TAG: "b0 b1 b2", RANGE_START_TAG: "b0", RANGE_END_TAG: "b2"}
    )

    assert result.success
    said = [e.user_message for e in instance.all_logs(result.run_id) if "already filtered" in e.user_message]
    assert [m.split(":")[0] for m in said] == ["b0", "b1"]
    assert {r: (commits / f"{r}.json").read_bytes() for r in ("b0", "b1")} == before  # not walked again
    assert (commits / "b2.json").exists()


def test_a_re_execution_of_a_sensor_ledger_run_that_walked_says_the_run_was_walked_before_it_was_created(
    instance, data_root
):
    overlapping(data_root, ["b0"])
    instance.add_dynamic_partitions("run_id", ["b0"])
    defs = defs_for(data_root)
    assert run_job(defs, instance, "judge_job", "b0").success
    sensor_tags = {FIRST_WALK_TAG: "b0"}
    first = run_job(defs, instance, "ledger_job", "b0", tags=sensor_tags)
    assert first.success
    commit = (data_root / "warehouse" / "_commits" / "b0.json").read_bytes()

    # "Re-execute" copies the run's tags, even one saying which runs that run walked before it waited
    copied = {**sensor_tags, WALKED_BEFORE_WAITING_TAG: f"b0 in run {first.run_id}", PARENT_RUN_TAG: first.run_id}
    again = run_job(defs, instance, "ledger_job", "b0", tags=copied)

    assert again.success
    [said] = [e.user_message for e in instance.all_logs(again.run_id) if e.user_message.startswith("b0: already")]
    assert said.startswith("b0: already filtered by another walk (committed, walked at ")
    assert said.endswith(
        f"before this run was created: not walked again (`{materialize_command('b0')}` walks it again)"
    )
    assert (data_root / "warehouse" / "_commits" / "b0.json").read_bytes() == commit


def test_the_first_walk_tag_is_written_and_read_back_by_one_pair_of_rules():
    from filter_pipeline.shell.jobs import first_walk_tags, first_walks

    assert first_walks(first_walk_tags(["b1", "b2"])) == ["b1", "b2"]
    assert first_walks(first_walk_tags([])) == [] and first_walks({}) is None  # not a first walk / nothing says
