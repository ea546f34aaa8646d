"""The `ledger` concurrency pool, and recovery of slots held by runs whose process was killed.

A run killed with SIGKILL never releases the slot it claimed, and with Dagster's default run launcher (and
`execute_in_process`, which the CLI uses) nothing notices the dead process, so every later ledger step would
wait forever. The ledger step therefore tags its run with its host and pid; the sensor and the CLI release
a slot whose holder is a dead process on this host, and mark that run failed.
"""

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from filter_pipeline.shell.warehouse import HOST, process_alive

LEDGER_POOL = "ledger"
HOST_TAG = "filter_pipeline/host"
PID_TAG = "filter_pipeline/pid"
LOCK_FILE = "filter_pipeline_ledger.lock"


@contextmanager
def ledger_lock(instance: dg.DagsterInstance) -> Iterator[None]:
    """On a SQLite instance, an exclusive OS lock on a file in its DAGSTER_HOME for as long as the ledger
    step runs; elsewhere, nothing.

    Dagster's SQLite storage can give the pool's one slot to two processes that claim it at the same
    moment: the claim reads a free slot, then updates it with no check that it is still free, and SQLite
    ignores FOR UPDATE SKIP LOCKED. Two CLI runs started together then walked the same history and kept a
    key twice (seen once in CI). A SQLite instance is one machine's, so a file lock in its folder
    serializes every process that uses it, and the OS drops the lock of a killed process. On PostgreSQL
    the claim is a real row lock, and the pool alone holds across machines.
    """
    with open(os.path.join(instance.root_directory, LOCK_FILE), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def mark_ledger_holder(context: dg.AssetExecutionContext) -> None:
    """Record which process holds the ledger slot for this run."""
    context.instance.add_run_tags(context.run.run_id, {HOST_TAG: HOST, PID_TAG: str(os.getpid())})


def release_stale_ledger_slots(instance: dg.DagsterInstance) -> list[str]:
    """Free ledger slots held by dead processes on this host; returns the run_ids whose slots were freed."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return []
    freed = []
    for run_id in storage.get_concurrency_info(LEDGER_POOL).active_run_ids:
        run = instance.get_run_by_id(run_id)
        tags = run.tags if run else {}
        holder_is_dead = tags.get(HOST_TAG) == HOST and PID_TAG in tags and not process_alive(int(tags[PID_TAG]))
        if run is None or (holder_is_dead and run.status != dg.DagsterRunStatus.SUCCESS):
            if run is not None and not run.is_finished:
                instance.report_run_failed(run, "its process died while holding the ledger slot")
            storage.free_concurrency_slots_for_run(run_id)
            freed.append(run_id)
    return freed
