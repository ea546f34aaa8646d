"""The audit of a whole warehouse (`filter-pipeline verify`, and the `warehouse_verified` check on coverage).

Every finding is one line naming the file or run, what is wrong and what to do:
- a commit record that cannot be read, a committed file that is missing or changed (size, SHA-256);
- a key kept by two non-retired runs (or twice by one);
- a cap exceeded where a run kept rows, counting the history that run's walk read, with the caps it recorded;
- a run whose verdicts are not each kept, surplus, a judge failure or unjudged (conservation);
- a kept file without a commit record (a walk stopped before committing);
- a committed batch whose input files changed since it was filtered.

Pure: no Dagster.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from upath import UPath

from filter_pipeline.rules.commits import COMMITS_DIR, CommitRecord, HistoryIntegrityError, parse_commit
from filter_pipeline.rules.filtering import Caps, MacroLimits
from filter_pipeline.rules.history import (
    HistoryError,
    as_text,
    drop_retired,
    kept_files,
    kept_pairs,
    legacy_kept_files,
    load_retired,
    read_legacy,
    sum_counts,
    verified_bytes,
)
from filter_pipeline.rules.schemas import (
    DEFAULT_PER_SITE_CAP,
    STATUS_ERROR,
    STATUS_JUDGED,
    read_parquet_file,
    to_pandas,
)
from filter_pipeline.storage.files import inputs_changed

FINDING_KINDS = ("commit", "file", "duplicate", "cap", "conservation", "uncommitted", "changed")
MAX_LINES_PER_KIND = 20  # beyond this, one line says how many more of the same kind were found


@dataclass(frozen=True)
class Finding:
    kind: str  # commit | file | duplicate | cap | conservation | uncommitted | changed
    line: str


def _commits(warehouse: UPath) -> tuple[dict[str, CommitRecord], list[Finding]]:
    folder = warehouse / COMMITS_DIR
    records, findings = {}, []
    if not folder.exists():
        return records, findings
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".json") or path.name.startswith("."):
            continue
        run_id = path.name.removesuffix(".json")
        try:
            records[run_id] = parse_commit(path.read_bytes(), f"warehouse/{COMMITS_DIR}/{path.name}", run_id)
        except HistoryIntegrityError as exc:
            findings.append(Finding("commit", str(exc)))
    return records, findings


def _caps_of(record: CommitRecord) -> Caps:
    raw = record.caps or {}
    macros = {
        m: MacroLimits(site_cap=c.get("site_cap"), target=c.get("target")) for m, c in (raw.get("caps") or {}).items()
    }
    return Caps(per_site_cap=raw.get("per_site_cap", DEFAULT_PER_SITE_CAP), macros=macros)


def _kept_rows(
    data_root: UPath, run_id: str, record: CommitRecord, columns: list[str], findings: list[Finding]
) -> pa.Table | None:
    """The columns of a committed run's kept file, verified against its commit (None, with a finding, if not)."""
    entry = record.files.get("kept")
    if entry is None:
        findings.append(Finding("commit", f"warehouse/{COMMITS_DIR}/{run_id}.json names no kept file: re-filter {run_id} "
                                          f"with `filter-pipeline materialize {run_id}`"))  # fmt: skip
        return None
    try:
        data = verified_bytes(data_root, run_id, entry)
        dictionary = [c for c in ("macro", "site") if c in columns]  # counted by code, not by text
        return read_parquet_file(pa.BufferReader(data), columns=columns, read_dictionary=dictionary)
    except HistoryIntegrityError as exc:
        findings.append(Finding("file", str(exc)))
    except (pa.ArrowException, OSError, KeyError) as exc:
        findings.append(
            Finding("file", f"{entry['path']} (committed by run {run_id}) is not a readable kept file ({exc})")
        )
    return None


def audit(data_root: UPath) -> list[Finding]:
    """Every finding on the warehouse under `data_root` (empty: clean)."""
    warehouse = data_root / "warehouse"
    findings: list[Finding] = []
    try:
        retired = load_retired(data_root)
    except HistoryError as exc:
        return [Finding("commit", str(exc))]
    records, commit_findings = _commits(warehouse)
    findings += commit_findings

    # Kept rows as key hashes and dictionary codes (cheap at millions of rows); texts only where hashes repeat.
    kept: dict[str, pa.Table] = {}
    for run_id, record in records.items():
        columns = ["key_hash", "macro", "site"] + (["task_id"] if retired.tasks.get(run_id) else [])
        table = _kept_rows(data_root, run_id, record, columns, findings)
        for asset, entry in record.files.items():
            if asset == "kept":
                continue
            try:
                verified_bytes(data_root, run_id, entry)
            except HistoryIntegrityError as exc:
                findings.append(Finding("file", str(exc)))
        if table is not None:
            kept[run_id] = table
    for run_id, path in legacy_kept_files(data_root / "runs").items():
        if run_id not in records:
            try:
                kept[run_id] = read_legacy(path, run_id)[0]
            except HistoryError as exc:
                findings.append(Finding("file", str(exc)))

    live = {r: drop_retired(t, retired.tasks.get(r)) for r, t in kept.items() if not retired.run_is_retired(r)}
    findings += _duplicates(data_root, records, live, retired)
    findings += _caps(records, live)
    findings += _conservation(data_root, records)
    for run_id in sorted(set(kept_files(warehouse / "kept")) - set(records)):
        findings.append(Finding(
            "uncommitted",
            f"warehouse/kept/{run_id}.parquet has no commit record (its walk stopped before committing): it is not "
            f"history; `filter-pipeline materialize` walks {run_id} again and commits it",
        ))  # fmt: skip
    for run_id, record in records.items():
        changed = inputs_changed(data_root / "runs" / run_id, record.inputs)
        if changed:
            findings.append(Finding(
                "changed",
                f"runs/{run_id}/{', '.join(changed)} changed since {run_id} was filtered: re-filter it with "
                f"`filter-pipeline materialize {run_id}` (it is not re-filtered unless named)",
            ))  # fmt: skip
    return _capped(findings)


def _capped(findings: list[Finding]) -> list[Finding]:
    out, seen = [], {}
    for finding in findings:
        seen[finding.kind] = seen.get(finding.kind, 0) + 1
        if seen[finding.kind] <= MAX_LINES_PER_KIND:
            out.append(finding)
    for kind, n in seen.items():
        if n > MAX_LINES_PER_KIND:
            out.append(Finding(kind, f"... and {n - MAX_LINES_PER_KIND} more findings of kind {kind!r}"))
    return out


def _duplicates(
    data_root: UPath, records: dict[str, CommitRecord], live: dict[str, pa.Table], retired
) -> list[Finding]:
    """Keys kept more than once across non-retired runs: rows whose key_hash repeats, confirmed on the text."""
    if not live:
        return []
    runs = list(live)
    hashes = np.concatenate([np.zeros(0, np.int64), *(live[r]["key_hash"].to_numpy() for r in runs)])
    owner = np.repeat(np.arange(len(runs)), [live[r].num_rows for r in runs])
    repeated = pd.Series(hashes).duplicated(keep=False).to_numpy()  # a hash table: no sort of millions
    if not repeated.any():
        return []
    suspects = set(hashes[repeated].tolist())
    rows = []
    for i in sorted(set(owner[repeated].tolist())):
        run_id = runs[i]
        if run_id in records:
            table = _kept_rows(data_root, run_id, records[run_id], ["dedup_key", "key_hash", "task_id"], [])
        else:
            table = read_legacy(data_root / "runs" / run_id / "kept.jsonl", run_id)[0]
        if table is None:
            continue
        table = drop_retired(table, retired.tasks.get(run_id))
        wanted = pc.is_in(table["key_hash"], value_set=pa.array(sorted(suspects), pa.int64()))
        for key, task_id in zip(*(table.filter(wanted)[c].to_pylist() for c in ("dedup_key", "task_id"))):
            rows.append((key, run_id, task_id))
    frame = pd.DataFrame(rows, columns=["dedup_key", "run_id", "task_id"])
    twice = frame[frame["dedup_key"].duplicated(keep=False)]
    findings = []
    for key, group in twice.groupby("dedup_key", sort=True):
        where = ", ".join(f"{r}/{t}" for r, t in zip(group["run_id"], group["task_id"]))
        findings.append(Finding("duplicate", f"key {key} is kept {len(group)} times ({where}): retire all but one "
                                             "in retired.json, or re-filter the later runs"))  # fmt: skip
    return findings


def _caps(records: dict[str, CommitRecord], live: dict[str, pa.Table]) -> list[Finding]:
    """Where a committed run kept rows: its kept rows plus those of the runs its walk read as history (still
    non-retired), against the caps it recorded. Each run is counted per (macro, site) once; a run's prior is
    the sum of the runs it read."""
    counts = {r: sum_counts([kept_pairs(t)]) for r, t in live.items() if t.num_rows}
    findings = []
    for run_id, record in records.items():
        if run_id not in counts:
            continue
        read = [counts[r] for r in sorted(set(record.history) & set(counts) - {run_id})]
        own = to_pandas(as_text(counts[run_id]))
        prior = to_pandas(as_text(sum_counts(read))).rename(columns={"n_kept": "prior"})
        totals = own.merge(prior, on=["macro", "site"], how="left")
        totals["total"] = totals["n_kept"] + totals["prior"].fillna(0).astype("int64")
        findings += _over_caps(run_id, _caps_of(record), totals, prior)
    return findings


def _over_caps(run_id: str, caps: Caps, totals: pd.DataFrame, prior: pd.DataFrame) -> list[Finding]:
    """The cap findings of one run: `totals` (macro, site, n_kept: its own, total: with its prior) against its
    site caps; each macro it kept rows of with a target, its own rows and all its prior against the target."""
    findings = []
    over = totals.assign(limit=caps.site_caps(totals["macro"])).query("total > limit").head(MAX_LINES_PER_KIND)
    for macro, site, total, limit in zip(over["macro"], over["site"], over["total"], over["limit"]):
        findings.append(Finding("cap", f"run {run_id}: {macro}/{site} holds {total} kept rows with the history "
                                       f"it read, over its site cap {limit}"))  # fmt: skip
    with_target = {m for m, limit in caps.macros.items() if limit.target is not None}
    for macro in sorted(set(totals["macro"]) & with_target):
        total = int(
            totals.loc[totals["macro"] == macro, "n_kept"].sum() + prior.loc[prior["macro"] == macro, "prior"].sum()
        )
        if total > caps.target(macro):
            findings.append(Finding("cap", f"run {run_id}: macro {macro} holds {total} kept rows with the history "
                                           f"it read, over its target {caps.target(macro)}"))  # fmt: skip
    return findings


def _conservation(data_root: UPath, records: dict[str, CommitRecord]) -> list[Finding]:
    findings = []
    for run_id, record in records.items():
        path = data_root / "warehouse" / "judge_verdicts" / f"{run_id}.parquet"
        try:
            with path.open("rb") as f:
                verdicts = read_parquet_file(f, columns=["status", "passed"])
        except (FileNotFoundError, pa.ArrowException, OSError):
            findings.append(Finding("conservation", f"warehouse/judge_verdicts/{run_id}.parquet is missing or unreadable: "
                                                    f"re-filter {run_id} with `filter-pipeline materialize {run_id}`"))  # fmt: skip
            continue
        status, passed = verdicts["status"], verdicts["passed"]
        judged = pc.equal(status, STATUS_JUDGED)
        failed = int(pc.sum(pc.and_(judged, pc.invert(pc.fill_null(passed, False)))).as_py() or 0)
        unjudged = int(pc.sum(pc.equal(status, STATUS_ERROR)).as_py() or 0)
        kept = int(record.files.get("kept", {}).get("rows", 0))
        surplus = int(record.files.get("surplus", {}).get("rows", 0))
        if kept + surplus + failed + unjudged != verdicts.num_rows:
            findings.append(Finding(
                "conservation",
                f"run {run_id}: {verdicts.num_rows} verdicts but {kept} kept + {surplus} surplus + {failed} judge "
                f"failures + {unjudged} unjudged (the verdicts changed since its walk?): re-filter {run_id} with "
                f"`filter-pipeline materialize {run_id}`",
            ))  # fmt: skip
    return findings
