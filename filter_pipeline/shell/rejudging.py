"""Judging again: the runs whose walk left tasks unjudged (an endpoint down, a budget spent), which are due under
a backoff and a cap on tries, by the judge that judged the rest; and the batches refused before their walk and
corrected since. The batch sensor launches both (`rejudge_job`: judged and walked in one run); a `materialize`
naming no run runs them."""

import json
import time
from collections.abc import Iterable, Set

import dagster as dg

from filter_pipeline import settings
from filter_pipeline.judge.config import ENV
from filter_pipeline.rules import order
from filter_pipeline.rules.batch import BatchState
from filter_pipeline.rules.commits import CommitRecord, another_judge
from filter_pipeline.rules.order import blocking_runs
from filter_pipeline.shell.jobs import REJUDGE_OF_TAG, REJUDGE_TRY_TAG, RUN_KEY_TAG, first_walk_tags, rejudge_job
from filter_pipeline.shell.waiting import DEFERRED_TAG
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.runs import walk_order


def rejudge_run_key(run_id: str, try_number: int) -> str:
    return f"{run_id}:rejudge:{try_number}"


def rejudge_tries(instance: dg.DagsterInstance, run_id: str) -> tuple[int, float]:
    """(re-judging runs launched so far for `run_id`, when the last one ended or started; 0.0 if none)."""
    records = instance.get_run_records(dg.RunsFilter(tags={REJUDGE_OF_TAG: run_id}))
    last = max((r.end_time or r.create_timestamp.timestamp() for r in records), default=0.0)
    return len(records), last


def left_alone(committed: Iterable[str], complete: Iterable[BatchState], retired: Set[str]) -> set[str]:
    """The committed runs no re-judging touches, whoever launches it: retired; their batch changed since it was
    filtered (re-filtered only when named: re-judging would parse its new files); or not among the `complete`
    batches, being written again or gone (the try would fail on its files and count against the cap)."""
    complete = list(complete)
    listed = {b.run_id for b in complete}
    return set(retired) | {b.run_id for b in complete if b.changed} | (set(committed) - listed)


def rejudging_due(
    instance: dg.DagsterInstance, commits: dict[str, CommitRecord], left_alone: set[str], judge: dict, wait: bool = True
) -> tuple[list[order.Rejudge], dict[str, str]]:
    """(committed runs with unjudged tasks to judge again now, under the cap on tries, but those in `left_alone`
    (in flight, changed, retired); the runs left as they are because `judge` (`JudgeResource.identity`) is not
    the one that judged them, each with a line saying so). `wait`: respect the backoff (the sensor does, a
    user's `materialize` does not)."""
    backoff = settings.int_setting(settings.REJUDGE_BACKOFF_SECONDS_ENV)
    max_tries = settings.int_setting(settings.REJUDGE_MAX_TRIES_ENV)
    due, other_judge = [], {}
    for run_id, record in sorted(commits.items()):
        if record.unjudged <= 0 or run_id in left_alone:
            continue
        if differs := another_judge(record.judge, judge):
            other_judge[run_id] = (
                f"{run_id}: {record.unjudged} unjudged tasks left as they are: the run was {differs} (judge them "
                f"again with that judge: --judge, {ENV['kind']}, {ENV['model']}, {ENV['prompt_version']})"
            )
            continue
        tries, last = rejudge_tries(instance, run_id)
        found = order.rejudge_due(
            run_id, record.unjudged, tries, max(last, record.walked_timestamp), time.time(), backoff, max_tries, wait
        )
        if found is not None:
            due.append(found)
    return due, other_judge


def rejudge_tags(item: order.Rejudge) -> dict[str, str]:
    return {REJUDGE_OF_TAG: item.run_id, REJUDGE_TRY_TAG: str(item.try_number)}


def rejudge_requests(
    context: dg.SensorEvaluationContext, commits: dict[str, CommitRecord], left_alone: set[str], judge: dict
) -> tuple[list[dg.RunRequest], str]:
    """(the re-judging runs to launch now; the sensor's cursor: the runs another judge judged, each said once)."""
    requests = []
    due, other_judge = rejudging_due(context.instance, commits, left_alone, judge)
    told = set(json.loads(context.cursor)) if context.cursor else set()
    for run_id, line in other_judge.items():
        if run_id not in told:
            context.log.info(line)
    for item in due:
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
    return requests, json.dumps(sorted(other_judge))


def corrected_run_key(run_id: str, refusal: dict, deferred: int = 0) -> str:
    """The run key of the run that judges and walks `run_id` once corrected after the refusal `refusal` (its
    failure record): one run per refusal, whichever version of the files it finds; after `deferred` runs of it
    that deferred their walk, one more of its own."""
    return f"{run_id}:corrected:{refusal.get('recorded_at')}" + (f":{deferred + 1}" if deferred else "")


def corrected_requests(
    context: dg.SensorEvaluationContext, data: DataRoot, corrected: dict[str, dict], busy: set[str]
) -> tuple[list[dg.RunRequest], str | None]:
    """(a run judging and walking the lowest of the `corrected` batches, refused before their walk and corrected
    since, each with its failure record (`corrected_since_refused`); the line the ledger's wait then says, when
    that run ended without walking it). One run per refusal (`corrected_run_key`), when none of the batch's runs
    is in flight (`busy`) and no lower batch holds its first walk back. The others wait for it (`plan_tick` walks
    nothing above it meanwhile), so that the rows kept are those `materialize` keeps. Such a batch stays skipped
    in the ledger step's own order until it is walked (CONTRACT §4): its walk is a late batch's, every other run
    its history."""
    if not corrected or (run_id := min(corrected)) in busy:
        return [], None
    refusal, state = corrected[run_id], walk_order(data.root)
    if blockers := blocking_runs(run_id, state.complete, state.committed, state.failed - set(corrected), state.retired):
        context.log.info(f"{run_id}: corrected since it was refused; its walk waits for {', '.join(blockers)}")
        return [], None
    key, deferred = corrected_run_key(run_id, refusal), 0
    while found := context.instance.get_run_records(dg.RunsFilter(tags={RUN_KEY_TAG: key}), limit=1):
        if DEFERRED_TAG not in found[0].dagster_run.tags:
            why = (
                f"ledger waits for {run_id}, corrected since it was refused, whose run ended without walking it: "
                "materialize it again or retire it in retired.json"
            )
            context.log.warning(why)
            return [], why
        deferred += 1
        key = corrected_run_key(run_id, refusal, deferred)
    context.log.info(f"{run_id}: corrected since it was refused ({refusal.get('reason')}): judging and walking it")
    tags = first_walk_tags([run_id])
    return [dg.RunRequest(job_name=rejudge_job.name, partition_key=run_id, run_key=key, tags=tags)], None
