"""A small warehouse written here for the review app's tests: one run with every fate, committed or not, its
verdict files with or without the judge's newer columns."""

from pathlib import Path

import pandas as pd
import pyarrow as pa
from upath import UPath

from filter_pipeline.review.data import Warehouse
from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.rules.schemas import SCHEMAS, VERDICT_PARTS, parquet_bytes, to_arrow
from filter_pipeline.storage.publish import file_entry, write_commit

TASKS = ["k", "d", "c", "jf", "u", "ef"]  # kept, duplicate, site_cap, judge_fail, unjudged, execute failures only


# the columns an older version of the stage (judge prompt v2) did not write
OLDER_VERSION_LACKS = VERDICT_PARTS


def write_asset(
    root: Path, asset: str, run_id: str, rows: list[dict], schema_of: str | None = None, extra: dict | None = None
):
    frame = pd.DataFrame({c: [r.get(c) for r in rows] for c in SCHEMAS[schema_of or asset].names})
    table = to_arrow(frame, schema_of or asset)
    if extra is None:  # a file as the older version wrote it
        table = table.drop_columns([c for c in OLDER_VERSION_LACKS if c in table.column_names])
    for name, (values, arrow_type) in (extra or {}).items():  # (replacing the column where the schema has it)
        table = table.drop_columns([name]) if name in table.column_names else table
        table = table.append_column(name, pa.array(values, type=arrow_type))
    path = root / "warehouse" / asset / f"{run_id}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(parquet_bytes(table).to_pybytes())


def write_run(root: Path, run_id: str, committed: bool = True, newer_columns: bool = False) -> None:
    (root / "runs" / run_id).mkdir(parents=True, exist_ok=True)
    (root / "runs" / run_id / "_SUCCESS").touch()
    task = lambda t: {"task_id": t, "site": f"s-{t}", "macro": "m", "instruction": f"do {t}", "run_id": run_id}  # noqa: E731
    write_asset(root, "batch_tasks", run_id, [task(t) | {"dedup_key": f'["s","#x","{t}"]'} for t in TASKS])
    write_asset(root, "batch_attempts", run_id, [{"task_id": t, "attempt": 1, "ok": t != "ef", "run_id": run_id,
                                              "dir": f"runs/{run_id}/traj/{t}/1", "n_actions": 2} for t in TASKS])  # fmt: skip
    judged = [t for t in TASKS if t != "ef"]
    verdicts = [task(t) | {"attempt": 1, "dir": f"runs/{run_id}/traj/{t}/1", "status": "error" if t == "u" else "judged",
                           "passed": None if t == "u" else t != "jf", "votes": "2/3", "cost": 0.5} for t in judged]  # fmt: skip
    extra = {"blocked": ([False, False, False, True, None], pa.bool_()), "score": ([5, 4, 4, 1, None], pa.int64()),
             "reasoning": (["fine", "fine", "fine", "a CAPTCHA <b>wall</b>", None], pa.large_string())}  # fmt: skip
    write_asset(root, "judge_verdicts", run_id, verdicts, extra=extra if newer_columns else None)
    write_asset(root, "failure_pool", run_id, [
        {"task_id": "ef", "stage": "execute", "reason": "backend_fail", "attempt": 1, "run_id": run_id},
        {"task_id": "jf", "stage": "judge", "reason": "judge_fail", "attempt": 1, "run_id": run_id}])  # fmt: skip
    write_asset(root, "batch_rejects", run_id, [{"file": "tasks.jsonl", "line": 9, "message": "tasks.jsonl:9: not JSON",
                                            "raw": "{oops", "run_id": run_id}])  # fmt: skip
    if not committed:
        return
    write_asset(root, "kept", run_id, verdicts[:1], schema_of="judge_verdicts")
    write_asset(root, "surplus", run_id, [verdicts[1] | {"dropped": "duplicate", "dup_of_run_id": "r0", "dup_of_task_id": "t0"},
                                     verdicts[2] | {"dropped": "site_cap"}])  # fmt: skip
    write_asset(root, "prior_kept_counts", run_id, [{"macro": "m", "site": "s-c", "n_kept": 1}])
    written = {a: root / "warehouse" / a / f"{run_id}.parquet" for a in ("kept", "surplus", "prior_kept_counts")}
    files = {a: file_entry(UPath(str(root)), UPath(str(p)), p.read_bytes(), 1) for a, p in written.items()}
    write_commit(UPath(str(root / "warehouse")), CommitRecord(
        run_id=run_id, walked_at="2026-12-01T00:00:00+00:00", files=files, kept_keys=1,
        caps={"per_site_cap": 3, "caps": {"m": {"site_cap": 1}}}, caps_source="deployment", judge={"kind": "gate"},
        history={}, inputs={}, unjudged=1))  # fmt: skip


def refused_batch(root: Path) -> Warehouse:
    """Batch r5 of one task, without executions.jsonl: the judge step refuses it."""
    from filter_pipeline_tests.builders import task, write_batch

    write_batch(root, "r5", [task("a")], [])
    (root / "runs" / "r5" / "executions.jsonl").unlink()
    return Warehouse(UPath(str(root)))
