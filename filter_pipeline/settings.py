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


# Arrow's allocator, mimalloc 3 (pyarrow 26), reserves a 1 GiB arena and asks for transparent huge pages on it:
# the first touch of any 2 MiB region then zeroes all of it, and memory it purges (after 1 s) is zeroed again
# when reused. At 300k tasks that was about 400 huge-page faults and 1.5 CPU-seconds of zeroing; with
# MIMALLOC_ALLOW_THP=0 mimalloc turns THP off for the process (prctl PR_SET_THP_DISABLE, which child processes
# inherit): about 1 s less system time, a little more user time (more TLB misses), a median of 6.32 -> 5.60 s
# in seven alternating runs, and no more peak RSS (README, Performance). mimalloc reads its options once, when
# libarrow loads.
ALLOCATOR_ENV = {"MIMALLOC_ALLOW_THP": "0"}


def tune_allocators() -> None:
    """Set ALLOCATOR_ENV's defaults in this process's environment (a value already set wins). Takes effect only
    if pyarrow is not loaded yet: `filter_pipeline/__init__.py` calls it, before any module that imports it."""
    for name, value in ALLOCATOR_ENV.items():
        os.environ.setdefault(name, value)
