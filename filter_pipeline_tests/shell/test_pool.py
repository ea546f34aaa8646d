"""The ledger pool's guard on SQLite instances: the ledger step holds an OS lock in DAGSTER_HOME, so two
processes never walk at once even when Dagster's SQLite slot claim lets both through."""

import fcntl
import subprocess
import time

import dagster as dg
import pytest

from filter_pipeline.shell.pool import LOCK_FILE, ledger_lock
from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import CLI, REPO

pytestmark = pytest.mark.slow


def test_the_ledger_step_waits_for_the_lock_and_then_runs(cli_env, data_root, dagster_home):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    dg.DagsterInstance.from_config(str(dagster_home)).dispose()
    with open(dagster_home / LOCK_FILE, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's ledger step, as far as b1 can tell
        proc = subprocess.Popen([*CLI, "materialize", "b1"], env=cli_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        verdicts = data_root / "warehouse" / "failure_pool" / "b1.parquet"
        deadline = time.time() + 120
        while not verdicts.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(2)  # ample time for an unguarded ledger step to write
        assert proc.poll() is None and verdicts.exists()
        assert not (data_root / "warehouse" / "kept" / "b1.parquet").exists()
        fcntl.flock(held, fcntl.LOCK_UN)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.startswith("b1: judged 1, unjudged 0, kept 1")


def test_only_sqlite_instances_take_the_file_lock(tmp_path):
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance, ledger_lock(instance):
        assert (tmp_path / LOCK_FILE).exists()
    ephemeral = tmp_path / "ephemeral"
    ephemeral.mkdir()
    with dg.DagsterInstance.ephemeral(tempdir=str(ephemeral)) as instance, ledger_lock(instance):  # in memory: one process
        assert not (ephemeral / LOCK_FILE).exists()
