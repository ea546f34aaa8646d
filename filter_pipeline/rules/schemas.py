"""The one place where output columns, their Arrow types, reason names and fixed texts are defined (what each
column means: `descriptions.COLUMN_DESCRIPTIONS`, re-exported here).

Every asset's Parquet file is written with the schema below, so an empty partition has the same column
types as a full one and `pd.read_parquet(<warehouse>/<asset>/)` over every run at once works.
"""

import functools
import hashlib
import json
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from filter_pipeline.rules.descriptions import (  # re-exported: schemas names every fixed text
    CALIBRATION_MIN_LABELS as CALIBRATION_MIN_LABELS,
)
from filter_pipeline.rules.descriptions import (
    COLUMN_DESCRIPTIONS as COLUMN_DESCRIPTIONS,
)
from filter_pipeline.rules.descriptions import (
    DETAIL_MAX_CHARS as DETAIL_MAX_CHARS,
)
from filter_pipeline.rules.descriptions import (
    RAW_MAX_CHARS as RAW_MAX_CHARS,
)
from filter_pipeline.rules.descriptions import (
    RAW_REPLY_MAX_CHARS as RAW_REPLY_MAX_CHARS,
)
from filter_pipeline.rules.descriptions import (
    REASONING_MAX_CHARS as REASONING_MAX_CHARS,
)

# judge_verdicts.votes of the LLM judge: "P/N", P passing votes of the N asked (`votes_text`; read back by
# `VOTES_PARTS`, as `(P)/(N)`)
VOTES_PARTS = r"^(\d+)/(\d+)$"


def votes_text(passing: int, asked: int) -> str:
    return f"{passing}/{asked}"


def votes_asked(votes: str) -> str:
    """The N of a "P/N" votes value (how many votes the judge asks for); any other value (the gate's) as it is."""
    return votes.partition("/")[2] or votes


# What the LLM judge was shown of an attempt (judge_verdicts.evidence; null for the gate, which reads none):
# `evidence_value` makes the three forms, `evidence_problem` and `evidence_kind` read them.
EVIDENCE_TRAJECTORY = "trajectory"
EVIDENCE_RECORD_STEPS = "record_steps"
TRAJECTORY_MISSING = "trajectory.json missing"
TRAJECTORY_UNREADABLE = "trajectory.json unreadable"  # + " (<the OS error>)"
TRAJECTORY_NOT_JSON = "trajectory.json not JSON"  # + " (<the parser's message>)"
TRAJECTORY_NOT_OBJECT = "trajectory.json not an object"
TRAJECTORY_OUTSIDE_ROOT = "trajectory.json outside the data root"
TRAJECTORY_NO_STEPS = "trajectory.json has no steps list"  # page text from it, actions from the record


def evidence_value(problem: str | None) -> str:
    """The evidence of an attempt whose trajectory.json had `problem` (None: none): "trajectory" (all of it);
    "trajectory, record_steps: <problem>" when only its steps list was missing (its page text, the record's
    steps); else "record_steps: <problem>" (the record's steps, no page text)."""
    if problem is None:
        return EVIDENCE_TRAJECTORY
    steps = f"{EVIDENCE_RECORD_STEPS}: {problem}"
    return f"{EVIDENCE_TRAJECTORY}, {steps}" if problem == TRAJECTORY_NO_STEPS else steps


def evidence_problem(evidence: str) -> str | None:
    """Why an attempt was not judged from its whole trajectory.json (`evidence_value`'s problem), or None."""
    _, found, problem = evidence.partition(f"{EVIDENCE_RECORD_STEPS}: ")
    return problem if found else None


def evidence_kind(evidence: str) -> str:
    """An evidence value without its per-file detail ("record_steps: trajectory.json not JSON"): what is counted."""
    return evidence.split(" (", 1)[0]


DEFAULT_PER_SITE_CAP = 3

# --- dedup keys -------------------------------------------------------------------------------------


_CANONICAL = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def canonical_key(key: list[Any]) -> str:
    """The dedup key as the canonical JSON text every comparison uses (CONTRACT §3.7): what
    `json.dumps(key, ensure_ascii=False, separators=(",", ":"))` writes, with the encoder built once.

    `1`, `"1"`, `1.0` and `true` give four different texts, so they are four different arguments.
    """
    return _CANONICAL.encode(key)


def key_hashes(texts: list[str]) -> np.ndarray:
    """`key_hash` of each text, as int64 (the digests read as one array, not converted one by one)."""
    digests = b"".join([_digest(text.encode()) for text in texts])
    return np.frombuffer(digests, dtype=_HASH_BYTES).astype(np.int64)


def key_hash(text: str | bytes) -> int:
    """A 64-bit fingerprint of a canonical key (BLAKE2b, stable across processes and versions).

    History is probed by these integers, which are far cheaper to read and match than the texts; a match
    is always confirmed on the text itself.
    """
    data = text.encode() if isinstance(text, str) else text  # (bytes: the text's UTF-8)
    return int.from_bytes(_digest(data), "little", signed=True)


_HASH_BYTES = np.dtype("<i8")  # what `key_hash` reads a digest as: a little-endian signed 64-bit integer


def file_fingerprint(data: bytes | None, name: str) -> str:
    """A hash of a file's bytes, or `no <name>` when there is no such file: what an asset built from the file
    records, so that it is known to be stale exactly when the file changes."""
    return f"no {name}" if data is None else hashlib.sha256(data).hexdigest()[:16]


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


# --- Arrow schemas ----------------------------------------------------------------------------------

# large_string: the type behind pandas' default string dtype, so tables convert to and from pandas without
# copying their texts (in Parquet both are the same UTF-8 column; readers see text either way)
STR = pa.large_string()
INT = pa.int64()
BOOL = pa.bool_()

# A judge_verdicts frame carries in `attrs[JUDGED_INPUTS]` the fingerprints of the input bytes it was judged
# from (`Batch.inputs`). pyarrow keeps a frame's attrs in the Parquet file's pandas metadata and restores them
# on reading, so whoever loads a verdicts file gets the fingerprints of exactly those verdicts.
JUDGED_INPUTS = "judged_inputs"
# and in `attrs[JUDGED_BY]` the judge that judged them (`JudgeResource.identity`: what its commit record names)
JUDGED_BY = "judged_by"
# and in `attrs[JUDGE_PROGRESS_PARTS]` the names of the saved-progress parts (`judge.driver.ProgressStore`) it
# was built from: parts a kill left behind the file are removed by the next materialization, not counted again
JUDGE_PROGRESS_PARTS = "judge_progress_parts"

_VERDICT_FIELDS = [
    ("task_id", STR),
    ("macro", STR),
    ("site", STR),
    ("dedup_key", STR),
    ("attempt", INT),
    ("dir", STR),
    ("passed", BOOL),
    ("why", STR),
    ("votes", STR),
    ("backend", STR),
    ("start_kind", STR),
    ("instruction", STR),
    # beyond the contract's columns:
    ("key_hash", INT),  # schemas.key_hash(dedup_key)
    ("n_actions", INT),  # steps of the judged attempt
    ("status", STR),  # judged | error (unjudged: neither kept nor a failure, judged again next time)
    ("judge", STR),  # gate | llm
    ("model", STR),
    ("prompt_version", STR),
    ("cache_key", STR),  # hash of prompt version, model, votes, temperature and the exact inputs shown
    ("cached", BOOL),  # verdict reused from this partition's previous materialization or saved progress
    ("deduplicated", BOOL),
    ("requests", INT),
    ("prompt_tokens", INT),
    ("completion_tokens", INT),
    ("cached_tokens", INT),
    ("cost", pa.float64()),
    ("evidence", STR),
    # the verdict's parts (prompt v3; null for the gate and where the model did not say)
    ("judge_passed", BOOL),  # the model's own verdict; passed adds FILTER_JUDGE_MIN_SCORE
    ("success", BOOL),
    ("side_effects", BOOL),
    ("looping", BOOL),
    ("blocked", BOOL),
    ("score", INT),
    ("key_points", STR),  # JSON list of texts
    ("reasoning", STR),  # cut to REASONING_MAX_CHARS
    ("latency_ms", pa.float64()),
    ("raw_replies", STR),  # JSON list of the model's replies, each cut to RAW_REPLY_MAX_CHARS
    ("replies_sha256", STR),  # hash of the full replies
    ("run_id", STR),
]

SCHEMAS: dict[str, pa.Schema] = {
    "batch_tasks": pa.schema(
        [
            ("task_id", STR),
            ("macro", STR),
            ("site", STR),
            ("dedup_key", STR),
            ("key_hash", INT),
            ("start_kind", STR),
            ("instruction", STR),
            ("line", INT),
            ("run_id", STR),
        ]
    ),
    "batch_attempts": pa.schema(
        [
            ("task_id", STR),
            ("attempt", INT),
            ("ok", BOOL),
            ("error", STR),
            ("dir", STR),
            ("n_actions", INT),
            ("backend_ok", BOOL),
            ("backend_detail", STR),
            ("line", INT),
            ("run_id", STR),
        ]
    ),
    "batch_rejects": pa.schema(
        [
            ("file", STR),
            ("line", INT),
            ("field", STR),
            ("message", STR),
            ("raw", STR),
            ("run_id", STR),
        ]
    ),
    "judge_verdicts": pa.schema(_VERDICT_FIELDS),
    "failure_pool": pa.schema(
        [
            ("task_id", STR),
            ("macro", STR),
            ("site", STR),
            ("stage", STR),
            ("reason", STR),
            ("detail", STR),
            ("attempt", INT),
            ("dir", STR),
            ("n_actions", INT),
            ("instruction", STR),
            ("backend_ok", BOOL),
            ("blocked", BOOL),
            ("votes", STR),
            ("dedup_key", STR),
            ("run_id", STR),
        ]
    ),
    "prior_dedup_index": pa.schema(
        [
            ("dedup_key", STR),
            ("key_hash", INT),
            ("macro", STR),
            ("site", STR),
            ("run_id", STR),
            ("task_id", STR),
        ]
    ),
    "prior_kept_counts": pa.schema([("macro", STR), ("site", STR), ("n_kept", INT)]),
    "kept": pa.schema(_VERDICT_FIELDS),
    "coverage": pa.schema(
        [
            ("level", STR),  # site | macro
            ("macro", STR),
            ("site", STR),  # null on macro rows
            ("kept", INT),
            ("limit", INT),  # site cap, or macro target (null: no target)
            ("remaining", INT),
            ("full", BOOL),
        ]
    ),
    "judge_calibration": pa.schema(
        [
            ("predictor", STR),  # judge | gate
            ("model", STR),
            ("prompt_version", STR),
            ("site", STR),  # "(all)" for the overall row
            ("n", INT),
            ("tp", INT),
            ("fp", INT),
            ("fn", INT),
            ("tn", INT),
            ("precision", pa.float64()),
            ("precision_low", pa.float64()),
            ("precision_high", pa.float64()),
            ("recall", pa.float64()),
            ("recall_low", pa.float64()),
            ("recall_high", pa.float64()),
            ("f1", pa.float64()),
            ("kappa", pa.float64()),
            ("pass_rate_gap", pa.float64()),
            ("agreement", pa.float64()),
        ]
    ),
    "filter_report": pa.schema(
        [("section", STR), ("key", STR), ("metric", STR), ("value", pa.float64()), ("run_id", STR)]
    ),
    "dpo_pairs": pa.schema(
        [
            ("task_id", STR),
            ("macro", STR),
            ("site", STR),
            ("instruction", STR),
            ("chosen_dir", STR),
            ("chosen_attempt", INT),
            ("chosen_n_actions", INT),
            ("rejected_dir", STR),
            ("rejected_attempt", INT),
            ("rejected_n_actions", INT),
            ("rejected_stage", STR),
            ("rejected_reason", STR),
            ("rejected_detail", STR),
            ("run_id", STR),
        ]
    ),
    "surplus": pa.schema(
        [
            *_VERDICT_FIELDS,
            ("dropped", STR),
            ("dup_of_run_id", STR),
            ("dup_of_task_id", STR),
        ]
    ),
}


# Columns with few distinct values, stored dictionary-encoded. The history scan counts macro and site by
# their dictionary codes. Other text columns (task_id, dedup_key, dir, ...) are nearly unique: trying a
# dictionary on them only to give it up costs a large part of a write.
DICTIONARY_COLUMNS = frozenset(
    {"macro", "site", "run_id", "status", "judge", "model", "prompt_version", "votes", "stage", "reason", "dropped",
     "start_kind", "file", "field", "section", "metric", "level", "predictor", "dup_of_run_id", "rejected_stage",
     "rejected_reason", "why", "key", "evidence"}
)  # fmt: skip


def dictionary_columns(asset: str) -> list[str]:
    """The asset's columns that Parquet stores dictionary-encoded."""
    return [name for name in SCHEMAS[asset].names if name in DICTIONARY_COLUMNS]


# Text columns whose min/max statistics can let a reader skip a whole file: a query across the warehouse by
# run_id, or by a task_id or trajectory dir (which usually carry the run's name). Parquet gets statistics for
# these and for every non-text column (nearly free); other text spans all its values in every file, so its
# statistics could skip nothing and would cost every write.
STATISTICS_TEXT_COLUMNS = frozenset({"run_id", "task_id", "dir", "dup_of_run_id", "dup_of_task_id", "rejected_dir"})


def type_name(arrow_type: pa.DataType) -> str:
    """A column's type as users meet it: text is "string" (whichever Arrow string type holds it)."""
    return "string" if arrow_type == STR else str(arrow_type)


def statistics_columns(asset: str) -> list[str]:
    """The asset's columns that Parquet writes min/max statistics for."""
    return [f.name for f in SCHEMAS[asset] if f.name in STATISTICS_TEXT_COLUMNS or f.type != STR]


def empty_frame(asset: str) -> pd.DataFrame:
    """A zero-row frame with the asset's columns and dtypes."""
    return to_pandas(SCHEMAS[asset].empty_table())


@functools.cache
def _pandas_dtypes(asset: str) -> pd.Series:
    return empty_frame(asset).dtypes


def conforms(df: pd.DataFrame, asset: str) -> bool:
    """Whether `df` is already what reading the asset's file gives: its columns in order, their dtypes and a
    default row index (0, 1, ...)."""
    index = df.index
    return (
        isinstance(index, pd.RangeIndex)
        and index.start == 0
        and index.step == 1
        and list(df.columns) == SCHEMAS[asset].names
        and bool((df.dtypes == _pandas_dtypes(asset)).all())
    )


def conform(df: pd.DataFrame, asset: str) -> pd.DataFrame:
    """The frame with exactly the asset's columns, in order, with its dtypes (missing columns are null)."""
    if conforms(df, asset):
        return df.copy(deep=False)  # (copy-on-write: the caller's later changes stay its own)
    return to_pandas(to_arrow(df, asset))


def to_arrow(df: pd.DataFrame, asset: str) -> pa.Table:
    """The frame as an Arrow table of the asset's fixed schema (extra columns are dropped, missing ones null)."""
    schema = SCHEMAS[asset]
    present = [name for name in schema.names if name in df.columns]
    # nthreads=1: the columns are mostly Arrow already, so converting is cheap, while a pool of its own (what
    # pyarrow starts per call otherwise) waits on the GIL whenever a step's other threads hold it
    table = pa.Table.from_pandas(
        df[present], schema=pa.schema([schema.field(name) for name in present]), preserve_index=False, nthreads=1
    )
    if len(present) == len(schema):
        return table
    # missing columns as Arrow nulls of their type: a pandas reindex would fill a float block with NaN
    # for each and cast it, touching as much fresh memory as all of them
    nulls = {field.name: pa.nulls(len(df), field.type) for field in schema if field.name not in table.column_names}
    columns = [nulls[name] if name in nulls else table[name] for name in schema.names]
    return pa.Table.from_arrays(columns, schema=schema.with_metadata(table.schema.metadata))


def parquet_bytes(table: pa.Table, asset: str | None = None) -> pa.Buffer:
    """A Parquet file holding `table`, encoded in Arrow's memory with Arrow's default compression: an asset's
    file (its dictionary and statistics columns), or with no asset every column dictionary-encoded and with
    statistics."""
    sink = pa.BufferOutputStream()
    columns = (
        {}
        if asset is None
        else {"use_dictionary": dictionary_columns(asset), "write_statistics": statistics_columns(asset)}
    )
    pq.write_table(table, sink, **columns)
    return sink.getvalue()


# Nullable pandas dtypes, so a null bool is <NA> (never NaN, which is truthy) and ints stay ints.
_PANDAS_TYPES = {BOOL: pd.BooleanDtype(), INT: pd.Int64Dtype()}


def to_pandas(table: pa.Table) -> pd.DataFrame:
    """An Arrow table as pandas with nullable bool/int dtypes and pandas' default string dtype."""
    return table.to_pandas(types_mapper=_PANDAS_TYPES.get)


def isin(values: pd.Series, allowed) -> np.ndarray:
    """`values.isin(allowed)` as a boolean array, done by Arrow (pandas' version walks arrow strings in Python)."""
    return positions(values, pd.Series(allowed, dtype=object)) >= 0


def positions(values: pd.Series, keys: pd.Series) -> np.ndarray:
    """For each value, the position of its first equal in `keys`, or -1: a lookup by Arrow's hash table
    (a pandas merge on text columns factorizes both sides first, several times slower)."""
    found = pc.index_in(pa.array(values.astype("str"), type=STR), value_set=pa.array(keys.astype("str"), type=STR))
    return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def pylist(values: pd.Series) -> list:
    """The column as a Python list, converted by Arrow (iterating pandas' arrow strings is slow)."""
    return pa.array(values).to_pylist()


# the yes/no parts of a verdict (prompt v3), each a column of judge_verdicts beside its score
VERDICT_FLAGS = ("success", "side_effects", "looping", "blocked")
SCORE_RANGE = (1, 5)  # a verdict's score, lowest and highest
# every part of a verdict beside passed and why (prompt v3; null for the gate and where the model did not say)
VERDICT_PARTS = (*VERDICT_FLAGS, "score", "key_points", "reasoning")
# what asking the judge spent on a verdict (0 on deduplicated copies and reused verdicts)
SPEND_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
# the judge_verdicts fields a judge's answer fills: what reused verdicts carry and deduplicated copies share
# (`judge_passed`: the model's own verdict; `passed` derives from it and the score)
JUDGE_ANSWER_FIELDS = ("judge_passed", "why", "votes", "status", *SPEND_COUNTS, "latency_ms", "raw_replies",
                       "replies_sha256", *VERDICT_PARTS)  # fmt: skip

# The answers saved as the LLM judge goes (warehouse/_judge_progress/<run_id>/*.parquet), by cache_key: what a
# killed run's next materialization reuses instead of asking again.
JUDGE_PROGRESS_FOLDER = "_judge_progress"  # warehouse/_judge_progress/<run_id>/
JUDGE_PROGRESS_SCHEMA = pa.schema([f for f in _VERDICT_FIELDS if f[0] in ("cache_key", *JUDGE_ANSWER_FIELDS)])
