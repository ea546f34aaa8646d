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

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from upath import UPath

from filter_pipeline.rules.commits import COMMITS_DIR, CommitRecord, HistoryIntegrityError, inputs_changed, parse_commit
from filter_pipeline.rules.filtering import Caps, MacroLimits
from filter_pipeline.rules.history import (
    HistoryError, _drop_retired, _read_legacy, kept_files, legacy_kept_files, load_retired, verified_bytes,
)  # fmt: skip
from filter_pipeline.rules.schemas import DEFAULT_PER_SITE_CAP, STATUS_ERROR, STATUS_JUDGED

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
    macros = {m: MacroLimits(site_cap=c.get("site_cap"), target=c.get("target")) for m, c in (raw.get("caps") or {}).items()}
    return Caps(per_site_cap=raw.get("per_site_cap", DEFAULT_PER_SITE_CAP), macros=macros)


def _kept_rows(data_root: UPath, run_id: str, record: CommitRecord, findings: list[Finding]) -> pa.Table | None:
    entry = record.files.get("kept")
    if entry is None:
        findings.append(Finding("commit", f"warehouse/{COMMITS_DIR}/{run_id}.json names no kept file: re-filter {run_id} "
                                          f"with `filter-pipeline materialize {run_id}`"))  # fmt: skip
        return None
    try:
        data = verified_bytes(data_root, run_id, entry)
        return pq.read_table(pa.BufferReader(data), columns=["dedup_key", "macro", "site", "task_id"])
    except HistoryIntegrityError as exc:
        findings.append(Finding("file", str(exc)))
    except (pa.ArrowException, OSError, KeyError) as exc:
        findings.append(Finding("file", f"{entry['path']} (committed by run {run_id}) is not a readable kept file ({exc})"))
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

    kept: dict[str, pa.Table] = {}
    for run_id, record in records.items():
        table = _kept_rows(data_root, run_id, record, findings)
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
                kept[run_id] = _read_legacy(path, run_id)[0].select(["dedup_key", "macro", "site", "task_id"])
            except HistoryError as exc:
                findings.append(Finding("file", str(exc)))

    live = {r: _drop_retired(t, retired.tasks.get(r)) for r, t in kept.items() if not retired.run_is_retired(r)}
    findings += _duplicates(live)
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


def _duplicates(live: dict[str, pa.Table]) -> list[Finding]:
    if not live:
        return []
    frames = [t.select(["dedup_key", "task_id"]).append_column("run_id", pa.array([r] * t.num_rows, pa.string()))
              for r, t in live.items()]  # fmt: skip
    rows = pa.concat_tables(frames).to_pandas()
    twice = rows[rows["dedup_key"].duplicated(keep=False)]
    findings = []
    for key, group in twice.groupby("dedup_key", sort=True):
        where = ", ".join(f"{r}/{t}" for r, t in zip(group["run_id"], group["task_id"]))
        findings.append(Finding("duplicate", f"key {key} is kept {len(group)} times ({where}): retire all but one "
                                             "in retired.json, or re-filter the later runs"))  # fmt: skip
    return findings


def _pair_counts(table: pa.Table) -> pd.DataFrame:
    if table.num_rows == 0:
        return pd.DataFrame({"macro": [], "site": [], "n": []})
    grouped = table.select(["macro", "site"]).cast(pa.schema([("macro", pa.string()), ("site", pa.string())]))
    return grouped.group_by(["macro", "site"]).aggregate([([], "count_all")]).rename_columns(["macro", "site", "n"]).to_pandas()


def _caps(records: dict[str, CommitRecord], live: dict[str, pa.Table]) -> list[Finding]:
    """Where a committed run kept rows: its kept rows plus those of the runs its walk read as history (still
    non-retired), against the caps it recorded."""
    counts = {r: _pair_counts(t) for r, t in live.items()}
    findings = []
    for run_id, record in records.items():
        if run_id not in counts or counts[run_id].empty:
            continue
        caps = _caps_of(record)
        before = [counts[r] for r in record.history if r in counts and r != run_id]
        prior = pd.concat(before).groupby(["macro", "site"], as_index=False)["n"].sum() if before else None
        mine = counts[run_id]
        totals = mine.merge(prior, on=["macro", "site"], how="left", suffixes=("", "_before")) if prior is not None else mine.assign(n_before=0)
        totals["total"] = totals["n"] + totals["n_before"].fillna(0).astype(int)
        for macro, site, total in zip(totals["macro"], totals["site"], totals["total"]):
            cap = caps.site_cap(macro)
            if total > cap:
                findings.append(Finding("cap", f"run {run_id}: {macro}/{site} holds {total} kept rows with the history "
                                               f"it read, over its site cap {cap}"))  # fmt: skip
        for macro in sorted(set(mine["macro"])):
            target = caps.target(macro)
            total = int(totals.loc[totals["macro"] == macro, "n"].sum())
            if prior is not None:
                total += int(prior.loc[prior["macro"] == macro, "n"].sum())
            if target is not None and total > target:
                findings.append(Finding("cap", f"run {run_id}: macro {macro} holds {total} kept rows with the history "
                                               f"it read, over its target {target}"))  # fmt: skip
    return findings


def _conservation(data_root: UPath, records: dict[str, CommitRecord]) -> list[Finding]:
    findings = []
    for run_id, record in records.items():
        path = data_root / "warehouse" / "judge_verdicts" / f"{run_id}.parquet"
        try:
            with path.open("rb") as f:
                verdicts = pq.read_table(f, columns=["status", "passed"])
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
