"""The assets: load, call a rule, attach metadata, return. The rules themselves live in `filter_pipeline.rules`.

Lineage: execution batch -> judge_verdicts -> failure_pool; judge_verdicts + prior index -> kept, surplus.
(No `from __future__ import annotations` here: Dagster reads the `context` annotation at runtime.)
"""

import inspect
from collections.abc import Iterable

import dagster as dg
import pandas as pd

from filter_pipeline.judge.client import EndpointRefused, JudgeSetupError
from filter_pipeline.judge.driver import ProgressStore, RecordSteps
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules import calibration, checks, filtering, report, verify
from filter_pipeline.rules.batch import EXECUTIONS_FILE, TASKS_FILE, BatchError
from filter_pipeline.rules.commits import CommitRecord, HistoryIntegrityError, another_judge
from filter_pipeline.rules.coverage import coverage_chart, coverage_markdown, coverage_table
from filter_pipeline.rules.descriptions import column_description
from filter_pipeline.rules.history import RETIRED_FILE, HistoryError, parse_retired
from filter_pipeline.rules.schemas import (
    JUDGE_PROGRESS_FOLDER,
    JUDGED_BY,
    JUDGED_INPUTS,
    SCHEMAS,
    file_fingerprint,
    type_name,
)
from filter_pipeline.rules.vocabulary import (
    FAILURE_REASONS,
    REASON_JUDGE_FAIL,
    STAGE_EXECUTE,
    STAGE_JUDGE,
    STATUS_ERROR,
    STATUS_JUDGED,
)
from filter_pipeline.settings import VERIFY_COMMAND
from filter_pipeline.shell.config import (
    COVERAGE_OP,
    caps_source,
    deployment_caps_config,
    refuse_invalid_run_caps,
)
from filter_pipeline.shell.refusals import committed_meanwhile, refuse_before_judging
from filter_pipeline.shell.warehouse import DataRoot, plain_run_ids
from filter_pipeline.storage import failures
from filter_pipeline.storage.audit import audit
from filter_pipeline.storage.history import kept_counts, read_commit, read_retired
from filter_pipeline.storage.labels import read_labels
from filter_pipeline.storage.parquet import read_folder, read_parquet, write_parquet
from filter_pipeline.storage.runs import not_complete, read_batch

run_id_partitions = dg.DynamicPartitionsDefinition(name="run_id")


def column_schema(asset: str) -> dict:
    """Definition metadata showing the asset's fixed Parquet schema, with each column's meaning, in the UI."""
    schema = SCHEMAS[asset]
    return {
        "dagster/column_schema": dg.TableSchema(
            columns=[
                dg.TableColumn(name=f.name, type=type_name(f.type), description=column_description(asset, f.name))
                for f in schema
            ]
        )
    }


def count_by(values: pd.Series, names: Iterable[str], prefix: str) -> dict:
    """One integer metadata entry per name (zeros included, so every materialization plots the same series)."""
    counts = values.value_counts()
    return {f"{prefix}{name}": int(counts.get(name, 0)) for name in names}


# --- the execution batch ----------------------------------------------------------------------------


BATCH_KEYS = [dg.AssetKey(k) for k in ("batch_tasks", "batch_attempts", "batch_rejects")]
# the metadata entry of an asset a run reports as another walk committed it: its line, which the CLI prints
ALREADY_FILTERED = "already_filtered"


def already_filtered_line(record: CommitRecord, when: str, by: str = "another walk") -> str:
    """The line of a run that another walk (or `by`) committed `when` (while this run waited, say), and what
    follows."""
    return f"{record.run_id}: already filtered by {by} (committed, walked at {record.walked_at}) {when}"


def blocking_check(name: str, asset: str, description: str | None) -> dg.AssetCheckSpec:
    """A blocking check; `description` may be a docstring (its indentation is removed: the UI renders markdown)."""
    text = inspect.cleandoc(description) if description else None
    return dg.AssetCheckSpec(name, asset=asset, blocking=True, description=text)


def check_result(check: str, asset: str, outcome: checks.CheckOutcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=check,
        asset_key=asset,
        passed=outcome.passed,
        description=outcome.description,
        metadata=outcome.metadata,
    )


@dg.multi_asset(
    name="judge_batch",
    partitions_def=run_id_partitions,
    # one step, five assets: the batch's tables go to the judge and the failure pool in memory, not through
    # the warehouse
    outs={
        "batch_tasks": dg.AssetOut(
            group_name="batch",
            description="Tasks of the execution batch `runs/<run_id>/tasks.jsonl` that passed validation, "
            "in file order, with the dedup key as canonical JSON text.",
            metadata=column_schema("batch_tasks"),
        ),
        "batch_attempts": dg.AssetOut(
            group_name="batch",
            description="Attempts of `runs/<run_id>/executions.jsonl` that passed validation, in file order: "
            "ok flag, error, trajectory dir, number of actions, backend gate result.",
            metadata=column_schema("batch_attempts"),
        ),
        "batch_rejects": dg.AssetOut(
            group_name="batch",
            description="One row per record of the batch that could not be used (not JSON, mistyped or missing "
            "field, second task_id or (task_id, attempt), attempt of an unknown task): file, line, message.",
            metadata=column_schema("batch_rejects"),
        ),
        "judge_verdicts": dg.AssetOut(
            group_name="judging",
            description="The verdict on each task's ok attempt with the highest number (tasks.jsonl order), from "
            f"the judge resource. status '{STATUS_ERROR}' marks a task that could not be judged: neither kept nor a "
            "failure. "
            f"The LLM judge saves verdicts as they arrive (warehouse/{JUDGE_PROGRESS_FOLDER}/<run_id>/), so a killed run "
            "asks again only what was not saved; evidence says what each verdict was judged from. With prompt v3 "
            "each verdict carries its parts (success, side_effects, looping, blocked, score), key_points and the "
            "judge's reasoning.",
            metadata=column_schema("judge_verdicts"),
        ),
        "failure_pool": dg.AssetOut(
            group_name="judging",
            description=f"Every failed attempt (stage {STAGE_EXECUTE}, reason from the error prefix) and every "
            f"verdict that did not pass (stage {STAGE_JUDGE}, reason {REASON_JUDGE_FAIL}): candidate DPO negatives. "
            "backend_ok rows reached the "
            "goal although the script failed, and blocked judge rows failed because of the site (CAPTCHA, bot "
            "wall, site down), so neither is a clean negative.",
            metadata=column_schema("failure_pool"),
        ),
    },
    internal_asset_deps={
        "batch_tasks": set(),
        "batch_attempts": set(),
        "batch_rejects": set(),
        "judge_verdicts": {dg.AssetKey("batch_tasks"), dg.AssetKey("batch_attempts")},
        "failure_pool": {*BATCH_KEYS, dg.AssetKey("judge_verdicts")},
    },
    check_specs=[
        dg.AssetCheckSpec(
            "all_tasks_judged",
            asset="judge_verdicts",
            description="Every task with an ok attempt got a verdict. A WARN failure: that many tasks could not be "
            "judged (endpoint down, no parseable answer); the batch sensor and `materialize` judge them again "
            "later, with a backoff and a cap on tries.",
        ),
        blocking_check("attempts_conserved", "failure_pool", checks.attempts_conserved.__doc__),
        blocking_check(
            "execute_rows_match_failed_attempts", "failure_pool", checks.execute_rows_match_failed_attempts.__doc__
        ),
    ],
)
def judge_batch(context: dg.AssetExecutionContext, judge: JudgeResource, data: DataRoot):
    """Parse one execution batch (bad records are set aside as rejects, never dropped silently), judge its
    tasks, and pool its failures."""
    [run_id] = plain_run_ids([context.partition_key])
    refuse_before_judging(context, judge, data, run_id)
    previous_file = data.asset_file("judge_verdicts", run_id)
    previous = read_parquet(previous_file) if previous_file.exists() else None  # (what the judge reuses)
    _refuse_another_judge(context, judge, data, run_id, previous)  # (before anything is written)
    batch = _parse(context, data, run_id)
    # in the warehouse before judging starts, however long it takes
    yield from _batch_outputs(batch)
    requests = filtering.attempts_to_judge(batch.tasks, batch.attempts, batch.task_at)
    # a run another walk committed while this one waited, or while it judged: its committed verdicts stand
    committed = committed_meanwhile(context, data, run_id)  # (asked before paying for any verdict)
    judgement = None if committed else _judge(context, judge, data, run_id, requests, previous)
    committed = committed or committed_meanwhile(context, data, run_id)
    if committed:
        verdicts, failures, metadata = _committed_outputs(context, data, committed)
    else:
        verdicts = _verdicts(judgement, judge, batch, run_id)
        executed = filtering.execute_failures(batch.tasks, batch.attempts, batch.task_at)
        failures = pd.concat([executed, filtering.judge_failures(verdicts)], ignore_index=True)
        metadata = (_verdicts_metadata(verdicts, batch, requests, judgement), _failures_metadata(failures))
    yield dg.Output(verdicts, output_name="judge_verdicts", metadata=metadata[0])
    if not committed:  # (a run committed meanwhile keeps this run's saved verdicts: a re-walk reuses them)
        judgement.written()  # (resumed once the IO manager has written the partition: the saved progress is in it)
    yield _all_tasks_judged(verdicts)
    yield dg.Output(failures, output_name="failure_pool", metadata=metadata[1])
    conserved = checks.attempts_conserved(batch.attempt_records, batch.attempts, batch.rejects, verdicts)
    yield check_result("attempts_conserved", "failure_pool", conserved)
    matched = checks.execute_rows_match_failed_attempts(failures, batch.attempts)
    yield check_result("execute_rows_match_failed_attempts", "failure_pool", matched)


def _verdicts(judgement, judge: JudgeResource, batch, run_id: str) -> pd.DataFrame:
    verdicts = judgement.verdicts.assign(backend=judgement.verdicts["backend_detail"], run_id=run_id)
    # written into the verdicts file (its pandas metadata): what the run's commit records as the input judged
    verdicts.attrs[JUDGED_INPUTS] = batch.inputs
    verdicts.attrs[JUDGED_BY] = judge.identity()
    return verdicts


def _committed_outputs(context, data: DataRoot, record: CommitRecord) -> tuple[pd.DataFrame, pd.DataFrame, tuple]:
    """The verdicts and failure pool the committed walk walked, as its files hold them: what this run outputs
    (the same content written again) rather than its own, which would contradict the commit's kept rows."""
    why = already_filtered_line(
        record, "while this run waited or judged: its verdicts and failure pool stand, this run's are not written"
    )
    context.log.info(why)
    frames = [read_parquet(data.asset_file(asset, record.run_id)) for asset in ("judge_verdicts", "failure_pool")]
    metadata = tuple({ALREADY_FILTERED: why, "dagster/row_count": len(frame)} for frame in frames)
    return frames[0], frames[1], metadata


def _verdicts_metadata(verdicts: pd.DataFrame, batch, requests: pd.DataFrame, judgement) -> dict:
    judged = (verdicts["status"] == STATUS_JUDGED).to_numpy(dtype=bool)  # (a mask: no copy of the frame)
    return {
        "judged": int(judged.sum()),
        "passed": int((verdicts["passed"][judged] == True).sum()),  # noqa: E712
        "unjudged": filtering.unjudged_count(verdicts),
        "superseded_ok_attempts": filtering.superseded_ok_attempts(batch.attempts, requests),
        **judgement.metadata,
    }


def _all_tasks_judged(verdicts: pd.DataFrame) -> dg.AssetCheckResult:
    unjudged = filtering.unjudged_count(verdicts)
    return dg.AssetCheckResult(
        check_name="all_tasks_judged",
        asset_key="judge_verdicts",
        passed=unjudged == 0,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"{unjudged} tasks wait to be judged again" if unjudged else "every task was judged",
        metadata={"unjudged": unjudged},
    )


def _failures_metadata(failures: pd.DataFrame) -> dict:
    return {
        **count_by(failures["reason"], FAILURE_REASONS, "reason/"),
        "backend_ok": int(failures["backend_ok"].sum()),
        "blocked": int(failures["blocked"].fillna(False).sum()),
    }


def _parse(context: dg.AssetExecutionContext, data: DataRoot, run_id: str):
    why = not_complete(data.run_dir(run_id))  # (the UI launches any registered partition)
    if why is not None:
        hint = (
            "; nothing is read until it is there: materialize it again once it is complete (the batch sensor "
            "leaves a partition registered by hand to whoever registered it)"
            if data.run_dir(run_id).exists()
            else " (its partition outlived it?)"
        )
        raise dg.Failure(description=f"runs/{run_id} {why}{hint}", allow_retries=False)
    try:
        batch = read_batch(data.run_dir(run_id), run_id)
    except BatchError as exc:
        # recorded, so that later batches stop waiting for this one (CONTRACT §4); its walk, once the batch
        # is fixed, removes the record. One line on the run (no retry: the batch must be fixed first).
        failures.record_failure(data.warehouse, run_id, str(exc), exc.inputs)
        raise dg.Failure(description=str(exc), allow_retries=False) from None  # (the line says it all)
    context.log.info(
        f"parsed runs/{run_id}: {len(batch.tasks)} tasks, {len(batch.attempts)} attempts, "
        f"{len(batch.rejects)} rejected lines in {batch.seconds:.1f} s"
    )
    _warn_each(context, batch.rejects["message"], f"runs/{run_id}: {{n}} more rejected line(s) (batch_rejects)")
    return batch


def _judge(context: dg.AssetExecutionContext, judge: JudgeResource, data: DataRoot, run_id: str, requests, previous):
    """The judgement of `requests` (rows of `filtering.attempts_to_judge`: each task's last ok attempt)."""
    progress = ProgressStore(data.judge_progress(run_id), write=write_parquet)
    try:
        judgement = judge.judge(
            requests,
            data.root,
            record_steps=RecordSteps(data.run_dir(run_id)),
            previous=previous,
            log=context.log,
            progress=progress,
        )
    except (EndpointRefused, JudgeSetupError) as exc:  # one line, no traceback: retrying cannot help
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    return judgement


def _refuse_another_judge(context, judge: JudgeResource, data: DataRoot, run_id: str, previous) -> None:
    """A re-judging of a filtered run's unjudged tasks by a judge other than the one that judged the rest fails
    in one line, before anything is asked or written (`commits.another_judge`: it would judge the run anew). A
    run not filtered (a batch corrected since it was refused) is judged anew whatever judged it before."""
    from filter_pipeline.shell.jobs import REJUDGE_OF_TAG, rejudge_job  # (jobs.py imports this module)

    if not (context.job_name == rejudge_job.name or REJUDGE_OF_TAG in context.run.tags) or previous is None:
        return
    record = read_commit(data.warehouse, run_id)  # (what the sensor and the CLI compare)
    differs = another_judge(record.judge, judge.identity()) if record is not None else None
    if differs:
        raise dg.Failure(
            description=f"{run_id}: its unjudged tasks are judged again only by the judge that judged the rest: "
            f"the run was {differs} (set FILTER_JUDGE_* as they were)",
            allow_retries=False,
        )


def _batch_outputs(batch) -> Iterable[dg.Output]:
    ok = int((batch.attempts["ok"] == True).sum())  # noqa: E712
    yield dg.Output(batch.tasks, output_name="batch_tasks")
    yield dg.Output(
        batch.attempts, output_name="batch_attempts", metadata={"ok": ok, "failed": len(batch.attempts) - ok}
    )
    yield dg.Output(
        batch.rejects,
        output_name="batch_rejects",
        metadata=count_by(batch.rejects["file"], [TASKS_FILE, EXECUTIONS_FILE], "file/"),
    )


# --- training data ----------------------------------------------------------------------------------


def build_coverage(deployment_caps: dict) -> dg.AssetsDefinition:
    """The coverage asset; its caps config defaults to `deployment_caps`, as the ledger's does. The CLI and the
    sensor never change them: coverage is the warehouse's, at the deployment's caps (a run config that does says
    so in `caps_source`)."""
    caps_config = deployment_caps_config(deployment_caps)

    @dg.asset(
        name=COVERAGE_OP,
        group_name="training",
        deps=[dg.AssetKey("kept")],
        description="Kept rows per (macro, site) and per macro over every non-retired committed run, against the site "
        "caps and macro targets: what is full, what is short, by how much (a chart and a table on the "
        "materialization). Refreshed by the batch sensor whenever the set of kept files changes, and by the "
        "retired_sensor when retired.json does.",
        metadata=column_schema("coverage"),
    )
    def coverage(context: dg.AssetExecutionContext, config: caps_config, data: DataRoot):
        refuse_invalid_run_caps(context)
        try:
            retired = read_retired(data.root)
            counts, runs = kept_counts(data.root, parse_retired(retired))
        except (HistoryIntegrityError, HistoryError) as exc:  # (no count can be trusted: a retry changes nothing)
            raise dg.Failure(
                description=f"{exc} (coverage is not counted until then; `{VERIFY_COMMAND}` lists every finding)",
                allow_retries=False,
            ) from None
        table = coverage_table(counts, config.to_caps())
        sites = table[table["level"] == "site"]
        return dg.Output(
            table,
            metadata={
                "kept": int(sites["kept"].sum()),
                "runs": runs,
                "caps_source": caps_source(config, deployment_caps),
                RETIRED_FINGERPRINT: file_fingerprint(retired, RETIRED_FILE),
                "full_sites": int(sites["full"].sum()),
                "short_sites": int((~sites["full"].astype(bool)).sum()),
                "coverage": dg.MetadataValue.md(
                    report.image_md("kept per macro", coverage_chart(table)) + "\n\n" + coverage_markdown(table)
                ),
            },
        )

    return coverage


# the audit of the whole warehouse, a check on coverage (jobs.py leaves it out of a batch's runs)
WAREHOUSE_VERIFIED = dg.AssetCheckKey(dg.AssetKey("coverage"), "warehouse_verified")


@dg.asset_check(
    asset=WAREHOUSE_VERIFIED.asset_key,
    name=WAREHOUSE_VERIFIED.name,
    description="The audit of the whole warehouse, as `filter-pipeline verify` does it (a warning when it finds "
    "anything). " + inspect.cleandoc(verify.__doc__ or "").split("\n\n")[1],
)
def warehouse_verified(data: DataRoot) -> dg.AssetCheckResult:
    """The audit of `filter-pipeline verify`, over the whole warehouse. Its own step, outside the batch's
    runs (its cost grows with the warehouse, the batch's with the batch): `across_runs_job` runs it, so the
    sensor does after every change of the kept files, and the UI can at any time."""
    findings = audit(data.root)
    return dg.AssetCheckResult(
        passed=not findings,
        severity=dg.AssetCheckSeverity.WARN,
        description="\n".join(f.line for f in findings)
        or "every committed file present and unchanged, no key kept twice, caps respected, verdicts conserved, "
        "no uncommitted kept file, no publish left half done, no batch changed since filtered",
        metadata={
            "findings": len(findings),
            **{f"findings/{kind}": sum(f.kind == kind for f in findings) for kind in verify.FINDING_KINDS},
            "changed_batches": dg.MetadataValue.md(
                "\n".join(f"- {f.line}" for f in findings if f.kind == "changed") or "none"
            ),
        },
    )


# --- reports ----------------------------------------------------------------------------------------


LABELS_FINGERPRINT = "labels_fingerprint"  # judge_calibration's metadata entry: the labels it was built from
RETIRED_FINGERPRINT = "retired_fingerprint"  # coverage's metadata entry: the retired.json it was built from
# judge_calibration's fingerprint of a labels.jsonl that cannot be read (a folder, no permission): built without it
LABELS_UNREADABLE = f"unreadable {calibration.LABELS_FILE}"


@dg.asset(
    group_name="reports",
    deps=[dg.AssetKey("judge_verdicts"), dg.AssetKey("batch_attempts"), dg.AssetKey("batch_tasks")],
    description="When <data>/labels.jsonl holds human labels ({dir | run_id + task_id, success}), the judge "
    "(per model and prompt version) and the gate scored against them, per site and overall: precision with "
    "its Wilson 95% interval first, recall (with its interval), F1, Cohen's kappa, the pass-rate gap, counts; "
    "whether to trust the judge before a large run. The latest label of an attempt counts; unsure labels "
    "(success null) do not. Refreshed when labels.jsonl changes (labels_sensor, `materialize` naming no run).",
    metadata=column_schema("judge_calibration"),
)
def judge_calibration(context: dg.AssetExecutionContext, data: DataRoot) -> dg.Output[pd.DataFrame]:
    """Lines of labels.jsonl that are not labels are reported (a count, the first lines, a warning each), and
    a labels.jsonl that cannot be read is warned: never a failure, the batch's run stays a success."""
    try:
        raw = read_labels(data.root)
        fingerprint = {LABELS_FINGERPRINT: file_fingerprint(raw, calibration.LABELS_FILE)}
    except ValueError as exc:  # (a folder, no permission)
        context.log.warning(f"{exc}: no label counts until it can be")
        raw, fingerprint = None, {LABELS_FINGERPRINT: LABELS_UNREADABLE}
    verdicts_dir = data.warehouse / "judge_verdicts"
    if raw is None or not verdicts_dir.exists():
        return dg.Output(
            calibration.calibration(pd.DataFrame()),
            metadata={"labels": 0, "matched": 0, "unmatched": 0, "rejected_lines": 0, **fingerprint},
        )
    labels, rejects = calibration.parse_labels(raw)
    shown = _warn_each(context, rejects, f"{calibration.LABELS_FILE}: {{n}} more line(s) rejected")
    attempts, verdicts, tasks = read_for_calibration(data, labels)
    unmatched = calibration.unmatched_labels(labels, attempts, tasks)
    _warn_each(context, unmatched, f"{calibration.LABELS_FILE}: {{n}} more label(s) name no attempt of a parsed batch")
    resolved = calibration.resolve(labels, attempts, verdicts, tasks)
    table = calibration.calibration(resolved)
    metadata = {"labels": len(labels), "matched": len(resolved), "unmatched": len(unmatched),
                "rejected_lines": len(rejects), **fingerprint}  # fmt: skip
    metadata["calibration"] = dg.MetadataValue.md(calibration.markdown(table))
    if rejects:
        metadata["rejects"] = dg.MetadataValue.md("\n".join(f"- `{m}`" for m in shown))
    return dg.Output(table, metadata=metadata)


def _warn_each(context: dg.AssetExecutionContext, messages: list[str] | pd.Series, more: str) -> list[str]:
    """A warning per message, up to MAX_REJECTS_SHOWN of them, then `more` saying how many were not shown (its
    `{n}`); the ones shown."""
    shown = list(messages[: calibration.MAX_REJECTS_SHOWN])  # (a Series: sliced by position)
    for message in shown:
        context.log.warning(message)
    if len(messages) > len(shown):
        context.log.warning(more.format(n=len(messages) - len(shown)))
    return shown


def read_for_calibration(data: DataRoot, labels: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(attempts the labels name by dir, every verdict, every task) from the warehouse: what
    calibration.resolve needs."""
    read = lambda asset, **kw: read_folder(data.warehouse / asset, calibration.RESOLVE_COLUMNS[asset], **kw)  # noqa: E731
    dirs = labels["dir"].dropna().tolist() or [""]
    return read("batch_attempts", filters=[("dir", "in", dirs)]), read("judge_verdicts"), read("batch_tasks")
