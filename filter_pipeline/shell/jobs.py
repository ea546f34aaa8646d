"""Jobs over the run_id-partitioned assets (partitioning is inferred from the selection).

The sensor launches `judge_job` for every new batch at once and `ledger_job` one run at a time (every
judged batch waiting in a row, walked in run_id order), and `rejudge_job` for filtered runs that left tasks
unjudged and for refused batches corrected since; the CLI runs `filter_job` (both halves) run by run, first
walks in run_id order, the across-runs assets only in the last. Whoever launches, the ledger step itself waits
for lower runs (CONTRACT §4).
"""

import dagster as dg

from filter_pipeline.shell.assets import WAREHOUSE_VERIFIED

# Dagster's documented run tags
PARTITION_TAG = "dagster/partition"
BACKFILL_TAG = "dagster/backfill"  # on a backfill's runs (an asset backfill's ledger runs walk what it judged)
PRIORITY_TAG = "dagster/priority"  # (an op tag: which ready step of a run goes first)
RUN_KEY_TAG = "dagster/run_key"
RANGE_START_TAG = "dagster/asset_partition_range_start"  # a ranged (single-run backfill) run's partitions
RANGE_END_TAG = "dagster/asset_partition_range_end"
# this project's run tags: which filtered run a re-judging run is for, and its try number
REJUDGE_OF_TAG = "filter_pipeline/rejudge_of"
REJUDGE_TRY_TAG = "filter_pipeline/rejudge_try"
# run tag: the runs a Dagster run was asked to walk for the first time (not committed when it was launched); one
# that another walk commits while this run waits for the ledger's lease is reported as already filtered
FIRST_WALK_TAG = "filter_pipeline/first_walk"


def first_walk_tags(run_ids: list[str]) -> dict[str, str]:
    """The tag naming the runs a Dagster run is asked to walk for the first time (none: an empty tag)."""
    return {FIRST_WALK_TAG: " ".join(run_ids)}


def partitions_of(tags: dict[str, str], registered: list[str] | None = None) -> list[str]:
    """The run_id partitions a Dagster run is for: its partition; else those it was asked to walk for the first
    time (a sensor's ledger run over several, `first_walk_tags`); else every partition of its range (a
    single-run backfill's ledger run) in `registered` (the partitions in registration order, which a range
    follows); none when nothing says."""
    if PARTITION_TAG in tags:
        return [tags[PARTITION_TAG]]
    if walks := first_walks(tags):
        return walks
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    registered = registered or []
    if start in registered and end in registered:
        return registered[registered.index(start) : registered.index(end) + 1]
    return []


def first_walks(tags: dict[str, str]) -> list[str] | None:
    """The runs a Dagster run was asked to walk for the first time (`first_walk_tags`); None without the tag
    (a backfill, the launchpad: nothing says)."""
    return tags[FIRST_WALK_TAG].split() if FIRST_WALK_TAG in tags else None


JUDGE_GROUPS = ("batch", "judging")
LEDGER_GROUP = "ledger"
# assets over every run at once (not partitioned): refreshed by their own job
ACROSS_RUNS_ASSETS = ("coverage", "judge_calibration")
ACROSS_RUNS = dg.AssetSelection.assets(*ACROSS_RUNS_ASSETS)
# the audit of the whole warehouse: its cost grows with the warehouse, so it is not part of a batch's run
WAREHOUSE_AUDIT = dg.AssetSelection.checks(WAREHOUSE_VERIFIED)

judge_job = dg.define_asset_job(
    "judge_job",
    selection=dg.AssetSelection.groups(*JUDGE_GROUPS),
    description="Parse a batch, judge its last ok attempts and fill its failure pool. Safe to run for many "
    "batches at once. A batch already filtered is refused (its new verdicts would not match its kept rows "
    "without a walk): filter_job judges and walks it again.",
)
ledger_job = dg.define_asset_job(
    "ledger_job",
    selection=dg.AssetSelection.groups(LEDGER_GROUP, "training", "reports") - ACROSS_RUNS,
    description="Build the prior dedup index, walk the verdicts into kept / surplus, write the DPO pairs and the "
    "run's report, and commit them (one walk at a time per data root, under the warehouse's ledger lease; the "
    "sensor launches one run at a time for the judged batches waiting in a row, walked in run_id order).",
)
across_runs_job = dg.define_asset_job(
    "across_runs_job",
    selection=ACROSS_RUNS,
    description="Coverage (kept rows of every non-retired run against caps and targets), judge calibration "
    "(against labels.jsonl) and the audit of the whole warehouse (warehouse_verified, as `filter-pipeline "
    "verify`). The sensor runs it whenever the set of kept files changes.",
)
rejudge_job = dg.define_asset_job(
    "rejudge_job",
    selection=dg.AssetSelection.all() - ACROSS_RUNS,
    description="A batch judged and walked in one run, again: a filtered batch whose walk left unjudged tasks "
    "(the judge asks only those, the other verdicts are reused by cache key; launched by the batch sensor with "
    "a backoff between tries and a cap on tries), or a batch refused before its walk and corrected since "
    "(launched by the batch sensor once per refusal; walked as a late batch).",
)
# the across-runs assets ride along in the batch's run: a run of their own would add a whole run's bookkeeping
# (planned events, start, resources, end) to every CLI call
filter_job = dg.define_asset_job(
    "filter_job",
    selection=dg.AssetSelection.all() - WAREHOUSE_AUDIT,
    description="The whole filter stage for one batch: parse, judge, failure pool, prior index, kept, surplus, "
    "DPO pairs, report; then coverage and judge calibration over every run (the CLI refreshes those in the "
    "last batch's run only). The audit of the whole warehouse (warehouse_verified) runs in across_runs_job.",
)
