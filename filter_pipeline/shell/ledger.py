"""The ledger step: the prior dedup index, the walk into kept / surplus, the DPO pairs and the run's report,
then the run's commit record, for one run or (a single-run backfill) several in run_id order.

Whoever launches it (the sensor, the CLI, a UI backfill in any order, another instance over the same warehouse),
the step itself guarantees CONTRACT §4: a run's first walk waits until every lower complete batch is walked,
retired or recorded as failed (the step asks Dagster to retry it later and walks no run after it meanwhile); walks on
one data root never overlap (the lease in `storage/lease.py`); a run counts as filtered only once its commit
record is published, after every file the walk derives is staged, by a write conditional on the record the walk
read when it took the lease (`storage/publish.py`); and a run asked for its first walk that another walk
committed meanwhile is reported as already filtered, not walked again.
(No `from __future__ import annotations` here: Dagster reads the `context` annotation at runtime.)
"""

import json
import time
from dataclasses import dataclass
from typing import Any

import dagster as dg
import pandas as pd

from filter_pipeline import settings
from filter_pipeline.rules import checks, commits, dpo, filtering, order, report
from filter_pipeline.rules.commits import CommitRecord, HistoryIntegrityError
from filter_pipeline.rules.history import HistoryError
from filter_pipeline.rules.vocabulary import DROPPED_REASONS
from filter_pipeline.shell.assets import (
    ALREADY_FILTERED,
    already_filtered_line,
    blocking_check,
    check_result,
    column_schema,
    count_by,
    run_id_partitions,
)
from filter_pipeline.shell.config import (
    CAPS_SOURCE_DEPLOYMENT,
    LEDGER_OP,
    LedgerConfig,
    caps_source,
    deployment_caps_config,
    refuse_invalid_run_caps,
)
from filter_pipeline.shell.jobs import LEDGER_GROUP, PRIORITY_TAG
from filter_pipeline.shell.waiting import (
    DEFERRED_TAG,
    Deferred,
    filtered_meanwhile,
    how_filtered,
    ready_runs,
    retry_later,
    unrecorded,
    walk_then_wait,
)
from filter_pipeline.shell.warehouse import DataRoot, plain_run_ids
from filter_pipeline.storage import failures
from filter_pipeline.storage.files import is_local
from filter_pipeline.storage.history import build_prior_index, commit_versions, committed_meanwhile, load_retired
from filter_pipeline.storage.lease import Lease, LedgerBusy, StoreIgnoresConditions, ledger_lease
from filter_pipeline.storage.parquet import LOADED_VERSION, encode, unchanged_since_loaded
from filter_pipeline.storage.publish import (
    CommitState,
    PublishIncomplete,
    PublishOverlapped,
    PublishRefused,
    PublishSuperseded,
    StagedWalk,
    commit_state,
    complete_published,
    pause_point,
    walked_now,
)
from filter_pipeline.storage.runs import changed_since_judged, inputs_to_commit, walk_order

_WALK_INPUTS = [dg.AssetKey("judge_verdicts"), dg.AssetKey("prior_dedup_index"), dg.AssetKey("prior_kept_counts")]


# the walk's checks on `kept` (functions of rules/checks.py of the same names)
KEPT_CHECKS = ("verdicts_conserved", "no_key_kept_twice", "caps_respected")
# warehouse/filter_report_html/<run_id>.html: the run's report as a page of its own (a file of its commit too)
REPORT_PAGES = "filter_report_html"


def _spec(name: str, description: str, deps: list, group: str = LEDGER_GROUP) -> dg.AssetSpec:
    # skippable: a deferred walk materializes nothing, and its run still succeeds
    return dg.AssetSpec(
        name, description=description, deps=deps, group_name=group, metadata=column_schema(name), skippable=True
    )


LEDGER_SPECS = [
    _spec(
        "prior_dedup_index",
        "Keys kept by every other committed run (plus legacy runs/*/kept.jsonl, minus retired.json) that this "
        "batch's verdicts carry, with the run and task that kept each. Read straight from the warehouse, "
        "verified against each run's commit record, not as an asset input: an asset cannot depend on other "
        "partitions of its own downstream `kept`.",
        ["judge_verdicts"],
    ),
    _spec(
        "prior_kept_counts",
        "Kept rows per (macro, site) over every other committed run, minus retired: where the caps start.",
        [],
    ),
    _spec(
        "kept",
        "Passing verdicts kept as training data: not a duplicate of anything kept before (same site, target "
        "element, argument) and under the site cap and macro target, history included.",
        _WALK_INPUTS,
    ),
    _spec(
        "surplus",
        "Passing verdicts dropped only by dedup or a cap: dropped = duplicate / site_cap / target; duplicates "
        "name the run and task that kept the key first.",
        _WALK_INPUTS,
    ),
    _spec(
        "dpo_pairs",
        "DPO pairs: chosen = a kept trajectory, rejected = a failed attempt of the same task that is a clean "
        "negative (not backend_ok, not blocked by the site, not unjudged; a judge failure's task is never kept, so "
        "execute failures are the negatives).",
        ["failure_pool", "kept"],
        group="training",
    ),
    _spec(
        "filter_report",
        "The run at a glance: funnel (attempts -> ok attempts -> judged -> passed -> kept), keep rate and "
        "failure reasons per site and macro, surplus by reason, judge pass rate and agreement with the gate, "
        f"cost. Charts show on the materialization; a standalone page is written to warehouse/{REPORT_PAGES}/.",
        ["batch_attempts", "judge_verdicts", "failure_pool", "kept", "surplus"],
        group="reports",
    ),
]


def build_ledger(deployment_caps: dict) -> dg.AssetsDefinition:
    """The ledger multi_asset; its config's caps default to `deployment_caps` (the launchpad shows them)."""
    config_class = deployment_caps_config(deployment_caps, base=LedgerConfig)

    @dg.multi_asset(
        name=LEDGER_OP,
        partitions_def=run_id_partitions,
        # one asset backfill ("Materialize all") walks all its partitions in one step, in run_id order
        backfill_policy=dg.BackfillPolicy.single_run(),
        # first among the steps ready beside it (judge_calibration): the longest of them
        op_tags={PRIORITY_TAG: "1"},
        # (whole frames: an input that also is a spec's dep cannot narrow its columns)
        ins={"judge_verdicts": dg.AssetIn(), "failure_pool": dg.AssetIn(), "batch_attempts": dg.AssetIn()},
        specs=LEDGER_SPECS,
        check_specs=[
            *(blocking_check(name, "kept", getattr(checks, name).__doc__) for name in KEPT_CHECKS),
        ],
    )
    def ledger(
        context: dg.AssetExecutionContext,
        config: config_class,
        data: DataRoot,
        judge_verdicts: Any,
        failure_pool: Any,
        batch_attempts: Any,
    ):
        """Walk this step's runs in run_id order, each once every lower complete batch is filtered (otherwise
        Dagster retries the step later, once a range has walked its runs before that one), under the data root's
        lease; each walk writes every file derived from it, then its commit. One partition: its frames; a range:
        dicts by run_id."""
        run_ids = plain_run_ids(context.partition_keys)
        inputs = [
            frames if isinstance(frames, dict) else {run_ids[0]: frames}
            for frames in (judge_verdicts, failure_pool, batch_attempts)
        ]
        refuse_invalid_run_caps(context)  # (Dagster checked only their types)
        source = caps_source(config, deployment_caps)
        if source != CAPS_SOURCE_DEPLOYMENT:
            context.log.info(f"caps from the run config, not the deployment's: {json.dumps(config.caps_document())}")
        try:
            yield from _walk_under_lease(context, config, data, run_ids, inputs, source)
        except LedgerBusy as exc:
            retry_later(context, f"another walker holds the data root's lease ({exc})", honour_tag=False)
        except Deferred as exc:
            yield from _deferred(context, str(exc))
        except (PublishRefused, PublishIncomplete, StoreIgnoresConditions) as exc:
            raise dg.Failure(description=str(exc) + unrecorded(context)) from None
        except (HistoryIntegrityError, HistoryError, PublishSuperseded, PublishOverlapped) as exc:
            # (a committed file changed, a broken retired.json, a later walk's commit standing: a retry changes none)
            raise dg.Failure(description=str(exc) + unrecorded(context), allow_retries=False) from None

    return ledger


def _walk_under_lease(context, config, data: DataRoot, run_ids: list[str], inputs: list[dict], source: str):
    """Take the data root's lease, complete a publish a killed walk left, wait for lower runs, then walk each
    run (`inputs`: the step's three input frames, each by run_id) and yield its events under the lease."""
    holder = f"the ledger walk of {', '.join(run_ids)} (Dagster run {context.run.run_id})"
    with ledger_lease(data.root, holder) as lease:
        complete_published(data.root, context.log.info)  # a walk killed after publishing, completed
        # what each run's commit record is as this walk takes the lease: its publish is conditional on it
        read = {run_id: commit_state(data.warehouse, run_id) for run_id in run_ids}
        meanwhile = filtered_meanwhile(context, data, read)
        # under the lease: no other walk is half done, so which runs are committed cannot change
        # meanwhile (a re-walk of a lower run is pending while it writes)
        pending = [r for r in run_ids if r not in meanwhile]
        now = walk_order(data.root)
        ready = ready_runs(now, pending)
        how = how_filtered(context, meanwhile)

        def walk_one(run_id: str):
            if run_id in meanwhile:
                return _already_filtered(context, meanwhile[run_id], how[run_id])
            walk = _RunWalk(context, config, data, run_id, source, lease, read[run_id])
            return _walk_the_ledger(walk, _JudgeStep(*(f[run_id] for f in inputs)))

        if ready != pending:  # (a run waits: the runs before it are walked, then the step waits, `walk_then_wait`)
            head = [r for r in run_ids if r in meanwhile or r in ready]
            walked = list(_walk_in_order(context, head, walk_one, run_ids)) if head else []
            yield from walk_then_wait(context, now, walked, ready, pending[len(ready) :])
            return
        walk = walk_one(run_ids[0]) if len(run_ids) == 1 else _walk_in_order(context, run_ids, walk_one)
        # yielded under the lease: the walk's materializations and check results are recorded before
        # another walker can start
        yield from walk


def _deferred(context: dg.AssetExecutionContext, why: str):
    """A walk left to the batch sensor: the run succeeds without materializing what it did not walk; the reason
    is on the run's tag `filter_pipeline/deferred`, in its log and on each check (a warning: not walked here)."""
    context.log.warning(why)
    context.instance.add_run_tags(context.run.run_id, {DEFERRED_TAG: why[:1000]})
    for check in KEPT_CHECKS:
        yield dg.AssetCheckResult(
            check_name=check, asset_key="kept", passed=False, severity=dg.AssetCheckSeverity.WARN, description=why
        )


# --- the walk -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RunWalk:
    """What one run's walk works under: the step's context and config, the data root, the run, where its caps
    came from (`source`: "deployment" or "run config", recorded in the commit), the lease the step holds, and
    the run's commit record as read when the lease was taken (`read`: the publish is conditional on it)."""

    context: dg.AssetExecutionContext
    config: LedgerConfig
    data: DataRoot
    run_id: str
    source: str
    lease: Lease
    read: CommitState


@dataclass(frozen=True)
class _JudgeStep:
    """The run's frames from the judge step, as the ledger step loaded them."""

    judge_verdicts: pd.DataFrame
    failure_pool: pd.DataFrame
    batch_attempts: pd.DataFrame


def _write(data: DataRoot, staged: StagedWalk, run_id: str, asset: str, frame: pd.DataFrame) -> dict:
    """Stage the asset's file of this run, from bytes encoded and hashed in memory (so the hash is of what was
    written); returns its commit entry."""
    table, content = encode(frame, asset)
    return staged.write(data.asset_file(asset, run_id), content, table.num_rows)


def _already_filtered(context: dg.AssetExecutionContext, record: CommitRecord, how: str):
    """A run committed by another walk while this one waited, by this run's earlier try, or before this run was
    created, as a re-execution copying a first walk's tags asks for (`how`: `waiting.how_filtered`): said in one
    line, and its assets reported as that walk committed them (a commit stands only when its walk's checks
    passed)."""
    if how == "this run":
        why = already_filtered_line(record, "while this step waited for the rest of its range: not walked again", how)
    elif how == "before":
        again = settings.materialize_command(record.run_id)
        why = already_filtered_line(record, f"before this run was created: not walked again (`{again}` walks it again)")
    else:
        why = already_filtered_line(record, "while this one waited for the lease: not walked again")
    context.log.info(why)
    for spec in LEDGER_SPECS:
        name = spec.key.path[-1]
        entry = record.files.get(name, {})
        yield dg.MaterializeResult(
            asset_key=name,
            metadata={ALREADY_FILTERED: why, "dagster/row_count": int(entry.get("rows") or 0),
                      "sha256": entry.get("sha256", ""), "caps_source": record.caps_source},
        )  # fmt: skip
    for check in KEPT_CHECKS:
        yield dg.AssetCheckResult(
            check_name=check, asset_key="kept", passed=True, description=f"held in the committed walk; {why}"
        )


def _walk_in_order(context, run_ids: list[str], walk_one, step_runs: list[str] | None = None):
    """A ranged step: each run walked on its own, lowest run_id first, written and committed before the next
    run reads history. Once every run is committed, each is materialized as its own partition with its own
    metadata (runtime materializations: a step downstream in the same run counts them as skipped). A run left
    uncommitted by a failed check stops the step: the runs after it are not walked, and none of the range is
    materialized (Dagster 1.12's asset backfill takes a range materialized in part for neither failed nor
    done, and waits forever). Each check's result is given once, over the runs walked."""
    materializations: list[dg.AssetMaterialization] = []
    outcomes: dict[tuple[str, str], list[tuple[str, dg.AssetCheckResult]]] = {}
    stopped = False
    for position, run_id in enumerate(run_ids, start=1):
        counted = step_runs or run_ids  # (the step's runs, when it walks those of them that may walk now)
        context.log.info(f"walking {run_id} ({counted.index(run_id) + 1} of {len(counted)} in run_id order)")
        for event in walk_one(run_id):
            if isinstance(event, dg.MaterializeResult):
                materialized = dg.AssetMaterialization(event.asset_key, partition=run_id, metadata=event.metadata)
                materializations.append(materialized)
            elif isinstance(event, dg.AssetCheckResult):
                outcomes.setdefault((event.check_name, event.asset_key.path[-1]), []).append((run_id, event))
                stopped = stopped or not event.passed
        if stopped:
            not_walked = counted[counted.index(run_id) + 1 :]
            context.log.error(order.describe_stop(run_id, not_walked, run_ids[: position - 1]))
            break
    if not stopped:
        yield from materializations
    for (check, asset), results in outcomes.items():
        failing = [r for r, result in results if not result.passed]
        yield dg.AssetCheckResult(
            check_name=check,
            asset_key=asset,
            passed=not failing,
            description="passed for every run" if not failing else f"failed for {', '.join(failing)}",
            metadata={"runs": len(results), "failed_runs": ", ".join(failing)},
        )


def _walk_the_ledger(walk: _RunWalk, judged: _JudgeStep):
    """One run's walk (the caller holds the lease): history, the walk, every file derived from it staged, their
    checks; then, if they held, the commit record published and one materialization per asset; then the
    checks' results. On object storage a holder that stalled past its lease may have lost it to a walk that
    committed: its publish, conditional on the record it read, is refused."""
    staged = StagedWalk(walk.data.root, walk.read)
    # the versions of the judge step's verdicts and failure pool this walk read, held against the files before its
    # publish (batch_attempts is written again with the same rows by any judge step of the run: its content is
    # the input files', whose fingerprints the commit records)
    judged.batch_attempts.attrs.pop(LOADED_VERSION, None)
    loaded = {
        name: getattr(judged, name).attrs.pop(LOADED_VERSION, None) for name in ("judge_verdicts", "failure_pool")
    }
    try:
        yield from _walk_staged(walk, judged, staged, loaded)
    finally:
        staged.discard()  # (nothing left once published; a walk that failed or was refused leaves nothing either)


def _walk_staged(walk: _RunWalk, judged: _JudgeStep, staged: StagedWalk, loaded: dict):
    """`_walk_the_ledger`'s body: its files written to `staged`, then (its checks held) its commit published."""
    context, data, run_id, verdicts = walk.context, walk.data, walk.run_id, judged.judge_verdicts
    inputs, changed = inputs_to_commit(data.warehouse, data.run_dir(run_id), run_id, verdicts)
    judged_by = commits.judge_settings(verdicts)
    verdicts.attrs.clear()  # (the fingerprints and the judge belong to the verdicts file: not carried into kept)
    if changed:
        context.log.warning(changed_since_judged(run_id, changed))
    # (on object storage, a walk that stalls past its lease may miss a commit another walk makes meanwhile: the
    # commits it read are held against those after its publish; local disk's lock holds for the whole walk)
    read = None if is_local(data.warehouse) else commit_versions(data.warehouse)
    index = build_prior_index(data.root, run_id, verdicts[["dedup_key", "key_hash"]], load_retired(data.root))
    context.log.info(
        f"prior index: {index.rows_read} kept rows of {index.runs_read} other runs; "
        f"{len(index.keys)} of them share a key with this batch"
    )
    pause_point("history_read")
    caps = walk.config.to_caps()
    result = filtering.walk_ledger(verdicts, index.keys, index.counts, caps, run_id)
    context.log.info(f"walk: kept {len(result.kept)}, surplus {len(result.surplus)}")
    outcomes = {
        ("verdicts_conserved", "kept"): checks.verdicts_conserved(verdicts, result.kept, result.surplus),
        # against the index this step built (it holds every earlier keeper of any key this batch carries)
        ("no_key_kept_twice", "kept"): checks.no_key_kept_twice(result.kept, index.keys),
        ("caps_respected", "kept"): checks.caps_respected(result.kept, index.counts, caps),
    }
    # staged: the committed files and record of the run, if any, stay as they are until the publish
    writing = time.perf_counter()
    frames = _walk_frames(index, result, walk.source)
    files = {asset: _write(data, staged, run_id, asset, frame) for asset, (frame, _) in frames.items()}
    pause_point("files_staged")
    derived, html = _derived_frames(walk, result, judged)
    files.update({asset: _write(data, staged, run_id, asset, frame) for asset, (frame, _) in derived.items()})
    page = data.warehouse / REPORT_PAGES / f"{run_id}.html"
    files[REPORT_PAGES] = staged.write(page, html, 0)
    derived["filter_report"][1]["html"] = dg.MetadataValue.path(str(page))
    context.log.info(f"staged {len(files)} files in {time.perf_counter() - writing:.2f} s")
    failing = [check for (check, _), outcome in outcomes.items() if not outcome.passed]
    meanwhile = []  # (runs another walk committed after this one read its history: object storage only)
    if failing:
        # Only a walk whose invariants held becomes history. One that broke them fails on its checks and
        # materializes nothing: its files were never published, so no partition may point at them.
        context.log.error(f"{run_id}: not committed ({', '.join(failing)} failed): nothing of this walk is kept")
    else:
        record = _commit_record(walk, verdicts, judged_by, result.kept, index, files, inputs)
        _refuse_if_judged_again(data, run_id, loaded)
        _publish(context, data, staged, record, walk.lease)
        meanwhile = [] if read is None else committed_meanwhile(data.warehouse, read, run_id)
        for asset, (frame, metadata) in {**frames, **derived}.items():
            yield dg.MaterializeResult(
                asset_key=asset,
                metadata={**metadata, "dagster/row_count": len(frame), "sha256": files[asset]["sha256"]},
            )
    for (check, asset), outcome in outcomes.items():
        yield check_result(check, asset, outcome)
    if meanwhile:
        raise _overlapped(run_id, meanwhile)


def _overlapped(run_id: str, meanwhile: list[str]) -> PublishOverlapped:
    return PublishOverlapped(
        f"{run_id}: committed, but while its walk stalled past its lease another walk committed "
        f"{', '.join(meanwhile)} after this walk had read its history: neither walk counted the other. Run "
        f"`{settings.VERIFY_COMMAND}`; if it reports a key kept twice or a cap exceeded, re-filter {run_id} with "
        f"`{settings.materialize_command(run_id)}`"
    )


def _walk_frames(index, result, source: str) -> dict[str, tuple[pd.DataFrame, dict]]:
    """The walk's own assets: (frame, metadata) of the prior index and counts, kept and surplus."""
    return {
        "prior_dedup_index": (index.keys, {"runs_read": index.runs_read, "rows_read": index.rows_read}),
        "prior_kept_counts": (index.counts, {"kept_before": int(index.counts["n_kept"].sum())}),
        "kept": (result.kept, {"caps_source": source}),
        "surplus": (result.surplus, count_by(result.surplus["dropped"], DROPPED_REASONS, "dropped/")),
    }


def _derived_frames(walk: _RunWalk, result: filtering.LedgerResult, judged: _JudgeStep):
    """The assets derived from the walk: ((frame, metadata) of dpo_pairs and filter_report, the report's
    standalone HTML page)."""
    config, run_id, source, pool = walk.config, walk.run_id, walk.source, judged.failure_pool
    pairs = dpo.dpo_pairs(result.kept, pool, include_judge_failures=config.include_judge_failures)
    figures = report.figures(
        judged.batch_attempts, judged.judge_verdicts, pool, result.kept, result.surplus, config.to_caps(), source
    )
    images = report.charts(figures)
    url = settings.review_run_url(run_id)
    frames = {
        "dpo_pairs": (
            pairs.pairs,
            {
                "kept_without_clean_negative": pairs.kept_without_negative,
                **{f"excluded/{reason}": n for reason, n in pairs.excluded.items()},
            },
        ),
        "filter_report": (
            report.long_form(figures).assign(run_id=run_id),
            {
                "report": dg.MetadataValue.md(report.markdown(figures, images, run_id)),
                "caps_source": source,  # "run config": this run's caps are not the deployment's
                **({"review": dg.MetadataValue.url(url)} if url else {}),
                **{f"funnel/{s}": int(c) for s, c in zip(figures.funnel["step"], figures.funnel["count"])},
            },
        ),
    }
    return frames, report.html(figures, images, run_id).encode()


def _commit_record(walk: _RunWalk, judge_verdicts, judged_by, kept, index, files, inputs) -> CommitRecord:
    """The run's commit record: its files, caps, judge (`judged_by`), the history it read and its inputs' hashes."""
    return commits.CommitRecord(
        run_id=walk.run_id,
        walked_at=walked_now(),
        files=files,
        kept_keys=len(kept),  # (all distinct: no_key_kept_twice held, or nothing is committed)
        caps=walk.config.caps_document(),
        caps_source=walk.source,
        judge=judged_by,
        history=index.history,
        inputs=inputs,
        unjudged=filtering.unjudged_count(judge_verdicts),
    )


def _refuse_if_judged_again(data: DataRoot, run_id: str, loaded: dict) -> None:
    """PublishRefused when a file of the judge step this walk read was written again since with other content
    (another launcher's judge step, judging the same run): the walk would commit kept rows the verdicts in place
    contradict; the walk of those commits instead."""
    again = [name for name, seen in loaded.items() if not unchanged_since_loaded(data.asset_file(name, run_id), seen)]
    if again:
        raise PublishRefused(
            f"{run_id}: not committed: {', '.join(f'warehouse/{n}/{run_id}.parquet' for n in again)} written again "
            "with other content while this walk ran (another launcher judging the same run); nothing of this walk "
            "is published, and the walk of the files now in place commits the run (its launcher's, or the next "
            "materialize)"
        )


def _publish(context, data: DataRoot, staged: StagedWalk, record: CommitRecord, lease: Lease) -> None:
    """Publish the run's commit record (conditional on the one read at the lease), its files moved into place."""
    publishing = time.perf_counter()
    staged.publish(record, lease.confirm)
    context.log.info(
        f"committed {record.run_id}: {commits.commit_file(record.run_id)} (published, its files "
        f"moved into place in {time.perf_counter() - publishing:.2f} s)"
    )
    if failures.clear_failure(data.warehouse, record.run_id):
        context.log.info(f"{record.run_id} was walked: its recorded validation failure is removed")
