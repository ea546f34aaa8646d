"""Judge calibration: the judge and the gate against human labels (`<data>/labels.jsonl`). Pure pandas.

A label line is `{"dir": "<trajectory dir>", "success": true}` or `{"run_id": ..., "task_id": ..., "success":
false}`: by dir it labels that attempt; by task it labels the task's judged attempt. `success` null means
unsure: the line stays in the file and is never counted. A later line for the same attempt replaces an earlier
one (file order); other fields (`note`, `labeler`, `labeled_at`) are allowed and ignored here.
"""

import json
import math

import pandas as pd

from filter_pipeline.rules.batch import jsonl_lines
from filter_pipeline.rules.descriptions import markdown_cell
from filter_pipeline.rules.records import is_text, json_text
from filter_pipeline.rules.schemas import CALIBRATION_MIN_LABELS, conform
from filter_pipeline.rules.vocabulary import STATUS_JUDGED

LABELS_FILE = "labels.jsonl"
ALL_SITES = "(all)"
# what is scored against the labels: the judge of each run (by model and prompt version) and the gate alone
PREDICTOR_JUDGE, PREDICTOR_GATE = "judge", "gate"
PREDICTORS = (PREDICTOR_JUDGE, PREDICTOR_GATE)


# rejected lines (of labels.jsonl, of a batch) a step or the CLI lists one by one; the rest are counted
MAX_REJECTS_SHOWN = 20
LABEL_NOTES = ("note", "labeler", "labeled_at")  # optional text a label may carry: shown, never counted
LABEL_COLUMNS = ["dir", "run_id", "task_id", "success", *LABEL_NOTES, "line"]


def parse_labels(data: bytes | str) -> tuple[pd.DataFrame, list[str]]:
    """(labels, rejects): rows (LABEL_COLUMNS) of every valid line (success None: unsure), and one message per
    line that is not a label ("labels.jsonl:N: why"), in file order. Never raises on content."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    rows, rejects = [], []
    for number, raw in jsonl_lines(data):
        try:
            rows.append({**_label(raw), "line": number})
        except ValueError as exc:
            rejects.append(f"{LABELS_FILE}:{number}: {exc}")
    return pd.DataFrame(rows, columns=LABEL_COLUMNS), rejects


def _label(raw: bytes) -> dict:
    """One label line as a row; ValueError saying why it is not one."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError):  # an integer longer than Python converts; nesting too deep
        raise ValueError("not a JSON value Python reads (an integer too long or nesting too deep)") from None
    by_dir = isinstance(record, dict) and isinstance(record.get("dir"), str)
    by_task = (
        isinstance(record, dict) and isinstance(record.get("run_id"), str) and isinstance(record.get("task_id"), str)
    )
    if not (by_dir or by_task) or "success" not in record or not isinstance(record["success"], (bool, type(None))):
        raise ValueError("expected {dir | run_id + task_id, success: true | false | null}")
    row = {"dir": record["dir"] if by_dir else None, "run_id": None if by_dir else record["run_id"],
           "task_id": None if by_dir else record["task_id"], "success": record["success"]}  # fmt: skip
    if not all(is_text(row[name]) for name in ("dir", "run_id", "task_id") if row[name] is not None):
        raise ValueError("a lone surrogate (\\ud800-\\udfff) in dir, run_id or task_id, which is not text")
    # (free text: a half emoji is shown as U+FFFD, as in a batch's instruction or error)
    row.update({name: json_text(record.get(name)) for name in LABEL_NOTES})
    return row


def latest_labels(
    labels: pd.DataFrame, attempts: pd.DataFrame, verdicts: pd.DataFrame, tasks: pd.DataFrame, unsure: bool = False
) -> pd.DataFrame:
    """The latest label of each labelled attempt, unsure ones (success null) dropped unless `unsure`: (run_id,
    task_id, dir, success, gate). A task label names the task's judged attempt (dir null when the task has none);
    the gate passed an attempt it let through (`ok`), a task if it had an ok attempt, i.e. a verdict. A dir that
    attempts of several runs name is one attempt, the latest run's (in run_id order). Labels matching nothing
    are dropped."""
    by_dir = labels[labels["dir"].notna()][["dir", "success", "line"]].merge(
        attempts[["run_id", "task_id", "dir", "ok"]], on="dir", how="inner"
    )
    by_dir = by_dir.rename(columns={"ok": "gate"})
    by_task = labels[labels["dir"].isna()][["run_id", "task_id", "success", "line"]].merge(
        tasks[["run_id", "task_id"]], on=["run_id", "task_id"], how="inner"
    )
    with_verdict = verdicts[["run_id", "task_id", "dir"]].assign(gate=True)
    by_task = by_task.merge(with_verdict, on=["run_id", "task_id"], how="left")
    by_task["gate"] = by_task["gate"].astype(object).fillna(False)
    both = pd.concat([by_dir, by_task], ignore_index=True)
    attempt = both["dir"].astype(object).where(both["dir"].notna(), both["run_id"] + "\0" + both["task_id"])
    # (by run_id within a line: a dir several runs name is the latest run's attempt)
    both = both.assign(attempt=attempt).sort_values(["line", "run_id"]).drop_duplicates("attempt", keep="last")
    both = both if unsure else both[both["success"].notna()]
    return both[["run_id", "task_id", "dir", "success", "gate"]].reset_index(drop=True)


def unmatched_labels(labels: pd.DataFrame, attempts: pd.DataFrame, tasks: pd.DataFrame) -> list[str]:
    """One line per label that names no attempt of `attempts` (by dir) and no task of `tasks` (by run_id and
    task_id), in file order: a typo, or a batch not parsed yet. Such a label counts once it matches."""
    by_task = pd.MultiIndex.from_frame(labels[["run_id", "task_id"]].astype(object))
    found = by_task.isin(pd.MultiIndex.from_frame(tasks[["run_id", "task_id"]].astype(object)))
    by_dir = labels["dir"].notna().to_numpy()
    found[by_dir] = labels["dir"][by_dir].isin(attempts["dir"]).to_numpy()
    return [
        f"{LABELS_FILE}:{row.line}: names no attempt of a parsed batch ("
        + (f"dir {row.dir!r}" if isinstance(row.dir, str) else f"run_id {row.run_id!r}, task_id {row.task_id!r}")
        + "): a typo, or a batch not parsed yet (it counts once it matches)"
        for row in labels[~found].itertuples()
    ]


# the columns of each warehouse asset that `resolve` reads (the frames it takes may hold more)
RESOLVE_COLUMNS = {
    "batch_attempts": ["run_id", "task_id", "dir", "ok"],
    "judge_verdicts": ["run_id", "task_id", "dir", "passed", "status", "model", "prompt_version"],
    "batch_tasks": ["run_id", "task_id", "site"],
}


def resolve(
    labels: pd.DataFrame,
    attempts: pd.DataFrame,
    verdicts: pd.DataFrame,
    tasks: pd.DataFrame,
    scored: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Each labelled attempt's latest label, once, with what the gate and the judge said of it: (site, success,
    gate, judge, model, prompt_version); judge is <NA> where the judge did not see that attempt. `verdicts`:
    production's, whose judged attempt of a task is what a task label labels; `scored`: the verdicts scored, when
    not those (a candidate judge's, which may have judged several attempts of a task). A verdict counts for the
    attempt of its own run: a dir two runs share is still one labelled attempt."""
    verdicts = verdicts.reindex(columns=RESOLVE_COLUMNS["judge_verdicts"])
    scored = verdicts if scored is None else scored.reindex(columns=RESOLVE_COLUMNS["judge_verdicts"])
    both = latest_labels(labels, attempts, verdicts, tasks)
    judged = scored[scored["status"] == STATUS_JUDGED][["run_id", "dir", "passed", "model", "prompt_version"]]
    both = both.merge(judged, on=["run_id", "dir"], how="left").rename(columns={"passed": "judge"})
    both = both.merge(tasks[["run_id", "task_id", "site"]], on=["run_id", "task_id"], how="left")
    out = both[["site", "success", "gate", "judge", "model", "prompt_version"]].astype(
        {"success": "boolean", "gate": "boolean", "judge": "boolean"}
    )
    return out.reset_index(drop=True)


def scores(tp: int, fp: int, fn: int, tn: int) -> dict:
    """The calibration figures of one confusion matrix (null where a figure has no denominator)."""
    n = tp + fp + fn + tn
    precision_low, precision_high = wilson_interval(tp, tp + fp)
    recall_low, recall_high = wilson_interval(tp, tp + fn)
    chance = ((tp + fp) * (tp + fn) + (fn + tn) * (fp + tn)) / (n * n) if n else math.nan
    return {
        "n": n, "tp": tp, "fp": fp, "fn": fn, "tn": tn,
        "precision": tp / (tp + fp) if tp + fp else None,
        "precision_low": _number(precision_low), "precision_high": _number(precision_high),
        "recall": tp / (tp + fn) if tp + fn else None,
        "recall_low": _number(recall_low), "recall_high": _number(recall_high),
        "f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None,
        "kappa": ((tp + tn) / n - chance) / (1 - chance) if n and chance < 1 else None,
        "pass_rate_gap": (fp - fn) / n if n else None,
        "agreement": (tp + tn) / n if n else None,
    }  # fmt: skip


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def _confusion(predicted: pd.Series, truth: pd.Series) -> tuple[int, int, int, int]:
    pred, truth = predicted.astype(bool), truth.astype(bool)
    return (
        int((pred & truth).sum()),
        int((pred & ~truth).sum()),
        int((~pred & truth).sum()),
        int((~pred & ~truth).sum()),
    )


def _judges(seen: pd.DataFrame, predictor: str) -> list[tuple[str | None, str | None, pd.DataFrame]]:
    """(model, prompt_version, rows) per judge: the judge by model and prompt version, the gate as one."""
    if predictor == PREDICTOR_GATE:
        return [(None, None, seen)]
    keys = seen[["model", "prompt_version"]].astype(object).fillna("")  # (the gate judge: no model, null or empty)
    return [
        (model or None, version or None, part)
        for (model, version), part in seen.groupby([keys["model"], keys["prompt_version"]], sort=True)
    ]


def calibration(resolved: pd.DataFrame) -> pd.DataFrame:
    """The calibration figures of the judge (per model and prompt version) and of the gate against the labels,
    overall (site "(all)") and per site."""
    rows = []
    for predictor in PREDICTORS:
        seen = resolved[resolved[predictor].notna()] if len(resolved) else resolved
        for model, version, part in _judges(seen, predictor) if len(seen) else []:
            for site, sub in [(ALL_SITES, part), *part.groupby("site")]:
                figures = scores(*_confusion(sub[predictor], sub["success"]))
                rows.append(
                    {"predictor": predictor, "model": model, "prompt_version": version, "site": site, **figures}
                )
    return conform(pd.DataFrame(rows), "judge_calibration")


def _share(value, low=None, high=None) -> str:
    if value is None or pd.isna(value):
        return "-"
    interval = f" [{low:.2f}, {high:.2f}]" if low is not None and not pd.isna(low) else ""
    return f"{value:.2f}{interval}"


def summary(row: dict) -> str:
    """One calibration row in words: precision and its interval first (the figure a kept row's worth rests
    on), recall, kappa, then n, with a warning under CALIBRATION_MIN_LABELS labels."""
    few = f" (under {CALIBRATION_MIN_LABELS} labels: read the intervals)" if row["n"] < CALIBRATION_MIN_LABELS else ""
    return (
        f"precision {_share(row['precision'], row['precision_low'], row['precision_high'])}, recall "
        f"{_share(row['recall'], row['recall_low'], row['recall_high'])}, kappa {_share(row['kappa'])} "
        f"on {row['n']} labels{few}"
    )


def who(row: dict) -> str:
    """The predictor of a calibration row: `gate`, `judge <model> <prompt_version>`, or the judge of runs the
    gate judge decided (no model)."""
    if row["predictor"] == PREDICTOR_GATE:
        return PREDICTOR_GATE
    named = [
        str(v) for v in (row["model"], row["prompt_version"]) if v is not None and not pd.isna(v) and str(v).strip()
    ]
    return " ".join([PREDICTOR_JUDGE, *named]) if named else f"{PREDICTOR_JUDGE} (the gate judge: no model)"


def markdown(table: pd.DataFrame) -> str:
    """The calibration as a markdown table, precision (95% Wilson interval) first, each row on fewer than
    CALIBRATION_MIN_LABELS labels marked."""
    lines = [
        "| predictor | site | precision [95%] | recall [95%] | kappa | f1 | pass rate gap | n |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in table.to_dict("records"):
        warn = " ⚠" if row["n"] < CALIBRATION_MIN_LABELS else ""
        lines.append(
            f"| {markdown_cell(who(row))} | {markdown_cell(row['site'])} | {_share(row['precision'], row['precision_low'], row['precision_high'])} "
            f"| {_share(row['recall'], row['recall_low'], row['recall_high'])} | {_share(row['kappa'])} "
            f"| {_share(row['f1'])} | {_share(row['pass_rate_gap'])} | {row['n']}{warn} |"
        )
    note = f"⚠: fewer than {CALIBRATION_MIN_LABELS} labels; the interval says how far the figure can be off."
    return "\n".join(lines) + ("\n\n" + note if (table["n"] < CALIBRATION_MIN_LABELS).any() else "")


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of the proportion successes / n (z = 1.96: 95%); (nan, nan) when n is 0."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))
