"""Parsing one execution batch (`runs/<run_id>/`, given as the bytes of its two files) into tasks, attempts
and rejected records.

A bad record never stops the batch: it becomes one `batch_rejects` row naming the file, line, field and
what was expected (`records`), and the rest is parsed. Only a batch without a single valid task raises
`BatchError` (a missing file is `storage.runs`' to report).

Each file is read whole by Arrow's JSON reader (for tasks.jsonl every field but the dedup_key, whose parts
mix scalar types no Arrow column holds: orjson reads each line's key) when Arrow can vouch for every line;
otherwise (a bad line, or anything Arrow would read otherwise than the record checks: see `_arrow_may_read`
and `_arrow_table`) it is read line by line with `records.task_row` / `records.attempt_row`, which define a
valid record and name the rejects. Where Arrow vouches for a file, both give the same rows.
"""

import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import orjson
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from filter_pipeline.rules.records import (
    ATTEMPT_FIELDS,
    ATTEMPT_LINE,
    MAX_LINE_BYTES,
    ORJSON_DIGITS,
    TASK_FIELDS,
    TASK_LINE,
    UNSAFE_DIR_RE2,
    Fields,
    Reject,
    TooDeep,
    attempt_row,
    clean_key,
    has_digit_run,
    load_record,
    reject_row,
    task_row,
)
from filter_pipeline.rules.schemas import STR, conform, empty_frame, isin, key_hashes, positions

TASKS_FILE = "tasks.jsonl"
EXECUTIONS_FILE = "executions.jsonl"
SUCCESS_FILE = "_SUCCESS"
LEGACY_KEPT_FILE = "kept.jsonl"
# a UTF-8 byte order mark, which some Windows tools write at the start of a text file: not part of its first line
UTF8_BOM = b"\xef\xbb\xbf"

# A run_id is a folder name under runs/: nothing that could climb out of it or hide. No `..` either: Dagster's
# partition keys may not hold `...` (its notation of a partition range).
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class BatchError(ValueError):
    """The batch cannot be processed at all; the message says which file and why. `inputs`: what the batch
    held when it was refused (input file -> the fingerprint of the bytes parsed, or None for a file there but
    not read), when the reader says."""

    inputs: dict[str, dict | None] | None = None


def check_run_id(run_id: str) -> str:
    """The run_id itself, if it is a plain folder name; otherwise a ValueError saying why."""
    if not RUN_ID_PATTERN.fullmatch(run_id) or ".." in run_id:
        raise ValueError(
            f"run_id {run_id!r} is not a plain folder name "
            "(letters, digits, '.', '_', '-'; starting with a letter or digit; no '..'; at most 128 characters)"
        )
    return run_id


def is_plain_run_id(name: str) -> bool:
    """Whether a folder's name is a plain run_id (`check_run_id`)."""
    try:
        check_run_id(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Batch:
    tasks: pd.DataFrame  # columns of schemas.SCHEMAS["batch_tasks"], in tasks.jsonl order
    attempts: pd.DataFrame  # columns of schemas.SCHEMAS["batch_attempts"], in executions.jsonl order
    rejects: pd.DataFrame  # columns of schemas.SCHEMAS["batch_rejects"]
    seconds: float = 0.0  # how long reading and parsing took (set by whoever read the files)
    # the row in `tasks` of each attempt's task, as the parse found it (the rules take it rather than look
    # every task_id up again)
    task_at: np.ndarray | None = None
    # each input file's fingerprint as it was read (`storage.files.read_input`; set by whoever read the files):
    # what the run's commit records, so that a batch rewritten after it was parsed is reported as changed
    inputs: dict | None = None
    # the non-blank lines of executions.jsonl as read (`non_blank_lines`): the records every attempt is
    # accounted against (`checks.attempts_conserved`), counted apart from the parse
    attempt_records: int = 0


@dataclass(frozen=True)
class BatchState:
    run_id: str
    judged: bool  # warehouse/judge_verdicts/<run_id>.parquet exists
    filtered: bool  # committed (warehouse/_commits/<run_id>.json) or a legacy runs/<run_id>/kept.jsonl exists
    changed: bool = False  # committed, but tasks.jsonl / executions.jsonl differ from what the commit recorded


# --- reading line by line ---------------------------------------------------------------------------


def jsonl_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of a JSON Lines file holding more than whitespace (what `bytes.strip`
    strips), a byte order mark at its start skipped. Lines end at `\\n` only: a JSON string may hold other line
    separators raw (U+2028, U+2029, U+0085), and a `\\r` is whitespace between tokens."""
    return _lines(data.removeprefix(UTF8_BOM))


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """`jsonl_lines` of a file whose byte order mark, if any, is already skipped (skipping it twice would take
    a second one as the first line's rather than a reject)."""
    for number, raw in enumerate(io.BytesIO(data), start=1):  # (one line at a time: files run to gigabytes)
        raw = raw.removesuffix(b"\n")
        if raw.strip():
            yield number, raw


# a blank line: nothing but whitespace (what `bytes.strip` strips) before its newline or the end of the file
_BLANK_FIRST_LINE = re.compile(rb"[ \t\r\x0b\x0c]*(?:\n|\Z)")
_BLANK_LINE_AFTER = re.compile(rb"\n[ \t\r\x0b\x0c]*(?=\n|\Z)")


def non_blank_lines(data: bytes) -> int:
    """How many lines `jsonl_lines` gives (the records of a JSON Lines file, whatever the parse made of them),
    counted without making each line an object."""
    data = data.removeprefix(UTF8_BOM)
    lines = data.count(b"\n") + 1  # (the text after the last newline, empty or not, counted as a line)
    blank = (_BLANK_FIRST_LINE.match(data) is not None) + sum(1 for _ in _BLANK_LINE_AFTER.finditer(data))
    return lines - blank


def _read_lines(
    data: bytes,
    file: str,
    to_row: Callable[[dict], tuple],
    fields: Fields,
    deep_row: Callable[[bytes], tuple | None] | None = None,
) -> tuple[list[tuple], list[dict]]:
    """Every line of `data` (`jsonl_lines`, its byte order mark already skipped) as a row tuple (line number
    last); a line that fails becomes a reject. `fields`: where the row keeps or reads a value (`load_record`). A
    line nested deeper than json.loads follows goes to `deep_row` (Arrow's reader on that line alone, which
    takes any depth), when given."""
    rows: list[tuple] = []
    rejects: list[dict] = []
    long_numbers = has_digit_run(data, ORJSON_DIGITS)  # once for the file rather than once a line
    for number, raw in _lines(data):
        try:
            try:
                row = to_row(load_record(raw, long_numbers, fields))
            except TooDeep:
                if deep_row is None or (row := deep_row(raw)) is None:
                    raise
        except Reject as rej:
            rejects.append(reject_row(file, number, rej.field, rej.message, raw))
            continue
        rows.append((*row, number))
    return rows, rejects


def _frame(rows: list[tuple], fields: tuple[str, ...], asset: str) -> pd.DataFrame:
    return pd.DataFrame.from_records(rows, columns=[*fields, "line"]) if rows else empty_frame(asset)


# --- reading a file whole with Arrow ----------------------------------------------------------------

_TASK_ARROW = pa.schema(
    [
        ("task_id", STR),
        ("macro", STR),
        ("site", STR),
        ("instruction", STR),
        ("start", pa.struct([("kind", STR)])),
        # dedup_key: its parts mix types, which no Arrow column holds (`_task_keys` reads it)
    ]
)
_ATTEMPT_ARROW = pa.schema(
    [
        ("task_id", STR),
        ("attempt", pa.int64()),
        ("ok", pa.bool_()),
        ("error", STR),
        ("dir", STR),
        # steps are objects of any shape; only their number matters here
        ("steps", pa.list_(pa.struct([]))),
        ("backend", pa.struct([("ok", pa.bool_()), ("detail", STR)])),
    ]
)


def _line_count(data: bytes) -> int:
    """Number of lines, counting a last line without a newline."""
    return data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


def _is_utf8(data: bytes) -> bool:
    try:
        data.isascii() or data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _has_line_over(data: bytes, limit: int) -> bool:
    """Whether a line of `data` is longer than `limit` bytes. Such a line covers a whole `limit // 2`-byte
    block without a newline, so only the lines over such blocks are measured."""
    step = max(limit // 2, 1)
    for start in range(0, len(data), step):
        if data.find(b"\n", start, start + step) == -1:
            end = data.find(b"\n", start)
            if (len(data) if end == -1 else end) - (data.rfind(b"\n", 0, start) + 1) > limit:
                return True
    return False


# Arrow's reader splits the file into blocks after a `\r` or a `\n` and starts each block as it starts the file:
# a `null` first there crashes it (apache/arrow#47409), a UTF-8 BOM there is skipped. So the file, each line
# that is not blank and whatever follows a `\r` must start with an object. (A blank line passes here; the rows
# then do not match the lines.)
_FIRST_NOT_OBJECT = re.compile(rb"[ \t\r\n]*[^{ \t\r\n]")
_LINE_NOT_OBJECT = re.compile(rb"\n[ \t\r]*[^{ \t\r\n]")
_CR_NOT_OBJECT = re.compile(rb"\r[ \t]*[^{ \t\r\n]")
# A second value after an object on one line, an object or a `null`: Arrow reads two rows (the `null` one of
# nulls, reached through the same code as the crash above), the record checks reject the line.
_SECOND_VALUE = re.compile(rb"\}[ \t\r]*[{n]")
# Numbers Arrow's reader takes and Python's json does not (it does take Infinity, -Infinity and NaN). As a
# value, such a number is followed by the end of its object or array or by a comma; each pattern starts with
# its literal, which the regex engine finds fast ("Info" in page text fails at its "o").
_NON_JSON_NUMBERS = (re.compile(rb"Inf(?!inity)[ \t\r\n]*[,\]}]"), re.compile(rb"-NaN[ \t\r\n]*[,\]}]"))


def _arrow_may_read(data: bytes) -> bool:
    """Whether Arrow's reader may be asked for `data` at all: UTF-8 text (Arrow takes other bytes in fields it
    skips) where each line that is not blank and whatever follows a `\r` starts with an object, with no line
    over the length limit (Arrow reads an object across its blocks), no second value after an object on one
    line and no number Python's json does not read (in a field Arrow skips, Arrow would keep a record the
    record checks reject as not JSON). Text like these in a string only sends its file line by line."""
    return (
        _is_utf8(data)
        and _FIRST_NOT_OBJECT.match(data) is None
        # (most files hold no `\r` at all: finding none is far cheaper than the pattern's search)
        and not (b"\r" in data and _CR_NOT_OBJECT.search(data))
        and not any(p.search(data) for p in (_LINE_NOT_OBJECT, _SECOND_VALUE, *_NON_JSON_NUMBERS))
        and not _has_line_over(data, MAX_LINE_BYTES)
    )


def _arrow_table(data: bytes, schema: pa.Schema, required: tuple[str, ...]) -> pa.Table | None:
    """The fields of `schema` of every line, read by Arrow's JSON reader in one pass, or None when any line
    must be read by the record checks: what `_arrow_may_read` declines, blank lines (Arrow skips them), a
    type mismatch, a field of `schema` written twice in one object or a lone surrogate (Arrow refuses the
    file), a missing `required` field (a null), or an empty task_id. An integer too long for Python in a field
    of `schema` is a type mismatch to Arrow; anywhere else both let it be."""
    n_lines = _line_count(data)
    if n_lines == 0 or not _arrow_may_read(data):
        return None
    try:
        table = pa_json.read_json(
            pa.BufferReader(data),
            parse_options=pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
            read_options=pa_json.ReadOptions(block_size=MAX_LINE_BYTES),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    # rows as many as lines, and no line holding two objects: each line holds one whole object
    if table.num_rows != n_lines or any(table[name].null_count for name in required):
        return None
    return None if pc.any(pc.equal(table["task_id"], "")).as_py() else table


def _arrow_tasks(data: bytes) -> pd.DataFrame | None:
    """tasks.jsonl read whole (`_arrow_table`), each line's dedup_key by orjson (`_task_keys`), or None when
    any line must be read by the record checks: for `_arrow_table`'s reasons, a missing start.kind, a key that
    is not an array of finite scalars, or a run of digits orjson may read otherwise than json."""
    table = None if has_digit_run(data, ORJSON_DIGITS) else _arrow_table(data, _TASK_ARROW, _TASK_ARROW.names)
    if table is None:
        return None
    kind = pc.struct_field(table["start"].combine_chunks(), "kind")
    texts = None if kind.null_count else _task_keys(data)
    if texts is None:
        return None
    return pd.DataFrame(
        {
            "task_id": table["task_id"].to_pandas(),
            "macro": table["macro"].to_pandas(),
            "site": table["site"].to_pandas(),
            "dedup_key": pa.array(texts, type=STR).to_pandas(),
            "key_hash": key_hashes(texts),
            "start_kind": kind.to_pandas(),
            "instruction": table["instruction"].to_pandas(),
            "line": np.arange(1, len(texts) + 1),
        }
    )


def _task_keys(data: bytes) -> list[str] | None:
    """The canonical text of the dedup_key of every line, or None at the first line without a valid one."""
    texts = []
    for raw in io.BytesIO(data):
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        text = clean_key(record.get("dedup_key")) if type(record) is dict else None
        if text is None:
            return None
        texts.append(text)
    return texts


def _arrow_attempts(data: bytes) -> pd.DataFrame | None:
    """executions.jsonl read whole (`_arrow_table`), or None when any line must be read by the record checks:
    for `_arrow_table`'s reasons, or an unsafe dir."""
    table = _arrow_table(data, _ATTEMPT_ARROW, ("task_id", "attempt", "ok", "dir", "steps"))
    if table is None or pc.any(pc.match_substring_regex(table["dir"], UNSAFE_DIR_RE2)).as_py():
        return None
    backend = table["backend"].combine_chunks()
    return pd.DataFrame(
        {
            "task_id": table["task_id"].to_pandas(),
            "attempt": table["attempt"].to_pandas(),
            "ok": table["ok"].to_pandas(),
            "error": table["error"].to_pandas(),
            "dir": table["dir"].to_pandas(),
            "n_actions": pc.list_value_length(table["steps"]).to_pandas(),
            "backend_ok": pc.fill_null(pc.struct_field(backend, "ok"), False).to_pandas(),
            "backend_detail": pc.struct_field(backend, "detail").to_pandas(),
            "line": np.arange(1, table.num_rows + 1),
        }
    )


def _deep_attempt_row(raw: bytes) -> tuple | None:
    """The attempt row of one line nested deeper than json.loads follows, read by Arrow (None: it cannot)."""
    frame = _arrow_attempts(raw + b"\n")
    if frame is None:
        return None
    return tuple(None if pd.isna(v) else v for v in frame[list(ATTEMPT_FIELDS)].astype(object).iloc[0])


# --- the batch --------------------------------------------------------------------------------------


def parse_tasks(data: bytes, run_id: str) -> tuple[pd.DataFrame, list[dict]]:
    """The valid tasks of tasks.jsonl (`data`), first of each task_id, and the reject rows of the others.
    Raises BatchError when no task is valid. A byte order mark at the file's start is skipped."""
    tasks, rejects = tasks_and_rejects(data)
    if tasks.empty:
        detail = f" ({len(rejects)} line(s) rejected, first: {rejects[0]['message']})" if rejects else ""
        raise BatchError(f"runs/{run_id}/{TASKS_FILE} holds no valid task{detail}")
    return tasks, rejects


def tasks_and_rejects(data: bytes) -> tuple[pd.DataFrame, list[dict]]:
    """`parse_tasks`' tasks (none, when no line is valid) and reject rows, without refusing the file."""
    data = data.removeprefix(UTF8_BOM)
    tasks, rejects = _arrow_tasks(data), []
    if tasks is None:
        rows, rejects = _read_lines(data, TASKS_FILE, task_row, TASK_LINE)
        tasks = _frame(rows, TASK_FIELDS, "batch_tasks")
    # by the task_ids' codes: pandas' `duplicated` on Arrow strings is several times slower than its factorize
    duplicated = pd.Series(pd.factorize(tasks["task_id"])[0]).duplicated(keep="first").to_numpy()
    rejects += _rejects_for(tasks[duplicated], data, TASKS_FILE, "task_id", "task_id {} appears earlier in the file")
    (tasks,) = _without(duplicated, tasks)
    return tasks, rejects


def parse_attempts(
    data: bytes,
    tasks: pd.DataFrame,
    rejects: list[dict],
    run_id: str,
    outside_root: Callable[[pd.Series], set[str]] = lambda dirs: set(),
) -> Batch:
    """The batch: `tasks` and their rejects (`parse_tasks`), with the attempts of executions.jsonl (`data`).
    An attempt is rejected when it is invalid, of a task_id not among the tasks, a second (task_id, attempt),
    or has a dir in `outside_root(dirs)` (the dirs that resolve outside the data root). A byte order mark at
    the file's start is skipped."""
    records = non_blank_lines(data)
    data = data.removeprefix(UTF8_BOM)
    attempts = _arrow_attempts(data)
    if attempts is None:
        rows, attempt_rejects = _read_lines(data, EXECUTIONS_FILE, attempt_row, ATTEMPT_LINE, _deep_attempt_row)
        rejects = rejects + attempt_rejects
        attempts = _frame(rows, ATTEMPT_FIELDS, "batch_attempts")
    task_at = positions(attempts["task_id"], tasks["task_id"])
    orphan = task_at < 0
    message = "attempt of task_id {} which is not in tasks.jsonl"
    rejects = rejects + _rejects_for(attempts[orphan], data, EXECUTIONS_FILE, "task_id", message)
    attempts, task_at = _without(orphan, attempts, task_at)
    # (task, attempt) as two integers: far cheaper to compare than the task_id text
    numbers = pd.DataFrame({"task": task_at, "attempt": attempts["attempt"].to_numpy(dtype=np.int64)})
    twice = numbers.duplicated(keep="first").to_numpy()
    message = "attempt of task_id {} appears earlier with the same number"
    rejects += _rejects_for(attempts[twice], data, EXECUTIONS_FILE, "attempt", message)
    attempts, task_at = _without(twice, attempts, task_at)
    escaping = isin(attempts["dir"], list(outside_root(attempts["dir"])))
    message = "attempt of task_id {} has a dir that resolves outside the data root"
    rejects += _rejects_for(attempts[escaping], data, EXECUTIONS_FILE, "dir", message)
    attempts, task_at = _without(escaping, attempts, task_at)
    rejects_frame = pd.DataFrame(rejects) if rejects else empty_frame("batch_rejects")
    return Batch(
        tasks=conform(tasks.assign(run_id=run_id), "batch_tasks"),
        attempts=conform(attempts.assign(run_id=run_id), "batch_attempts"),
        rejects=conform(
            rejects_frame.assign(run_id=run_id).sort_values(["file", "line"], kind="stable"), "batch_rejects"
        ),
        task_at=task_at,
        attempt_records=records,
    )


def _without(dropped: np.ndarray, frame: pd.DataFrame, *aligned: np.ndarray) -> tuple:
    """`frame`, and the arrays aligned with its rows, without the rows `dropped` marks: as they are when it
    marks none (the usual case, where a copy of every column of a large batch would buy nothing)."""
    if not dropped.any():
        return (frame, *aligned)
    keep = ~dropped
    return (frame[keep], *(array[keep] for array in aligned))


def _rejects_for(rows: pd.DataFrame, data: bytes, file: str, field: str, template: str) -> list[dict]:
    if rows.empty:
        return []
    lines = data.split(b"\n")
    return [
        reject_row(file, int(line), field, template.format(repr(task_id)), lines[int(line) - 1])
        for task_id, line in zip(rows["task_id"], rows["line"])
    ]
