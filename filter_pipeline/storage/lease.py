"""Exclusion of ledger walks that lives with the warehouse: one walk at a time per data root, whichever
process, Dagster instance or machine runs it (CONTRACT §4 "walks never overlap on one warehouse").

- Local disk: an OS lock (`flock`) on `<data>/warehouse/_ledger.lock`. The OS drops it when its holder
  exits or is killed, so a dead holder never needs hand work. `_ledger.holder.json` beside it names the
  holder for the busy message. (A lock on a network file system holds only if that file system honours
  `flock` across clients: use object storage for a warehouse shared by machines.)
- Object storage (s3://): `<data>/warehouse/_ledger.lease`, created only if absent (S3 conditional write
  `If-None-Match: *`), naming its holder and its TTL; a heartbeat thread renews it (`If-Match` its own
  ETag) well before it expires. A lease is expired when the store's clock says so (its `LastModified` plus
  the TTL against the `Date` of the store's answer), so machines whose clocks disagree agree on it, or when its
  holder was a process of this machine and PID namespace that is gone (killed); it is then taken over with a write conditional on
  the old ETag, so of two takers exactly one wins. It is deleted at the
  end. A lease alone cannot stop a holder that was paused past its expiry: what it writes is fenced by the
  conditional publish of `storage/publish.py`. Both need a store that honours conditional writes: each lease
  first checks that it does (`check_conditional_writes`).

No Dagster here: the CLI's `materialize` takes the lease too, to complete a published walk before planning.
"""

import errno
import fcntl
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from upath import UPath

from filter_pipeline import settings
from filter_pipeline.storage.files import (
    ABANDONED_AFTER_SECONDS,
    CONFLICT,
    HOST,
    MACHINE,
    PRECONDITION,
    WAREHOUSE_DIR,
    alive,
    atomic_write,
    etag,
    is_local,
    is_object_store,
    store_refusal,
)

LOCK_FILE = "_ledger.lock"
HOLDER_FILE = "_ledger.holder.json"
LEASE_FILE = "_ledger.lease"
PROBE_FILE = "_conditional_writes.probe"
NO_SUCH_ETAG = "0" * 32  # an If-Match no object's ETag equals


class LedgerBusy(Exception):
    """Another walk holds the ledger of this data root; str() says who (host, pid, run, since)."""


def taken_over(lease: str) -> str:
    """Why a walk lost `lease` (how it names the lease): what LeaseLost says."""
    return f"{lease} was taken over by another walk after it expired"


class LeaseLost(Exception):
    """The lease expired and was taken over while its holder still walked: the walk must not commit."""


def _now_iso(seconds: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if seconds is None else seconds, UTC).isoformat(timespec="seconds")


def _holder_record(holder: str, ttl_seconds: float, since: str | None = None, token: str = "") -> dict:
    """Who holds the ledger. On object storage its expiry is judged by the store's clock from `ttl_seconds`;
    `expires` (this machine's clock) is for people reading the file."""
    now = time.time()
    return {"host": HOST, "machine": MACHINE, "pid": os.getpid(), "holder": holder, "since": since or _now_iso(now),
            "expires": now + ttl_seconds, "ttl_seconds": ttl_seconds, "token": token}  # fmt: skip


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
            self.lost = taken_over("the ledger lease")
            self.check()


@contextmanager
def ledger_lease(data_root: UPath, holder: str, ttl_seconds: float | None = None) -> Iterator[Lease]:
    """Exclusive across processes, instances and machines on one data root; raises LedgerBusy at once if held.

    `holder`: who walks (e.g. "run r1 (dagster run 1a2b...)"), shown to whoever finds the ledger busy.
    """
    warehouse = data_root / WAREHOUSE_DIR
    ttl_seconds = ttl_seconds or default_ttl_seconds()
    if is_local(warehouse):
        with _local_lock(warehouse, holder) as lease:
            yield lease
    elif warehouse.protocol == "memory":
        with _process_lock(warehouse, holder) as lease:
            yield lease
    elif is_object_store(warehouse):
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


class StoreIgnoresConditions(Exception):
    """The object store applied a write whose condition (`If-None-Match: *` or `If-Match`) did not hold: neither
    the lease nor the fenced publish can hold there; str() says so in one line."""


def _put(fs, path: str, record: dict, **condition) -> str:
    """Write the lease record with the given S3 condition; its new ETag. FileExistsError / OSError when the
    condition does not hold."""
    return etag(fs.pipe_file(path, json.dumps(record).encode(), **condition))


def _object_where(warehouse: UPath) -> str:
    return f"{warehouse.protocol}://{warehouse.parent.path}"


def _refused(fs, path: str, **condition) -> bool:
    """Whether the store refuses a write of the probe file under `condition` (a 409 is a refusal too: only a store
    that evaluates conditions answers it)."""
    try:
        fs.pipe_file(path, b"a probe of conditional writes: the ledger lease and the publish need them", **condition)
    except OSError as exc:
        if store_refusal(exc) is None:
            raise
        return True
    return False


def check_conditional_writes(warehouse: UPath) -> None:
    """Raise StoreIgnoresConditions unless the store refuses a create of a key that exists (`If-None-Match: *`)
    and a write whose `If-Match` names another version: S3 and recent MinIO do, some S3-compatible stores
    apply such writes anyway, and then two walks could overwrite each other's commits. Two refused PUTs of
    `warehouse/_conditional_writes.probe` (three the first time)."""
    fs, path = warehouse.fs, (warehouse / PROBE_FILE).path
    created = not _refused(fs, path, mode="create")
    if (created and not _refused(fs, path, mode="create")) or not _refused(fs, path, IfMatch=NO_SUCH_ETAG):
        raise StoreIgnoresConditions(
            f"the object store of {_object_where(warehouse)} applied a write whose condition (If-None-Match / "
            "If-Match) did not hold: the ledger's lease and its fenced publish need a store that honours "
            "conditional writes (AWS S3 does; check your store's version and settings)"
        )


def _store_says_expired(fs, path: str, current: dict) -> bool:
    """Whether the lease read (`current`, its record) is past its expiry by the store's own clock: the time it was
    last written (`LastModified`) plus its TTL, against the `Date` of the store's answer: two machines' clocks
    never meet. A record without `ttl_seconds` (written by an earlier version, which renews it all the same) lasts
    FILTER_PIPELINE_LEASE_SECONDS, or as long as its `expires` says if that is longer (at most an hour, or that
    setting if longer); one without `expires` either is unreadable, hence expired. Raises FileNotFoundError when
    the lease is gone."""
    ttl, expires = current.get("ttl_seconds"), current.get("expires")
    if ttl is None and not _finite(expires):
        return True
    head = fs.call_s3("head_object", **_bucket_key(fs, path))
    written = head["LastModified"]
    if ttl is None:  # its holder may run with a longer setting than this one, and renew less often; but not for
        # more than an hour (or this setting, if longer), however far its clock ran ahead
        longest = max(default_ttl_seconds(), ABANDONED_AFTER_SECONDS)
        ttl = min(max(default_ttl_seconds(), expires - written.timestamp()), longest)
    return not _finite(ttl) or (_store_now(head) - written).total_seconds() > ttl


def _finite(value) -> bool:
    try:
        return isinstance(value, int | float) and math.isfinite(value)
    except OverflowError:  # (an integer JSON holds but no float can)
        return False


def _store_now(head: dict) -> datetime:
    """The store's clock when it answered (its `Date` header); this machine's if it sends none or a garbled one."""
    said = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        now = parsedate_to_datetime(said) if said else datetime.now(UTC)
    except (TypeError, ValueError):
        now = datetime.now(UTC)
    return now if now.tzinfo else now.replace(tzinfo=UTC)


def _holder_gone(record: dict) -> bool:
    """Whether the lease's holder was a process of this machine and PID namespace (`MACHINE`: Linux only) that no
    longer runs (killed: it could not delete its lease), so its TTL need not be waited out. Elsewhere, or for a
    holder that does not say, its TTL is waited out."""
    pid = record.get("pid")
    same = MACHINE is not None and record.get("machine") == MACHINE and record.get("host") == HOST
    return same and type(pid) is int and pid != os.getpid() and not alive(pid)


def _take(fs, path: str, holder: str, ttl_seconds: float, token: str, where: str) -> str:
    """Create the lease, or take over an expired one; its ETag. Raises LedgerBusy when it is held. A write whose
    reply was lost (and whose retry the store refused) is recognised by `token` in the record it left."""
    record = _holder_record(holder, ttl_seconds, token=token)
    try:
        return _put(fs, path, record, mode="create")
    except Exception as exc:  # (botocore's connection errors are not OSErrors)
        refusal = store_refusal(exc) if isinstance(exc, OSError) else None
        if refusal == CONFLICT:
            raise LedgerBusy(f"another walk was taking the ledger of {where} at the same moment: try again") from None
        if refusal is None:  # (a network error: the write may have landed, its reply lost)
            found = _ours(fs, path, token)
            if found is None:
                raise
            return found
    released = LedgerBusy(f"the ledger of {where} was released just now by another walk: try again")
    try:
        info = fs.info(path, refresh=True)
        current = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise released from None
    except ValueError:
        current = {}  # unreadable: treat as expired, a conditional takeover settles who wins
    current = current if isinstance(current, dict) else {}
    if current.get("token") == token:
        return etag(info)
    try:
        expired = _store_says_expired(fs, path, current)
    except FileNotFoundError:
        raise released from None
    if not expired and not _holder_gone(current):
        raise LedgerBusy(_describe(where, current))
    try:
        return _put(fs, path, record, IfMatch=etag(info))
    except Exception as exc:
        found = _ours(fs, path, token)
        if found is not None:
            return found
        if isinstance(exc, OSError):
            raise LedgerBusy(
                _describe(where, current) + " (its expired lease was just taken over by another walk)"
            ) from None
        raise


def lease_live(warehouse: UPath) -> bool | None:
    """On object storage, whether a walk holds the ledger now: its lease exists and has not expired by the store's
    clock. None elsewhere: a local lock's holder is told by its pid."""
    if not is_object_store(warehouse):
        return None
    fs, path = warehouse.fs, (warehouse / LEASE_FILE).path
    try:
        current = json.loads(fs.cat_file(path))
        current = current if isinstance(current, dict) else {}
        return not (_store_says_expired(fs, path, current) or _holder_gone(current))
    except FileNotFoundError:
        return False
    except ValueError:
        return False  # unreadable: expired, as a taker judges it
    except Exception:  # noqa: BLE001 - a network error (botocore's are not all OSErrors): unknown
        return None


def _ours(fs, path: str, token: str) -> str | None:
    """The lease's ETag if the record in the store is this holder's (its token), else None (a network error
    raises: it says nothing about who holds the lease)."""
    try:
        info = fs.info(path, refresh=True)
        current = json.loads(fs.cat_file(path))
    except (FileNotFoundError, ValueError):
        return None
    return etag(info) if isinstance(current, dict) and current.get("token") == token else None


@contextmanager
def _object_lease(warehouse: UPath, holder: str, ttl_seconds: float) -> Iterator[Lease]:
    fs, path, where = warehouse.fs, (warehouse / LEASE_FILE).path, _object_where(warehouse)
    check_conditional_writes(warehouse)
    token = uuid.uuid4().hex  # tells this holder's record from a taker's, whatever the ETags say
    since, state = _now_iso(), {"etag": _take(fs, path, holder, ttl_seconds, token, where)}

    lease = Lease(lambda: _ours(fs, path, token) is not None)
    stop = threading.Event()

    def renew() -> None:
        record = _holder_record(holder, ttl_seconds, since, token)
        try:
            state["etag"] = _put(fs, path, record, IfMatch=state["etag"])
        except FileNotFoundError:
            lease.lost = taken_over(f"the ledger lease {path}")
        except OSError as exc:
            if store_refusal(exc) != PRECONDITION:
                return  # a network error or a 409: try again at the next beat (the lease holds until it expires)
            # refused: taken over, or this renewal was applied and its reply lost (a retried PUT then fails its
            # If-Match): the token in the store tells which
            found = _ours(fs, path, token)
            if found is None:
                lease.lost = taken_over(f"the ledger lease {path}")
            else:
                state["etag"] = found

    def heartbeat() -> None:
        while not lease.lost and not stop.wait(ttl_seconds / 4):
            try:
                renew()
            except Exception:  # noqa: BLE001 - botocore's connection errors are not OSErrors: try again
                continue

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
            except Exception:  # noqa: BLE001 - botocore's connection errors are not OSErrors
                # taken over meanwhile (it is the taker's now), or the store out of reach: the lease then
                # expires by its TTL, and the walk's own outcome (or error) stands
                pass
            fs.invalidate_cache(path)


def _bucket_key(fs, path: str) -> dict:
    bucket, key, _ = fs.split_path(path)
    return {"Bucket": bucket, "Key": key}
