"""Names and defaults of the settings read from the environment before Dagster loads.

Dagster-free on purpose: the CLI reads them to start reading its first batch while Dagster imports.
"""

import os

DATA_ENV = "FILTER_PIPELINE_DATA"
DEFAULT_DATA = "data"
ENDPOINT_ENV = "FILTER_PIPELINE_ENDPOINT_URL"

EXECUTOR_ENV = "FILTER_PIPELINE_EXECUTOR"
# threaded (default): a run's steps in its own process, independent ones at once in threads (executor.py).
# in_process: Dagster's, one step at a time. Both suit this pipeline: each step is one vectorised pass, and a
# process per step costs seconds on a small machine; batches run in parallel as separate runs (one process
# or pod each). multiprocess puts each step in its own process, as a deployment that isolates steps wants.
DEFAULT_EXECUTOR = "threaded"
STEPS_IN_RUN_PROCESS = ("threaded", "in_process")  # the executors that run steps in the run's own process

JUDGE_KINDS = ("gate", "llm")
JUDGE_KIND_ENV = "FILTER_JUDGE_KIND"


def data_path(path: str | None = None) -> str:
    """The data root's path or URL: `path` when given, else $FILTER_PIPELINE_DATA, else `data`."""
    return path or os.environ.get(DATA_ENV, DEFAULT_DATA)
