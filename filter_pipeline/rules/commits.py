"""STUB of helper C1's commit records (branch `ledger-integrity` replaces this file): one JSON record per
walked run, `warehouse/_commits/<run_id>.json`, written after all of that run's ledger outputs. A run is
filtered exactly when it has one. Only what the order and re-judging code reads is here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from upath import UPath

COMMITS_DIR = "_commits"


@dataclass(frozen=True)
class CommitRecord:
    run_id: str
    walked_at: str = ""  # ISO 8601, UTC
    caps: dict = field(default_factory=dict)
    caps_source: str = "deployment"  # "deployment" or "run config"
    unjudged: int = 0  # tasks the walk could not use because they were not judged


def commit_path(warehouse: UPath, run_id: str) -> UPath:
    return warehouse / COMMITS_DIR / f"{run_id}.json"


def read_commits(warehouse: UPath) -> dict[str, CommitRecord]:
    """Every committed run_id -> its record."""
    folder = warehouse / COMMITS_DIR
    if not folder.exists():
        return {}
    records = {}
    for path in folder.iterdir():
        if path.name.endswith(".json") and not path.name.startswith("."):
            raw = json.loads(path.read_text(encoding="utf-8"))
            known = {k: raw[k] for k in CommitRecord.__dataclass_fields__ if k in raw}
            records[raw["run_id"]] = CommitRecord(**known)
    return records


def write_commit(warehouse: UPath, record: CommitRecord) -> None:
    path = commit_path(warehouse, record.run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    walked_at = record.walked_at or datetime.now(timezone.utc).isoformat(timespec="seconds")
    body = json.dumps({**asdict(record), "walked_at": walked_at}, sort_keys=True)
    temp = path.parent / f".{path.name}.tmp"
    temp.write_text(body, encoding="utf-8")
    temp.rename(path)
