"""Where data lives: the data root resource and the Parquet IO manager over `<data>/warehouse/`.

Both take the data root from the same `DataRoot` resource, so the ledger step, which reads other runs'
`kept` files directly, always looks where the IO manager writes.
"""

import os
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import dagster as dg
import fsspec.utils
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from pydantic import Field
from upath import UPath

from filter_pipeline.rules.schemas import (
    SCHEMAS,
    conforms,
    parquet_bytes,
    read_parquet_file,
    to_arrow,
    to_pandas,
)
from filter_pipeline.settings import DATA_ENV, DEFAULT_DATA, ENDPOINT_ENV, data_path
from filter_pipeline.shell.runs import LOCAL_PROTOCOLS, local_signature
from filter_pipeline.storage.files import replace_locally


class DataRoot(dg.ConfigurableResource):
    """The data root: `runs/<run_id>/` batches, `retired.json`, and the `warehouse/` of outputs.

    On object storage, credentials come from the store's own environment (for S3: AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, a profile, or the pod's IAM role), never from this config.
    """

    path: str = Field(
        default=DEFAULT_DATA,
        description=f"Local folder or fsspec URL (s3://bucket/prefix) of the data root; env {DATA_ENV}.",
    )
    endpoint_url: str | None = Field(
        default=None,
        description="S3-compatible endpoint (MinIO, Ceph, moto) for an s3:// data root; unset: AWS itself, or "
        f"AWS_ENDPOINT_URL if set. Env {ENDPOINT_ENV}.",
    )

    @classmethod
    def from_env(cls, path: str | None = None) -> "DataRoot":
        """The data root the environment names (`path`, when given, wins over FILTER_PIPELINE_DATA)."""
        return cls(path=data_path(path), endpoint_url=os.environ.get(ENDPOINT_ENV) or None)

    @property
    def root(self) -> UPath:
        return UPath(self.path, **storage_options(self.path, self.endpoint_url))

    @property
    def runs(self) -> UPath:
        return self.root / "runs"

    def run_dir(self, run_id: str) -> UPath:
        return self.runs / run_id

    @property
    def warehouse(self) -> UPath:
        return self.root / "warehouse"

    def asset_file(self, asset: str, run_id: str) -> UPath:
        """`warehouse/<asset>/<run_id>.parquet`: the same path the IO manager writes."""
        return self.warehouse / asset / f"{run_id}.parquet"


def storage_options(path: str, endpoint_url: str | None) -> dict:
    """fsspec options for the data root at `path`. Raises ValueError for an endpoint on a non-S3 root."""
    protocol = fsspec.utils.get_protocol(path)
    if endpoint_url and protocol not in ("s3", "s3a"):
        raise ValueError(f"an endpoint URL applies to an s3:// data root, not {protocol}://")
    if protocol in LOCAL_PROTOCOLS:
        return {}
    # fsspec caches directory listings per filesystem instance, for the life of the process: the sensor's
    # long-lived code server would never see a batch that arrives after its first listing.
    options: dict = {"use_listings_cache": False}
    if endpoint_url:
        options["endpoint_url"] = endpoint_url
    return options


def write_parquet(table: pa.Table, path: UPath) -> tuple[int, int] | None:
    """Write `table` to `path` atomically (see `write_atomically`, which says what it returns), every column
    dictionary-encoded and with statistics (`schemas.parquet_bytes`).

    The file is encoded in Arrow's memory and written in one call: Arrow writing to a Python file object takes
    the GIL for every chunk it writes, and beside a step's other threads each of those waits its turn."""
    return write_bytes(parquet_bytes(table), path)


def write_bytes(content, path: UPath) -> tuple[int, int] | None:
    """Write `content` (bytes or an Arrow buffer) to `path` atomically (see `write_atomically`)."""
    return write_atomically(path, lambda f: f.write(content))


@dataclass(frozen=True)
class Encoding:
    """An asset's output whose Parquet file is being encoded in another thread (`encode_ahead`): the IO
    manager writes those bytes once they are ready instead of encoding `frame` itself. A step that yields
    several large outputs thus encodes them side by side while Dagster records the ones before."""

    frame: pd.DataFrame
    encoded: Future  # of (the Arrow table, its Parquet bytes)


def encode_ahead(pool: Executor, frame: pd.DataFrame, asset: str) -> Encoding:
    """Start encoding `frame` as the asset's Parquet file in `pool`; yield the result as the output's value.
    `frame` must not change afterwards (what is written is what it held when encoded)."""
    return Encoding(frame, pool.submit(encode, frame, asset))


def encode(frame: pd.DataFrame, asset: str) -> tuple[pa.Table, pa.Buffer]:
    """`frame` as the asset's Arrow table and the bytes of its Parquet file."""
    table = to_arrow(frame, asset)
    return table, parquet_bytes(table, asset)


def write_atomically(path: UPath, write) -> tuple[int, int] | None:
    """Call `write(file)` so that readers of `path` see the old file or the new one, never a partial one.
    Returns the (size, mtime_ns) of the file as written on local disk (`storage.files.replace_locally`); None on
    object stores, which make a single PUT visible atomically."""
    if not isinstance(path.fs, LocalFileSystem):  # (also: object stores have no rename)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            write(f)
        return None
    written = replace_locally(path.path, write, sync_folder=False)
    return written.st_size, written.st_mtime_ns


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
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.name.endswith(".parquet") and not path.name.startswith("."):
            with path.open("rb") as f:
                table = read_parquet_file(f, columns=wanted)
            tables.append(table.filter(expression).select(columns) if expression is not None else table)
    if not tables:
        return pd.DataFrame({name: pd.Series(dtype=object) for name in columns})
    return to_pandas(pa.concat_tables(tables, promote_options="default"))


RECENT_BYTES = 256 << 20  # Arrow bytes of recently written outputs an IO manager keeps for the steps after


class ParquetWarehouseIOManager(dg.UPathIOManager):
    """Stores each asset partition as `<base>/<asset>/<run_id>.parquet` with the asset's fixed schema.

    In one process (the in-process executor runs a whole run in one), the tables it last wrote
    to local disk, up to RECENT_BYTES, are handed to the steps that load them next instead of being read
    back, as long as the file on disk is still the one written (same size and modification time). A step
    loads exactly what reading the file gives: the frame that was written when it already had the file's
    columns, dtypes and row index (as a copy, so the writer's changes never reach it), else its table
    converted.
    """

    extension = ".parquet"

    def __init__(self, base_path: UPath, recent_bytes: int = RECENT_BYTES):
        super().__init__(base_path=base_path)
        self.recent_bytes = recent_bytes
        # path -> (signature, what was written: the conforming frame or the Arrow table, Arrow bytes)
        self._recent: OrderedDict[str, tuple[tuple[int, int], pd.DataFrame | pa.Table, int]] = OrderedDict()
        self._recent_lock = threading.Lock()  # a step's checks run in a thread beside its writes

    def dump_to_path(self, context: dg.OutputContext, obj: pd.DataFrame, path: UPath) -> None:
        asset = context.asset_key.path[-1]
        if asset not in SCHEMAS:
            raise KeyError(f"asset {asset!r} has no Arrow schema in filter_pipeline.rules.schemas.SCHEMAS")
        frame, (table, content) = (
            (obj.frame, obj.encoded.result()) if isinstance(obj, Encoding) else (obj, encode(obj, asset))
        )
        signature = write_bytes(content, path)
        self._remember(path, table, signature, frame.copy(deep=False) if conforms(frame, asset) else None)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pd.DataFrame:
        """The partition's frame; only the columns an input names in its `columns` metadata, if it does."""
        columns = (context.definition_metadata or {}).get("columns")
        written = self._recall(path)
        if written is None:
            return read_parquet(path, columns=columns)
        if isinstance(written, pd.DataFrame):
            return written[columns] if columns else written.copy(deep=False)
        return to_pandas(written.select(columns) if columns else written)

    def _remember(
        self, path: UPath, table: pa.Table, signature: tuple[int, int] | None, frame: pd.DataFrame | None = None
    ) -> None:
        """Keep what was written as the content of the file with `signature` (None: an object store, not
        kept): `frame`, when it is what reading the file gives, else `table`."""
        size = table.nbytes  # measured once: it walks every column's buffers
        with self._recent_lock:
            self._recent.pop(str(path), None)
            if signature is None or size > self.recent_bytes:
                return
            self._recent[str(path)] = (signature, table if frame is None else frame, size)
            while sum(entry[2] for entry in self._recent.values()) > self.recent_bytes:
                self._recent.popitem(last=False)  # the oldest write goes first

    def _recall(self, path: UPath) -> pd.DataFrame | pa.Table | None:
        with self._recent_lock:
            entry = self._recent.get(str(path))
        if entry is None:
            return None
        try:
            if local_signature(path) == entry[0]:
                return entry[1]
        except OSError:
            pass
        with self._recent_lock:
            if self._recent.get(str(path)) is entry:
                del self._recent[str(path)]
        return None

    def get_metadata(self, context: dg.OutputContext, obj: pd.DataFrame | Encoding) -> dict:
        return {"dagster/row_count": len(obj.frame if isinstance(obj, Encoding) else obj)}


class WarehouseIOManager(dg.ConfigurableIOManagerFactory):
    """Parquet files under `<data root>/warehouse/`, one per asset and run_id; works on any fsspec path."""

    data: DataRoot

    def create_io_manager(self, context: dg.InitResourceContext) -> ParquetWarehouseIOManager:
        return ParquetWarehouseIOManager(base_path=self.data.warehouse)
