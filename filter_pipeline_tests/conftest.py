import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "filter_pipeline.cli"]


@pytest.fixture
def dagster_home(tmp_path) -> Path:
    """A fresh instance folder with the project's dagster.yaml (ledger pool limit 1), as `make setup` writes."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
    return home


@pytest.fixture
def data_root(tmp_path) -> Path:
    root = tmp_path / "data"
    (root / "runs").mkdir(parents=True)
    return root


@pytest.fixture
def cli_env(dagster_home, data_root) -> dict:
    """Environment of a user shell pointed at the temp instance and data root."""
    return {**os.environ, "DAGSTER_HOME": str(dagster_home), "FILTER_PIPELINE_DATA": str(data_root)}


@pytest.fixture
def cli(cli_env):
    """Run `filter-pipeline materialize ARGS` as a separate process, the way a user runs it."""

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*CLI, "materialize", *args],
            env={**cli_env, **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run
