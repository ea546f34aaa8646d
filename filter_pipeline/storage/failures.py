"""Validation failures on record: `warehouse/_failed/<run_id>.json` says a batch cannot be filtered as it is,
so later batches stop waiting for it (`rules/order.py` decides what waits on what)."""

import json
import time
from collections.abc import Iterator

from upath import UPath

from filter_pipeline.rules.commits import INPUT_FILES
from filter_pipeline.storage.files import atomic_write, files_in, inputs_changed

FAILED_DIR = "_failed"


def failure_path(warehouse: UPath, run_id: str) -> UPath:
    return warehouse / FAILED_DIR / f"{run_id}.json"


def record_failure(warehouse: UPath, run_id: str, reason: str, inputs: dict[str, dict | None] | None = None) -> None:
    """Record that `run_id`'s batch cannot be filtered as it is (later batches stop waiting for it), with what
    the batch held then, when known (`BatchError.inputs`: `refused_as_they_are` tells when that changes)."""
    path = failure_path(warehouse, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"run_id": run_id, "reason": reason, "recorded_at": time.time()}
    if inputs is not None:
        record["inputs"] = inputs
    body = json.dumps(record, ensure_ascii=False)
    atomic_write(path, body.encode("utf-8"))  # a reader never sees half a record


def clear_failure(warehouse: UPath, run_id: str) -> bool:
    """Remove `run_id`'s failure record (it was walked since); returns whether there was one."""
    path = failure_path(warehouse, run_id)
    if not path.exists():
        return False
    path.unlink()
    return True


UNREADABLE_RECORD = "unreadable failure record"


def read_failures(warehouse: UPath) -> dict[str, str]:
    """run_id -> recorded reason, for every batch whose validation failure is recorded."""
    found = {name: read_failure(path) for name, path in files_in(warehouse / FAILED_DIR, ".json").items()}
    return {run_id: reason for run_id, reason in found.items() if reason is not None}  # (none: removed meanwhile)


def read_failure(path: UPath) -> str | None:
    """The reason the failure record at `path` gives; None when there is none."""
    record = _read_record(path)
    return None if record is None else str(record.get("reason", ""))


def refused_as_they_are(warehouse: UPath, runs: UPath, run_ids: list[str]) -> dict[str, str]:
    """run_id -> recorded reason, for each of `run_ids` (batches under `runs`) refused before its walk whose
    input files are as they were then: none added or removed, and the one parsed unchanged. Trying such a batch
    again can only fail the same way. (A record without what the batch held, or unreadable, is not listed: the
    batch may have been corrected.)"""
    return {
        run_id: str(record.get("reason", "")) for run_id, record, same in _refusals(warehouse, runs, run_ids) if same
    }


def corrected_since_refused(warehouse: UPath, runs: UPath, run_ids: list[str]) -> dict[str, dict]:
    """run_id -> its failure record, for each of `run_ids` refused before its walk whose input files are no
    longer as they were then (`refused_as_they_are`' others, among records that say what the batch held): its
    producer corrected it, or wrote it again."""
    return {run_id: record for run_id, record, same in _refusals(warehouse, runs, run_ids) if not same}


def _refusals(warehouse: UPath, runs: UPath, run_ids: list[str]) -> Iterator[tuple[str, dict, bool]]:
    """(run_id, its failure record, whether its input files are as they were when it was recorded) for each of
    `run_ids` whose record says what the batch held (`BatchError.inputs`)."""
    wanted = set(run_ids)
    for run_id, path in files_in(warehouse / FAILED_DIR, ".json").items():
        record = _read_record(path) if run_id in wanted else None
        recorded = record.get("inputs") if record else None
        if not isinstance(recorded, dict):
            continue
        run_dir = runs / run_id
        present = {name for name in INPUT_FILES if (run_dir / name).exists()}
        yield run_id, record, present == set(recorded) and not inputs_changed(run_dir, recorded)  # (None: not compared)


def _read_record(path: UPath) -> dict | None:
    """The failure record at `path` (only a reason saying so when it cannot be read); None when there is none."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"reason": UNREADABLE_RECORD}
    return raw if isinstance(raw, dict) else {"reason": UNREADABLE_RECORD}
