"""The batch sensor: picks up each complete new batch, launches its judge run at once and its ledger run in
run_id order, re-judges filtered runs that left tasks unjudged, and records as materialized the runs filtered
elsewhere (legacy runs, and runs another instance or the CLI committed to the same warehouse).

Judging (slow, costly) starts as soon as a batch is complete, for many batches at once. The ledger step,
whose result depends on which runs were walked before, is requested for every judged batch waiting in a row
from the lowest run_id on, in one run that walks them lowest run_id first (as an asset backfill's ledger run
does), so a backlog costs about one ledger run, not one tick per batch. That is an optimisation: the ledger
step itself waits for lower runs (CONTRACT §4), whoever launched it, so a UI backfill or another instance
cannot walk out of order either.
"""

import re
from collections.abc import Callable, Iterable

import dagster as dg

from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules.batch import LEGACY_KEPT_FILE, SUCCESS_FILE, BatchState
from filter_pipeline.rules.commits import CommitRecord, commit_file, walks_fingerprint
from filter_pipeline.rules.history import HistoryError
from filter_pipeline.settings import materialize_command
from filter_pipeline.shell.assets import judge_batch, run_id_partitions
from filter_pipeline.shell.jobs import (
    FIRST_WALK_TAG,
    PARTITION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    RUN_KEY_TAG,
    across_runs_job,
    first_walk_tags,
    judge_job,
    ledger_job,
    partitions_of,
    rejudge_job,
)
from filter_pipeline.shell.ledger import LEDGER_SPECS
from filter_pipeline.shell.orphans import IN_FLIGHT_RUNS_LIMIT, NOT_FINISHED_STATUSES, fail_orphaned_runs
from filter_pipeline.shell.rejudging import corrected_requests, left_alone, rejudge_requests
from filter_pipeline.shell.waiting import DEFERRED_TAG
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage import failures
from filter_pipeline.storage.history import load_retired, read_commits
from filter_pipeline.storage.runs import complete_batches, count_records

JUDGE_JOB = judge_job.name
LEDGER_JOB = ledger_job.name
SENSOR_INTERVAL_SECONDS = 10
# the most batches one ledger run walks: its step holds the judge verdicts of all of them in memory at once
LEDGER_RANGE_LIMIT = 50

# every run_id-partitioned asset: what a legacy run (runs/<run>/kept.jsonl, filtered by the earlier script)
# is recorded as having materialized, so that it shows as filled and "Materialize missing" leaves it alone
PARTITIONED_ASSETS = tuple(sorted(key.path[-1] for key in (*judge_batch.keys, *(spec.key for spec in LEDGER_SPECS))))
LEGACY_SOURCE = "legacy kept.jsonl"
COMMITTED_SOURCE = "committed by a walk this instance has no record of"


def coverage_run_key(commits: dict[str, CommitRecord]) -> str | None:
    """The run key of across_runs_job over the committed walks as they are (`walks_fingerprint`); None before any."""
    fingerprint = walks_fingerprint(commits)
    return None if fingerprint is None else f"across-runs:{fingerprint}"


def coverage_refresh(instance: dg.DagsterInstance, commits: dict[str, CommitRecord]) -> list[dg.RunRequest]:
    """across_runs_job (coverage, calibration, the audit of the warehouse) once per change of the committed walks:
    none when a run of its key exists (Dagster would skip the request, and the tick would show no reason)."""
    key = coverage_run_key(commits)
    if key is None or instance.get_run_records(dg.RunsFilter(tags={RUN_KEY_TAG: key}), limit=1):
        return []
    return [dg.RunRequest(job_name=across_runs_job.name, run_key=key)]


def changed_warning(run_id: str) -> str:
    return (
        f"runs/{run_id} changed since it was filtered (tasks.jsonl or executions.jsonl differ from its commit "
        f"record): re-filter it with `{materialize_command(run_id)}`; it is not re-filtered unless named"
    )


def plan_tick(
    batches: list[BatchState],
    registered: set[str],
    busy: set[str],
    failed_ledger: set[str],
    failed: Iterable[str] = (),
    retired: Iterable[str] = (),
    never_run: Iterable[str] = (),
    corrected: Iterable[str] = (),
) -> tuple[list[str], list[str], list[str], str]:
    """Decide one tick: (run_ids to register, run_ids to judge, run_ids whose ledger to walk, why).

    `busy`: run_ids with a queued or running run; `failed_ledger`: run_ids a ledger run stopped at without
    filtering them; `failed`: runs with a recorded validation failure; `retired`: runs retired as a whole
    (one not filtered yet is neither registered, judged nor walked: left alone, as asked); `never_run`:
    registered run_ids no run was ever launched for (a `materialize` registers every run it is given before it
    runs the first: the sensor leaves them to it, or, if it was interrupted, to the user); `corrected`: those of `failed` corrected since, which a run of
    their own judges and walks (`rejudging.corrected_requests`), holding later ones back as any pending batch.
    A batch already filtered is registered but never re-run. The ledger walks the judged batches waiting in a
    row from the lowest pending run_id on (at most LEDGER_RANGE_LIMIT), and only when nothing lower is pending
    (the order rule); a lower batch whose run failed holds the rest back until it is materialized again,
    retired, or its validation failure is recorded.
    """
    corrected, retired, by_id = set(corrected), set(retired), {b.run_id: b for b in batches}
    skipped = (set(failed) - corrected) | retired
    # (a batch retired before it was filtered is not registered: retired no longer, it is a new batch again)
    to_register = [b.run_id for b in batches if b.run_id not in registered and (b.filtered or b.run_id not in retired)]
    to_judge = [r for r in to_register if not (by_id[r].filtered or by_id[r].judged or r in corrected)]
    ready: list[str] = []
    for b in batches:
        if b.filtered or b.run_id in skipped:
            continue
        if b.judged and b.run_id not in busy | failed_ledger | corrected and len(ready) < LEDGER_RANGE_LIMIT:
            ready.append(b.run_id)
            continue
        if ready:  # the walk stops before the first batch that is not ready: the next tick takes the rest
            break
        if b.run_id in corrected:  # (its own run judges and walks it)
            return to_register, to_judge, [], f"ledger waits for {b.run_id}, corrected since it was refused"
        if b.run_id in busy or b.run_id in to_judge:
            doing = ", judged, whose run is in flight" if b.judged else " to finish judging"
            return to_register, to_judge, [], f"ledger waits for {b.run_id}{doing}"
        which = "ledger" if b.run_id in failed_ledger else "judge"
        why = (
            f"ledger waits for {b.run_id}, whose {which} run failed: materialize it again or retire it in retired.json"
        )
        if which == "judge" and b.run_id in never_run:
            why = (
                f"ledger waits for {b.run_id}, registered but never run (by a materialize or a backfill still "
                "launching its runs, or one interrupted before it did: then materialize it or retire it in "
                "retired.json)"
            )
        return to_register, to_judge, [], why
    if not ready:
        return to_register, to_judge, [], "no batch waiting for the ledger"
    return to_register, to_judge, ready, f"ledger walks {describe_walk(ready)}"


def describe_walk(run_ids: list[str]) -> str:
    """The run_ids one ledger run walks, as its tag and the sensor's log show them: 'r1' or 'r1 r2 r3 (3 runs,
    in run_id order)'."""
    return run_ids[0] if len(run_ids) == 1 else f"{' '.join(run_ids)} ({len(run_ids)} runs, in run_id order)"


def registered_block(run_ids: list[str], registration_order: list[str]) -> list[str]:
    """The longest head of `run_ids` (in run_id order) that is exactly one block of consecutive partitions in
    registration order. A ranged run covers the partitions from its start to its end *as registered*; a batch
    registered late (an earlier run_id after later ones) would otherwise bring in partitions that are not
    ready, or leave out one that is. Empty when the first is not registered yet."""
    position = {r: i for i, r in enumerate(registration_order)}
    block: list[str] = []
    for k, run_id in enumerate(run_ids, start=1):
        if run_id not in position:
            break
        head = [position[r] for r in run_ids[:k]]
        if max(head) - min(head) + 1 == k:
            block = run_ids[:k]
    return block


def in_flight_partitions(instance: dg.DagsterInstance, registered: list[str]) -> set[str]:
    """run_ids with a queued or running run (`partitions_of`: its partition, the walks a sensor's ledger run was
    asked for, or every partition of a single-run backfill's range in the order the partitions were registered)."""
    records = instance.get_run_records(dg.RunsFilter(statuses=NOT_FINISHED_STATUSES), limit=IN_FLIGHT_RUNS_LIMIT)
    return {run_id for record in records for run_id in partitions_of(record.dagster_run.tags, registered)}


LEDGER_KEY_SUFFIX = ":ledger"
# the run keys of the sensor's ledger runs: <lowest run_id walked>:ledger, then :ledger:2, :ledger:3 after runs
# from there that deferred their walk
_LEDGER_KEY = re.compile(rf"[^:]+{re.escape(LEDGER_KEY_SUFFIX)}(?::[0-9]+)?")


def ledger_run_key(run_id: str, deferred: int = 0) -> str:
    """The run key of the sensor's ledger run whose walk starts at `run_id` (the lowest it walks), after
    `deferred` runs from there that deferred their walk: a tick that evaluates again never launches a second
    run from the same start, and a run that deferred is followed by one of its own (Dagster launches a run key
    once)."""
    return f"{run_id}{LEDGER_KEY_SUFFIX}" + (f":{deferred + 1}" if deferred else "")


def next_ledger_key(instance: dg.DagsterInstance, run_id: str) -> str:
    """The key of the sensor's next ledger run from `run_id`: the first `ledger_run_key` of it whose run, if
    any, did not defer its walk (the sensor asks for a walk from there only when no run of it is in flight or
    failed, so a run under that key deferred, or there is none)."""
    deferred = 0
    while True:
        key = ledger_run_key(run_id, deferred)
        found = instance.get_run_records(dg.RunsFilter(tags={RUN_KEY_TAG: key}), limit=1)
        if not found or DEFERRED_TAG not in found[0].dagster_run.tags:
            return key
        deferred += 1


def ledger_request(run_ids: list[str], registration_order: list[str], key: str) -> dg.RunRequest:
    """One ledger run for `run_ids` (consecutive in registration order, see `registered_block`), walked in
    run_id order, under the run key `key` (`next_ledger_key`); each is named for its first walk
    (FIRST_WALK_TAG, which the UI shows: which runs it walks)."""
    tags = first_walk_tags(run_ids)  # (plan_tick walks only batches not yet filtered)
    if len(run_ids) == 1:
        return dg.RunRequest(job_name=LEDGER_JOB, partition_key=run_ids[0], run_key=key, tags=tags)
    position = {r: i for i, r in enumerate(registration_order)}
    first, last = min(run_ids, key=position.__getitem__), max(run_ids, key=position.__getitem__)
    return dg.RunRequest(job_name=LEDGER_JOB, run_key=key, tags={**tags, RANGE_START_TAG: first, RANGE_END_TAG: last})


def stopped_at(run_ids: list[str], commits: dict[str, CommitRecord], ended: float) -> str | None:
    """Where a finished ledger run over `run_ids` (run_id order) stopped: the first it had not committed when it
    ended (each is committed before the next is walked); None when it committed them all. A commit walked after
    the run ended is another walk's."""
    for run_id in run_ids:
        record = commits.get(run_id)
        if record is None or record.walked_timestamp > ended:
            return run_id
    return None


def runless(instance: dg.DagsterInstance, run_ids: list[str]) -> set[str]:
    """Those of `run_ids` that no run of this instance was ever launched for (by its partition tag)."""
    if not run_ids:
        return set()
    tried = instance.get_run_records(dg.RunsFilter(tags={PARTITION_TAG: run_ids}))
    return set(run_ids) - {r.dagster_run.tags.get(PARTITION_TAG) for r in tried}


def failed_ledger_runs(instance: dg.DagsterInstance, waiting: list[str], commits: dict[str, CommitRecord]) -> set[str]:
    """Waiting run_ids (none of them in flight) that a finished sensor ledger run stopped at without filtering:
    the first of a run's walks it did not commit, found from the runs that started at a waiting run_id and
    from every failed or canceled one (a ranged run may have committed the first runs of its range). The
    run_ids after it in its range were not tried: they are walked again once it is filtered. A run that
    deferred its walk (it succeeds, tagged DEFERRED_TAG) stopped nowhere: the sensor's next ledger run walks
    its batches once the lower ones are walked (`next_ledger_key`)."""
    if not waiting:
        return set()
    started = instance.get_run_records(dg.RunsFilter(tags={RUN_KEY_TAG: [ledger_run_key(r) for r in waiting]}))
    broken = instance.get_run_records(
        dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]),
        limit=IN_FLIGHT_RUNS_LIMIT,
    )
    found = set()
    for record in [*started, *broken]:
        tags = record.dagster_run.tags
        if (
            record.dagster_run.status in NOT_FINISHED_STATUSES
            or not _LEDGER_KEY.fullmatch(tags.get(RUN_KEY_TAG, ""))
            or DEFERRED_TAG in tags
        ):
            continue  # in flight, deferred, or not the sensor's ledger run (the launchpad's, a backfill's, a judge run)
        ended = record.end_time or record.update_timestamp.timestamp()
        stop = stopped_at(sorted(partitions_of(tags)), commits, ended)
        if stop in waiting:
            found.add(stop)
    return found


def record_legacy_runs(instance: dg.DagsterInstance, data: DataRoot, run_ids: list[str]) -> list[str]:
    """Record each legacy run (registered as a partition) as materialized for every partitioned asset, once:
    `kept` with its row count, the others with a note. Returns the run_ids recorded now."""

    def metadata(run_id: str, asset: str) -> dict:
        if asset == "kept":
            return {"source": LEGACY_SOURCE, "dagster/row_count": count_records(data.run_dir(run_id), LEGACY_KEPT_FILE)}
        note = f"filtered by the earlier script: only kept rows exist (runs/{run_id}/{LEGACY_KEPT_FILE})"
        return {"source": LEGACY_SOURCE, "note": note}

    return _record_as_materialized(instance, run_ids, metadata)


def record_committed_elsewhere(
    instance: dg.DagsterInstance, run_ids: list[str], commits: dict[str, CommitRecord]
) -> list[str]:
    """Record each committed run (registered as a partition) whose walk this instance has no record of (a CLI
    or another deployment on the same warehouse walked it) as materialized, once: each asset the walk wrote
    with its row count and sha256 from the commit record, the judge step's with the record named. Returns the
    run_ids recorded now."""

    def metadata(run_id: str, asset: str) -> dict:
        record = commits[run_id]
        found = {"source": f"{COMMITTED_SOURCE} ({commit_file(run_id)}, walked at {record.walked_at})"}
        if entry := record.files.get(asset):
            found |= {"dagster/row_count": int(entry.get("rows") or 0), "sha256": entry.get("sha256", "")}
        return found

    return _record_as_materialized(instance, run_ids, metadata)


def _unknown(instance: dg.DagsterInstance, asset: str, run_ids: list[str]) -> list[str]:
    """The run_ids whose partition of `asset` this instance has no status of: never materialized nor tried."""
    status = instance.get_status_by_partition(dg.AssetKey(asset), run_ids, run_id_partitions) or {}
    return [r for r in run_ids if status.get(r) is None]


def _record_as_materialized(
    instance: dg.DagsterInstance, run_ids: list[str], metadata: Callable[[str, str], dict]
) -> list[str]:
    """For each run_id whose `kept` this instance has no record of at all (never materialized, never tried: a
    failed or running attempt here is left as it shows), a runless materialization of every partitioned asset
    it has no record of, with `metadata(run_id, asset)`: so that the run shows as filled and "Materialize
    missing" leaves it alone. Returns those run_ids."""
    if not run_ids:
        return []
    missing = _unknown(instance, "kept", run_ids)
    for asset in PARTITIONED_ASSETS if missing else ():
        for run_id in missing if asset == "kept" else _unknown(instance, asset, missing):
            instance.report_runless_asset_event(
                dg.AssetMaterialization(asset_key=asset, partition=run_id, metadata=metadata(run_id, asset))
            )
    return missing


def legacy_run_ids(data: DataRoot, batches: list[BatchState], commits: dict[str, CommitRecord]) -> list[str]:
    """Complete batches filtered by the earlier script (a legacy kept.jsonl, no commit of this pipeline)."""
    return [
        b.run_id for b in batches
        if b.filtered and b.run_id not in commits and (data.run_dir(b.run_id) / LEGACY_KEPT_FILE).exists()
    ]  # fmt: skip


def register_legacy_runs(
    context: dg.SensorEvaluationContext, data: DataRoot, batches: list[BatchState], commits: dict[str, CommitRecord]
) -> list[str]:
    """Register legacy runs now (so that their materializations can be recorded in this tick) and record them
    as materialized; returns every registered run_id in registration order."""
    instance = context.instance
    registration_order = list(instance.get_dynamic_partitions(run_id_partitions.name))
    legacy = legacy_run_ids(data, batches, commits)
    new_legacy = [r for r in legacy if r not in set(registration_order)]
    if new_legacy:
        instance.add_dynamic_partitions(run_id_partitions.name, new_legacy)
        registration_order += new_legacy
        context.log.info(f"registered {len(new_legacy)} legacy run(s) (filtered by the earlier script)")
    for run_id in record_legacy_runs(instance, data, legacy):
        context.log.info(f"{run_id}: recorded as materialized ({LEGACY_SOURCE})")
    return registration_order


def plan_ledger(
    context: dg.SensorEvaluationContext,
    data: DataRoot,
    batches: list[BatchState],
    commits: dict[str, CommitRecord],
    retired: set[str],
    corrected: set[str],
) -> tuple[list[str], list[str], list[str], str, set[str], list[str]]:
    """plan_tick over what the instance and the warehouse say now (`retired`: the runs retired as a whole), the
    walk narrowed to one block of registration order: (to register, to judge, to walk, why, busy run_ids,
    registration order)."""
    registration_order = register_legacy_runs(context, data, batches, commits)
    for line in fail_orphaned_runs(context.instance):  # (else in flight for ever: their batches never picked up)
        context.log.warning(line)
    busy = in_flight_partitions(context.instance, registration_order)
    elsewhere = [r for r in registration_order if r in commits and r not in busy]
    for run_id in record_committed_elsewhere(context.instance, elsewhere, commits):
        context.log.info(f"{run_id}: recorded as materialized ({COMMITTED_SOURCE})")
    waiting = [b.run_id for b in batches if not b.filtered and b.run_id not in busy]
    failed_ledger = failed_ledger_runs(context.instance, waiting, commits)
    for r in sorted(failed_ledger):
        context.log.warning(f"ledger run for {r} ended without filtering it; materialize it by hand")
    never_run = runless(context.instance, [b.run_id for b in batches if b.run_id in set(waiting) - set(retired)])
    plan = plan_tick(
        batches,
        set(registration_order),
        busy,
        failed_ledger,
        failures.read_failures(data.warehouse),
        retired,
        never_run,
        corrected,
    )
    to_register, to_judge, ready, why = plan
    to_walk = registered_block(ready, registration_order)
    if ready and not to_walk:
        why = f"ledger waits for {ready[0]} to be registered"
    elif to_walk != ready:
        why = (
            f"ledger walks {describe_walk(to_walk)}; {ready[len(to_walk)]} and later next (one ledger run walks "
            "partitions consecutive in registration order: one registered out of order, or one not walked, lies "
            "between)"
        )
    return to_register, to_judge, to_walk, why, busy, registration_order


def build_batch_sensor() -> dg.SensorDefinition:
    """The batch sensor. Its runs carry no caps config: the caps config's defaults are the deployment's."""

    @dg.sensor(
        name="batch_sensor",
        jobs=[judge_job, ledger_job, across_runs_job, rejudge_job],
        minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Registers each complete batch (runs/<run_id>/{SUCCESS_FILE}) as a run_id partition and "
        "launches its judge run (run_key = run_id), unless it is retired as a whole; then one ledger run at a time "
        "for every judged batch waiting "
        f"in a row from the lowest run_id on (up to {LEDGER_RANGE_LIMIT}), walked in run_id order (run_key = "
        f"{ledger_run_key('<lowest run_id>')}, then {ledger_run_key('<lowest run_id>', 1)} and on after a run "
        f"from there deferred its walk; the tag {FIRST_WALK_TAG} lists them). Batches already filtered "
        "(committed, or a legacy kept file) are registered, never re-run; legacy ones, and committed ones this "
        "instance has no record of (walked by the CLI or another deployment), are recorded as materialized. "
        "Filtered runs that left tasks unjudged are judged and walked again, with a backoff and a cap on tries; "
        "a batch refused before its walk (skipped in the order from then on) and corrected since is judged and "
        "walked once per refusal, as a late batch (rejudge_job). "
        "After each walk that commits, once nothing is in flight, it refreshes coverage and judge calibration "
        "and audits the warehouse (across_runs_job).",
    )
    def batch_sensor(context: dg.SensorEvaluationContext, data: DataRoot, judge: JudgeResource) -> dg.SensorResult:
        batches = complete_batches(data.runs, data.warehouse, context.log)
        for b in batches:
            if b.changed:
                context.log.warning(changed_warning(b.run_id))
        try:
            commits, retired = read_commits(data.warehouse), set(load_retired(data.root).runs)
        except HistoryError as exc:  # (which runs count, and which wait, is unknown until it is mended)
            return dg.SensorResult(skip_reason=f"nothing launched until it is fixed: {exc}")
        unfiltered = [b.run_id for b in batches if not b.filtered and b.run_id not in retired]
        corrected = failures.corrected_since_refused(data.warehouse, data.runs, unfiltered)
        plan = plan_ledger(context, data, batches, commits, retired, set(corrected))
        to_register, to_judge, to_walk, why, busy, registration_order = plan
        # (tagged as first walks: a batch another process commits before its judge run starts keeps its commit)
        requests = [
            dg.RunRequest(job_name=JUDGE_JOB, partition_key=r, run_key=r, tags=first_walk_tags([r])) for r in to_judge
        ]
        if to_walk:
            requests.append(ledger_request(to_walk, registration_order, next_ledger_key(context.instance, to_walk[0])))
        untouched = busy | set(to_walk) | set(to_judge) | left_alone(commits, batches, retired)
        rejudging, cursor = rejudge_requests(context, commits, untouched, judge.identity())
        fixing, stuck = corrected_requests(context, data, corrected, busy)
        why = stuck or why  # (the batch the ledger waits for: the lowest corrected one)
        requests += rejudging + fixing
        if not (to_walk or busy or rejudging or fixing):
            requests += coverage_refresh(context.instance, commits)
        context.log.info(f"registered {len(to_register)} new batch(es), judging {len(to_judge)}; {why}")
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[run_id_partitions.build_add_request(to_register)] if to_register else [],
            skip_reason=None if requests or to_register else why,
            cursor=cursor,
        )

    return batch_sensor
