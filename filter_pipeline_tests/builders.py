"""Small builders so each test reads as the rule it checks."""

import json
from pathlib import Path

import pandas as pd

from filter_pipeline.batch import read_batch
from filter_pipeline.schemas import STATUS_JUDGED, canonical_key, conform
from upath import UPath


def task(task_id: str, macro: str = "m", site: str = "s", key: list | None = None, **extra) -> dict:
    """A tasks.jsonl record; the dedup key defaults to one unique to the task."""
    record = {
        "task_id": task_id,
        "macro": macro,
        "site": site,
        "instruction": f"do {task_id}",
        "dedup_key": key if key is not None else [site, "#el", task_id],
        "start": {"kind": "url"},
    }
    record.update(extra)
    return record


def attempt(task_id: str, n: int = 1, ok: bool = True, error: str | None = None, backend=..., steps: int = 2, **extra) -> dict:
    """An executions.jsonl record; `backend` defaults to {"ok": ok, "detail": ...}, pass None for null."""
    record = {
        "task_id": task_id,
        "attempt": n,
        "ok": ok,
        "dir": f"runs/r/traj/{task_id}/{n}",
        "steps": [{"action": "click"}] * steps,
        "backend": {"ok": ok, "detail": f"detail {task_id}/{n}"} if backend is ... else backend,
    }
    if error is not None:
        record["error"] = error
    record.update(extra)
    return record


def jsonl(records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def write_batch(data: Path, run_id: str, tasks, attempts, complete: bool = True) -> Path:
    """Write runs/<run_id>/ with tasks.jsonl, executions.jsonl and (if complete) _SUCCESS."""
    run = Path(data) / "runs" / run_id
    run.mkdir(parents=True, exist_ok=True)
    (run / "tasks.jsonl").write_text(jsonl(tasks))
    (run / "executions.jsonl").write_text(jsonl(attempts))
    if complete:
        (run / "_SUCCESS").write_text("")
    return run


def parse(tmp_path: Path, tasks, attempts, run_id: str = "r"):
    """Write a batch and parse it: the Batch of frames the assets see."""
    write_batch(tmp_path, run_id, tasks, attempts)
    return read_batch(UPath(tmp_path) / "runs" / run_id, run_id)


def verdicts(*rows: dict) -> pd.DataFrame:
    """judge_verdicts rows; each dict needs task_id and may set macro, site, key, passed, status."""
    out = []
    for row in rows:
        row = dict(row)
        tid = row.pop("task_id")
        key = row.pop("key", ["s", "#el", tid])
        out.append(
            {
                "task_id": tid,
                "macro": row.pop("macro", "m"),
                "site": row.pop("site", "s"),
                "dedup_key": canonical_key(key),
                "attempt": 1,
                "passed": row.pop("passed", True),
                "status": row.pop("status", STATUS_JUDGED),
                **row,
            }
        )
    return conform(pd.DataFrame(out), "judge_verdicts")


def kept_history(*rows: tuple) -> pd.DataFrame:
    """prior_dedup_index rows from (key, macro, site, run_id, task_id) tuples."""
    return conform(
        pd.DataFrame(
            [dict(dedup_key=canonical_key(k), macro=m, site=s, run_id=r, task_id=t) for k, m, s, r, t in rows]
        ),
        "prior_dedup_index",
    )


def counts(*rows: tuple) -> pd.DataFrame:
    """prior_kept_counts rows from (macro, site, n_kept) tuples."""
    return conform(pd.DataFrame([dict(macro=m, site=s, n_kept=n) for m, s, n in rows]), "prior_kept_counts")
