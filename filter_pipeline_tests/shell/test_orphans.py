"""Runs a killed `filter-pipeline materialize` left started: marked failed by the sensor's next tick and by the
next `materialize`, so their batches are picked up again; a run whose process still runs, or ran on another
machine, is left alone."""

import os
import subprocess
import sys

import dagster as dg
import pytest

from filter_pipeline.shell.orphans import CLI_PROCESS_TAG
from filter_pipeline.storage.files import writer_named, writer_pid
from filter_pipeline_tests.builders import LogLines, attempt, sensor_context, task, write_batch
from filter_pipeline_tests.shell.test_sensors import judged, requests, run_in_instance


def ended_pid() -> int:
    """The pid of a process of this machine that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def cli_run(instance, run_id: str, process: str) -> dg.DagsterRun:
    """A started run of `run_id`'s batch, as a `filter-pipeline materialize` process named `process` left it."""
    tags = {"dagster/partition": run_id, CLI_PROCESS_TAG: process}
    return run_in_instance(instance, tags=tags, status=dg.DagsterRunStatus.STARTED)


def status(instance, run: dg.DagsterRun) -> dg.DagsterRunStatus:
    return instance.get_run_by_id(run.run_id).status


def test_the_sensor_marks_a_killed_cli_run_failed_and_walks_its_batch(instance, data_root):
    from filter_pipeline.shell.sensors import build_batch_sensor

    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    judged(data_root, "b1")  # (the CLI was killed after judging b1, in its walk)
    instance.add_dynamic_partitions("run_id", ["b1"])
    killed = cli_run(instance, "b1", writer_named("materialize", ended_pid()))
    context = sensor_context(instance, data_root)
    said = LogLines()
    context.log.addHandler(said)
    result = build_batch_sensor()(context)
    assert requests(result) == [("ledger_job", "b1", "b1:ledger")]
    assert status(instance, killed) == dg.DagsterRunStatus.FAILURE
    [line] = [line for line in said.lines if killed.run_id in line]
    assert "(b1)" in line and "ended before the run did (killed)" in line


@pytest.mark.parametrize(
    "process",
    [
        pytest.param(lambda: writer_named("materialize"), id="its process still runs"),
        pytest.param(lambda: f"materialize.otherhost-0a1b2c3d.{ended_pid()}.0123abcd", id="another machine's"),
        pytest.param(lambda: "not a process name", id="a tag of another form"),
    ],
)
def test_a_run_whose_process_may_still_run_stays_in_flight(instance, data_root, process):
    from filter_pipeline.shell.sensors import build_batch_sensor

    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    judged(data_root, "b1")
    instance.add_dynamic_partitions("run_id", ["b1"])
    running = cli_run(instance, "b1", process())
    assert requests(build_batch_sensor()(sensor_context(instance, data_root))) == []
    assert status(instance, running) == dg.DagsterRunStatus.STARTED


def test_no_run_is_tagged_where_a_step_may_outlive_the_cli_or_the_machine_is_unknown(monkeypatch):
    from filter_pipeline.shell import orphans

    assert set(orphans.cli_process_tag()) == {CLI_PROCESS_TAG}
    monkeypatch.setenv("FILTER_PIPELINE_EXECUTOR", "multiprocess")  # (each step a process of its own)
    assert orphans.cli_process_tag() == {}
    monkeypatch.setenv("FILTER_PIPELINE_EXECUTOR", "in_process")
    monkeypatch.setattr(orphans, "MACHINE", None)  # (off Linux: a pid alone could be another machine's)
    assert orphans.cli_process_tag() == {}


@pytest.mark.slow
def test_materialize_marks_a_killed_runs_failed_and_tags_its_own_runs(cli, dagster_home, data_root, monkeypatch):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    with dg.DagsterInstance.get() as instance:
        killed = cli_run(instance, "r1", writer_named("materialize", ended_pid()))
    done = cli()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run {killed.run_id} (r1): the filter-pipeline materialize process running it" in done.stderr
    assert "r1: judged 2" in done.stdout
    with dg.DagsterInstance.get() as instance:
        assert status(instance, killed) == dg.DagsterRunStatus.FAILURE
        own = [r for r in instance.get_runs() if r.run_id != killed.run_id]
        processes = {writer_pid(r.tags.get(CLI_PROCESS_TAG, "")) for r in own}
    assert own and processes.isdisjoint({None, str(os.getpid())})  # each named the CLI's process
