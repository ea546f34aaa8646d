"""What the review app and `explain` read: the runs of a data root and each run's task table with its fate.

Pure reads over the data root (local or s3:// through UPath). A run's tables are read once and kept, keyed by
the path and version (`file_version`: mtime, size and inode on local disk, ETag on object storage) of every
file they come from, so a page of a large run is a filter over frames in memory; a rewritten file is read
again.
"""

import json
import threading
from collections import OrderedDict

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from filter_pipeline.review.fates import (
    FATE_KEPT,
    STATE_UNREADABLE,
    TASK_COLUMNS,
    RunTables,
    summarize,
    task_table,
    unreadable_summary,
)
from filter_pipeline.rules.batch import (
    EXECUTIONS_FILE,
    LEGACY_KEPT_FILE,
    SUCCESS_FILE,
    TASKS_FILE,
    check_run_id,
    is_plain_run_id,
    jsonl_lines,
)
from filter_pipeline.rules.commits import COMMITS_DIR, commit_file, parse_commit
from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.rules.history import RETIRED_FILE, HistoryError, Retired, legacy_key_text, parse_retired
from filter_pipeline.rules.records import ATTEMPT_FIELDS, json_text
from filter_pipeline.rules.schemas import SCHEMAS, key_hashes, pylist, to_pandas
from filter_pipeline.rules.vocabulary import STATUS_JUDGED
from filter_pipeline.storage.failures import failure_path, read_failure
from filter_pipeline.storage.files import (
    RUNS_DIR,
    WAREHOUSE_DIR,
    asset_file,
    file_version,
    files_in,
    folder_entries,
    run_folder,
)
from filter_pipeline.storage.history import committed_paths, read_retired
from filter_pipeline.storage.publish import commit_path
from filter_pipeline.storage.runs import unparsed_batch

CACHED_RUNS = 8  # run tables kept in memory (least recently used dropped first)
ERROR_MAX_CHARS = 500  # an error shown on a page or in a JSON answer, in one line


class ReviewError(LookupError):
    """A run or task that does not exist, or a request that cannot be answered: one line for the user."""


class UnreadableFile(ValueError):
    """A file of the data root exists but cannot be read: one line naming it and why."""


class UnreadableRun(UnreadableFile):
    """A file of the run cannot be read: one line naming the run and why (`reason`)."""

    def __init__(self, run_id: str, reason: str):
        super().__init__(f"run {run_id} cannot be read: {reason}")
        self.run_id, self.reason = run_id, reason


def read_table(path: UPath, columns: list[str] | None = None, exclude: tuple = ()) -> pd.DataFrame | None:
    """The Parquet file's columns that exist among `columns` (all when None); None when the file is absent.
    Columns another version of the stage added or has not added yet are simply absent."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        names = parquet.schema_arrow.names
        wanted = [c for c in (names if columns is None else columns) if c in names and c not in exclude]
        return to_pandas(parquet.read(columns=wanted))
    except (pa.ArrowException, ValueError) as exc:  # (the run's page says which of its files, as verify does)
        raise ValueError(f"{WAREHOUSE_DIR}/{path.parent.name}/{path.name}: {exc}") from exc


def frame(path: UPath, columns: list[str]) -> pd.DataFrame:
    """`read_table`, with an empty frame of `columns` for an absent file."""
    found = read_table(path, columns)
    return found if found is not None else _empty(columns)


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="object") for c in columns})


class Warehouse:
    """The data root as the review app sees it; thread-safe, with a small cache of run tables."""

    def __init__(self, root: UPath):
        self.root = root
        self.warehouse = root / WAREHOUSE_DIR
        self._cache: OrderedDict[str, tuple[tuple, RunTables]] = OrderedDict()
        self._summaries: dict[str, tuple[tuple, dict]] = {}  # run_id -> (key, summary)
        self._judged: dict[str, tuple[tuple, pd.DataFrame]] = {}  # run_id -> (key, judged attempts)
        self._lock = threading.Lock()

    def asset_file(self, asset: str, run_id: str) -> UPath:
        return asset_file(self.warehouse, asset, run_id)

    def problem(self) -> str | None:
        """What every page says above its content: a retired.json the stage refuses (`retired_problem`)."""
        return retired_problem(self.root)

    def run_ids(self) -> list[str]:
        """Every run the data root knows, in run_id order: batch folders with a name the stage accepts (not a
        file such as runs/README.md, nor a folder it refuses to filter), commit records and judged runs."""
        judged = {name for name in files_in(self.warehouse / "judge_verdicts", ".parquet") if is_plain_run_id(name)}
        return sorted(self.rooted_run_ids() | judged)

    def rooted_run_ids(self) -> set[str]:
        """The runs with a batch folder or a commit record: those the labelling queue serves (a judge_verdicts
        file alone, a copy kept beside it or a batch since deleted, has no story to label)."""
        found = {name for name, is_dir in folder_entries(self.root / RUNS_DIR) if is_dir and is_plain_run_id(name)}
        # (a file named otherwise, such as a copy `2026-11-29 copy.json`, is not a run's: the stage writes none)
        return found | {name for name in files_in(self.warehouse / COMMITS_DIR, ".json") if is_plain_run_id(name)}

    def check_run(self, run_id: str) -> str:
        """`run_id`, if the data root knows it; ReviewError else (for a name that is no run_id, `explain`'s line)."""
        try:
            check_run_id(run_id) if isinstance(run_id, str) else None
        except ValueError as exc:
            raise ReviewError(str(exc)) from None
        if not isinstance(run_id, str) or run_id not in self.run_ids():
            raise ReviewError(f"no run {run_id!r} in {self.root}")
        return run_id

    def _files(self, run_id: str) -> dict[str, UPath]:
        files = {a: self.asset_file(a, run_id) for a in ASSETS}
        files["commit"] = commit_path(self.warehouse, run_id)
        batch = run_folder(self.root, run_id)
        files["legacy"] = batch / LEGACY_KEPT_FILE
        files["complete"] = batch / SUCCESS_FILE
        files["retired"] = self.root / RETIRED_FILE
        files["failed"] = failure_path(self.warehouse, run_id)
        # (read until the judge step writes batch_tasks)
        files[TASKS_FILE] = batch / TASKS_FILE
        files[EXECUTIONS_FILE] = batch / EXECUTIONS_FILE
        return files

    def _key(self, run_id: str) -> tuple:
        return tuple((name, str(path), file_version(path)) for name, path in self._files(run_id).items())

    def run(self, run_id: str) -> RunTables:
        """The run's tables, from the cache when no file changed since they were read."""
        self.check_run(run_id)
        return self._run(run_id)

    def _run(self, run_id: str) -> RunTables:
        """`run` of a run_id known to be one (`run_ids`)."""
        key = self._key(run_id)
        with self._lock:
            cached = self._cache.get(run_id)
            if cached and cached[0] == key:
                self._cache.move_to_end(run_id)
                return cached[1]
        try:
            tables = load_run(self.root, run_id, self._files(run_id))
        except (OSError, ValueError, RecursionError) as exc:  # (Arrow's errors are ValueErrors)
            raise UnreadableRun(run_id, one_line(exc, ERROR_MAX_CHARS) or type(exc).__name__) from exc
        with self._lock:
            self._cache[run_id] = (key, tables)
            self._cache.move_to_end(run_id)
            while len(self._cache) > CACHED_RUNS:
                self._cache.popitem(last=False)
            self._summaries[run_id] = (key, tables.summary)
        return tables

    def summary(self, run_id: str) -> dict:
        """The runs page's line of a run of `run_ids`: kept for every run read, not only the CACHED_RUNS whose
        tables are in memory; a run whose files cannot be read says why in its state."""
        key = self._key(run_id)
        with self._lock:
            cached = self._summaries.get(run_id)
        if cached and cached[0] == key:
            return cached[1]
        try:
            return self._run(run_id).summary
        except UnreadableRun as exc:  # one run, not the whole page
            summary = unreadable_summary(run_id, exc.reason)
            with self._lock:
                self._summaries[run_id] = (key, summary)
            return summary

    def judged(self, run_id: str) -> pd.DataFrame:
        """The judged attempts of a run of `run_ids` (JUDGED_COLUMNS), read from its judge_verdicts alone (the
        judge step's file, which no commit moves) and kept until that file changes: the labelling queue reads
        every run's. None of a run whose files were found unreadable (`known_unreadable`), nor, until it can be
        read, of a run whose verdicts cannot be: the queue goes on without them."""
        if self.known_unreadable(run_id):
            return NO_JUDGED
        path = self.asset_file("judge_verdicts", run_id)
        key = file_version(path)
        with self._lock:
            cached = self._judged.get(run_id)
        if cached and cached[0] == key:
            return cached[1]
        try:
            found = judged_attempts(run_id, frame(path, VERDICT_COLUMNS_JUDGED))
        except OSError:  # (the store out of reach for a moment: read again on the next request)
            return NO_JUDGED
        except ValueError:  # (a file that is not Parquet: the run's own page says why)
            found = NO_JUDGED
        with self._lock:
            self._judged[run_id] = (key, found)
        return found

    def known_unreadable(self, run_id: str) -> bool:
        """Whether the run's files were found unreadable when last read, and are as they were then."""
        with self._lock:
            cached = self._summaries.get(run_id)
        unreadable = cached is not None and cached[1]["state"].startswith(STATE_UNREADABLE)
        return unreadable and cached[0] == self._key(run_id)

    def warm_in_background(self) -> threading.Thread:
        """Read the newest runs' tables in a background thread, so their first pages answer at once."""

        def warm() -> None:
            for run_id in reversed(self.run_ids()[-CACHED_RUNS:]):
                try:
                    self._run(run_id)
                except (OSError, ValueError, ReviewError):
                    pass  # (the page will say what is wrong when asked)

        thread = threading.Thread(target=warm, name="review-warm", daemon=True)
        thread.start()
        return thread

    def runs(self, offset: int = 0, limit: int | None = None) -> tuple[int, list[dict]]:
        """(how many runs there are, the summaries of those from `offset`, newest first, at most `limit`: all
        when None). Only the runs asked for are read."""
        newest_first = self.run_ids()[::-1]
        chosen = newest_first[offset:] if limit is None else newest_first[offset : offset + limit]
        return len(newest_first), [self.summary(run_id) for run_id in chosen]


ASSETS = ("batch_tasks", "batch_attempts", "judge_verdicts", "kept", "surplus", "failure_pool", "batch_rejects",
          "dpo_pairs", "prior_kept_counts")  # fmt: skip


def _verdicts(path: UPath) -> tuple[pd.DataFrame, bool]:
    """(judge_verdicts, whether the run has that file): every column this version of the stage or a newer one
    wrote (the raw replies left out: nothing shows them); an empty frame of the basic columns without the file."""
    found = read_table(path, exclude=("raw_replies",))
    if found is not None:
        return found, True
    basic = ["task_id", "site", "status", "passed", "dir", "attempt", "votes", "cost"]
    return pd.DataFrame({c: pd.Series(dtype="object") for c in basic}), False


def retired_problem(root: UPath) -> str | None:
    """Why the stage refuses the data root's retired.json, in one line; None when it is absent or valid. Every
    page says so above its content (`explain` on stderr), and shows no row as retired meanwhile."""
    try:
        parse_retired(read_retired(root))
    except HistoryError as exc:
        problem = str(exc)
    else:
        return None
    return f"{problem}: the stage refuses it, and walks no batch until it is corrected or removed; no row is shown as retired meanwhile"


def _retired(root: UPath) -> Retired:
    """retired.json as the stage reads it; nothing retired when it is absent or refused (`retired_problem`)."""
    try:
        return parse_retired(read_retired(root))
    except HistoryError:
        return Retired()


# the judge step's files every committed run has (its walk read them)
JUDGE_STEP_ASSETS = ("batch_tasks", "batch_attempts", "judge_verdicts", "failure_pool")


def load_run(root: UPath, run_id: str, files: dict[str, UPath]) -> RunTables:
    """Read the run's files and derive each task's fate. A file the run's commit names is read where it is
    (`committed_paths`: a publish not complete holds it in its staging folder); HistoryIntegrityError (a
    ValueError) naming it when it is nowhere, and a ValueError naming a judge step's file a committed run
    lacks: the run's rows are not shown as undecided."""
    commit, files = committed_files(root, run_id, files)
    if commit is not None and "error" not in commit:  # (a walk read them all: one gone would show wrong fates)
        gone = [asset for asset in JUDGE_STEP_ASSETS if not files[asset].exists()]
        if gone:
            raise ValueError(
                f"{WAREHOUSE_DIR}/{gone[0]}/{run_id}.parquet is missing, but run {run_id} was walked from it"
            )
    verdicts, judged = _verdicts(files["judge_verdicts"])
    legacy = files["legacy"] if files["legacy"].exists() else None
    # (before the judge step parsed the batch, it is parsed here as that step will; once it has, a failure on
    # record is one it has since got past)
    parsed = files["batch_tasks"].exists()
    unparsed = None if legacy or parsed else unparsed_batch(files["complete"].parent, run_id)
    tables = RunTables(
        run_id=run_id,
        commit=commit,
        tasks=_batch_frame(files["batch_tasks"], BATCH_TASK_COLUMNS, unparsed and unparsed.tasks),
        attempts=_batch_frame(files["batch_attempts"], BATCH_ATTEMPT_COLUMNS, unparsed and unparsed.attempts),
        verdicts=verdicts,
        judged=judged,
        surplus=frame(files["surplus"], ["task_id", "dropped", "dup_of_run_id", "dup_of_task_id"]),
        failure_pool=frame(
            files["failure_pool"],
            ["task_id", "stage", "reason", "detail", "attempt", "dir", "backend_ok", "votes", "blocked"],
        ),  # fmt: skip
        rejects=_batch_frame(files["batch_rejects"], BATCH_REJECT_COLUMNS, unparsed and unparsed.rejects),
        prior_counts=frame(files["prior_kept_counts"], ["macro", "site", "n_kept"]),
        dpo_pairs=frame(
            files["dpo_pairs"],
            [
                "task_id",
                "chosen_dir",
                "chosen_attempt",
                "rejected_dir",
                "rejected_attempt",
                "rejected_stage",
                "rejected_reason",
            ],
        ),  # fmt: skip
        legacy=legacy,
        complete=commit is not None or files["complete"].exists() or not files["complete"].parent.exists(),
        retired=_retired(files["retired"].parent),
        failure=None if commit or parsed else read_failure(files["failed"]),
    )
    kept_ids = frame(files["kept"], ["task_id"])["task_id"]
    legacy = read_legacy_kept(tables.legacy) if tables.legacy and tables.tasks.empty else None
    tables.tasks = task_table(tables, kept_ids, legacy)
    tables.summary = summarize(tables)
    return tables


def committed_files(root: UPath, run_id: str, files: dict[str, UPath]) -> tuple[dict | None, dict[str, UPath]]:
    """(the run's commit record as JSON, None without one, {"error": why} for one that cannot be read; `files`
    with each file of ASSETS the record commits where it is now: `committed_paths`, whose
    HistoryIntegrityError, a ValueError, names a file that is nowhere)."""
    try:
        record = parse_commit(files["commit"].read_bytes(), commit_file(run_id), run_id)
    except FileNotFoundError:
        return None, files
    except ValueError as exc:
        return {"error": str(exc)}, files
    entries = {a: e for a, e in record.files.items() if a in ASSETS}
    return json.loads(record.to_json()), files | committed_paths(root, run_id, entries)


# the columns of batch_tasks, batch_attempts and batch_rejects the pages show
BATCH_TASK_COLUMNS = ["task_id", "site", "macro", "instruction", "dedup_key"]
BATCH_ATTEMPT_COLUMNS = list(ATTEMPT_FIELDS)
BATCH_REJECT_COLUMNS = [c for c in SCHEMAS["batch_rejects"].names if c != "run_id"]


def _batch_frame(path: UPath, columns: list[str], unparsed: pd.DataFrame | None) -> pd.DataFrame:
    """The judge step's file at `path`, or before it wrote it, the same rows of the batch parsed here."""
    return frame(path, columns) if unparsed is None else unparsed.reindex(columns=columns)


def read_legacy_kept(path: UPath) -> pd.DataFrame:
    """A run filtered by the earlier script has only its kept rows (kept.jsonl): each is a kept task."""
    rows = []
    for _, raw in jsonl_lines(path.read_bytes()):
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):  # (the ledger refuses such a file: the page shows what it can)
            continue
        if isinstance(record, dict) and isinstance(record.get("task_id"), str):
            rows.append({"task_id": json_text(record["task_id"]), "fate": FATE_KEPT, "reason": None,
                         "site": json_text(record.get("site")), "macro": json_text(record.get("macro")),
                         "instruction": json_text(record.get("instruction")),
                         "dedup_key": _legacy_key(record.get("dedup_key"))})  # fmt: skip
    return pd.DataFrame(rows, columns=[*TASK_COLUMNS, "dedup_key"])


def _legacy_key(key) -> str:
    """The key's text as the ledger compares it (prior_dedup_index shows the same), or, for a key the ledger
    refuses, as the file has it."""
    try:
        return legacy_key_text(key)
    except (TypeError, ValueError, RecursionError):
        if isinstance(key, str):
            return key
    try:
        return json.dumps(key, ensure_ascii=False)
    except RecursionError:
        return "(a key nested too deep to show)"


def matching(tasks: pd.DataFrame, filters: dict) -> pd.DataFrame:
    """The rows of the task table under `filters` (column -> value, for fate, site, macro, reason; None: any)."""
    mask = np.ones(len(tasks), bool)
    for column, value in filters.items():
        if value:
            mask &= (tasks[column] == value).to_numpy(bool)
    return tasks[mask] if not mask.all() else tasks


def page(tasks: pd.DataFrame, filters: dict, offset: int, limit: int) -> tuple[int, list[dict]]:
    """(rows matching, the rows at offset..offset+limit) of the task table under `filters` (`matching`)."""
    rows = matching(tasks, filters)
    shown = rows.iloc[offset : offset + limit][TASK_COLUMNS].astype("object")  # (only the page made JSON-ready)
    return int(len(rows)), shown.where(shown.notna(), None).to_dict("records")


# draw: a hash of the dir, the labelling queue's random order (computed once per run as it is read)
JUDGED_COLUMNS = ["run_id", "task_id", "dir", "site", "votes", "passed", "draw"]


def draw(dirs: pd.Series) -> np.ndarray:
    """Each dir's place in the labelling queue's random order: its key_hash (BLAKE2b), the same everywhere."""
    return key_hashes(pylist(dirs))


VERDICT_COLUMNS_JUDGED = ["status", "task_id", "dir", "site", "votes", "passed"]  # what judged attempts read


NO_JUDGED = pd.DataFrame(columns=JUDGED_COLUMNS)  # (shared, never changed: the queue's memo sees it unchanged)


def judged_attempts(run_id: str, verdicts: pd.DataFrame) -> pd.DataFrame:
    """The run's judged attempts (what the labelling queue serves), from its judge_verdicts: JUDGED_COLUMNS."""
    if verdicts.empty or "status" not in verdicts:
        return NO_JUDGED
    v = verdicts[verdicts["status"] == STATUS_JUDGED]
    return pd.DataFrame({"run_id": run_id, "task_id": v["task_id"], "dir": v["dir"], "site": v["site"],
                         "votes": v["votes"], "passed": v["passed"], "draw": draw(v["dir"])})  # fmt: skip
