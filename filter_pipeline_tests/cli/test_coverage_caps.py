"""Coverage is the warehouse's, at the deployment's caps (CONTRACT §4 caps): a run walked again with a one-off
cap says so in its own report and commit only; the warehouse-wide coverage stays at the deployment's caps."""

import json

import pytest

from filter_pipeline.storage.parquet import read_parquet
from filter_pipeline_tests.builders import attempt, task, write_batch

pytestmark = pytest.mark.slow


def test_coverage_after_a_one_off_cap_keeps_the_deployments_caps(cli, data_root):
    # 3 sites x 3 tasks, distinct keys: at the deployment's cap (3 per site) every site is full
    tasks = [task(f"r1-{i}", site=f"site{i % 3}", key=["s", "#el", i]) for i in range(9)]
    write_batch(data_root, "r1", tasks, [attempt(t["task_id"]) for t in tasks])
    first = cli("r1")
    assert first.returncode == 0, first.stderr[-3000:]
    line = "coverage: 9 kept rows over 3 (macro, site) pairs, 3 full"
    assert line in first.stdout
    again = cli("r1", "--per-site-cap", "10")
    assert again.returncode == 0, again.stderr[-3000:]
    assert line in again.stdout  # not "0 full", as it would be at limit 10
    coverage = read_parquet(data_root / "warehouse" / "coverage.parquet")
    assert coverage[coverage["level"] == "site"]["full"].astype(bool).all()
    record = json.loads((data_root / "warehouse" / "_commits" / "r1.json").read_text())
    assert record["caps_source"] == "run config" and record["caps"]["per_site_cap"] == 10


def test_materialize_naming_no_run_refreshes_coverage_when_retired_json_changed(cli, data_root):
    tasks = [task(f"r1-{i}", site=f"site{i}", key=["s", "#el", i]) for i in range(3)]
    write_batch(data_root, "r1", tasks, [attempt(t["task_id"]) for t in tasks])
    assert cli().returncode == 0
    (data_root / "retired.json").write_text(json.dumps([{"run_id": "r1", "task_ids": ["r1-0"], "reason": "bad"}]))
    refreshed = cli()
    assert refreshed.returncode == 0, refreshed.stderr[-3000:]
    assert refreshed.stdout.splitlines() == [
        "nothing to materialize: no complete batch is waiting to be filtered",
        "retired.json changed since coverage was built: refreshing it",
        "coverage: 2 kept rows over 2 (macro, site) pairs, 0 full",
    ]
    assert "refreshing" not in cli().stdout  # up to date now
    # a folder the stage refuses fails the call (exit 1), but does not hold back the refresh
    (data_root / "runs" / "bad name").mkdir()
    (data_root / "runs" / "bad name" / "_SUCCESS").touch()
    (data_root / "retired.json").write_text("[]")
    despite = cli()
    assert despite.returncode == 1 and "runs/bad name: refused" in despite.stderr, despite.stderr[-3000:]
    assert despite.stdout.splitlines() == [
        "retired.json changed since coverage was built: refreshing it",
        "coverage: 3 kept rows over 3 (macro, site) pairs, 0 full",
    ]
