"""Judge calibration: the judge and the gate against human labels (`<data>/labels.jsonl`). Pure pandas.

A label line is `{"dir": "<trajectory dir>", "success": true}` or `{"run_id": ..., "task_id": ..., "success":
false}`: by dir it labels that attempt; by task it labels the task's judged attempt.
"""

import json
import math

import pandas as pd

from filter_pipeline.rules.schemas import STATUS_JUDGED, conform

LABELS_FILE = "labels.jsonl"
ALL_SITES = "(all)"


MAX_REJECTS_SHOWN = 20  # bad label lines listed in judge_calibration's metadata and log


def parse_labels(data: bytes | str) -> tuple[pd.DataFrame, list[str]]:
    """(labels, rejects): rows (dir, run_id, task_id, success) of every valid line, and one message per
    line that is not a label ("labels.jsonl:N: why"), in file order. Never raises on content."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    rows, rejects = [], []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            rows.append(_label(raw))
        except ValueError as exc:
            rejects.append(f"{LABELS_FILE}:{number}: {exc}")
    return pd.DataFrame(rows, columns=["dir", "run_id", "task_id", "success"]), rejects


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
    if not (by_dir or by_task) or not isinstance(record.get("success"), bool):
        raise ValueError("expected {dir | run_id + task_id, success: bool}")
    row = {"dir": record["dir"] if by_dir else None, "run_id": None if by_dir else record["run_id"],
           "task_id": None if by_dir else record["task_id"], "success": record["success"]}  # fmt: skip
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a lone surrogate (\\ud800-\\udfff) in dir, run_id or task_id, which is not text") from None
    return row


def resolve(labels: pd.DataFrame, attempts: pd.DataFrame, verdicts: pd.DataFrame, tasks: pd.DataFrame) -> pd.DataFrame:
    """Each label with what the gate and the judge said: (site, success, gate, judge); judge is <NA> where the
    judge did not see that attempt, and labels matching nothing are dropped."""
    judged = verdicts[verdicts["status"] == STATUS_JUDGED][["run_id", "task_id", "dir", "passed"]]
    by_dir = labels[labels["dir"].notna()][["dir", "success"]].merge(
        attempts[["run_id", "task_id", "dir", "ok"]], on="dir", how="inner"
    )
    by_dir = by_dir.merge(judged[["dir", "passed"]], on="dir", how="left").rename(
        columns={"ok": "gate", "passed": "judge"}
    )
    by_task = labels[labels["dir"].isna()][["run_id", "task_id", "success"]].merge(
        tasks[["run_id", "task_id"]], on=["run_id", "task_id"], how="inner"
    )
    by_task = by_task.merge(judged[["run_id", "task_id", "passed"]], on=["run_id", "task_id"], how="left")
    # the gate passed a task if it had an ok attempt, i.e. a verdict
    with_verdict = verdicts[["run_id", "task_id"]].assign(gate=True)
    by_task = by_task.merge(with_verdict, on=["run_id", "task_id"], how="left").rename(columns={"passed": "judge"})
    by_task["gate"] = by_task["gate"].fillna(False)
    both = pd.concat([by_dir, by_task], ignore_index=True)
    both = both.merge(tasks[["run_id", "task_id", "site"]], on=["run_id", "task_id"], how="left")
    return both[["site", "success", "gate", "judge"]].astype(
        {"success": "boolean", "gate": "boolean", "judge": "boolean"}
    )


def calibration(resolved: pd.DataFrame) -> pd.DataFrame:
    """Precision, recall and agreement of the judge and of the gate against the labels, per site and overall."""
    rows = []
    if resolved.empty:
        return conform(pd.DataFrame(rows), "judge_calibration")
    for predictor in ("judge", "gate"):
        seen = resolved[resolved[predictor].notna()]
        groups = [(ALL_SITES, seen)] + list(seen.groupby("site")) if len(seen) else []
        for site, part in groups:
            pred, truth = part[predictor].astype(bool), part["success"].astype(bool)
            tp, fp = int((pred & truth).sum()), int((pred & ~truth).sum())
            fn, tn = int((~pred & truth).sum()), int((~pred & ~truth).sum())
            rows.append({
                "predictor": predictor, "site": site, "n": len(part), "tp": tp, "fp": fp, "fn": fn, "tn": tn,
                "precision": tp / (tp + fp) if tp + fp else None, "recall": tp / (tp + fn) if tp + fn else None,
                "agreement": (tp + tn) / len(part),
            })  # fmt: skip
    return conform(pd.DataFrame(rows), "judge_calibration")


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of the proportion successes / n (z = 1.96: 95%); (nan, nan) when n is 0."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))
