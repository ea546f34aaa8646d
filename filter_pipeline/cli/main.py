"""`filter-pipeline`: the filter stage from a terminal, on the data root (--data or $FILTER_PIPELINE_DATA).

`materialize` runs on the Dagster instance at $DAGSTER_HOME, so `dagster dev` on the same DAGSTER_HOME shows
what it did; the other commands need the data root alone (`verify` and `explain` only read it, `calibrate` writes
its scores under warehouse/judge_eval/, `review` appends labels to labels.jsonl). `filter-pipeline COMMAND --help`
says more.
"""

import argparse
import os
import sys

from filter_pipeline.cli import EXIT_BAD_INPUT, EXIT_FAILED, add_data_argument, complain, explain, review
from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.rules.history import HistoryError
from filter_pipeline.rules.verify import MAX_LINES_PER_KIND
from filter_pipeline.settings import (
    CLI,
    DEFAULT_JUDGE,
    JUDGE_KIND_ENV,
    JUDGE_KINDS,
    data_path,
)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (exit status 2, as argparse's own)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see {self.prog} --help)\n")


CALIBRATE_DESCRIPTION = (
    "Judge only the attempts labels.jsonl labels with a candidate judge (the production "
    "judge's FILTER_JUDGE_* settings, the options given in their place), write its verdicts to "
    "warehouse/judge_eval/<candidate>.parquet, and print precision (95% interval), recall, kappa and cost "
    "beside the judge in production. Verdicts already on file for the candidate are reused (a second run "
    "asks nothing). Never changes kept, surplus, judge_verdicts or the commit records. Exit 0 when scored, 1 "
    "when the endpoint refused, 2 on bad input (no labels file, no verdicts, no label naming an attempt of the "
    "warehouse, a missing setting), 3 when the "
    "candidate left labelled attempts unjudged (the next call asks for those alone)."
)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=CLI, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    m = commands.add_parser(
        "materialize",
        help="register and materialize execution batches",
        description="Register and materialize the given runs (none given: every complete batch not yet filtered, "
        "but those refused before their walk and unchanged since), in the order the ledger accepts: first walks "
        "in run_id order. Exit status 0 only if all succeeded.",
    )
    m.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="run_id folders under <data>/runs/")
    add_data_argument(m)
    m.add_argument(
        "--judge",
        choices=JUDGE_KINDS,
        default=None,
        help=f"which judge decides (default: ${JUDGE_KIND_ENV} or {DEFAULT_JUDGE})",
    )
    m.add_argument(
        "--per-site-cap",
        type=int,
        default=None,
        help="most kept rows per (macro, site); overrides the --caps file's per_site_cap",
    )
    m.add_argument(
        "--caps",
        default=None,
        metavar="FILE",
        help='YAML/JSON {"per_site_cap": N, "caps": {macro: {site_cap, target}}}',
    )
    v = commands.add_parser(
        "verify",
        help="audit the whole warehouse",
        description="Audit the warehouse: every committed file present and unchanged, no key kept twice across "
        "non-retired runs, caps respected with history, verdicts conserved per run, no kept file without a commit, "
        "no publish left half done, no batch changed since it was filtered. Exit 0 when clean, 1 with one line per "
        f"finding (at most {MAX_LINES_PER_KIND} of a kind, then a count), 2 when the data root does not exist, has no "
        "runs/ or cannot be read (an object store's error).",
    )
    add_data_argument(v)
    c = commands.add_parser(
        "calibrate",
        help="score a candidate judge on the labelled attempts, beside the judge in production",
        description=CALIBRATE_DESCRIPTION,
    )
    add_data_argument(c)
    c.add_argument("--model", default=None, help="the candidate's model (default: FILTER_JUDGE_MODEL)")
    c.add_argument("--base-url", default=None, help="the candidate's endpoint (default: FILTER_JUDGE_BASE_URL)")
    c.add_argument(
        "--prompt-version",
        default=None,
        help="the candidate's prompt version (default: FILTER_JUDGE_PROMPT_VERSION, else the current)",
    )
    c.add_argument("--votes", type=_at_least_one, default=None, help="votes per task (default: FILTER_JUDGE_VOTES)")
    review.add_parser(commands)
    explain.add_parser(commands)
    return parser


def _at_least_one(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number}: at least 1")
    return number


def verify(args: argparse.Namespace) -> int:
    """Print one line per finding of the warehouse audit; 0 when clean, 1 otherwise (2: no data root)."""
    from filter_pipeline.cli.data_root import existing_root, unreadable
    from filter_pipeline.storage.audit import audit

    root = existing_root(args.data)
    if root is None:
        return EXIT_BAD_INPUT
    try:
        findings = audit(root)
    except OSError as exc:  # (a file the audit must read and cannot: no finding can be trusted without it)
        complain(unreadable(data_path(args.data), exc))
        return EXIT_BAD_INPUT
    for finding in findings:
        print(finding.line)
    if not findings:
        print(f"{data_path(args.data)}: warehouse verified, no finding")
    return EXIT_FAILED if findings else 0


def main(argv: list[str] | None = None) -> int:
    """The command's exit status: 0 done, else one of `cli.EXIT_*` (1 something was not done, 2 an argument or
    setting is wrong, 3 some attempts were left unjudged). Each command's help says what its own mean."""
    args = _parser().parse_args(argv)
    if args.command == "verify":
        return verify(args)
    if args.command == "calibrate":
        from filter_pipeline.cli.calibrate import run as calibrate

        return calibrate(args)
    if args.command == "review":
        return review.review(args)
    if args.command == "explain":
        return explain.explain(args)
    from filter_pipeline.cli.interrupts import Interrupted, Signals, saved_line

    signals = Signals()  # before Dagster loads: a SIGTERM from now on ends with one line and status 143
    signals.named_left = list(args.run_ids)
    try:
        return _materialize(args, signals)
    except KeyboardInterrupt:  # (between runs, or before the first one started)
        complain(saved_line(signals, None, None, False, signals.done, signals.named_left))
        return signals.exit_status
    except Interrupted as exc:
        complain(str(exc))
        return exc.status


def _materialize(args: argparse.Namespace, signals) -> int:
    try:
        # the code location reads its settings (FILTER_PIPELINE_EXECUTOR, FILTER_JUDGE_*, FILTER_PIPELINE_CAPS)
        # from the environment as it is imported
        from filter_pipeline.cli.materialize import CliError, materialize
    except ValueError as exc:  # (each names the setting it is about)
        complain(error_message(exc))
        return EXIT_BAD_INPUT
    try:
        return materialize(args, signals)
    except (CliError, ValueError, HistoryError) as exc:
        complain(error_message(exc))
        return EXIT_BAD_INPUT


def error_message(exc: Exception) -> str:
    """The error in one line. A pydantic error names the setting (its environment variable where there is
    one) and its first problem; anything else gives its message's lines joined."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.errors():
        from filter_pipeline.judge.resource import ENV

        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        env = ENV.get(field)
        named = f"{env}={os.environ[env]!r}" if env and env in os.environ else env or f"{exc.title}.{field}"
        return f"{named}: {first['msg'].removeprefix('Value error, ')}"
    return one_line(exc) or type(exc).__name__


def run() -> None:
    """The console entry point. Output piped into a reader that stops early (`| head`) ends quietly, as
    other command-line tools do, with the status a shell gives a process its pipe closed (141)."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit and would report the same broken pipe: point it at /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 141
    sys.exit(status)


if __name__ == "__main__":
    run()
