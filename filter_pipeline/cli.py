"""`filter-pipeline materialize`: register and materialize batches on the instance at $DAGSTER_HOME.

What it materializes is recorded in that instance, so `dagster dev` on the same DAGSTER_HOME shows it.
"""

# Only what reading a batch takes is imported up front. The first batch to materialize starts being read in
# the background (`batch.read_ahead`) before Dagster and the assets are imported (`materialize.py`): on two
# cores the parse then overlaps Dagster's import and the run's start, about 3 s of one core.
import argparse
import ctypes
import gc
import os
import sys

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def one_malloc_arena() -> bool:
    """Have every thread of this process allocate from glibc's main malloc arena; returns whether it could.

    By default each thread that allocates gets an arena of its own (up to 8 per core). The batch is read in
    one thread, history in eight, steps in two, and memory freed in one arena is not reused by the others:
    at 300k tasks, one arena lowers the peak by about 90 MB (to about 950 MB) at no cost in time, since
    Python allocates under the GIL anyway and Arrow uses its own allocator. Not glibc: nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, 1))


# Before numpy loads: its threads start with it, and glibc fixes the arena limit when a second thread first
# allocates. Only the CLI's process is ours to tune this way (a Dagster run worker keeps glibc's default).
one_malloc_arena()

from upath import UPath  # noqa: E402 - the imports from here on load numpy

from filter_pipeline.batch import LOCAL_PROTOCOLS, SUCCESS_FILE, check_run_id, complete_batches, read_ahead  # noqa: E402
from filter_pipeline.history import HistoryError  # noqa: E402
from filter_pipeline.settings import (  # noqa: E402
    DATA_ENV,
    DEFAULT_DATA,
    DEFAULT_EXECUTOR,
    EXECUTOR_ENV,
    JUDGE_KIND_ENV,
    JUDGE_KINDS,
    STEPS_IN_RUN_PROCESS,
    data_path,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="filter-pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    m = commands.add_parser(
        "materialize",
        help="register and materialize execution batches",
        description="Register and materialize the given runs in the given order (none given: every complete "
        "batch not yet filtered, in run_id order). Exit status 0 only if all succeeded.",
    )
    m.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="run_id folders under <data>/runs/")
    m.add_argument("--data", default=None, help=f"data root (default: ${DATA_ENV} or '{DEFAULT_DATA}')")
    m.add_argument(
        "--judge", choices=JUDGE_KINDS, default=None, help=f"which judge decides (default: ${JUDGE_KIND_ENV} or gate)"
    )
    m.add_argument("--per-site-cap", type=int, default=None, help="most kept rows per (macro, site); overrides --caps")
    m.add_argument("--caps", default=None, metavar="FILE", help='YAML/JSON {"per_site_cap": N, "caps": {macro: {site_cap, target}}}')
    return parser


def read_first_batch_ahead(args: argparse.Namespace) -> bool:
    """Start reading the first batch this call will materialize, when its steps will run in this process
    (the threaded or in-process executor) on a local data root. Anything amiss (a bad run_id, a missing
    batch) is left for `materialize` to report; returns whether a read started."""
    if (os.environ.get(EXECUTOR_ENV) or DEFAULT_EXECUTOR) not in STEPS_IN_RUN_PROCESS:
        return False  # the steps run in other processes, which parse for themselves
    root = UPath(data_path(args.data))
    if root.protocol not in LOCAL_PROTOCOLS:
        return False
    try:
        pending = args.run_ids or [b.run_id for b in complete_batches(root / "runs", root / "warehouse", log=None) if not b.filtered]
        if not pending:
            return False
        run_dir = root / "runs" / check_run_id(pending[0])
        if not (run_dir / SUCCESS_FILE).exists():
            return False  # still being written
        return read_ahead(run_dir, pending[0])
    except (ValueError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    read_first_batch_ahead(args)
    # Importing Dagster creates millions of long-lived objects and next to no garbage: the collector's passes
    # over them cost about 0.5 s of the GIL, shared with the batch being read. Collection resumes afterwards,
    # over only what is created from then on (freeze sets the imported objects aside).
    gc.disable()
    try:
        from filter_pipeline.materialize import CliError, materialize  # Dagster loads while the batch is read
    finally:
        gc.freeze()
        gc.enable()

    try:
        return materialize(args)
    except (CliError, ValueError, HistoryError) as exc:
        print(f"filter-pipeline: {exc}", file=sys.stderr)
        return 2


def run() -> None:
    """The console entry point: `main`, then exit without interpreter teardown.

    Arrow's parquet threads can abort the process while Python tears down, after all work is done and
    printed (SIGABRT, "terminate called without an active exception"; apache/arrow#34314, seen once in
    this project's test runs). Flushing and leaving with os._exit skips that teardown; nothing is
    pending by then (runs are finished and recorded, files written atomically)."""
    code = main()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
