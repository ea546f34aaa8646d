"""The batch sensor: picks up each complete new batch and keeps the ledger walks in run_id order.

Judging (slow, costly) starts as soon as a batch is complete, for many batches at once. The ledger step,
whose result depends on which runs were walked before, is requested for one run at a time, lowest
run_id first, so the outcome does not depend on which judge run happened to finish first.
"""

import hashlib

import dagster as dg

from filter_pipeline.shell.assets import run_id_partitions
from filter_pipeline.rules.batch import BatchState, complete_batches
from filter_pipeline.shell.jobs import PARTITION_TAG, RUN_KEY_TAG, across_runs_job, judge_job, ledger_job
from filter_pipeline.shell.warehouse import DataRoot

JUDGE_JOB = judge_job.name
LEDGER_JOB = ledger_job.name
NOT_FINISHED_STATUSES = [
    dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING,
]  # fmt: skip
SENSOR_INTERVAL_SECONDS = 10


def caps_run_config(op: str, caps: dict) -> dict:
    return {"ops": {op: {"config": caps}}} if caps else {}


def kept_fingerprint(data: DataRoot) -> str | None:
    """A short hash of which kept files exist and their sizes (None: no kept file yet): coverage is stale
    exactly when this changes."""
    folder = data.warehouse / "kept"
    if not folder.exists():
        return None
    files = sorted((p.name, p.stat().st_size) for p in folder.iterdir() if p.name.endswith(".parquet") and not p.name.startswith("."))
    return hashlib.sha1(repr(files).encode()).hexdigest()[:16] if files else None


def changed_warning(run_id: str) -> str:
    return (
        f"runs/{run_id} changed since it was filtered (tasks.jsonl or executions.jsonl differ from its commit "
        f"record): re-filter it with `filter-pipeline materialize {run_id}`; it is not re-filtered unless named"
    )


def plan_tick(
    batches: list[BatchState],
    registered: set[str],
    busy: set[str],
    failed_ledger: set[str],
) -> tuple[list[str], list[str], str | None, str]:
    """Decide one tick: (run_ids to register, run_ids to judge, run_id whose ledger to walk or None, why).

    `busy`: run_ids with a queued or running run; `failed_ledger`: run_ids whose ledger run ended without
    writing `kept`. A batch already filtered (warehouse or legacy kept) is registered but never re-run.
    """
    to_register = [b.run_id for b in batches if b.run_id not in registered]
    to_judge = [b.run_id for b in batches if b.run_id not in registered and not b.filtered and not b.judged]
    for b in batches:
        if b.filtered:
            continue
        if b.run_id in busy or b.run_id in to_judge:
            return to_register, to_judge, None, f"ledger waits for {b.run_id} to finish judging"
        if b.judged and b.run_id not in failed_ledger:
            return to_register, to_judge, b.run_id, f"ledger walks {b.run_id}"
    return to_register, to_judge, None, "no batch waiting for the ledger"


def _has_run(instance: dg.DagsterInstance, tags: dict, statuses=None) -> bool:
    return bool(instance.get_run_records(dg.RunsFilter(tags=tags, statuses=statuses), limit=1))


def ledger_run_key(run_id: str) -> str:
    return f"{run_id}:ledger"


def build_batch_sensor(caps: dict) -> dg.SensorDefinition:
    """The batch sensor; its ledger runs use `caps` (validated CapsConfig run config, possibly empty)."""

    @dg.sensor(
        name="batch_sensor",
        jobs=[judge_job, ledger_job, across_runs_job],
        minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Registers each complete batch (runs/<run_id>/_SUCCESS) as a run_id partition and launches "
        "its judge run (run_key = run_id); then launches ledger runs one at a time in run_id order. Batches "
        "already filtered (a warehouse or legacy kept file) are registered, never re-run. When the set of kept "
        "files changes and nothing is in flight, it refreshes coverage and judge calibration.",
    )
    def batch_sensor(context: dg.SensorEvaluationContext, data: DataRoot) -> dg.SensorResult:
        instance = context.instance
        batches = complete_batches(data.runs, data.warehouse, context.log)
        for b in batches:
            if b.changed:
                context.log.warning(changed_warning(b.run_id))
        registered = set(instance.get_dynamic_partitions(run_id_partitions.name))
        waiting = [b.run_id for b in batches if not b.filtered]
        busy = {r for r in waiting if _has_run(instance, {PARTITION_TAG: r}, NOT_FINISHED_STATUSES)}
        failed_ledger = {
            r for r in waiting if r not in busy and _has_run(instance, {RUN_KEY_TAG: ledger_run_key(r)})
        }
        to_register, to_judge, to_walk, why = plan_tick(batches, registered, busy, failed_ledger)
        requests = [dg.RunRequest(job_name=JUDGE_JOB, partition_key=r, run_key=r) for r in to_judge]
        if to_walk is not None:
            requests.append(
                dg.RunRequest(
                    job_name=LEDGER_JOB,
                    partition_key=to_walk,
                    run_key=ledger_run_key(to_walk),
                    run_config=caps_run_config("ledger", caps),
                )
            )
        fingerprint = kept_fingerprint(data)
        if fingerprint is not None and to_walk is None and not busy:
            requests.append(
                dg.RunRequest(
                    job_name=across_runs_job.name, run_key=f"across-runs:{fingerprint}", run_config=caps_run_config("coverage", caps)
                )
            )
        for r in sorted(failed_ledger):
            context.log.warning(f"ledger run for {r} ended without writing kept; materialize it by hand")
        context.log.info(f"registered {len(to_register)}, judging {len(to_judge)}; {why}")
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[run_id_partitions.build_add_request(to_register)] if to_register else [],
            skip_reason=None if requests or to_register else why,
        )

    return batch_sensor
