"""Names and defaults of the settings read from the environment before Dagster loads.

Dagster-free on purpose: the CLI reads them to start reading its first batch while Dagster imports.
"""

import os

DATA_ENV = "FILTER_PIPELINE_DATA"
DEFAULT_DATA = "data"
ENDPOINT_ENV = "FILTER_PIPELINE_ENDPOINT_URL"

EXECUTOR_ENV = "FILTER_PIPELINE_EXECUTOR"
# Dagster's stock executors. in_process (default): a run's steps one after the other in the run's process, which
# suits this pipeline (each step is one vectorised pass; a process per step costs seconds on a small machine;
# batches run in parallel as separate runs, one process or pod each). multiprocess: each step in its own
# process, as a deployment that isolates steps wants.
EXECUTORS = ("in_process", "multiprocess")
DEFAULT_EXECUTOR = "in_process"
STEPS_IN_RUN_PROCESS = ("in_process",)  # the executors that run steps in the run's own process

JUDGE_KINDS = ("gate", "llm")
JUDGE_KIND_ENV = "FILTER_JUDGE_KIND"


def data_path(path: str | None = None) -> str:
    """The data root's path or URL: `path` when given, else $FILTER_PIPELINE_DATA, else `data`."""
    return path or os.environ.get(DATA_ENV, DEFAULT_DATA)
