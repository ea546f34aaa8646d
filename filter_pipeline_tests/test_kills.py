"""Kills at every write boundary (CONTRACT §4: a kill at any point leaves the run pending, and any launcher
completes it): the CLI SIGKILLed at random moments many times, then completed; `verify` is clean and every
output equals an uninterrupted run's, row by row."""

import os
import random
import shutil
import signal
import subprocess
import time

import pandas as pd
import pytest

from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import CLI, REPO

pytestmark = pytest.mark.slow

KILLS = 12
COMPARED = [
    "judge_verdicts",
    "failure_pool",
    "prior_dedup_index",
    "prior_kept_counts",
    "kept",
    "surplus",
    "dpo_pairs",
    "filter_report",
]


def batches(data_root):
    """Three batches sharing keys, with failures (DPO negatives) and a cap that binds."""
    for n, run_id in enumerate(("b1", "b2", "b3")):
        tasks = [task(f"{run_id}-{i}", site=f"s{i % 5}", key=["s", "#el", (i + 7 * n) % 40]) for i in range(60)]
        attempts = [attempt(t["task_id"], 1, ok=False, error="assertion failed: no") for t in tasks[::3]]
        attempts += [attempt(t["task_id"], 2) for t in tasks]
        write_batch(data_root, run_id, tasks, attempts)


def start(env) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "materialize"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def test_random_kills_then_completion_give_exactly_the_uninterrupted_outputs(cli_env, data_root, tmp_path):
    batches(data_root)
    reference = tmp_path / "reference"
    shutil.copytree(data_root, reference)
    home = tmp_path / "reference_home"
    shutil.copytree(cli_env["DAGSTER_HOME"], home)
    started = time.monotonic()
    ref = subprocess.run([*CLI, "materialize"], env={**cli_env, "FILTER_PIPELINE_DATA": str(reference), "DAGSTER_HOME": str(home)},
                         cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    whole = time.monotonic() - started

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    finished_early = 0
    for kill in range(KILLS):
        proc = start(cli_env)
        # the first kill lands in the first half of a run from scratch: a call that finishes leaves the ones after
        # it nothing to interrupt
        time.sleep(rng.uniform(0.5, whole / 2 if kill == 0 else whole))
        if proc.poll() is not None:
            finished_early += 1
            continue
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert finished_early < KILLS, f"seed {seed}: nothing was interrupted"

    done = subprocess.run([*CLI, "materialize"], env=cli_env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-3000:]}"
    verified = subprocess.run([*CLI, "verify"], env=cli_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, f"seed {seed}: {verified.stdout}"
    for asset in COMPARED:
        for run_id in ("b1", "b2", "b3"):
            pd.testing.assert_frame_equal(
                pd.read_parquet(data_root / "warehouse" / asset / f"{run_id}.parquet"),
                pd.read_parquet(reference / "warehouse" / asset / f"{run_id}.parquet"),
                obj=f"seed {seed}: {asset}/{run_id}",
            )
    leftovers = [p for p in (data_root / "warehouse").rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == [], f"seed {seed}"
