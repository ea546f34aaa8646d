"""One record of an execution batch, checked: the row it gives, or a Reject saying which field is wrong and how.

These checks define what a valid record is and the message of every reject (`batch` applies them line by
line wherever Arrow's reader cannot take a file whole). A record that is valid JSON can still be no use as
data: a lone surrogate escape (`"\\ud800"`, not text: Parquet cannot store it) in a field a row keeps but
free text (an instruction, an error, a backend detail: text cut mid-emoji, which keeps U+FFFD in its place); an
integer with more digits than Python converts (`sys.get_int_max_str_digits()`, 4,300 by default) in a field a
row keeps or reads; a dedup_key holding NaN or Infinity (or 1e400, which reads as Infinity); an attempt number
beyond 64 bits. Anywhere else (an extra field, a step's page text) neither harms anything, and is let be.
"""

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from filter_pipeline.rules.schemas import RAW_MAX_CHARS, canonical_key, key_hash

MAX_LINE_BYTES = 1 << 20  # a record this long is a harness bug, not a trajectory


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


class Reject(Exception):
    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


TOO_DEEP = "line nests arrays or objects deeper than a JSON reader follows"


class TooDeep(Reject):
    """A line nested deeper than json.loads follows (which Arrow's reader reads: `batch._read_lines`)."""


def _require(record: dict, field: str, check: Callable[[Any], bool], expected: str) -> Any:
    if field not in record:
        raise Reject(field, f"missing field {field!r} (expected {expected})")
    value = record[field]
    if not check(value):
        raise Reject(field, f"field {field!r} is {_describe(value)}, expected {expected}")
    return value


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    try:
        shown = json.dumps(value)[:60]
    except RecursionError:  # (orjson reads a little deeper than json writes)
        shown = "nested too deep to show"
    return f"a {type(value).__name__} ({shown})"


def _finite(key: list) -> bool:
    """Whether no part of the key is NaN or Infinity (JSON has neither; 1e400 reads as Infinity)."""
    return all(math.isfinite(part) for part in key if type(part) is float)


_NOT_FINITE = "field 'dedup_key' holds NaN or Infinity (or a number too large for a float, such as 1e400), which JSON has no text for"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# The characters str.isspace() (and Python's `\s`) takes as whitespace, written out for RE2 (Arrow's regex
# engine), whose `\s` holds only ASCII ones.
WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
UNSAFE_DIR = r"^(/|\\|[A-Za-z]:)|://|(^|[/\\])\.\.([/\\]|$)|^[" + WHITESPACE + r"]*$"
# the same pattern for RE2, where `$` is the very end of the text only (Python's is also before a final newline)
UNSAFE_DIR_RE2 = UNSAFE_DIR.replace("$", r"\n?$")


def unsafe_dir_reason(path: str) -> str | None:
    """Why a trajectory `dir` may not be read (absolute, a URL, or climbing with '..'), or None."""
    if not re.search(UNSAFE_DIR, path):
        return None
    if not path.strip():
        return "must not be empty"
    if ".." in re.split(r"[\\/]", path):
        return "must not contain '..'"
    return "must be relative to the data root"


# --- per-record parsers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fields:
    """Where in a record of one line kind a value matters, as dotted names (`start.kind`): `stored`, the fields
    whose text a row keeps (the field and anything inside it); `read`, the fields whose value alone a row reads
    (of `steps`, only its length: not what is inside); `prose`, the stored fields of free text, where a lone
    surrogate (text cut mid-emoji, as a harness cutting a message in UTF-16 writes it) becomes U+FFFD rather
    than rejecting the record: an identifier holding one is no text, a message holding one is still a message."""

    stored: tuple[str, ...]
    read: tuple[str, ...] = ()
    prose: tuple[str, ...] = ()

    def keeps(self, parts: list) -> bool:
        """Whether the field at `parts` (a path, as `_first` gives it) is stored or inside a stored one."""
        return any(parts[: len(names)] == names for names in (name.split(".") for name in self.stored))

    def keeps_exact_text(self, parts: list) -> bool:
        """Whether the field at `parts` is stored and must be text as it is (not prose)."""
        return self.keeps(parts) and parts not in [name.split(".") for name in self.prose]

    def uses(self, parts: list) -> bool:
        """Whether the row keeps or reads the value at `parts`."""
        return self.keeps(parts) or any(parts == name.split(".") for name in self.read)


TASK_FIELDS = ("task_id", "macro", "site", "dedup_key", "key_hash", "start_kind", "instruction")
TASK_LINE = Fields(
    stored=("task_id", "macro", "site", "dedup_key", "start.kind", "instruction"),
    read=("start",),
    prose=("instruction",),
)


_SCALARS = (str, int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)


def task_row(record: dict) -> tuple:
    """The task row of a record: (task_id, macro, site, canonical key text, its hash, start kind, instruction);
    raises Reject naming the first field that is wrong."""
    row = _clean_task_row(record)
    return row if row is not None else _checked_task_row(record)


def _clean_task_row(record: dict) -> tuple | None:
    """The task row when every field has its type, else None (then `_checked_task_row` says which does not):
    the usual record costs a few type tests instead of one check per field."""
    try:
        task_id, macro, site = record["task_id"], record["macro"], record["site"]
        instruction, key, kind = record["instruction"], record["dedup_key"], record["start"]["kind"]
    except (KeyError, TypeError, IndexError):
        return None
    if not (
        type(task_id) is str and task_id and type(macro) is str and type(site) is str
        and type(instruction) is str and type(kind) is str and type(record["start"]) is dict
    ):  # fmt: skip
        return None
    text = clean_key(key)
    return None if text is None else (task_id, macro, site, text, key_hash(text), kind, as_text(instruction))


def clean_key(key: Any) -> str | None:
    """The canonical text of a dedup_key that is an array of finite scalars, else None (the record checks
    then say what is wrong with it)."""
    if type(key) is not list:
        return None
    types = set(map(type, key))  # (the set's test is one pass in C, not a generator per record)
    if not types <= _SCALAR_TYPES or (float in types and not _finite(key)):
        return None
    return key_text(key, float in types)


def key_text(key: list, has_float: bool | None = None) -> str:
    """`canonical_key(key)`, written by orjson where it writes the same text as json.dumps: for strings,
    integers within 64 bits, booleans and null, but not for floats (1e16 is `1e16` to orjson, `1e+16` to
    json), so a key with a float is written by json. `has_float`: whether the key holds a float, when the
    caller knows."""
    if not (float in map(type, key) if has_float is None else has_float):
        try:
            # (decoded at once: each of orjson's results holds about a page of memory for as long as it lives)
            return orjson.dumps(key).decode()
        except orjson.JSONEncodeError:  # an integer beyond 64 bits
            pass
    return canonical_key(key)


def _checked_task_row(record: dict) -> tuple:
    task_id = _require(record, "task_id", lambda v: _is_str(v) and v != "", "a non-empty string")
    macro = _require(record, "macro", _is_str, "a string")
    site = _require(record, "site", _is_str, "a string")
    instruction = _require(record, "instruction", _is_str, "a string")
    key = _require(record, "dedup_key", lambda v: isinstance(v, list), "a JSON array")
    if not all(_is_scalar(part) for part in key):
        raise Reject("dedup_key", "field 'dedup_key' must be an array of scalars (no arrays or objects)")
    if not _finite(key):
        raise Reject("dedup_key", _NOT_FINITE)
    start = _require(record, "start", lambda v: isinstance(v, dict), "an object with 'kind'")
    if not _is_str(start.get("kind")):
        raise Reject("start.kind", f"field 'start.kind' is {_describe(start.get('kind'))}, expected a string")
    text = key_text(key)
    return (task_id, macro, site, text, key_hash(text), start["kind"], as_text(instruction))


ATTEMPT_FIELDS = ("task_id", "attempt", "ok", "error", "dir", "n_actions", "backend_ok", "backend_detail")
ATTEMPT_LINE = Fields(
    stored=("task_id", "error", "dir", "backend.detail"),
    read=("attempt", "ok", "steps", "backend", "backend.ok"),
    prose=("error", "backend.detail"),
)


def attempt_row(record: dict) -> tuple:
    task_id = _require(record, "task_id", lambda v: _is_str(v) and v != "", "a non-empty string")
    attempt = _require(record, "attempt", _is_int, "an integer")
    if not INT64_MIN <= attempt <= INT64_MAX:
        raise Reject("attempt", f"field 'attempt' is {_describe(attempt)}, expected an integer within 64 bits")
    ok = _require(record, "ok", _is_bool, "true or false")
    error = record.get("error")
    if not (error is None or _is_str(error)):
        raise Reject("error", f"field 'error' is {_describe(error)}, expected a string or null")
    path = _require(record, "dir", _is_str, "a path relative to the data root")
    if reason := unsafe_dir_reason(path):
        raise Reject("dir", f"field 'dir' {path!r} {reason}")
    steps = _require(record, "steps", lambda v: isinstance(v, list), "an array")
    backend = record.get("backend")
    if not (backend is None or isinstance(backend, dict)):
        raise Reject("backend", f"field 'backend' is {_describe(backend)}, expected an object or null")
    backend = backend or {}
    backend_ok = backend.get("ok")
    if not (backend_ok is None or _is_bool(backend_ok)):
        raise Reject("backend.ok", f"field 'backend.ok' is {_describe(backend_ok)}, expected true or false")
    detail = backend.get("detail")
    if not (detail is None or _is_str(detail)):
        raise Reject("backend.detail", f"field 'backend.detail' is {_describe(detail)}, expected a string")
    return (task_id, attempt, ok, json_text(error), path, len(steps), bool(backend_ok), json_text(detail))


# a JSON escape of a UTF-16 surrogate: half of a pair (an emoji, as json.dumps writes it) or a lone one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


_DIGITS = bytes(ord("1") if chr(byte).isdigit() and byte < 128 else ord("0") for byte in range(256))
# orjson reads an integer beyond 64 bits as a float where json keeps it whole (it has at least 19 digits)
ORJSON_DIGITS = 19


def has_digit_run(data: bytes, length: int) -> bool:
    """Whether `data` holds `length` or more ASCII digits in a row (in a number or a string)."""
    return b"1" * length in data.translate(_DIGITS)


def load_record(raw: bytes, long_numbers: bool = True, fields: Fields | None = None) -> dict:
    """The line as a JSON object whose every string a row keeps is text and every integer it uses is one
    Python converts; raises Reject saying why not (too long, not UTF-8, not JSON, nested too deep, an integer
    too long, a lone surrogate, not an object).

    orjson reads the line first: it takes only strict UTF-8 JSON without lone surrogates, NaN or Infinity,
    which json reads to the same values. Any line it refuses (or that is not an object) is read by json,
    so what json accepts and the rejects' messages stay the same; so is a line with a run of 19 or more
    digits (`long_numbers`: whether the line may hold one; False when its whole file was checked).
    `fields`: where a value matters (None: everywhere). A lone surrogate rejects the record only in a field
    it stores but prose (where the row function replaces it), an integer too long for Python only in one it
    stores or reads: elsewhere, as in an action's
    page text cut mid-emoji, neither harms anything (such an integer stays in the record as a `LongInteger`)."""
    if len(raw) > MAX_LINE_BYTES:
        raise Reject(None, f"line is {len(raw):,} bytes, longer than the {MAX_LINE_BYTES:,}-byte limit")
    if not (long_numbers and has_digit_run(raw, ORJSON_DIGITS)):
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # read again by json below, which accepts or rejects the line as it always has
        else:
            if isinstance(record, dict):
                return record
    return _load_checked(raw, fields)


def _load_checked(raw: bytes, fields: Fields | None = None) -> dict:
    """`load_record` by Python's json, whose acceptance and messages define a valid line."""
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
    except UnicodeDecodeError as exc:
        raise Reject(None, f"line is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Reject(None, f"line is not JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError:  # the only other one json raises: an integer beyond Python's int-string limit
        record = _with_long_integers(text, fields)
    except RecursionError:
        raise TooDeep(None, TOO_DEEP) from None
    if not isinstance(record, dict):
        raise Reject(None, f"line is a JSON {type(record).__name__}, expected an object")
    if _SURROGATE_ESCAPE.search(raw) and not _all_text(record):
        found = _first(record, _lone_surrogate, where=lambda parts: fields is None or fields.keeps_exact_text(parts))
        if found is not None:
            field, char = found
            raise Reject(field, f"field {field!r} holds a lone surrogate (\\u{ord(char):04x}), which is not text")
    return record


def _all_text(record: dict) -> bool:
    """Whether every string of the record encodes as UTF-8 (one pass in C; `_first` then says where not)."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return False
    return True


# a UTF-16 surrogate alone in a decoded string (json.loads joins the two halves of a pair into one character)
_LONE_SURROGATE_CHAR = re.compile("[\ud800-\udfff]")


def as_text(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD: what UTF-8 (a request body, a page, a terminal)
    carries. Page text cut mid-emoji reads as a lone surrogate; strict servers refuse a body holding one."""
    return text if text.isascii() else _LONE_SURROGATE_CHAR.sub("\ufffd", text)


def json_text(value: Any) -> str | None:
    """A decoded JSON value as UTF-8 can carry it (`as_text`) when it is a string, else None: how free text
    (an instruction, an error, a note, a reason) is kept, where a lone surrogate is no reason to lose the row."""
    return as_text(value) if isinstance(value, str) else None


def is_text(value: Any) -> bool:
    """Whether `value` is a string UTF-8 (hence Parquet) can carry: JSON's `"\\ud83d"` escape decodes to a lone
    surrogate, which it cannot."""
    return isinstance(value, str) and _lone_surrogate(value) is None


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate of a string value (which UTF-8, hence Parquet, cannot hold), or None."""
    if type(value) is not str or value.isascii():
        return None
    found = _LONE_SURROGATE_CHAR.search(value)
    return found.group() if found else None


class LongInteger(str):
    """An integer literal with more digits than Python converts, kept as its text (`str(value)` shows it)."""

    @property
    def digits(self) -> int:
        return len(self) - self.startswith("-")


def _int_or_literal(literal: str) -> int | LongInteger:
    limit = sys.get_int_max_str_digits()
    return LongInteger(literal) if limit and len(literal) - literal.startswith("-") > limit else int(literal)


def read_json(data: str | bytes) -> Any:
    """json.loads, except that an integer with more digits than Python converts is kept as its literal text
    (a `LongInteger`, a str) instead of failing the whole document: for what is only shown, as a step in the
    judge's prompt or on the review page. A document nested deeper than json follows raises a ValueError
    (`TOO_DEEP`), as any other it cannot read, not a RecursionError."""
    try:
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise
        except ValueError:  # (json's only other error: such an integer)
            return json.loads(data, parse_int=_int_or_literal)
    except RecursionError:
        raise ValueError(TOO_DEEP.replace("line", "document", 1)) from None


def _with_long_integers(text: str, fields: Fields | None) -> Any:
    """The line read with each integer too long for Python as a `LongInteger`; raises Reject when one is in a
    field the row uses (`fields`; None: any), or the line is no JSON object."""
    limit = sys.get_int_max_str_digits()
    try:
        record = json.loads(text, parse_int=_int_or_literal)
    except RecursionError:  # (as `_load_checked`'s: a line too deep, whatever else it holds)
        raise TooDeep(None, TOO_DEEP) from None
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise Reject(
            None, f"line holds an integer of more than {limit:,} digits, more than Python converts to a number"
        )
    used = (lambda parts: True) if fields is None else fields.uses
    found = _first(record, lambda v: v if isinstance(v, LongInteger) else None, where=used)
    if found is not None:
        field, number = found
        raise Reject(
            field,
            f"field {field!r} holds an integer of {number.digits:,} digits, more than the {limit:,} Python converts to a number",
        )
    return record


def _first(
    record: dict, problem: Callable[[Any], Any], where: Callable[[list], bool] = lambda parts: True
) -> tuple[str, Any] | None:
    """(where, what `problem` found) for the first key or value anywhere in the record, however deep, for
    which `problem` returns something other than None and `where(its path's parts)` is true (the parts: keys
    and list indexes, as ["steps", 2, "text"]; where: the path as text, as `steps[2].text`); None if there is
    none. Iterative: a record as deep as json.loads reads would exhaust the recursion limit."""
    # a path is (its parent's path, its last part), so that going one level deeper costs one pair
    stack: list[tuple[tuple, Any]] = [((None, key), value) for key, value in reversed(record.items())]
    stack += [((None, key), key) for key in reversed(record)]  # the field names first
    while stack:
        path, item = stack.pop()
        if (found := problem(item)) is not None and where(parts := _parts(path)):
            return _path_text(parts), found
        if isinstance(item, dict):
            stack += [((path, key), value) for key, value in reversed(item.items())]
            stack += [((path, key), key) for key in reversed(item)]
        elif isinstance(item, list):
            stack += [((path, i), value) for i, value in reversed(list(enumerate(item)))]
    return None


def _parts(path: tuple) -> list:
    parts = []
    while path is not None:
        path, part = path
        parts.append(part)
    return parts[::-1]


def _path_text(parts: list) -> str:
    return str(parts[0]) + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts[1:])


def reject_row(file: str, line: int, field: str | None, message: str, raw: bytes) -> dict:
    return {
        "file": file,
        "line": line,
        # a field is named by the record, so its name may itself hold a lone surrogate: escaped, to stay text
        "field": None if field is None else field.encode("utf-8", "backslashreplace").decode("utf-8"),
        "message": f"{file}:{line}: {message}",
        "raw": raw[: RAW_MAX_CHARS * 4].decode("utf-8", errors="replace")[:RAW_MAX_CHARS],
    }
