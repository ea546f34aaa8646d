"""Validation failures on record: `warehouse/_failed/<run_id>.json` says a batch cannot be filtered as it is,
so later batches stop waiting for it (`rules/order.py` decides what waits on what)."""

import json
import time

from upath import UPath

from filter_pipeline.storage.files import atomic_write, files_in

FAILED_DIR = "_failed"


def failure_path(warehouse: UPath, run_id: str) -> UPath:
    return warehouse / FAILED_DIR / f"{run_id}.json"


def record_failure(warehouse: UPath, run_id: str, reason: str) -> None:
    """Record that `run_id`'s batch cannot be filtered as it is (later batches stop waiting for it)."""
    path = failure_path(warehouse, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"run_id": run_id, "reason": reason, "recorded_at": time.time()}, ensure_ascii=False)
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
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError:
        return UNREADABLE_RECORD
    return str(raw.get("reason", "")) if isinstance(raw, dict) else UNREADABLE_RECORD
