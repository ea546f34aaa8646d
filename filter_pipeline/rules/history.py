"""History for the ledger walk: what earlier runs kept (CONTRACT §2 retired.json, §3.5 the prior index, §4).

The record is what was committed: the `kept` file each commit record (`warehouse/_commits/<run>.json`)
names, verified against the size and SHA-256 the commit recorded, plus the legacy `runs/<run>/kept.jsonl`
of runs filtered by the earlier script that have no commit. A committed file that is missing, changed,
unreadable or not a kept file fails the read with one line naming it (HistoryIntegrityError); a kept file
without a commit (a walk killed before it committed) is not history. Files are read a few at a time, so
memory follows the largest run rather than the whole history.
"""

import hashlib
import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from upath import UPath

from filter_pipeline.rules.batch import LEGACY_KEPT_FILE, local_signature
from filter_pipeline.rules.commits import LEGACY_PREFIX, CommitRecord, HistoryIntegrityError, read_commits
from filter_pipeline.rules.schemas import canonical_key, conform, empty_frame, key_hashes, pylist, to_pandas

RETIRED_FILE = "retired.json"


class HistoryError(ValueError):
    """retired.json or a legacy kept.jsonl is unreadable; the message says which and why."""


@dataclass(frozen=True)
class Retired:
    """Kept rows that no longer count for dedup or caps: whole runs, or single (run, task) rows."""

    runs: frozenset[str] = frozenset()
    tasks: dict[str, frozenset[str]] = field(default_factory=dict)

    def run_is_retired(self, run_id: str) -> bool:
        return run_id in self.runs


def load_retired(data_root: UPath) -> Retired:
    """Parse `<data>/retired.json` (absent: nothing retired). Raises HistoryError on a wrong shape."""
    path = data_root / RETIRED_FILE
    if not path.exists():
        return Retired()
    where = f"{RETIRED_FILE}"
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HistoryError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise HistoryError(f"{where} must be a JSON list of {{run_id, task_ids?, reason}} objects")
    runs: set[str] = set()
    tasks: dict[str, set[str]] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("run_id"), str):
            raise HistoryError(f"{where}[{i}] must be an object with a string 'run_id'")
        if "task_ids" not in entry or entry["task_ids"] is None:
            runs.add(entry["run_id"])
            continue
        ids = entry["task_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, str) for t in ids):
            raise HistoryError(f"{where}[{i}].task_ids must be a list of strings")
        tasks.setdefault(entry["run_id"], set()).update(ids)
    return Retired(runs=frozenset(runs), tasks={r: frozenset(t) for r, t in tasks.items()})


@dataclass(frozen=True)
class PriorIndex:
    """What the walk of one run needs from history.

    `keys`: rows (dedup_key, macro, site, run_id, task_id) of prior kept rows whose key is among the
    batch's keys; `counts`: (macro, site, n_kept) over all non-retired prior kept rows.
    """

    keys: pd.DataFrame
    counts: pd.DataFrame
    runs_read: int
    rows_read: int
    history: dict[str, str] = field(default_factory=dict)  # run_id -> commit digest, or "legacy:<sha256>"


_INDEX_COLUMNS = ["dedup_key", "key_hash", "macro", "site", "task_id"]
_STRINGS = pa.schema([(c, pa.string()) for c in ("dedup_key", "macro", "site", "task_id")])


def kept_files(kept_dir: UPath) -> dict[str, UPath]:
    """run_id -> its `kept` Parquet file, committed or not, skipping temporary files of writes in progress."""
    if not kept_dir.exists():
        return {}
    return {
        p.name.removesuffix(".parquet"): p
        for p in kept_dir.iterdir()
        if p.name.endswith(".parquet") and not p.name.startswith((".", "_"))
    }


def legacy_kept_files(runs_dir: UPath) -> dict[str, UPath]:
    """run_id -> `runs/<run>/kept.jsonl` for every run that has one."""
    if not runs_dir.exists():
        return {}
    return {p.name: p / LEGACY_KEPT_FILE for p in runs_dir.iterdir() if (p / LEGACY_KEPT_FILE).exists()}


def _read_legacy(path: UPath, run_id: str) -> tuple[pa.Table, str]:
    """A legacy kept.jsonl's rows (keys re-encoded as canonical text) and the SHA-256 of its bytes."""
    data = path.read_bytes()
    rows = []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HistoryError(f"runs/{run_id}/{LEGACY_KEPT_FILE}: not UTF-8 ({exc})") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key = record["dedup_key"]
            if isinstance(key, str):  # some exports stored the key as its JSON text
                key = json.loads(key)
            if not isinstance(key, list):
                raise TypeError("dedup_key is not an array")
            rows.append(
                {
                    "dedup_key": canonical_key(key),
                    "macro": str(record["macro"]),
                    "site": str(record["site"]),
                    "task_id": str(record["task_id"]),
                }
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise HistoryError(f"runs/{run_id}/{LEGACY_KEPT_FILE}:{number}: not a kept row ({exc})") from None
    return _with_hashes(pa.Table.from_pylist(rows, schema=_STRINGS)), hashlib.sha256(data).hexdigest()


def _with_hashes(table: pa.Table) -> pa.Table:
    """The table with a key_hash column computed from dedup_key (legacy rows, files from before key_hash)."""
    hashes = pa.array(key_hashes(table["dedup_key"].to_pylist()), type=pa.int64())
    if "key_hash" in table.column_names:
        return table.set_column(table.column_names.index("key_hash"), "key_hash", hashes)
    return table.append_column("key_hash", hashes)


class _KeyProbe:
    """Which history rows carry one of the batch's keys: matched on 64-bit hashes (an int64 hash index, O(1)
    per row), then confirmed on the canonical text."""

    def __init__(self, batch_keys: pd.DataFrame):
        self.batch_hashes = batch_keys["key_hash"].to_numpy(dtype=np.int64)
        self.hashes = pd.Index(pd.unique(self.batch_hashes))
        self.hashes.get_indexer(np.zeros(1, dtype=np.int64))  # build its hash table now, not racing in threads
        texts = pa.array(batch_keys["dedup_key"], type=pa.string())
        self.texts = texts.combine_chunks() if isinstance(texts, pa.ChunkedArray) else texts
        self.wanted = len(batch_keys) > 0  # no keys to look for: history is read for its counts alone

    def maybe(self, hashes: np.ndarray) -> np.ndarray:
        return self.hashes.get_indexer(hashes) >= 0

    def confirm(self, matched: pa.Table) -> pa.Table:
        """The rows of `matched` (rows whose key_hash is among the batch's) whose text is one of the batch's.
        A key's hash is a function of its text, so only the batch texts with those hashes can match: the value
        set is those few, not all the batch's texts (a set of 300k texts costs 0.1 s to build)."""
        same_hash = pd.Index(pd.unique(matched["key_hash"].to_numpy())).get_indexer(self.batch_hashes) >= 0
        return matched.filter(pc.is_in(matched["dedup_key"], value_set=self.texts.filter(pa.array(same_hash))))


class _Names:
    """Integer ids for names, looked up by Arrow in bulk: only names never seen before touch Python."""

    def __init__(self):
        self.names: list[str] = []
        self.known = pa.array([], pa.string())

    def ids(self, values: pa.Array) -> np.ndarray:
        found = pc.index_in(values, value_set=self.known)
        if found.null_count:
            self.names += pc.unique(values.filter(pc.is_null(found))).to_pylist()
            self.known = pa.array(self.names, pa.string())
            found = pc.index_in(values, value_set=self.known)
        return found.to_numpy(zero_copy_only=False).astype(np.int64)


class _PairCounts:
    """Kept rows per (macro, site), summed file by file into a dense grid of integer ids.

    Each file's macro and site columns arrive dictionary-encoded: only the (small) dictionaries are mapped
    to global ids; the rows are counted with numpy.
    """

    def __init__(self):
        self.macros, self.sites = _Names(), _Names()
        self.grid = np.zeros((0, 0), dtype=np.int64)

    @staticmethod
    def _codes(column: pa.ChunkedArray | pa.Array, names: _Names) -> np.ndarray:
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if not pa.types.is_dictionary(column.type):
            column = column.dictionary_encode()
        mapping = names.ids(column.dictionary.cast(pa.string()))
        return mapping[column.indices.to_numpy(zero_copy_only=False)] if len(mapping) else np.zeros(0, np.int64)

    def copy(self) -> "_PairCounts":
        twin = _PairCounts()
        for mine, theirs in ((self.macros, twin.macros), (self.sites, twin.sites)):
            theirs.names, theirs.known = list(mine.names), mine.known
        twin.grid = self.grid.copy()
        return twin

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        m = self._codes(table["macro"], self.macros)
        s = self._codes(table["site"], self.sites)
        rows, cols = len(self.macros.names), len(self.sites.names)
        if rows > self.grid.shape[0] or cols > self.grid.shape[1]:
            grown = np.zeros((max(rows, 2 * self.grid.shape[0]), max(cols, 2 * self.grid.shape[1])), dtype=np.int64)
            grown[: self.grid.shape[0], : self.grid.shape[1]] = self.grid
            self.grid = grown
        width = self.grid.shape[1]
        self.grid += np.bincount(m * width + s, minlength=self.grid.size).reshape(self.grid.shape)

    def total(self) -> pa.Table:
        m, s = np.nonzero(self.grid)
        macros = np.array(self.macros.names, dtype=object)
        sites = np.array(self.sites.names, dtype=object)
        return pa.table(
            {
                "macro": pa.array(macros[m] if len(m) else [], pa.string()),
                "site": pa.array(sites[s] if len(s) else [], pa.string()),
                "count_all": pa.array(self.grid[m, s], pa.int64()),
            }
        )


def _drop_retired(table: pa.Table, retired_ids: frozenset[str] | None) -> pa.Table:
    if not retired_ids:
        return table
    return table.filter(pc.invert(pc.is_in(table["task_id"], value_set=pa.array(sorted(retired_ids), pa.string()))))


_MATCHED = pa.schema([*_STRINGS, ("key_hash", pa.int64())])


KEPT_COLUMNS = ("dedup_key", "key_hash", "macro", "site", "task_id")


def _refilter(run_id: str) -> str:
    return f"restore it, or re-filter {run_id} with `filter-pipeline materialize {run_id}`"


def verified_bytes(data_root: UPath, run_id: str, entry: dict) -> bytes:
    """The bytes of a committed file, checked against its commit entry (size, SHA-256). Raises
    HistoryIntegrityError naming the file when it is missing, unreadable or changed."""
    where = entry["path"]
    try:
        with (data_root / where).open("rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise HistoryIntegrityError(f"{where} is missing, but run {run_id} committed it: {_refilter(run_id)}") from None
    except OSError as exc:
        raise HistoryIntegrityError(
            f"{where} (committed by run {run_id}) cannot be read ({exc}): {_refilter(run_id)}"
        ) from None
    digest = hashlib.sha256(data).hexdigest()  # (releases the GIL: the read-ahead threads hash in parallel)
    if len(data) != entry["size"] or digest != entry["sha256"]:
        raise HistoryIntegrityError(
            f"{where} changed since run {run_id} was committed (sha256 {digest[:12]}, {len(data)} bytes; committed "
            f"{str(entry['sha256'])[:12]}, {entry['size']} bytes): {_refilter(run_id)}"
        )
    return data


def _open_kept(data: bytes, where: str, run_id: str) -> pq.ParquetFile:
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data), read_dictionary=["macro", "site"])  # counted by code
    except (pa.ArrowException, OSError) as exc:
        raise HistoryIntegrityError(
            f"{where} (committed by run {run_id}) is not readable Parquet ({exc}): {_refilter(run_id)}"
        ) from None
    missing = [c for c in KEPT_COLUMNS if c not in parquet.schema_arrow.names]
    if missing:
        raise HistoryIntegrityError(
            f"{where} (committed by run {run_id}) is not a kept file: no column {', '.join(missing)}: {_refilter(run_id)}"
        )
    return parquet


def _read_warehouse(
    data_root: UPath, run_id: str, entry: dict, probe: _KeyProbe, retired_ids: frozenset[str] | None
) -> tuple[pa.Table, pa.Table]:
    """(rows for the counts: macro, site; rows whose key_hash the batch carries, to be confirmed on the text:
    the index columns and key_hash), from a committed kept file verified against its commit entry."""
    parquet = _open_kept(verified_bytes(data_root, run_id, entry), entry["path"], run_id)
    # The file is the one the walk wrote (its hash says so): its keys are canonical and key_hash is theirs.
    keys = ["key_hash"] if probe.wanted else []  # (coverage wants no keys)
    wanted = ["macro", "site", *keys] + (["task_id"] if retired_ids else [])
    table = _drop_retired(parquet.read(columns=wanted), retired_ids)  # macro/site stay dictionary codes
    if not probe.wanted:
        return table, _MATCHED.empty_table()
    hashes = table["key_hash"].to_numpy()
    maybe = probe.maybe(hashes)
    if not maybe.any():
        return table, _MATCHED.empty_table()
    full = parquet.read(columns=["dedup_key", "macro", "site", "task_id"]).cast(_STRINGS)
    matched = _drop_retired(full, retired_ids).filter(pa.array(maybe))
    return table, matched.append_column("key_hash", pa.array(hashes[maybe], pa.int64()))


READ_AHEAD = 8  # files read at once: Arrow decodes without the GIL; 8 was 10% faster than 4 over 400 files
# (20M rows, 2 cores), and memory stays a few files' worth


def _in_order(read, items: list):
    """`read(item)` for each item, in order, with up to READ_AHEAD reads running in threads ahead of the
    consumer (reading is I/O and Arrow decoding; the consumer's counting stays in one thread)."""
    with ThreadPoolExecutor(max_workers=READ_AHEAD) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(read, item))
            if len(pending) >= READ_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@dataclass(frozen=True)
class _Counted:
    """The counts of one history read, and the exact files they came from: run_id -> (path, (size,
    mtime_ns), that run's retired task_ids, what its commit says of it)."""

    files: dict[str, tuple]
    counts: _PairCounts
    rows: int


# The last history read of this process. A read for counts alone (coverage, right after the ledger step of
# the same run counted every other run) takes from it the runs whose file is unchanged since, and reads the
# rest: at 2M rows of history, one file instead of 41.
_last_counted: _Counted | None = None


def _fingerprint(path: UPath, retired_ids: frozenset[str] | None, source: str) -> tuple | None:
    """What a file's counts depend on; None off local disk or when it is missing (then it is read, and fails)."""
    try:
        signature = local_signature(path)
    except OSError:
        return None
    return None if signature is None else (path.path, signature, retired_ids, source)


def history_sources(data_root: UPath, commits: dict[str, CommitRecord]) -> dict[str, tuple[str, UPath, dict | None]]:
    """run_id -> ("warehouse", its committed kept file, the commit's entry) for each committed run, or
    ("legacy", runs/<run>/kept.jsonl, None) for a run with a legacy file and no commit."""
    sources: dict[str, tuple[str, UPath, dict | None]] = {
        r: ("legacy", p, None) for r, p in legacy_kept_files(data_root / "runs").items() if r not in commits
    }
    for run_id, record in commits.items():
        entry = record.files.get("kept")
        if entry is None:
            raise HistoryIntegrityError(
                f"warehouse/_commits/{run_id}.json names no kept file: delete it and re-filter {run_id} with "
                f"`filter-pipeline materialize {run_id}`"
            )
        sources[run_id] = ("warehouse", data_root / entry["path"], entry)
    return dict(sorted(sources.items()))


def build_prior_index(
    data_root: UPath,
    run_id: str,
    batch_keys: pd.DataFrame,
    retired: Retired,
    commits: dict[str, CommitRecord] | None = None,
) -> PriorIndex:
    """The prior-run dedup index for `run_id` (CONTRACT §3.5, §4): every other committed run's kept rows,
    plus legacy kept.jsonl, minus retired. Raises HistoryIntegrityError (one line: the file, what is wrong,
    what to do) when a committed kept file is missing, changed, unreadable or not a kept file.

    `batch_keys` (dedup_key, key_hash) are the keys the walk can meet: only those are returned with their
    provenance; counts cover every row. `commits`: the warehouse's commit records (read when not given).
    Files are read a few at a time (READ_AHEAD), each hashed as read, mostly decoded as integers and
    dictionary codes, so cost grows slowly with history and memory not at all. Without batch keys, runs
    counted by this process's previous read, with their file and retired rows unchanged, are not read again.
    """
    global _last_counted
    commits = read_commits(data_root / "warehouse") if commits is None else commits
    sources = history_sources(data_root, commits)
    probe = _KeyProbe(batch_keys)
    counts = _PairCounts()
    key_parts: list[pa.Table] = []
    runs_read = rows_read = 0
    history: dict[str, str] = {}

    def read(other: str) -> tuple[pa.Table, pa.Table, str]:
        kind, path, entry = sources[other]
        retired_ids = retired.tasks.get(other)
        if kind == "warehouse":
            return *_read_warehouse(data_root, other, entry, probe, retired_ids), commits[other].digest
        rows, digest = _read_legacy(path, other)
        rows = _drop_retired(rows, retired_ids)
        return (
            rows,
            rows.filter(pa.array(probe.maybe(rows["key_hash"].to_numpy()))).select(_MATCHED.names),
            LEGACY_PREFIX + digest,
        )

    others = [r for r in sources if r != run_id and not retired.run_is_retired(r)]
    files = {
        r: _fingerprint(sources[r][1], retired.tasks.get(r), commits[r].digest if r in commits else "legacy")
        for r in others
    }
    to_read = others
    last = _last_counted
    if (
        not probe.wanted
        and last is not None
        and all(f is not None and files.get(r) == f for r, f in last.files.items())
    ):
        counts, runs_read, rows_read = last.counts.copy(), len(last.files), last.rows
        to_read = [r for r in others if r not in last.files]
    for other, (rows, matched, digest) in zip(to_read, _in_order(read, to_read)):
        runs_read += 1
        rows_read += rows.num_rows
        history[other] = digest
        counts.add(rows.select(["macro", "site"]))
        if matched.num_rows:
            key_parts.append(matched.append_column("run_id", pa.array([other] * matched.num_rows, type=pa.string())))
    for other in others:
        history.setdefault(other, commits[other].digest if other in commits else "legacy:")
    if all(f is not None for f in files.values()):
        _last_counted = _Counted(files, counts.copy(), rows_read)

    total = (
        counts.total()
        .rename_columns(["macro", "site", "n_kept"])
        .sort_by([("macro", "ascending"), ("site", "ascending")])
    )
    # every run's hash matches confirmed at once: one value set, of the batch texts that share their hashes
    hits = probe.confirm(pa.concat_tables(key_parts)).drop_columns(["key_hash"]) if key_parts else None
    keys = to_pandas(hits) if hits is not None else empty_frame("prior_dedup_index")
    keys = keys.assign(key_hash=pd.array(key_hashes(pylist(keys["dedup_key"])), dtype="Int64"))
    return PriorIndex(
        keys=conform(keys.sort_values(["run_id", "task_id"], kind="stable"), "prior_dedup_index"),
        counts=conform(to_pandas(total), "prior_kept_counts"),
        runs_read=runs_read,
        rows_read=rows_read,
        history=dict(sorted(history.items())),
    )
