"""The filter rules of CONTRACT §3 as plain pandas functions: no Dagster, no IO.

Each function takes and returns frames with the columns named in `schemas.py` and keeps row order
meaningful: tasks in `tasks.jsonl` order, attempts in `executions.jsonl` order.
"""

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from filter_pipeline.rules.schemas import (
    DEFAULT_PER_SITE_CAP,
    DETAIL_MAX_CHARS,
    SCHEMAS,
    STR,
    conform,
    positions,
    pylist,
)
from filter_pipeline.rules.vocabulary import (
    BELOW_MIN_SCORE_DETAIL,
    DROPPED_DUPLICATE,
    DROPPED_SITE_CAP,
    DROPPED_TARGET,
    ERROR_PREFIX_REASONS,
    REASON_JUDGE_FAIL,
    REASON_SCRIPT_ERROR,
    REASON_UNKNOWN,
    STAGE_EXECUTE,
    STAGE_JUDGE,
    STATUS_ERROR,
    STATUS_JUDGED,
)

# --- §3.1 execute failures --------------------------------------------------------------------------


def _task_rows(tasks: pd.DataFrame, attempts: pd.DataFrame, task_at: np.ndarray | None, rows: np.ndarray):
    """The row in `tasks` of the task of each attempt picked by the boolean mask `rows` (-1: not a task);
    `task_at`: the row of every attempt's task, as the parse found it, or None to look them up."""
    if task_at is not None:
        return task_at[rows]
    return positions(attempts["task_id"][rows], tasks["task_id"])


def execute_failures(tasks: pd.DataFrame, attempts: pd.DataFrame, task_at: np.ndarray | None = None) -> pd.DataFrame:
    """One failure-pool row per attempt with `ok` false, in executions.jsonl order; `detail` is the error cut
    to DETAIL_MAX_CHARS, "" when the error is empty, null or absent (never null: CONTRACT §3.1). `task_at`:
    the row in `tasks` of each attempt's task (`Batch.task_at`), looked up when not given."""
    is_failed = (attempts["ok"] == False).to_numpy(dtype=bool, na_value=False)  # noqa: E712 - nullable bool
    # only the attempt columns a failure-pool row carries, and the error its reason and detail come from
    wanted = [c for c in attempts.columns if c in SCHEMAS["failure_pool"].names or c == "error"]
    failed = attempts[wanted][is_failed].reset_index(drop=True)
    at = _task_rows(tasks, attempts, task_at, is_failed)
    task_columns = tasks[["macro", "site", "instruction", "dedup_key"]].iloc[np.maximum(at, 0)].reset_index(drop=True)
    if (at < 0).any():  # an attempt of an unknown task (read_batch rejects those): no task columns
        task_columns.loc[at < 0, :] = None
    rows = pd.concat([failed, task_columns], axis=1)
    return conform(
        rows.assign(
            stage=STAGE_EXECUTE,
            reason=failure_reasons(rows["error"]),
            detail=rows["error"].fillna("").str.slice(0, DETAIL_MAX_CHARS),
            votes=None,
        ),
        "failure_pool",
    )


def failure_reasons(errors: pd.Series) -> pd.Series:
    """The failure-pool reason of each error text (same index): its case-sensitive prefix
    (ERROR_PREFIX_REASONS), script_error for any other non-empty text, unknown for empty or missing."""
    errors = errors.astype("str")  # nulls stay missing
    empty = errors.isna() | (errors == "")
    conditions = [empty] + [errors.str.startswith(prefix).fillna(False) for prefix, _ in ERROR_PREFIX_REASONS]
    reasons = pa.array([REASON_UNKNOWN, *(reason for _, reason in ERROR_PREFIX_REASONS), REASON_SCRIPT_ERROR], STR)
    # each row's reason as a position in `reasons`, taken by Arrow: no Python or numpy text per row
    codes = np.select([c.to_numpy(dtype=bool) for c in conditions], range(len(conditions)), default=len(conditions))
    return pd.Series(pc.take(reasons, pa.array(codes, pa.int8())).to_pandas().array, index=errors.index)


# --- §3.2 what gets judged --------------------------------------------------------------------------


def attempts_to_judge(tasks: pd.DataFrame, attempts: pd.DataFrame, task_at: np.ndarray | None = None) -> pd.DataFrame:
    """For each task (tasks.jsonl order) with an ok attempt, the ok attempt with the highest number.

    Columns: the task's (every column of `tasks` but line: task_id, macro, site, dedup_key, key_hash,
    start_kind, instruction, and run_id when it has one) and the attempt's
    (attempt, dir, n_actions, backend_ok, backend_detail, attempt_line: its line in executions.jsonl).
    `task_at`: the row in `tasks` of each attempt's task (`Batch.task_at`), looked up when not given.
    """
    is_ok = (attempts["ok"] == True).to_numpy(dtype=bool, na_value=False)  # noqa: E712 - nullable bool
    ok_rows = np.flatnonzero(is_ok)
    task_at = _task_rows(tasks, attempts, task_at, is_ok)
    # by (task position, attempt number), stable: the last row of each task is its highest ok attempt (the
    # later line if a number repeats), and tasks come out in tasks.jsonl order
    order = np.lexsort((attempts["attempt"].iloc[ok_rows].to_numpy(dtype=np.int64), task_at))
    order = order[task_at[order] >= 0]  # an attempt of an unknown task is judged for nobody
    last = order[np.append(task_at[order][1:] != task_at[order][:-1], True)] if len(order) else order
    picked_tasks = tasks.drop(columns=["line"], errors="ignore").iloc[task_at[last]].reset_index(drop=True)
    # the picked rows taken once, and only the columns wanted (not every ok attempt's every column first)
    picked_attempts = attempts[["attempt", "dir", "n_actions", "backend_ok", "backend_detail", "line"]].iloc[
        ok_rows[last]
    ]
    return pd.concat(
        [picked_tasks, picked_attempts.rename(columns={"line": "attempt_line"}).reset_index(drop=True)], axis=1
    )


def superseded_ok_attempts(attempts: pd.DataFrame, judged: pd.DataFrame) -> int:
    """How many ok attempts were not judged because a later ok attempt of the same task was
    (`judged`: one row per judged attempt, e.g. the verdicts)."""
    return int((attempts["ok"] == True).sum()) - len(judged)  # noqa: E712


# --- §3.4 judge failures ----------------------------------------------------------------------------


def judge_failures(verdicts: pd.DataFrame) -> pd.DataFrame:
    """One failure-pool row per judged verdict that did not pass, in task order.

    Unjudged verdicts (status error) are not failures: they are judged again later.
    """
    failed = verdicts[(verdicts["status"] == STATUS_JUDGED) & (verdicts["passed"] == False)]  # noqa: E712
    return conform(
        failed.assign(stage=STAGE_JUDGE, reason=REASON_JUDGE_FAIL, detail=_judge_detail(failed), backend_ok=None),
        "failure_pool",
    )


def unjudged_count(verdicts: pd.DataFrame) -> int:
    """How many verdicts are unjudged (status error): neither kept nor failures, asked again by a later
    materialization."""
    return int((verdicts["status"] == STATUS_ERROR).sum())


def _judge_detail(failed: pd.DataFrame) -> list:
    """The why of each failed verdict; one the model passed (judge_passed) failed by FILTER_JUDGE_MIN_SCORE says so."""
    model_passed = failed["judge_passed"] if "judge_passed" in failed else pd.Series(False, index=failed.index)
    return [
        BELOW_MIN_SCORE_DETAIL.format(score=int(score), why=why) if passed is True and pd.notna(score) else why
        for passed, score, why in zip(
            model_passed.astype(object).tolist(), failed.get("score", model_passed).tolist(), failed["why"].tolist()
        )
    ]


# --- §3.6 the ledger walk ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MacroLimits:
    site_cap: int | None = None  # None: the run's per_site_cap
    target: int | None = None  # None: no per-macro target


@dataclass(frozen=True)
class Caps:
    per_site_cap: int
    macros: dict[str, MacroLimits] = field(default_factory=dict)

    @classmethod
    def recorded(cls, raw: dict | None) -> "Caps":
        """The caps as a commit record's `caps` field holds them (a macro's null `site_cap`: the per-site cap)."""
        raw = raw or {}
        macros = {
            m: MacroLimits(site_cap=c.get("site_cap"), target=c.get("target"))
            for m, c in (raw.get("caps") or {}).items()
        }
        return cls(per_site_cap=raw.get("per_site_cap", DEFAULT_PER_SITE_CAP), macros=macros)

    def site_cap(self, macro: str) -> int:
        limits = self.macros.get(macro)
        return limits.site_cap if limits is not None and limits.site_cap is not None else self.per_site_cap

    def target(self, macro: str) -> int | None:
        limits = self.macros.get(macro)
        return limits.target if limits is not None else None

    def site_caps(self, macros) -> np.ndarray:
        """The site cap of each row's macro, looked up once per distinct macro."""
        codes, names = pd.factorize(macros, use_na_sentinel=False)
        return np.array([self.site_cap(m) for m in names], dtype=np.int64)[codes]

    def targets(self, macros) -> pd.arrays.IntegerArray:
        """The target of each row's macro (<NA>: the macro has none)."""
        codes, names = pd.factorize(macros, use_na_sentinel=False)
        return pd.array([self.target(m) for m in names], dtype="Int64")[codes]

    def targeted(self) -> list[str]:
        """The macros that have a target, by name."""
        return sorted(m for m, limits in self.macros.items() if limits.target is not None)


def over_caps(own: pd.DataFrame, prior: pd.DataFrame, caps: Caps) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Where `own` kept rows (macro, site, n_kept: one row per pair), what breaks a cap with `prior` (the same
    columns: history's kept rows) counted in: `caps_broken` of own's pairs with history's count of each. The
    one rule for "over its cap" of the ledger's check and of `verify`."""
    # Arrow's hash join (pandas' merge on two text keys costs several times more), on 32-bit-offset strings,
    # which its join hashes faster than large ones
    keys = ["macro", "site"]
    history = pa.table({c: pa.array(prior[c].astype("str"), type=pa.string()) for c in keys})
    history = history.append_column("prior", pa.array(prior["n_kept"].to_numpy(dtype=np.int64)))
    mine = pa.table({**{c: pa.array(own[c].astype("str"), type=pa.string()) for c in keys},
                     "n_kept": pa.array(own["n_kept"].to_numpy(dtype=np.int64))})  # fmt: skip
    pairs = mine.join(history, keys=keys, join_type="left outer").to_pandas()
    pairs["prior"] = pairs["prior"].fillna(0).astype(np.int64)
    return caps_broken(pairs, prior.groupby("macro")["n_kept"].sum(), caps)


def caps_broken(pairs: pd.DataFrame, prior_by_macro: pd.Series, caps: Caps) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What breaks a cap where a run kept rows: `pairs` holds one row per (macro, site) it kept rows in, with
    their number (n_kept) and history's (prior); `prior_by_macro`, history's kept rows per macro (a macro not
    there: none). The pairs whose kept rows exceed their site cap, as (macro, site, total, limit), sorted, and
    the macros whose kept rows over all their sites exceed their target, as (macro, total, limit)."""
    pairs = pairs.assign(total=pairs["n_kept"] + pairs["prior"], limit=caps.site_caps(pairs["macro"]))
    over_site = pairs.loc[pairs["total"] > pairs["limit"], ["macro", "site", "total", "limit"]]

    with_target = sorted(set(caps.targeted()) & set(pairs["macro"].unique()))
    total = pairs.groupby("macro")["n_kept"].sum().reindex(with_target, fill_value=0) + prior_by_macro.reindex(
        with_target, fill_value=0
    )
    macros = pd.DataFrame({"macro": pd.Series(with_target, dtype="str"), "total": np.asarray(total, dtype=np.int64)})
    macros["limit"] = caps.targets(macros["macro"])
    over_target = macros[macros["total"] > macros["limit"]]
    return over_site.sort_values(["macro", "site"]).reset_index(drop=True), over_target.reset_index(drop=True)


@dataclass(frozen=True)
class LedgerResult:
    kept: pd.DataFrame  # the verdict columns
    surplus: pd.DataFrame  # the verdict columns + dropped, dup_of_run_id, dup_of_task_id


def walk_ledger(
    verdicts: pd.DataFrame,
    prior_index: pd.DataFrame,
    prior_counts: pd.DataFrame,
    caps: Caps,
    run_id: str,
) -> LedgerResult:
    """The greedy walk of CONTRACT §3.6 over the passing verdicts, in task order.

    `prior_index` holds (dedup_key, run_id, task_id) of keys kept by other runs (at least every such key
    that appears in `verdicts`); `prior_counts` holds (macro, site, n_kept) over all of history. A verdict
    is a duplicate if its key was kept before (history or earlier in this walk), else dropped by its
    (macro, site) cap, else by its macro's target, else kept.

    Most verdicts cannot be dropped whatever comes before them: the first use of a key no other run kept,
    in a (macro, site) and a macro that stay within their limits even if every passing verdict in them were
    kept. Those are kept in bulk; only the others are walked one by one, in order, and see the bulk keeps
    as earlier keepers of their keys (a bulk keep is its key's first use, so it comes first). The result is
    the one-by-one walk's over all verdicts; each verdict costs O(1).
    """
    is_passing = (verdicts["status"] == STATUS_JUDGED) & (verdicts["passed"] == True)  # noqa: E712
    passing_at = np.flatnonzero(is_passing.to_numpy(dtype=bool, na_value=False))  # verdict rows, in order
    # only the columns the walk reads; the kept and surplus rows are taken from `verdicts` once, at the end
    passing = verdicts[["task_id", "macro", "site", "dedup_key"]].iloc[passing_at]
    keys = passing["dedup_key"]
    first_kept = prior_index.drop_duplicates("dedup_key", keep="first")  # provenance: the earliest keeper
    kept_before = positions(keys, first_kept["dedup_key"]) >= 0
    key_code, unique_keys = pd.factorize(keys)  # the texts are hashed once; the rest works on their codes
    repeated = np.bincount(key_code, minlength=len(unique_keys))[key_code] > 1
    later_use = pd.Series(key_code).duplicated(keep="first").to_numpy()
    groups = _Groups.of(passing, prior_counts, caps)
    bulk = groups.safe & ~later_use & ~kept_before

    task_ids = passing["task_id"]
    kept_by: dict[str, tuple[str, str]] = dict(
        zip(pylist(first_kept["dedup_key"]), zip(pylist(first_kept["run_id"]), pylist(first_kept["task_id"])))
    )
    seeds = bulk & repeated  # bulk keepers of a key that is used again
    kept_by.update(zip(pylist(keys[seeds]), ((run_id, t) for t in pylist(task_ids[seeds]))))
    walked = np.flatnonzero(~bulk)
    drops = groups.walk(walked, pylist(task_ids.iloc[walked]), pylist(keys.iloc[walked]), kept_by, run_id)

    dropped_at = [i for i, _, _ in drops]
    keep_mask = np.ones(len(passing), dtype=bool)
    keep_mask[dropped_at] = False
    surplus = verdicts.iloc[passing_at[dropped_at]].assign(
        dropped=[reason for _, reason, _ in drops],
        dup_of_run_id=[r for _, _, (r, _) in drops],
        dup_of_task_id=[t for _, _, (_, t) in drops],
    )
    kept_columns = [c for c in SCHEMAS["kept"].names if c in verdicts.columns]  # (conform adds any missing)
    kept = verdicts[kept_columns].iloc[passing_at[keep_mask]].reset_index(drop=True)
    return LedgerResult(kept=conform(kept, "kept"), surplus=conform(surplus, "surplus"))


@dataclass
class _Groups:
    """The passing verdicts' (macro, site) pairs and macros as codes, with history's counts and the limits:
    what the one-by-one walk counts against. `safe`: per verdict, whether its pair and macro stay within
    their limits even if every passing verdict in them were kept."""

    pair_code: np.ndarray
    macro_code: np.ndarray
    count: list[int]  # kept rows by pair position (history's, then this walk's)
    macro_total: list[int]  # kept rows by macro position
    site_caps: list[int]  # by macro position
    targets: list[int]
    safe: np.ndarray

    @classmethod
    def of(cls, passing: pd.DataFrame, prior_counts: pd.DataFrame, caps: Caps) -> "_Groups":
        macro_code, macros = pd.factorize(passing["macro"])
        site_code, sites = pd.factorize(passing["site"])
        pair_code, pairs = pd.factorize(macro_code * len(sites) + site_code)
        prior_pair, prior_macro = _prior_totals(prior_counts, macros, sites, pairs)
        site_cap = caps.site_caps(macros)
        target = caps.targets(macros).fillna(np.iinfo(np.int64).max).to_numpy(dtype=np.int64)  # none: unreachable
        # a limit nobody can reach: history plus every passing verdict under it still fits
        pair_macro = pairs // max(len(sites), 1)
        pair_safe = prior_pair + np.bincount(pair_code, minlength=len(pairs)) <= site_cap[pair_macro]
        macro_safe = prior_macro + np.bincount(macro_code, minlength=len(macros)) <= target
        return cls(pair_code, macro_code, prior_pair.tolist(), prior_macro.tolist(), site_cap.tolist(),
                   target.tolist(), pair_safe[pair_code] & macro_safe[macro_code])  # fmt: skip

    def walk(
        self, walked: np.ndarray, task_ids: list, keys: list, kept_by: dict[str, tuple[str, str]], run_id: str
    ) -> list[tuple[int, str, tuple[str | None, str | None]]]:
        """The one-by-one walk over the verdicts at positions `walked`: (position, reason, provenance) of each
        dropped one (most verdicts are kept, so only drops are recorded); `kept_by` gains this walk's keeps."""
        drops: list[tuple[int, str, tuple[str | None, str | None]]] = []
        count, macro_total, site_caps, targets = self.count, self.macro_total, self.site_caps, self.targets
        columns = (walked.tolist(), task_ids, keys, self.pair_code[walked].tolist(), self.macro_code[walked].tolist())
        for i, task_id, key, pair, macro in zip(*columns):
            if key in kept_by:
                drops.append((i, DROPPED_DUPLICATE, kept_by[key]))
            elif count[pair] >= site_caps[macro]:
                drops.append((i, DROPPED_SITE_CAP, (None, None)))
            elif macro_total[macro] >= targets[macro]:
                drops.append((i, DROPPED_TARGET, (None, None)))
            else:
                kept_by[key] = (run_id, task_id)
                count[pair] += 1
                macro_total[macro] += 1
        return drops


def _prior_totals(prior_counts: pd.DataFrame, macros, sites, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """History's kept rows per pair (`pairs`: macro position * len(sites) + site position) and per macro,
    for the macros and sites this batch has."""
    m = positions(prior_counts["macro"], pd.Series(macros, dtype="str"))
    s = positions(prior_counts["site"], pd.Series(sites, dtype="str"))
    n_kept = prior_counts["n_kept"].to_numpy(dtype=np.int64)
    per_macro = np.zeros(len(macros), dtype=np.int64)
    np.add.at(per_macro, m[m >= 0], n_kept[m >= 0])
    both = (m >= 0) & (s >= 0)
    at = pd.Index(pairs).get_indexer(m[both] * len(sites) + s[both])
    per_pair = np.zeros(len(pairs), dtype=np.int64)
    np.add.at(per_pair, at[at >= 0], n_kept[both][at >= 0])
    return per_pair, per_macro
