"""Exclusion of ledger walks that lives with the warehouse: one walk at a time per data root, whichever
process, Dagster instance or machine runs it (CONTRACT §4 "walks never overlap on one warehouse").

- Local disk: an OS lock (`flock`) on `<data>/warehouse/_ledger.lock`. The OS drops it when its holder
  exits or is killed, so a dead holder never needs hand work. `_ledger.holder.json` beside it names the
  holder for the busy message. (A lock on a network file system holds only if that file system honours
  `flock` across clients: use object storage for a warehouse shared by machines.)
- Object storage (s3://): `<data>/warehouse/_ledger.lease`, created only if absent (S3 conditional write
  `If-None-Match: *`), naming its holder and an expiry; a heartbeat thread renews it (`If-Match` its own
  ETag) well before it expires. A lease past its expiry (its holder died or lost its network) is taken
  over with a write conditional on the old ETag, so of two takers exactly one wins. It is deleted at the end.
  A lease alone cannot stop a holder that was paused past its expiry: what it writes is fenced by the
  conditional publish of `storage/publish.py`.

Pure: no Dagster.
"""

import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from upath import UPath

from filter_pipeline import settings
from filter_pipeline.storage.files import atomic_write, is_local

LOCK_FILE = "_ledger.lock"
HOLDER_FILE = "_ledger.holder.json"
LEASE_FILE = "_ledger.lease"


class LedgerBusy(Exception):
    """Another walk holds the ledger of this data root; str() says who (host, pid, run, since)."""


class LeaseLost(Exception):
    """The lease expired and was taken over while its holder still walked: the walk must not commit."""


def _now_iso(seconds: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if seconds is None else seconds, UTC).isoformat(timespec="seconds")


def _holder_record(holder: str, ttl_seconds: float, since: str | None = None) -> dict:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "holder": holder, "since": since or _now_iso(now),
            "expires": now + ttl_seconds}  # fmt: skip


def _describe(where: str, record: dict | None) -> str:
    if not record:
        return f"the ledger of {where} is held by another walk (holder unknown)"
    return (
        f"the ledger of {where} is held by {record.get('holder', '?')} (host {record.get('host', '?')}, "
        f"pid {record.get('pid', '?')}) since {record.get('since', '?')}"
    )


def default_ttl_seconds() -> float:
    """How long a lease on object storage lasts unless renewed (FILTER_PIPELINE_LEASE_SECONDS)."""
    return float(max(1, settings.int_setting(settings.LEASE_SECONDS_ENV)))


class Lease:
    """A held ledger lease. `check()` raises LeaseLost if it is known lost (object storage only); `confirm()`
    reads the lease again from the store first."""

    def __init__(self, still_ours: Callable[[], bool] | None = None):
        self.lost: str | None = None
        self._still_ours = still_ours

    def check(self) -> None:
        if self.lost:
            raise LeaseLost(self.lost)

    def confirm(self) -> None:
        self.check()
        if self._still_ours is not None and not self._still_ours():
            self.lost = "the ledger lease was taken over by another walk after it expired"
            self.check()


@contextmanager
def ledger_lease(data_root: UPath, holder: str, ttl_seconds: float | None = None) -> Iterator[Lease]:
    """Exclusive across processes, instances and machines on one data root; raises LedgerBusy at once if held.

    `holder`: who walks (e.g. "run r1 (dagster run 1a2b...)"), shown to whoever finds the ledger busy.
    """
    warehouse = data_root / "warehouse"
    ttl_seconds = ttl_seconds or default_ttl_seconds()
    if is_local(warehouse):
        with _local_lock(warehouse, holder) as lease:
            yield lease
    elif warehouse.protocol == "memory":
        with _process_lock(warehouse, holder) as lease:
            yield lease
    elif warehouse.protocol in ("s3", "s3a"):
        with _object_lease(warehouse, holder, ttl_seconds) as lease:
            yield lease
    else:
        raise ValueError(
            f"the ledger lease needs a local or s3:// data root (conditional writes), not {warehouse.protocol}://"
        )


# --- fsspec's memory filesystem (one process's, as in tests) ---------------------------------------

_process_locks: dict[str, tuple[threading.Lock, list]] = {}
_process_locks_guard = threading.Lock()


@contextmanager
def _process_lock(warehouse: UPath, holder: str) -> Iterator[Lease]:
    with _process_locks_guard:
        lock, holders = _process_locks.setdefault(warehouse.path, (threading.Lock(), [None]))
    if not lock.acquire(blocking=False):
        raise LedgerBusy(_describe(f"memory://{warehouse.parent.path}", holders[0]))
    holders[0] = _holder_record(holder, 0)
    try:
        yield Lease()
    finally:
        lock.release()


# --- local disk -------------------------------------------------------------------------------------


@contextmanager
def _local_lock(warehouse: UPath, holder: str) -> Iterator[Lease]:
    folder = warehouse.path
    os.makedirs(folder, exist_ok=True)
    handle = open(os.path.join(folder, LOCK_FILE), "a")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise LedgerBusy(_describe(str(warehouse.parent.path), _read_json(warehouse / HOLDER_FILE))) from None
        atomic_write(warehouse / HOLDER_FILE, json.dumps(_holder_record(holder, 0)).encode())
        try:
            yield Lease()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        handle.close()


def _read_json(path: UPath) -> dict | None:
    try:
        value = json.loads(path.read_bytes())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


# --- object storage ---------------------------------------------------------------------------------


def _etag(response: dict) -> str:
    return str(response.get("ETag", "")).strip('"')


def _put(fs, path: str, record: dict, **condition) -> str:
    """Write the lease record with the given S3 condition; its new ETag. FileExistsError / OSError when the
    condition does not hold."""
    return _etag(fs.pipe_file(path, json.dumps(record).encode(), **condition))


def _object_where(warehouse: UPath) -> str:
    return f"{warehouse.protocol}://{warehouse.parent.path}"


def _take(fs, path: str, holder: str, ttl_seconds: float, where: str) -> str:
    """Create the lease, or take over an expired one; its ETag. Raises LedgerBusy when it is held."""
    try:
        return _put(fs, path, _holder_record(holder, ttl_seconds), mode="create")
    except FileExistsError:
        pass
    try:
        info = fs.info(path, refresh=True)
        current = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise LedgerBusy(f"the ledger of {where} was released just now by another walk: try again") from None
    except ValueError:
        current = {}  # unreadable: treat as expired, a conditional takeover settles who wins
    if isinstance(current, dict) and float(current.get("expires", 0)) > time.time():
        raise LedgerBusy(_describe(where, current))
    try:
        return _put(fs, path, _holder_record(holder, ttl_seconds), IfMatch=_etag(info))
    except (OSError, FileNotFoundError):
        raise LedgerBusy(
            _describe(where, current) + " (its expired lease was just taken over by another walk)"
        ) from None


@contextmanager
def _object_lease(warehouse: UPath, holder: str, ttl_seconds: float) -> Iterator[Lease]:
    fs, path, where = warehouse.fs, (warehouse / LEASE_FILE).path, _object_where(warehouse)
    etag = _take(fs, path, holder, ttl_seconds, where)
    since = _now_iso()
    state = {"etag": etag}

    def still_ours() -> bool:
        try:
            return _etag(fs.info(path, refresh=True)) == state["etag"]
        except FileNotFoundError:
            return False

    lease = Lease(still_ours)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(ttl_seconds / 4):
            try:
                state["etag"] = _put(fs, path, _holder_record(holder, ttl_seconds, since), IfMatch=state["etag"])
            except (OSError, FileNotFoundError) as exc:
                if isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.EINVAL:
                    lease.lost = f"the ledger lease {path} was taken over by another walk after it expired"
                    return
                # a network error: try again at the next beat (the lease is still good until it expires)

    beat = threading.Thread(target=heartbeat, name="ledger-lease", daemon=True)
    beat.start()
    try:
        yield lease
    finally:
        stop.set()
        beat.join()
        if not lease.lost:
            try:
                fs.call_s3("delete_object", **_bucket_key(fs, path), IfMatch=state["etag"])
            except (OSError, FileNotFoundError):
                pass  # taken over meanwhile: it is the taker's now
            fs.invalidate_cache(path)


def _bucket_key(fs, path: str) -> dict:
    bucket, key, _ = fs.split_path(path)
    return {"Bucket": bucket, "Key": key}
