"""The batch sensor: registration, judge runs for new complete batches, one ledger run at a time for the judged
batches waiting in a row, walked in run_id order."""

import json
import logging
import shutil

import dagster as dg
import pandas as pd
import pytest

from filter_pipeline.rules.batch import BatchState
from filter_pipeline.shell.jobs import FIRST_WALK_TAG, RANGE_END_TAG, RANGE_START_TAG, RUN_KEY_TAG
from filter_pipeline.shell.sensors import LEDGER_RANGE_LIMIT, build_batch_sensor, plan_tick, registered_block
from filter_pipeline.shell.waiting import DEFERRED_TAG
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.runs import complete_batches
from filter_pipeline_tests.builders import (
    LogLines,
    Pipeline,
    attempt,
    commit_files,
    sensor_context,
    task,
    write_batch,
    write_kept,
    write_legacy_kept,
)


def tick(instance, data_root) -> dg.SensorResult:
    sensor = build_batch_sensor()
    return sensor(sensor_context(instance, data_root))


def judged(data_root, run_id):
    """Mark a batch as judged the way the judge run does: its judge_verdicts file exists."""
    folder = data_root / "warehouse" / "judge_verdicts"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{run_id}.parquet").write_bytes(b"")


def requests(result) -> list[tuple[str, str, str]]:
    """Judge and ledger run requests (coverage refreshes have their own test): (job, the partition or the
    run_ids a ledger run walks, run key)."""
    return [
        (r.job_name, r.tags.get(FIRST_WALK_TAG, r.partition_key), r.run_key)
        for r in result.run_requests
        if r.job_name != "across_runs_job"
    ]


def coverage_keys(result) -> list[str]:
    return [r.run_key for r in result.run_requests if r.job_name == "across_runs_job"]


@dg.op
def _nothing():
    pass


@dg.job
def some_job():
    _nothing()


def run_in_instance(instance, tags: dict, status: dg.DagsterRunStatus) -> dg.DagsterRun:
    """A run in the instance's run storage with `tags` and `status`, as a launched run leaves it; the sensor
    reads runs only by status and tags."""
    return instance.create_run_for_job(some_job, tags=tags, status=status)


def added(result) -> list[str]:
    return [k for req in result.dynamic_partitions_requests for k in req.partition_keys]


def test_new_complete_batches_are_registered_and_judged_in_one_result(instance, data_root):
    write_batch(data_root, "b2", [task("a")], [attempt("a")])
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    write_batch(data_root, "b3", [task("a")], [attempt("a")], complete=False)
    (data_root / "runs" / "not a run id").mkdir()
    (data_root / "runs" / "not a run id" / "_SUCCESS").write_text("")

    result = tick(instance, data_root)

    assert added(result) == ["b1", "b2"]
    assert requests(result) == [("judge_job", "b1", "b1"), ("judge_job", "b2", "b2")]


def test_a_complete_batch_whose_folder_is_not_a_plain_run_id_is_refused_with_a_reason(data_root, caplog):
    write_batch(data_root, "fine", [task("a")], [attempt("a")])
    write_batch(data_root, "has space", [task("a")], [attempt("a")])
    with caplog.at_level(logging.WARNING):
        data = DataRoot(path=str(data_root))
        batches = complete_batches(data.runs, data.warehouse, logging.getLogger("test"))
    assert [b.run_id for b in batches] == ["fine"]
    assert "runs/has space: refused: run_id 'has space' is not a plain folder name" in caplog.text
    assert caplog.text.count("refused") == 1 and "; rename it" in caplog.text


def test_a_batch_whose_success_marker_appears_later_is_picked_up_on_the_next_tick(instance, data_root):
    run = write_batch(data_root, "b1", [task("a")], [attempt("a")], complete=False)
    first = tick(instance, data_root)
    assert requests(first) == [] and added(first) == []
    (run / "_SUCCESS").write_text("")
    assert requests(tick(instance, data_root)) == [("judge_job", "b1", "b1")]


def test_already_filtered_batches_are_registered_never_rerun(instance, data_root):
    """A fresh instance over an existing warehouse must not re-filter old batches with a bigger history."""
    write_batch(data_root, "old", [task("a")], [attempt("a")])
    write_kept(data_root, "old", ("a", ["k"], "m", "s"))
    write_batch(data_root, "legacy", [task("a")], [attempt("a")])
    write_legacy_kept(data_root, "legacy", ("a", ["k"], "m", "s"))
    result = tick(instance, data_root)
    assert added(result) == ["old"]
    assert set(instance.get_dynamic_partitions("run_id")) == {
        "legacy"
    }  # registered at once, to record it as materialized
    assert requests(result) == []


def test_ledger_is_walked_lowest_run_id_first_with_the_deployments_caps(instance, data_root):
    for run_id in ("b1", "b2"):
        write_batch(data_root, run_id, [task("a")], [attempt("a")])
    judged(data_root, "b1")
    instance.add_dynamic_partitions("run_id", ["b1", "b2"])
    result = tick(instance, data_root)
    assert requests(result) == [("ledger_job", "b1", "b1:ledger")]  # b2 is not judged yet
    assert result.run_requests[0].partition_key == "b1"
    assert result.run_requests[0].run_config == {}  # the caps config's defaults are the deployment's


def judged_batches(data_root, run_ids: list[str]) -> None:
    for run_id in run_ids:
        write_batch(data_root, run_id, [task("a")], [attempt("a")])
        judged(data_root, run_id)


def ledger_requests(result) -> list[dg.RunRequest]:
    return [r for r in result.run_requests if r.job_name == "ledger_job"]


def test_a_backlog_registered_out_of_order_is_walked_by_one_ledger_run_in_run_id_order(instance, data_root):
    judged_batches(data_root, ["b1", "b2", "b3", "b4", "b5"])
    instance.add_dynamic_partitions("run_id", ["b1", "b2", "b4", "b5", "b3"])  # b3 registered late

    [request] = ledger_requests(tick(instance, data_root))

    # named for the first walk of each, in run_id order; the range spans them in registration order
    assert request.tags[FIRST_WALK_TAG] == "b1 b2 b3 b4 b5" and request.run_key == "b1:ledger"
    assert (request.tags[RANGE_START_TAG], request.tags[RANGE_END_TAG]) == ("b1", "b3")
    assert request.partition_key is None
    # evaluated again before the run shows: the same run key (the daemon launches a run key once)
    assert [r.run_key for r in ledger_requests(tick(instance, data_root))] == ["b1:ledger"]
    # once it is in flight, every run_id of its range is busy: no second range
    run_in_instance(instance, tags=dict(request.tags), status=dg.DagsterRunStatus.STARTED)
    assert ledger_requests(tick(instance, data_root)) == []


def test_a_backlog_walk_stops_where_registration_order_would_bring_in_a_batch_not_ready(instance, data_root):
    judged_batches(data_root, ["b1", "b2", "b3", "b4"])
    write_batch(data_root, "b5", [task("a")], [attempt("a")])  # complete, still judging
    instance.add_dynamic_partitions("run_id", ["b1", "b2", "b4", "b5", "b3"])
    run_in_instance(instance, tags={"dagster/partition": "b5"}, status=dg.DagsterRunStatus.STARTED)

    # b3's range would run from b3 to b3 in registration order, through b4 and b5 (not judged): b1 b2 first
    assert requests(tick(instance, data_root)) == [("ledger_job", "b1 b2", "b1:ledger")]


def test_registered_block_is_the_longest_head_that_is_consecutive_in_registration_order():
    order = ["b1", "b2", "b4", "b6", "b3", "b5"]
    assert registered_block(["b1", "b2", "b3", "b4", "b5"], order) == ["b1", "b2"]
    assert registered_block(["b3", "b4", "b5"], ["b1", "b4", "b3", "b5"]) == ["b3", "b4", "b5"]
    assert registered_block(["b4", "b5"], ["b5", "b9", "b4"]) == ["b4"]
    assert registered_block(["b7"], order) == []  # not registered yet


def test_plan_walks_at_most_the_range_limit_at_once():
    batches = [B(f"b{i:03d}", judged=True, filtered=False) for i in range(LEDGER_RANGE_LIMIT + 5)]
    walk = plan_tick(batches, {b.run_id for b in batches}, busy=set(), failed_ledger=set())[2]
    assert walk == [b.run_id for b in batches[:LEDGER_RANGE_LIMIT]]


def test_a_failed_ranged_ledger_run_holds_the_batch_it_stopped_at_not_the_ones_it_did_not_reach(
    instance, data_root, capfd
):
    judged_batches(data_root, ["b1", "b2", "b3", "b4", "b5"])
    instance.add_dynamic_partitions("run_id", ["b1", "b2", "b3", "b4", "b5"])
    [request] = ledger_requests(tick(instance, data_root))
    assert request.tags[FIRST_WALK_TAG] == "b1 b2 b3 b4 b5"
    # the ranged run committed b1 and b2, then failed walking b3
    for run_id in ("b1", "b2"):
        write_kept(data_root, run_id, ("a", [run_id], "m", "s"), commit=False)
        commit_files(data_root, run_id, {"kept": data_root / "warehouse" / "kept" / f"{run_id}.parquet"},
                     walked_at="2001-01-01T00:00:00+00:00")  # fmt: skip
    run_in_instance(
        instance, tags={**request.tags, "dagster/run_key": request.run_key}, status=dg.DagsterRunStatus.FAILURE
    )

    capfd.readouterr()
    for _ in range(2):  # not relaunched, tick after tick
        assert ledger_requests(tick(instance, data_root)) == []
    log = capfd.readouterr().err  # (the sensor's log, as the daemon prints it)
    assert log.count("ledger run for b3 ended without filtering it; materialize it by hand") == 2
    assert "ledger waits for b3, whose ledger run failed" in log
    assert "ledger run for b4" not in log and "ledger run for b5" not in log

    # b3 materialized by hand: the batches the failed run never reached are walked, from b4 on
    write_kept(data_root, "b3", ("a", ["b3"], "m", "s"), commit=False)
    commit_files(data_root, "b3", {"kept": data_root / "warehouse" / "kept" / "b3.parquet"},
                 walked_at="2100-01-01T00:00:00+00:00")  # fmt: skip
    assert requests(tick(instance, data_root)) == [("ledger_job", "b4 b5", "b4:ledger")]


B = BatchState


def test_plan_waits_for_an_earlier_batch_still_judging():
    batches = [B("b1", judged=False, filtered=False), B("b2", judged=True, filtered=False)]
    plan = plan_tick(batches, {"b1", "b2"}, busy={"b1"}, failed_ledger=set())
    assert plan[2] == [] and plan[3] == "ledger waits for b1 to finish judging"


def test_plan_waits_while_an_earlier_ledger_run_is_in_flight():
    batches = [B("b1", judged=True, filtered=False), B("b2", judged=True, filtered=False)]
    plan = plan_tick(batches, {"b1", "b2"}, busy={"b1"}, failed_ledger=set())
    assert plan[2] == [] and plan[3] == "ledger waits for b1, judged, whose run is in flight"


def test_plan_holds_later_batches_behind_a_failed_run_until_it_is_recorded_or_retired():
    batches = [
        B("b0", judged=True, filtered=True),
        B("b1", judged=False, filtered=False),  # its judge run failed: nothing in flight
        B("b2", judged=True, filtered=False),  # its ledger run failed
        B("b3", judged=True, filtered=False),
    ]
    registered = {"b0", "b1", "b2", "b3"}
    _, _, walk, why = plan_tick(batches, registered, busy=set(), failed_ledger={"b2"})
    assert walk == [] and why.startswith("ledger waits for b1, whose judge run failed")
    _, _, walk, why = plan_tick(batches, registered, busy=set(), failed_ledger={"b2"}, failed={"b1"})
    assert walk == [] and why.startswith("ledger waits for b2, whose ledger run failed")
    assert plan_tick(batches, registered, busy=set(), failed_ledger={"b2"}, failed={"b1"}, retired={"b2"})[2] == ["b3"]


def test_plan_waits_for_a_batch_judged_in_this_very_tick():
    batches = [B("b1", judged=False, filtered=False), B("b2", judged=True, filtered=False)]
    register, judge, walk, why = plan_tick(batches, {"b2"}, busy=set(), failed_ledger=set())
    assert (register, judge, walk) == (["b1"], ["b1"], [])
    assert "b1" in why


def test_sensor_sees_runs_in_flight_and_failed_ledger_runs_in_the_instance(instance, data_root):
    for run_id in ("b1", "b2", "b3"):
        write_batch(data_root, run_id, [task("a")], [attempt("a")])
    judged(data_root, "b2")
    judged(data_root, "b3")
    instance.add_dynamic_partitions("run_id", ["b1", "b2", "b3"])

    judging_b1 = run_in_instance(instance, tags={"dagster/partition": "b1"}, status=dg.DagsterRunStatus.STARTED)
    assert requests(tick(instance, data_root)) == []  # b2 must wait for b1

    instance.report_run_failed(judging_b1)
    assert requests(tick(instance, data_root)) == []  # b1's judge run failed: b2 still waits for b1
    (data_root / "retired.json").write_text('[{"run_id": "b1", "reason": "broken build"}]')
    assert requests(tick(instance, data_root)) == [("ledger_job", "b2 b3", "b2:ledger")]

    run_in_instance(
        instance, tags={"dagster/partition": "b2", "dagster/run_key": "b2:ledger"}, status=dg.DagsterRunStatus.FAILURE
    )
    assert requests(tick(instance, data_root)) == []
    (data_root / "retired.json").write_text('[{"run_id": "b1", "reason": "x"}, {"run_id": "b2", "reason": "x"}]')
    assert requests(tick(instance, data_root)) == [("ledger_job", "b3", "b3:ledger")]


def test_a_broken_retired_json_launches_nothing_and_the_tick_says_why(instance, data_root):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    (data_root / "retired.json").write_text('{"run_id": "b1"}')  # not a list of entries
    result = tick(instance, data_root)
    why = result.skip_reason.skip_message
    assert result.run_requests == [] and why.startswith("nothing launched until it is fixed: retired.json"), why
    (data_root / "retired.json").write_text("[]")
    assert requests(tick(instance, data_root)) == [("judge_job", "b1", "b1")]


def test_a_batch_registered_without_a_run_is_left_to_its_launcher_and_named_so(instance, data_root):
    for run_id in ("b1", "b2"):
        write_batch(data_root, run_id, [task("a")], [attempt("a")])
    judged(data_root, "b2")
    # registered by a `materialize` that runs them one by one (judging them here too would pay the judge twice)
    instance.add_dynamic_partitions("run_id", ["b1", "b2"])
    result = tick(instance, data_root)
    assert requests(result) == []
    assert result.skip_reason.skip_message.startswith("ledger waits for b1, registered but never run (by a materialize")
    run_in_instance(instance, tags={"dagster/partition": "b1"}, status=dg.DagsterRunStatus.FAILURE)
    assert tick(instance, data_root).skip_reason.skip_message.startswith("ledger waits for b1, whose judge run failed")


def test_a_sensor_ledger_run_that_deferred_its_walk_is_followed_by_one_of_its_own(instance, data_root):
    for run_id in ("b1", "b2"):
        write_batch(data_root, run_id, [task("a")], [attempt("a")])
        judged(data_root, run_id)
    instance.add_dynamic_partitions("run_id", ["b2", "b1"])
    # b2's ledger run, launched before b1 arrived, let its slot go to b1's queued judge run and deferred
    deferred = {"dagster/partition": "b2", "dagster/run_key": "b2:ledger", DEFERRED_TAG: "waits for b1; deferred"}
    run_in_instance(instance, tags=deferred, status=dg.DagsterRunStatus.SUCCESS)
    write_kept(data_root, "b1", ("a", ["k1"], "m", "s"))  # b1 walked since
    assert requests(tick(instance, data_root)) == [("ledger_job", "b2", "b2:ledger:2")]
    run_in_instance(instance, tags={**deferred, "dagster/run_key": "b2:ledger:2"}, status=dg.DagsterRunStatus.SUCCESS)
    assert requests(tick(instance, data_root)) == [("ledger_job", "b2", "b2:ledger:3")]  # (deferred again)
    failed = {"dagster/partition": "b2", "dagster/run_key": "b2:ledger:3"}
    run_in_instance(instance, tags=failed, status=dg.DagsterRunStatus.FAILURE)
    assert requests(tick(instance, data_root)) == []  # a ledger run that failed holds b2 until it is handled


def test_a_ranged_run_in_flight_makes_every_partition_of_its_range_busy(instance, data_root):
    for run_id in ("b1", "b2", "b3"):
        write_batch(data_root, run_id, [task("a")], [attempt("a")])
        judged(data_root, run_id)
    instance.add_dynamic_partitions("run_id", ["b2", "b1", "b3"])
    run_in_instance(
        instance,
        tags={"dagster/asset_partition_range_start": "b2", "dagster/asset_partition_range_end": "b1"},
        status=dg.DagsterRunStatus.STARTED,
    )
    assert requests(tick(instance, data_root)) == []  # b1 and b2 are being walked by the ranged run


def test_coverage_is_refreshed_when_the_set_of_kept_files_changes_and_nothing_is_in_flight(instance, data_root):
    write_batch(data_root, "old", [task("a")], [attempt("a")])
    assert coverage_keys(tick(instance, data_root)) == []  # no kept file yet; "old" is being judged
    write_kept(data_root, "old", ("a", ["k"], "m", "s"))
    first = coverage_keys(tick(instance, data_root))
    assert len(first) == 1 and first == coverage_keys(tick(instance, data_root))  # same files: same run_key
    write_kept(data_root, "other", ("b", ["k2"], "m", "s"))
    result = tick(instance, data_root)
    [refresh] = [r for r in result.run_requests if r.job_name == "across_runs_job"]
    assert refresh.run_key != first[0]
    assert refresh.run_config == {}


def test_an_idle_tick_whose_coverage_run_exists_requests_nothing_and_says_why(instance, data_root):
    write_batch(data_root, "old", [task("a")], [attempt("a")])
    judged(data_root, "old")
    write_kept(data_root, "old", ("a", ["k"], "m", "s"))
    instance.add_dynamic_partitions("run_id", ["old"])
    [key] = coverage_keys(tick(instance, data_root))
    run_in_instance(instance, {RUN_KEY_TAG: key}, dg.DagsterRunStatus.SUCCESS)  # the refresh it requested, run
    result = tick(instance, data_root)
    assert result.run_requests == [] and result.skip_reason.skip_message == "no batch waiting for the ledger"


def test_coverage_is_refreshed_once_per_walk_even_one_that_brings_kept_back_to_an_earlier_state(instance, data_root):
    def walk(stamp: str, *row) -> list[str]:
        """A walk of r1 committing `row` as its kept file at `stamp`, then the tick: its coverage run keys."""
        write_kept(data_root, "r1", row, commit=False)
        commit_files(data_root, "r1", {"kept": data_root / "warehouse" / "kept" / "r1.parquet"}, walked_at=stamp)
        return coverage_keys(tick(instance, data_root))

    [first] = walk("2026-12-01T00:00:00+00:00", "a", ["k1"], "m", "s1")
    assert coverage_keys(tick(instance, data_root)) == [first]  # nothing walked since: the same key, run once
    [second] = walk("2026-12-02T00:00:00+00:00", "b", ["k2"], "m", "s2")  # another row, the same size
    [third] = walk("2026-12-03T00:00:00+00:00", "a", ["k1"], "m", "s1")  # back to the first kept file
    assert len({first, second, third}) == 3


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_on_s3_a_batch_completed_after_the_first_listing_is_seen_by_the_same_process(s3_bucket):
    # the sensor lives in a long-running code server: a cached listing would hide new batches for good
    data = DataRoot(path=f"s3://{s3_bucket}/data")
    write_batch(data.root, "b1", [task("a")], [attempt("a")])
    write_batch(data.root, "b2", [task("a")], [attempt("a")], complete=False)
    assert [b.run_id for b in complete_batches(data.runs, data.warehouse)] == ["b1"]

    (data.run_dir("b2") / "_SUCCESS").write_text("")
    write_batch(data.root, "b3", [task("a")], [attempt("a")])

    assert [b.run_id for b in complete_batches(data.runs, data.warehouse)] == ["b1", "b2", "b3"]


def filtered_with_unjudged_tasks(instance, data_root, unjudged: int, **record) -> None:
    """b1, registered and filtered long ago with `unjudged` tasks left unjudged (`record`: other fields of its
    commit record)."""
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    judged(data_root, "b1")
    write_kept(data_root, "b1", ("a", ["k"], "m", "s"))
    instance.add_dynamic_partitions("run_id", ["b1"])
    kept_file = data_root / "warehouse" / "kept" / "b1.parquet"
    commit_files(data_root, "b1", {"kept": kept_file}, unjudged=unjudged, walked_at="2001-01-01T00:00:00+00:00",
                 **record)  # fmt: skip


def test_a_filtered_run_with_unjudged_tasks_is_judged_again_after_a_backoff_under_a_cap(
    instance, data_root, monkeypatch
):
    monkeypatch.setenv("FILTER_PIPELINE_REJUDGE_BACKOFF_SECONDS", "1000")
    monkeypatch.setenv("FILTER_PIPELINE_REJUDGE_MAX_TRIES", "2")
    filtered_with_unjudged_tasks(instance, data_root, 2)

    def rejudge(result):
        return [(r.job_name, r.run_key, r.tags) for r in result.run_requests if r.job_name == "rejudge_job"]

    [(job, key, tags)] = rejudge(tick(instance, data_root))
    assert key == "b1:rejudge:1" and tags == {"filter_pipeline/rejudge_of": "b1", "filter_pipeline/rejudge_try": "1"}

    run_in_instance(instance, tags=tags, status=dg.DagsterRunStatus.SUCCESS)  # that try just ended
    assert rejudge(tick(instance, data_root)) == []  # the backoff: 2000 s after the first try
    monkeypatch.setenv("FILTER_PIPELINE_REJUDGE_BACKOFF_SECONDS", "0")
    [(_, key, _)] = rejudge(tick(instance, data_root))
    assert key == "b1:rejudge:2"
    run_in_instance(instance, tags={"filter_pipeline/rejudge_of": "b1", "filter_pipeline/rejudge_try": "2"},
                    status=dg.DagsterRunStatus.SUCCESS)  # fmt: skip
    assert rejudge(tick(instance, data_root)) == []  # the cap: 2 tries


def test_a_run_with_unjudged_tasks_whose_batch_is_being_written_again_or_gone_is_left_as_it_is(
    instance, data_root, monkeypatch
):
    monkeypatch.setenv("FILTER_PIPELINE_REJUDGE_BACKOFF_SECONDS", "0")
    filtered_with_unjudged_tasks(instance, data_root, 1)
    rejudged = lambda: [r.run_key for r in tick(instance, data_root).run_requests if r.job_name == "rejudge_job"]  # noqa: E731
    (data_root / "runs" / "b1" / "_SUCCESS").unlink()  # (its producer writes it again: nothing reads it meanwhile)
    assert rejudged() == []  # (a try would fail on it, and count against the cap)
    shutil.rmtree(data_root / "runs" / "b1")
    assert rejudged() == []
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    assert rejudged() == ["b1:rejudge:1"]


def test_unjudged_tasks_are_judged_again_only_by_the_judge_that_judged_the_rest(instance, data_root, monkeypatch):
    from filter_pipeline.judge.resource import JudgeResource, LLMJudgeConfig

    monkeypatch.setenv("FILTER_PIPELINE_REJUDGE_BACKOFF_SECONDS", "0")
    filtered_with_unjudged_tasks(instance, data_root, 1, judge={"kind": "llm", "model": "judge-a",
                                                                "prompt_version": "v3", "votes": "1"})  # fmt: skip
    sensor = build_batch_sensor()

    cursor = {"last": None}

    def rejudged(judge) -> tuple[list[str], list[str]]:
        context = sensor_context(instance, data_root, judge, cursor["last"])
        said = LogLines()
        context.log.addHandler(said)
        result = sensor(context)
        cursor["last"] = result.cursor
        left = [line for line in said.lines if "left as they are" in line]
        return [r.partition_key for r in result.run_requests if r.job_name == "rejudge_job"], left

    asked, said = rejudged(JudgeResource(kind="gate"))
    assert (
        asked == []
        and (
            "b1: 1 unjudged tasks left as they are: the run was judged by llm judge-a v3 (votes 1), not by gate (judge them "
            "again with that judge: --judge, FILTER_JUDGE_KIND, FILTER_JUDGE_MODEL, FILTER_JUDGE_PROMPT_VERSION)"
        )
        in said
    )
    assert rejudged(JudgeResource(kind="gate")) == ([], [])  # said once: the sensor's cursor remembers it
    another_model = JudgeResource(kind="llm", llm=LLMJudgeConfig(base_url="http://127.0.0.1:9/v1", model="judge-b"))
    assert rejudged(another_model)[0] == []
    same = JudgeResource(kind="llm", llm=LLMJudgeConfig(base_url="http://127.0.0.1:9/v1", model="judge-a"))
    assert rejudged(same)[0] == ["b1"]
    (data_root / "retired.json").write_text('[{"run_id": "b1", "reason": "never judged"}]')
    assert rejudged(same) == ([], [])  # retired: left alone


def test_a_run_with_unjudged_tasks_whose_batch_changed_is_not_judged_again_unless_named(
    instance, data_root, monkeypatch
):
    from filter_pipeline.storage.files import input_fingerprints

    monkeypatch.setenv("FILTER_PIPELINE_REJUDGE_BACKOFF_SECONDS", "0")
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    judged(data_root, "b1")
    write_kept(data_root, "b1", ("a", ["k"], "m", "s"))
    instance.add_dynamic_partitions("run_id", ["b1"])
    inputs = input_fingerprints(DataRoot(path=str(data_root)).run_dir("b1"))
    commit_files(data_root, "b1", {"kept": data_root / "warehouse" / "kept" / "b1.parquet"}, unjudged=1, inputs=inputs)
    rejudged = lambda: [r.run_key for r in tick(instance, data_root).run_requests if r.job_name == "rejudge_job"]  # noqa: E731
    assert rejudged() == ["b1:rejudge:1"]
    with open(data_root / "runs" / "b1" / "tasks.jsonl", "a") as f:  # the batch ran again meanwhile
        f.write(json.dumps(task("late")) + "\n")
    assert rejudged() == []


def refused_by_its_judge_run(instance, data_root, run_id: str) -> dg.ExecuteInProcessResult:
    """`run_id`'s judge run, as the sensor launches it, refusing its batch (its failure then on record)."""
    from filter_pipeline.definitions import build_defs
    from filter_pipeline.judge.resource import JudgeResource

    instance.add_dynamic_partitions("run_id", [run_id])
    job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("judge_job")
    result = job.execute_in_process(instance=instance, partition_key=run_id, tags={"dagster/run_key": run_id},
                                    raise_on_error=False)  # fmt: skip
    assert not result.success and (data_root / "warehouse" / "_failed" / f"{run_id}.json").exists()
    return result


def test_a_refused_batch_corrected_since_is_judged_and_walked_once_per_refusal_as_a_late_batch(instance, data_root):
    from filter_pipeline.definitions import build_defs
    from filter_pipeline.judge.resource import JudgeResource

    write_batch(data_root, "b1", [task("a", key=["k"])], [attempt("a")])
    good_b1 = (data_root / "runs" / "b1" / "tasks.jsonl").read_bytes()
    (data_root / "runs" / "b1" / "tasks.jsonl").write_text("not json\n")  # no valid task: refused
    refused_by_its_judge_run(instance, data_root, "b1")
    assert requests(tick(instance, data_root)) == []  # refused as it is: nothing to try
    write_batch(data_root, "b2", [task("b", key=["k"])], [attempt("b")])
    Pipeline(data_root, instance).run(JudgeResource(), "b2")  # b2 goes ahead of it: b1 is skipped in the order

    (data_root / "runs" / "b1" / "tasks.jsonl").write_bytes(good_b1)  # corrected by its producer
    [(job, partition, key)] = requests(result := tick(instance, data_root))
    assert (job, partition) == ("rejudge_job", "b1") and key.startswith("b1:corrected:")
    assert requests(tick(instance, data_root)) == [(job, partition, key)]  # (the same key: Dagster launches it once)
    [request] = [r for r in result.run_requests if r.job_name == "rejudge_job"]
    run = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("rejudge_job")
    assert run.execute_in_process(instance=instance, partition_key="b1", tags=request.tags).success
    # walked as a late batch, b2 its history: its task shares b2's key
    assert pd.read_parquet(data_root / "warehouse" / "surplus" / "b1.parquet")["dropped"].tolist() == ["duplicate"]
    assert not (data_root / "warehouse" / "_failed" / "b1.json").exists()
    assert requests(tick(instance, data_root)) == []


def test_a_corrected_batch_is_left_alone_when_retired_or_when_its_run_ended_without_walking_it(instance, data_root):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    good_b1 = (data_root / "runs" / "b1" / "tasks.jsonl").read_bytes()
    (data_root / "runs" / "b1" / "tasks.jsonl").write_text("not json\n")
    refused_by_its_judge_run(instance, data_root, "b1")
    (data_root / "runs" / "b1" / "tasks.jsonl").write_bytes(good_b1)
    (data_root / "retired.json").write_text('[{"run_id": "b1", "reason": "bad build"}]')
    assert requests(tick(instance, data_root)) == []  # retired: left alone, as asked
    (data_root / "retired.json").unlink()
    [(_, _, key)] = requests(tick(instance, data_root))
    run_in_instance(instance, {"dagster/partition": "b1", "dagster/run_key": key}, dg.DagsterRunStatus.FAILURE)
    context, said = sensor_context(instance, data_root), LogLines(logging.WARNING)
    context.log.addHandler(said)
    assert requests(build_batch_sensor()(context)) == []
    why = (
        "ledger waits for b1, corrected since it was refused, whose run ended without walking it: materialize it "
        "again or retire it in retired.json"
    )
    assert said.lines == [why] and build_batch_sensor()(context).skip_reason.skip_message == why


def test_a_refusal_recorded_without_what_the_batch_held_is_never_taken_as_corrected(instance, data_root):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    instance.add_dynamic_partitions("run_id", ["b1"])
    run_in_instance(instance, {"dagster/partition": "b1", "dagster/run_key": "b1"}, dg.DagsterRunStatus.FAILURE)
    failed = data_root / "warehouse" / "_failed"
    failed.mkdir(parents=True)
    (failed / "b1.json").write_text('{"run_id": "b1", "reason": "an earlier version", "recorded_at": 1.0}')
    assert requests(tick(instance, data_root)) == []  # (unknown whether it changed: skipped in the order, as before)


def test_a_corrected_batch_waits_for_a_lower_batch_its_walk_would_wait_for_and_a_deferred_run_is_followed(
    instance, data_root
):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    good_b1 = (data_root / "runs" / "b1" / "tasks.jsonl").read_bytes()
    (data_root / "runs" / "b1" / "tasks.jsonl").write_text("not json\n")
    refused_by_its_judge_run(instance, data_root, "b1")
    write_batch(data_root, "b0", [task("z")], [attempt("z")])  # a lower batch, arrived late, not judged yet
    (data_root / "runs" / "b1" / "tasks.jsonl").write_bytes(good_b1)
    context, said = sensor_context(instance, data_root), LogLines()
    context.log.addHandler(said)
    assert [job for job, _, _ in requests(build_batch_sensor()(context))] == ["judge_job"]  # b0's alone
    assert "b1: corrected since it was refused; its walk waits for b0" in said.lines
    (data_root / "retired.json").write_text('[{"run_id": "b0", "reason": "bad build"}]')
    corrected = lambda: [r for r in requests(tick(instance, data_root)) if r[0] == "rejudge_job"]  # noqa: E731
    [(_, _, key)] = corrected()
    deferred = {"dagster/partition": "b1", "dagster/run_key": key, DEFERRED_TAG: "a lower run sat in the queue"}
    run_in_instance(instance, deferred, dg.DagsterRunStatus.SUCCESS)  # (its walk deferred: a run of its own next)
    assert corrected() == [("rejudge_job", "b1", f"{key}:2")]


def test_plan_never_walks_a_corrected_batch_on_its_old_verdicts_and_holds_later_ones_behind_it():
    batches = [B("b1", judged=True, filtered=False), B("b2", judged=True, filtered=False)]  # b1: an old version's
    _, _, walk, why = plan_tick(batches, {"b1", "b2"}, busy=set(), failed_ledger=set(), failed={"b1"})
    assert walk == ["b2"]  # refused as it is: skipped in the order
    _, _, walk, why = plan_tick(batches, {"b1", "b2"}, set(), set(), failed={"b1"}, corrected={"b1"})
    assert walk == [] and why == "ledger waits for b1, corrected since it was refused"


def test_plan_leaves_a_batch_retired_before_it_was_filtered_alone_until_it_is_retired_no_longer():
    batches = [B("b1", judged=False, filtered=False), B("b2", judged=False, filtered=False)]
    register, judge, walk, _ = plan_tick(batches, set(), busy=set(), failed_ledger=set(), retired={"b1"})
    assert (register, judge, walk) == (["b2"], ["b2"], [])  # neither registered, judged nor walked
    register, judge, _, _ = plan_tick(batches, {"b2"}, busy=set(), failed_ledger=set())
    assert (register, judge) == (["b1"], ["b1"])  # retired no longer: a new batch


def test_a_refused_batch_corrected_before_this_instance_registered_it_gets_one_run_not_two(instance, data_root):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    good = (data_root / "runs" / "b1" / "tasks.jsonl").read_bytes()
    (data_root / "runs" / "b1" / "tasks.jsonl").write_text("not json\n")
    with dg.DagsterInstance.ephemeral() as elsewhere:  # (another deployment, or a laptop's CLI, refused it)
        refused_by_its_judge_run(elsewhere, data_root, "b1")
    (data_root / "runs" / "b1" / "tasks.jsonl").write_bytes(good)
    result = tick(instance, data_root)
    assert added(result) == ["b1"] and [job for job, _, _ in requests(result)] == ["rejudge_job"]


def test_of_two_corrected_batches_the_lower_is_run_first_and_nothing_else_meanwhile(instance, data_root):
    for run_id in ("b1", "b2"):
        write_batch(data_root, run_id, [task("a")], [attempt("a")])
        good = (data_root / "runs" / run_id / "tasks.jsonl").read_bytes()
        (data_root / "runs" / run_id / "tasks.jsonl").write_text("not json\n")
        refused_by_its_judge_run(instance, data_root, run_id)
        (data_root / "runs" / run_id / "tasks.jsonl").write_bytes(good)
    write_batch(data_root, "b3", [task("c")], [attempt("c")])
    judged(data_root, "b3")
    instance.add_dynamic_partitions("run_id", ["b3"])
    result = tick(instance, data_root)
    [(job, partition, key)] = requests(result)  # not b2's, not b3's walk
    assert (job, partition) == ("rejudge_job", "b1") and coverage_keys(result) == []
    run_in_instance(instance, {"dagster/partition": "b1", "dagster/run_key": key}, dg.DagsterRunStatus.STARTED)
    assert requests(tick(instance, data_root)) == []  # b1's run in flight: b2 waits for it
