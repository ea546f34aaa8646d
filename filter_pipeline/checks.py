"""Invariants checked on every materialization ("nothing lost, nothing let in"), as pure functions.

Each returns a `CheckOutcome`: whether it held, and figures for the asset check's metadata. The assets
turn them into blocking Dagster asset checks.
"""

from dataclasses import dataclass

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from filter_pipeline import rules
from filter_pipeline.batch import EXECUTIONS_FILE
from filter_pipeline.schemas import STAGE_EXECUTE, STATUS_ERROR, STATUS_JUDGED, isin


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    metadata: dict
    description: str


def attempts_conserved(
    records_in_file: int, attempts: pd.DataFrame, rejects: pd.DataFrame, judged: pd.DataFrame
) -> CheckOutcome:
    """Every record of executions.jsonl is exactly one of: an execute failure, the judged attempt of its task,
    an ok attempt superseded by a later one, or a reject."""
    failed = int((attempts["ok"] == False).sum())  # noqa: E712
    superseded = rules.superseded_ok_attempts(attempts, judged)
    rejected = int((rejects["file"] == EXECUTIONS_FILE).sum())
    accounted = failed + len(judged) + superseded + rejected
    return CheckOutcome(
        passed=accounted == records_in_file and superseded >= 0,
        metadata={
            "records": records_in_file, "execute_failures": failed, "judged": len(judged),
            "superseded_ok_attempts": superseded, "rejected": rejected,
        },  # fmt: skip
        description=f"{accounted} of {records_in_file} attempt records accounted for",
    )


def _sorted_ids(frame: pd.DataFrame) -> pa.Table:
    table = pa.table({"task_id": pa.array(frame["task_id"].astype("str"), pa.string()), "attempt": pa.array(frame["attempt"], pa.int64())})
    return table.sort_by([("task_id", "ascending"), ("attempt", "ascending")])


def _same_rows_once(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two (task_id, attempt) frames hold the same rows, each exactly once (False: look closer)."""
    if len(a) != len(b):
        return False
    sorted_a, sorted_b = _sorted_ids(a), _sorted_ids(b)
    if not sorted_a.equals(sorted_b):
        return False
    if len(sorted_a) < 2:
        return True
    neighbour = [pc.equal(sorted_a[c].slice(1), sorted_a[c].slice(0, len(sorted_a) - 1)) for c in ("task_id", "attempt")]
    return not pc.any(pc.and_(*neighbour)).as_py()


def execute_rows_match_failed_attempts(pool: pd.DataFrame, attempts: pd.DataFrame) -> CheckOutcome:
    """The failure pool's execute rows are exactly the batch's failed attempts, once each."""
    ids = ["task_id", "attempt"]
    execute = pool.loc[pool["stage"] == STAGE_EXECUTE, ids]
    failed = attempts.loc[attempts["ok"] == False, ids]  # noqa: E712
    if _same_rows_once(execute, failed):  # the usual case, settled by sorting each side once
        missing = extra = twice = 0
    else:
        twice = int(execute.duplicated().sum())
        joined = execute.drop_duplicates().merge(failed.drop_duplicates(), on=ids, how="outer", indicator=True)
        missing = int((joined["_merge"] == "right_only").sum())
        extra = int((joined["_merge"] == "left_only").sum())
    return CheckOutcome(
        passed=not missing and not extra and twice == 0,
        metadata={"execute_rows": len(execute), "failed_attempts": len(failed), "missing": missing,
                  "unexpected": extra, "duplicated": twice},  # fmt: skip
        description="execute rows match failed attempts" if not (missing or extra or twice) else
        f"{missing} failed attempts missing, {extra} unexpected rows, {twice} duplicated",
    )  # fmt: skip


def verdicts_conserved(verdicts: pd.DataFrame, kept: pd.DataFrame, surplus: pd.DataFrame) -> CheckOutcome:
    """Every verdict is exactly one of kept, surplus, judge failure, or unjudged."""
    judged = verdicts["status"] == STATUS_JUDGED
    failed = int((judged & (verdicts["passed"] == False)).sum())  # noqa: E712
    unjudged = int((verdicts["status"] == STATUS_ERROR).sum())
    places = pd.concat([kept["task_id"], surplus["task_id"]], ignore_index=True)
    walked = verdicts.loc[judged & (verdicts["passed"] == True), "task_id"]  # noqa: E712
    passed = (
        len(kept) + len(surplus) + failed + unjudged == len(verdicts)
        and places.is_unique
        and len(places) == len(walked)
        and bool(isin(places, walked).all())
    )
    return CheckOutcome(
        passed=bool(passed),
        metadata={"verdicts": len(verdicts), "kept": len(kept), "surplus": len(surplus),
                  "judge_failures": failed, "unjudged": unjudged},  # fmt: skip
        description="each verdict is kept, surplus, a judge failure or unjudged, once",
    )


def no_key_kept_twice(kept: pd.DataFrame, kept_elsewhere: pd.DataFrame) -> CheckOutcome:
    """No key of this run's kept rows is kept twice: not within the run, not by any other non-retired run.

    `kept_elsewhere`: other runs' non-retired kept rows whose key is among this run's (the ledger step's prior
    index: it holds every earlier keeper of any key the batch carries).
    """
    within = int(kept["dedup_key"].duplicated().sum())
    across = int(isin(kept["dedup_key"], kept_elsewhere["dedup_key"]).sum())
    return CheckOutcome(
        passed=within == 0 and across == 0,
        metadata={"kept": len(kept), "duplicated_within_run": within, "kept_by_another_run": across},
        description=f"{within} keys kept twice in this run, {across} kept by another run",
    )


def caps_respected(kept: pd.DataFrame, prior_counts: pd.DataFrame, caps: rules.Caps) -> CheckOutcome:
    """Where this run kept rows, no (macro, site) count and no macro total exceeds its cap, history included."""
    new = kept.groupby(["macro", "site"]).size().rename("new").reset_index()
    totals = new.merge(prior_counts, on=["macro", "site"], how="left").fillna({"n_kept": 0})
    totals["total"] = totals["new"] + totals["n_kept"].astype(int)
    totals["cap"] = totals["macro"].map({m: caps.site_cap(m) for m in totals["macro"].unique()}).astype(int)
    over = totals[totals["total"] > totals["cap"]]
    over_site = [f"{m}/{s}: {t} > {c}" for m, s, t, c in zip(over["macro"], over["site"], over["total"], over["cap"])]
    macro_prior = prior_counts.groupby("macro")["n_kept"].sum()
    over_target = []
    for macro, added in new.groupby("macro")["new"].sum().items():
        target = caps.target(macro)
        total = int(added + macro_prior.get(macro, 0))
        if target is not None and total > target:
            over_target.append(f"{macro}: {total} > {target}")
    return CheckOutcome(
        passed=not over_site and not over_target,
        metadata={"over_site_cap": len(over_site), "over_target": len(over_target)},
        description="; ".join(over_site + over_target) or "every cap respected",
    )
