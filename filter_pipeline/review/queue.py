"""The labelling queue: which judged attempt to label next, and how far to trust the judge so far.

Order: first a uniform random sample of every judged attempt (so the precision measured on it is an unbiased
estimate of the judge's precision on the whole warehouse), then attempts whose votes split (where the judge
itself hesitated), then attempts of sites with no label yet, then the rest, in random order. The random order
is that of a hash of each attempt's dir (`data.draw`): the same on every request, and an attempt keeps its
place among the others as runs are added, so the sample (the SAMPLE_SIZE attempts hashed lowest) changes only
by new attempts that hash lower (it stays a uniform sample). A label moves its site's other attempts out of
"site with no label", so after a label the app addresses the attempt by its dir, not its position.
"""

import threading
from dataclasses import dataclass

import numpy as np
import pandas as pd

from filter_pipeline.review.data import JUDGED_COLUMNS, Warehouse
from filter_pipeline.rules import calibration
from filter_pipeline.rules.calibration import wilson_interval
from filter_pipeline.rules.schemas import VOTES_PARTS

SAMPLE_SIZE = 200  # attempts in the uniform random sample served first

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


def latest_labels(labels: pd.DataFrame, attempts: pd.DataFrame) -> pd.DataFrame:
    """The last label of each judged attempt in `attempts` (by dir, or by run and task for the judged attempt),
    unsure ones included: dir, success (`calibration.latest_labels` over the judged attempts)."""
    if labels.empty or attempts.empty:
        return pd.DataFrame(columns=["dir", "success"])
    judged = attempts[["run_id", "task_id", "dir"]]
    latest = calibration.latest_labels(labels, judged.assign(ok=True), judged, judged, unsure=True)
    return latest[["dir", "success"]]


QUEUE_COLUMNS = ["run_id", "task_id", "dir", "site", "phase"]
PHASES = (PHASE_SAMPLE, PHASE_SPLIT, PHASE_UNLABELLED_SITE, PHASE_REST)


def split_mask(votes: pd.Series) -> np.ndarray:
    """For each value, whether it is `P/N` (P passing votes of the N asked) with 0 < P < N: the judge's votes
    disagreed."""
    parts = votes.astype("object").where(votes.notna(), "").astype(str).str.extract(VOTES_PARTS)
    passing, asked = pd.to_numeric(parts[0]), pd.to_numeric(parts[1])
    return ((passing > 0) & (passing < asked)).to_numpy(bool)


def order(attempts: pd.DataFrame, labelled_sites: set) -> pd.DataFrame:
    """Every judged attempt once, in queue order (see the module's docstring): QUEUE_COLUMNS. An attempt several
    runs judged (a batch copied with its dirs) is the latest run's, the verdict its labels are scored against
    (`calibration.latest_labels`)."""
    unique = attempts.drop_duplicates("dir", keep="last").reset_index(drop=True)
    shuffled = unique.iloc[np.argsort(unique["draw"].to_numpy(np.int64), kind="stable")].reset_index(drop=True)
    rank = np.full(len(shuffled), PHASES.index(PHASE_REST))
    rank[~shuffled["site"].isin(labelled_sites).to_numpy(bool)] = PHASES.index(PHASE_UNLABELLED_SITE)
    rank[split_mask(shuffled["votes"])] = PHASES.index(PHASE_SPLIT)
    rank[: min(SAMPLE_SIZE, len(rank))] = PHASES.index(PHASE_SAMPLE)
    queued = shuffled.iloc[np.argsort(rank, kind="stable")]
    phase = np.asarray(PHASES, dtype=object)[np.sort(rank, kind="stable")]
    return queued.assign(phase=phase)[QUEUE_COLUMNS].reset_index(drop=True)


def item(queue: pd.DataFrame, position: int) -> QueueItem:
    row = queue.iloc[position]
    site = row["site"] if isinstance(row["site"], str) else None
    return QueueItem(row["run_id"], row["task_id"], row["dir"], site, row["phase"])


def precision(labelled: pd.DataFrame) -> dict:
    """The judge's precision on the labelled judged attempts (latest label each, unsure left out), with its
    Wilson 95% interval: what the kept data's correctness rests on."""
    sure = labelled[labelled["success"].notna()]
    said_yes = sure[sure["passed"].fillna(False).astype(bool)]
    tp, n = int(said_yes["success"].astype(bool).sum()), len(said_yes)
    low, high = wilson_interval(tp, n)
    return {"labelled": len(sure), "unsure": int(labelled["success"].isna().sum()), "judge_passed_labelled": n,
            "precision": tp / n if n else None, "low": None if n == 0 else low, "high": None if n == 0 else high}  # fmt: skip


def queue_state(attempts: pd.DataFrame, labels: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray, dict]:
    """(the queue over `attempts`, which of its attempts are labelled already, precision figures: over every
    labelled attempt, and under `sample` over the random sample's labels as far as all of it is labelled, in
    queue order: the unbiased estimate)."""
    latest = latest_labels(labels, attempts)
    # each label once, scored against the verdict of the latest run that judged its attempt (as `order` queues it)
    labelled = attempts.drop_duplicates("dir", keep="last").merge(latest, on="dir")
    queue = order(attempts, set(labelled["site"].dropna()))
    done = queue["dir"].isin(set(latest["dir"])).to_numpy(bool)
    # the sample's labels up to its first attempt not labelled yet, in queue order: labels given elsewhere, or
    # before new runs moved the sample on, would make it a chosen subset rather than a random one
    sample = queue.loc[queue["phase"] == PHASE_SAMPLE, "dir"].to_numpy(object)
    gaps = np.flatnonzero(~done[: len(sample)])
    prefix = set(sample[: gaps[0] if len(gaps) else len(sample)])
    figures = {**precision(labelled), "sample": precision(labelled[labelled["dir"].isin(prefix).to_numpy(bool)])}
    return queue, done, {**figures, "label_lines": len(labels), "attempts": len(queue)}


class QueueMemo:
    """The last queue computed, reused while no run's judged attempts and no label changed (the warehouse
    and the labels hand out the same frame objects until their files change)."""

    def __init__(self):
        self._inputs: list = []
        self._state: tuple | None = None
        self._lock = threading.Lock()

    def state(self, warehouse: Warehouse, labels: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray, dict]:
        frames = [warehouse.judged(run_id) for run_id in sorted(warehouse.rooted_run_ids())]
        inputs = [labels, *frames]
        with self._lock:
            if self._state and len(inputs) == len(self._inputs) and all(a is b for a, b in zip(inputs, self._inputs)):
                return self._state
        frames = [f for f in frames if len(f)]
        attempts = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=JUDGED_COLUMNS)
        state = queue_state(attempts, labels)
        with self._lock:
            self._inputs, self._state = inputs, state
        return state
