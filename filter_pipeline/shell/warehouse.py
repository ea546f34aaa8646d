"""Where data lives: the data root resource and the Parquet IO manager over `<data>/warehouse/`.

Both take the data root from the same `DataRoot` resource, so the ledger step, which reads other runs'
`kept` files directly, always looks where the IO manager writes.
"""

import functools
import hashlib
import os
from collections.abc import Iterable

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field
from upath import UPath

from filter_pipeline.rules.batch import check_run_id
from filter_pipeline.rules.schemas import (
    JUDGE_PROGRESS_FOLDER,
    SCHEMAS,
    parquet_bytes,
    to_arrow,
    to_pandas,
)
from filter_pipeline.settings import DATA_ENV, DEFAULT_DATA, ENDPOINT_ENV, data_path
from filter_pipeline.storage.files import (
    RUNS_DIR,
    WAREHOUSE_DIR,
    asset_file,
    atomic_write,
    file_version,
    files_in,
    open_root,
    read_parquet_file,
    run_folder,
    sha256_of,
)

# a loaded frame's attrs key: (the version, the SHA-256) of the file it was read from (`load_from_path`)
LOADED_VERSION = "filter_pipeline/loaded_version"


def plain_run_ids(keys: Iterable[str]) -> list[str]:
    """Partition keys, sorted, when each is a plain run_id (`check_run_id`); else a one-line dg.Failure. Each
    step asks first, before it reads or writes anything, and the IO manager again: the UI registers any key, and
    `../x` would reach outside runs/ and warehouse/<asset>/."""
    try:
        return sorted(check_run_id(key) for key in keys)
    except ValueError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None


@functools.lru_cache(maxsize=32)
def _plain_keys(keys: tuple[str, ...]) -> None:
    """`plain_run_ids` once per set of keys: a ranged step loads one file per key, each asking of them all."""
    plain_run_ids(keys)


class DataRoot(dg.ConfigurableResource):
    """The data root: `runs/<run_id>/` batches, `retired.json`, and the `warehouse/` of outputs. On object
    storage, credentials come from the store's own environment (for S3: AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, a profile, or the pod's IAM role), never from this config."""

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
        return open_root(self.path, self.endpoint_url)

    @property
    def runs(self) -> UPath:
        return self.root / RUNS_DIR

    def run_dir(self, run_id: str) -> UPath:
        return run_folder(self.root, run_id)

    @property
    def warehouse(self) -> UPath:
        return self.root / WAREHOUSE_DIR

    def asset_file(self, asset: str, run_id: str) -> UPath:
        return asset_file(self.warehouse, asset, run_id)

    def judge_progress(self, run_id: str) -> UPath:
        """The folder of the run's verdicts the LLM judge saved as they arrived (`driver.ProgressStore`)."""
        return self.warehouse / JUDGE_PROGRESS_FOLDER / run_id


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


def unchanged_since_loaded(path: UPath, loaded: tuple | None) -> bool:
    """Whether the file at `path` holds what a step loaded from it (`loaded`: its `attrs[LOADED_VERSION]`; None,
    a frame not loaded by the IO manager: taken as unchanged): the same version, or written again with the same
    bytes (a second judge step of the run writing identical verdicts)."""
    if loaded is None:
        return True
    version, digest = loaded
    return file_version(path) == version or (path.exists() and sha256_of(path) == digest)


class ParquetWarehouseIOManager(dg.UPathIOManager):
    """Stores each asset partition as `<base>/<asset>/<run_id>.parquet` with the asset's fixed schema."""

    extension = ".parquet"

    def dump_to_path(self, context: dg.OutputContext, obj: pd.DataFrame, path: UPath) -> None:
        asset = context.asset_key.path[-1]
        if context.has_asset_partitions:
            _plain_keys(tuple(context.asset_partition_keys))
        if asset not in SCHEMAS:
            raise KeyError(f"asset {asset!r} has no Arrow schema in filter_pipeline.rules.schemas.SCHEMAS")
        write_bytes(encode(obj, asset)[1], path)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> pd.DataFrame:
        """The partition's frame (a partition key that is not a plain run_id: a one-line failure); only the columns an input names in its `columns` metadata, if it does. Its
        `attrs[LOADED_VERSION]`: (the file's version as it was read, `file_version`, taken before the read; the
        SHA-256 of the bytes read), so that a step can tell whether the file was written again meanwhile, and
        if so with other content (`unchanged_since_loaded`)."""
        if context.has_asset_partitions:
            _plain_keys(tuple(context.asset_partition_keys))
        version = file_version(path)
        data = path.read_bytes()
        table = read_parquet_file(pa.BufferReader(data), columns=(context.definition_metadata or {}).get("columns"))
        frame = to_pandas(table)
        frame.attrs[LOADED_VERSION] = (version, hashlib.sha256(data).hexdigest())
        return frame

    def get_metadata(self, context: dg.OutputContext, obj: pd.DataFrame) -> dict:
        return {"dagster/row_count": len(obj)}


class WarehouseIOManager(dg.ConfigurableIOManagerFactory):
    """Parquet files under `<data root>/warehouse/`, one per asset and run_id; works on any fsspec path."""

    data: DataRoot = Field(description="The data root whose warehouse/ holds the files (the `data` resource).")

    def create_io_manager(self, context: dg.InitResourceContext) -> ParquetWarehouseIOManager:
        return ParquetWarehouseIOManager(base_path=self.data.warehouse)
