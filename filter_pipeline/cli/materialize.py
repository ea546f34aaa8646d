"""The Dagster side of `filter-pipeline materialize`: register the batches, run `filter_job` for each on the
instance at $DAGSTER_HOME, print a summary line per batch (cli/main.py parses the arguments).

What it materializes is recorded in that instance, so `dagster dev` on the same DAGSTER_HOME shows it.
Exit status: 0 all succeeded; 1 a run failed (or a batch refused before its walk is still as it was); 2 bad
input or config, nothing ran; 3 every run succeeded but some left tasks unjudged (a later `materialize` naming
no run judges them again).
"""

import argparse
import os
import sys

import dagster as dg

from filter_pipeline.cli import EXIT_FAILED, EXIT_UNJUDGED, complain
from filter_pipeline.cli.console import one_line_console
from filter_pipeline.cli.data_root import root_problem, unreadable
from filter_pipeline.cli.interrupts import Interrupted, Signals, saved_line, was_interrupted
from filter_pipeline.cli.summary import failure_reason, print_across_runs, print_calibration, print_coverage, summarize
from filter_pipeline.definitions import defs_from_env
from filter_pipeline.judge.client import ssl_context
from filter_pipeline.judge.resource import ENV, JudgeResource, judge_from_env
from filter_pipeline.rules import order
from filter_pipeline.rules.batch import SUCCESS_FILE, BatchState, check_run_id
from filter_pipeline.rules.filtering import unjudged_count
from filter_pipeline.settings import JUDGE_LLM, REJUDGE_MAX_TRIES_ENV, materialize_command
from filter_pipeline.shell.assets import ALREADY_FILTERED, run_id_partitions
from filter_pipeline.shell.config import LEDGER_OP, caps_from_env, load_caps_file, parse_caps
from filter_pipeline.shell.freshness import CALIBRATION, COVERAGE, FOLLOWS, stale_across_runs
from filter_pipeline.shell.jobs import (
    ACROSS_RUNS_ASSETS,
    PARTITION_TAG,
    across_runs_job,
    filter_job,
    first_walk_tags,
)
from filter_pipeline.shell.orphans import cli_process_tag, fail_orphaned_runs
from filter_pipeline.shell.rejudging import left_alone, rejudge_tags, rejudging_due
from filter_pipeline.shell.sensors import changed_warning, legacy_run_ids, record_legacy_runs
from filter_pipeline.shell.waiting import ORDER_MAX_WAIT_TAG
from filter_pipeline.shell.warehouse import DATA_ENV, DataRoot
from filter_pipeline.storage.failures import refused_as_they_are
from filter_pipeline.storage.history import load_retired, read_commits
from filter_pipeline.storage.lease import LedgerBusy, StoreIgnoresConditions, ledger_lease
from filter_pipeline.storage.parquet import read_parquet
from filter_pipeline.storage.publish import STAGING_DIR, commit_state, complete_published
from filter_pipeline.storage.runs import complete_batches, not_complete, walk_order


class CliError(Exception):
    """A one-line reason to stop before materializing anything."""


def _caps(args: argparse.Namespace) -> dict:
    """The run config caps of --caps and --per-site-cap, validated; FILTER_PIPELINE_CAPS (which the code
    location reads for the sensor) is validated too. Raises CliError (one line) before anything is written."""
    try:
        caps_from_env()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        caps = load_caps_file(args.caps) if args.caps else {}
        if args.per_site_cap is not None:
            caps = parse_caps({**caps, "per_site_cap": args.per_site_cap}, "--per-site-cap")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return caps


def _data_root(path: str | None) -> DataRoot:
    """The data root --data or FILTER_PIPELINE_DATA names, if it exists and holds runs/; else CliError."""
    data = DataRoot.from_env(path)
    if problem := root_problem(data.root, path):
        raise CliError(problem)
    return data


def _dagster_home() -> str:
    """$DAGSTER_HOME, if it names an existing folder by an absolute path (what Dagster requires); else CliError."""
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        raise CliError("DAGSTER_HOME is not set: point it at the instance folder (`make setup` creates .dagster_home/)")
    if not os.path.isabs(home):
        raise CliError(f"DAGSTER_HOME={home}: not an absolute path (Dagster requires one): use {os.path.abspath(home)}")
    if not os.path.isdir(home):
        raise CliError(
            f"DAGSTER_HOME={home}: no such folder: point DAGSTER_HOME at the instance folder, or create it with this "
            f"project's settings (mkdir -p {home} && cp instance/dagster.yaml {home}/)"
        )
    return home


def _runs_to_materialize(
    data: DataRoot, requested: list[str], refused: list[str], incomplete: list[str]
) -> tuple[list[str], list[BatchState]]:
    """(the run_ids to materialize: those `requested`, or when none is, `_found_runs`, the batches still being
    written appended to `incomplete`; every complete batch). The filtered batches changed since, and not
    requested, are warned of."""
    unnamed = not requested
    batches = complete_batches(
        data.runs, data.warehouse, refused=refused if unnamed else None, incomplete=incomplete if unnamed else None
    )
    for b in batches:
        if b.changed and b.run_id not in requested:
            complain(changed_warning(b.run_id), warning=True)
    if unnamed:
        return _found_runs(data, batches, refused), batches
    for run_id in requested:
        check_run_id(run_id)
        why = not_complete(data.run_dir(run_id))
        if why is not None:
            raise CliError(f"batch runs/{run_id} {why}")
    return requested, batches


def _found_runs(data: DataRoot, batches: list[BatchState], refused: list[str]) -> list[str]:
    """Every complete batch not yet filtered but those retired as a whole (left alone, as asked, as the sensor
    leaves them) and those refused before their walk and unchanged since (trying them again could only fail
    the same way): each of these is appended to `refused` with what to do, as each complete folder refused for
    its name was."""
    retired = load_retired(data.root).runs
    waiting = [b.run_id for b in batches if not b.filtered and b.run_id not in retired]
    as_refused = refused_as_they_are(data.warehouse, data.runs, waiting) if waiting else {}
    refused += [
        f"runs/{run_id}: refused before its walk, and its files are unchanged since ({as_refused[run_id]}): correct "
        f"them (a `{materialize_command()}` then walks it), name it to try it again as it is, or retire the run in "
        "retired.json"
        for run_id in waiting
        if run_id in as_refused
    ]
    return [run_id for run_id in waiting if run_id not in as_refused]


def _instance(home: str) -> dg.DagsterInstance:
    try:
        return dg.DagsterInstance.get()
    except Exception as exc:  # noqa: BLE001 - a dagster.yaml Dagster cannot load fails in several ways, none ours
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise CliError(f"DAGSTER_HOME={home}: the instance cannot be loaded: {first}") from None


def _in_ledger_order(data: DataRoot, run_ids: list[str], named: bool) -> list[str]:
    """`run_ids` in the order the ledger accepts (CONTRACT §4): first walks in run_id order (one line when
    that differs from the order given). Raises CliError when a named run's first walk would wait for a lower
    complete batch that is neither named, filtered, retired, nor recorded as failed."""
    now = walk_order(data.root)
    ordered = order.walk_order(run_ids, now.committed)
    if named and ordered != list(dict.fromkeys(run_ids)):
        print(f"first walks go in run_id order: {' '.join(ordered)} (given: {' '.join(run_ids)})", flush=True)
    blocked = {}
    for run_id in ordered:
        blockers = now.blocking(run_id, walked_before=ordered)
        if blockers:
            blocked[run_id] = blockers
    if blocked:
        lowest = sorted({b for found in blocked.values() for b in found})
        raise CliError(
            f"{', '.join(sorted(blocked))}: first walk must wait for {', '.join(lowest)} (complete, lower run_id, "
            f"not yet filtered): name {'it' if len(lowest) == 1 else 'them'} too, run `{materialize_command()}` "
            f"with no run, or retire {'it' if len(lowest) == 1 else 'them'} in retired.json"
        )
    return ordered


def materialize(args: argparse.Namespace, signals: Signals | None = None) -> int:
    signals = signals or Signals()
    data, caps, home, judge = _checked_arguments(args)
    refused: list[str] = []
    incomplete: list[str] = []
    try:
        # read before the plan: a run not committed then is asked for its first walk even when another walk
        # commits it before this call's run of it starts (it is then reported as filtered, not walked again)
        committed = set(read_commits(data.warehouse))
        found, batches = _runs_to_materialize(data, args.run_ids, refused, incomplete)
    except BrokenPipeError:
        raise
    except OSError as exc:  # an unreadable runs/ or batch folder: one line, before anything is registered
        raise CliError(unreadable(data.path, exc)) from None
    run_ids = _in_ledger_order(data, found, named=bool(args.run_ids))
    instance = _instance(home)
    for line in fail_orphaned_runs(instance):
        print(line, file=sys.stderr, flush=True)
    _complete_publishes(data)
    for name in sorted(incomplete):
        print(
            f"runs/{name}: no {SUCCESS_FILE} yet (still being written): left out until it is complete", file=sys.stderr
        )
    for line in refused:
        print(line, file=sys.stderr, flush=True)
    _register_legacy_runs(instance, data, args.run_ids)
    # (as the sensor leaves them: changed, retired, incomplete or gone; but the runs named, filtered again now)
    apart = left_alone(committed, batches, load_retired(data.root).runs) - set(args.run_ids)
    rejudge, other_judge = ({}, set()) if args.run_ids else _rejudging(instance, data, apart, judge)
    run_ids = sorted(set(run_ids) | set(rejudge)) if rejudge else run_ids
    # every job run here is rebuilt from the environment (see cli_filter_job): the settings travel through it
    os.environ[DATA_ENV], os.environ[ENV["kind"]] = data.path, judge.kind
    unjudged: set[str] = set()  # (runs of this call that left tasks unjudged)
    if not run_ids:
        status = _nothing_to_materialize(instance, data, args, refused)
    else:
        _register(instance, run_ids)
        first_walks = set(run_ids) - committed
        named = bool(args.run_ids)
        failed, unjudged = _run_batches(instance, data, caps, run_ids, first_walks, rejudge, signals, named)
        status = EXIT_FAILED if failed or refused else EXIT_UNJUDGED if unjudged else 0
    spent = _say_unjudged(instance, data, judge, unjudged, apart | other_judge, named=bool(args.run_ids))
    return status or (EXIT_UNJUDGED if spent or other_judge else 0)


def _say_unjudged(instance, data: DataRoot, judge, unjudged: set[str], said_apart: set[str], named: bool) -> list:
    """Say which runs left unjudged a later call naming none judges again, and which must be named (returned):
    their last try spent (of the named runs, when `named`; else any not `said_apart`: left alone, another
    judge's)."""
    due = _due_again(instance, data, said_apart, judge)
    again = len(due & unjudged)
    if again:
        print(
            f"{again} run(s) left tasks unjudged: a later `{materialize_command()}` naming no run judges them again",
            flush=True,
        )
    if named:  # (of the runs it named: the others are a call naming none's to say)
        spent = sorted(unjudged - due - load_retired(data.root).runs)
    else:
        spent = _tries_spent(data, due | said_apart)
    if spent:
        print(
            f"{len(spent)} run(s) still hold unjudged tasks after their last try ({REJUDGE_MAX_TRIES_ENV}): "
            f"name them to judge them again: {materialize_command(*spent)}",
            flush=True,
        )
    return spent


def _rejudging(instance, data: DataRoot, apart: set[str], judge: JudgeResource) -> tuple[dict, set[str]]:
    """(run_id -> Rejudge of the committed runs whose unjudged tasks this call judges again, but those `apart`
    (`rejudging.left_alone`); the runs another judge judged, left as they are, each said in one line)."""
    due, other_judge = rejudging_due(instance, read_commits(data.warehouse), apart, judge.identity(), wait=False)
    for line in other_judge.values():
        complain(line)
    return {r.run_id: r for r in due}, set(other_judge)


def _due_again(instance, data: DataRoot, apart: set[str], judge: JudgeResource) -> set[str]:
    """The committed runs a materialize naming no run would judge again now (`rejudging_due`, no backoff), but
    those `apart`."""
    apart = apart | load_retired(data.root).runs
    due, _ = rejudging_due(instance, read_commits(data.warehouse), apart, judge.identity(), wait=False)
    return {r.run_id for r in due}


def _tries_spent(data: DataRoot, said_apart: set[str]) -> list[str]:
    """Committed runs, not retired, still holding unjudged tasks, but for those `said_apart` (due to be judged
    again by a materialize naming no run, another judge's, or changed since filtered): they have spent their
    re-judging tries."""
    left_out = load_retired(data.root).runs | said_apart
    return sorted(
        run_id
        for run_id, record in read_commits(data.warehouse).items()
        if record.unjudged > 0 and run_id not in left_out
    )


def _checked_arguments(args: argparse.Namespace):
    """(data root, caps, DAGSTER_HOME, judge) once every argument and setting is checked: before anything is
    registered, written or judged (each problem raises with one line)."""
    data = _data_root(args.data)
    caps = _caps(args)
    home = _dagster_home()
    defs_from_env()  # FILTER_PIPELINE_EXECUTOR, FILTER_JUDGE_*: what the runs will read (ValueError: one line)
    judge = judge_from_env(args.judge)
    if judge.kind == JUDGE_LLM:
        judge.settings()  # missing FILTER_JUDGE_BASE_URL / MODEL: say so before any run starts
        ssl_context()  # an unreadable SSL_CERT_FILE too
    load_retired(data.root)  # a broken retired.json fails here, before anything is written
    return data, caps, home, judge


def _nothing_to_materialize(instance: dg.DagsterInstance, data: DataRoot, args, refused: list[str]) -> int:
    """No batch to run: say so, and refresh judge_calibration if labels.jsonl changed since it was built, and
    coverage if retired.json did. EXIT_FAILED when a folder was `refused` (something complete was not filtered;
    each was named on stderr), which holds back no refresh."""
    if not refused:
        print("nothing to materialize: no complete batch is waiting to be filtered")
    stale = {} if args.run_ids else stale_across_runs(instance, data)
    for asset, found in stale.items():
        name, file = asset.path[-1], FOLLOWS[asset].file
        print(f"{name} has no record of the {file} it was built from on this instance: building it"
              if found.recorded is None else f"{file} changed since {name} was built: refreshing it", flush=True)  # fmt: skip
    if stale and not _refresh_across_runs(instance, only=list(stale)):
        return EXIT_FAILED
    if COVERAGE in stale:
        print_coverage(data)
    if CALIBRATION in stale:
        print_calibration(data)
    return EXIT_FAILED if refused else 0


def _run_batches(
    instance,
    data: DataRoot,
    caps,
    run_ids: list[str],
    first_walks: set[str],
    rejudge: dict,
    signals: Signals,
    named: bool,
):
    """One Dagster run per batch, in `run_ids`' order (those in `first_walks` asked for their first walk), each
    summarized in a line; coverage and calibration once, in the last batch's run (or on their own if it failed).
    Returns (how many runs failed, the runs left with unjudged tasks)."""
    job = dg.reconstructable(cli_filter_job)
    batch_only = [
        k for k in job.get_definition().asset_layer.executable_asset_keys if k.path[-1] not in ACROSS_RUNS_ASSETS
    ]
    failed_runs, unjudged, refreshed = [], set(), False
    for position, run_id in enumerate(run_ids, start=1):
        last = position == len(run_ids)
        tags = _run_tags(run_id, first_walks, rejudge)
        # (a run that failed is not done: an interrupt's line names it again, with the runs still to do)
        finished = [r for r in run_ids[: position - 1] if r not in failed_runs]
        still_named = [*failed_runs, *run_ids[position - 1 :]] if named else []
        signals.done, signals.named_left = finished, still_named
        selection = None if last else batch_only
        result = _run_one(instance, data, job, caps, tags, selection, signals, [*finished, run_id], still_named)
        if result.success:
            signals.done, signals.named_left = [*finished, run_id], [r for r in still_named if r != run_id]
            print(_already_filtered(result) or summarize(data, run_id), flush=True)
            if _unjudged(data, run_id) > 0:
                unjudged.add(run_id)
            refreshed = last
        else:
            failed_runs.append(run_id)
            print(f"{run_id}: FAILED ({failure_reason(result)})", flush=True)
    failed = len(failed_runs)
    if failed < len(run_ids) and not refreshed:  # the last batch's run failed, an earlier one did not
        refreshed = _refresh_across_runs(instance)
        failed += not refreshed
    if refreshed:
        print_across_runs(data)
    return failed, unjudged


def _run_tags(run_id: str, first_walks: set[str], rejudge: dict) -> dict[str, str]:
    """The tags of the CLI's run of the batch `run_id` (a re-judging's said in a line)."""
    # this call orders its own runs, so a ledger step that would wait can only be behind a run of this call
    # that failed: it fails at once, naming that run, rather than wait for the order's whole timeout
    tags = {
        PARTITION_TAG: run_id,
        ORDER_MAX_WAIT_TAG: "0",
        **first_walk_tags([run_id] if run_id in first_walks else []),
        **cli_process_tag(),
    }
    if run_id in rejudge:
        tags.update(rejudge_tags(rejudge[run_id]))
        print(f"{run_id}: judging its unjudged tasks again (try {rejudge[run_id].try_number})", flush=True)
    return tags


def _run_one(
    instance, data: DataRoot, job, caps, tags: dict, selection, signals: Signals, so_far: list[str], still_named
):
    """Execute the job for the batch `so_far[-1]` (`selection`: its assets; None: all, coverage and calibration
    included); raises Interrupted, saying what was saved (and, for a call that named its runs, the ones to name
    again: `still_named`), when the user interrupted it."""
    run_id = so_far[-1]
    # (--caps / --per-site-cap are this call's walks' caps only: coverage is the warehouse's, at the
    # deployment's caps, so a one-off cap does not rewrite everyone's coverage; the run's report says so)
    # (not opened as a context manager: that initializes the resources again, to load outputs, which the
    # summary reads from the warehouse instead)
    before = commit_state(data.warehouse, run_id)
    try:
        result = dg.execute_job(
            job, instance, run_config=_run_config(caps, ops_with_caps=[LEDGER_OP]), tags=tags, asset_selection=selection
        )
    except KeyboardInterrupt:
        result = None
    if result is None or (not result.success and was_interrupted(result)):
        committed = commit_state(data.warehouse, run_id) != before
        line = saved_line(signals, data, run_id, committed, so_far[:-1], still_named)
        raise Interrupted(line, signals.exit_status)
    return result


def _already_filtered(result) -> str | None:
    """The line of a run another walk committed while this one waited (not walked again), else None."""
    for event in result.get_asset_materialization_events():
        said = event.step_materialization_data.materialization.metadata.get(ALREADY_FILTERED)
        if said is not None:
            return str(said.value)
    return None


def _complete_publishes(data: DataRoot) -> None:
    """Move into place the files of a walk killed after its commit was published (each said in one line), so
    that what this call's walks read, and what users read, is whole; the walk holding the lease does it
    otherwise."""
    if not (data.warehouse / STAGING_DIR).exists():
        return  # (no walk staged anything that was left: nothing to take the lease for)
    try:
        with ledger_lease(data.root, f"{materialize_command()} (completing published walks)"):
            complete_published(data.root, lambda line: print(line, file=sys.stderr, flush=True))
    except LedgerBusy:
        pass
    except StoreIgnoresConditions as exc:
        raise CliError(str(exc)) from None


def _unjudged(data: DataRoot, run_id: str) -> int:
    verdicts = read_parquet(data.asset_file("judge_verdicts", run_id), columns=["status"])
    return unjudged_count(verdicts)


REGISTER_TRIES = 5


def _register(instance: dg.DagsterInstance, run_ids: list[str]) -> None:
    """Register `run_ids` as partitions. Another launcher registering some of them at the same moment is
    fine: the storage refuses a batch of keys holding one it already has, whole, so the keys still missing
    are added again, until all are registered (what matters is that they are)."""
    wanted = list(dict.fromkeys(run_ids))
    for attempt in range(1, REGISTER_TRIES + 1):
        known = set(instance.get_dynamic_partitions(run_id_partitions.name))
        new = [r for r in wanted if r not in known]
        if not new:
            return
        try:
            instance.add_dynamic_partitions(run_id_partitions.name, new)
            return
        except Exception:  # noqa: BLE001 - the storage's own error for a key inserted meanwhile; checked below
            if attempt == REGISTER_TRIES:
                raise


def _register_legacy_runs(instance: dg.DagsterInstance, data: DataRoot, named: list[str]) -> None:
    """Register every legacy run (a kept.jsonl of the earlier script) and record it as materialized, once; but
    a `named` one, which this call filters."""
    legacy = legacy_run_ids(data, complete_batches(data.runs, data.warehouse), read_commits(data.warehouse))
    legacy = [run_id for run_id in legacy if run_id not in named]
    _register(instance, legacy)
    for run_id in record_legacy_runs(instance, data, legacy):
        print(f"{run_id}: recorded as materialized (legacy kept.jsonl)", flush=True)


def _run_config(caps: dict, ops_with_caps: list[str]) -> dict:
    """INFO on the console, and the caps for the given ops (a run may configure only ops it runs). No caps
    given: none passed, and the steps use the deployment's (the caps config's defaults)."""
    config: dict = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
    if caps:
        config["ops"] = {op: {"config": caps} for op in ops_with_caps}
    return config


def _refresh_across_runs(instance: dg.DagsterInstance, only: list[dg.AssetKey] | None = None) -> bool:
    """Materialize coverage (at the deployment's caps) and judge calibration, or `only` those assets, over every
    run in a run of their own."""
    result = dg.execute_job(
        dg.reconstructable(cli_across_runs_job),
        instance,
        run_config=_run_config({}, []),
        tags=cli_process_tag(),
        asset_selection=only,
    )
    if not result.success:
        names = " / ".join(k.path[-1] for k in only) if only else "coverage / judge_calibration"
        print(f"{names}: FAILED ({failure_reason(result)})", flush=True)
    return result.success


def _cli_job(name: str) -> dg.JobDefinition:
    """The named job as the environment configures it (see `definitions.defs_from_env`), with the CLI's
    one-line console as its console logger."""
    return dg.Definitions.merge(defs_from_env(), dg.Definitions(loggers={"console": one_line_console})).resolve_job_def(
        name
    )


def cli_filter_job() -> dg.JobDefinition:
    """`filter_job` for the CLI's runs (`dg.reconstructable` needs a module-level function)."""
    return _cli_job(filter_job.name)


def cli_across_runs_job() -> dg.JobDefinition:
    """`across_runs_job` (coverage, judge calibration) for the CLI's runs."""
    return _cli_job(across_runs_job.name)
