"""The batch folders under `runs/` on the data root: which are complete, reading one (and a legacy run's
kept rows), the checks on it that need the file system (trajectory dirs behind symlinks), and which input
bytes a run's verdicts were made from."""

import json
import logging
import os
import posixpath
import time
from dataclasses import dataclass, replace

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from upath import UPath

from filter_pipeline.rules.batch import (
    EXECUTIONS_FILE,
    LEGACY_KEPT_FILE,
    SUCCESS_FILE,
    TASKS_FILE,
    Batch,
    BatchError,
    BatchState,
    check_run_id,
    is_plain_run_id,
    non_blank_lines,
    parse_attempts,
    parse_tasks,
    tasks_and_rejects,
)
from filter_pipeline.rules.commits import INPUT_FILES
from filter_pipeline.rules.order import blocking_runs
from filter_pipeline.rules.schemas import JUDGED_INPUTS
from filter_pipeline.settings import materialize_command
from filter_pipeline.storage.failures import read_failures
from filter_pipeline.storage.files import (
    RUNS_DIR,
    WAREHOUSE_DIR,
    files_in,
    input_fingerprints,
    inputs_changed,
    is_local,
    read_input,
)
from filter_pipeline.storage.history import load_retired, read_commit, read_commits


def complete_batches(
    runs: UPath,
    warehouse: UPath,
    log: logging.Logger | None = None,
    refused: list[str] | None = None,
    incomplete: list[str] | None = None,
) -> list[BatchState]:
    """Every batch under `runs` with `_SUCCESS` and a plain run_id, in run_id order (`warehouse`: where
    their outputs are).

    A batch without `_SUCCESS` is still being written and is not listed (its run_id is appended to
    `incomplete` when given; a folder whose name no batch can have is not); a complete one whose folder name is
    not a plain run_id is refused: one line, "runs/<name>: refused: why; rename it", logged as a warning to
    `log` (None: not logged) and appended to `refused` (when given). A batch is filtered only
    once its walk committed (a kept file without a commit is a walk killed midway: still to do).
    """
    if not runs.exists():
        return []
    judged = _stems(warehouse / "judge_verdicts")
    commits = read_commits(warehouse)
    states = []
    for run_dir in runs.iterdir():
        run_id = run_dir.name
        if not (run_dir / SUCCESS_FILE).exists():
            # (a folder no batch can be, a hidden one or a name refused once complete, is not one being written)
            if incomplete is not None and run_dir.is_dir() and is_plain_run_id(run_id):
                incomplete.append(run_id)
            continue
        try:
            check_run_id(run_id)
        except ValueError as exc:
            message = _printable(f"runs/{run_id}: refused: {exc}; rename it")
            if log is not None:
                log.warning(message)
            if refused is not None:
                refused.append(message)
            continue
        committed = commits.get(run_id)
        filtered = committed is not None or (run_dir / LEGACY_KEPT_FILE).exists()
        changed = committed is not None and bool(inputs_changed(run_dir, committed.inputs))
        states.append(BatchState(run_id=run_id, judged=run_id in judged, filtered=filtered, changed=changed))
    return sorted(states, key=lambda s: s.run_id)


def _stems(folder) -> set[str]:
    return set(files_in(folder, ".parquet"))


def _printable(text: str) -> str:
    """`text` (a folder's name in it) as text: a name that is not UTF-8 reaches Python as lone surrogates."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def not_complete(run_dir: UPath) -> str | None:
    """Why the batch in `run_dir` may not be read, to follow its folder's name in a message; None when it is
    complete (its SUCCESS_FILE is there)."""
    if (run_dir / SUCCESS_FILE).exists():
        return None
    if run_dir.is_dir():
        return f"has no {SUCCESS_FILE}: still being written (the harness writes it last)"
    return "is a file, not a batch folder" if run_dir.exists() else "does not exist"


def read_batch(run_dir: UPath, run_id: str) -> Batch:
    """Parse `runs/<run_id>/`: tasks and attempts that passed validation, and one reject row per record that
    did not (malformed, mistyped, a second `task_id` or (task_id, attempt), an attempt of an unknown task, a
    dir that resolves outside the data root), with the fingerprints of the bytes parsed (`Batch.inputs`). One
    file's bytes are held at a time.

    Raises BatchError when `tasks.jsonl` is missing or has no task, or `executions.jsonl` is missing; its
    `inputs` are the input files there, with the fingerprint of the one parsed (a correction changes them).
    """
    started = time.perf_counter()
    there: dict[str, dict | None] = {name: None for name in INPUT_FILES if (run_dir / name).exists()}
    missing = {TASKS_FILE: "not an execution batch", EXECUTIONS_FILE: "the harness wrote no attempts file"}
    for name, why in missing.items():
        if name not in there:
            error = BatchError(f"runs/{run_id}/{name} does not exist: {why}")
            error.inputs = there
            raise error
    tasks_path, executions_path = run_dir / TASKS_FILE, run_dir / EXECUTIONS_FILE
    data, tasks_input = read_input(tasks_path)
    try:
        tasks, rejects = parse_tasks(data, run_id)
    except BatchError as error:
        error.inputs = {**there, TASKS_FILE: tasks_input}
        raise
    del data  # (let go before the next file is read)
    data, executions_input = read_input(executions_path)
    outside = lambda dirs: dirs_outside_root(run_dir, dirs)  # noqa: E731
    parsed = parse_attempts(data, tasks, rejects, run_id, outside)
    inputs = {TASKS_FILE: tasks_input, EXECUTIONS_FILE: executions_input}
    return replace(parsed, seconds=time.perf_counter() - started, inputs=inputs)


@dataclass(frozen=True)
class WalkOrder:
    """What the ledger's order (CONTRACT §4) is decided from, as the data root holds it now."""

    complete: list[str]  # every complete batch
    committed: set[str]  # filtered for good: committed, or a legacy kept.jsonl
    failed: set[str]  # a recorded validation failure
    retired: set[str]  # retired as a whole

    def blocking(self, run_id: str, walked_before: list[str]) -> list[str]:
        """The runs a first walk of `run_id` waits for (`order.blocking_runs`)."""
        return blocking_runs(run_id, self.complete, self.committed, self.failed, self.retired, walked_before)


def walk_order(root: UPath) -> WalkOrder:
    """The data root's `WalkOrder`: its complete batches, commits, recorded failures and retired runs."""
    batches = complete_batches(root / RUNS_DIR, root / WAREHOUSE_DIR)
    committed = set(read_commits(root / WAREHOUSE_DIR)) | {b.run_id for b in batches if b.filtered}
    return WalkOrder(
        complete=[b.run_id for b in batches],
        committed=committed,
        failed=set(read_failures(root / WAREHOUSE_DIR)),
        retired=set(load_retired(root).runs),
    )


def unparsed_batch(run_dir: UPath, run_id: str) -> Batch | None:
    """The batch in `run_dir` parsed as the judge step parses it (`read_batch`), for a batch it has not parsed
    yet; one the step refuses as a whole gives its tasks and their rejects alone (without executions.jsonl, or
    without a valid task, say), or None without tasks.jsonl."""
    try:
        return read_batch(run_dir, run_id)
    except BatchError:
        pass
    try:
        tasks, rejects = tasks_and_rejects((run_dir / TASKS_FILE).read_bytes())
    except FileNotFoundError:
        return None
    return parse_attempts(b"", tasks, rejects, run_id)


def inputs_to_commit(warehouse: UPath, run_dir: UPath, run_id: str, verdicts: pd.DataFrame) -> tuple[dict, list[str]]:
    """The input fingerprints the run's commit records, and the input files changed since. Those are the
    fingerprints of the bytes `verdicts` (the run's, as the walk loaded them) were made from, so that a batch
    rewritten after it was judged is reported as changed once committed (`complete_batches`, `verify`). For
    verdicts judged before they carried fingerprints: those an earlier version recorded beside them, else those
    of its standing commit, if any (a re-walk of a changed batch stays reported as changed), else the files as
    they are now."""
    judged = (
        _judged_inputs(verdicts) or _legacy_judged_inputs(warehouse, run_id) or _committed_inputs(warehouse, run_id)
    )
    if judged is None:
        return input_fingerprints(run_dir), []
    return judged, inputs_changed(run_dir, judged)


def _judged_inputs(verdicts: pd.DataFrame) -> dict | None:
    return _fingerprints_or_none(verdicts.attrs.get(JUDGED_INPUTS))


def _fingerprints_or_none(recorded) -> dict | None:
    readable = isinstance(recorded, dict) and recorded and all(isinstance(v, dict) for v in recorded.values())
    return recorded if readable else None


def _legacy_judged_inputs(warehouse: UPath, run_id: str) -> dict | None:
    """The record an earlier version wrote beside the verdicts it judged (warehouse/_judged_inputs/<run_id>.json,
    read only): the fingerprints of verdicts judged before the verdicts file carried them."""
    try:
        recorded = json.loads((warehouse / "_judged_inputs" / f"{run_id}.json").read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return _fingerprints_or_none(recorded)


def _committed_inputs(warehouse: UPath, run_id: str) -> dict | None:
    try:
        record = read_commit(warehouse, run_id)
    except ValueError:  # (unreadable: the walk's history check says so)
        return None
    return (record.inputs or None) if record else None


def changed_since_judged(run_id: str, changed: list[str]) -> str:
    return (
        f"runs/{run_id} changed since it was judged ({', '.join(changed)}): the walk commits the verdicts of the "
        f"files as they were, and the run is then reported as changed; re-filter it with "
        f"`{materialize_command(run_id)}`"
    )


def count_records(run_dir: UPath, file: str) -> int:
    """The records (non-blank lines) of the run's `file`: of a legacy run's kept.jsonl, its kept rows."""
    return non_blank_lines((run_dir / file).read_bytes())


def _symlinks_below(folder: str) -> list[str]:
    found, stack = [], [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():
                found.append(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return found


# The folder a trajectory dir sits in, at most three levels deep (runs/<run_id>/traj/<task>/<n> ->
# runs/<run_id>/traj; a/b -> a; a -> a).
_TOP = r"^((?:[^/]*/){0,2}[^/]*)/.*$"


def dirs_outside_root(run_dir: UPath, dirs: pd.Series) -> set[str]:
    """The trajectory dirs that, with symlinks resolved, leave the data root (local disk only).

    Dirs are grouped by their top folder (runs/<run_id>/traj); each top folder is resolved once and walked
    once for symlinks, and only dirs behind a symlink are resolved one by one. A batch without symlinks
    costs one walk of its trajectory folders.
    """
    if not is_local(run_dir) or dirs.empty:
        return set()
    root = os.path.realpath(os.path.dirname(os.path.dirname(run_dir.path)))
    inside = lambda rel: os.path.realpath(os.path.join(root, rel)).startswith(root + os.sep)  # noqa: E731
    paths = pa.array(
        dirs, type=pa.string()
    )  # (not made unique first: the paths are nearly all distinct, so hashing them costs more than it saves)
    outside: set[str] = set()
    for top, under in _by_top(paths):
        if not inside(top):
            outside.update(under.to_pylist())
            continue
        links = tuple(os.path.relpath(p, root) + "/" for p in _symlinks_below(os.path.join(root, top)))
        if links:  # (a dir is compared in its normal form: `traj/./link` and `traj//link` are behind `traj/link`)
            behind = (d for d in under.to_pylist() if (posixpath.normpath(d) + "/").startswith(links))
            outside.update(d for d in behind if not inside(d))
    return outside


def _by_top(paths: pa.Array) -> list[tuple[str, pa.Array]]:
    """(top folder, the paths under it) groups. A batch's dirs nearly all share one top
    (runs/<run_id>/traj): one prefix test settles those, and only the others go through the regex."""
    first = pc.replace_substring_regex(paths.slice(0, 1), _TOP, r"\1")[0].as_py()
    groups = []
    if first.count("/") == 2:
        common = pc.starts_with(paths, first + "/")
        groups.append((first, paths.filter(common)))
        paths = paths.filter(pc.invert(common))
    tops = pc.replace_substring_regex(paths, _TOP, r"\1")
    groups += [(top, paths.filter(pc.equal(tops, top))) for top in pc.unique(tops).to_pylist()]
    return groups
