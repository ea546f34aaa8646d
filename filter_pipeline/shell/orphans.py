"""Runs a `filter-pipeline materialize` process started and did not live to end.

The CLI executes its runs in its own process. Killed outright (`kill -9`, the kernel's OOM killer), it cannot
record how its run ended, and Dagster shows the run as started for ever; the batch sensor, which leaves alone
a batch with a run in flight, would never pick that batch up again. Every run the CLI executes with all its
steps in its own process (the in-process executor, the default) is tagged with that process
(`cli_process_tag`); a run not finished whose process, of this machine, no longer runs is marked failed
(`fail_orphaned_runs`) by the next `materialize` and by the sensor's next tick. A process of another machine,
container or boot is never judged, nor one where the system does not say which machine it is (off Linux).
"""

import dagster as dg

from filter_pipeline.settings import executor_name, materialize_command
from filter_pipeline.shell.jobs import PARTITION_TAG
from filter_pipeline.storage.files import MACHINE, writer_gone, writer_named, writer_pid

# run tag: the `filter-pipeline materialize` process executing the run (`storage.files.writer_named`: this
# machine, its PID namespace and the pid)
CLI_PROCESS_TAG = "filter_pipeline/cli_process"
NOT_FINISHED_STATUSES = [
    dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING,
]  # fmt: skip
# the most runs one query of runs in flight reads
IN_FLIGHT_RUNS_LIMIT = 10_000


def cli_process_tag() -> dict[str, str]:
    """The tag naming this process, for a run it executes itself; none where a step may outlive it (the
    multiprocess executor's steps run in processes of their own) or where the system does not say which
    machine and PID namespace this is (a pid alone could be another machine's)."""
    in_process = executor_name() == dg.in_process_executor.name
    return {CLI_PROCESS_TAG: writer_named("materialize")} if in_process and MACHINE else {}


def fail_orphaned_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark failed every run not finished that a `filter-pipeline materialize` process of this machine
    executed and that process no longer runs; one line per run marked, saying what happened and which command
    resumes its batch. A run whose process runs, or ran elsewhere, is left as it is."""
    records = instance.get_run_records(dg.RunsFilter(statuses=NOT_FINISHED_STATUSES), limit=IN_FLIGHT_RUNS_LIMIT)
    lines = []
    for record in records:
        run = record.dagster_run
        process = run.tags.get(CLI_PROCESS_TAG)
        if process is None or not writer_gone(process):
            continue
        pid, batch = writer_pid(process), run.tags.get(PARTITION_TAG)
        message = (
            f"the {materialize_command()} process running it (pid {pid}) ended before the run did (killed): "
            "marked failed, no longer in flight; what it saved stays"
            + (f", and `{materialize_command(batch)}` resumes it" if batch else "")
        )
        instance.report_run_failed(run, message)
        lines.append(f"run {run.run_id} ({batch or run.job_name}): {message}")
    return lines
