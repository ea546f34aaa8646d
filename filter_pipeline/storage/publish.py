"""A walk's files staged, then published by one conditional write of its commit record (CONTRACT §4).

A walk writes each file under a folder of its own, `warehouse/_staging/<run_id>.<walk>/`, mirroring where the
file belongs (`warehouse/kept/<run_id>.parquet` is staged as `.../warehouse/kept/<run_id>.parquet`). Nothing in
the folders users read changes while it walks. It then writes, next to its staged files, a manifest naming the
record it publishes and the moves, and publishes: the commit record `warehouse/_commits/<run_id>.json` is
written only if it is still what the walk read when it took the lease.

- Object storage: one PUT with `If-None-Match: *` (the run had no record) or `If-Match: <ETag read>` (a re-walk).
  A walk that stalled past its lease while another committed the run is refused by the store itself, however
  long it stalled and wherever it stalled.
- Local disk (and fsspec's memory store): the lease is an OS lock held for the whole walk, so no other walk
  writes meanwhile; the record read back is compared with the one read at the start, then replaced atomically.

Once the record stands, the staged files are moved into place (a rename on local disk, a server-side copy on
object storage) and the staging folder is removed. A kill between the publish and the last move is completed by
the next walk (`complete_published`, run under the lease before anything else). A walk whose publish is refused
removes its own staging folder only; one whose publish got no answer leaves it to later walks, which complete it
if the record stands, else remove it once its walk is gone (`_abandoned`) and, on object storage, a PUT it sent
can no longer land (`_publish_may_land`). A commit record is never deleted: a re-walk replaces it.
"""

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from upath import UPath

from filter_pipeline.rules.commits import COMMITS_DIR, CommitRecord, commit_name
from filter_pipeline.settings import VERIFY_COMMAND, materialize_command
from filter_pipeline.storage.files import (
    ABANDONED_AFTER_SECONDS,
    PRECONDITION,
    WAREHOUSE_DIR,
    atomic_write,
    etag,
    fsync_folder,
    is_local,
    is_object_store,
    name_head,
    sha256_of,
    store_refusal,
    writer_gone,
    writer_named,
)
from filter_pipeline.storage.lease import LeaseLost

STAGING_DIR = "_staging"  # warehouse/_staging/<run_id>.<writer>.<pid>.<hex>/ (`files.writer_named`)
MANIFEST = "_publish.json"
# fault injection for the tests of stalls and kills: "<point>:<file>" makes the walk write its pid to <file> and
# stop itself (SIGSTOP) at <point>; the test resumes it (SIGCONT) or kills it
PAUSE_ENV = "FILTER_PIPELINE_PAUSE_AT"
# AWS answers 409 to a conditional write while another one on the same key is in flight: try again, briefly
CONFLICT_TRIES, CONFLICT_PAUSE_SECONDS = 4, 0.25


def walked_now() -> str:
    """A commit's walked_at for a walk committing now: ISO 8601 in UTC, to the microsecond (a re-walk launched
    in the same second as the commit before it must still be told apart from it)."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def commit_path(warehouse: UPath, run_id: str) -> UPath:
    return warehouse / COMMITS_DIR / commit_name(run_id)


def relative(data_root: UPath, path: UPath) -> str:
    """`path` relative to the data root, as commit records name files."""
    root = data_root.path.rstrip("/")
    return path.path[len(root) + 1 :] if path.path.startswith(root + "/") else path.path


def file_entry(data_root: UPath, path: UPath, data, rows: int) -> dict:
    """A commit's entry for a file written with `data` (bytes or a buffer; path relative to the data root)."""
    view = memoryview(data)
    return {
        "path": relative(data_root, path),
        "size": view.nbytes,
        "sha256": hashlib.sha256(view).hexdigest(),
        "rows": rows,
    }


class PublishIncomplete(Exception):
    """A published walk's files could not all be moved into place: its commit record names a file that is not
    there; str(): one line naming them and what to do."""


class PublishSuperseded(Exception):
    """The walk's commit was published, then replaced by another walk's before this one finished moving its
    files (it stalled past its lease): the commit and files in place are that walk's; str(): one line."""


class PublishOverlapped(Exception):
    """The walk's commit was published, but another walk committed another run after this one read its history
    (it stalled past its lease): neither counted the other; str(): one line saying what to check."""


class PublishRefused(Exception):
    """The walk's commit was not published (another walk committed the run meanwhile, or its lease was lost);
    str(): one line saying so and that its staged files were removed."""


def pause_point(point: str) -> None:
    """Stop this process here when PAUSE_ENV names `point` (tests reproduce a stalled or killed walk with it)."""
    named, _, marker = os.environ.get(PAUSE_ENV, "").partition(":")
    if named != point:
        return
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


@dataclass(frozen=True)
class CommitState:
    """A run's commit record as a walk read it when it took the lease: absent (version None), or its version
    (its ETag on object storage, the SHA-256 of its bytes elsewhere)."""

    run_id: str
    version: str | None

    @property
    def exists(self) -> bool:
        return self.version is not None


def commit_state(warehouse: UPath, run_id: str) -> CommitState:
    """What `warehouse/_commits/<run_id>.json` is now (read fresh, no listing cache)."""
    path = commit_path(warehouse, run_id)
    try:
        if is_object_store(path):
            path.fs.invalidate_cache(path.path)
            info = path.fs.info(path.path)
            return CommitState(run_id, etag(info))
        return CommitState(run_id, hashlib.sha256(path.read_bytes()).hexdigest())
    except FileNotFoundError:
        return CommitState(run_id, None)


def write_commit(warehouse: UPath, record: CommitRecord) -> None:
    """Write a record unconditionally (atomically): for building warehouses by hand, as tests and benchmarks do.
    A walk publishes through `StagedWalk.publish`."""
    atomic_write(commit_path(warehouse, record.run_id), record.to_json())


def _put_commit(warehouse: UPath, record: CommitRecord, read: CommitState) -> str | None:
    """Write the record if the run's record is still `read`; None when written, else why not."""
    path, data = commit_path(warehouse, record.run_id), record.to_json()
    if not is_object_store(path):
        # under the OS lock (or the process lock): nobody else writes between this read and the rename
        if commit_state(warehouse, record.run_id) != read:
            return "its commit record changed since this walk took the lease"
        atomic_write(path, data)
        return None
    condition = {"IfMatch": read.version} if read.exists else {"mode": "create"}
    try:
        for attempt in range(CONFLICT_TRIES):
            if attempt:
                time.sleep(CONFLICT_PAUSE_SECONDS * 2 ** (attempt - 1))  # another write was in flight: it decides
            try:
                path.fs.pipe_file(path.path, data, **condition)
                return None
            except Exception as exc:  # (botocore's connection errors are not OSErrors)
                if _written(path, data):
                    return None  # written, its reply lost (a retried PUT finds its own record)
                refusal = store_refusal(exc) if isinstance(exc, OSError) else None
                if refusal is None:
                    raise
                if refusal == PRECONDITION:
                    return (
                        "another walk committed it after this walk took the lease (the store refused the conditional "
                        "write)"
                    )
        return "another write of its commit record was in flight each time it tried (the store answered 409)"
    finally:
        path.fs.invalidate_cache(path.path)


def _written(path: UPath, data: bytes) -> bool:
    try:
        return path.fs.cat_file(path.path) == data
    except FileNotFoundError:
        return False


class StagedWalk:
    """The files of one run's walk, staged under a folder of its own until `publish`."""

    def __init__(self, data_root: UPath, read: CommitState):
        self.data_root, self.read = data_root, read
        self.folder = data_root / WAREHOUSE_DIR / STAGING_DIR / writer_named(read.run_id)
        self.moves: dict[str, str] = {}  # staged path -> final path, both relative to the data root
        self.published = False
        self.unsettled = False

    def write(self, final: UPath, data, rows: int) -> dict:
        """Stage `data` for the file `final`; its commit entry (which names `final`, where it will be)."""
        where = relative(self.data_root, final)
        staged = self.folder / where
        atomic_write(staged, data)
        self.moves[relative(self.data_root, staged)] = where
        return file_entry(self.data_root, final, data, rows)

    def publish(self, record: CommitRecord, still_held: Callable[[], None]) -> None:
        """Publish `record` (conditional on the record read at the lease), then move the staged files into
        place. `still_held` raises when the lease is known lost. Raises PublishRefused (its staged files removed)
        when the record is not written; any other exception leaves them for the next launcher, which moves them
        into place if the record stands after all (`complete_published`), else removes them."""
        sha256 = {entry["path"]: entry["sha256"] for entry in record.files.values()}
        manifest = {"run_id": record.run_id, "digest": record.digest, "moves": self.moves, "sha256": sha256}
        atomic_write(self.folder / MANIFEST, json.dumps(manifest, sort_keys=True).encode())
        try:
            still_held()
            pause_point("before_publish")
            why = self._staged_files_gone()
            if why is None:
                # until the store answers, the record may stand (a PUT interrupted, or with its reply lost, may
                # still be applied): the staged files stay for the next launcher unless the answer is known
                self.unsettled = True
                why = _put_commit(self.data_root / WAREHOUSE_DIR, record, self.read)
                self.published = why is None  # (before unsettled is cleared: an interrupt may come between)
                self.unsettled = False
        except LeaseLost as exc:
            why = str(exc)
        if why is not None:
            self.discard()
            raise PublishRefused(
                f"{record.run_id}: this walk was not published ({why}); it removed its own staged files only, "
                "the commit that stands and its files are untouched"
            )
        pause_point("published")
        _move_all(self.data_root, self.folder, manifest)
        if _standing_digest(self.data_root / WAREHOUSE_DIR, record.run_id) != record.digest:
            raise PublishSuperseded(
                f"{record.run_id}: this walk's commit was replaced by another walk's before it had moved its files "
                "into place (it stalled past its lease): the commit standing is that walk's, and this walk's "
                f"figures describe none of it (`{VERIFY_COMMAND}` checks its files)"
            )

    def _staged_files_gone(self) -> str | None:
        """Why not to publish when a staged file is gone: a record naming it could not be completed."""
        if not is_local(self.folder):
            self.folder.fs.invalidate_cache(self.folder.path)
        gone = [final for staged, final in self.moves.items() if not (self.data_root / staged).exists()]
        if not gone:
            return None
        return (
            f"its staged files ({', '.join(gone)}) were removed while it stalled: another launcher took them for "
            f"abandoned after {ABANDONED_AFTER_SECONDS} s"
        )

    def discard(self) -> None:
        """Remove this walk's staging folder (and nothing else), unless it was published, or its publish ended
        with its outcome unknown: then it is the next launcher's to complete or remove."""
        if not self.published and not self.unsettled:
            _remove(self.folder)


def _remove(folder: UPath) -> None:
    try:
        folder.fs.rm(folder.path, recursive=True)
    except FileNotFoundError:
        pass


def _move_all(data_root: UPath, folder: UPath, manifest: dict) -> None:
    """Move each staged file of a published walk into place (one already moved is skipped), then remove the
    staging folder. Raises PublishIncomplete when a staged file is gone and the file in place is not the one
    committed (`manifest["sha256"]`: path -> SHA-256; a manifest without it is not checked)."""
    missing = []
    for staged, final in manifest["moves"].items():
        if not _move(data_root / staged, data_root / final) and not _holds(data_root / final, manifest, final):
            missing.append(final)
    _remove(folder)
    run_id = manifest["run_id"]
    if missing and _standing_digest(data_root / WAREHOUSE_DIR, run_id) == manifest["digest"]:  # (else superseded)
        raise PublishIncomplete(
            f"{run_id}: its commit was published, but its staged files ({', '.join(missing)}) were removed before they "
            f"were moved into place (the walk stalled for longer than {ABANDONED_AFTER_SECONDS} s, and another launcher took "
            f"them for abandoned): re-filter it with `{materialize_command(run_id)}`"
        )


def _standing_digest(warehouse: UPath, run_id: str) -> str | None:
    try:
        return hashlib.sha256(commit_path(warehouse, run_id).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _holds(final: UPath, manifest: dict, where: str) -> bool:
    expected = manifest.get("sha256", {}).get(where)
    if expected is None:
        return True
    try:
        return sha256_of(final) == expected
    except FileNotFoundError:
        return False


def _move(staged: UPath, final: UPath) -> bool:
    """Move `staged` over `final`; False when there is no staged file (moved already, by the walk itself or by the
    launcher completing it, or removed)."""
    if not staged.exists():
        return False
    try:
        if is_local(staged):
            os.makedirs(os.path.dirname(final.path), exist_ok=True)
            os.replace(staged.path, final.path)
            fsync_folder(os.path.dirname(final.path))
        else:
            staged.fs.copy(staged.path, final.path)  # server-side on object storage; a PUT a reader sees whole
            staged.fs.rm(staged.path)
    except FileNotFoundError:  # (moved meanwhile by a launcher completing this publish, or removed)
        return False
    return True


def _abandoned(name: str, folder: UPath) -> bool:
    """Whether an unpublished staging folder's walk is gone: its process is (`writer_gone`), or the folder is
    older than ABANDONED_AFTER_SECONDS (a walk paused past its lease may still resume and must find its files)."""
    if writer_gone(name):
        return True
    idle = _idle_seconds(folder)
    return idle is not None and idle > ABANDONED_AFTER_SECONDS


def _publish_may_land(folder: UPath, manifest: dict | None) -> bool:
    """Whether the commit record of a gone walk that got as far as publishing (its folder holds a manifest) may
    still land, so that its staged files must stay for the record to find: on object storage, where a PUT the
    store received before the walk died can still be applied (and a walk may try its publish for minutes after
    writing its manifest), until nothing was written to the folder for ABANDONED_AFTER_SECONDS. On local disk
    the publish is a rename the dead process can no longer make."""
    if manifest is None or not is_object_store(folder):
        return False
    idle = _idle_seconds(folder)
    return idle is None or idle <= ABANDONED_AFTER_SECONDS


def _idle_seconds(folder: UPath) -> float | None:
    """Seconds since the newest file of `folder` was written (S3 "LastModified", local "mtime"); None when
    unknown."""
    try:
        found = folder.fs.find(folder.path, detail=True).values()
    except (FileNotFoundError, OSError):
        return None
    stamps = [info.get("LastModified") or info.get("mtime") for info in found]
    seconds = [s.timestamp() if hasattr(s, "timestamp") else float(s) for s in stamps if s is not None]
    return time.time() - max(seconds) if seconds else None


def _staged_walks(data_root: UPath) -> Iterator[tuple[UPath, dict | None, bool]]:
    """(folder, its manifest or None, whether its commit record stands) for each staging folder, in name order."""
    staging = data_root / WAREHOUSE_DIR / STAGING_DIR
    if not staging.exists():
        return
    for folder in sorted(staging.iterdir(), key=lambda p: p.name):
        try:
            manifest = json.loads((folder / MANIFEST).read_bytes())
        except (FileNotFoundError, ValueError):
            manifest = None
        run_id = manifest["run_id"] if manifest else name_head(folder.name)
        yield (
            folder,
            manifest,
            manifest is not None and _standing_digest(data_root / WAREHOUSE_DIR, run_id) == manifest["digest"],
        )


def incomplete_publishes(data_root: UPath) -> dict[str, tuple[UPath, bool]]:
    """run_id -> (its staging folder, whether its walk is gone) for each run whose commit record stands but whose
    files are not all moved into place yet: a walk moving them now, or one killed after its publish."""
    return {
        manifest["run_id"]: (folder, _abandoned(folder.name, folder))
        for folder, manifest, published in _staged_walks(data_root)
        if published
    }


def published_folder(data_root: UPath, run_id: str) -> UPath | None:
    """The staging folder of the walk of `run_id` whose commit record stands, while its publish is not
    complete (its files not all moved into place yet); else None."""
    for folder, manifest, published in _staged_walks(data_root):
        if published and manifest["run_id"] == run_id:
            return folder
    return None


def staged_copy(data_root: UPath, run_id: str, where: str) -> UPath | None:
    """Where a published walk of `run_id` still holds the file it committed at `where` (relative to the data
    root), if its publish is not complete."""
    folder = published_folder(data_root, run_id)
    return folder / where if folder is not None and (folder / where).exists() else None


def complete_published(data_root: UPath, log: Callable[[str], None]) -> list[str]:
    """Under the lease: finish the moves of every walk whose commit record stands but whose files were not all
    moved (it was killed after publishing), and remove staging folders of walks that are gone unpublished.
    Returns the runs whose publish was completed; says each in one line to `log`."""
    completed = []
    for folder, manifest, published in _staged_walks(data_root):
        if published:
            try:
                _move_all(data_root, folder, manifest)
            except PublishIncomplete as exc:
                log(str(exc))  # (reading that run's history says so again, naming the file, until it is re-filtered)
                continue
            log(f"{manifest['run_id']}: completed the publish of its committed walk (its files moved into place)")
            completed.append(manifest["run_id"])
        elif _abandoned(folder.name, folder) and not _publish_may_land(folder, manifest):
            _remove(folder)
    return completed
