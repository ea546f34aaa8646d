"""The `filter-pipeline` command line."""

import argparse
import sys

from filter_pipeline.settings import CLI, DATA_ENV, DEFAULT_DATA

# Exit statuses, the same for every command: 1 something was not done (a run failed, a task not found, the
# endpoint refused, the audit found something), 2 an argument, setting or input is wrong (one line on stderr,
# nothing done), 3 some attempts were left unjudged (asked again by the next call).
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNJUDGED = 1, 2, 3


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """The `--data` option every command takes (`cli/data_root.py` opens and checks what it names)."""
    parser.add_argument("--data", default=None, help=f"data root (default: ${DATA_ENV} or '{DEFAULT_DATA}')")


def complain(message: str, warning: bool = False) -> None:
    """Say a problem as every command does: one line on stderr, `filter-pipeline: [warning: ]<message>`."""
    print(f"{CLI}: {'warning: ' if warning else ''}{message}", file=sys.stderr, flush=True)
