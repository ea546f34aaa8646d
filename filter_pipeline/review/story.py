"""A task's whole story (every attempt, the judged attempt's trajectory, the verdict, the walk's decision, its
DPO pair, its labels) and the labels of the data root, read for the review app and `explain`."""

import json
import re

import pandas as pd
from upath import UPath

from filter_pipeline.judge.prompt import agent_output, read_trajectory, screenshot_files
from filter_pipeline.review.data import ReviewError, UnreadableFile, Warehouse
from filter_pipeline.review.fates import FATE_JUDGE_FAIL, FATE_KEPT, FATE_SURPLUS, REASON_RETIRED, RunTables, fate_where
from filter_pipeline.rules.batch import SUCCESS_FILE
from filter_pipeline.rules.calibration import LABEL_COLUMNS, parse_labels
from filter_pipeline.rules.filtering import Caps
from filter_pipeline.rules.records import as_text, unsafe_dir_reason
from filter_pipeline.rules.schemas import SPEND_COUNTS, TRAJECTORY_OUTSIDE_ROOT, VERDICT_PARTS
from filter_pipeline.rules.vocabulary import DROPPED_DUPLICATE, DROPPED_SITE_CAP, STAGE_EXECUTE, STAGE_JUDGE
from filter_pipeline.settings import materialize_command
from filter_pipeline.storage.files import RUNS_DIR, file_version, read_if_present
from filter_pipeline.storage.labels import LABELS_FILE

# The verdict fields a story shows (its parts where the file has them)
VERDICT_FIELDS = ("status", "passed", "why", "votes", "judge", "model", "prompt_version", *VERDICT_PARTS,
                  *SPEND_COUNTS, "cost", "latency_ms", "evidence", "cached")  # fmt: skip


def plain(records: list[dict]) -> list[dict]:
    """Records with pandas' missing values as None and numpy scalars as Python ones (JSON-ready)."""
    out = []
    for record in records:
        out.append({k: (None if _missing(v) else v.item() if hasattr(v, "item") else v) for k, v in record.items()})
    return out


def _missing(value) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def rows_of(table: pd.DataFrame, task_id: str) -> list[dict]:
    if table.empty or "task_id" not in table:
        return []
    return plain(table[table["task_id"] == task_id].to_dict("records"))


def readable_dir(dir_: str | None) -> bool:
    """Whether a trajectory dir is one the stage reads, relative to the data root (`records.unsafe_dir_reason`:
    not absolute, not a URL, no '..')."""
    return isinstance(dir_, str) and unsafe_dir_reason(dir_) is None


def inside_run(run_id: str, dir_: str | None) -> bool:
    """Whether a trajectory dir (relative to the data root) lies inside the run's folder, with no step out."""
    if not isinstance(dir_, str) or not dir_.startswith(f"runs/{run_id}/") or "\\" in dir_:
        return False
    return all(part not in ("", ".", "..") for part in dir_.split("/"))


# What a page shows of one trajectory, its head: a harness can write one of gigabytes, which no browser opens.
STEPS_SHOWN = 1_000
CHARS_SHOWN = 200_000  # of the instruction, the final URL and page text, the agent's output
STEP_CHARS_SHOWN = 5_000  # of each step, as the page writes it (JSON)


def _head(value, chars: int | None = None):
    """`value` as it is when its text (a string's own, anything else's JSON) holds at most `chars` characters
    (`CHARS_SHOWN`); else that text's head, saying how many more characters there were."""
    chars = CHARS_SHOWN if chars is None else chars
    text = value if isinstance(value, str) or value is None else json.dumps(value, ensure_ascii=False)
    if text is None or len(text) <= chars:
        return value
    return f"{text[:chars]}… ({len(text) - chars:,} more characters not shown)"


def trajectory(root: UPath, dir_: str | None) -> dict:
    """The attempt's trajectory.json (instruction, steps, final url and page text, the agent's output), read as
    the judge reads it (`prompt.read_trajectory`, `prompt.agent_output`: from anywhere inside the data root, as
    a batch's dirs may lie), and its screenshots' names, those the judge takes its first and last from;
    `problem` says what could not be read, in the words of the judge's evidence. Its first `STEPS_SHOWN` steps
    are shown (`steps_not_shown` counts the others), each to `STEP_CHARS_SHOWN` characters of its JSON, and its
    texts to `CHARS_SHOWN` characters each (`_head`)."""
    if not readable_dir(dir_):
        return {"problem": TRAJECTORY_OUTSIDE_ROOT, "steps": [], "steps_not_shown": 0, "screenshots": []}
    found: dict = {"steps": [], "steps_not_shown": 0, "screenshots": []}
    try:
        found["screenshots"] = [p.name for p in screenshot_files(root, root / dir_)]
    except OSError:
        pass
    record, _, problem = read_trajectory(root, dir_)  # (what the judge read, and its problem texts)
    if problem is not None:
        return {**found, "problem": problem}
    record = _as_text(record)
    final = record.get("final") if isinstance(record.get("final"), dict) else {}
    steps = record.get("steps") if isinstance(record.get("steps"), list) else []
    return {**found, "instruction": _head(record.get("instruction")),
            "steps": [_head(step, STEP_CHARS_SHOWN) for step in steps[:STEPS_SHOWN]],
            "steps_not_shown": max(0, len(steps) - STEPS_SHOWN), "final_url": _head(final.get("url")),
            "page_text": _head(final.get("observation")), "output": _head(agent_output(record, final))}  # fmt: skip


def _as_text(value):
    """`value` (decoded JSON) as it can be printed and served as UTF-8 JSON: each lone surrogate replaced by
    U+FFFD (`as_text`), and each number JSON cannot carry (NaN, Infinity, one too large for a float, which
    Python's json reads) as its text."""
    text = json.dumps(value, ensure_ascii=False)
    clean = as_text(text)
    if clean == text and "NaN" not in text and "Infinity" not in text:
        return value
    return json.loads(clean, parse_constant=str)


def refused(t: RunTables) -> str:
    """What to say of a run the stage refused before its walk: why, and what to do."""
    return (f"its batch was refused before its walk ({t.failure}): correct its files, then "
            f"{materialize_command(t.run_id)}")  # fmt: skip


def decision(t: RunTables, task: dict) -> dict:
    """The walk's decision about the task: its fate and reason; for a retired row, retired.json's reason; for a
    duplicate, who kept the key first; for a cap, the cap the walk applied and the count it met (history's kept rows plus the run's own)."""
    found = {"fate": task["fate"], "reason": task["reason"], "where": fate_where(task["fate"], task["reason"])}
    if t.legacy is not None and t.commit is None:  # (the earlier script's kept row: not in warehouse/kept)
        found["where"] = f"its row is one of {RUNS_DIR}/{t.run_id}/{t.legacy.name}, the earlier script's kept rows"
    if task["reason"] == REASON_RETIRED:
        found["retired_because"] = t.retired.reason_of(t.run_id, task["task_id"])
    if t.failure is not None:
        found["run_refused"] = refused(t)
    if task["fate"] != FATE_SURPLUS:
        return found
    row = rows_of(t.surplus, task["task_id"])[-1:]
    if row and task["reason"] == DROPPED_DUPLICATE:
        found["duplicate_of"] = {"run_id": row[0].get("dup_of_run_id"), "task_id": row[0].get("dup_of_task_id")}
    elif t.commit and isinstance(t.commit.get("caps"), dict):
        found["cap"] = cap_met(t, task)
    return found


def cap_met(t: RunTables, task: dict) -> dict:
    """The cap a surplus row met: for `site_cap` the (macro, site)'s cap and kept rows, for `target` the macro's.
    Once a cap is met no later task of that group is kept, so the run's kept rows of the group are all counted."""
    caps = Caps.recorded(t.commit["caps"])
    by_site = task["reason"] == DROPPED_SITE_CAP
    prior, kept = t.prior_counts, t.tasks[t.tasks["fate"] == FATE_KEPT]
    same = (prior["macro"] == task["macro"]) & ((prior["site"] == task["site"]) if by_site else True)
    run_same = (kept["macro"] == task["macro"]) & ((kept["site"] == task["site"]) if by_site else True)
    macro = task.get("macro") or ""
    limit = caps.site_cap(macro) if by_site else caps.target(macro)
    return {"reason": task["reason"], "limit": limit, "kept_before": int(prior.loc[same, "n_kept"].sum()),
            "kept_in_run": int(run_same.sum()), "caps_source": t.commit.get("caps_source")}  # fmt: skip


def story(warehouse: Warehouse, run_id: str, task_id: str, labels: pd.DataFrame | None = None) -> dict:
    """Everything about one task; ReviewError when the run or task does not exist."""
    t = warehouse.run(run_id)
    match = t.tasks[t.tasks["task_id"] == task_id] if isinstance(task_id, str) else t.tasks.iloc[:0]
    if match.empty and t.legacy is None and not warehouse.asset_file("batch_tasks", run_id).exists():
        if not t.complete:
            raise ReviewError(f"run {run_id!r} is not complete (no {SUCCESS_FILE}): it is filtered once it is")
        if t.failure is not None:
            raise ReviewError(f"run {run_id!r}: {refused(t)}")
        raise ReviewError(f"run {run_id!r} is not filtered yet: {materialize_command(run_id)}")
    if match.empty:
        legacy = " (filtered by the earlier script: only its kept rows, kept.jsonl, are known)" if t.legacy else ""
        raise ReviewError(f"no task {task_id!r} in run {run_id!r}{legacy}")
    task = plain(match.iloc[:1].to_dict("records"))[0]
    verdict_rows = rows_of(t.verdicts, task_id)
    verdict = verdict_rows[-1] if verdict_rows else None
    judged_dir = verdict.get("dir") if verdict else None
    attempts = sorted(rows_of(t.attempts, task_id), key=lambda a: (a.get("attempt") is None, a.get("attempt") or 0))
    failures = {(r.get("attempt"), r.get("stage")): r for r in rows_of(t.failure_pool, task_id)}
    for a in attempts:
        a["failure"] = failures.get((a.get("attempt"), STAGE_EXECUTE))
        a["judged"] = a.get("dir") == judged_dir and judged_dir is not None
    judge_failure = failures.get((verdict.get("attempt") if verdict else None, STAGE_JUDGE))
    decided = decision(t, task)
    if decided["fate"] == FATE_JUDGE_FAIL and judge_failure and judge_failure.get("detail"):
        # (why it failed: the judge's why, or a verdict the judge passed that FILTER_JUDGE_MIN_SCORE failed)
        decided["where"] = f"{decided['where']}: {judge_failure['detail']}"
    return {
        "run_id": run_id,
        "task": task,
        "attempts": attempts,
        "judged_attempt": verdict.get("attempt") if verdict else None,
        "judged_dir": judged_dir,
        "trajectory": trajectory(warehouse.root, judged_dir) if judged_dir else None,
        "verdict": verdict and {k: verdict.get(k) for k in VERDICT_FIELDS if k in verdict},
        "judge_failure": judge_failure,
        "decision": decided,
        "dpo_pairs": rows_of(t.dpo_pairs, task_id),
        "rejects": task_rejects(t.rejects, task_id),
        "labels": task_labels(labels, run_id, task_id, [a.get("dir") for a in attempts], judged_dir),
    }


def task_rejects(rejects: pd.DataFrame, task_id: str, most: int = 20) -> list[dict]:
    """The batch_rejects rows about the task: lines naming its task_id, or the rejected line it is."""
    if rejects.empty:
        return []
    raw, message = rejects["raw"].fillna("").astype(str), rejects["message"].fillna("").astype(str)
    named = r'"task_id"\s*:\s*' + re.escape(json.dumps(task_id, ensure_ascii=False))  # (its value, not any string)
    mine = raw.str.contains(named, regex=True) | message.str.startswith(f"{task_id}:")
    return plain(rejects[mine.to_numpy(bool)].head(most).to_dict("records"))


def screenshot(warehouse: Warehouse, run_id: str, task_id: str, attempt: int, name: str) -> bytes:
    """A screenshot of one attempt: one of those its trajectory shows (`prompt.screenshot_files`), by name;
    ReviewError else."""
    t = warehouse.run(run_id)
    rows = [a for a in rows_of(t.attempts, task_id) if a.get("attempt") == attempt]
    dir_ = rows[0].get("dir") if rows else None
    if not readable_dir(dir_):
        raise ReviewError("no such screenshot")
    try:
        shots = {p.name: p for p in screenshot_files(warehouse.root, warehouse.root / dir_)}
        if name not in shots:
            raise ReviewError("no such screenshot")
        return shots[name].read_bytes()
    except OSError:
        raise ReviewError("no such screenshot") from None


# --- labels ------------------------------------------------------------------------------------------


class Labels:
    """labels.jsonl as a frame of every valid line (file order), re-read when the file changes."""

    def __init__(self, root: UPath):
        self.path = root / LABELS_FILE
        self._seen: tuple | None = None
        self._frame = pd.DataFrame(columns=LABEL_COLUMNS)

    def frame(self) -> pd.DataFrame:
        """Every valid label; UnreadableFile when the file exists but cannot be read (a folder, no permission)."""
        current = file_version(self.path)
        if current != self._seen:
            data = read_if_present(self.path, UnreadableFile) if current is not None else None
            self._frame, self._seen = parse_labels(data or b"")[0], current
        return self._frame


def task_labels(labels: pd.DataFrame | None, run_id: str, task_id: str, dirs: list, judged_dir) -> list[dict]:
    """The task's labels in file order: by dir of any of its attempts, or by run and task (the judged attempt's).
    `current` is False on a label a later one of the same attempt replaces (calibration reads the latest)."""
    if labels is None or labels.empty:
        return []
    mine = labels["dir"].isin([d for d in dirs if d]) | ((labels["run_id"] == run_id) & (labels["task_id"] == task_id))
    found = plain(labels[mine.fillna(False).astype(bool)].to_dict("records"))
    for label in found:
        label["dir"] = label["dir"] or judged_dir
    last = {label["dir"]: i for i, label in enumerate(found)}
    for i, label in enumerate(found):
        label["current"] = last[label["dir"]] == i
    return found
