"""Reading history off the data root: commit records, retired.json, the committed kept files (verified against
their commits) and legacy `runs/<run>/kept.jsonl` (CONTRACT §2, §4). What they mean and how they are counted
is `rules/history.py`'s; this module lists and reads the files and hands their bytes over."""

from collections.abc import Iterator

import pandas as pd
import pyarrow as pa
from upath import UPath

from filter_pipeline.rules.batch import LEGACY_KEPT_FILE
from filter_pipeline.rules.commits import COMMITS_DIR, CommitRecord, HistoryIntegrityError, commit_file, parse_commit
from filter_pipeline.rules.history import (
    RETIRED_FILE,
    HistoryError,
    PriorIndex,
    Retired,
    Source,
    add_own,
    check_committed,
    covering_walk,
    parse_retired,
    prior_index,
    refilter,
    whole_runs_counted,
)
from filter_pipeline.settings import materialize_command
from filter_pipeline.storage.files import RUNS_DIR, WAREHOUSE_DIR, etag, files_in, listing, read_if_present
from filter_pipeline.storage.parquet import read_parquet_file
from filter_pipeline.storage.publish import commit_path, published_folder, staged_copy

# Readers of many committed files (the audit, coverage's counts) read again, at most this many passes in all, when
# a file no longer matches the commit records they read first and the records changed meanwhile (a walk committed).
COMMIT_RACE_PASSES = 3


def read_commit(warehouse: UPath, run_id: str) -> CommitRecord | None:
    """The run's commit record; None when it has none. Raises HistoryIntegrityError on a record that is not one."""
    try:
        data = commit_path(warehouse, run_id).read_bytes()
    except FileNotFoundError:
        return None
    return parse_commit(data, commit_file(run_id), run_id)


def read_commits(warehouse: UPath) -> dict[str, CommitRecord]:
    """Every committed run: run_id -> its record. Raises HistoryIntegrityError on a record that is not one."""
    found = {run_id: read_commit(warehouse, run_id) for run_id in files_in(warehouse / COMMITS_DIR, ".json")}
    return {run_id: record for run_id, record in found.items() if record is not None}  # (one deleted meanwhile)


def commit_versions(warehouse: UPath) -> dict[str, str]:
    """run_id -> the ETag of its commit record, for every committed run of a warehouse on object storage, from
    one fresh listing of the records' folder (a cached listing would hide another walk's commit)."""
    listed = listing(warehouse / COMMITS_DIR, fresh=True)
    return {
        name.removesuffix(".json"): etag(info)
        for name, info in listed
        if info["type"] == "file" and name.endswith(".json")
    }


def committed_meanwhile(warehouse: UPath, read: dict[str, str], run_id: str) -> list[str]:
    """The runs but `run_id` committed, or committed again, since `read` (their `commit_versions` then)."""
    return sorted(r for r, version in commit_versions(warehouse).items() if r != run_id and read.get(r) != version)


def read_retired(data_root: UPath) -> bytes | None:
    """`<data>/retired.json`'s bytes; None when there is none. HistoryError, in one line, when it exists but
    cannot be read (a folder, no permission): whoever refuses a malformed one refuses it too."""
    return read_if_present(data_root / RETIRED_FILE, HistoryError)


def load_retired(data_root: UPath) -> Retired:
    """Parse `<data>/retired.json` (absent: nothing retired). Raises HistoryError on a wrong shape."""
    return parse_retired(read_retired(data_root))


def kept_files(kept_dir: UPath) -> dict[str, UPath]:
    """run_id -> its `kept` Parquet file, committed or not, skipping temporary files of writes in progress."""
    return {run_id: p for run_id, p in files_in(kept_dir, ".parquet").items() if not run_id.startswith("_")}


def legacy_kept_files(runs_dir: UPath) -> dict[str, UPath]:
    """run_id -> `runs/<run>/kept.jsonl` for every run that has one."""
    if not runs_dir.exists():
        return {}
    return {p.name: p / LEGACY_KEPT_FILE for p in runs_dir.iterdir() if (p / LEGACY_KEPT_FILE).exists()}


def verified_bytes(data_root: UPath, run_id: str, entry: dict) -> bytes:
    """The bytes of a committed file, checked against its commit entry (size, SHA-256). Raises
    HistoryIntegrityError naming the file when it is missing, unreadable or changed. A file that a published
    walk has not moved into place yet (it is moving it now, or was stopped doing so) is read from its staging
    folder: that is the committed file."""
    final = data_root / entry["path"]
    try:
        return _checked(final, run_id, entry)
    except (FileNotFoundError, HistoryIntegrityError) as exc:
        failure = exc
    staged = staged_copy(data_root, run_id, entry["path"])
    # read in place again after the staged copy: the walk may have moved it between the two reads
    for path in [staged, final] if staged is not None else [final]:
        try:
            return _checked(path, run_id, entry)
        except (FileNotFoundError, HistoryIntegrityError) as exc:
            failure = exc if path is final else failure
    if isinstance(failure, FileNotFoundError):
        raise _missing(run_id, entry) from None
    raise failure


def committed_paths(data_root: UPath, run_id: str, entries: dict[str, dict]) -> dict[str, UPath]:
    """Where each committed file of `entries` (a commit record's, by asset) is now: in the staging folder of the
    published walk that has not moved it yet (a re-walk's file in place is the walk before's), else in place.
    Raises HistoryIntegrityError naming a file in neither (contents are not checked: `verified_bytes` does)."""
    folder = published_folder(data_root, run_id)
    found = {}
    for asset, entry in entries.items():
        staged, final = (folder / entry["path"] if folder is not None else None), data_root / entry["path"]
        if staged is not None and staged.exists():
            found[asset] = staged
        elif final.exists():  # (moved into place, or never staged)
            found[asset] = final
        else:
            raise _missing(run_id, entry)
    return found


def _missing(run_id: str, entry: dict) -> HistoryIntegrityError:
    return HistoryIntegrityError(f"{entry['path']} is missing, but run {run_id} committed it: {refilter(run_id)}")


def _checked(path: UPath, run_id: str, entry: dict) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise HistoryIntegrityError(
            f"{entry['path']} (committed by run {run_id}) cannot be read ({exc}): {refilter(run_id)}"
        ) from None
    return check_committed(data, run_id, entry)


def names_no_kept_file(run_id: str) -> str:
    """What a commit record naming no kept file means, and the mend: no walk reads history past it, its run's own
    included, until it is gone."""
    return (
        f"{commit_file(run_id)} names no kept file: delete it and re-filter {run_id} with "
        f"`{materialize_command(run_id)}`"
    )


def history_sources(data_root: UPath, commits: dict[str, CommitRecord]) -> dict[str, tuple[str, UPath, dict | None]]:
    """run_id -> ("warehouse", its committed kept file, the commit's entry) for each committed run, or
    ("legacy", runs/<run>/kept.jsonl, None) for a run with a legacy file and no commit."""
    sources: dict[str, tuple[str, UPath, dict | None]] = {
        r: ("legacy", p, None) for r, p in legacy_kept_files(data_root / RUNS_DIR).items() if r not in commits
    }
    for run_id, record in commits.items():
        entry = record.files.get("kept")
        if entry is None:
            raise HistoryIntegrityError(names_no_kept_file(run_id))
        sources[run_id] = ("warehouse", data_root / entry["path"], entry)
    return dict(sorted(sources.items()))


def _read_sources(
    data_root: UPath, sources: dict[str, tuple[str, UPath, dict | None]], commits: dict[str, CommitRecord]
) -> Iterator[Source]:
    """Each source's bytes, read when the counting asks for them (one file held at a time)."""
    for run_id, (kind, path, entry) in sources.items():
        if kind == "warehouse":
            data = verified_bytes(data_root, run_id, entry)
            yield Source(run_id, kind, data, entry, commits[run_id].digest)
        else:
            yield Source(run_id, kind, path.read_bytes())


def build_prior_index(
    data_root: UPath,
    run_id: str,
    batch_keys: pd.DataFrame,
    retired: Retired,
    commits: dict[str, CommitRecord] | None = None,
) -> PriorIndex:
    """The prior-run dedup index for `run_id` (CONTRACT §3.5, §4): every other committed run's kept rows,
    plus legacy kept.jsonl, minus retired (`rules.history.prior_index` over the files read here). Raises
    HistoryIntegrityError (one line: the file, what is wrong, what to do) when a committed kept file is
    missing, changed, unreadable or not a kept file. `commits`: the warehouse's commit records (read when
    not given)."""
    commits = read_commits(data_root / WAREHOUSE_DIR) if commits is None else commits
    sources = history_sources(data_root, commits)
    others = {r: s for r, s in sources.items() if r != run_id and not retired.run_is_retired(r)}
    return prior_index(batch_keys, retired, _read_sources(data_root, others, commits))


def kept_counts(data_root: UPath, retired: Retired) -> tuple[pd.DataFrame, int]:
    """(macro, site, n_kept) over every non-retired run's kept rows (what coverage shows), and how many runs.
    Every committed kept file is verified against its commit as `build_prior_index` verifies it; when the
    newest walk read all the other runs as they stand (`covering_walk`), its prior_kept_counts plus its own
    kept file are counted instead of decoding every run's file again. A walk committing meanwhile (a file no
    longer what the records read first say) makes it read again, `COMMIT_RACE_PASSES` times at most."""
    commits = read_commits(data_root / WAREHOUSE_DIR)
    for _ in range(COMMIT_RACE_PASSES - 1):
        try:
            return _kept_counts(data_root, retired, commits)
        except HistoryIntegrityError:
            again = read_commits(data_root / WAREHOUSE_DIR)
            if again == commits:
                raise
            commits = again
    return _kept_counts(data_root, retired, commits)


def _kept_counts(data_root: UPath, retired: Retired, commits: dict[str, CommitRecord]) -> tuple[pd.DataFrame, int]:
    sources = history_sources(data_root, commits)
    live = {r for r in sources if not retired.run_is_retired(r)}
    walk = covering_walk(commits, live, retired)
    if walk is not None:
        for run_id in sorted(live):
            verified_bytes(data_root, run_id, commits[run_id].files["kept"])
        record = commits[walk]
        prior = read_parquet_file(pa.BufferReader(verified_bytes(data_root, walk, record.files["prior_kept_counts"])))
        if whole_runs_counted(prior, commits, record.history):
            own = verified_bytes(data_root, walk, record.files["kept"])
            return add_own(prior, read_parquet_file(pa.BufferReader(own), columns=["macro", "site"])), len(live)
    no_keys = pd.DataFrame({"dedup_key": pd.Series([], dtype=object), "key_hash": pd.Series([], dtype="int64")})
    index = build_prior_index(data_root, "", no_keys, retired, commits)
    return index.counts, index.runs_read
