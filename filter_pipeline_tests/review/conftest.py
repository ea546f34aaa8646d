"""A filtered copy of the sample data root (with hostile content planted in it) and a review app served by a
real uvicorn on loopback."""

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from upath import UPath

from filter_pipeline.review.app import create_app
from filter_pipeline.review.data import Warehouse
from filter_pipeline_tests.conftest import CLI, REPO
from filter_pipeline_tests.review.small_warehouse import write_run
from filter_pipeline_tests.servers import free_port

HOSTILE_TASK = "2026-11-28-t004"  # its judged attempt's page text carries a script
SCRIPT = "<script>document.title='owned'</script>"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16  # enough for a content check
REVIEW_URL = "http://review.test:8765/"  # filter_report's materializations link there
SECRET_FILE = "secret.txt"  # outside the data root: the path-traversal attempts aim at it


def _plant(root: Path) -> None:
    """A script in one page text, a screenshot in a judged attempt, a symlinked screenshot pointing out, and two
    rejected lines in 2026-11-29's executions.jsonl."""
    folder = root / "runs" / "2026-11-28" / "traj" / HOSTILE_TASK / "1"
    record = json.loads((folder / "trajectory.json").read_text())
    record["final"]["observation"] = f"before {SCRIPT} after"
    (folder / "trajectory.json").write_text(json.dumps(record))
    (folder / "step-1.png").write_bytes(PNG)
    (root.parent / SECRET_FILE).write_text("do not serve me")
    (folder / "leak.png").symlink_to(root.parent / SECRET_FILE)
    with open(root / "runs" / "2026-11-29" / "executions.jsonl", "a") as f:  # two lines its checks reject
        f.write('not json\n{"task_id": "ghost", "attempt": 1, "ok": true, "dir": "traj/ghost/1", "steps": []}\n')


@pytest.fixture(scope="session")
def filtered_sample(tmp_path_factory) -> Path:
    """The sample batches filtered by the CLI (gate judge), with `_plant`'s content: built once per session."""
    base = tmp_path_factory.mktemp("review")
    root = base / "data"
    shutil.copytree(REPO / "data" / "runs", root / "runs", ignore=shutil.ignore_patterns("warehouse"))
    shutil.copy(REPO / "data" / "labels.jsonl", root / "labels.jsonl")
    _plant(root)
    home = base / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(home), "FILTER_PIPELINE_DATA": str(root),
           "FILTER_PIPELINE_REVIEW_URL": REVIEW_URL}  # fmt: skip
    done = subprocess.run([*CLI, "materialize"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return root


@pytest.fixture
def sample_root(filtered_sample, tmp_path) -> Path:
    """A private copy of the filtered sample (labels written by one test stay in it)."""
    root = tmp_path / "data"
    shutil.copytree(filtered_sample, root, symlinks=True)  # (leak.png still points out of the data root)
    return root


class Served:
    """A uvicorn server running the review app in a thread on a free loopback port."""

    def __init__(self, root: UPath, labeler: str = "tester", **app_options):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(root, labeler, **app_options)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the review app did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def served(sample_root):
    app = Served(UPath(str(sample_root)))
    yield app
    app.stop()


@pytest.fixture
def warehouse(tmp_path) -> Warehouse:
    """The small warehouse: run r1 committed (with the judge's newer columns), r2 not committed yet."""
    write_run(tmp_path, "r1", newer_columns=True)
    write_run(tmp_path, "r2", committed=False)
    return Warehouse(UPath(str(tmp_path)))
