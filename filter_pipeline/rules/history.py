"""History for the ledger walk: what earlier runs kept (CONTRACT §2 retired.json, §3.5 the prior index, §4).

The record is what was committed: the `kept` file each commit record (`warehouse/_commits/<run>.json`)
names, verified against the size and SHA-256 the commit recorded, plus the legacy `runs/<run>/kept.jsonl`
of runs filtered by the earlier script that have no commit. A committed file that is missing, changed,
unreadable or not a kept file fails the read with one line naming it (HistoryIntegrityError); a kept file
without a commit (a walk killed before it committed) is not history. Files are read one at a time and
counted as they are read, so memory follows the largest run rather than the whole history.

Pure: bytes in, tables out. Listing and reading the files is `storage/history.py`'s, which hands each
source's bytes here as it reads them (`prior_index` takes them one at a time).

Counting is Arrow's: kept rows per (macro, site) by `group_by`, the batch's keys found by their 64-bit
key_hash and confirmed on the text (`pc.is_in`). `verify` counts with the same functions.
"""

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from filter_pipeline.rules import records
from filter_pipeline.rules.batch import LEGACY_KEPT_FILE, jsonl_lines
from filter_pipeline.rules.commits import LEGACY_PREFIX, CommitRecord, HistoryIntegrityError
from filter_pipeline.rules.records import is_text
from filter_pipeline.rules.schemas import canonical_key, conform, empty_frame, key_hashes, positions, to_pandas
from filter_pipeline.settings import materialize_command

RETIRED_FILE = "retired.json"


class HistoryError(ValueError):
    """retired.json or a legacy kept.jsonl is unreadable; the message says which and why."""


@dataclass(frozen=True)
class Retired:
    """Kept rows that no longer count for dedup or caps: whole runs, or single (run, task) rows."""

    runs: frozenset[str] = frozenset()
    tasks: dict[str, frozenset[str]] = field(default_factory=dict)
    # each entry's `reason`, where it gives one as text: by (run_id, None) for a whole run, else (run_id, task_id)
    reasons: dict[tuple[str, str | None], str] = field(default_factory=dict)

    def run_is_retired(self, run_id: str) -> bool:
        return run_id in self.runs

    def reason_of(self, run_id: str, task_id: str) -> str | None:
        """Why the row is retired, as retired.json says (its task's entry first, then its run's); None if unsaid."""
        return self.reasons.get((run_id, task_id)) or self.reasons.get((run_id, None))


def parse_retired(data: bytes | None) -> Retired:
    """`<data>/retired.json`'s bytes as a Retired (None, the file absent: nothing retired). Raises HistoryError
    on a wrong shape."""
    if data is None:
        return Retired()
    where = f"{RETIRED_FILE}"
    try:
        entries = json.loads(data.decode("utf-8-sig"))  # (a hand-edited file: a Windows editor's BOM is skipped)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HistoryError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise HistoryError(f"{where} must be a JSON list of {{run_id, task_ids?, reason}} objects")
    runs: set[str] = set()
    tasks: dict[str, set[str]] = {}
    reasons: dict[tuple[str, str | None], str] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("run_id"), str):
            raise HistoryError(f"{where}[{i}] must be an object with a string 'run_id'")
        if not is_text(entry["run_id"]):
            raise HistoryError(f"{where}[{i}].run_id holds a lone surrogate, which is not text")
        reason = entry.get("reason") if isinstance(entry.get("reason"), str) and entry["reason"].strip() else None
        reason = records.json_text(reason)  # (free text: a half emoji is shown as U+FFFD)
        if "task_ids" not in entry or entry["task_ids"] is None:
            runs.add(entry["run_id"])
            reasons.update({(entry["run_id"], None): reason} if reason else {})
            continue
        ids = entry["task_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, str) for t in ids):
            raise HistoryError(f"{where}[{i}].task_ids must be a list of strings")
        if not all(is_text(t) for t in ids):
            raise HistoryError(f"{where}[{i}].task_ids holds a lone surrogate, which is not text")
        tasks.setdefault(entry["run_id"], set()).update(ids)
        reasons.update({(entry["run_id"], t): reason for t in ids} if reason else {})
    return Retired(runs=frozenset(runs), tasks={r: frozenset(t) for r, t in tasks.items()}, reasons=reasons)


@dataclass(frozen=True)
class PriorIndex:
    """What the walk of one run needs from history.

    `keys`: rows (dedup_key, key_hash, macro, site, run_id, task_id) of prior kept rows whose key is among the
    batch's keys; `counts`: (macro, site, n_kept) over all non-retired prior kept rows.
    """

    keys: pd.DataFrame
    counts: pd.DataFrame
    runs_read: int
    rows_read: int
    history: dict[str, str] = field(default_factory=dict)  # run_id -> commit digest, or "legacy:<sha256>"


_STRINGS = pa.schema([(c, pa.string()) for c in ("dedup_key", "macro", "site", "task_id")])
_MATCHED = pa.schema([*_STRINGS, ("key_hash", pa.int64())])
_COUNTS = pa.schema([("macro", pa.string()), ("site", pa.string()), ("n_kept", pa.int64())])
_CODED = pa.dictionary(pa.int32(), pa.string())
_PARTS = pa.schema([("macro", _CODED), ("site", _CODED), ("n_kept", pa.int64())])


@dataclass(frozen=True)
class Source:
    """One run's history as read: `kind` "warehouse" (its committed kept file, `entry` the commit's entry for
    it, `digest` the commit record's) or "legacy" (runs/<run>/kept.jsonl); `data`, the file's bytes."""

    run_id: str
    kind: str
    data: bytes
    entry: dict | None = None
    digest: str = ""


def parse_legacy(data: bytes, run_id: str) -> tuple[pa.Table, str]:
    """A legacy kept.jsonl's rows (keys re-encoded as canonical text) and the SHA-256 of its bytes."""
    rows = []
    try:
        data.decode("utf-8")  # (said for the whole file, before any line)
    except UnicodeDecodeError as exc:
        raise HistoryError(f"runs/{run_id}/{LEGACY_KEPT_FILE}: not UTF-8 ({exc})") from None
    for number, line in jsonl_lines(data):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise TypeError("not a JSON object")
            key = legacy_key_text(record["dedup_key"])
            rows.append({"dedup_key": _text(key, "dedup_key"), **{f: _text(record[f], f) for f in _LEGACY_TEXTS}})
        # (ValueError: not JSON, or an integer too long for int; RecursionError: nested deeper than json follows)
        except KeyError as exc:
            raise HistoryError(
                f"runs/{run_id}/{LEGACY_KEPT_FILE}:{number}: not a kept row (missing field {exc.args[0]!r})"
            ) from None
        except (ValueError, TypeError, RecursionError) as exc:
            raise HistoryError(f"runs/{run_id}/{LEGACY_KEPT_FILE}:{number}: not a kept row ({exc})") from None
    return _with_hashes(pa.Table.from_pylist(rows, schema=_STRINGS)), hashlib.sha256(data).hexdigest()


_LEGACY_TEXTS = ("macro", "site", "task_id")


def _text(value: Any, name: str) -> str:
    """`value`, if it is text (`records.is_text`); TypeError or ValueError naming `name` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} is not a string")
    if not is_text(value):
        raise ValueError(f"{name} holds a lone surrogate, which is not text")
    return value


def legacy_key_text(key: Any) -> str:
    """The canonical text of a legacy kept row's dedup_key: an array, or its JSON text (as some exports stored
    it). Raises TypeError or ValueError when it is neither, RecursionError when it is nested too deep."""
    if isinstance(key, str):
        key = json.loads(key)
    if not isinstance(key, list):
        raise TypeError("dedup_key is not an array")
    return canonical_key(key)


def _with_hashes(table: pa.Table) -> pa.Table:
    """The table (legacy kept rows) with a key_hash column computed from its dedup_key."""
    return table.append_column("key_hash", pa.array(key_hashes(table["dedup_key"].to_pylist()), type=pa.int64()))


def drop_retired(table: pa.Table, retired_ids: frozenset[str] | None) -> pa.Table:
    """The rows of `table` whose task_id is not among `retired_ids`."""
    if not retired_ids:
        return table
    return table.filter(pc.invert(pc.is_in(table["task_id"], value_set=pa.array(sorted(retired_ids), pa.string()))))


def kept_pairs(table: pa.Table) -> pa.Table:
    """A table's (macro, site) columns, one kept row each (n_kept 1), dictionary-encoded: a part for
    `sum_counts`. Counting rows as they come, rather than counting each file first, keeps the group_by to
    one pass over codes."""
    columns = [pc.dictionary_encode(table[c]) if not pa.types.is_dictionary(table[c].type) else table[c]
               for c in ("macro", "site")]  # fmt: skip
    ones = pa.array(np.ones(table.num_rows, dtype=np.int64))
    return pa.table([*(c.cast(_CODED) for c in columns), ones], schema=_PARTS)


def sum_counts(parts: list[pa.Table]) -> pa.Table:
    """`kept_pairs` (or earlier `sum_counts`) tables summed per (macro, site): macro, site, n_kept."""
    if not parts:
        return _PARTS.empty_table()
    summed = pa.concat_tables(parts).unify_dictionaries().group_by(["macro", "site"]).aggregate([("n_kept", "sum")])
    return pa.table([summed["macro"], summed["site"], summed["n_kept_sum"]], schema=_PARTS)


def as_text(counts: pa.Table) -> pa.Table:
    """`sum_counts`' table with macro and site as text, sorted by them."""
    table = pa.table([counts[c].cast(pa.string()) for c in ("macro", "site")] + [counts["n_kept"]], schema=_COUNTS)
    return table.sort_by([("macro", "ascending"), ("site", "ascending")])


KEPT_COLUMNS = ("dedup_key", "key_hash", "macro", "site", "task_id")


def refilter(run_id: str) -> str:
    return f"restore it, or re-filter {run_id} with `{materialize_command(run_id)}`"


def check_committed(data: bytes, run_id: str, entry: dict) -> bytes:
    """`data`, the bytes read of a file `run_id` committed, if they are what its commit entry says (size,
    SHA-256); HistoryIntegrityError naming the file otherwise."""
    where = entry["path"]
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry["size"] or digest != entry["sha256"]:
        raise HistoryIntegrityError(
            f"{where} changed since run {run_id} was committed (sha256 {digest[:12]}, {len(data)} bytes; committed "
            f"{str(entry['sha256'])[:12]}, {entry['size']} bytes): {refilter(run_id)}"
        )
    return data


def open_kept(data: bytes, where: str, run_id: str) -> pq.ParquetFile:
    """The committed kept file `where` of `run_id` (its verified bytes `data`), its macro and site read as
    dictionaries; HistoryIntegrityError, saying what to do, when it is not Parquet or lacks a kept column. The
    ledger and the audit both open kept files here, so both say the same of a broken one."""
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data), read_dictionary=["macro", "site"])  # counted by code
    except (pa.ArrowException, OSError) as exc:
        raise HistoryIntegrityError(
            f"{where} (committed by run {run_id}) is not readable Parquet ({exc}): {refilter(run_id)}"
        ) from None
    missing = [c for c in KEPT_COLUMNS if c not in parquet.schema_arrow.names]
    if missing:
        raise HistoryIntegrityError(
            f"{where} (committed by run {run_id}) is not a kept file: no column {', '.join(missing)}: {refilter(run_id)}"
        )
    return parquet


def _count_committed(
    source: Source, batch_hashes: pd.Index, retired_ids: frozenset[str] | None
) -> tuple[pa.Table, pa.Table, int]:
    """(its pair counts; rows whose key_hash the batch carries, to be confirmed on the text: the index columns
    and key_hash; its number of rows), from a committed kept file verified against its commit entry."""
    entry, run_id = source.entry, source.run_id
    parquet = open_kept(check_committed(source.data, run_id, entry), entry["path"], run_id)
    # The file is the one the walk wrote (its hash says so): its keys are canonical and key_hash is theirs.
    wanted = ["macro", "site", "key_hash"] + (["task_id"] if retired_ids else [])
    table = drop_retired(parquet.read(columns=wanted), retired_ids)  # macro/site stay dictionary codes
    # (the batch's hashes are a pandas index built once: its hash table serves every file)
    maybe = batch_hashes.get_indexer(table["key_hash"].to_numpy()) >= 0
    matched = _MATCHED.empty_table()
    if maybe.any():
        full = drop_retired(parquet.read(columns=["dedup_key", "macro", "site", "task_id"]).cast(_STRINGS), retired_ids)
        matched = full.filter(pa.array(maybe)).append_column("key_hash", pa.array(table["key_hash"].to_numpy()[maybe]))
    return kept_pairs(table), matched, table.num_rows


def _count_source(
    source: Source, batch_hashes: pd.Index, retired_ids: frozenset[str] | None
) -> tuple[pa.Table, pa.Table, int, str]:
    """`_count_committed` of a committed run, or the same of a legacy kept.jsonl; with what `PriorIndex.history`
    says of the run (its commit digest, or "legacy:<sha256>")."""
    if source.kind == "warehouse":
        return *_count_committed(source, batch_hashes, retired_ids), source.digest
    rows, digest = parse_legacy(source.data, source.run_id)
    rows = drop_retired(rows, retired_ids)
    maybe = batch_hashes.get_indexer(rows["key_hash"].to_numpy()) >= 0
    matched = rows.filter(pa.array(maybe)).select(_MATCHED.names)
    return kept_pairs(rows), matched, rows.num_rows, LEGACY_PREFIX + digest


def prior_index(batch_keys: pd.DataFrame, retired: Retired, sources: Iterable[Source]) -> PriorIndex:
    """The prior-run dedup index (CONTRACT §3.5, §4) from `sources`, every other non-retired run's history
    (consumed one at a time, so only one file's bytes need be held). Raises HistoryIntegrityError (one
    line: the file, what is wrong, what to do) when a committed kept file is changed or not a kept file.

    `batch_keys` (dedup_key, key_hash) are the keys the walk can meet: only those are returned with their
    provenance; counts cover every row. Each file is mostly decoded as integers and dictionary codes.
    """
    batch_hashes = pd.Index(pd.unique(batch_keys["key_hash"].to_numpy(dtype=np.int64)))
    counts, key_parts, rows_read, history = [], [], 0, {}
    for source in sources:
        pairs, matched, rows, history[source.run_id] = _count_source(
            source, batch_hashes, retired.tasks.get(source.run_id)
        )
        rows_read += rows
        counts.append(pairs)
        if sum(part.num_rows for part in counts) >= _COUNTS_PENDING_ROWS:
            counts = [sum_counts(counts)]
        if matched.num_rows:
            run_ids = pa.array([source.run_id] * matched.num_rows, pa.string())
            key_parts.append(matched.append_column("run_id", run_ids))
    return PriorIndex(
        keys=_confirmed(key_parts, batch_keys),
        counts=conform(to_pandas(as_text(sum_counts(counts))), "prior_kept_counts"),
        runs_read=len(history),
        rows_read=rows_read,
        history=dict(sorted(history.items())),
    )


# kept rows held as (macro, site) codes before they are counted into one table: memory stays at a few
# files' worth, whatever the history's length
_COUNTS_PENDING_ROWS = 4_000_000


def _confirmed(key_parts: list[pa.Table], batch_keys: pd.DataFrame) -> pd.DataFrame:
    """The prior_dedup_index rows: history rows whose key_hash the batch carries, kept where the text is one
    of the batch's too (a hash is a function of the text: only batch texts with those hashes can match)."""
    if not key_parts:
        return conform(empty_frame("prior_dedup_index"), "prior_dedup_index")
    matched = pa.concat_tables(key_parts)
    texts = pa.array(batch_keys["dedup_key"], pa.string())
    same_hash = pc.is_in(pa.array(batch_keys["key_hash"], pa.int64()), value_set=matched["key_hash"])
    hits = matched.filter(pc.is_in(matched["dedup_key"], value_set=texts.filter(same_hash))).drop_columns(["key_hash"])
    keys = to_pandas(hits)
    # each key's hash from the batch's row of the same text (a file's own key_hash column is only a probe)
    hashes = batch_keys["key_hash"].to_numpy(dtype=np.int64)[positions(keys["dedup_key"], batch_keys["dedup_key"])]
    keys = keys.assign(key_hash=pd.array(hashes, dtype="Int64"))
    return conform(keys.sort_values(["run_id", "task_id"], kind="stable"), "prior_dedup_index")


def covering_walk(commits: dict[str, CommitRecord], live: set[str], retired: Retired) -> str | None:
    """The committed run whose walk read as history exactly the other runs that count now (`live`), each as it
    is committed now (its commit's digest): that walk's prior_kept_counts plus its own kept rows are then
    every live run's kept rows. None when no walk did (a run retired, added or re-walked since, a legacy run,
    single tasks retired): then every run is counted from its file."""
    if any(retired.tasks.get(r) for r in live):
        return None
    for run_id, record in sorted(commits.items(), key=lambda item: item[1].walked_timestamp, reverse=True):
        if (
            run_id in live and {"kept", "prior_kept_counts"} <= set(record.files)
            and set(record.history) == live - {run_id}
            and all(r in commits and commits[r].digest == d for r, d in record.history.items())
        ):  # fmt: skip
            return run_id
    return None


def whole_runs_counted(prior_counts: pa.Table, commits: dict[str, CommitRecord], read: dict[str, str]) -> bool:
    """Whether a walk's prior_kept_counts count every row of the runs it `read` (no single task was retired
    when it walked): then they are those runs' counts now too."""
    rows = sum(int(commits[r].files["kept"].get("rows", -1)) for r in read)
    return int(pc.sum(prior_counts["n_kept"]).as_py() or 0) == rows


def add_own(prior_counts: pa.Table, kept: pa.Table) -> pd.DataFrame:
    """A walk's prior_kept_counts (macro, site, n_kept) plus its own kept rows (macro, site), as counts."""
    coded = [pc.dictionary_encode(prior_counts[c]).cast(_CODED) for c in ("macro", "site")]
    prior = pa.table([*coded, prior_counts["n_kept"].cast(pa.int64())], schema=_PARTS)
    return conform(to_pandas(as_text(sum_counts([prior, kept_pairs(kept)]))), "prior_kept_counts")
