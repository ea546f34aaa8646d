"""The data root a command is given (--data, else $FILTER_PIPELINE_DATA, else `data`), checked the same way by
every command: it exists and holds runs/."""

import os

from upath import UPath

from filter_pipeline.cli import complain
from filter_pipeline.rules.descriptions import one_line
from filter_pipeline.settings import DATA_ENV, ENDPOINT_ENV, data_path
from filter_pipeline.storage.files import RUNS_DIR, error_line, open_root


def named(data: str | None) -> str:
    """The data root as the user gave it, for a message: `--data X`, `FILTER_PIPELINE_DATA=X` or the default."""
    if data:
        return f"--data {data}"
    path = data_path(None)
    return f"{DATA_ENV}={path}" if os.environ.get(DATA_ENV) else f"data root {path} (the default)"


def root_problem(root: UPath, data: str | None) -> str | None:
    """Why `root` (opened from `data`, --data) is not a data root, in one line; None when it is. A folder
    without runs/ (one inside the data root, or another one) is refused: a command over it would check
    nothing and find it clean."""
    try:
        exists, has_runs = root.exists(), (root / RUNS_DIR).exists()
    except Exception as exc:  # (an object store that cannot be reached: no credentials, no endpoint, no bucket)
        return f"{named(data)}: cannot be read ({error_line(exc)})"
    if not exists:
        return f"{named(data)}: no such folder (point --data or {DATA_ENV} at the folder that holds {RUNS_DIR}/)"
    if not has_runs and not _is_dir(root):
        return (
            f"{named(data)}: is a file, not a folder (point --data or {DATA_ENV} at the folder that holds {RUNS_DIR}/)"
        )
    if not has_runs:
        return f"{named(data)}: has no {RUNS_DIR}/ folder, so it holds no execution batch ({RUNS_DIR}/<run_id>/); is it the data root?"
    return None


def _is_dir(root: UPath) -> bool:
    try:
        return root.is_dir()
    except Exception:  # (a store that answered exists() but not this: said as no runs/ folder)
        return True


def existing_root(data: str | None) -> UPath | None:
    """The data root `data` (--data) or $FILTER_PIPELINE_DATA names, opened as the stage opens it (with
    $FILTER_PIPELINE_ENDPOINT_URL on S3), for the commands that read it (`verify`, `review`, `explain`,
    `calibrate`). None, after one line on stderr, when that setting is refused or it is not a data root
    (`root_problem`): the command then exits with status 2."""
    try:
        root = open_root(data_path(data), os.environ.get(ENDPOINT_ENV) or None)
    except ValueError as exc:
        complain(str(exc))
        return None
    if problem := root_problem(root, data):
        complain(problem)
        return None
    return root


def unreadable(path: str, exc: OSError) -> str:
    """The one line that says the data root at `path` holds a file or folder a command must read and cannot
    (what the OS said, and which)."""
    where = f": {exc.filename}" if exc.filename else ""
    return f"cannot read the data root {path}: {exc.strerror or one_line(exc)}{where}"
