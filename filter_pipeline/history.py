"""History for the ledger walk: what earlier runs kept (CONTRACT §2 retired.json, §3.4 the prior index).

The record is the warehouse: every `warehouse/kept/<run>.parquet`, plus the legacy `runs/<run>/kept.jsonl`
of runs filtered by the earlier script that have no such file. Files are read one at a time, only the
columns the walk needs, so memory follows the largest run rather than the whole history.
"""

import json
from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from upath import UPath

from filter_pipeline.batch import LEGACY_KEPT_FILE
from filter_pipeline.schemas import canonical_key, conform, to_pandas

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


_INDEX_COLUMNS = ["dedup_key", "macro", "site", "task_id"]


def kept_files(kept_dir: UPath) -> dict[str, UPath]:
    """run_id -> its `kept` Parquet file, skipping temporary files of writes in progress."""
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


def _read_legacy(path: UPath, run_id: str) -> pa.Table:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
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
    schema = pa.schema([(c, pa.string()) for c in _INDEX_COLUMNS])
    return pa.Table.from_pylist(rows, schema=schema)


def build_prior_index(
    data_root: UPath, kept_dir: UPath, run_id: str, batch_keys: pd.Series, retired: Retired
) -> PriorIndex:
    """The prior-run dedup index for `run_id` (CONTRACT §3.4): every other run's kept rows minus retired.

    Only keys in `batch_keys` are returned with their provenance (what the walk can hit); counts cover
    every row. Each file is streamed, so memory does not grow with the number of runs.
    """
    sources: dict[str, tuple[str, UPath]] = {
        r: ("legacy", p) for r, p in legacy_kept_files(data_root / "runs").items()
    }
    sources.update({r: ("warehouse", p) for r, p in kept_files(kept_dir).items()})
    wanted = pa.array(pd.unique(batch_keys.astype(object)), type=pa.string())

    key_parts: list[pa.Table] = []
    count_parts: list[pa.Table] = []
    runs_read = rows_read = 0
    for other in sorted(sources):
        if other == run_id or retired.run_is_retired(other):
            continue
        kind, path = sources[other]
        if kind == "warehouse":
            with path.open("rb") as f:
                table = pq.read_table(f, columns=_INDEX_COLUMNS)
        else:
            table = _read_legacy(path, other)
        if other in retired.tasks:
            retired_ids = pa.array(sorted(retired.tasks[other]), type=pa.string())
            table = table.filter(pc.invert(pc.is_in(table["task_id"], value_set=retired_ids)))
        runs_read += 1
        rows_read += table.num_rows
        count_parts.append(table.group_by(["macro", "site"]).aggregate([("task_id", "count")]))
        hits = table.filter(pc.is_in(table["dedup_key"], value_set=wanted))
        key_parts.append(hits.append_column("run_id", pa.array([other] * hits.num_rows, type=pa.string())))

    if count_parts:
        counts = (
            pa.concat_tables(count_parts)
            .group_by(["macro", "site"])
            .aggregate([("task_id_count", "sum")])
            .rename_columns(["macro", "site", "n_kept"])
            .sort_by([("macro", "ascending"), ("site", "ascending")])
        )
        keys = pa.concat_tables(key_parts).sort_by([("run_id", "ascending"), ("task_id", "ascending")])
        keys_frame, counts_frame = to_pandas(keys), to_pandas(counts)
    else:
        keys_frame = counts_frame = pd.DataFrame()
    return PriorIndex(
        keys=conform(keys_frame, "prior_dedup_index"),
        counts=conform(counts_frame, "prior_kept_counts"),
        runs_read=runs_read,
        rows_read=rows_read,
    )
