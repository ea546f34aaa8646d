"""Reading the whole warehouse for its audit (`filter-pipeline verify`, the `warehouse_verified` check): commit
records, kept files verified against them, legacy kept.jsonl, verdicts, batch inputs. The findings are
`rules/verify.py`'s."""

import pyarrow as pa
from upath import UPath

from filter_pipeline.rules.batch import LEGACY_KEPT_FILE
from filter_pipeline.rules.commits import COMMITS_DIR, CommitRecord, HistoryIntegrityError
from filter_pipeline.rules.history import HistoryError, drop_retired, open_kept, parse_legacy
from filter_pipeline.rules.verify import (
    Finding,
    cap_findings,
    capped,
    conservation,
    duplicate_findings,
    duplicate_suspects,
    suspect_rows,
    unreadable_verdicts,
)
from filter_pipeline.settings import materialize_command
from filter_pipeline.storage.files import (
    RUNS_DIR,
    WAREHOUSE_DIR,
    asset_file,
    files_in,
    inputs_changed,
    is_local,
    run_folder,
)
from filter_pipeline.storage.history import (
    COMMIT_RACE_PASSES,
    kept_files,
    legacy_kept_files,
    load_retired,
    names_no_kept_file,
    read_commit,
    verified_bytes,
)
from filter_pipeline.storage.lease import lease_live
from filter_pipeline.storage.parquet import read_parquet_file
from filter_pipeline.storage.publish import MANIFEST, incomplete_publishes, relative


def _commits(warehouse: UPath) -> tuple[dict[str, CommitRecord], list[Finding]]:
    records, findings = {}, []
    for run_id in files_in(warehouse / COMMITS_DIR, ".json"):
        try:
            record = read_commit(warehouse, run_id)
        except HistoryIntegrityError as exc:
            findings.append(Finding("commit", str(exc)))
            continue
        if record is not None:  # (None: deleted since it was listed, as `read_commits` reads it)
            records[run_id] = record
    return records, findings


def _kept_rows(
    data_root: UPath, run_id: str, record: CommitRecord, columns: list[str], findings: list[Finding]
) -> pa.Table | None:
    """The columns of a committed run's kept file, verified against its commit (None, with a finding, if not)."""
    entry = record.files.get("kept")
    if entry is None:
        findings.append(Finding("commit", names_no_kept_file(run_id)))
        return None
    try:
        return open_kept(verified_bytes(data_root, run_id, entry), entry["path"], run_id).read(columns=columns)
    except HistoryIntegrityError as exc:
        findings.append(Finding("file", str(exc)))
    except (pa.ArrowException, OSError) as exc:  # (a file whose footer reads, but not its pages)
        findings.append(Finding("file", f"{entry['path']} (committed by run {run_id}) is not readable Parquet ({exc})"))
    return None


def _legacy(data_root: UPath, run_id: str) -> pa.Table:
    return parse_legacy((run_folder(data_root, run_id) / LEGACY_KEPT_FILE).read_bytes(), run_id)[0]


def _kept(data_root: UPath, records: dict[str, CommitRecord], retired, findings: list[Finding]) -> dict[str, pa.Table]:
    """Kept rows of every run as key hashes and dictionary codes (cheap at millions of rows), each committed
    file of every run verified on the way."""
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
    for run_id in legacy_kept_files(data_root / RUNS_DIR):
        if run_id not in records:
            try:
                kept[run_id] = _legacy(data_root, run_id)
            except HistoryError as exc:
                findings.append(Finding("file", str(exc)))
    return kept


def audit(data_root: UPath) -> list[Finding]:
    """Every finding on the warehouse under `data_root` (empty: clean). It may run while walks commit, which can
    show it one walk's record beside another walk's files: a pass with findings is read again when a commit
    record changed during it (`COMMIT_RACE_PASSES` passes at most; the last one's findings stand)."""
    for _ in range(COMMIT_RACE_PASSES):
        records, findings = _commits(data_root / WAREHOUSE_DIR)
        findings = _audit_pass(data_root, records, findings)
        if not findings or _commits(data_root / WAREHOUSE_DIR)[0] == records:
            break
    return findings


def _audit_pass(data_root: UPath, records: dict[str, CommitRecord], findings: list[Finding]) -> list[Finding]:
    """The findings of one pass over the warehouse, with the commit `records` read at its start (and the
    `findings` of reading them)."""
    warehouse = data_root / WAREHOUSE_DIR
    try:
        retired = load_retired(data_root)
    except HistoryError as exc:
        return [Finding("commit", str(exc))]
    kept = _kept(data_root, records, retired, findings)
    live = {r: drop_retired(t, retired.tasks.get(r)) for r, t in kept.items() if not retired.run_is_retired(r)}
    findings += _duplicates(data_root, records, live, retired)
    findings += cap_findings(records, live)
    findings += _conservation(data_root, records)
    for run_id in sorted(set(kept_files(warehouse / "kept")) - set(records)):
        findings.append(Finding(
            "uncommitted",
            f"warehouse/kept/{run_id}.parquet has no commit record (its walk stopped before committing): it is not "
            f"history; `{materialize_command()}` walks {run_id} again and commits it",
        ))  # fmt: skip
    # a walk publishes and moves its files under the lease: with no live lease, a publish half done is stopped
    incomplete = incomplete_publishes(data_root)
    walking = lease_live(warehouse) if incomplete else None
    for run_id, (folder, gone) in incomplete.items():
        # (a walk moving its files now is no finding: its staged copies were verified; one that finished since the
        # listing removed its folder before its lease)
        if (gone or walking is False) and _still_there(folder / MANIFEST):
            findings.append(Finding(
                "incomplete",
                f"{run_id}: its walk stopped after publishing its commit, before moving all its files into place (the "
                f"rest are in {relative(data_root, folder)}/; readers of warehouse/ still see the earlier files): "
                f"`{materialize_command()}` moves them",
            ))  # fmt: skip
    for run_id, record in records.items():
        changed = inputs_changed(run_folder(data_root, run_id), record.inputs)
        if changed:
            findings.append(Finding(
                "changed",
                f"runs/{run_id}/{', '.join(changed)} changed since {run_id} was filtered: re-filter it with "
                f"`{materialize_command(run_id)}` (it is not re-filtered unless named)",
            ))  # fmt: skip
    return capped(findings)


def _still_there(path: UPath) -> bool:
    """Whether `path` exists now (on object storage, not as a listing cached earlier in the audit said)."""
    if not is_local(path):
        path.fs.invalidate_cache(path.parent.path)
    return path.exists()


def _duplicates(
    data_root: UPath, records: dict[str, CommitRecord], live: dict[str, pa.Table], retired
) -> list[Finding]:
    """Keys kept more than once across non-retired runs: rows whose key_hash repeats, confirmed on the text."""
    runs, suspects = duplicate_suspects(live)
    rows = []
    for run_id in runs:
        if run_id in records:
            table = _kept_rows(data_root, run_id, records[run_id], ["dedup_key", "key_hash", "task_id"], [])
        else:
            table = _legacy(data_root, run_id)
        if table is not None:
            rows += suspect_rows(run_id, drop_retired(table, retired.tasks.get(run_id)), suspects)
    return duplicate_findings(rows) if runs else []


def _conservation(data_root: UPath, records: dict[str, CommitRecord]) -> list[Finding]:
    findings = []
    for run_id, record in records.items():
        path = asset_file(data_root / WAREHOUSE_DIR, "judge_verdicts", run_id)
        try:
            with path.open("rb") as f:
                verdicts = read_parquet_file(f, columns=["status", "passed"])
        except (FileNotFoundError, pa.ArrowException, OSError):
            findings.append(unreadable_verdicts(run_id))
            continue
        findings += conservation(run_id, record, verdicts)
    return findings
