"""The ledger step's wait for lower runs, as Dagster runs it: a run's first walk waits until every lower complete
batch is walked, retired or recorded as failed (CONTRACT §4). The step asks Dagster to retry it later while it
waits, and leaves its walk to the batch sensor (`Deferred`) when a run it waits for is stuck in the run queue
behind it. The order itself is the pure rule of `rules/order.py`."""

import math
import time

import dagster as dg

from filter_pipeline import settings
from filter_pipeline.rules import order
from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.shell.assets import run_id_partitions
from filter_pipeline.shell.jobs import first_walks, partitions_of
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.history import read_commit
from filter_pipeline.storage.publish import CommitState
from filter_pipeline.storage.runs import WalkOrder

# run tag: the most seconds this run's ledger step waits for lower runs (the CLI sets 0: it orders its own runs)
ORDER_MAX_WAIT_TAG = "filter_pipeline/order_max_wait_seconds"
# run tag: why this run's ledger step deferred its walk to the batch sensor (shown on the run in the UI)
DEFERRED_TAG = "filter_pipeline/deferred"
# run tag Dagster gives a re-execution: the run it re-executes
PARENT_RUN_TAG = "dagster/parent_run_id"
# run tag: "<run_ids, space-separated> in run <Dagster run id>": the runs this run's ledger step walked and committed
# before it waited for the rest of its range; its next try reports them as already filtered by this run (the run id:
# a re-execution copies its parent's tags, and walked none of them)
WALKED_BEFORE_WAITING_TAG = "filter_pipeline/walked_before_waiting"


class Deferred(Exception):
    """The step leaves its walk to the batch sensor (the runs it waits for are stuck in the run queue behind
    it); str(): why, in one line."""


def _order_settings(context: dg.AssetExecutionContext, honour_tag: bool = True) -> tuple[int, int, str]:
    """(seconds between tries, most seconds to wait, what set that wait) for this run (its run tag may lower
    the wait for lower runs; a wait for the lease is not lowered: the other walker will be done soon)."""
    interval = max(1, settings.int_setting(settings.ORDER_RETRY_SECONDS_ENV))
    max_wait, source = settings.int_setting(settings.ORDER_MAX_WAIT_SECONDS_ENV), settings.ORDER_MAX_WAIT_SECONDS_ENV
    tagged = context.run.tags.get(ORDER_MAX_WAIT_TAG)
    if honour_tag and tagged is not None and tagged.isdigit() and int(tagged) < max_wait:
        max_wait, source = int(tagged), f"this run's tag {ORDER_MAX_WAIT_TAG}"
    return interval, max_wait, source


def retry_later(context: dg.AssetExecutionContext, why: str, honour_tag: bool = True) -> None:
    """Ask Dagster to run this step again in a while, or fail it with `why` once the wait is used up."""
    interval, max_wait, source = _order_settings(context, honour_tag)
    tries = math.ceil(max_wait / interval)
    if context.retry_number >= tries:
        waited = f"after waiting {max_wait} s" if max_wait else "without waiting"
        raise dg.Failure(description=f"{why}; gave up {waited} ({source})")
    context.log.info(f"{why}; trying again in {interval} s (try {context.retry_number + 1} of {tries})")
    raise dg.RetryRequested(max_retries=tries, seconds_to_wait=interval)


def ready_runs(now: WalkOrder, run_ids: list[str]) -> list[str]:
    """The head of `run_ids` (in that order) that may be walked now: every run up to the first that waits."""
    for position, run_id in enumerate(run_ids):
        if now.blocking(run_id, walked_before=run_ids[:position]):
            return run_ids[:position]
    return run_ids


def walked_before_waiting(context: dg.AssetExecutionContext) -> set[str]:
    """The runs an earlier try of this step walked and committed before it waited (WALKED_BEFORE_WAITING_TAG, when
    this Dagster run wrote it), read from the instance: a retry in the same process holds the run's tags as they
    were at its start."""
    run = context.instance.get_run_by_id(context.run.run_id)
    walked, _, by = (run.tags if run else {}).get(WALKED_BEFORE_WAITING_TAG, "").partition(" in run ")
    return set(walked.split()) if by == context.run.run_id else set()


def committed_before_this_run(context: dg.AssetExecutionContext, found: dict[str, CommitRecord]) -> set[str]:
    """When this Dagster run re-executes another (it copies its parent's tags, a first walk's included): those of
    `found` (`filtered_meanwhile`) committed before it was created, by the run it re-executes, say."""
    reexecution = PARENT_RUN_TAG in context.run.tags
    record = context.instance.get_run_record_by_id(context.run.run_id) if found and reexecution else None
    created = record.create_timestamp.timestamp() if record else None
    return {r for r, commit in found.items() if created is not None and commit.walked_timestamp < created}


def unrecorded(context: dg.AssetExecutionContext) -> str:
    """What a failure of this step adds when an earlier try committed runs it did not record as materialized
    (`walked_before_waiting`): "; committed, but not recorded …: <runs>", or ""."""
    committed = sorted(walked_before_waiting(context))
    return f"; {order.describe_unrecorded(committed)}" if committed else ""


def how_filtered(context: dg.AssetExecutionContext, meanwhile: dict[str, CommitRecord]) -> dict[str, str]:
    """Who committed each run of `meanwhile` (`filtered_meanwhile`), and when: "this run" (an earlier try of this
    step, `walked_before_waiting`), "before" (before this Dagster run was created: `committed_before_this_run`)
    or "meanwhile" (another walk, while this one waited)."""
    ours = walked_before_waiting(context) if meanwhile else set()
    before = committed_before_this_run(context, meanwhile)
    return {r: "this run" if r in ours else "before" if r in before else "meanwhile" for r in meanwhile}


def walk_then_wait(context: dg.AssetExecutionContext, now: WalkOrder, walked: list, ready: list[str], rest: list[str]):
    """A step some of whose runs (`rest`, the first of which waits in `now`) may not be walked yet. A range may
    hold runs that may (`ready`): an asset backfill splits its runs into ranges by registration order, so two
    ranges may each hold a run the other waits for; `walked` holds the events of the walk of the `ready` runs,
    done and committed, and of the step's runs committed meanwhile. The step is then tried again
    later (its next try reports the runs walked here as already filtered by this run), unless a run `rest`
    waits for is stuck in the run queue: then the runs of `walked` are reported materialized, and Deferred is
    raised. When the wait is used up, the failure names the runs this run committed. A walk stopped by a failed
    check does not wait: its events are yielded as they are."""
    if any(isinstance(event, dg.AssetCheckResult) and not event.passed for event in walked):
        yield from walked
        return
    if ready:
        context.log.info(f"walked and committed {', '.join(ready)}; the rest of the range ({', '.join(rest)}) waits")
        committed = " ".join(sorted(walked_before_waiting(context) | set(ready)))
        context.instance.add_run_tags(
            context.run.run_id, {WALKED_BEFORE_WAITING_TAG: f"{committed} in run {context.run.run_id}"}
        )
    try:
        wait_for_lower_runs(context, now, rest, walked_before=ready)
    except Deferred:
        yield from (event for event in walked if isinstance(event, dg.AssetMaterialization))
        raise
    except dg.Failure as exc:  # (the wait is used up: the tag names what this run committed)
        raise dg.Failure(description=exc.description + unrecorded(context)) from None
    # (not reached: `rest`'s first run waits in `now`, as `ready_runs` found)
    retry_later(context, f"{', '.join(rest)} may be walked now")


def wait_for_lower_runs(
    context: dg.AssetExecutionContext, now: WalkOrder, run_ids: list[str], walked_before: list[str]
) -> None:
    """Return when every run in `run_ids` may be walked now (`now`: the data root's `walk_order`), in that order,
    after `walked_before`; else retry the step later, or raise Deferred at once when a run it waits for is stuck
    in the run queue (`_stuck_in_queue`). A run that waits for nothing (a wait of 0: its tag, as on the CLI's
    runs, or the setting) holds no slot waiting: it fails at once, naming the run it waits for, and is never
    deferred (its launcher, not the sensor, says what became of it)."""
    for position, run_id in enumerate(run_ids):
        blockers = now.blocking(run_id, walked_before=[*walked_before, *run_ids[:position]])
        if blockers:
            why = order.describe_wait(run_id, blockers)
            waits = _order_settings(context)[1] > 0
            stuck = _stuck_in_queue(context.instance, blockers) if waits else {}
            if stuck:
                raise Deferred(order.describe_stuck(why, run_id, stuck))
            retry_later(context, why)


def _stuck_in_queue(instance: dg.DagsterInstance, blockers: list[str]) -> dict[str, float]:
    """Blockers with a run queued for ORDER_QUEUED_SECONDS or more (`order.stuck_in_queue`): a run of the
    blocker's partition, a sensor's ledger run walking it, or an asset backfill's ledger run over a range of it."""
    limit = settings.int_setting(settings.ORDER_QUEUED_SECONDS_ENV)
    records = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED]))
    registered = list(instance.get_dynamic_partitions(run_id_partitions.name)) if records else []
    queued = [
        (run_id, r.create_timestamp.timestamp())
        for r in records
        for run_id in partitions_of(r.dagster_run.tags, registered)
        if run_id in blockers
    ]
    return order.stuck_in_queue(queued, time.time(), limit)


def filtered_meanwhile(
    context: dg.AssetExecutionContext, data: DataRoot, read: dict[str, CommitState]
) -> dict[str, CommitRecord]:
    """The runs this Dagster run was asked to walk for the first time that are committed already, by another walk
    while it waited or by an earlier try of its own step (their records). Asked for a first walk: named in the
    FIRST_WALK_TAG tag (a re-execution copies it: `committed_before_this_run`); without the tag (a backfill, the
    launchpad), a run named in this run's WALKED_BEFORE_WAITING_TAG or whose commit was walked after this Dagster
    run was created."""
    tagged = first_walks(context.run.tags)
    created, ours = None, set()
    if tagged is None:
        ours = walked_before_waiting(context)  # (its own tag, not two clocks: the worker's and run storage's)
        record = context.instance.get_run_record_by_id(context.run.run_id)
        created = record.create_timestamp.timestamp() if record else None
    found = {}
    for run_id, state in read.items():
        if not state.exists or (tagged is not None and run_id not in tagged):
            continue
        committed = read_commit(data.warehouse, run_id)
        if tagged is not None or run_id in ours or (created is not None and committed.walked_timestamp >= created):
            found[run_id] = committed
    return found
