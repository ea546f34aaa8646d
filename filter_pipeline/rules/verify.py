"""The audit of a whole warehouse (`filter-pipeline verify`, and the `warehouse_verified` check on coverage).

Every finding is one line naming the file or run, what is wrong and what to do:
- a commit record that cannot be read, a committed file that is missing or changed (size, SHA-256);
- a key kept by two non-retired runs (or twice by one);
- a cap exceeded where a run kept rows, counting the history that run's walk read and any run whose walk and
  its own never read each other, with the caps it recorded;
- a run whose verdicts are not each kept, surplus, a judge failure or unjudged (conservation);
- a kept file without a commit record (a walk stopped before committing);
- a published walk stopped before moving all its files into place;
- a committed batch whose input files changed since it was filtered.

Pure: tables and records in, findings out. Reading the warehouse for them is `storage/audit.py`'s.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.rules.filtering import Caps, caps_broken, over_caps
from filter_pipeline.rules.history import as_text, kept_pairs, sum_counts
from filter_pipeline.rules.schemas import to_pandas
from filter_pipeline.rules.vocabulary import STATUS_ERROR, STATUS_JUDGED
from filter_pipeline.settings import materialize_command

FINDING_KINDS = ("commit", "file", "duplicate", "cap", "conservation", "uncommitted", "incomplete", "changed")
MAX_LINES_PER_KIND = 20  # beyond this, one line says how many more of the same kind were found


@dataclass(frozen=True)
class Finding:
    kind: str  # one of FINDING_KINDS
    line: str

    def __post_init__(self):
        if self.kind not in FINDING_KINDS:  # (the check's metadata counts findings by these kinds)
            raise ValueError(f"finding kind {self.kind!r} is not one of {FINDING_KINDS}")


def capped(findings: list[Finding]) -> list[Finding]:
    out, seen = [], {}
    for finding in findings:
        seen[finding.kind] = seen.get(finding.kind, 0) + 1
        if seen[finding.kind] <= MAX_LINES_PER_KIND:
            out.append(finding)
    for kind, n in seen.items():
        if n > MAX_LINES_PER_KIND:
            out.append(Finding(kind, f"... and {n - MAX_LINES_PER_KIND} more findings of kind {kind!r}"))
    return out


def cap_findings(records: dict[str, CommitRecord], live: dict[str, pa.Table]) -> list[Finding]:
    """Where a committed run kept rows: its kept rows plus those of the runs its walk read as history (still
    non-retired), against the caps it recorded. Each run is counted per (macro, site) once; a run's prior is
    the sum of the runs it read, and of any run whose walk and its own never read each other (two walks blind
    to each other: one that stalled past its lease, a run retired at the other's walk and restored since).

    A walk that read exactly the runs before its own in run_id order (each first walk of a batch a day) has
    its prior from running totals (`running_priors`), so a warehouse's history is not summed again per run."""
    counts = {r: sum_counts([kept_pairs(t)]) for r, t in sorted(live.items()) if t.num_rows}
    running, position, runs = running_priors(counts), {r: at for at, r in enumerate(counts)}, set(counts)
    findings = []
    for run_id, record in records.items():
        if run_id not in runs:
            continue
        at = position[run_id]  # (how many runs with kept rows come before it in run_id order)
        read_ids = sorted(set(record.history) & runs - {run_id})
        unseen = [r for r in counts if r != run_id and r not in record.history and not _read(records, r, run_id)]
        caps = Caps.recorded(record.caps)
        if len(read_ids) + len(unseen) == at and all(r < run_id for r in read_ids + unseen):
            broken = caps_broken(*running[run_id], caps)  # (read: exactly the `at` runs before it)
        else:
            own = to_pandas(as_text(counts[run_id]))
            broken = over_caps(own, to_pandas(as_text(sum_counts([counts[r] for r in read_ids + unseen]))), caps)
        # runs committed again since this walk read them: their files now are not what it counted
        since = [r for r in read_ids if r in records and records[r].digest != record.history[r]]
        findings += cap_lines(run_id, *broken, since, unseen)
    return findings


def running_priors(counts: dict[str, pa.Table]) -> dict[str, tuple[pd.DataFrame, pd.Series]]:
    """For each run of `counts` (run_id -> `sum_counts`, in run_id order): its pairs (macro, site, n_kept) with
    `prior`, the pair's kept rows in the runs before it, and the kept rows per macro in the runs before it:
    `filtering.caps_broken`'s arguments for a walk that read exactly those runs. One pass over all runs."""
    if not counts:
        return {}
    tables = [as_text(c).append_column("run", pa.array([r] * c.num_rows, pa.string())) for r, c in counts.items()]
    frame = to_pandas(pa.concat_tables(tables))
    frame["prior"] = frame.groupby(["macro", "site"], sort=False)["n_kept"].cumsum() - frame["n_kept"]
    per_macro = frame.groupby(["run", "macro"], sort=False)["n_kept"].sum()
    macro_prior = per_macro.groupby(level="macro", sort=False).cumsum() - per_macro
    macros = {r: prior.droplevel("run") for r, prior in macro_prior.groupby(level="run", sort=False)}
    pairs = frame[["macro", "site", "n_kept", "prior"]]
    starts = np.flatnonzero(frame["run"].ne(frame["run"].shift()).to_numpy())  # (each run's rows are together)
    ends = [*starts[1:], len(frame)]
    return {r: (pairs.iloc[a:b], macros[r]) for r, a, b in zip(counts, starts, ends)}


def _read(records: dict[str, CommitRecord], reader: str, run_id: str) -> bool:
    """Whether the walk of `reader` read `run_id` as history (a legacy run, with no record, read none)."""
    return reader in records and run_id in records[reader].history


def cap_lines(
    run_id: str, sites: pd.DataFrame, macros: pd.DataFrame, since: list[str], unseen: list[str] = ()
) -> list[Finding]:
    """The cap findings of one run, from `filtering.over_caps`. `since`: the runs of its prior walked again
    after it read them (the lines say so: the breach is theirs); `unseen`: the runs counted with it whose walks
    and its own never read each other."""
    history = "the history it read"
    if since:
        history = f"its history as it is now ({', '.join(since)} walked again since it read them)"
    if unseen:
        history += f" and {', '.join(unseen)} (committed without either walk reading the other)"
    sites = sites.head(MAX_LINES_PER_KIND)
    return [
        Finding("cap", f"run {run_id}: {m}/{s} holds {total} kept rows with {history}, over its site cap {limit}")
        for m, s, total, limit in zip(sites["macro"], sites["site"], sites["total"], sites["limit"])
    ] + [
        Finding("cap", f"run {run_id}: macro {m} holds {total} kept rows with {history}, over its target {limit}")
        for m, total, limit in zip(macros["macro"], macros["total"], macros["limit"])
    ]


def duplicate_suspects(live: dict[str, pa.Table]) -> tuple[list[str], set[int]]:
    """The runs holding a key_hash that repeats across `live` (run -> its non-retired kept rows), and those
    hashes: only their texts need reading to confirm a duplicate."""
    if not live:
        return [], set()
    runs = list(live)
    hashes = np.concatenate([np.zeros(0, np.int64), *(live[r]["key_hash"].to_numpy() for r in runs)])
    owner = np.repeat(np.arange(len(runs)), [live[r].num_rows for r in runs])
    repeated = pd.Series(hashes).duplicated(keep=False).to_numpy()  # a hash table: no sort of millions
    return [runs[i] for i in sorted(set(owner[repeated].tolist()))], set(hashes[repeated].tolist())


def suspect_rows(run_id: str, table: pa.Table, suspects: set[int]) -> list[tuple[str, str, str]]:
    """(dedup_key, run_id, task_id) of the rows of `table` (dedup_key, key_hash, task_id) with a suspect hash."""
    wanted = pc.is_in(table["key_hash"], value_set=pa.array(sorted(suspects), pa.int64()))
    return [
        (key, run_id, task_id)
        for key, task_id in zip(*(table.filter(wanted)[c].to_pylist() for c in ("dedup_key", "task_id")))
    ]


def duplicate_findings(rows: list[tuple[str, str, str]]) -> list[Finding]:
    """Keys kept more than once among `rows` (dedup_key, run_id, task_id), confirmed on the text."""
    frame = pd.DataFrame(rows, columns=["dedup_key", "run_id", "task_id"])
    twice = frame[frame["dedup_key"].duplicated(keep=False)]
    findings = []
    for key, group in twice.groupby("dedup_key", sort=True):
        where = ", ".join(f"{r}/{t}" for r, t in zip(group["run_id"], group["task_id"]))
        findings.append(Finding("duplicate", f"key {key} is kept {len(group)} times ({where}): retire all but one "
                                             "in retired.json, or re-filter the later runs"))  # fmt: skip
    return findings


def unreadable_verdicts(run_id: str) -> Finding:
    return Finding("conservation", f"warehouse/judge_verdicts/{run_id}.parquet is missing or unreadable: "
                                   f"re-filter {run_id} with `{materialize_command(run_id)}`")  # fmt: skip


def conservation(run_id: str, record: CommitRecord, verdicts: pa.Table) -> list[Finding]:
    """A run whose verdicts (status, passed) are not each kept, surplus, a judge failure or unjudged."""
    status, passed = verdicts["status"], verdicts["passed"]
    judged = pc.equal(status, STATUS_JUDGED)
    failed = int(pc.sum(pc.and_(judged, pc.invert(pc.fill_null(passed, False)))).as_py() or 0)
    unjudged = int(pc.sum(pc.equal(status, STATUS_ERROR)).as_py() or 0)
    kept = int(record.files.get("kept", {}).get("rows", 0))
    surplus = int(record.files.get("surplus", {}).get("rows", 0))
    if kept + surplus + failed + unjudged == verdicts.num_rows:
        return []
    return [Finding(
        "conservation",
        f"run {run_id}: {verdicts.num_rows} verdicts but {kept} kept + {surplus} surplus + {failed} judge "
        f"failures + {unjudged} unjudged (the verdicts changed since its walk?): re-filter {run_id} with "
        f"`{materialize_command(run_id)}`",
    )]  # fmt: skip
