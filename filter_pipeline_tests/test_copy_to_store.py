"""scripts/copy_to_store.py: inputs copied to the store; bad input answered in one line, exit 2."""

import os
import subprocess
import sys

import pytest

from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import REPO

pytestmark = pytest.mark.slow


def copy_to_store(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/copy_to_store.py", *args], cwd=REPO, env=os.environ,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_batch_is_copied_to_the_store(data_root, s3_server, s3_bucket):
    write_batch(data_root, "r1", [task("t1")], [attempt("t1")])
    done = copy_to_store(str(data_root), f"s3://{s3_bucket}/data")
    assert done.returncode == 0, done.stderr
    assert s3_server.filesystem().exists(f"{s3_bucket}/data/runs/r1/tasks.jsonl")


@pytest.mark.parametrize("target", ["s3://Not_A_Valid_Bucket!/data", "s3://"])
def test_an_invalid_bucket_is_one_line_without_a_traceback(data_root, s3_server, monkeypatch, target):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    write_batch(data_root, "r1", [task("t1")], [attempt("t1")])
    refused = copy_to_store(str(data_root), target)
    assert refused.returncode == 2
    assert len(refused.stderr.splitlines()) == 1 and refused.stderr.startswith("copy_to_store: "), refused.stderr


def test_a_missing_source_folder_is_one_line(tmp_path, s3_bucket):
    refused = copy_to_store(str(tmp_path / "nowhere"), f"s3://{s3_bucket}/data")
    assert refused.returncode == 2 and refused.stderr.strip().endswith(
        "(give the local data root, the folder that holds runs/)"
    )
