"""Files on the data root written so that readers never see a part: atomic writes (a temp file renamed over
the target on local disk, fsynced; one PUT on object storage), temp files a killed writer left, and the
fingerprints that tell whether a batch's input files changed since its commit (CONTRACT §4)."""

import hashlib
import os
import socket
import time
import uuid

import fsspec.utils
from upath import UPath

from filter_pipeline.rules.commits import INPUT_FILES
from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.settings import ENDPOINT_ENV

RUNS_DIR, WAREHOUSE_DIR = "runs", "warehouse"  # <data>/runs/<run_id>/: the batches; <data>/warehouse/: outputs


def run_folder(root: UPath, run_id: str) -> UPath:
    """`runs/<run_id>/` of the data root `root`: the run's batch."""
    return root / RUNS_DIR / run_id


def asset_file(warehouse: UPath, asset: str, run_id: str) -> UPath:
    """`warehouse/<asset>/<run_id>.parquet`: the run's file of the asset (the IO manager writes the same path)."""
    return warehouse / asset / f"{run_id}.parquet"


HASH_CHUNK = 8 << 20  # bytes read at a time where a file is read in pieces (hashing, line offsets)
# fsspec protocols of a local data root; anything else is object storage (no symlinks, no rename, no flock)
LOCAL_PROTOCOLS = ("", "file", "local")
OBJECT_STORE_PROTOCOLS = ("s3", "s3a")  # the object stores this project writes to (conditional writes, an endpoint)


def storage_options(path: str, endpoint_url: str | None) -> dict:
    """fsspec options for the data root at `path`. Raises ValueError for an endpoint on a non-S3 root."""
    protocol = fsspec.utils.get_protocol(path)
    if endpoint_url and protocol not in OBJECT_STORE_PROTOCOLS:
        raise ValueError(
            f"an endpoint URL ({ENDPOINT_ENV}, or the data resource's endpoint_url) applies to an s3:// data root, "
            f"not {protocol}://"
        )
    if protocol in LOCAL_PROTOCOLS:
        return {}
    # fsspec caches directory listings per filesystem instance, for the life of the process: the sensor's
    # long-lived code server would never see a batch that arrives after its first listing.
    options: dict = {"use_listings_cache": False}
    if endpoint_url:
        options["endpoint_url"] = endpoint_url
    return options


def open_root(path: str, endpoint_url: str | None = None) -> UPath:
    """The data root at `path` (a folder or an s3:// URL), as every reader and writer of this project opens it
    (`storage_options`)."""
    return UPath(path, **storage_options(path, endpoint_url))


HOST = socket.gethostname()


def _machine() -> str | None:
    """This machine's boot and this process's PID namespace (Linux), or None where the system does not say: a
    pid names this process only among holders that share both (hostnames are shared by laptops of one default
    name and by containers on the host's network, each with pids of its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


MACHINE = _machine()


def writer_tag(host: str, machine: str | None) -> str:
    """Who writes, as temp files and staging folders are named after it: the hostname (its dots made dashes, so
    a name is read from its end) and, where the system says (`MACHINE`), a digest of this boot and PID namespace:
    hostnames alone are shared by laptops of one default name and by containers on the host's network."""
    tag = host.replace(".", "-")
    return tag if machine is None else f"{tag}-{hashlib.sha256(machine.encode()).hexdigest()[:8]}"


WRITER = writer_tag(HOST, MACHINE)


def writer_named(head: str, pid: int | None = None) -> str:
    """`<head>.<writer>.<pid>.<random hex>`: a name of its own for what this process (or process `pid`) writes,
    a temp file or a staging folder, saying who wrote it. It is read from its end (`name_head`, `writer_gone`),
    so a head may hold dots."""
    return f"{head}.{WRITER}.{os.getpid() if pid is None else pid}.{uuid.uuid4().hex}"


def _name_parts(name: str) -> list[str] | None:
    parts = name.rsplit(".", 3)  # (head, writer, pid, hex: only the head may hold dots)
    return parts if len(parts) == 4 else None


def name_head(name: str) -> str:
    """The head of a name `writer_named` made (any other name as it is)."""
    parts = _name_parts(name)
    return name if parts is None else parts[0]


def writer_pid(name: str) -> str | None:
    """The pid in a name `writer_named` made (None for a name of another form)."""
    parts = _name_parts(name)
    return None if parts is None else parts[2]


def writer_gone(name: str) -> bool:
    """Whether what is named `name` (`writer_named`) was written by a process of this machine and PID namespace
    that no longer runs: what it left can go at once. A writer of elsewhere, or a name of another form, is
    judged by the age of its files."""
    parts = _name_parts(name)
    return parts is not None and parts[1] == WRITER and parts[2].isdigit() and not alive(int(parts[2]))


# how an object store refuses a conditional write (`store_refusal`)
PRECONDITION, CONFLICT = "precondition failed", "conflicting write in flight"
# how long a writer's temp file, a walk's staging folder or a lease of unknown length may go untouched before
# its writer counts as gone
ABANDONED_AFTER_SECONDS = 3600


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(folder: str, head: str) -> None:
    """Temp files (`<head>.<writer>...tmp`) a killed earlier write of the same target left: its writer is gone
    (`writer_gone`), or nobody touched the file for ABANDONED_AFTER_SECONDS (a live writer's file is left alone)."""
    for name in os.listdir(folder):
        if not (name.startswith(f"{head}.") and name.endswith(".tmp")):
            continue
        path = os.path.join(folder, name)
        try:
            if writer_gone(name.removesuffix(".tmp")) or time.time() - os.stat(path).st_mtime > ABANDONED_AFTER_SECONDS:
                os.unlink(path)
        except FileNotFoundError:
            pass


def atomic_write(path: UPath, data, sync_folder: bool = True) -> None:
    """Write `data` to `path` so that readers see the old content or the new, never a part. Local disk:
    `replace_locally`, with `sync_folder` the folder fsynced too so the rename survives a crash. Object stores
    make a single PUT visible atomically."""
    if not is_local(path):  # (`data`: bytes or any buffer, e.g. an Arrow buffer)
        path.fs.pipe_file(path.path, data if isinstance(data, bytes) else memoryview(data).tobytes())
        return
    replace_locally(path.path, lambda f: f.write(data), sync_folder=sync_folder)


def replace_locally(target: str, write, sync_folder: bool) -> os.stat_result:
    """Call `write(file)` on a hidden temp file beside the local file `target` (named after its writer,
    `writer_named`, so a later write can tell a dead writer's file from a live one's; temp files a killed earlier write
    left are removed first), fsync it and rename it over `target`; with `sync_folder`, fsync the folder as
    well. Returns the temp file's stat, taken before the rename (which keeps size and mtime), so another
    process's write right after cannot be mistaken for this one."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    head = f".{os.path.basename(target)}"
    remove_stale_temps(folder, head)
    tmp = os.path.join(folder, f"{writer_named(head)}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        written = os.stat(tmp)
        os.replace(tmp, target)
        if sync_folder:
            fsync_folder(folder)
        return written
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_if_present(path: UPath, error: type[Exception] = ValueError) -> bytes | None:
    """The file's bytes; None when it does not exist; `error`, in one line naming it, when it exists but cannot
    be read (a folder, no permission)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise error(f"{path.name} cannot be read ({exc.strerror or exc})") from None


def sha256_of(path: UPath) -> str:
    """SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_version(path: UPath) -> tuple | None:
    """What changes whenever the file at `path` is written again (its ETag on object storage; its mtime, size
    and inode elsewhere, an atomic write being a new file); None when it does not exist."""
    try:
        if is_local(path):
            stat = os.stat(path.path)
            return (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        path.fs.invalidate_cache(path.path)  # (read fresh: a listing cache would hide another writer's write)
        info = path.fs.info(path.path)
    except (FileNotFoundError, OSError):
        return None
    return (etag(info) or str(info.get("LastModified")), info.get("size"))


def input_fingerprint(path: UPath) -> dict:
    """What tells a later reader whether an input file changed: size and SHA-256 (and mtime_ns, so an
    unchanged file need not be hashed again) on local disk; size and ETag on object storage."""
    if is_local(path):
        stat = os.stat(path.path)
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_of(path)}
    return _store_fingerprint(path.fs.info(path.path))


def read_input(path: UPath) -> tuple[bytes, dict]:
    """The file's bytes and an `input_fingerprint` of exactly those bytes, for `inputs_changed` to hold the file
    against later. The file's state is read before its bytes, so a change during the read is reported as a
    change later (on local disk the hash of the bytes read decides), never missed."""
    if is_local(path):
        stat = os.stat(path.path)
        data = path.read_bytes()
        return data, {"size": len(data), "mtime_ns": stat.st_mtime_ns, "sha256": hashlib.sha256(data).hexdigest()}
    info = path.fs.info(path.path)
    return path.read_bytes(), _store_fingerprint(info)


def _store_fingerprint(info: dict) -> dict:
    return {"size": int(info.get("size") or 0), "etag": etag(info)}


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
        if is_local(path):
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


def files_in(folder: UPath, suffix: str) -> dict[str, UPath]:
    """name without `suffix` -> path, for each file of `folder` ending in `suffix`, in name order; a file whose
    name starts with a dot (the temporary file of a write in progress) is skipped; {} without the folder."""
    names = sorted(name for name, _ in folder_entries(folder) if name.endswith(suffix) and not name.startswith("."))
    return {name.removesuffix(suffix): folder / name for name in names}


def folder_entries(folder: UPath) -> list[tuple[str, bool]]:
    """(name, whether it is a folder) of each entry of `folder`, from one listing (`listing`; on local disk a
    symlink is followed, as the stage follows it)."""
    return [
        (name, info["type"] == "directory" or bool(info.get("islink")) and folder.fs.isdir(info["name"]))
        for name, info in listing(folder)
    ]


def listing(folder: UPath, fresh: bool = False) -> list[tuple[str, dict]]:
    """(name, the store's information: type, size, and on object storage the ETag) of each entry of `folder`,
    from one listing (no stat per entry on object storage; an object store may list a file and a folder of one
    name); none when the folder does not exist or is a file (which a listing gives as its own entry, as it
    gives an object store's folder marker). `fresh`: not from the filesystem's cache of listings, which would
    hide another writer's new files."""
    if fresh:
        folder.fs.invalidate_cache(folder.path)
    try:
        listed = folder.fs.ls(folder.path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    itself = folder.path.rstrip("/")
    return [
        (info["name"].rstrip("/").rsplit("/", 1)[-1], info) for info in listed if info["name"].rstrip("/") != itself
    ]


def fsync_folder(folder: str) -> None:
    """Make a rename into the local `folder` survive a crash (the folder's entry is on disk)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def is_object_store(path: UPath) -> bool:
    """Whether `path` is on an object store whose conditional writes the lease and the publish use (s3://)."""
    return path.protocol in OBJECT_STORE_PROTOCOLS


def etag(info: dict) -> str:
    """An object's ETag, as a store's `info` or a write's response gives it, without quotes ("" when none)."""
    return str(info.get("ETag") or info.get("etag") or "").strip('"')


def store_trouble(exc: BaseException) -> str | None:
    """One line naming an error of the data root's storage (the file system; an object store that cannot be
    reached, has no credentials or refuses), as `<ErrorType>: <its message>`; None for any other error."""
    from botocore.exceptions import BotoCoreError, ClientError  # (s3fs's; imported only when an error is told)

    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return None  # (a file missing or of the wrong kind: not the store failing)
    return error_line(exc) if isinstance(exc, (OSError, BotoCoreError, ClientError)) else None


def error_line(exc: BaseException) -> str:
    """`<ErrorType>: <its message>` on one line."""
    return f"{type(exc).__name__}: {one_line(exc)}"


def store_refusal(exc: BaseException) -> str | None:
    """Why an object store refused a conditional write, from s3fs's exception: PRECONDITION (412, or
    `If-None-Match: *` on a key that exists), CONFLICT (409 `ConditionalRequestConflict`: AWS refuses a
    conditional write while another one on the same key is in flight), else None (not a refusal)."""
    if isinstance(exc, FileExistsError):
        return PRECONDITION
    response = getattr(exc.__cause__, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", "")) or str(exc)  # (the code is in s3fs's message too)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if "PreconditionFailed" in code or status == 412:
        return PRECONDITION
    if "ConditionalRequestConflict" in code or status == 409:
        return CONFLICT
    return None


def is_local(path: UPath) -> bool:
    """Whether `path` is on local disk (renames, fsync, flock and symlinks), not an object store."""
    return path.protocol in LOCAL_PROTOCOLS
