"""Parsing one execution batch (`runs/<run_id>/`) into tasks, attempts and rejected records.

A bad record never stops the batch: it becomes one `batch_rejects` row naming the file, line, field and
what was expected, and the rest is parsed. That includes records that are valid JSON but no use as data: a
lone surrogate escape (`"\ud800"`, not text: Parquet cannot store it), an integer with more digits than
Python converts (`sys.get_int_max_str_digits()`, 4,300 by default), anywhere in the record; a dedup_key
holding NaN or Infinity (or 1e400, which reads as Infinity); an attempt number beyond 64 bits. Only a batch
that cannot be read at all (no or empty `tasks.jsonl`, no `executions.jsonl`) raises `BatchError`.
"""

import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
from upath import UPath

from filter_pipeline.rules.commits import read_commits
from filter_pipeline.rules.schemas import (
    canonical_key,
    canonical_texts,
    conform,
    empty_frame,
    isin,
    key_hash,
    key_hashes,
    positions,
)
from filter_pipeline.storage.files import inputs_changed

# fsspec protocols of a local data root; anything else is object storage (no symlinks, no rename)
LOCAL_PROTOCOLS = ("", "file", "local")


def local_signature(path: UPath) -> tuple[int, int] | None:
    """(size, mtime_ns) of a file on local disk, by which a process tells a file it read or wrote from a later
    rewrite; None off local disk (another machine may rewrite an object). Raises OSError if it is missing."""
    if path.protocol not in LOCAL_PROTOCOLS:
        return None
    stat = os.stat(path.path)
    return stat.st_size, stat.st_mtime_ns


TASKS_FILE = "tasks.jsonl"
EXECUTIONS_FILE = "executions.jsonl"
SUCCESS_FILE = "_SUCCESS"
LEGACY_KEPT_FILE = "kept.jsonl"

MAX_LINE_BYTES = 1 << 20  # a record this long is a harness bug, not a trajectory
RAW_MAX_CHARS = 4096  # how much of a rejected line is kept in batch_rejects

# A run_id is a folder name under runs/: nothing that could climb out of it or hide.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class BatchError(ValueError):
    """The batch cannot be processed at all; the message says which file and why."""


def check_run_id(run_id: str) -> str:
    """The run_id itself, if it is a plain folder name; otherwise a ValueError saying why."""
    if not RUN_ID_PATTERN.match(run_id) or ".." in run_id:
        raise ValueError(
            f"run_id {run_id!r} is not a plain folder name "
            "(letters, digits, '.', '_', '-'; starting with a letter or digit; at most 128 characters)"
        )
    return run_id


@dataclass(frozen=True)
class Batch:
    tasks: pd.DataFrame  # columns of schemas.SCHEMAS["batch_tasks"], in tasks.jsonl order
    attempts: pd.DataFrame  # columns of schemas.SCHEMAS["batch_attempts"], in executions.jsonl order
    rejects: pd.DataFrame  # columns of schemas.SCHEMAS["batch_rejects"]
    seconds: float = 0.0  # how long the parse took
    # the row in `tasks` of each attempt's task, as the parse found it (the rules take it rather than look
    # every task_id up again)
    task_at: np.ndarray | None = None


# --- field checks -----------------------------------------------------------------------------------


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


class _Reject(Exception):
    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


class _TooDeep(_Reject):
    """A line nested deeper than json.loads follows (which pyarrow reads; see `_parse_lines`)."""


def _require(record: dict, field: str, check: Callable[[Any], bool], expected: str) -> Any:
    if field not in record:
        raise _Reject(field, f"missing field {field!r} (expected {expected})")
    value = record[field]
    if not check(value):
        raise _Reject(field, f"field {field!r} is {_describe(value)}, expected {expected}")
    return value


def _describe(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({json.dumps(value)[:60]})"


def _finite(key: list) -> bool:
    """Whether no part of the key is NaN or Infinity (JSON has neither; 1e400 reads as Infinity)."""
    return all(math.isfinite(part) for part in key if type(part) is float)


_NOT_FINITE = "field 'dedup_key' holds NaN or Infinity (or a number too large for a float, such as 1e400), which JSON has no text for"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


_UNSAFE_DIR = r"^(/|\\|[A-Za-z]:)|://|(^|[/\\])\.\.([/\\]|$)|^\s*$"


def unsafe_dir_reason(path: str) -> str | None:
    """Why a trajectory `dir` may not be read (absolute, a URL, or climbing with '..'), or None."""
    if not re.search(_UNSAFE_DIR, path):
        return None
    if not path.strip():
        return "must not be empty"
    if ".." in re.split(r"[\\/]", path):
        return "must not contain '..'"
    return "must be relative to the data root"


# --- per-record parsers -----------------------------------------------------------------------------


TASK_FIELDS = ("task_id", "macro", "site", "dedup_key", "key_hash", "start_kind", "instruction")
_SCALARS = (str, int, float, bool, type(None))


def _fast_task_row(record: Any) -> tuple | None:
    """The task row if the record is clean, else None (the careful parser then says what is wrong)."""
    try:
        task_id, macro, site = record["task_id"], record["macro"], record["site"]
        instruction, key, kind = record["instruction"], record["dedup_key"], record["start"]["kind"]
    except (KeyError, TypeError, IndexError):
        return None
    if not (
        type(task_id) is str and task_id and type(macro) is str and type(site) is str
        and type(instruction) is str and type(key) is list and type(kind) is str
        and type(record["start"]) is dict and all(type(part) in _SCALARS for part in key) and _finite(key)
    ):  # fmt: skip
        return None
    text = canonical_key(key)
    return (task_id, macro, site, text, key_hash(text), kind, instruction)


def _task_row(record: dict) -> tuple:
    task_id = _require(record, "task_id", lambda v: _is_str(v) and v != "", "a non-empty string")
    macro = _require(record, "macro", _is_str, "a string")
    site = _require(record, "site", _is_str, "a string")
    instruction = _require(record, "instruction", _is_str, "a string")
    key = _require(record, "dedup_key", lambda v: isinstance(v, list), "a JSON array")
    if not all(_is_scalar(part) for part in key):
        raise _Reject("dedup_key", "field 'dedup_key' must be an array of scalars (no arrays or objects)")
    if not _finite(key):
        raise _Reject("dedup_key", _NOT_FINITE)
    start = _require(record, "start", lambda v: isinstance(v, dict), "an object with 'kind'")
    if not _is_str(start.get("kind")):
        raise _Reject("start.kind", f"field 'start.kind' is {_describe(start.get('kind'))}, expected a string")
    text = canonical_key(key)
    return (task_id, macro, site, text, key_hash(text), start["kind"], instruction)


ATTEMPT_FIELDS = ("task_id", "attempt", "ok", "error", "dir", "n_actions", "backend_ok", "backend_detail")


def _attempt_row(record: dict) -> tuple:
    task_id = _require(record, "task_id", lambda v: _is_str(v) and v != "", "a non-empty string")
    attempt = _require(record, "attempt", _is_int, "an integer")
    if not INT64_MIN <= attempt <= INT64_MAX:
        raise _Reject("attempt", f"field 'attempt' is {_describe(attempt)}, expected an integer within 64 bits")
    ok = _require(record, "ok", _is_bool, "true or false")
    error = record.get("error")
    if not (error is None or _is_str(error)):
        raise _Reject("error", f"field 'error' is {_describe(error)}, expected a string or null")
    path = _require(record, "dir", _is_str, "a path relative to the data root")
    if reason := unsafe_dir_reason(path):
        raise _Reject("dir", f"field 'dir' {path!r} {reason}")
    steps = _require(record, "steps", lambda v: isinstance(v, list), "an array")
    backend = record.get("backend")
    if not (backend is None or isinstance(backend, dict)):
        raise _Reject("backend", f"field 'backend' is {_describe(backend)}, expected an object or null")
    backend = backend or {}
    backend_ok = backend.get("ok")
    if not (backend_ok is None or _is_bool(backend_ok)):
        raise _Reject("backend.ok", f"field 'backend.ok' is {_describe(backend_ok)}, expected true or false")
    detail = backend.get("detail")
    if not (detail is None or _is_str(detail)):
        raise _Reject("backend.detail", f"field 'backend.detail' is {_describe(detail)}, expected a string")
    return (task_id, attempt, ok, error, path, len(steps), bool(backend_ok), detail)


def _parse_lines(
    data: bytes,
    file: str,
    to_row: Callable[[dict], tuple],
    fast_row: Callable[[Any], tuple | None] | None = None,
    deep_row: Callable[[bytes], tuple | None] | None = None,
) -> tuple[list[tuple], list[dict]]:
    """Every non-blank line of `data` as a row tuple (line number last); a line that fails becomes a reject.

    `fast_row` takes clean records cheaply; anything it declines goes through `to_row`, which names the
    problem. A line nested deeper than json.loads follows goes to `deep_row`, the vectorised path on that
    line alone: it takes what it would take in a whole file, so both paths keep the same records.
    """
    rows: list[tuple] = []
    rejects: list[dict] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw or raw.isspace():
            continue
        try:
            try:
                record = _load_record(raw)
            except _TooDeep:
                if deep_row is None or (row := deep_row(raw)) is None:
                    raise
            else:
                row = fast_row(record) if fast_row is not None else None
                if row is None:
                    row = to_row(record)
        except _Reject as rej:
            rejects.append(_reject_row(file, number, rej.field, rej.message, raw))
            continue
        rows.append((*row, number))
    return rows, rejects


# a JSON escape of a UTF-16 surrogate: half of a pair (an emoji, as json.dumps writes it) or a lone one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _load_record(raw: bytes) -> dict:
    """The line as a JSON object whose every string is text and every integer one Python converts; raises
    _Reject saying why not (too long, not UTF-8, not JSON, nested too deep, an integer too long, a lone
    surrogate, not an object)."""
    if len(raw) > MAX_LINE_BYTES:
        raise _Reject(None, f"line is {len(raw):,} bytes, longer than the {MAX_LINE_BYTES:,}-byte limit")
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
    except UnicodeDecodeError as exc:
        raise _Reject(None, f"line is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Reject(None, f"line is not JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError:  # the only other one json raises: an integer beyond Python's int-string limit
        raise _long_integer_reject(text) from None
    except RecursionError:
        raise _TooDeep(None, "line nests arrays or objects deeper than a JSON reader follows") from None
    if not isinstance(record, dict):
        raise _Reject(None, f"line is a JSON {type(record).__name__}, expected an object")
    if _SURROGATE_ESCAPE.search(raw) and not _is_text(record) and (found := _first(record, _lone_surrogate)):
        field, char = found
        raise _Reject(field, f"field {field!r} holds a lone surrogate (\\u{ord(char):04x}), which is not text")
    return record


def _is_text(record: dict) -> bool:
    """Whether every string of the record encodes as UTF-8 (one pass in C; `_first` then says where not)."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return False
    return True


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate of a string value (which UTF-8, hence Parquet, cannot hold), or None."""
    if type(value) is not str or value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return value[exc.start]
    return None


class _LongInteger:
    """An integer literal with more digits than Python converts (read as this marker, to name its field)."""

    def __init__(self, literal: str):
        self.digits = len(literal) - literal.startswith("-")


def _long_integer_reject(text: str) -> _Reject:
    limit = sys.get_int_max_str_digits()
    read = lambda literal: _LongInteger(literal) if len(literal) - literal.startswith("-") > limit else int(literal)  # noqa: E731
    try:
        record = json.loads(text, parse_int=read)
    except (ValueError, RecursionError):
        record = None
    found = _first(record, lambda v: v if isinstance(v, _LongInteger) else None) if isinstance(record, dict) else None
    if found is None:
        return _Reject(
            None, f"line holds an integer of more than {limit:,} digits, more than Python converts to a number"
        )
    field, number = found
    return _Reject(
        field,
        f"field {field!r} holds an integer of {number.digits:,} digits, more than the {limit:,} Python converts to a number",
    )


def _first(record: dict, problem: Callable[[Any], Any]) -> tuple[str, Any] | None:
    """(where, what `problem` found) for the first key or value anywhere in the record, however deep, for
    which `problem` returns something other than None (where: the field's path, as `backend.detail` or
    `steps[2].text`); None if there is none. Iterative: a record as deep as json.loads reads would exhaust
    the recursion limit."""
    stack: list[tuple[str, Any]] = [(key, value) for key, value in reversed(record.items())]
    stack += [(key, key) for key in reversed(record)]  # the field names first
    while stack:
        path, item = stack.pop()
        if (found := problem(item)) is not None:
            return path, found
        if isinstance(item, dict):
            stack += [(f"{path}.{key}", value) for key, value in reversed(item.items())]
            stack += [(f"{path}.{key}", key) for key in reversed(item)]
        elif isinstance(item, list):
            stack += [(f"{path}[{i}]", value) for i, value in reversed(list(enumerate(item)))]
    return None


def _one_row(frame: pd.DataFrame | None, fields: tuple[str, ...]) -> tuple | None:
    """The first row of a fast-path frame as a row tuple of `fields` (None stays None)."""
    if frame is None:
        return None
    values = frame[list(fields)].astype(object).iloc[0]
    return tuple(None if pd.isna(v) else v for v in values)


def _deep_task_row(raw: bytes) -> tuple | None:
    return _one_row(_fast_tasks(raw + b"\n"), TASK_FIELDS)


def _deep_attempt_row(raw: bytes) -> tuple | None:
    return _one_row(_fast_attempts(raw + b"\n"), ATTEMPT_FIELDS)


def _frame(rows: list[tuple], fields: tuple[str, ...], asset: str) -> pd.DataFrame:
    return pd.DataFrame.from_records(rows, columns=[*fields, "line"]) if rows else empty_frame(asset)


def _reject_row(file: str, line: int, field: str | None, message: str, raw: bytes) -> dict:
    return {
        "file": file,
        "line": line,
        # a field is named by the record, so its name may itself hold a lone surrogate: escaped, to stay text
        "field": None if field is None else field.encode("utf-8", "backslashreplace").decode("utf-8"),
        "message": f"{file}:{line}: {message}",
        "raw": raw[: RAW_MAX_CHARS * 4].decode("utf-8", errors="replace")[:RAW_MAX_CHARS],
    }


# --- vectorised fast path for executions.jsonl ------------------------------------------------------

_ATTEMPT_ARROW = pa.schema(
    [
        ("task_id", pa.large_string()),
        ("attempt", pa.int64()),
        ("ok", pa.bool_()),
        ("error", pa.large_string()),
        ("dir", pa.large_string()),
        # steps are objects of any shape; only their number matters here
        ("steps", pa.list_(pa.struct([]))),
        ("backend", pa.struct([("ok", pa.bool_()), ("detail", pa.large_string())])),
    ]
)


NEWLINE_SCAN_BYTES = 16 << 20  # _newline_slices compares this much of the data at a time, into one reused buffer


def _newline_slices(data: bytes) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, mask) for each NEWLINE_SCAN_BYTES slice of `data`, the mask marking its newline bytes (one
    reused buffer: valid until the next slice). numpy compares without holding the GIL, and the batch is
    parsed while the main thread imports Dagster (bytes.count holds the GIL over the whole file: 0.05 s at
    140 MB, three times numpy's time); a mask of the whole file at once would be as large as the file, in
    fresh memory (15k page faults at 60 MB)."""
    view = np.frombuffer(data, dtype=np.uint8)
    found = np.empty(min(len(view), NEWLINE_SCAN_BYTES), dtype=bool)
    for start in range(0, len(view), NEWLINE_SCAN_BYTES):
        part = view[start : start + NEWLINE_SCAN_BYTES]
        yield start, np.equal(part, ord("\n"), out=found[: len(part)])


def _newlines(data: bytes) -> int:
    """How many newline bytes `data` holds."""
    return sum(int(np.count_nonzero(mask)) for _, mask in _newline_slices(data))


def _newline_positions(data: bytes) -> np.ndarray:
    """The offsets of `data`'s newline bytes, in order (int64)."""
    parts = [np.flatnonzero(mask) + start for start, mask in _newline_slices(data)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _is_utf8(data: bytes) -> bool:
    """Whether `data` is valid UTF-8 (Arrow's validation, without copying or decoding it)."""
    offsets = np.array([0, len(data)], dtype=np.int64)
    try:
        pa.Array.from_buffers(pa.large_string(), 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)]).validate(
            full=True
        )
    except pa.ArrowInvalid:
        return False
    return True


def _may_hold_long_integer(data: bytes) -> bool:
    """Whether `data` holds a run of more digits than Python converts to an integer
    (`sys.get_int_max_str_digits()`), in a string or not. Looks at one byte in every `limit // 10`: such a
    run covers at least ten consecutive samples, all digits; only around those is the data searched."""
    limit = sys.get_int_max_str_digits()
    if not limit or len(data) <= limit:
        return False
    step = max(1, limit // 10)
    samples = np.frombuffer(data, dtype=np.uint8)[::step]
    digit = np.subtract(samples, np.uint8(ord("0"))) < 10  # (uint8 wraps around below "0")
    runs = np.concatenate([[0], np.cumsum(digit)])
    candidates = np.flatnonzero(runs[10:] - runs[:-10] == 10) * step
    # a run of more than `limit` digits through `at` has more than `limit` of them within `limit` bytes of it
    long_run = re.compile(rb"[0-9]{%d}" % (limit + 1))
    return any(long_run.search(data, max(0, at - limit), at + limit + 1) for at in candidates.tolist())


def _line_count(data: bytes) -> int:
    """Number of lines, counting a last line without a newline."""
    return _newlines(data) + (0 if data.endswith(b"\n") or not data else 1)


def _read_jsonl(data: bytes, schema: pa.Schema) -> pa.Table | None:
    """The JSON lines as a table of `schema` (other fields ignored), or None if pyarrow cannot read them
    as they are: a type mismatch, a record longer than MAX_LINE_BYTES (it straddles pyarrow's block), a
    blank line (pyarrow would skip it and shift every later line number), a lone surrogate escape or a
    number too large for a float anywhere (pyarrow refuses both), bytes that are not UTF-8 or what may be an
    integer longer than Python converts (pyarrow takes both unchecked; the careful path rejects their
    records)."""
    n_lines = _line_count(data)
    if n_lines == 0 or not _is_utf8(data) or _may_hold_long_integer(data):
        return None
    try:
        table = pa_json.read_json(
            pa.BufferReader(data),
            parse_options=pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
            read_options=pa_json.ReadOptions(block_size=MAX_LINE_BYTES),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return table if table.num_rows == n_lines else None


def _fast_attempts(data: bytes) -> pd.DataFrame | None:
    """executions.jsonl read by pyarrow in one pass, or None when any line needs the careful path.

    The careful path gives the same rows for clean input; this one only exists for speed on big batches,
    so it refuses anything it would have to interpret: blank or over-long lines, type mismatches (pyarrow
    raises), or a missing required field (a null in the table).
    """
    table = _read_jsonl(data, _ATTEMPT_ARROW)
    if table is None:
        return None
    n_lines = table.num_rows
    for required in ("task_id", "attempt", "ok", "dir", "steps"):
        if table[required].null_count:
            return None
    if pc.any(pc.equal(table["task_id"], "")).as_py():
        return None
    dirs = table["dir"]
    if pc.any(pc.match_substring_regex(dirs, _UNSAFE_DIR)).as_py():
        return None
    backend = table["backend"].combine_chunks()
    return pd.DataFrame(
        {
            "task_id": table["task_id"].to_pandas(),
            "attempt": table["attempt"].to_pandas(),
            "ok": table["ok"].to_pandas(),
            "error": table["error"].to_pandas(),
            "dir": dirs.to_pandas(),
            "n_actions": pc.list_value_length(table["steps"]).to_pandas(),
            "backend_ok": pc.fill_null(pc.struct_field(backend, "ok"), False).to_pandas(),
            "backend_detail": pc.struct_field(backend, "detail").to_pandas(),
            "line": np.arange(1, n_lines + 1),
        }
    )


# --- symlinks ---------------------------------------------------------------------------------------


def _symlinks_below(folder: str) -> list[str]:
    found, stack = [], [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():
                found.append(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return found


# The folder a trajectory dir sits in, at most three levels deep (runs/<run_id>/traj/<task>/<n> ->
# runs/<run_id>/traj; a/b -> a; a -> a).
_TOP = r"^((?:[^/]*/){0,2}[^/]*)/.*$"


def dirs_outside_root(run_dir: UPath, dirs: pd.Series) -> set[str]:
    """The trajectory dirs that, with symlinks resolved, leave the data root (local disk only).

    Dirs are grouped by their top folder (runs/<run_id>/traj); each top folder is resolved once and walked
    once for symlinks, and only dirs behind a symlink are resolved one by one. A batch without symlinks
    costs one walk of its trajectory folders.
    """
    if run_dir.protocol not in LOCAL_PROTOCOLS or dirs.empty:
        return set()
    root = os.path.realpath(os.path.dirname(os.path.dirname(run_dir.path)))
    inside = lambda rel: os.path.realpath(os.path.join(root, rel)).startswith(root + os.sep)  # noqa: E731
    paths = pa.array(dirs, type=pa.string())  # (not made unique first: hashing 600k paths costs more than it saves)
    outside: set[str] = set()
    for top, under in _by_top(paths):
        if not inside(top):
            outside.update(under.to_pylist())
            continue
        links = tuple(os.path.relpath(p, root) + "/" for p in _symlinks_below(os.path.join(root, top)))
        if links:
            outside.update(d for d in under.to_pylist() if (d + "/").startswith(links) and not inside(d))
    return outside


def _by_top(paths: pa.Array) -> list[tuple[str, pa.Array]]:
    """(top folder, the paths under it) groups. A batch's dirs nearly all share one top
    (runs/<run_id>/traj): one prefix test settles those, and only the others go through the regex."""
    first = pc.replace_substring_regex(paths.slice(0, 1), _TOP, r"\1")[0].as_py()
    groups = []
    if first.count("/") == 2:
        common = pc.starts_with(paths, first + "/")
        groups.append((first, paths.filter(common)))
        paths = paths.filter(pc.invert(common))
    tops = pc.replace_substring_regex(paths, _TOP, r"\1")
    groups += [(top, paths.filter(pc.equal(tops, top))) for top in pc.unique(tops).to_pylist()]
    return groups


# --- vectorised fast path for tasks.jsonl ----------------------------------------------------------

_TASK_ARROW = pa.schema(
    [
        ("task_id", pa.large_string()),
        ("macro", pa.large_string()),
        ("site", pa.large_string()),
        ("instruction", pa.large_string()),
        ("start", pa.struct([("kind", pa.large_string())])),
    ]
)
_STRING = r'"(?:[^"\\]|\\.)*"'
# A dedup_key field at object level (after '{' or ','): an array holding only strings (which may contain
# any character), numbers, true, false and null — no nested array or object can match.
_KEY_FIELD = rf'(?:^|[{{,])\s*"dedup_key"\s*:\s*(?P<key>\[(?:[^\[\]{{}}"]|{_STRING})*\])'
# ... of the line's own object, not of one nested in it: from the opening brace to the field, only scalars,
# whole strings and whole nested objects (up to three deep; deeper ones go to the exact check below). A
# plain match, without captures, which RE2 runs as a fast DFA.
_NESTED = rf'\{{(?:[^"{{}}]|{_STRING})*\}}'
for _ in range(2):
    _NESTED = rf'\{{(?:[^"{{}}]|{_STRING}|{_NESTED})*\}}'
_TOP_LEVEL_KEY = rf'^\s*\{{(?:[^"{{]|{_STRING}|{_NESTED})*?"dedup_key"\s*:'
# Everything before the first dedup_key field outside strings (for the exact check).
_BEFORE_KEY = rf'^(?P<before>(?:[^"]|{_STRING})*?[{{,])\s*"dedup_key"\s*:'


def _lines(data: bytes) -> pa.Array:
    """Each line of `data` (with its newline) as a string, without copying: the string offsets are the
    newline positions, over the bytes themselves. (`data` must be valid UTF-8: `_read_jsonl` checked.)"""
    ends = _newline_positions(data) + 1
    if len(ends) == 0 or ends[-1] != len(data):
        ends = np.append(ends, len(data))
    offsets = np.concatenate([[0], ends]).astype(np.int32 if len(data) < 2**31 else np.int64)
    kind = pa.string() if offsets.dtype == np.int32 else pa.large_string()
    return pa.Array.from_buffers(kind, len(ends), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _keys_are_top_level(lines: pa.Array) -> bool:
    """Whether each line's first dedup_key field (outside strings) belongs to the line's own object rather
    than to an object nested in it. Exact where the fast match cannot tell: with the strings taken out of
    what comes before the field, exactly one brace is open there and no bracket."""
    unsure = pc.invert(pc.match_substring_regex(lines, _TOP_LEVEL_KEY))
    if not pc.any(unsure).as_py():
        return True
    found = pc.extract_regex(lines.filter(unsure), _BEFORE_KEY)
    if found.null_count:
        return False
    before = pc.replace_substring_regex(pc.struct_field(found, "before"), _STRING, "")
    count = lambda text: pc.count_substring(before, text).to_numpy(zero_copy_only=False)  # noqa: E731
    return bool(((count("{") - count("}") == 1) & (count("[") == count("]"))).all())


def _fast_tasks(data: bytes) -> pd.DataFrame | None:
    """tasks.jsonl read by pyarrow, or None when any line needs the careful path.

    Arrow cannot hold a dedup_key of mixed scalar types, so the keys' JSON text is cut out of each line by
    one vectorised regex and parsed in a single json.loads call. Anything unusual (blank or over-long lines,
    a missing or mistyped field, `"dedup_key"` named more than once in a line, a key that is not an array of
    scalars) sends the whole file down the careful path, which says what is wrong.
    """
    table = _read_jsonl(data, _TASK_ARROW)
    if table is None:
        return None
    n_lines = table.num_rows
    try:
        lines = _lines(data)
    except pa.ArrowInvalid:
        return None
    if len(lines) != n_lines:
        return None
    kind = pc.struct_field(table["start"].combine_chunks(), "kind")
    if any(table[c].null_count for c in ("task_id", "macro", "site", "instruction")) or kind.null_count:
        return None
    if pc.any(pc.equal(table["task_id"], "")).as_py():
        return None
    raw = pc.struct_field(pc.extract_regex(lines, _KEY_FIELD), "key")
    # every line names "dedup_key" at least once (the regex matched) and the file n_lines times: so each once
    named = pc.sum(pc.count_substring(lines, '"dedup_key"')).as_py()  # (bytes.count would hold the GIL)
    if raw.null_count or named != n_lines or not _keys_are_top_level(lines):
        return None
    try:
        texts = canonical_texts(raw)
    except ValueError:
        return None
    del lines, raw
    return pd.DataFrame(
        {
            "task_id": table["task_id"].to_pandas(),
            "macro": table["macro"].to_pandas(),
            "site": table["site"].to_pandas(),
            "dedup_key": texts.to_pandas(),
            "key_hash": key_hashes(texts),
            "start_kind": kind.to_pandas(),
            "instruction": table["instruction"].to_pandas(),
            "line": np.arange(1, n_lines + 1),
        }
    )


# --- the batch --------------------------------------------------------------------------------------


_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchState:
    run_id: str
    judged: bool  # warehouse/judge_verdicts/<run_id>.parquet exists
    filtered: bool  # committed (warehouse/_commits/<run_id>.json) or a legacy runs/<run_id>/kept.jsonl exists
    changed: bool = False  # committed, but tasks.jsonl / executions.jsonl differ from what the commit recorded


def complete_batches(
    runs: UPath,
    warehouse: UPath,
    log: logging.Logger | None = _LOG,
    refused: list[str] | None = None,
) -> list[BatchState]:
    """Every batch under `runs` with `_SUCCESS` and a plain run_id, in run_id order (`warehouse`: where
    their outputs are).

    A batch without `_SUCCESS` is still being written and is not listed; a complete one whose folder name is
    not a plain run_id is refused: one line, "runs/<name>: refused: why; rename it", logged as a warning to
    `log` (None: not logged) and appended to `refused` (when given). A batch is filtered only
    once its walk committed (a kept file without a commit is a walk killed midway: still to do).
    """
    if not runs.exists():
        return []
    judged = _stems(warehouse / "judge_verdicts")
    commits = read_commits(warehouse)
    states = []
    for run_dir in runs.iterdir():
        run_id = run_dir.name
        if not (run_dir / SUCCESS_FILE).exists():
            continue
        try:
            check_run_id(run_id)
        except ValueError as exc:
            # (a name that is not UTF-8 reaches Python as lone surrogates: escaped, to print as text)
            name = run_id.encode("utf-8", "backslashreplace").decode("utf-8")
            message = f"runs/{name}: refused: {exc}; rename it".encode("utf-8", "backslashreplace").decode("utf-8")
            if log is not None:
                log.warning(message)
            if refused is not None:
                refused.append(message)
            continue
        committed = commits.get(run_id)
        filtered = committed is not None or (run_dir / LEGACY_KEPT_FILE).exists()
        changed = committed is not None and bool(inputs_changed(run_dir, committed.inputs))
        states.append(BatchState(run_id=run_id, judged=run_id in judged, filtered=filtered, changed=changed))
    return sorted(states, key=lambda s: s.run_id)


def _stems(folder) -> set[str]:
    if not folder.exists():
        return set()
    return {
        p.name.removesuffix(".parquet")
        for p in folder.iterdir()
        if p.name.endswith(".parquet") and not p.name.startswith(".")
    }


def read_batch(run_dir: UPath, run_id: str) -> Batch:
    """Parse `runs/<run_id>/`: tasks and attempts that passed validation, and one reject row per record that
    did not (malformed, mistyped, a second `task_id` or (task_id, attempt), an attempt of an unknown task).

    Raises BatchError when `tasks.jsonl` is missing or has no task, or `executions.jsonl` is missing.
    """
    started = time.perf_counter()
    tasks_path, executions_path = run_dir / TASKS_FILE, run_dir / EXECUTIONS_FILE
    if not tasks_path.exists():
        raise BatchError(f"runs/{run_id}/{TASKS_FILE} does not exist: not an execution batch")
    if not executions_path.exists():
        raise BatchError(f"runs/{run_id}/{EXECUTIONS_FILE} does not exist: the harness wrote no attempts file")
    tasks_data = tasks_path.read_bytes()

    tasks, rejects = _fast_tasks(tasks_data), []
    if tasks is None:
        task_rows, rejects = _parse_lines(tasks_data, TASKS_FILE, _task_row, _fast_task_row, _deep_task_row)
        tasks = _frame(task_rows, TASK_FIELDS, "batch_tasks")
    duplicated = tasks["task_id"].duplicated(keep="first").to_numpy()
    rejects += _rejects_for(
        tasks[duplicated], tasks_data, TASKS_FILE, "task_id", "task_id {} appears earlier in the file"
    )
    (tasks,) = _without(duplicated, tasks)
    if tasks.empty:
        detail = f" ({len(rejects)} line(s) rejected, first: {rejects[0]['message']})" if rejects else ""
        raise BatchError(f"runs/{run_id}/{TASKS_FILE} holds no valid task{detail}")
    del tasks_data  # big batches: hold one file's bytes at a time

    executions_data = executions_path.read_bytes()
    attempts = _fast_attempts(executions_data)
    if attempts is None:
        attempt_rows, attempt_rejects = _parse_lines(
            executions_data, EXECUTIONS_FILE, _attempt_row, deep_row=_deep_attempt_row
        )
        rejects += attempt_rejects
        attempts = _frame(attempt_rows, ATTEMPT_FIELDS, "batch_attempts")
    task_at = positions(attempts["task_id"], tasks["task_id"])
    orphan = task_at < 0
    rejects += _rejects_for(
        attempts[orphan],
        executions_data,
        EXECUTIONS_FILE,
        "task_id",
        "attempt of task_id {} which is not in tasks.jsonl",
    )
    attempts, task_at = _without(orphan, attempts, task_at)
    # (task, attempt) as two integers: far cheaper to compare than the task_id text
    numbers = pd.DataFrame({"task": task_at, "attempt": attempts["attempt"].to_numpy(dtype=np.int64)})
    twice = numbers.duplicated(keep="first").to_numpy()
    rejects += _rejects_for(
        attempts[twice],
        executions_data,
        EXECUTIONS_FILE,
        "attempt",
        "attempt of task_id {} appears earlier with the same number",
    )
    attempts, task_at = _without(twice, attempts, task_at)
    escaping = isin(attempts["dir"], list(dirs_outside_root(run_dir, attempts["dir"])))
    rejects += _rejects_for(
        attempts[escaping],
        executions_data,
        EXECUTIONS_FILE,
        "dir",
        "attempt of task_id {} has a dir that resolves outside the data root",
    )
    attempts, task_at = _without(escaping, attempts, task_at)

    rejects_frame = pd.DataFrame(rejects) if rejects else empty_frame("batch_rejects")
    return Batch(
        tasks=conform(tasks.assign(run_id=run_id), "batch_tasks"),
        attempts=conform(attempts.assign(run_id=run_id), "batch_attempts"),
        rejects=conform(
            rejects_frame.assign(run_id=run_id).sort_values(["file", "line"], kind="stable"), "batch_rejects"
        ),
        seconds=time.perf_counter() - started,
        task_at=task_at,
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
        _reject_row(file, int(line), field, template.format(repr(task_id)), lines[int(line) - 1])
        for task_id, line in zip(rows["task_id"], rows["line"])
    ]


COUNT_CHUNK_BYTES = 8 << 20  # count_records reads the file this much at a time, into one reused buffer


def count_records(run_dir: UPath) -> int:
    """Non-blank lines of executions.jsonl, counted afresh (what every attempt must be accounted against).

    The file is read a chunk at a time into one buffer, reused: the count runs beside other steps' work,
    and holding the whole file (hundreds of MB for a large batch) would add that much to the run's peak
    memory, while a fresh buffer per chunk would fault its pages in anew each time (about 30k page faults
    and a third of the count's time at 140 MB)."""
    records, head = 0, b""  # head: the start of a line that the previous chunk cut off
    buffer = bytearray(COUNT_CHUNK_BYTES)
    with (run_dir / EXECUTIONS_FILE).open("rb") as f:
        while size := f.readinto(buffer):
            chunk = memoryview(buffer)[:size]
            first_end = buffer.find(b"\n", 0, size)
            if first_end < 0:
                head += chunk
                continue
            records += bool((head + chunk[:first_end]).strip())
            last_end = buffer.rfind(b"\n", 0, size)
            records += _non_blank_lines(chunk[first_end + 1 : last_end + 1])
            head = bytes(chunk[last_end + 1 :])
    return records + bool(head.strip())


# the bytes bytes.strip() removes: a line that starts with none of them has content, so is not blank
_SPACE_OR_NEWLINE = np.zeros(256, dtype=bool)
_SPACE_OR_NEWLINE[list(b" \t\n\r\f\v")] = True


def _non_blank_lines(lines: memoryview) -> int:
    """Non-blank lines of `lines`, whole lines that each end with a newline."""
    # When every line starts with a byte that is neither whitespace nor a newline (what a JSON-lines writer
    # produces), none is blank and the count is the newlines: found by numpy, which compares without holding the
    # GIL (count_records runs beside a step's other work). Otherwise each line is looked at.
    view = np.frombuffer(lines, dtype=np.uint8)
    newlines, blank = 0, len(view) == 0 or bool(_SPACE_OR_NEWLINE[view[0]])
    for start, mask in _newline_slices(lines):
        newlines += int(np.count_nonzero(mask))
        following = view[start + 1 : start + 1 + len(mask)]  # the byte after each newline (none after the last)
        blank = blank or bool(_SPACE_OR_NEWLINE[following[mask[: len(following)]]].any())
    if not blank:
        return newlines
    return sum(1 for raw in bytes(lines).split(b"\n")[:-1] if raw.strip())
