"""Ctrl-C and SIGTERM during `filter-pipeline materialize`: one line saying what was saved and that a rerun
resumes, and the shell's exit status for the signal (130 for SIGINT, 143 for SIGTERM).

Dagster's execution turns SIGINT into an interrupt of the running step; SIGTERM is turned into SIGINT here so that
both stop a run the same way (the judge's saved verdicts stay, a walk never half-published).
"""

import os
import signal

from filter_pipeline.settings import materialize_command

# (nothing heavier here: main.py installs the handler before Dagster is imported)

INTERRUPT_ERRORS = ("DagsterExecutionInterruptedError", "KeyboardInterrupt")


class Interrupted(Exception):
    """A run of this call was interrupted: the one line to print, and the exit status."""

    def __init__(self, line: str, status: int):
        super().__init__(line)
        self.status = status


class Signals:
    """Which signal stopped this process. SIGTERM is delivered as SIGINT, which Dagster's execution handles
    (Dagster itself points SIGTERM at its SIGINT handler while it runs); the signal's number is told by the
    wakeup file descriptor, which the interpreter writes whichever Python handler is installed."""

    def __init__(self):
        self.received: int | None = None
        # where the call was, for the line of an interrupt between its runs: the runs it finished, and for a
        # call naming its runs, those it has not finished (named again, as `saved_line` says)
        self.done: list[str] = []
        self.named_left: list[str] = []
        self._read, write = os.pipe()
        for descriptor in (self._read, write):
            os.set_blocking(descriptor, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._terminate)

    def _terminate(self, signum: int, _frame) -> None:
        self.received = signum
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # (a shell starts a script's `cmd &` with SIGINT ignored: sending it would do nothing)
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)

    @property
    def signum(self) -> int:
        try:
            seen = os.read(self._read, 1024)
        except BlockingIOError:
            seen = b""
        if signal.SIGTERM in seen:
            self.received = signal.SIGTERM
        return self.received or signal.SIGINT

    @property
    def exit_status(self) -> int:
        """The shell's status for death by this signal: 128 + its number."""
        return 128 + self.signum

    def name(self) -> str:
        return signal.Signals(self.signum).name


def was_interrupted(result) -> bool:
    """Whether an execute_job result failed because its run was interrupted."""
    for event in result.all_events:
        if event.event_type_value != "STEP_FAILURE":
            continue
        error = event.step_failure_data.error
        while error is not None:
            if error.cls_name in INTERRUPT_ERRORS:
                return True
            error = error.cause
    return False


def verdicts_saved(data, run_id: str) -> str:
    """What the judge left of `run_id` on disk (`data`: the DataRoot), as the interrupt line says it: the
    verdicts saved as they arrived (a judging not finished), and those of its judge_verdicts file (with parts
    saved beside it that the file was not built from, an earlier judging's, which the next one reuses only
    where its prompts are the same)."""
    import logging

    from filter_pipeline.judge.driver import ProgressStore, progress_parts
    from filter_pipeline.rules.vocabulary import STATUS_JUDGED

    done = data.asset_file("judge_verdicts", run_id)
    on_file, counted = _judged_rows(done) if done.exists() else (None, ())
    try:
        parts = [p for p in progress_parts(data.judge_progress(run_id)) if p.name not in counted]
    except OSError:
        parts = []
    if not parts:
        return f"{on_file or 0} judge verdicts saved"
    saved = ProgressStore(data.judge_progress(run_id)).load(logging.getLogger(__name__), counted)
    # (the parts hold the tries left unjudged too, whose spend they keep: only verdicts count here, once each)
    known = saved is not None and {"status", "cache_key"} <= set(saved.columns)
    count = saved.loc[saved["status"] == STATUS_JUDGED, "cache_key"].nunique() if known else 0
    earlier = f" ({on_file} more on file from an earlier judging)" if on_file is not None else ""
    return f"{count} judge verdicts saved{earlier}"


def _judged_rows(path) -> tuple[int, list[str]]:
    """(the rows of a judge_verdicts file whose task was judged, the progress parts it was built from:
    `JUDGE_PROGRESS_PARTS`); (0, []) when it cannot be read."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from filter_pipeline.rules.schemas import JUDGE_PROGRESS_PARTS
    from filter_pipeline.rules.vocabulary import STATUS_JUDGED
    from filter_pipeline.storage.parquet import read_parquet_file

    try:
        table = read_parquet_file(pa.BufferReader(path.read_bytes()), columns=["status"])
        statuses, attributes = table["status"], (table.schema.pandas_metadata or {}).get("attributes") or {}
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return 0, []
    parts = attributes.get(JUDGE_PROGRESS_PARTS) if isinstance(attributes, dict) else None
    judged = int(pc.sum(pc.equal(statuses, STATUS_JUDGED)).as_py() or 0)
    return judged, [str(p) for p in parts] if isinstance(parts, list) else []


def saved_line(
    signals: Signals, data, run_id: str | None, committed: bool, done: list[str], named: list[str] = ()
) -> str:
    """The one line for an interrupt while `run_id` was materialized (None: between runs). `named`: when the call
    named its runs, those still to do (runs of it that failed, then `run_id` and the rest): the line names them
    again (a `materialize` naming no run would leave a re-walk of a run filtered before undone, and take runs
    not named)."""
    earlier = f"; {', '.join(done)} finished before it" if done else ""
    if run_id is None:
        what = f"interrupted by {signals.name()} before a run started{earlier}"
    else:
        walk = "its walk committed" if committed else "its walk not committed (nothing of it published)"
        what = f"interrupted by {signals.name()} during {run_id}: {verdicts_saved(data, run_id)}, {walk}{earlier}"
    remaining = [r for r in named if not (r == run_id and committed)]
    again = materialize_command(*remaining)
    return f"{what}; run `{again}` again to resume from what was saved"
