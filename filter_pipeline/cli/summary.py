"""What `filter-pipeline materialize` prints of its runs: a line per batch (or why its run failed, and where
its full log is), then coverage and the judge's calibration."""

import os

import dagster as dg

from filter_pipeline.rules import calibration as calibration_rules
from filter_pipeline.rules.filtering import unjudged_count
from filter_pipeline.rules.vocabulary import DROPPED_REASONS, FAILURE_REASONS
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.parquet import read_parquet


def summarize(data: DataRoot, run_id: str) -> str:
    """One line: judged, kept, surplus by reason, failure_pool rows by reason (reasons with zero rows left out), and the
    lines the batch checks rejected when there are any."""

    def counts(asset: str, column: str, names) -> tuple[int, str]:
        values = read_parquet(data.asset_file(asset, run_id), columns=[column])[column].value_counts()
        detail = ", ".join(f"{n} {values[n]}" for n in names if values.get(n, 0))
        return int(values.sum()), f" ({detail})" if detail else ""

    verdicts = read_parquet(data.asset_file("judge_verdicts", run_id), columns=["status"])
    unjudged = unjudged_count(verdicts)
    n_kept = len(read_parquet(data.asset_file("kept", run_id), columns=["task_id"]))
    n_surplus, surplus_detail = counts("surplus", "dropped", DROPPED_REASONS)
    n_fail, fail_detail = counts("failure_pool", "reason", FAILURE_REASONS)
    n_rejected = len(read_parquet(data.asset_file("batch_rejects", run_id), columns=["line"]))
    return (
        f"{run_id}: judged {len(verdicts) - unjudged}, unjudged {unjudged}, kept {n_kept}, "
        f"surplus {n_surplus}{surplus_detail}, failure_pool {n_fail}{fail_detail}"
        + (f", rejected lines {n_rejected} (batch_rejects)" if n_rejected else "")
    )


def failure_reason(result) -> str:
    """The first failed step and its error, and where the run's full log is, in one line (result: an
    execute_job result)."""
    return f"{_failed_step(result)}; full log: {where_the_log_is(result.run_id)}"


def where_the_log_is(run_id: str) -> str:
    """Where a run's event log, stack traces included, can be read."""
    return (
        f"run {run_id} on the instance at $DAGSTER_HOME ({os.environ.get('DAGSTER_HOME')}): "
        f"`dagster dev` shows it at /runs/{run_id}, `dagster debug export {run_id} run.gz` saves it"
    )


def _failed_step(result) -> str:
    for event in result.all_events:
        if event.event_type == dg.DagsterEventType.STEP_FAILURE:
            error = event.step_failure_data.error
            # Dagster wraps what user code raised (in a step, an IO manager, a resource, a type check): the
            # cause says why
            while error.cause is not None and (error.cls_name or "").startswith("Dagster"):
                error = error.cause
            message = error.message.strip().splitlines()[-1] if error.message.strip() else error.cls_name
            qualified, _, text = message.partition(": ")
            if qualified.endswith(error.cls_name or "\0") and text:
                message = text  # "pkg.module.BatchError: why" -> "why"
            return f"step {event.step_key}: {message}"
    return "run failed"


def print_across_runs(data: DataRoot) -> None:
    """A line for coverage and one per judge calibration predictor, from what was just materialized."""
    print_coverage(data)
    print_calibration(data)


def print_coverage(data: DataRoot) -> None:
    coverage = read_parquet(data.warehouse / "coverage.parquet")
    sites = coverage[coverage["level"] == "site"]
    print(
        f"coverage: {int(sites['kept'].sum())} kept rows over {len(sites)} (macro, site) pairs, "
        f"{int(sites['full'].sum())} full",
        flush=True,
    )


def print_calibration(data: DataRoot) -> None:
    """One line per judge calibration predictor (overall), precision and its interval first; one line saying so
    when labels.jsonl is there but no label of it counts."""
    calibration = read_parquet(data.warehouse / "judge_calibration.parquet")
    overall = calibration[calibration["site"] == calibration_rules.ALL_SITES].to_dict("records")
    for row in overall:
        print(f"judge_calibration: {calibration_rules.who(row)}: {calibration_rules.summary(row)}", flush=True)
    if not overall and (data.root / calibration_rules.LABELS_FILE).exists():
        print(
            f"judge_calibration: no label of {calibration_rules.LABELS_FILE} counts yet (unreadable, or no success "
            "or failure label of a judged attempt in it; the step's warnings name the lines it could not use)",
            flush=True,
        )
