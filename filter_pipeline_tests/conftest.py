import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A ledger step waiting for a lower run retries for hours by default; a test that left a lower batch unwalked by
# mistake fails within minutes instead (tests of the wait set their own, shorter, value; subprocesses inherit it)
os.environ.setdefault("FILTER_PIPELINE_ORDER_MAX_WAIT_SECONDS", "300")
CLI = [sys.executable, "-m", "filter_pipeline.cli.main"]


@pytest.fixture
def dagster_home(tmp_path) -> Path:
    """A fresh instance folder with the project's dagster.yaml, as `make setup` writes."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
    return home


@pytest.fixture
def instance():
    """A Dagster instance of its own for the test, in memory: Dagster's own SQL storage on an in-memory SQLite
    database, without the disk writes that make most of a Dagster test's time on an instance in a folder. The
    tests of what lives on disk (the CLI's runs, `dagster dev`, the deployment) or of runs written from several
    threads at once make theirs in a folder."""
    import dagster as dg

    with dg.DagsterInstance.ephemeral() as instance:
        yield instance


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


@pytest.fixture
def started() -> list:
    """Processes a test started; any still running (a stopped walk after a failed assertion) is killed."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3-compatible server on loopback for the whole session (skips, with the reason, if it cannot start)."""
    from filter_pipeline_tests.servers import MotoS3, ServerUnavailable

    try:
        server = MotoS3(tmp_path_factory.mktemp("moto"))
    except ServerUnavailable as exc:
        pytest.skip(f"S3-compatible server unavailable: {exc}")
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request) -> str:
    """A fresh bucket on the S3 server, with the standard AWS variables pointing at it; returns its name."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    name = request.node.name.lower()
    # (the name's digest tells apart parametrized tests whose names differ only past the cut)
    readable = "".join(c if c.isalnum() else "-" for c in name)[:42].strip("-")
    bucket = f"t-{readable}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    s3_server.filesystem().mkdir(bucket)
    return bucket


@pytest.fixture
def s3_faults(s3_server):
    """A loopback proxy in front of the S3 server that answers chosen requests as other stores or a bad network
    do (`filter_pipeline_tests/s3_faults.py`); point a client at its `endpoint`."""
    from filter_pipeline_tests.s3_faults import S3Faults

    with S3Faults(s3_server.endpoint) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL cluster on loopback with a `dagster` database (skips, with the reason, if it cannot
    start)."""
    from filter_pipeline_tests.servers import PostgresCluster, ServerUnavailable

    try:
        cluster = PostgresCluster()
        cluster.create_database(PostgresCluster.DB)
    except ServerUnavailable as exc:
        pytest.skip(f"PostgreSQL server unavailable: {exc}")
    yield cluster
    cluster.stop()


def assert_verified(data_root) -> None:
    """What `filter-pipeline verify` audits holds on the warehouse under `data_root` (a path or UPath): every
    committed file present and unchanged, no key kept twice, caps held with history, every run conserved."""
    from upath import UPath

    from filter_pipeline.storage.audit import audit

    findings = audit(data_root if isinstance(data_root, UPath) else UPath(str(data_root)))
    assert not findings, "\n".join(f.line for f in findings)
