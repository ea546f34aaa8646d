"""A task's fate and a run's line on the runs page, derived from the run's tables as the warehouse holds them:
frames in, frames out (`data.py` reads the files)."""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from upath import UPath

from filter_pipeline.rules.batch import TASKS_FILE
from filter_pipeline.rules.history import Retired
from filter_pipeline.rules.records import json_text, read_json
from filter_pipeline.rules.schemas import isin, positions
from filter_pipeline.rules.vocabulary import (
    DROPPED_REASONS,
    REASON_JUDGE_FAIL,
    STAGE_EXECUTE,
    STAGE_JUDGE,
    STATUS_ERROR,
    STATUS_JUDGED,
)

# A task's fate, in the words of the outputs
FATE_KEPT = "kept"
FATE_SURPLUS = "surplus"  # reason: duplicate / site_cap / target
FATE_JUDGE_FAIL = REASON_JUDGE_FAIL
FATE_UNJUDGED = "unjudged"  # the judge could not judge it (judge_verdicts status error)
FATE_EXECUTE_FAIL = "execute_fail"  # every attempt failed: execute failures only, never judged
REASON_RETIRED = "retired"  # a kept row retired.json retires: it no longer counts for dedup or caps
REASON_NO_ATTEMPT = "no_attempt"  # an execute_fail's reason when executions.jsonl holds no attempt of the task
FATE_REJECT = "reject"  # its line in tasks.jsonl was unusable (batch_rejects)
FATE_PENDING = "pending"  # judged and passed in a run whose walk is not committed yet, or any task of a run
# whose judge step has not written its verdicts yet (nothing of it is decided)
FATES = (FATE_KEPT, FATE_SURPLUS, FATE_JUDGE_FAIL, FATE_UNJUDGED, FATE_EXECUTE_FAIL, FATE_REJECT, FATE_PENDING)

STATE_COMMITTED = "committed"
STATE_UNJUDGED = "unjudged"  # committed, with tasks left unjudged (judged again later)
STATE_PENDING = "pending"  # complete batch not committed yet
STATE_INCOMPLETE = "incomplete"  # batch folder without _SUCCESS: the harness is still writing it
STATE_LEGACY = "legacy"  # filtered by the earlier script (kept.jsonl)
# a complete batch the stage refused before its walk (warehouse/_failed/<run_id>.json): not filtered until corrected
STATE_FAILED = "failed"
STATE_UNREADABLE = "unreadable"  # a file of the run cannot be read (the runs page and the queue go on without it)

TASK_COLUMNS = ["task_id", "fate", "reason", "site", "macro", "instruction"]
# where each fate leaves the task's rows, in the outputs' words (the task page and `explain` say it)
FATE_WHERE = {
    FATE_KEPT: "its judged attempt is a row of kept (training data)",
    FATE_SURPLUS: "its judged attempt is a row of surplus (valid, dropped by dedup or a cap)",
    FATE_JUDGE_FAIL: "its judged attempt is a row of failure_pool (stage judge)",
    FATE_UNJUDGED: "no row yet: the judge that judged the rest of the run is asked again later",
    FATE_EXECUTE_FAIL: "its attempts are rows of failure_pool (stage execute)",
    FATE_REJECT: "its line is a batch_rejects row",
    FATE_PENDING: "not decided yet: the run is not walked (or not judged) yet",
}
NO_ATTEMPT_WHERE = "no row: executions.jsonl holds no valid attempt of it (a rejected line is a batch_rejects row)"


def fate_where(fate: str, reason: str | None) -> str | None:
    """Where the task's rows are, in the outputs' words (`FATE_WHERE`; a task never executed has none)."""
    return NO_ATTEMPT_WHERE if fate == FATE_EXECUTE_FAIL and reason == REASON_NO_ATTEMPT else FATE_WHERE.get(fate)


@dataclass
class RunTables:
    """Everything the warehouse holds about one run, read once."""

    run_id: str
    commit: dict | None  # the commit record as JSON, None when the run is not committed
    tasks: pd.DataFrame  # TASK_COLUMNS + dedup_key, plus reject rows
    attempts: pd.DataFrame
    verdicts: pd.DataFrame
    judged: bool  # the run's judge_verdicts file exists
    surplus: pd.DataFrame
    failure_pool: pd.DataFrame
    rejects: pd.DataFrame
    dpo_pairs: pd.DataFrame
    prior_counts: pd.DataFrame  # prior_kept_counts: history's kept rows per (macro, site) when the run was walked
    legacy: UPath | None = None  # kept.jsonl of a run filtered by the earlier script
    complete: bool = True  # False: its batch folder lacks _SUCCESS (the harness is still writing it)
    retired: Retired = field(default_factory=Retired)  # retired.json (its kept rows show reason `retired`)
    failure: str | None = None  # why the stage refused the batch, when it did and has not walked it since
    summary: dict = field(default_factory=dict)


def _by_task(table: pd.DataFrame, column: str, ids: pd.Series) -> pd.Series:
    """`table[column]` looked up by task_id for each of `ids`, <NA> when none: the row of a task's highest
    attempt wins (its last row in a table without attempts)."""
    if table.empty or column not in table.columns:
        return pd.Series([pd.NA] * len(ids), index=ids.index, dtype="object")
    if "attempt" in table.columns:
        table = table.sort_values("attempt", kind="stable")
    last = table.drop_duplicates("task_id", keep="last")
    found = positions(ids, last["task_id"])  # (an Arrow hash lookup: a pandas reindex on text is slower)
    values = last[column].astype("object").to_numpy()
    return pd.Series(np.where(found >= 0, values[np.maximum(found, 0)], None), index=ids.index, dtype="object")


def task_table(t: RunTables, kept_ids: pd.Series, legacy: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per task: TASK_COLUMNS + dedup_key; tasks.jsonl rejects appended with fate `reject`, and the
    `legacy` rows (a run filtered by the earlier script: its kept.jsonl) with theirs."""
    tasks = t.tasks.reset_index(drop=True)
    ids = tasks["task_id"]
    committed = is_committed(t)
    status = _by_task(t.verdicts, "status", ids)
    dropped = _by_task(t.surplus, "dropped", ids)
    pool = t.failure_pool
    judge_rows = pool[pool["stage"] == STAGE_JUDGE] if "stage" in pool else pool.iloc[:0]
    execute_rows = pool[pool["stage"] == STAGE_EXECUTE] if "stage" in pool else pool.iloc[:0]
    judge_failed = _by_task(judge_rows, "reason", ids).notna().to_numpy()
    kept = isin(ids, kept_ids) if committed else np.zeros(len(ids), bool)
    in_surplus = dropped.notna().to_numpy() & committed
    conditions = [kept, in_surplus, judge_failed, (status == STATUS_ERROR).fillna(False).to_numpy(bool),
                  status.notna().to_numpy()]  # fmt: skip
    fate = np.select(conditions, [FATE_KEPT, FATE_SURPLUS, FATE_JUDGE_FAIL, FATE_UNJUDGED, FATE_PENDING],
                     default=FATE_EXECUTE_FAIL)  # fmt: skip
    reason = np.where(in_surplus, dropped.astype("object").to_numpy(), None)
    reason = np.where(judge_failed & ~in_surplus & ~kept, REASON_JUDGE_FAIL, reason)
    executed = isin(ids, t.attempts["task_id"])
    execute_reason = np.where(executed, _by_task(execute_rows, "reason", ids).to_numpy(), REASON_NO_ATTEMPT)
    reason = np.where(fate == FATE_EXECUTE_FAIL, execute_reason, reason)
    if not t.judged:  # (the judge step has not written its verdicts, nor the failure pool: nothing is decided)
        fate, reason = np.full(len(ids), FATE_PENDING, dtype=object), np.full(len(ids), None)
    table = tasks.assign(fate=fate, reason=reason)
    parts = [table, _rejected_tasks(t.rejects, set(ids)), legacy if legacy is not None else table.iloc[:0]]
    table = pd.concat([p for p in parts if len(p)] or [table], ignore_index=True)
    retired = t.run_id in t.retired.runs or table["task_id"].isin(t.retired.tasks.get(t.run_id, ()))
    table.loc[(table["fate"] == FATE_KEPT) & retired, "reason"] = REASON_RETIRED
    reason = table["reason"].astype("object")  # (None, not NaN, where a task has no reason)
    return table[[*TASK_COLUMNS, "dedup_key"]].assign(reason=reason.where(reason.notna(), None))


def _rejected_tasks(rejects: pd.DataFrame, valid: set) -> pd.DataFrame:
    """The unusable lines of tasks.jsonl as task rows (fate reject), with what the raw line says of the task; a
    line naming no task_id, one of a `valid` task (a second line of it) or one an earlier rejected line named, is
    named `tasks.jsonl:<line>`: each row's name opens its own story."""
    rows, named_before = [], set(valid)
    for record in rejects[rejects["file"] == TASKS_FILE].to_dict("records") if "file" in rejects else []:
        try:
            raw = read_json(record.get("raw") or "")  # (a line rejected for an over-long integer still names its task)
        except ValueError:
            raw = None
        raw = raw if isinstance(raw, dict) else {}
        named = json_text(raw.get("task_id"))
        named = None if named in named_before else named
        named_before.add(named)
        rows.append({"task_id": named or f"{TASKS_FILE}:{record['line']}", "fate": FATE_REJECT,
                     "reason": record.get("message"), "site": json_text(raw.get("site")),
                     "macro": json_text(raw.get("macro")), "instruction": json_text(raw.get("instruction"))})  # fmt: skip
    return pd.DataFrame(rows, columns=[*TASK_COLUMNS, "dedup_key"])


def is_committed(t: RunTables) -> bool:
    """Whether the run's walk is committed: its commit record is there and can be read."""
    return t.commit is not None and "error" not in t.commit


def summarize(t: RunTables) -> dict:
    """The run's line on the runs page: state, funnel, rates, blocked attempts and cost."""
    fates = t.tasks["fate"].value_counts().to_dict()
    verdicts = t.verdicts
    judged = verdicts[verdicts["status"] == STATUS_JUDGED] if "status" in verdicts else verdicts.iloc[:0]
    passed = int(judged["passed"].fillna(False).astype(bool).sum()) if "passed" in judged else 0
    # (a run the earlier script filtered is known by its kept rows alone: how many tasks it had is not known)
    legacy = t.legacy and t.commit is None
    committed = is_committed(t)
    n_tasks = None if legacy else int(len(t.tasks) - fates.get(FATE_REJECT, 0))
    blocked = int(verdicts["blocked"].fillna(False).astype(bool).sum()) if "blocked" in verdicts else None
    cost = verdicts["cost"].dropna() if "cost" in verdicts else pd.Series(dtype=float)
    summary = {
        "run_id": t.run_id,
        "state": run_state(t, fates),
        "walked_at": (t.commit or {}).get("walked_at"),
        "tasks": n_tasks,
        "attempts": int(len(t.attempts)),
        "rejects": int(len(t.rejects)),
        "with_ok_attempt": with_ok_attempt(t),
        "judged": int(len(judged)),
        "passed": passed,
        **{fate: int(fates.get(fate, 0)) for fate in FATES},
        # (only a walk's commit decides what is kept and dropped: a run not committed yet, or whose commit record
        # cannot be read, has no keep rate, and its surplus is counted as its fates are: none)
        "surplus_by_reason": {
            r: int((t.surplus.get("dropped") == r).sum()) if committed else 0 for r in DROPPED_REASONS
        },
        "keep_rate": fates.get(FATE_KEPT, 0) / n_tasks if n_tasks and committed else None,
        "judge_pass_rate": passed / len(judged) if len(judged) else None,
        "blocked": blocked,
        "cost": float(cost.sum()) if len(cost) else None,
    }
    if legacy:  # (every figure but its kept rows is unknown, not 0)
        unknown = ["attempts", "rejects", "with_ok_attempt", "judged", "passed", *(f for f in FATES if f != FATE_KEPT)]
        summary.update(dict.fromkeys(unknown), surplus_by_reason={})
    return summary


def with_ok_attempt(t: RunTables) -> int:
    """How many tasks have an ok attempt: those the judge step gave a verdict, or before it ran, those the
    batch's attempts say (the judge step judges each of them)."""
    if t.judged or "ok" not in t.attempts:
        return int(len(t.verdicts))
    attempts = t.attempts
    return int(attempts.loc[attempts["ok"].fillna(False).astype(bool), "task_id"].nunique())


def unreadable_summary(run_id: str, reason: str) -> dict:
    """The runs page's line of a run whose files cannot be read: why, in one line, and no figures (its own page
    answers 500 with the same reason)."""
    return {"run_id": run_id, "state": f"{STATE_UNREADABLE} ({reason})", "walked_at": None, "tasks": None,
            "attempts": None, "rejects": None, "with_ok_attempt": None, "judged": None, "passed": None,
            **dict.fromkeys(FATES), "surplus_by_reason": {}, "keep_rate": None, "judge_pass_rate": None,
            "blocked": None, "cost": None}  # fmt: skip


def run_state(t: RunTables, fates: dict) -> str:
    if t.commit is None:
        if t.legacy:
            return STATE_LEGACY
        if t.failure is not None:
            return f"{STATE_FAILED} ({t.failure})"
        return STATE_PENDING if t.complete else STATE_INCOMPLETE
    if "error" in t.commit:
        return f"{STATE_PENDING} (unreadable commit record)"
    return STATE_UNJUDGED if fates.get(FATE_UNJUDGED, 0) else STATE_COMMITTED
