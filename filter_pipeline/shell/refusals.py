"""What the judge step refuses, in one line, before it reads, judges or writes anything, and the commit of a run
another walk made while this Dagster run waited or judged (whose committed outputs then stand)."""

import dagster as dg

from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules.batch import LEGACY_KEPT_FILE
from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.rules.history import HistoryError
from filter_pipeline.settings import JUDGE_LLM, materialize_command
from filter_pipeline.shell.config import LEDGER_OP, refuse_invalid_run_caps
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.history import load_retired
from filter_pipeline.storage.publish import commit_state


def refuse_before_judging(context: dg.AssetExecutionContext, judge: JudgeResource, data: DataRoot, run_id: str):
    """Fail the step in one line, before anything is read, judged or written, on caps in the run config that
    are not valid, a broken retired.json, an LLM judge whose settings cannot work (no endpoint or model, votes
    at temperature 0, ...), or a filtered run this Dagster run would judge without walking it again."""
    refuse_invalid_run_caps(context)
    try:
        load_retired(data.root)
        if judge.kind == JUDGE_LLM:
            judge.settings()
    except (HistoryError, ValueError) as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    _refuse_judging_a_filtered_run_alone(context, data, run_id)


def _refuse_judging_a_filtered_run_alone(context: dg.AssetExecutionContext, data: DataRoot, run_id: str) -> None:
    """A run filtered before this Dagster run was created, judged by a run that does not walk it (`judge_job`,
    the judging assets alone, from the launchpad or a backfill, or the judging step re-executed alone): its new
    verdicts and failure pool would not match its kept rows, so the step fails in one line. An asset backfill
    that selects the ledger's assets ("Materialize all") walks its partitions in a ledger run of its own after
    judging them; a run committed while this one waited keeps its committed outputs (below)."""
    from filter_pipeline.shell.jobs import BACKFILL_TAG  # (jobs.py imports assets.py, which imports this module)

    steps = context.run.step_keys_to_execute  # (None: every step of the job; a re-execution may select some)
    backfill_id = context.run.tags.get(BACKFILL_TAG)
    backfill = context.instance.get_backfill(backfill_id) if backfill_id else None
    if context.job_def.has_node_named(LEDGER_OP) and (steps is None or LEDGER_OP in steps):
        return
    if backfill is not None and backfill.is_asset_backfill and dg.AssetKey("kept") in (backfill.asset_selection or ()):
        return
    if commit_state(data.warehouse, run_id).exists:
        filtered = committed_meanwhile(context, data, run_id) is None
    else:  # (a legacy run: the earlier script's kept.jsonl counts as filtered)
        filtered = (data.run_dir(run_id) / LEGACY_KEPT_FILE).exists()
    if filtered:
        raise dg.Failure(
            description=f"{run_id} is already filtered, and this run judges it without walking it again: its "
            "judge_verdicts and failure_pool would no longer match its kept rows. Materialize it with filter_job "
            f"(or `{materialize_command(run_id)}`) to judge and walk it again.",
            allow_retries=False,
        )


def committed_meanwhile(context: dg.AssetExecutionContext, data: DataRoot, run_id: str) -> CommitRecord | None:
    """The run's commit record when another walk committed it while this Dagster run, asked for its first walk,
    waited or judged (`waiting.filtered_meanwhile`); else None."""
    from filter_pipeline.shell.waiting import filtered_meanwhile  # (waiting.py imports jobs.py: see above)

    return filtered_meanwhile(context, data, {run_id: commit_state(data.warehouse, run_id)}).get(run_id)
