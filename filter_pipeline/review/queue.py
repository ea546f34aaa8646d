"""The labelling queue: which judged attempt to label next, and how far to trust the judge so far.

Order: first a uniform random sample of every judged attempt (so the precision measured on it is an unbiased
estimate of the judge's precision on the whole warehouse), then attempts whose votes split (where the judge
itself hesitated), then attempts of sites with no label yet, then the rest, in random order. The order is
fixed by a seed, so positions stay the same between requests while the warehouse does not change.
"""

import random
from dataclasses import dataclass

import pandas as pd

from filter_pipeline.review.data import JUDGED_COLUMNS, Warehouse
from filter_pipeline.rules.calibration import wilson_interval

SAMPLE_SIZE = 200  # attempts in the uniform random sample served first
SEED = 33

PHASE_SAMPLE = "random sample"
PHASE_SPLIT = "split votes"
PHASE_UNLABELLED_SITE = "site with no label"
PHASE_REST = "the rest"


@dataclass(frozen=True)
class QueueItem:
    run_id: str
    task_id: str
    dir: str
    site: str | None
    phase: str


def judged_attempts(warehouse: Warehouse) -> pd.DataFrame:
    """Every judged attempt of every run: run_id, task_id, dir, site, votes, passed."""
    frames = [warehouse.light(run_id)[1] for run_id in warehouse.run_ids()]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=JUDGED_COLUMNS)


def split_votes(votes) -> bool:
    """`P/N` with both sides non-zero: the judge's votes disagreed."""
    if not isinstance(votes, str) or "/" not in votes:
        return False
    yes, _, no = votes.partition("/")
    return yes.isdigit() and no.isdigit() and int(yes) > 0 and int(no) > 0


def latest_labels(labels: pd.DataFrame, attempts: pd.DataFrame) -> pd.DataFrame:
    """The last label of each judged attempt (by dir, or by run and task for the judged attempt): dir, success."""
    if labels.empty or attempts.empty:
        return pd.DataFrame(columns=["dir", "success"])
    by_task = labels[labels["dir"].isna()].merge(attempts[["run_id", "task_id", "dir"]], on=["run_id", "task_id"],
                                                 suffixes=("_label", ""))  # fmt: skip
    both = pd.concat([labels[labels["dir"].notna()][["dir", "success", "line"]], by_task[["dir", "success", "line"]]])
    both = both[both["dir"].isin(set(attempts["dir"]))]
    return both.sort_values("line", kind="stable").drop_duplicates("dir", keep="last")[["dir", "success"]]


def order(attempts: pd.DataFrame, labelled_sites: set) -> list[QueueItem]:
    """Every judged attempt once, in queue order (see the module's docstring)."""
    records = attempts.sort_values(["run_id", "task_id"]).to_dict("records")
    rng = random.Random(SEED)
    rng.shuffle(records)
    seen, items = set(), []

    def add(rows, phase):
        for r in rows:
            if r["dir"] not in seen:
                seen.add(r["dir"])
                site = r["site"] if isinstance(r["site"], str) else None
                items.append(QueueItem(r["run_id"], r["task_id"], r["dir"], site, phase))

    add(records[:SAMPLE_SIZE], PHASE_SAMPLE)
    add([r for r in records if split_votes(r["votes"])], PHASE_SPLIT)
    add([r for r in records if r["site"] not in labelled_sites], PHASE_UNLABELLED_SITE)
    add(records, PHASE_REST)
    return items


def precision(labelled: pd.DataFrame) -> dict:
    """The judge's precision on the labelled judged attempts (latest label each, unsure left out), with its
    Wilson 95% interval: what the kept data's correctness rests on."""
    sure = labelled[labelled["success"].notna()]
    said_yes = sure[sure["passed"].fillna(False).astype(bool)]
    tp, n = int(said_yes["success"].astype(bool).sum()), len(said_yes)
    low, high = wilson_interval(tp, n)
    return {"labelled": len(sure), "unsure": int(labelled["success"].isna().sum()), "judge_passed_labelled": n,
            "precision": tp / n if n else None, "low": None if n == 0 else low, "high": None if n == 0 else high}  # fmt: skip


def queue_state(warehouse: Warehouse, labels: pd.DataFrame) -> tuple[list[QueueItem], set, dict]:
    """(the queue, the dirs already labelled, precision figures)."""
    attempts = judged_attempts(warehouse)
    latest = latest_labels(labels, attempts)
    labelled = attempts.merge(latest, on="dir")
    items = order(attempts, set(labelled["site"].dropna()))
    return items, set(latest["dir"]), {**precision(labelled), "label_lines": len(labels), "attempts": len(items)}
