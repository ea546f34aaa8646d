"""`filter-pipeline verify` and the CLI's side of commits, as a user runs them (separate processes)."""

import json
import subprocess

import pandas as pd
import pytest

from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import CLI, REPO

pytestmark = pytest.mark.slow

LEDGER_FILES = ["prior_dedup_index", "prior_kept_counts", "kept", "surplus", "dpo_pairs", "filter_report"]


def verify(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "verify", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def two_batches(data_root):
    for run_id in ("b1", "b2"):
        tasks = [task(f"{run_id}-{i}", site=f"s{i % 2}", key=["s", "#el", i]) for i in range(6)]
        write_batch(data_root, run_id, tasks, [attempt(t["task_id"]) for t in tasks])


def test_verify_is_clean_after_a_run_and_names_each_finding_after_damage(cli, cli_env, data_root):
    two_batches(data_root)
    assert cli().returncode == 0
    clean = verify(cli_env)
    assert (clean.returncode, clean.stdout) == (0, f"{data_root}: warehouse verified, no finding\n")
    (data_root / "warehouse" / "kept" / "b1.parquet").unlink()
    with open(data_root / "runs" / "b2" / "tasks.jsonl", "a") as f:
        f.write(json.dumps(task("late")) + "\n")
    damaged = verify(cli_env, "--data", str(data_root))
    assert damaged.returncode == 1
    assert damaged.stdout.splitlines() == [
        "warehouse/kept/b1.parquet is missing, but run b1 committed it: restore it, or re-filter b1 with "
        "`filter-pipeline materialize b1`",
        "runs/b2/tasks.jsonl changed since b2 was filtered: re-filter it with `filter-pipeline materialize b2` (it is "
        "not re-filtered unless named)",
    ]
    # the next materialize warns of the changed batch and does not re-filter it unless named
    again = cli()
    assert again.returncode == 0 and "nothing to materialize" in again.stdout
    assert again.stderr.strip() == (
        "filter-pipeline: warning: runs/b2 changed since it was filtered (tasks.jsonl or executions.jsonl differ "
        "from its commit record): re-filter it with `filter-pipeline materialize b2`; it is not re-filtered unless named"
    )


def test_verify_of_a_missing_data_root_exits_2_with_one_line(cli_env, tmp_path):
    done = verify(cli_env, "--data", str(tmp_path / "nope"))
    assert (done.returncode, done.stdout) == (2, "")
    assert (
        done.stderr.strip()
        == f"filter-pipeline: --data {tmp_path / 'nope'}: no such folder (point --data or FILTER_PIPELINE_DATA at "
        "the folder that holds runs/)"
    )


def test_verify_of_a_warehouse_file_it_cannot_read_exits_2_with_one_line(cli, cli_env, data_root):
    two_batches(data_root)
    assert cli().returncode == 0
    record = data_root / "warehouse" / "_commits" / "b1.json"
    record.unlink()
    record.mkdir()  # (read as a file, it fails as a file without read permission or on a failing disk does)
    done = verify(cli_env, "--data", str(data_root))
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.strip() == f"filter-pipeline: cannot read the data root {data_root}: Is a directory: {record}"


def test_verify_of_a_folder_that_is_not_the_data_root_exits_2_rather_than_find_nothing(cli, cli_env, data_root):
    two_batches(data_root)
    assert cli().returncode == 0
    for wrong in (data_root / "warehouse", data_root / "runs"):
        done = verify(cli_env, "--data", str(wrong))
        assert (done.returncode, done.stdout) == (2, ""), done.stdout
        assert done.stderr.strip() == (
            f"filter-pipeline: --data {wrong}: has no runs/ folder, so it holds no execution batch (runs/<run_id>/); "
            "is it the data root?"
        )


def test_a_run_stopped_after_kept_but_before_its_commit_is_completed_by_materialize_naming_no_run(
    cli, cli_env, data_root
):
    two_batches(data_root)
    assert cli().returncode == 0
    before = {a: pd.read_parquet(data_root / "warehouse" / a / "b2.parquet") for a in LEDGER_FILES}
    # what a SIGKILL after kept/b2.parquet is in place leaves: no commit, no surplus, pairs or report
    (data_root / "warehouse" / "_commits" / "b2.json").unlink()
    for asset in ("surplus", "dpo_pairs", "filter_report"):
        (data_root / "warehouse" / asset / "b2.parquet").unlink()
    done = cli()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("b2: judged 6")
    assert (data_root / "warehouse" / "_commits" / "b2.json").exists()
    for asset in LEDGER_FILES:
        pd.testing.assert_frame_equal(
            pd.read_parquet(data_root / "warehouse" / asset / "b2.parquet"), before[asset], obj=asset
        )
    assert verify(cli_env).returncode == 0
