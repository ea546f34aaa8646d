"""Two Dagster instances over one warehouse (CONTRACT §4: walks never overlap on one warehouse): two CLI
processes with different DAGSTER_HOMEs on the same data root, two batches carrying the same 30 new keys."""

import os
import shutil
import subprocess

import pandas as pd
import pytest
from upath import UPath

from filter_pipeline.storage.audit import audit
from filter_pipeline.storage.parquet import read_parquet
from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import CLI, REPO

pytestmark = pytest.mark.slow

ROUNDS = 3
KEYS = 30


def homes(tmp_path, n=2) -> list[str]:
    found = []
    for i in range(n):
        home = tmp_path / f"home{i}"
        home.mkdir()
        shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
        found.append(str(home))
    return found


def race(root: UPath, env: dict, tmp_path) -> None:
    """ROUNDS rounds; in each, two batches with the same KEYS new keys, one per site, launched at once by two
    instances. Asserts each round's keys are kept exactly once in total."""
    dagster_homes = homes(tmp_path)
    for n in range(ROUNDS):
        pair = [f"r{n}a", f"r{n}b"]
        for run_id in pair:
            tasks = [task(f"{run_id}-{i}", site=f"site{i}", key=["s", "#el", f"round{n}", i]) for i in range(KEYS)]
            write_batch(root, run_id, tasks, [attempt(t["task_id"]) for t in tasks])
        # the second names both: alone, r<n>b would be refused (its first walk must follow r<n>a's)
        procs = [
            subprocess.Popen(
                [*CLI, "materialize", *run_ids],
                env={**env, "DAGSTER_HOME": home},
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for run_ids, home in zip([pair[:1], pair], dagster_homes)
        ]
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
        kept = pd.concat([read_parquet(root / "warehouse" / "kept" / f"{r}.parquet") for r in pair])
        assert len(kept) == KEYS and kept["dedup_key"].is_unique, f"round {n}: {len(kept)} kept rows"
    assert audit(root) == []


def test_two_instances_on_one_local_warehouse_keep_each_key_once(tmp_path, data_root):
    env = {**os.environ, "FILTER_PIPELINE_DATA": str(data_root)}
    race(UPath(data_root), env, tmp_path)


def test_two_instances_on_one_s3_warehouse_keep_each_key_once(tmp_path, s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/data"
    env = {**os.environ, "FILTER_PIPELINE_DATA": url, "FILTER_PIPELINE_ENDPOINT_URL": s3_server.endpoint}
    race(UPath(url, endpoint_url=s3_server.endpoint, use_listings_cache=False), env, tmp_path)
