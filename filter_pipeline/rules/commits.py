"""Commit records: what one walk of one run wrote, so that history is what was committed (CONTRACT §4).

After the ledger step has staged every output of a run's walk (kept, surplus, the prior index and counts,
DPO pairs, the report), it publishes `<data>/warehouse/_commits/<run_id>.json` in one conditional write
(`storage/publish.py`). A run is filtered only once that record exists; a walk killed at any point before it
leaves the run pending, and its next walk starts again from the inputs. The record names each file with its size and SHA-256, so a later
reader can tell a committed file that was deleted, rewritten or truncated from the one the walk wrote.

The record and its parsing; reading and writing them is `storage/`'s (history.py, publish.py).
"""

import hashlib
import json
from dataclasses import dataclass, fields
from datetime import datetime
from functools import cached_property

import pandas as pd

from filter_pipeline.rules.batch import EXECUTIONS_FILE, TASKS_FILE
from filter_pipeline.rules.schemas import JUDGED_BY, votes_asked
from filter_pipeline.settings import JUDGE_LLM, materialize_command

COMMITS_DIR = "_commits"  # <data>/warehouse/_commits/<run_id>.json
LEGACY_PREFIX = "legacy:"  # history entry of a legacy run: "legacy:<sha256 of its kept.jsonl>"
INPUT_FILES = (TASKS_FILE, EXECUTIONS_FILE)


def commit_name(run_id: str) -> str:
    """The file name of a run's commit record, in COMMITS_DIR."""
    return f"{run_id}.json"


def commit_file(run_id: str) -> str:
    """Where a run's commit record is, as messages name it: relative to the data root."""
    return f"warehouse/{COMMITS_DIR}/{commit_name(run_id)}"


class HistoryIntegrityError(ValueError):
    """History cannot be trusted: one line naming the file, what is wrong with it and what to do."""


@dataclass(frozen=True)
class CommitRecord:
    """What one walk of one run wrote; every field is plain JSON.

    `files`: asset -> {"path" (relative to the data root), "size", "sha256", "rows"}; `kept_keys`: distinct keys
    kept; `caps`: the caps the walk applied, `caps_source` "deployment" or "run config"; `judge`: kind, model,
    prompt_version, votes and the settings that shape a verdict (`JUDGE_IDENTITY`; never a key); `history`:
    run_id -> the SHA-256 of the commit record it read (or "legacy:<sha256 of kept.jsonl>"); `inputs`: tasks.jsonl /
    executions.jsonl -> {"size", and "sha256" + "mtime_ns" on local disk or "etag" on object storage}; `unjudged`:
    tasks left unjudged by this walk.
    """

    run_id: str
    walked_at: str
    files: dict[str, dict]
    kept_keys: int
    caps: dict
    caps_source: str
    judge: dict
    history: dict[str, str]
    inputs: dict[str, dict]
    unjudged: int

    def to_json(self) -> bytes:
        """The record's canonical bytes (sorted keys, compact): what is written, and what `digest` hashes."""
        # (its fields as they are: `asdict` would copy every nested dict first, and a late run's history names
        # every run before it)
        fields_ = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps(fields_, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    @property
    def walked_timestamp(self) -> float:
        """When the walk committed, in seconds since the epoch (0.0 when the record does not say). Records
        written before walked_at carried microseconds say the start of their second: a comparison with a later
        moment of that second finds them earlier, so a walk asked meanwhile walks again rather than skipping."""
        try:
            return datetime.fromisoformat(self.walked_at).timestamp()
        except (TypeError, ValueError):
            return 0.0

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the record: how a later walk names the commit it read as history. Worked out once per
        record (a record is never changed once made): each later walk's record names every earlier one, so
        checking a warehouse's histories asks for each digest about as many times as there are runs."""
        return hashlib.sha256(self.to_json()).hexdigest()


def parse_commit(data: bytes, where: str, run_id: str) -> CommitRecord:
    """The commit record in `data` (the file `where` names); HistoryIntegrityError if it is not one."""
    redo = f"delete it and re-filter {run_id} with `{materialize_command(run_id)}`"
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HistoryIntegrityError(f"{where} is not a commit record (not JSON: {exc}): {redo}") from None
    names = {f.name for f in fields(CommitRecord)}
    if not isinstance(raw, dict) or set(raw) != names:
        raise HistoryIntegrityError(f"{where} is not a commit record (its fields differ): {redo}")
    record = CommitRecord(**raw)
    if record.run_id != run_id or not isinstance(record.files, dict) or not isinstance(record.history, dict):
        raise HistoryIntegrityError(f"{where} is not the commit record of run {run_id}: {redo}")
    for asset, entry in record.files.items():
        if not isinstance(entry, dict) or not {"path", "size", "sha256"} <= set(entry):
            raise HistoryIntegrityError(f"{where}: files.{asset} lacks path, size or sha256: {redo}")
    return record


# What tells one judge from another in a commit record: what enters the verdict cache key (`settings`: a digest
# of all of it, temperature and the prompt's screenshot and size settings included; absent from records written
# before it was recorded, where the rest is compared).
JUDGE_IDENTITY = ("kind", "model", "prompt_version", "votes", "settings")


def walks_fingerprint(records: dict[str, CommitRecord]) -> str | None:
    """A short hash of every committed walk (its run, when it was walked, its kept file's SHA-256), None before
    the first: it changes with every walk that commits, so the across-runs assets and the audit of the warehouse
    are refreshed once per change, even when kept files come back to an earlier state."""
    walks = sorted((run_id, r.walked_at, r.files.get("kept", {}).get("sha256", "")) for run_id, r in records.items())
    return hashlib.sha256(json.dumps(walks).encode()).hexdigest()[:16] if walks else None


def judge_settings(verdicts: pd.DataFrame) -> dict:
    """Which judge decided the walked verdicts (JUDGE_IDENTITY; never its key): the judge the verdicts' attrs
    name (JUDGED_BY), which holds even when it left every task unjudged; for verdicts written before they named
    it, what their columns say (no settings)."""
    judged_by = verdicts.attrs.get(JUDGED_BY)
    if isinstance(judged_by, dict) and judged_by.get("kind"):
        return {k: judged_by.get(k) for k in JUDGE_IDENTITY}

    def first(column: str):
        values = verdicts[column].dropna().unique() if column in verdicts else []
        return str(values[0]) if len(values) else None

    votes = first("votes")
    return {"kind": first("judge"), "model": first("model"), "prompt_version": first("prompt_version"),
            "votes": votes_asked(votes) if votes else None, "settings": None}  # fmt: skip


def another_judge(recorded, current: dict) -> str | None:
    """How the judge `current` (JUDGE_IDENTITY) differs from the one a commit `recorded`, or None when it is the
    same one (or the record names none: each setting is compared where the record names it). A run's unjudged
    tasks are judged again only by the judge that judged the rest: another would judge the run anew (the gate
    takes every task; another model, prompt or number of votes asks every task again), mixing two judges'
    verdicts or paying twice for them."""
    if not isinstance(recorded, dict) or not recorded.get("kind"):
        return None
    differ = [k for k in JUDGE_IDENTITY if recorded.get(k) and recorded[k] != (current.get(k) or None)]
    if not differ:
        return None
    others = " (other temperature, screenshot or prompt-size settings)" if differ == ["settings"] else ""
    return f"judged by {_named(recorded)}, not by {_named(current)}{others}"


def _named(judge: dict) -> str:
    if judge.get("kind") != JUDGE_LLM:
        return str(judge.get("kind"))
    return f"llm {judge.get('model')} {judge.get('prompt_version')} (votes {judge.get('votes') or '?'})"
