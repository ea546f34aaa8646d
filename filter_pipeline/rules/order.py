"""The ledger's order (CONTRACT §4), as pure decisions (the records of batches that failed validation are
`storage/failures.py`'s).

A run's first walk waits until every complete batch with a lower run_id is committed, retired as a whole, or
has a recorded validation failure (`warehouse/_failed/<run_id>.json`). Walking an already committed run again
waits for nothing. Whoever launches the walk (sensor, CLI, a UI backfill in any order, another instance), the
ledger step asks `blocking_runs` first, so the order does not depend on the launcher.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def blocking_runs(
    run_id: str,
    complete: Iterable[str],
    committed: Iterable[str],
    failed: Iterable[str],
    retired: Iterable[str],
    walked_before: Iterable[str] = (),
) -> list[str]:
    """The run_ids a first walk of `run_id` must wait for, in run_id order (empty: it may walk now).

    `complete`: every complete batch (`_SUCCESS`); `committed`: runs filtered for good (committed, or a legacy
    kept.jsonl); `failed`: runs with a recorded validation failure; `retired`: runs retired as a whole;
    `walked_before`: runs the same step walks before this one (a ranged step walks its partitions in run_id
    order, each committed before the next). A run that is itself committed is a re-walk and never waits.
    """
    done = set(committed)
    if run_id in done:
        return []
    passed = done | set(failed) | set(retired) | set(walked_before)
    return sorted(r for r in set(complete) if r < run_id and r not in passed)


def walk_order(run_ids: Iterable[str], committed: Iterable[str]) -> list[str]:
    """The order in which to walk `run_ids` (as given, duplicates dropped): runs whose first walk is pending
    take the places of pending runs in run_id order; re-walks of committed runs keep their places."""
    given = list(dict.fromkeys(run_ids))
    done = set(committed)
    pending = iter(sorted(r for r in given if r not in done))
    return [r if r in done else next(pending) for r in given]


def describe_wait(run_id: str, blockers: list[str], limit: int = 5) -> str:
    """One line: which runs a first walk of `run_id` waits for."""
    shown = ", ".join(blockers[:limit]) + (f" and {len(blockers) - limit} more" if len(blockers) > limit else "")
    if len(blockers) == 1:
        return (
            f"the first walk of {run_id} waits for {shown}: a complete batch with a lower run_id, not yet filtered "
            "(walk it, retire it in retired.json, or let its validation failure be recorded)"
        )
    return (
        f"the first walk of {run_id} waits for {shown}: complete batches with a lower run_id, not yet filtered "
        "(walk them, retire them in retired.json, or let their validation failures be recorded)"
    )


def describe_stop(run_id: str, not_walked: list[str], committed: list[str]) -> str:
    """One line: a ranged walk stopped at `run_id`, left uncommitted by its checks; the runs after it were not
    walked and those before it, though committed, are not recorded as materialized."""
    said = [f"{run_id} was not committed"]
    if not_walked:
        said.append(f"not walked, to keep run_id order: {', '.join(not_walked)}")
    if committed:
        said.append(describe_unrecorded(committed))
    return "; ".join(said)


def describe_unrecorded(committed: list[str]) -> str:
    """The runs a step committed but did not record as materialized (it stopped or failed after their walks)."""
    return f"committed, but not recorded as materialized (materializing again walks them again): {', '.join(committed)}"


def stuck_in_queue(queued: list[tuple[str, float]], now: float, limit: float) -> dict[str, float]:
    """Of queued runs given as (run_id, queued at, in seconds since the epoch), the run_ids queued for
    `limit` seconds or more, each with its longest time in the queue, in run_id order.

    Why it matters: a waiting ledger step holds a run slot. A run it waits for that sits in the queue that
    long means the slots are all taken, perhaps by runs waiting like this one, none of which can move."""
    stuck: dict[str, float] = {}
    for run_id, queued_at in queued:
        if now - queued_at >= limit:
            stuck[run_id] = max(now - queued_at, stuck.get(run_id, 0.0))
    return dict(sorted(stuck.items()))


def describe_stuck(why: str, run_id: str, stuck: dict[str, float]) -> str:
    """One line: why a waiting step deferred its walk instead of waiting (`stuck`: blocker -> seconds queued)."""
    queued = ", ".join(f"{r} (queued {seconds:.0f} s)" for r, seconds in stuck.items())
    return (
        f"{why}; deferred instead of waiting: the run of {queued} is waiting for a run slot, which this run "
        f"would hold. The batch sensor walks {run_id} in run_id order once the lower runs are walked (with the "
        f"sensor off, materialize {run_id} again then)"
    )


# --- re-judging runs with unjudged tasks -------------------------------------------------------------------


@dataclass(frozen=True)
class Rejudge:
    run_id: str
    try_number: int  # 1 for the first re-judging


def rejudge_due(
    run_id: str,
    unjudged: int,
    tries_so_far: int,
    last_at: float,
    now: float,
    backoff_seconds: float,
    max_tries: int,
    wait: bool = True,
) -> Rejudge | None:
    """Whether to judge `run_id` again now: it has unjudged tasks, fewer than `max_tries` tries were made, and
    (when `wait`) `backoff_seconds * 2**tries_so_far` have passed since `last_at` (its last walk or try)."""
    if unjudged <= 0 or tries_so_far >= max_tries:
        return None
    if wait and now < last_at + backoff_seconds * (2**tries_so_far):
        return None
    return Rejudge(run_id=run_id, try_number=tries_so_far + 1)
