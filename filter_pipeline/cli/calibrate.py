"""`filter-pipeline calibrate`: a candidate judge (another model, endpoint, prompt version or number of votes)
on the labelled attempts only, scored against the labels side by side with the judge in production.

The candidate is the production judge's settings (FILTER_JUDGE_*) with the options given in their place. Its
verdicts go to `warehouse/judge_eval/<candidate>.parquet` (the judge_verdicts columns), and are reused by cache
key the next time: a second run of the same candidate asks nothing. Nothing else in the warehouse is written:
kept, surplus, the commit records and judge_verdicts stay as they are.
"""

import argparse
import logging
import re

import pandas as pd

from filter_pipeline.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_UNJUDGED, complain
from filter_pipeline.cli.data_root import existing_root
from filter_pipeline.judge.client import EndpointRefused, JudgeSetupError, ssl_context
from filter_pipeline.judge.config import env_name
from filter_pipeline.judge.driver import RecordSteps
from filter_pipeline.judge.resource import JudgeResource, judge_from_env
from filter_pipeline.rules import calibration
from filter_pipeline.rules.filtering import unjudged_count
from filter_pipeline.rules.schemas import conform
from filter_pipeline.rules.vocabulary import STATUS_JUDGED
from filter_pipeline.settings import JUDGE_LLM
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.labels import read_labels
from filter_pipeline.storage.parquet import encode, read_folder, read_parquet, write_bytes

JUDGE_EVAL_FOLDER = "judge_eval"  # warehouse/judge_eval/<candidate>.parquet
# what the candidate's prompts and its cost beside production's need, beyond what calibration.resolve reads
CANDIDATE_COLUMNS = {
    "batch_tasks": [*calibration.RESOLVE_COLUMNS["batch_tasks"], "macro", "dedup_key", "start_kind", "instruction"],
    "batch_attempts": [*calibration.RESOLVE_COLUMNS["batch_attempts"], "attempt", "n_actions", "backend_ok",
                       "backend_detail", "line"],
    "judge_verdicts": [*calibration.RESOLVE_COLUMNS["judge_verdicts"], "requests", "prompt_tokens",
                       "completion_tokens", "cost"],
}  # fmt: skip


class CalibrateError(Exception):
    """A one-line reason to stop before asking the candidate anything."""


def candidate_judge(args: argparse.Namespace) -> JudgeResource:
    """The production judge's settings with the options in their place (the secrets as their values: this
    process asks the endpoint itself, outside Dagster)."""
    overrides = {"model": args.model, "base_url": args.base_url, "prompt_version": args.prompt_version,
                 "votes": args.votes}  # fmt: skip
    judge = judge_from_env(JUDGE_LLM, {k: v for k, v in overrides.items() if v is not None}, env_vars=False)
    missing = [name for name in ("base_url", "model") if not getattr(judge.llm, name)]
    if missing:  # (named by the options first: they are what a calibration usually sets)
        flags = " and ".join(f"--{name.replace('_', '-')}" for name in missing)
        raise CalibrateError(f"the candidate judge needs {flags} (or {' and '.join(map(env_name, missing))})")
    judge.settings()  # settings that cannot work: one line
    ssl_context()
    return judge


def candidate_name(judge: JudgeResource) -> str:
    """The candidate's key: its model, prompt version and votes, as a file name."""
    settings = judge.settings()
    name = f"{settings.model}_{settings.prompt_version}_votes{settings.votes}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")  # (no leading dot: not a hidden file)


def labelled_requests(data: DataRoot, labels: pd.DataFrame) -> tuple[pd.DataFrame, tuple]:
    """(one judge request per labelled attempt the candidate can see, with its run_id; the warehouse frames
    calibration.resolve needs: attempts, production verdicts, tasks)."""
    read = lambda asset: read_folder(data.warehouse / asset, CANDIDATE_COLUMNS[asset])  # noqa: E731
    tasks, verdicts, attempts = read("batch_tasks"), read("judge_verdicts"), read("batch_attempts")
    latest = calibration.latest_labels(labels, attempts, verdicts, tasks)
    latest = latest[latest["dir"].notna()]
    picked = attempts.merge(latest[["dir"]], on="dir", how="inner")
    requests = (
        picked.drop(columns=["ok"])
        .rename(columns={"line": "attempt_line"})
        .merge(tasks, on=["run_id", "task_id"], how="left")
    )
    return requests.reset_index(drop=True), (attempts, verdicts, tasks)


def judge_candidate(
    judge: JudgeResource, data: DataRoot, requests: pd.DataFrame, previous: pd.DataFrame | None
) -> tuple[pd.DataFrame, dict]:
    """The candidate's verdicts on `requests` (run by run: each run's records give steps where a trajectory.json
    cannot be used), reusing those in `previous` (its file); (verdicts, requests and cost paid now)."""
    log = logging.getLogger("filter_pipeline.calibrate")
    frames, spent = [], {"requests": 0, "cost": 0.0, "priced": judge.prices().priced}
    for run_id, part in requests.groupby("run_id", sort=True):
        judgement = judge.judge(
            part.reset_index(drop=True), data.root, RecordSteps(data.run_dir(run_id)), previous, log
        )
        frames.append(judgement.verdicts.assign(run_id=run_id))
        spent["requests"] += int(judgement.metadata.get("requests", 0))
        cost = judgement.metadata.get("cost")
        spent["cost"] += cost if isinstance(cost, float) else 0.0
    verdicts = (
        pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=CANDIDATE_COLUMNS["judge_verdicts"])
    )
    return conform(verdicts.assign(backend=verdicts.get("backend_detail")), "judge_verdicts"), spent


def on_file(previous: pd.DataFrame | None, verdicts: pd.DataFrame) -> pd.DataFrame:
    """The candidate's file after this call: `verdicts`, and every verdict of `previous` on an attempt not judged
    now, so that attempts labelled earlier (a label replaced, a labels file cut short) are not paid for again."""
    if previous is None:
        return verdicts
    return pd.concat([verdicts, previous[~previous["dir"].isin(verdicts["dir"])]], ignore_index=True)


def _judged_by(verdicts: pd.DataFrame, row: dict) -> pd.DataFrame:
    """The verdicts of the calibration row's judge: its model and prompt version (none: the gate judge)."""
    same = pd.Series(True, index=verdicts.index)
    for column in ("model", "prompt_version"):
        wanted = "" if row[column] is None or pd.isna(row[column]) else str(row[column])
        same &= verdicts[column].astype(object).fillna("").astype(str) == wanted
    return verdicts[same]


def _cost(verdicts: pd.DataFrame) -> str:
    requests = int(pd.to_numeric(verdicts["requests"], errors="coerce").fillna(0).sum())
    tokens = int(pd.to_numeric(verdicts["prompt_tokens"], errors="coerce").fillna(0).sum()) + int(
        pd.to_numeric(verdicts["completion_tokens"], errors="coerce").fillna(0).sum()
    )
    cost = pd.to_numeric(verdicts["cost"], errors="coerce")
    priced = f"cost {cost.sum():.4f}" if cost.notna().any() else "not priced"
    return f"{requests} requests, {tokens} tokens, {priced}"


def side_by_side(labels: pd.DataFrame, frames: tuple, candidate: pd.DataFrame, name: str) -> list[str]:
    """One line per production predictor and one for the candidate on the same attempts (those production
    judged), then, when it was also asked about attempts production never judged (failed executions, which the
    judge never sees), one for the candidate on every labelled attempt: precision first, recall, kappa, cost."""
    attempts, production, tasks = frames
    seen = candidate["dir"].isin(production.loc[production["status"] == STATUS_JUDGED, "dir"])
    compared = [("production", production), (f"candidate {name}", candidate[seen])]
    if not seen.all():
        compared.append((f"candidate {name} (every labelled attempt, {int((~seen).sum())} of them never judged "
                         "in production)", candidate))  # fmt: skip
    lines = []
    for label, verdicts in compared:
        table = calibration.calibration(calibration.resolve(labels, attempts, production, tasks, verdicts))
        overall = table[table["site"] == calibration.ALL_SITES]
        if label != "production":
            overall = overall[overall["predictor"] == calibration.PREDICTOR_JUDGE]
        labelled = verdicts[verdicts["dir"].isin(candidate["dir"])]  # the same attempts' verdicts, each once
        for row in overall.to_dict("records"):
            cost = "" if row["predictor"] == calibration.PREDICTOR_GATE else f"; {_cost(_judged_by(labelled, row))}"
            lines.append(f"{label}: {calibration.who(row)}: {calibration.summary(row)}{cost}")
        if overall.empty:
            lines.append(f"{label}: no labelled attempt judged")
    return lines


def calibrate(args: argparse.Namespace) -> int:
    """Exit status 0 when the candidate judged every labelled attempt and was scored; 1 when it could not judge
    (endpoint refused); 2 bad input, or no label naming an attempt it could judge; 3 when attempts were left
    unjudged (scored on the others, if any)."""
    if existing_root(args.data) is None:
        return EXIT_BAD_INPUT
    data = DataRoot.from_env(args.data)
    try:
        raw = read_labels(data.root)
    except ValueError as exc:  # (one that exists but cannot be read)
        raise CalibrateError(f"{data.path}: {exc}") from None
    if raw is None:
        raise CalibrateError(f"{data.path}: no {calibration.LABELS_FILE}: label some attempts first")
    if not (data.warehouse / "judge_verdicts").exists():
        raise CalibrateError(f"{data.path}: no judge_verdicts in the warehouse: materialize a batch first")
    judge = candidate_judge(args)
    labels, rejects = calibration.parse_labels(raw)
    for message in rejects[: calibration.MAX_REJECTS_SHOWN]:
        complain(message, warning=True)
    if labels.empty:
        refused = f" ({len(rejects)} line(s) refused, above)" if rejects else ""
        raise CalibrateError(f"{data.path}: {calibration.LABELS_FILE} holds no label{refused}: label some attempts")
    requests, frames = labelled_requests(data, labels)
    if requests.empty:
        raise CalibrateError(
            f"{data.path}: none of the {len(labels)} label(s) in {calibration.LABELS_FILE} is a sure label "
            "(success true or false) of an attempt in the warehouse's batch_attempts: nothing to judge"
        )
    name = candidate_name(judge)
    file = data.warehouse / JUDGE_EVAL_FOLDER / f"{name}.parquet"
    previous = read_parquet(file) if file.exists() else None
    print(f"judging {len(requests)} labelled attempts with the candidate {name}", flush=True)
    try:
        verdicts, spent = judge_candidate(judge, data, requests, previous)
    except EndpointRefused as exc:
        complain(str(exc))
        return EXIT_FAILED
    write_bytes(encode(on_file(previous, verdicts), "judge_verdicts")[1], file)
    paid = f", cost {spent['cost']:.4f}" if spent["priced"] else ""
    print(f"asked {spent['requests']} requests now{paid}; verdicts in {file}", flush=True)
    for line in side_by_side(labels, frames, verdicts, name):
        print(line, flush=True)
    unjudged = unjudged_count(verdicts)
    if unjudged:
        complain(
            f"the candidate left {unjudged} of {len(verdicts)} labelled attempts unjudged (the endpoint did "
            "not answer in time); run calibrate again to ask for those alone"
        )
        return EXIT_UNJUDGED
    return 0


def run(args: argparse.Namespace) -> int:
    """`calibrate` with its errors as one line (exit 2)."""
    try:
        return calibrate(args)
    except (CalibrateError, JudgeSetupError, ValueError) as exc:
        from filter_pipeline.cli.main import error_message

        complain(error_message(exc))
        return EXIT_BAD_INPUT
