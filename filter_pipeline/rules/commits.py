"""Commit records: what one walk of one run wrote, so that history is what was committed (CONTRACT §4).

After the ledger step has written every output of a run's walk (kept, surplus, the prior index and counts,
DPO pairs, the report), it writes `<data>/warehouse/_commits/<run_id>.json` in one atomic write. A run is
filtered only once that record exists; a walk killed at any point before it leaves the run pending, and its
next walk starts again from the inputs. The record names each file with its size and SHA-256, so a later
reader can tell a committed file that was deleted, rewritten or truncated from the one the walk wrote.

Pure: no Dagster; IO only through UPath/fsspec.
"""

import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, fields

from fsspec.implementations.local import LocalFileSystem
from upath import UPath

COMMITS_DIR = "_commits"  # <data>/warehouse/_commits/<run_id>.json
LEGACY_PREFIX = "legacy:"  # history entry of a legacy run: "legacy:<sha256 of its kept.jsonl>"
INPUT_FILES = ("tasks.jsonl", "executions.jsonl")
HASH_CHUNK = 8 << 20


class HistoryIntegrityError(ValueError):
    """History cannot be trusted: one line naming the file, what is wrong with it and what to do."""


@dataclass(frozen=True)
class CommitRecord:
    """What one walk of one run wrote; every field is plain JSON.

    `files`: asset -> {"path" (relative to the data root), "size", "sha256", "rows"}; `kept_keys`: distinct keys
    kept; `caps`: the caps the walk applied, `caps_source` "deployment" or "run config"; `judge`: kind, model,
    prompt_version, votes (never a key); `history`: run_id -> the SHA-256 of the commit record it read (or
    "legacy:<sha256 of kept.jsonl>"); `inputs`: tasks.jsonl / executions.jsonl -> {"size", and "sha256" +
    "mtime_ns" on local disk or "etag" on object storage}; `unjudged`: tasks left unjudged by this walk.
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
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    @property
    def digest(self) -> str:
        """SHA-256 of the record: how a later walk names the commit it read as history."""
        return hashlib.sha256(self.to_json()).hexdigest()


def commit_path(warehouse: UPath, run_id: str) -> UPath:
    return warehouse / COMMITS_DIR / f"{run_id}.json"


def _where(warehouse: UPath, path: UPath) -> str:
    """A path as the user sees it from the data root: `warehouse/_commits/r1.json`."""
    return f"{warehouse.name}/{path.parent.name}/{path.name}"


def parse_commit(data: bytes, where: str, run_id: str) -> CommitRecord:
    """The commit record in `data` (the file `where` names); HistoryIntegrityError if it is not one."""
    redo = f"delete it and re-filter {run_id} with `filter-pipeline materialize {run_id}`"
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


def read_commits(warehouse: UPath) -> dict[str, CommitRecord]:
    """Every committed run: run_id -> its record. Raises HistoryIntegrityError on a record that is not one."""
    folder = warehouse / COMMITS_DIR
    if not folder.exists():
        return {}
    found = {}
    for path in folder.iterdir():
        if not path.name.endswith(".json") or path.name.startswith("."):
            continue  # (temp files of a write in progress start with a dot)
        run_id = path.name.removesuffix(".json")
        found[run_id] = parse_commit(path.read_bytes(), _where(warehouse, path), run_id)
    return dict(sorted(found.items()))


def write_commit(warehouse: UPath, record: CommitRecord) -> None:
    """Write the record atomically: readers see no record or the whole of it, never part."""
    atomic_write(commit_path(warehouse, record.run_id), record.to_json())


def delete_commit(warehouse: UPath, run_id: str) -> None:
    """Forget that `run_id` was filtered (before its walk is redone): it is pending until committed again."""
    path = commit_path(warehouse, run_id)
    if path.exists():
        path.unlink()


# --- writing and fingerprinting files ---------------------------------------------------------------

HOST = socket.gethostname()
STALE_TEMP_SECONDS = 3600


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(folder: str, prefix: str) -> None:
    """Temp files a killed earlier write of the same target left: its writer ran on this host and is gone,
    or nobody touched the file for STALE_TEMP_SECONDS (a live writer's file is left alone)."""
    for name in os.listdir(folder):
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        host, _, rest = name[len(prefix) :].partition(".")
        pid = rest.partition(".")[0]
        path = os.path.join(folder, name)
        try:
            dead = host == HOST and pid.isdigit() and not _alive(int(pid))
            if dead or time.time() - os.stat(path).st_mtime > STALE_TEMP_SECONDS:
                os.unlink(path)
        except FileNotFoundError:
            pass


def atomic_write(path: UPath, data) -> None:
    """Write `data` to `path` so that readers see the old content or the new, never a part. Local disk:
    `replace_locally`, the folder fsynced too so the rename survives a crash. Object stores make a single PUT
    visible atomically."""
    if not isinstance(path.fs, LocalFileSystem):  # (`data`: bytes or any buffer, e.g. an Arrow buffer)
        path.fs.pipe_file(path.path, data if isinstance(data, bytes) else memoryview(data).tobytes())
        return
    replace_locally(path.path, lambda f: f.write(data), sync_folder=True)


def replace_locally(target: str, write, sync_folder: bool) -> os.stat_result:
    """Call `write(file)` on a hidden temp file beside the local file `target` (named after this host and
    pid, so a later write can tell a dead writer's file from a live one's; temp files a killed earlier write
    left are removed first), fsync it and rename it over `target`; with `sync_folder`, fsync the folder as
    well. Returns the temp file's stat, taken before the rename (which keeps size and mtime), so another
    process's write right after cannot be mistaken for this one."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    prefix = f".{os.path.basename(target)}."
    remove_stale_temps(folder, prefix)
    tmp = os.path.join(folder, f"{prefix}{HOST}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        written = os.stat(tmp)
        os.replace(tmp, target)
        if sync_folder:
            descriptor = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        return written
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def sha256_of(path: UPath) -> str:
    """SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def input_fingerprint(path: UPath) -> dict:
    """What tells a later reader whether an input file changed: size and SHA-256 (and mtime_ns, so an
    unchanged file need not be hashed again) on local disk; size and ETag on object storage."""
    if isinstance(path.fs, LocalFileSystem):
        stat = os.stat(path.path)
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_of(path)}
    info = path.fs.info(path.path)
    return {"size": int(info.get("size") or 0), "etag": str(info.get("ETag") or info.get("etag") or "").strip('"')}


def input_fingerprints(run_dir: UPath) -> dict[str, dict]:
    """`input_fingerprint` of each input file of the batch that exists."""
    return {name: input_fingerprint(run_dir / name) for name in INPUT_FILES if (run_dir / name).exists()}


def inputs_changed(run_dir: UPath, recorded: dict[str, dict]) -> list[str]:
    """The input files of a batch that differ from what its commit recorded (missing ones included). On local
    disk a file with the recorded size and mtime is taken as unchanged; one whose mtime moved is hashed."""
    changed = []
    for name in sorted(set(INPUT_FILES) | set(recorded)):
        path, then = run_dir / name, recorded.get(name)
        if then is None:
            continue  # (a file the commit did not know of: a producer's extra, not an input)
        if not path.exists():
            changed.append(name)
            continue
        if isinstance(path.fs, LocalFileSystem):
            stat = os.stat(path.path)
            if stat.st_size != then.get("size"):
                changed.append(name)
            elif stat.st_mtime_ns != then.get("mtime_ns") and sha256_of(path) != then.get("sha256"):
                changed.append(name)
            continue
        now = input_fingerprint(path)
        if now["size"] != then.get("size") or (then.get("etag") and now["etag"] != then.get("etag")):
            changed.append(name)
    return changed


def file_entry(data_root: UPath, path: UPath, data, rows: int) -> dict:
    """A commit's entry for a file written with `data` (bytes or a buffer; path relative to the data root)."""
    view = memoryview(data)
    return {
        "path": relative(data_root, path),
        "size": view.nbytes,
        "sha256": hashlib.sha256(view).hexdigest(),
        "rows": rows,
    }


def relative(data_root: UPath, path: UPath) -> str:
    root = data_root.path.rstrip("/")
    return path.path[len(root) + 1 :] if path.path.startswith(root + "/") else path.path
