"""Names and defaults of the settings read from the environment: one place for each, whoever reads it (the
code location, the CLI, the review app). Dagster-free, so that the review app and `verify` load without it.
The LLM judge's settings are named on its configuration model (`judge/config.py`), each beside its default.
"""

import os

DATA_ENV = "FILTER_PIPELINE_DATA"
DEFAULT_DATA = "data"
ENDPOINT_ENV = "FILTER_PIPELINE_ENDPOINT_URL"
CAPS_ENV = "FILTER_PIPELINE_CAPS"  # the deployment's caps file (YAML or JSON)
LABELER_ENV = "FILTER_PIPELINE_LABELER"  # who the review app records as a label's author

EXECUTOR_ENV = "FILTER_PIPELINE_EXECUTOR"
# Dagster's stock executors. in_process (default): a run's steps one after the other in the run's process, which
# suits this pipeline (each step is one vectorised pass; a process per step pays Python's and Dagster's start-up
# again; batches run in parallel as separate runs, one process or pod each). multiprocess: each step in its own
# process, as a deployment that isolates steps wants.
DEFAULT_EXECUTOR = "in_process"

CLI = "filter-pipeline"  # the command line's name, as every hint spells a command


def materialize_command(*run_ids: str) -> str:
    """The command that (re-)filters the named runs, as a hint quotes it."""
    return " ".join([CLI, "materialize", *run_ids])


VERIFY_COMMAND = f"{CLI} verify"  # the audit of the whole warehouse, as a hint quotes it


JUDGE_GATE, JUDGE_LLM = "gate", "llm"  # the two judges (`--judge`, FILTER_JUDGE_KIND)
JUDGE_KINDS = (JUDGE_GATE, JUDGE_LLM)
DEFAULT_JUDGE = JUDGE_GATE
JUDGE_KIND_ENV = "FILTER_JUDGE_KIND"


def executor_name() -> str:
    """The executor's name: $FILTER_PIPELINE_EXECUTOR, else the default."""
    return os.environ.get(EXECUTOR_ENV) or DEFAULT_EXECUTOR


def data_path(path: str | None = None) -> str:
    """The data root's path or URL: `path` when given, else $FILTER_PIPELINE_DATA, else `data`."""
    return path or os.environ.get(DATA_ENV, DEFAULT_DATA)


# The ledger's order (CONTRACT §4): a first walk blocked by a lower complete batch that is not yet committed
# is retried by Dagster every ORDER_RETRY_SECONDS, for at most ORDER_MAX_WAIT_SECONDS; then it fails with one
# line naming the run it waited for.
ORDER_RETRY_SECONDS_ENV = "FILTER_PIPELINE_ORDER_RETRY_SECONDS"
DEFAULT_ORDER_RETRY_SECONDS = 15
ORDER_MAX_WAIT_SECONDS_ENV = "FILTER_PIPELINE_ORDER_MAX_WAIT_SECONDS"
DEFAULT_ORDER_MAX_WAIT_SECONDS = 4 * 3600
# A waiting run holds a run slot (max_concurrent_runs). When a run it waits for has sat in the run queue for
# ORDER_QUEUED_SECONDS, the slots are taken (perhaps by runs waiting like this one): the step stops, so that
# the queued run can start, and the batch sensor walks this batch in run_id order once the lower ones are.
ORDER_QUEUED_SECONDS_ENV = "FILTER_PIPELINE_ORDER_QUEUED_SECONDS"
# The ledger's lease on object storage: a holder that stops renewing it (dead, paused, cut off) loses it after
# LEASE_SECONDS, and another walk may take over; a stale holder's publish is then refused (storage/publish.py).
LEASE_SECONDS_ENV = "FILTER_PIPELINE_LEASE_SECONDS"
DEFAULT_LEASE_SECONDS = 120
DEFAULT_ORDER_QUEUED_SECONDS = 60

# Runs whose walk left unjudged tasks are judged and walked again (by the sensor, and by a `materialize`
# naming no run): at most REJUDGE_MAX_TRIES times, the sensor waiting REJUDGE_BACKOFF_SECONDS after the
# first walk, doubling after each try.
REJUDGE_BACKOFF_SECONDS_ENV = "FILTER_PIPELINE_REJUDGE_BACKOFF_SECONDS"
DEFAULT_REJUDGE_BACKOFF_SECONDS = 300
REJUDGE_MAX_TRIES_ENV = "FILTER_PIPELINE_REJUDGE_MAX_TRIES"
DEFAULT_REJUDGE_MAX_TRIES = 5


def int_setting(env: str) -> int:
    """A whole-number setting of WHOLE_NUMBER_SETTINGS from the environment (unset or empty: its default);
    raises ValueError with one line naming it."""
    raw = os.environ.get(env)
    if raw is None or raw.strip() == "":
        return WHOLE_NUMBER_SETTINGS[env]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r}: expected a whole number of 0 or more") from None
    if value < 0:
        raise ValueError(f"{env}={raw!r}: expected a whole number of 0 or more")
    return value


# every whole-number setting with its default: checked together before anything runs
WHOLE_NUMBER_SETTINGS = {
    ORDER_RETRY_SECONDS_ENV: DEFAULT_ORDER_RETRY_SECONDS,
    ORDER_MAX_WAIT_SECONDS_ENV: DEFAULT_ORDER_MAX_WAIT_SECONDS,
    ORDER_QUEUED_SECONDS_ENV: DEFAULT_ORDER_QUEUED_SECONDS,
    LEASE_SECONDS_ENV: DEFAULT_LEASE_SECONDS,
    REJUDGE_BACKOFF_SECONDS_ENV: DEFAULT_REJUDGE_BACKOFF_SECONDS,
    REJUDGE_MAX_TRIES_ENV: DEFAULT_REJUDGE_MAX_TRIES,
}


def check_whole_number_settings() -> None:
    """Raise ValueError, in one line naming it, for the first whole-number setting that is not one: said when
    the code loads rather than when a step or sensor first reads it."""
    for env in WHOLE_NUMBER_SETTINGS:
        int_setting(env)


# The review app (`filter-pipeline review`): where users browse it, so that filter_report's materialization links
# to a run's review page; and where the Dagster UI is, so that the review app links to a run's partition.
REVIEW_URL_ENV = "FILTER_PIPELINE_REVIEW_URL"
# what this machine's own browser may call the review app (the first: where it listens unless told otherwise; it
# has no login)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DAGSTER_URL_ENV = "FILTER_PIPELINE_DAGSTER_URL"


def base_url(env: str) -> str | None:
    """The URL the variable `env` holds, without a trailing slash; None when it is unset or blank."""
    return os.environ.get(env, "").strip().rstrip("/") or None


def review_run_url(run_id: str) -> str | None:
    """The run's page in the review app, when FILTER_PIPELINE_REVIEW_URL is set; else None."""
    from urllib.parse import quote

    base = base_url(REVIEW_URL_ENV)
    return f"{base}/runs/{quote(run_id, safe='')}" if base else None
