"""Where data lives: the data root resource and the Parquet IO manager over `<data>/warehouse/`.

Both take the data root from the same `DataRoot` resource, so the ledger step, which reads other runs'
`kept` files directly, always looks where the IO manager writes.
"""

import functools
import os
from collections.abc import Iterable

import dagster as dg
import pandas as pd
from pydantic import Field
from upath import UPath

from filter_pipeline.rules.batch import check_run_id
from filter_pipeline.rules.schemas import (
    JUDGE_PROGRESS_FOLDER,
    SCHEMAS,
)
from filter_pipeline.settings import DATA_ENV, DEFAULT_DATA, ENDPOINT_ENV, data_path
from filter_pipeline.storage.files import (
    RUNS_DIR,
    WAREHOUSE_DIR,
    asset_file,
    open_root,
    run_folder,
)
from filter_pipeline.storage.parquet import encode, read_versioned, write_bytes


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
        """The partition's whole frame, with the version it was read at (`storage.parquet.read_versioned`); a
        partition key that is not a plain run_id, or a file that is not there, is a one-line failure."""
        if context.has_asset_partitions:
            _plain_keys(tuple(context.asset_partition_keys))
        try:
            return read_versioned(path)
        except FileNotFoundError:  # (a ledger_job launched for a batch never judged, say)
            raise dg.Failure(
                description=f"warehouse/{path.parent.name}/{path.name} does not exist: materialize the batch "
                f"{path.stem} with filter_job (it judges the batch, then walks it)",
                allow_retries=False,
            ) from None

    def get_metadata(self, context: dg.OutputContext, obj: pd.DataFrame) -> dict:
        return {"dagster/row_count": len(obj)}


class WarehouseIOManager(dg.ConfigurableIOManagerFactory):
    """Parquet files under `<data root>/warehouse/`, one per asset and run_id; works on any fsspec path."""

    data: DataRoot = Field(description="The data root whose warehouse/ holds the files (the `data` resource).")

    def create_io_manager(self, context: dg.InitResourceContext) -> ParquetWarehouseIOManager:
        return ParquetWarehouseIOManager(base_path=self.data.warehouse)
