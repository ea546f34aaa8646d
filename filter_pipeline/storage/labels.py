"""Appending human labels to `<data>/labels.jsonl`, safely when several people label at once.

One label is one JSON line (docs/contract.md, labels.jsonl): `{"dir": ..., "success": true | false | null,
"note": ..., "labeler": ..., "labeled_at": "2026-12-03T21:00:00Z"}`; a later line for the same attempt
replaces an earlier one.

- Local disk: the line is written with one `write` on a file opened `O_APPEND`, under an exclusive OS lock
  (`fcntl.flock`) on the file itself, so two writers' lines never interleave or overwrite each other.
- Object storage (s3://), which cannot append: read the object and its ETag, write it back with the new line
  on condition that it is unchanged (`If-Match: <ETag>`; `If-None-Match: *` when it does not exist yet), and
  start again when another writer got there first (412 Precondition Failed).
"""

import fcntl
import json
import os
import random
import time
from datetime import UTC, datetime

from upath import UPath

from filter_pipeline.rules.calibration import LABELS_FILE
from filter_pipeline.storage.files import etag, is_local, read_if_present, store_refusal

MAX_TRIES = 50  # conditional writes lost to other writers before giving up on object storage


class LabelWriteError(OSError):
    """The label could not be written: one line saying why."""


def read_labels(data_root: UPath) -> bytes | None:
    """The labels file's bytes; None when there is none. ValueError, in one line, when it exists but cannot be
    read (a folder, no permission)."""
    return read_if_present(data_root / LABELS_FILE)


def now_iso() -> str:
    """The current time as ISO-8601 UTC to the second, e.g. 2026-12-03T21:00:00Z."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def label_line(record: dict) -> bytes:
    """The record as one labels.jsonl line (compact JSON, UTF-8, ending in a newline)."""
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def append_label(data_root: UPath, record: dict) -> None:
    """Append `record` as one line to `<data_root>/labels.jsonl`; LabelWriteError when it cannot be."""
    line = label_line(record)
    path = data_root / LABELS_FILE
    if is_local(path):
        try:
            _append_locally(path.path, line)
        except LabelWriteError:
            raise
        except OSError as exc:  # (a folder in its place, no permission, a full or read-only disk)
            raise LabelWriteError(f"{path.path}: the label could not be written ({exc.strerror or exc})") from None
    else:
        _append_conditionally(path.fs, path.path, line)


def _after(current_end: bytes, line: bytes) -> bytes:
    """`line` as appended after a file ending in `current_end`: on a line of its own even when a hand-edited
    file lacks its final newline (else the two would read as one line that is not JSON, and both be lost)."""
    return line if current_end in (b"", b"\n") else b"\n" + line


def _append_locally(path: str, line: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            line = _after(os.pread(fd, 1, size - 1) if size else b"", line)
            written = os.write(fd, line)
            if written != len(line):
                raise LabelWriteError(f"{path}: wrote {written} of {len(line)} bytes of a label")
            os.fsync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _append_conditionally(fs, path: str, line: bytes) -> None:
    for attempt in range(MAX_TRIES):
        try:
            info = fs.info(path, refresh=True)
        except FileNotFoundError:
            info = None
        try:
            if info is None:
                fs.pipe_file(path, line, mode="create")  # If-None-Match: *
            else:
                current = fs.cat_file(path)
                fs.pipe_file(path, current + _after(current[-1:], line), IfMatch=etag(info))
            fs.invalidate_cache(path)
            return
        except (FileExistsError, FileNotFoundError, OSError) as exc:
            # (creating: a missing folder or bucket is not a race; rewriting: the object deleted meanwhile is)
            if not _lost_race(exc) or (info is None and isinstance(exc, FileNotFoundError)):
                raise LabelWriteError(f"{path}: the label could not be written ({exc})") from None
        time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))  # another writer won: read again
    raise LabelWriteError(f"{path}: the label lost {MAX_TRIES} conditional writes to other writers; try again")


def _lost_race(exc: Exception) -> bool:
    """Whether a failed conditional write means another writer changed (or removed) the object first
    (`files.store_refusal`), not a network or permission error."""
    return isinstance(exc, FileNotFoundError) or store_refusal(exc) is not None
