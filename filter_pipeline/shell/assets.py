"""The assets: load, call a rule, attach metadata, return. The rules themselves live in `filter_pipeline.rules`.

Lineage: execution batch -> judge_verdicts -> failure_pool; judge_verdicts + prior index -> kept, surplus.
(No `from __future__ import annotations` here: Dagster reads the `context` annotation at runtime.)
"""

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from filter_pipeline.rules import calibration
from filter_pipeline.rules import checks
from filter_pipeline.rules import dpo
from filter_pipeline.rules import report
from filter_pipeline.rules import filtering
from filter_pipeline.rules.batch import EXECUTIONS_FILE, TASKS_FILE, count_records, read_batch
from filter_pipeline.shell.config import CapsConfig
from filter_pipeline.shell.jobs import PRIORITY_TAG
from filter_pipeline.rules.coverage import coverage_chart, coverage_markdown, coverage_table
from filter_pipeline.rules.history import build_prior_index, load_retired
from filter_pipeline.judge.driver import ProgressStore, RecordSteps
from filter_pipeline.judge.client import EndpointRefused
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules.schemas import (
    DROPPED_REASONS, FAILURE_REASONS, SCHEMAS, STATUS_ERROR, STATUS_JUDGED, dictionary_columns, statistics_columns, to_arrow,
)  # fmt: skip
from filter_pipeline.rules import commits
from filter_pipeline.rules import verify
from filter_pipeline.rules.commits import atomic_write, delete_commit, file_entry, write_commit
from filter_pipeline.rules.lease import Lease, acquire_or_wait
from filter_pipeline.shell.config import CAPS_ENV, load_caps_file
from filter_pipeline.shell.warehouse import DataRoot, read_folder, read_parquet, write_atomically, write_parquet
from filter_pipeline.rules.schemas import COLUMN_DESCRIPTIONS

run_id_partitions = dg.DynamicPartitionsDefinition(name="run_id")


def column_schema(asset: str) -> dict:
    """Definition metadata showing the asset's fixed Parquet schema, with each column's meaning, in the UI."""
    schema = SCHEMAS[asset]
    return {
        "dagster/column_schema": dg.TableSchema(
            columns=[
                dg.TableColumn(name=f.name, type=str(f.type), description=COLUMN_DESCRIPTIONS.get(f.name))
                for f in schema
            ]
        )
    }


def count_by(values: pd.Series, names: Iterable[str], prefix: str) -> dict:
    """One integer metadata entry per name (zeros included, so every materialization plots the same series)."""
    counts = values.value_counts()
    return {f"{prefix}{name}": int(counts.get(name, 0)) for name in names}


# --- the execution batch ----------------------------------------------------------------------------


@dg.multi_asset(
    partitions_def=run_id_partitions,
    group_name="batch",
    outs={
        "batch_tasks": dg.AssetOut(
            description="Tasks of the execution batch `runs/<run_id>/tasks.jsonl` that passed validation, "
            "in file order, with the dedup key as canonical JSON text.",
            metadata=column_schema("batch_tasks"),
        ),
        "batch_attempts": dg.AssetOut(
            description="Attempts of `runs/<run_id>/executions.jsonl` that passed validation, in file order: "
            "ok flag, error, trajectory dir, number of actions, backend gate result.",
            metadata=column_schema("batch_attempts"),
        ),
        "batch_rejects": dg.AssetOut(
            description="One row per record of the batch that could not be used (not JSON, mistyped or missing "
            "field, second task_id or (task_id, attempt), attempt of an unknown task): file, line, message.",
            metadata=column_schema("batch_rejects"),
        ),
    },
)
def execution_batch(context: dg.AssetExecutionContext, data: DataRoot):
    """Parse one execution batch; bad records are set aside as rejects, never dropped silently."""
    run_id = context.partition_key
    load_retired(data.root)  # a broken retired.json fails the run here, before anything is written
    batch = read_batch(data.run_dir(run_id), run_id)
    context.log.info(
        f"parsed runs/{run_id}: {len(batch.tasks)} tasks, {len(batch.attempts)} attempts, "
        f"{len(batch.rejects)} rejected lines in {batch.seconds:.1f} s"
        + (" (read ahead by the CLI while the run started)" if batch.read_ahead else "")
    )
    for message in batch.rejects["message"].head(20):
        context.log.warning(message)
    ok = int((batch.attempts["ok"] == True).sum())  # noqa: E712
    yield dg.Output(batch.tasks, output_name="batch_tasks")
    yield dg.Output(
        batch.attempts, output_name="batch_attempts", metadata={"ok": ok, "failed": len(batch.attempts) - ok}
    )
    yield dg.Output(batch.rejects, output_name="batch_rejects", metadata=count_by(batch.rejects["file"], [TASKS_FILE, EXECUTIONS_FILE], "file/"))


# --- judging ----------------------------------------------------------------------------------------


JUDGE_PROGRESS_FOLDER = "_judge_progress"  # warehouse/_judge_progress/<run_id>/: verdicts saved as they arrive


@dg.asset(
    partitions_def=run_id_partitions,
    group_name="judging",
    description="The verdict on each task's ok attempt with the highest number (tasks.jsonl order), from the "
    "judge resource. status 'error' marks a task that could not be judged: neither kept nor a failure. The LLM "
    "judge saves verdicts as they arrive (warehouse/_judge_progress/<run_id>/), so a killed run asks again only "
    "what was not saved; evidence says what each verdict was judged from.",
    metadata=column_schema("judge_verdicts"),
)
def judge_verdicts(
    context: dg.AssetExecutionContext,
    batch_tasks: pd.DataFrame,
    batch_attempts: pd.DataFrame,
    judge: JudgeResource,
    data: DataRoot,
):
    run_id = context.partition_key
    requests = filtering.attempts_to_judge(batch_tasks, batch_attempts)
    previous_file = data.asset_file("judge_verdicts", run_id)
    progress = ProgressStore(data.warehouse / JUDGE_PROGRESS_FOLDER / run_id, write=write_parquet)
    try:
        judgement = judge.judge(
            requests,
            data.root,
            record_steps=RecordSteps(data.run_dir(run_id)),
            previous=read_parquet(previous_file) if previous_file.exists() else None,
            log=context.log,
            progress=progress,
        )
    except EndpointRefused as exc:  # one line, no traceback: the endpoint refuses, retrying cannot help
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    verdicts = judgement.verdicts.assign(backend=judgement.verdicts["backend_detail"], run_id=run_id)
    judged = verdicts[verdicts["status"] == STATUS_JUDGED]
    yield dg.Output(
        verdicts,
        metadata={
            "judged": len(judged),
            "passed": int((judged["passed"] == True).sum()),  # noqa: E712
            "unjudged": int((verdicts["status"] == STATUS_ERROR).sum()),
            "superseded_ok_attempts": filtering.superseded_ok_attempts(batch_attempts, requests),
            **judgement.metadata,
        },
    )
    # resumed after the IO manager has written the partition: the saved progress is in it now
    judgement.written()


def check_result(check: str, asset: str, outcome: checks.CheckOutcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=check,
        asset_key=asset,
        passed=outcome.passed,
        description=outcome.description,
        metadata=outcome.metadata,
    )


def outputs_then_checks(outputs: list[dg.Output], checks_of: dict[tuple[str, str], Callable[[], checks.CheckOutcome]]):
    """Yield the outputs, then the result of each (check, asset) in `checks_of`. The checks are computed in a
    second thread while the IO manager writes the outputs: Parquet encoding runs without the GIL, so on two
    cores the checks add little wall time. (They read the in-memory frames, the same ones written.)"""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checks") as alongside:
        pending = {key: alongside.submit(compute) for key, compute in checks_of.items()}
        yield from outputs
        for (check, asset), outcome in pending.items():
            yield check_result(check, asset, outcome.result())


def blocking_check(name: str, asset: str, description: str) -> dg.AssetCheckSpec:
    return dg.AssetCheckSpec(name, asset=asset, blocking=True, description=description)


@dg.asset(
    partitions_def=run_id_partitions,
    group_name="judging",
    description="Every failed attempt (stage execute, reason from the error prefix) and every verdict that did not "
    "pass (stage judge, reason judge_fail): candidate DPO negatives. backend_ok rows reached the goal although "
    "the script failed, so they are not clean negatives.",
    metadata=column_schema("failure_pool"),
    check_specs=[
        blocking_check("attempts_conserved", "failure_pool", checks.attempts_conserved.__doc__),
        blocking_check("execute_rows_match_failed_attempts", "failure_pool", checks.execute_rows_match_failed_attempts.__doc__),
    ],
)
def failure_pool(
    context: dg.AssetExecutionContext,
    batch_tasks: pd.DataFrame,
    batch_attempts: pd.DataFrame,
    batch_rejects: pd.DataFrame,
    judge_verdicts: pd.DataFrame,
    data: DataRoot,
):
    pool = pd.concat(
        [filtering.execute_failures(batch_tasks, batch_attempts), filtering.judge_failures(judge_verdicts)],
        ignore_index=True,
    )
    run_dir = data.run_dir(context.partition_key)
    metadata = {**count_by(pool["reason"], FAILURE_REASONS, "reason/"), "backend_ok": int((pool["backend_ok"] == True).sum())}  # noqa: E712
    yield from outputs_then_checks(
        [dg.Output(pool, metadata=metadata)],
        {
            ("attempts_conserved", "failure_pool"): lambda: checks.attempts_conserved(
                count_records(run_dir), batch_attempts, batch_rejects, judge_verdicts
            ),
            ("execute_rows_match_failed_attempts", "failure_pool"): lambda: checks.execute_rows_match_failed_attempts(pool, batch_attempts),
        },
    )


# --- the ledger -------------------------------------------------------------------------------------


class LedgerConfig(CapsConfig):
    """Caps of the walk, and which failed attempts may be the rejected side of a DPO pair."""

    include_judge_failures: bool = Field(
        default=False,
        description="DPO pairs: also pair judge failures, whose backend gate passed (the judge and the gate "
        "disagree there).",
    )


_WALK_INPUTS = [dg.AssetKey("judge_verdicts"), dg.AssetKey("prior_dedup_index"), dg.AssetKey("prior_kept_counts")]


def _ledger_spec(name: str, description: str, deps: list, group: str = "ledger") -> dg.AssetSpec:
    return dg.AssetSpec(name, description=description, deps=deps, group_name=group, metadata=column_schema(name))


@dg.multi_asset(
    name="ledger",
    partitions_def=run_id_partitions,
    # first among the steps ready beside it (judge_calibration): the longest of them
    op_tags={PRIORITY_TAG: "1"},
    # (whole frames: in one process the IO manager hands over the tables it just wrote, without reading them;
    # an input that also is a spec's dep cannot narrow its columns)
    ins={"judge_verdicts": dg.AssetIn(), "failure_pool": dg.AssetIn(), "batch_attempts": dg.AssetIn()},
    specs=[
        _ledger_spec(
            "prior_dedup_index",
            "Keys kept by every other committed run (plus legacy runs/*/kept.jsonl, minus retired.json) that this "
            "batch's verdicts carry, with the run and task that kept each. Read straight from the warehouse, "
            "verified against each run's commit record, not as an asset input: an asset cannot depend on other "
            "partitions of its own downstream `kept`.",
            ["judge_verdicts"],
        ),
        _ledger_spec("prior_kept_counts", "Kept rows per (macro, site) over every other committed run, minus "
                     "retired: where the caps start.", []),  # fmt: skip
        _ledger_spec(
            "kept",
            "Passing verdicts kept as training data: not a duplicate of anything kept before (same site, target "
            "element, argument) and under the site cap and macro target, history included.",
            _WALK_INPUTS,
        ),
        _ledger_spec(
            "surplus",
            "Passing verdicts dropped only by dedup or a cap: dropped = duplicate / site_cap / target; duplicates "
            "name the run and task that kept the key first.",
            _WALK_INPUTS,
        ),
        _ledger_spec(
            "dpo_pairs",
            "DPO pairs: chosen = a kept trajectory, rejected = a failed attempt of the same task that is a clean "
            "negative (not backend_ok, not unjudged; judge failures only if configured).",
            ["failure_pool", "kept"],
            group="training",
        ),
        _ledger_spec(
            "filter_report",
            "The run at a glance: funnel (attempts -> ok attempts -> judged -> passed -> kept), keep rate and "
            "failure reasons per site and macro, surplus by reason, judge pass rate and agreement with the gate, "
            "cost. Charts show on the materialization; a standalone page is written to "
            "warehouse/filter_report_html/.",
            ["batch_attempts", "judge_verdicts", "failure_pool", "kept", "surplus"],
            group="reports",
        ),
    ],
    check_specs=[
        blocking_check("verdicts_conserved", "kept", checks.verdicts_conserved.__doc__),
        blocking_check("no_key_kept_twice", "kept", checks.no_key_kept_twice.__doc__),
        blocking_check("caps_respected", "kept", checks.caps_respected.__doc__),
    ],
)
def ledger(
    context: dg.AssetExecutionContext,
    config: LedgerConfig,
    data: DataRoot,
    judge_verdicts: pd.DataFrame,
    failure_pool: pd.DataFrame,
    batch_attempts: pd.DataFrame,
):
    """Walk the run's verdicts against committed history, write everything derived from the walk, then
    commit it (warehouse/_commits/<run_id>.json), all under the warehouse's ledger lease: walks on one data
    root never overlap, whichever process, instance or machine runs them. A run is filtered only once its
    commit is written; a walk killed before that leaves the run pending, to be walked again from its inputs."""
    run_id = context.partition_key
    holder = f"the ledger walk of {run_id} (Dagster run {context.run.run_id})"
    # (the place for an order check: which lower runs this walk waits for)
    with acquire_or_wait(data.root, holder, log=context.log.info) as lease:
        yield from _walk_the_ledger(
            context, config, data, run_id, judge_verdicts, caps_source(config), failure_pool, batch_attempts, lease
        )


def caps_source(config: CapsConfig) -> str:
    """'deployment' when the walk's caps are the deployment's (FILTER_PIPELINE_CAPS, else the defaults),
    else 'run config'."""
    path = os.environ.get(CAPS_ENV)
    deployment = CapsConfig(**(load_caps_file(path) if path else {})).to_caps()
    return "deployment" if config.to_caps() == deployment else "run config"


def judge_settings(verdicts: pd.DataFrame) -> dict:
    """Which judge decided the walked verdicts (kind, model, prompt version, votes per task); never its key."""
    def first(column: str):
        values = verdicts[column].dropna().unique() if column in verdicts else []
        return str(values[0]) if len(values) else None

    votes = first("votes")
    return {"kind": first("judge"), "model": first("model"), "prompt_version": first("prompt_version"),
            "votes": votes.partition("/")[2] or votes if votes else None}  # fmt: skip


def _parquet_bytes(frame: pd.DataFrame, asset: str) -> tuple[pa.Buffer, int]:
    table = to_arrow(frame, asset)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, use_dictionary=dictionary_columns(asset), write_statistics=statistics_columns(asset))
    return sink.getvalue(), table.num_rows


def _walk_the_ledger(
    context: dg.AssetExecutionContext,
    config: LedgerConfig,
    data: DataRoot,
    run_id: str,
    judge_verdicts: pd.DataFrame,
    source: str,
    failure_pool: pd.DataFrame,
    batch_attempts: pd.DataFrame,
    lease: Lease | None = None,
):
    """One run's walk (the caller holds the lease): history, the walk, every file derived from it written
    atomically, their checks, then the commit record, then one materialization per asset and the checks'
    results. `source`: where the caps came from ("deployment" or "run config"), recorded in the commit;
    `lease`: the held lease, checked just before committing (on object storage a holder that stalled past its
    expiry may have lost it: it must not commit)."""
    # two threads beside the walk: the inputs' hashes (hashlib and Arrow run without the GIL), and the checks
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ledger") as alongside:
        # the inputs' hashes, for telling later whether the batch changed since it was filtered
        inputs = alongside.submit(commits.input_fingerprints, data.run_dir(run_id))
        retired = load_retired(data.root)
        index = build_prior_index(data.root, run_id, judge_verdicts[["dedup_key", "key_hash"]], retired)
        context.log.info(
            f"prior index: {index.rows_read} kept rows of {index.runs_read} other runs; "
            f"{len(index.keys)} of them share a key with this batch"
        )
        caps = config.to_caps()
        result = filtering.walk_ledger(judge_verdicts, index.keys, index.counts, caps, run_id)
        context.log.info(f"walk: kept {len(result.kept)}, surplus {len(result.surplus)}")
        pending = {
            ("verdicts_conserved", "kept"): alongside.submit(checks.verdicts_conserved, judge_verdicts, result.kept, result.surplus),
            # against the index this step built (it holds every earlier keeper of any key this batch carries)
            ("no_key_kept_twice", "kept"): alongside.submit(checks.no_key_kept_twice, result.kept, index.keys),
            ("caps_respected", "kept"): alongside.submit(checks.caps_respected, result.kept, index.counts, caps),
        }
        pairs = dpo.dpo_pairs(result.kept, failure_pool, include_judge_failures=config.include_judge_failures)
        figures = report.figures(batch_attempts, judge_verdicts, failure_pool, result.kept, result.surplus)
        images = report.charts(figures)
        frames = {
            "prior_dedup_index": (index.keys, {"runs_read": index.runs_read, "rows_read": index.rows_read}),
            "prior_kept_counts": (index.counts, {"kept_before": int(index.counts["n_kept"].sum())}),
            "kept": (result.kept, {"caps_source": source}),
            "surplus": (result.surplus, count_by(result.surplus["dropped"], DROPPED_REASONS, "dropped/")),
            "dpo_pairs": (pairs.pairs, {"kept_without_clean_negative": pairs.kept_without_negative,
                                        **{f"excluded/{reason}": n for reason, n in pairs.excluded.items()}}),  # fmt: skip
            "filter_report": (
                report.long_form(figures).assign(run_id=run_id),
                {"report": dg.MetadataValue.md(report.markdown(figures, images, run_id)),
                 **{f"funnel/{s}": int(c) for s, c in zip(figures.funnel["step"], figures.funnel["count"])}},
            ),  # fmt: skip
        }
        files: dict[str, dict] = {}
        writing = time.perf_counter()
        # pending from the first write until committed again (not before: a walk that fails on history leaves
        # an already filtered run's commit, and so its place in everyone's history, as it was)
        delete_commit(data.warehouse, run_id)
        for asset, (frame, _) in frames.items():
            path = data.asset_file(asset, run_id)
            encoded, rows = _parquet_bytes(frame, asset)
            atomic_write(path, encoded)
            files[asset] = file_entry(data.root, path, encoded, rows)
        page = data.warehouse / "filter_report_html" / f"{run_id}.html"
        html = report.html(figures, images, run_id).encode()
        atomic_write(page, html)
        files["filter_report_html"] = file_entry(data.root, page, html, 0)
        context.log.info(f"wrote {len(files)} files in {time.perf_counter() - writing:.2f} s")
        frames["filter_report"][1]["html"] = dg.MetadataValue.path(str(page))
        outcomes = {key: future.result() for key, future in pending.items()}
        if all(outcome.passed for outcome in outcomes.values()):
            # Only a walk whose invariants held becomes history; one that broke them fails on its checks.
            record = commits.CommitRecord(
                run_id=run_id,
                walked_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                files=files,
                kept_keys=int(result.kept["dedup_key"].nunique()),
                caps={k: v for k, v in config.model_dump().items() if k in CapsConfig.model_fields},
                caps_source=source,
                judge=judge_settings(judge_verdicts),
                history=index.history,
                inputs=inputs.result(),
                unjudged=int((judge_verdicts["status"] == STATUS_ERROR).sum()),
            )
            if lease is not None:
                lease.check()
            write_commit(data.warehouse, record)
            context.log.info(f"committed {run_id}: warehouse/{commits.COMMITS_DIR}/{run_id}.json")
    for asset, (frame, metadata) in frames.items():
        yield dg.MaterializeResult(
            asset_key=asset,
            metadata={**metadata, "dagster/row_count": len(frame), "sha256": files[asset]["sha256"]},
        )
    for (check, asset), outcome in outcomes.items():
        yield check_result(check, asset, outcome)


# --- training data ----------------------------------------------------------------------------------


@dg.asset(
    group_name="training",
    deps=[dg.AssetKey("kept")],
    description="Kept rows per (macro, site) and per macro over every non-retired committed run, against the site "
    "caps and macro targets: what is full, what is short, by how much (a chart and a table on the "
    "materialization). Refreshed by the batch sensor whenever the set of kept files changes.",
    metadata=column_schema("coverage"),
    check_specs=[dg.AssetCheckSpec("warehouse_verified", asset="coverage", description=verify.audit.__doc__ + " " + (verify.__doc__ or "").split("\n\n")[1])],
)
def coverage(config: CapsConfig, data: DataRoot):
    no_keys = pd.DataFrame({"dedup_key": pd.Series([], dtype=object), "key_hash": pd.Series([], dtype="int64")})
    index = build_prior_index(data.root, "", no_keys, load_retired(data.root))
    table = coverage_table(index.counts, config.to_caps())
    sites = table[table["level"] == "site"]
    yield dg.Output(
        table,
        metadata={
            "kept": int(sites["kept"].sum()),
            "runs": index.runs_read,
            "full_sites": int(sites["full"].sum()),
            "short_sites": int((~sites["full"].astype(bool)).sum()),
            "coverage": dg.MetadataValue.md(
                report.image_md("kept per macro", coverage_chart(table)) + "\n\n" + coverage_markdown(table)
            ),
        },
    )
    findings = verify.audit(data.root)
    yield dg.AssetCheckResult(
        check_name="warehouse_verified",
        passed=not findings,
        description="\n".join(f.line for f in findings) or "every committed file present and unchanged, no key kept "
        "twice, caps respected, verdicts conserved, no uncommitted kept file, no batch changed since filtered",
        metadata={
            "findings": len(findings),
            **{f"findings/{kind}": sum(f.kind == kind for f in findings) for kind in verify.FINDING_KINDS},
            "changed_batches": dg.MetadataValue.md(
                "\n".join(f"- {f.line}" for f in findings if f.kind == "changed") or "none"
            ),
        },
    )


# --- reports ----------------------------------------------------------------------------------------


@dg.asset(
    group_name="reports",
    deps=[dg.AssetKey("judge_verdicts"), dg.AssetKey("batch_attempts"), dg.AssetKey("batch_tasks")],
    description="When <data>/labels.jsonl holds human labels ({dir | run_id + task_id, success}), precision, "
    "recall and agreement of the judge and of the gate against them, per site and overall, with counts: "
    "whether to trust the judge before a large run.",
    metadata=column_schema("judge_calibration"),
)
def judge_calibration(context: dg.AssetExecutionContext, data: DataRoot) -> dg.Output[pd.DataFrame]:
    """Lines of labels.jsonl that are not labels are reported (a count, the first lines, a warning each),
    never a failure: the batch's run stays a success."""
    labels_path = data.root / calibration.LABELS_FILE
    verdicts_dir = data.warehouse / "judge_verdicts"
    if not labels_path.exists() or not verdicts_dir.exists():
        return dg.Output(calibration.calibration(pd.DataFrame()), metadata={"labels": 0, "matched": 0, "rejected_lines": 0})
    labels, rejects = calibration.parse_labels(labels_path.read_bytes())
    shown = rejects[: calibration.MAX_REJECTS_SHOWN]
    for message in shown:
        context.log.warning(message)
    if len(rejects) > len(shown):
        context.log.warning(f"{calibration.LABELS_FILE}: {len(rejects) - len(shown)} more line(s) rejected")
    read = lambda asset, columns, **kw: read_folder(data.warehouse / asset, columns, **kw)  # noqa: E731
    dirs = labels["dir"].dropna().tolist() or [""]
    resolved = calibration.resolve(
        labels,
        read("batch_attempts", ["run_id", "task_id", "dir", "ok"], filters=[("dir", "in", dirs)]),
        read("judge_verdicts", ["run_id", "task_id", "dir", "passed", "status"]),
        read("batch_tasks", ["run_id", "task_id", "site"]),
    )
    table = calibration.calibration(resolved)
    metadata = {"labels": len(labels), "matched": len(resolved), "rejected_lines": len(rejects)}
    if rejects:
        metadata["rejects"] = dg.MetadataValue.md("\n".join(f"- `{m}`" for m in shown))
    return dg.Output(table, metadata=metadata)
