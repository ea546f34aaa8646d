"""The data root of the commands that read it rather than filter it (`verify`, `review`, `explain`, `calibrate`)."""

import os
import sys

from upath import UPath

from filter_pipeline.settings import DATA_ENV, ENDPOINT_ENV, data_path
from filter_pipeline.storage.files import RUNS_DIR, open_root


def existing_root(data: str | None) -> UPath | None:
    """The data root `data` (--data) or $FILTER_PIPELINE_DATA names, opened as the stage opens it (with
    $FILTER_PIPELINE_ENDPOINT_URL on S3). None, after one line on stderr, when that setting is refused, the root
    does not exist or it has no runs/ folder (a folder inside the data root, or another one): the command then
    exits with status 2."""
    path = data_path(data)
    try:
        root = open_root(path, os.environ.get(ENDPOINT_ENV) or None)
    except ValueError as exc:
        print(f"filter-pipeline: {exc}", file=sys.stderr)
        return None
    if not root.exists():
        print(f"filter-pipeline: data root {path} does not exist (--data or ${DATA_ENV})", file=sys.stderr)
        return None
    if not (root / RUNS_DIR).exists():  # (a folder inside the root, or another one: nothing would be checked)
        print(f"filter-pipeline: {path} has no {RUNS_DIR}/ folder, so it holds no execution batch: is it the data "
              f"root? (--data or ${DATA_ENV})", file=sys.stderr)  # fmt: skip
        return None
    return root
