"""Invariants checked on every materialization ("nothing lost, nothing let in"), as pure functions.

Each returns a `CheckOutcome`: whether it held, and figures for the asset check's metadata. The assets
turn them into blocking Dagster asset checks.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from filter_pipeline.rules import filtering
from filter_pipeline.rules.batch import EXECUTIONS_FILE
from filter_pipeline.rules.schemas import isin
from filter_pipeline.rules.vocabulary import STAGE_EXECUTE, STATUS_JUDGED


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
    superseded = filtering.superseded_ok_attempts(attempts, judged)
    rejected = int((rejects["file"] == EXECUTIONS_FILE).sum())
    accounted = failed + len(judged) + superseded + rejected
    return CheckOutcome(
        passed=accounted == records_in_file and superseded >= 0,
        metadata={
            "records": records_in_file,
            "execute_failures": failed,
            "judged": len(judged),
            "superseded_ok_attempts": superseded,
            "rejected": rejected,
        },  # fmt: skip
        description=f"{accounted} of {records_in_file} attempt records accounted for",
    )


def codes(*columns: pd.Series) -> list[np.ndarray]:
    """Each text column as integers, one per row: equal across all the columns exactly where the texts are
    equal (one Arrow dictionary over them all; comparing integers is far cheaper than comparing text)."""
    arrays = [pa.array(c.astype("str"), type=pa.string()) for c in columns]
    chunks = [chunk for a in arrays for chunk in (a.chunks if isinstance(a, pa.ChunkedArray) else [a])]
    # one hash table across the chunks: a text gets the same index wherever it appears
    encoded = pa.chunked_array(chunks, pa.string()).dictionary_encode()
    indices = [c.indices.to_numpy(zero_copy_only=False).astype(np.int64) for c in encoded.chunks]
    return np.split(np.concatenate([np.zeros(0, np.int64), *indices]), np.cumsum([len(a) for a in arrays])[:-1])


def _sorted_pairs(task: np.ndarray, attempt: pd.Series) -> np.ndarray:
    numbers = attempt.to_numpy(dtype=np.int64)
    order = np.lexsort((numbers, task))
    return np.column_stack([task[order], numbers[order]])


def _same_rows_once(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two (task_id, attempt) frames hold the same rows, each exactly once (False: look closer)."""
    if len(a) != len(b):
        return False
    task_a, task_b = codes(a["task_id"], b["task_id"])
    sorted_a, sorted_b = _sorted_pairs(task_a, a["attempt"]), _sorted_pairs(task_b, b["attempt"])
    return np.array_equal(sorted_a, sorted_b) and not (sorted_a[1:] == sorted_a[:-1]).all(axis=1).any()


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
    unjudged = filtering.unjudged_count(verdicts)
    places, walked = codes(
        pd.concat([kept["task_id"], surplus["task_id"]], ignore_index=True),
        verdicts.loc[judged & (verdicts["passed"] == True), "task_id"],  # noqa: E712
    )
    places.sort()
    walked.sort()
    passed = (
        len(kept) + len(surplus) + failed + unjudged == len(verdicts)
        and not (places[1:] == places[:-1]).any()  # each place once
        and np.array_equal(places, walked)  # and exactly the passing verdicts
    )
    return CheckOutcome(
        passed=bool(passed),
        metadata={
            "verdicts": len(verdicts),
            "kept": len(kept),
            "surplus": len(surplus),
            "judge_failures": failed,
            "unjudged": unjudged,
        },  # fmt: skip
        description="each verdict is kept, surplus, a judge failure or unjudged, once",
    )


def no_key_kept_twice(kept: pd.DataFrame, kept_elsewhere: pd.DataFrame) -> CheckOutcome:
    """No key of this run's kept rows is kept twice: not within the run, not by any other non-retired run.

    `kept_elsewhere`: other runs' non-retired kept rows whose key is among this run's (the ledger step's prior
    index: it holds every earlier keeper of any key the batch carries).
    """
    # equal keys have equal hashes: only rows whose hash repeats need their text compared
    repeats = kept["key_hash"].duplicated(keep=False).to_numpy(dtype=bool) if "key_hash" in kept else slice(None)
    within = int(kept["dedup_key"][repeats].duplicated().sum())
    across = int(isin(kept["dedup_key"], kept_elsewhere["dedup_key"]).sum())
    return CheckOutcome(
        passed=within == 0 and across == 0,
        metadata={"kept": len(kept), "duplicated_within_run": within, "kept_by_another_run": across},
        description=f"{within} keys kept twice in this run, {across} kept by another run",
    )


def caps_respected(kept: pd.DataFrame, prior_counts: pd.DataFrame, caps: filtering.Caps) -> CheckOutcome:
    """Where this run kept rows, no (macro, site) count and no macro total exceeds its cap, history included."""
    pairs = pa.table({c: pa.array(kept[c].astype("str"), type=pa.string()) for c in ("macro", "site")})
    own = pairs.group_by(["macro", "site"]).aggregate([([], "count_all")]).rename_columns(["macro", "site", "n_kept"])
    sites, macros = filtering.over_caps(own.to_pandas(), prior_counts, caps)
    over_site = [
        f"{m}/{s}: {t} > {c}" for m, s, t, c in zip(sites["macro"], sites["site"], sites["total"], sites["limit"])
    ]
    over_target = [f"{m}: {t} > {c}" for m, t, c in zip(macros["macro"], macros["total"], macros["limit"])]
    return CheckOutcome(
        passed=not over_site and not over_target,
        metadata={"over_site_cap": len(over_site), "over_target": len(over_target)},
        description="; ".join(over_site + over_target) or "every cap respected",
    )
