"""DPO pairs: a kept trajectory (chosen) against a failed attempt of the same task that is a clean negative
(rejected). Pure pandas, no files."""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from filter_pipeline.rules.schemas import conform, positions
from filter_pipeline.rules.vocabulary import STAGE_JUDGE

EXCLUDED_BACKEND_OK = "backend_ok"  # reached the goal state although the script failed
EXCLUDED_BLOCKED = "blocked"  # the judge said the site, not the agent, prevented the task
EXCLUDED_JUDGE_GATE_PASSED = "judge_fail_gate_passed"  # the judge failed it but the backend gate passed it
_CHOSEN = ["task_id", "macro", "site", "instruction", "dir", "attempt", "n_actions", "run_id"]
_REJECTED = ["task_id", "dir", "attempt", "n_actions", "stage", "reason", "detail"]


@dataclass(frozen=True)
class Pairs:
    pairs: pd.DataFrame  # columns of schemas.SCHEMAS["dpo_pairs"], kept (task) order, then pool order
    kept_without_negative: int  # kept tasks with no clean negative
    excluded: dict[str, int]  # negatives left out, per reason


def dpo_pairs(kept: pd.DataFrame, failure_pool: pd.DataFrame, include_judge_failures: bool = False) -> Pairs:
    """One pair per (kept task, clean failed attempt of that task).

    A failure-pool row is not a clean negative when its backend gate passed (`backend_ok`), when the judge
    found it `blocked` (the site prevented the task: the agent did nothing wrong; never paired, whatever the
    config), or when it is a judge failure (its attempt was ok, so the gate passed it) unless
    `include_judge_failures`. Unjudged tasks are never in the pool, so never a negative. (A pipeline's pool holds
    a judge failure only for a task whose one verdict failed, which is never kept: such rows pair only in a pool
    and kept rows put together otherwise.)
    """
    kept_at = positions(failure_pool["task_id"], kept["task_id"])
    of_kept = kept_at >= 0
    backend_ok = (failure_pool["backend_ok"] == True).fillna(False).to_numpy(dtype=bool) & of_kept  # noqa: E712
    blocked = (
        (failure_pool["blocked"] == True).fillna(False).to_numpy(dtype=bool) & of_kept & ~backend_ok  # noqa: E712
        if "blocked" in failure_pool  # (a pool written before the judge said so)
        else np.zeros(len(failure_pool), dtype=bool)
    )
    judge_row = (failure_pool["stage"] == STAGE_JUDGE).to_numpy(dtype=bool) & of_kept & ~blocked
    gate_passed_judge = judge_row & (not include_judge_failures)
    clean = np.flatnonzero(of_kept & ~backend_ok & ~blocked & ~gate_passed_judge)  # pool rows, in pool order
    clean_at = kept_at[clean]  # the kept row of each
    # pairs in kept (task) order, then pool order: each clean row beside the kept row of its task (rows are
    # picked by position, one take per column: filtering the frames first would copy every column again)
    order = np.argsort(clean_at, kind="stable")
    chosen = (
        kept[_CHOSEN]
        .iloc[clean_at[order]]
        .reset_index(drop=True)
        .rename(columns={"dir": "chosen_dir", "attempt": "chosen_attempt", "n_actions": "chosen_n_actions"})
    )
    rejected = failure_pool[_REJECTED].iloc[clean[order]].reset_index(drop=True).rename(
        columns={
            "dir": "rejected_dir", "attempt": "rejected_attempt", "n_actions": "rejected_n_actions",
            "stage": "rejected_stage", "reason": "rejected_reason", "detail": "rejected_detail",
        }
    )  # fmt: skip
    pairs = pd.concat([chosen, rejected.drop(columns=["task_id"])], axis=1)
    has_negative = np.zeros(len(kept), dtype=bool)
    has_negative[clean_at] = True
    return Pairs(
        pairs=conform(pairs, "dpo_pairs"),
        kept_without_negative=int((~has_negative).sum()),
        excluded={
            EXCLUDED_BACKEND_OK: int(backend_ok.sum()),
            EXCLUDED_BLOCKED: int(blocked.sum()),
            EXCLUDED_JUDGE_GATE_PASSED: int(gate_passed_judge.sum()),
        },
    )
