"""The batch sensor: picks up each complete new batch, launches its judge run at once and its ledger run in
run_id order, re-judges filtered runs that left tasks unjudged, and records legacy runs as materialized.

Judging (slow, costly) starts as soon as a batch is complete, for many batches at once. The ledger step,
whose result depends on which runs were walked before, is requested for one run at a time, lowest run_id
first. That is an optimisation: the ledger step itself waits for lower runs (CONTRACT §4), whoever
launched it, so a UI backfill or another instance cannot walk out of order either.
"""

import hashlib
import time
from collections.abc import Iterable
from datetime import datetime

import dagster as dg

from filter_pipeline import settings
from filter_pipeline.rules import order
from filter_pipeline.rules.batch import LEGACY_KEPT_FILE, BatchState
from filter_pipeline.rules.calibration import labels_fingerprint
from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.shell.assets import LABELS_FINGERPRINT, labels_bytes, run_id_partitions
from filter_pipeline.shell.jobs import (
    FIRST_WALK_TAG,
    PARTITION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REJUDGE_OF_TAG,
    REJUDGE_TRY_TAG,
    RUN_KEY_TAG,
    across_runs_job,
    judge_job,
    ledger_job,
    rejudge_job,
)
from filter_pipeline.shell.runs import complete_batches
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage import failures
from filter_pipeline.storage.history import load_retired, read_commits

JUDGE_JOB = judge_job.name
LEDGER_JOB = ledger_job.name
NOT_FINISHED_STATUSES = [
    dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING,
]  # fmt: skip
SENSOR_INTERVAL_SECONDS = 10
LABELS_SENSOR_INTERVAL_SECONDS = 30
IN_FLIGHT_RUNS_LIMIT = 10_000

# every run_id-partitioned asset: what a legacy run (runs/<run>/kept.jsonl, filtered by the earlier script)
# is recorded as having materialized, so that it shows as filled and "Materialize missing" leaves it alone
PARTITIONED_ASSETS = (
    "batch_tasks", "batch_attempts", "batch_rejects", "judge_verdicts", "failure_pool",
    "prior_dedup_index", "prior_kept_counts", "kept", "surplus", "dpo_pairs", "filter_report",
)  # fmt: skip
LEGACY_SOURCE = "legacy kept.jsonl"


def kept_fingerprint(data: DataRoot) -> str | None:
    """A short hash of which kept files exist and their sizes (None: no kept file yet): coverage is stale
    exactly when this changes."""
    folder = data.warehouse / "kept"
    if not folder.exists():
        return None
    files = sorted(
        (p.name, p.stat().st_size)
        for p in folder.iterdir()
        if p.name.endswith(".parquet") and not p.name.startswith(".")
    )
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
    failed: Iterable[str] = (),
    retired: Iterable[str] = (),
) -> tuple[list[str], list[str], str | None, str]:
    """Decide one tick: (run_ids to register, run_ids to judge, run_id whose ledger to walk or None, why).

    `busy`: run_ids with a queued or running run; `failed_ledger`: run_ids whose ledger run ended without
    filtering them; `failed`: runs with a recorded validation failure; `retired`: runs retired as a whole. A
    batch already filtered is registered but never re-run. The ledger walks the lowest pending run_id, and
    only when nothing lower is pending (the order rule); a lower batch whose run failed holds the rest back
    until it is materialized again, retired, or its validation failure is recorded.
    """
    skipped = set(failed) | set(retired)
    to_register = [b.run_id for b in batches if b.run_id not in registered]
    to_judge = [b.run_id for b in batches if b.run_id not in registered and not b.filtered and not b.judged]
    for b in batches:
        if b.filtered or b.run_id in skipped:
            continue
        if b.run_id in busy or b.run_id in to_judge:
            return to_register, to_judge, None, f"ledger waits for {b.run_id} to finish judging"
        if b.judged and b.run_id not in failed_ledger:
            return to_register, to_judge, b.run_id, f"ledger walks {b.run_id}"
        which = "ledger" if b.run_id in failed_ledger else "judge"
        return (
            to_register,
            to_judge,
            None,
            (
                f"ledger waits for {b.run_id}, whose {which} run failed: materialize it again or retire it in retired.json"
            ),
        )
    return to_register, to_judge, None, "no batch waiting for the ledger"


def in_flight_partitions(instance: dg.DagsterInstance, registered: list[str]) -> set[str]:
    """run_ids with a queued or running run: its partition, or every partition of its range (a single-run
    backfill's ledger run), in the order the partitions were registered."""
    position = {r: i for i, r in enumerate(registered)}
    found: set[str] = set()
    records = instance.get_run_records(dg.RunsFilter(statuses=NOT_FINISHED_STATUSES), limit=IN_FLIGHT_RUNS_LIMIT)
    for record in records:
        tags = record.dagster_run.tags
        if PARTITION_TAG in tags:
            found.add(tags[PARTITION_TAG])
        elif tags.get(RANGE_START_TAG) in position and tags.get(RANGE_END_TAG) in position:
            start, end = position[tags[RANGE_START_TAG]], position[tags[RANGE_END_TAG]]
            found.update(registered[start : end + 1])
    return found


def ledger_run_key(run_id: str) -> str:
    return f"{run_id}:ledger"


def rejudge_run_key(run_id: str, try_number: int) -> str:
    return f"{run_id}:rejudge:{try_number}"


def rejudge_tries(instance: dg.DagsterInstance, run_id: str) -> tuple[int, float]:
    """(re-judging runs launched so far for `run_id`, when the last one ended or started; 0.0 if none)."""
    records = instance.get_run_records(dg.RunsFilter(tags={REJUDGE_OF_TAG: run_id}))
    last = max((r.end_time or r.create_timestamp.timestamp() for r in records), default=0.0)
    return len(records), last


def rejudging_due(
    instance: dg.DagsterInstance, commits: dict[str, CommitRecord], busy: set[str], wait: bool = True
) -> list[order.Rejudge]:
    """Committed runs with unjudged tasks to judge again now (`wait`: respect the backoff; the sensor does,
    a user's `materialize` does not), under the cap on tries."""
    backoff = settings.int_setting(settings.REJUDGE_BACKOFF_SECONDS_ENV, settings.DEFAULT_REJUDGE_BACKOFF_SECONDS)
    max_tries = settings.int_setting(settings.REJUDGE_MAX_TRIES_ENV, settings.DEFAULT_REJUDGE_MAX_TRIES)
    due = []
    for run_id, record in sorted(commits.items()):
        if record.unjudged <= 0 or run_id in busy:
            continue
        tries, last = rejudge_tries(instance, run_id)
        found = order.rejudge_due(
            run_id, record.unjudged, tries, max(last, walked_at(record)), time.time(), backoff, max_tries, wait
        )
        if found is not None:
            due.append(found)
    return due


def walked_at(record: CommitRecord) -> float:
    """When the commit's walk happened, in seconds since the epoch (0.0 when the record does not say)."""
    try:
        return datetime.fromisoformat(record.walked_at).timestamp()
    except (TypeError, ValueError):
        return 0.0


def rejudge_tags(item: order.Rejudge) -> dict[str, str]:
    return {REJUDGE_OF_TAG: item.run_id, REJUDGE_TRY_TAG: str(item.try_number)}


def legacy_rows(data: DataRoot, run_id: str) -> int:
    """Kept rows of a legacy run: the non-blank lines of its kept.jsonl."""
    with (data.run_dir(run_id) / LEGACY_KEPT_FILE).open("rb") as f:
        return sum(1 for line in f if line.strip())


def record_legacy_runs(instance: dg.DagsterInstance, data: DataRoot, run_ids: list[str]) -> list[str]:
    """Record each legacy run (registered as a partition) as materialized for every partitioned asset, once:
    `kept` with its row count, the others with a note. Returns the run_ids recorded now."""
    if not run_ids:
        return []
    status = instance.get_status_by_partition(dg.AssetKey("kept"), run_ids, run_id_partitions) or {}
    recorded = []
    for run_id in run_ids:
        if status.get(run_id) == dg.AssetPartitionStatus.MATERIALIZED:
            continue
        n = legacy_rows(data, run_id)
        for asset in PARTITIONED_ASSETS:
            metadata = {"source": LEGACY_SOURCE}
            if asset == "kept":
                metadata["dagster/row_count"] = n
            else:
                metadata["note"] = (
                    f"filtered by the earlier script: only kept rows exist (runs/{run_id}/{LEGACY_KEPT_FILE})"
                )
            instance.report_runless_asset_event(
                dg.AssetMaterialization(asset_key=asset, partition=run_id, metadata=metadata)
            )
        recorded.append(run_id)
    return recorded


def legacy_run_ids(data: DataRoot, batches: list[BatchState], commits: dict[str, CommitRecord]) -> list[str]:
    """Complete batches filtered by the earlier script (a legacy kept.jsonl, no commit of this pipeline)."""
    return [
        b.run_id for b in batches
        if b.filtered and b.run_id not in commits and (data.run_dir(b.run_id) / LEGACY_KEPT_FILE).exists()
    ]  # fmt: skip


def build_batch_sensor() -> dg.SensorDefinition:
    """The batch sensor. Its runs carry no caps config: the caps config's defaults are the deployment's."""

    @dg.sensor(
        name="batch_sensor",
        jobs=[judge_job, ledger_job, across_runs_job, rejudge_job],
        minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Registers each complete batch (runs/<run_id>/_SUCCESS) as a run_id partition and launches "
        "its judge run (run_key = run_id); then launches ledger runs one at a time in run_id order. Batches "
        "already filtered (committed, or a legacy kept file) are registered, never re-run; legacy ones are "
        "recorded as materialized. Filtered runs that left tasks unjudged are judged and walked again, with a "
        "backoff and a cap on tries. When the set of kept files changes and nothing is in flight, it "
        "refreshes coverage and judge calibration.",
    )
    def batch_sensor(context: dg.SensorEvaluationContext, data: DataRoot) -> dg.SensorResult:
        instance = context.instance
        batches = complete_batches(data.runs, data.warehouse, context.log)
        for b in batches:
            if b.changed:
                context.log.warning(changed_warning(b.run_id))
        commits = read_commits(data.warehouse)
        registered_list = list(instance.get_dynamic_partitions(run_id_partitions.name))
        registered = set(registered_list)
        legacy = legacy_run_ids(data, batches, commits)
        new_legacy = [r for r in legacy if r not in registered]
        if new_legacy:  # registered here, so that their materializations can be recorded in this tick
            instance.add_dynamic_partitions(run_id_partitions.name, new_legacy)
            registered |= set(new_legacy)
        for run_id in record_legacy_runs(instance, data, legacy):
            context.log.info(f"{run_id}: recorded as materialized ({LEGACY_SOURCE})")

        busy = in_flight_partitions(instance, registered_list)
        waiting = [b.run_id for b in batches if not b.filtered]
        failed_ledger = {
            r for r in waiting
            if r not in busy and instance.get_run_records(dg.RunsFilter(tags={RUN_KEY_TAG: ledger_run_key(r)}), limit=1)
        }  # fmt: skip
        failed = failures.read_failures(data.warehouse)
        retired = load_retired(data.root).runs
        to_register, to_judge, to_walk, why = plan_tick(batches, registered, busy, failed_ledger, failed, retired)
        requests = [dg.RunRequest(job_name=JUDGE_JOB, partition_key=r, run_key=r) for r in to_judge]
        if to_walk is not None:
            requests.append(
                dg.RunRequest(
                    job_name=LEDGER_JOB,
                    partition_key=to_walk,
                    run_key=ledger_run_key(to_walk),
                    tags={FIRST_WALK_TAG: to_walk},  # (plan_tick walks only batches not yet filtered)
                )
            )
        for item in rejudging_due(instance, commits, busy | {to_walk} | set(to_judge)):
            context.log.info(
                f"{item.run_id}: {commits[item.run_id].unjudged} unjudged tasks, judging again (try {item.try_number})"
            )
            requests.append(
                dg.RunRequest(
                    job_name=rejudge_job.name,
                    partition_key=item.run_id,
                    run_key=rejudge_run_key(item.run_id, item.try_number),
                    tags=rejudge_tags(item),
                )
            )
        fingerprint = kept_fingerprint(data)
        if fingerprint is not None and to_walk is None and not busy:
            requests.append(dg.RunRequest(job_name=across_runs_job.name, run_key=f"across-runs:{fingerprint}"))
        for r in sorted(failed_ledger):
            context.log.warning(f"ledger run for {r} ended without filtering it; materialize it by hand")
        context.log.info(f"registered {len(to_register)}, judging {len(to_judge)}; {why}")
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[run_id_partitions.build_add_request(to_register)] if to_register else [],
            skip_reason=None if requests or to_register else why,
        )

    return batch_sensor


# --- the labels sensor --------------------------------------------------------------------------------

NO_LABELS = "no labels file"
CALIBRATION = dg.AssetKey("judge_calibration")


def labels_changed(instance: dg.DagsterInstance, data: DataRoot) -> tuple[str, str | None] | None:
    """(the labels file's fingerprint now, the one judge_calibration was last built from) when they differ
    and there are verdicts to score; None when the calibration is up to date (or there is nothing to score)."""
    if not (data.warehouse / "judge_verdicts").exists():
        return None
    current = labels_fingerprint(labels_bytes(data)) or NO_LABELS
    event = instance.get_latest_materialization_event(CALIBRATION)
    entry = (
        event.asset_materialization.metadata.get(LABELS_FINGERPRINT) if event and event.asset_materialization else None
    )
    recorded = entry.value if entry is not None else None
    if recorded == current or (recorded is None and current == NO_LABELS):
        return None
    return current, recorded


def build_labels_sensor() -> dg.SensorDefinition:
    """The labels sensor: new labels show in judge_calibration without waiting for a new batch."""

    @dg.sensor(
        name="labels_sensor",
        jobs=[across_runs_job],
        minimum_interval_seconds=LABELS_SENSOR_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Refreshes judge_calibration (alone) when <data>/labels.jsonl changed since it was last "
        "built (a fingerprint of the file's bytes, recorded on each materialization), so new labels show "
        "without a new batch.",
    )
    def labels_sensor(context: dg.SensorEvaluationContext, data: DataRoot) -> dg.SensorResult:
        changed = labels_changed(context.instance, data)
        if changed is None:
            return dg.SensorResult(skip_reason="judge_calibration is up to date with labels.jsonl")
        current, recorded = changed
        context.log.info(f"labels.jsonl changed ({recorded} -> {current}): refreshing judge_calibration")
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(
                    job_name=across_runs_job.name, asset_selection=[CALIBRATION], run_key=f"labels:{recorded}:{current}"
                )
            ]
        )

    return labels_sensor
