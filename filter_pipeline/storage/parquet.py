"""The warehouse's Parquet files: each written whole so that readers never see a part, each read to its end
before the call returns, an asset's folder read as one frame, and whether a file still holds what a step
loaded from it."""

import hashlib

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from filter_pipeline.rules.schemas import parquet_bytes, to_arrow, to_pandas
from filter_pipeline.storage.files import atomic_write, file_version, files_in, sha256_of

# a loaded frame's attrs key: (the version, the SHA-256) of the file it was read from (the IO manager's load)
LOADED_VERSION = "filter_pipeline/loaded_version"


def read_parquet_file(source, columns: list[str] | None = None) -> pa.Table:
    """One Parquet file (a path, an Arrow file such as `pa.BufferReader(bytes)`, or a Python file object) as an
    Arrow table, read to the end before it returns.

    Not `pq.read_table`: that goes through Arrow's dataset scanner, whose background read-ahead can still be
    winding down when the call returns; a process that exits then aborts with "terminate called without an
    active exception" (apache/arrow#34314, #39862). `ParquetFile.read` reads synchronously.

    A Python file object (what fsspec opens) is first copied whole into memory Arrow owns, and parsed from
    there: given the file object itself, Arrow reads it ahead on its IO threads, and a read still finishing
    when the process exits releases a Python buffer without the interpreter, which aborts the process
    ("terminate called without an active exception", apache/arrow#50482; seen in this project's CI)."""
    if not isinstance(source, (pa.NativeFile, str)):
        with pa.BufferOutputStream() as owned:  # (a copy: no Python object is left for Arrow's threads to release)
            owned.write(source.read())
            source = pa.BufferReader(owned.getvalue())
    return pq.ParquetFile(source).read(columns=columns)


def write_parquet(table: pa.Table, path: UPath) -> None:
    """Write `table` to `path` atomically (`write_bytes`), every column dictionary-encoded and with
    statistics (`schemas.parquet_bytes`).

    The file is encoded in Arrow's memory and written in one call (one PUT on object storage), not streamed
    through a Python file object, which takes the GIL for every chunk Arrow writes."""
    write_bytes(parquet_bytes(table), path)


def write_bytes(content, path: UPath) -> None:
    """Write `content` (bytes or an Arrow buffer) to `path` so that readers see the old file or the new one,
    never a part (`storage.files.atomic_write`; the folder is not fsynced: an output lost in a crash is
    written again by the step's retry, and only a commit record makes it part of the ledger)."""
    atomic_write(path, content, sync_folder=False)


def encode(frame: pd.DataFrame, asset: str) -> tuple[pa.Table, pa.Buffer]:
    """`frame` as the asset's Arrow table and the bytes of its Parquet file."""
    table = to_arrow(frame, asset)
    return table, parquet_bytes(table, asset)


def read_parquet(path: UPath, columns: list[str] | None = None) -> pd.DataFrame:
    with path.open("rb") as f:
        return to_pandas(read_parquet_file(f, columns=columns))


def read_folder(folder: UPath, columns: list[str], filters=None) -> pd.DataFrame:
    """Every partition file of an asset folder as one frame (files in name order), through the folder's own
    filesystem (so an endpoint set on the data root applies, not only one in the environment); `filters`: rows
    to keep: (column, op, value) conditions that must all hold, as `pd.read_parquet` takes them. Each file is read by
    `read_parquet_file`, not by Arrow's dataset scanner: see there why."""
    expression = pq.filters_to_expression(filters) if filters else None
    wanted = list(dict.fromkeys([*columns, *(name for name, _, _ in (filters or []))]))
    tables = []
    for path in files_in(folder, ".parquet").values():
        with path.open("rb") as f:
            table = read_parquet_file(f, columns=wanted)
        tables.append(table.filter(expression).select(columns) if expression is not None else table)
    if not tables:
        return pd.DataFrame({name: pd.Series(dtype=object) for name in columns})
    frame = to_pandas(pa.concat_tables(tables, promote_options="default"))
    frame.attrs.clear()  # (the first file's, kept by the concatenation: say nothing of the others)
    return frame


def read_versioned(path: UPath) -> pd.DataFrame:
    """The file at `path` as a frame, with `attrs[LOADED_VERSION]`: (the file's
    version as it was read, `file_version`, taken before the read; the SHA-256 of the bytes read), so that a
    step can tell whether the file was written again meanwhile, and if so with other content
    (`unchanged_since_loaded`)."""
    version = file_version(path)
    data = path.read_bytes()
    frame = to_pandas(read_parquet_file(pa.BufferReader(data)))
    frame.attrs[LOADED_VERSION] = (version, hashlib.sha256(data).hexdigest())
    return frame


def unchanged_since_loaded(path: UPath, loaded: tuple | None) -> bool:
    """Whether the file at `path` holds what a step loaded from it (`loaded`: its `attrs[LOADED_VERSION]`; None,
    a frame not loaded by the IO manager: taken as unchanged): the same version, or written again with the same
    bytes (a second judge step of the run writing identical verdicts)."""
    if loaded is None:
        return True
    version, digest = loaded
    return file_version(path) == version or (path.exists() and sha256_of(path) == digest)
