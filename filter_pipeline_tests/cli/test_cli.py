"""The CLI as a user runs it: separate processes on a temp DAGSTER_HOME and data root."""

import json
import shutil
import subprocess
import time

import dagster as dg
import pandas as pd
import pytest

from filter_pipeline.cli import materialize as materialize_module
from filter_pipeline.cli.main import main
from filter_pipeline.settings import EXECUTOR_ENV
from filter_pipeline.shell.jobs import ACROSS_RUNS_ASSETS
from filter_pipeline.storage.publish import STAGING_DIR
from filter_pipeline_tests.builders import attempt, task, write_batch, write_legacy_kept
from filter_pipeline_tests.conftest import CLI, REPO

pytestmark = pytest.mark.slow


def overlapping_batches(data_root, run_ids, n=40):
    """Batches whose tasks share keys across runs, so any double keep would show."""
    for run_id in run_ids:
        tasks = [task(f"{run_id}-{i}", site=f"s{i % 4}", key=["s", "#el", i]) for i in range(n)]
        write_batch(data_root, run_id, tasks, [attempt(t["task_id"]) for t in tasks])


def read_all(data_root, asset) -> pd.DataFrame:
    return pd.read_parquet(data_root / "warehouse" / asset)


def test_materializes_every_complete_batch_in_run_id_order_and_prints_a_summary(cli, data_root, dagster_home):
    write_batch(data_root, "b2", [task("x", key=["k"])], [attempt("x")])
    with open(data_root / "runs" / "b2" / "executions.jsonl", "a") as f:
        f.write("not JSON\n")  # (a rejected line: counted in b2's line)
    write_batch(
        data_root, "b1", [task("y", key=["k"])], [attempt("y"), attempt("y", 2, ok=False, error="policy violation: z")]
    )
    write_batch(data_root, "b3", [task("z")], [attempt("z")], complete=False)

    done = cli()

    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines == [
        "b1: judged 1, unjudged 0, kept 1, surplus 0, failure_pool 1 (policy_violation 1)",
        "b2: judged 1, unjudged 0, kept 0, surplus 1 (duplicate 1), failure_pool 0, rejected lines 1 (batch_rejects)",
        "coverage: 1 kept rows over 1 (macro, site) pairs, 0 full",
    ]
    surplus = read_all(data_root, "surplus")
    assert surplus[["task_id", "dup_of_run_id", "dup_of_task_id"]].values.tolist() == [["x", "b1", "y"]]
    assert not (data_root / "warehouse" / "kept" / "b3.parquet").exists()
    assert "parsed runs/b1" in done.stderr  # progress goes to the run log on stderr
    assert "runs/b3: no _SUCCESS yet (still being written): left out until it is complete" in done.stderr.splitlines()
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        [run] = instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": "b1"}))
        stored = [e.user_message for e in instance.all_logs(run.dagster_run.run_id) if not e.is_dagster_event]
    assert any(m.startswith("parsed runs/b1") for m in stored)  # INFO lines are stored ...
    assert not any("Loading partition" in m or "Writing file at" in m for m in stored)  # ... DEBUG ones are not
    assert across_runs_materialized_by_run(dagster_home) == {"b1": [], "b2": ["coverage", "judge_calibration"]}

    again = cli()
    assert again.returncode == 0 and "nothing to materialize" in again.stdout


def test_the_default_data_root_is_the_folder_data_where_it_runs(cli_env, tmp_path):
    write_batch(tmp_path / "data", "b1", [task("y", key=["k"])], [attempt("y")])
    env = {name: value for name, value in cli_env.items() if name != "FILTER_PIPELINE_DATA"}
    done = subprocess.run([*CLI, "materialize"], env={**env, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "b1: judged 1, unjudged 0, kept 1, surplus 0, failure_pool 0"
    assert (tmp_path / "data" / "warehouse" / "_commits" / "b1.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "batch runs/nope does not exist"),
        (["partial"], "batch runs/partial has no _SUCCESS: still being written (the harness writes it last)"),
        (["notes.txt"], "batch runs/notes.txt is a file, not a batch folder"),
        (["../etc"], "is not a plain folder name"),
        (["--per-site-cap", "-1"], "per_site_cap: must be 0 or more"),
        (["--caps", "/no/such/caps.yaml"], "caps file /no/such/caps.yaml"),
    ],
)
def test_bad_arguments_fail_with_one_line(cli, data_root, args, message):
    write_batch(data_root, "b1", [task("y")], [attempt("y")])
    write_batch(data_root, "partial", [task("z")], [attempt("z")], complete=False)
    (data_root / "runs" / "notes.txt").write_text("what the harness writes beside its batches")
    done = cli(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (data_root / "warehouse").exists()


def test_caps_file_and_per_site_cap_flag(cli, data_root, tmp_path):
    tasks = [task(f"t{i}", macro="m" if i < 4 else "n") for i in range(8)]
    write_batch(data_root, "b1", tasks, [attempt(t["task_id"]) for t in tasks])
    caps = tmp_path / "caps.yaml"
    caps.write_text("per_site_cap: 3\ncaps:\n  m: {site_cap: 1}\n")
    done = cli("--caps", str(caps), "--per-site-cap", "2")
    assert done.returncode == 0, done.stderr
    assert read_all(data_root, "kept")["task_id"].tolist() == ["t0", "t4", "t5"]


def test_a_failing_run_exits_non_zero_with_its_reason(cli, data_root):
    write_batch(data_root, "b1", [task("y")], [attempt("y")])
    (data_root / "retired.json").write_text("{not json")
    done = cli("b1")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "filter-pipeline: retired.json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    )


def across_runs_materialized_by_run(dagster_home) -> dict[str, list[str]]:
    """Run (its partition, or its job's name) -> the across-runs assets it materialized."""
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        found = {}
        for record in instance.get_run_records():
            run = record.dagster_run
            events = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
            names = [e.get_dagster_event().asset_key.path[-1] for e in events]
            assets = sorted(name for name in names if name in ACROSS_RUNS_ASSETS)
            found[run.tags.get("dagster/partition", run.job_name)] = assets
    return found


def test_when_the_last_batch_fails_coverage_is_refreshed_in_a_run_of_its_own(cli, data_root, dagster_home):
    write_batch(data_root, "fine", [task("a")], [attempt("a")])
    write_batch(data_root, "z_empty", [], [])  # last in run_id order too (first walks go in run_id order)
    done = cli("fine", "z_empty")
    assert done.returncode == 1
    assert done.stdout.splitlines()[1].startswith(
        "z_empty: FAILED (step judge_batch: runs/z_empty/tasks.jsonl holds no valid task; full log: run "
    )
    assert done.stdout.splitlines()[2:] == ["coverage: 1 kept rows over 1 (macro, site) pairs, 0 full"]
    assert across_runs_materialized_by_run(dagster_home) == {
        "fine": [], "z_empty": [], "across_runs_job": ["coverage", "judge_calibration"]
    }  # fmt: skip


def test_a_batch_without_tasks_fails_its_run_with_the_reason_and_writes_nothing(cli, data_root):
    write_batch(data_root, "empty", [], [])
    write_batch(data_root, "fine", [task("a")], [attempt("a")])
    done = cli("empty", "fine")
    assert done.returncode == 1
    assert done.stdout.splitlines()[0].startswith(
        "empty: FAILED (step judge_batch: runs/empty/tasks.jsonl holds no valid task; full log: run "
    )
    assert done.stdout.splitlines()[1].startswith("fine: judged 1")
    assert sorted(p.name for p in (data_root / "warehouse").rglob("*.parquet") if p.stem == "empty") == []


def runs_of(dagster_home, partition: str) -> int:
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        return len(instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": partition})))


def test_a_refused_batch_is_tried_again_only_once_its_files_change_and_never_once_retired(cli, data_root, dagster_home):
    write_batch(data_root, "a_empty", [], [])
    write_batch(data_root, "b_fine", [task("a")], [attempt("a")])
    assert cli().returncode == 1 and runs_of(dagster_home, "a_empty") == 1
    again = cli()  # (it could only fail the same way: said, with what to do, and not launched)
    assert again.returncode == 1 and runs_of(dagster_home, "a_empty") == 1
    assert again.stderr.strip().splitlines()[-1] == (
        "runs/a_empty: refused before its walk, and its files are unchanged since (runs/a_empty/tasks.jsonl holds "
        "no valid task): correct them (a `filter-pipeline materialize` then walks it), name it to try it again as it "
        "is, or retire the run in retired.json"
    )
    (data_root / "retired.json").write_text('[{"run_id": "a_empty", "reason": "a broken export"}]')
    retired = cli()
    assert (retired.returncode, retired.stderr) == (0, "") and runs_of(dagster_home, "a_empty") == 1
    assert retired.stdout.splitlines()[0] == "nothing to materialize: no complete batch is waiting to be filtered"
    (data_root / "retired.json").unlink()
    write_batch(data_root, "a_empty", [task("x")], [attempt("x")])  # corrected
    fixed = cli()
    assert fixed.returncode == 0 and fixed.stdout.startswith("a_empty: judged 1")
    assert not (data_root / "warehouse" / "_failed" / "a_empty.json").exists()


def test_a_legacy_run_named_is_filtered_and_not_also_recorded_as_materialized_by_its_legacy_file(cli, data_root):
    write_batch(data_root, "legacy", [task("a")], [attempt("a")])
    write_legacy_kept(data_root, "legacy", ("a", ["k1"], "m", "s"))
    named = cli("legacy")
    assert named.returncode == 0, named.stderr
    assert named.stdout.splitlines()[0] == "legacy: judged 1, unjudged 0, kept 1, surplus 0, failure_pool 0"
    assert "recorded as materialized" not in named.stdout
    again = cli()  # (committed now: no longer a legacy run)
    assert again.returncode == 0 and "recorded as materialized" not in again.stdout


def test_a_run_another_walk_commits_after_this_call_planned_it_is_reported_as_filtered_not_walked_again(
    cli_env, data_root, dagster_home, tmp_path, monkeypatch, capsys
):
    """Planned as first walks, r1 and r2 stay first walks when a laptop's CLI on the same warehouse commits them
    before this call's runs start: walked again, r1 would count r2's keys as history."""
    write_batch(data_root, "r1", [task("t1", key=["x", 1]), task("t2", key=["x", 2])], [attempt("t1"), attempt("t2")])
    write_batch(data_root, "r2", [task("u1", key=["x", 2])], [attempt("u1")])
    other_home = tmp_path / "other_home"
    shutil.copytree(dagster_home, other_home)
    commits = data_root / "warehouse" / "_commits"
    walked: dict[str, str] = {}
    register = materialize_module._register

    def another_walk_commits_them_first(instance, run_ids):
        if run_ids:  # (not the legacy runs' registration, of none here)
            other = {**cli_env, "DAGSTER_HOME": str(other_home)}
            done = subprocess.run([*CLI, "materialize"], env=other, cwd=REPO, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            walked.update({r: json.loads((commits / f"{r}.json").read_text())["walked_at"] for r in ("r1", "r2")})
        register(instance, run_ids)

    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    monkeypatch.setenv("FILTER_PIPELINE_DATA", str(data_root))
    monkeypatch.setattr(materialize_module, "_register", another_walk_commits_them_first)
    assert main(["materialize"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("r1: already filtered by another walk") and out[1].startswith("r2: already filtered")
    assert {r: json.loads((commits / f"{r}.json").read_text())["walked_at"] for r in ("r1", "r2")} == walked


def test_two_runs_launched_together_never_keep_a_key_twice(cli_env, data_root, dagster_home):
    overlapping_batches(data_root, ["b1", "b2"])
    dg.DagsterInstance.from_config(str(dagster_home)).dispose()  # an existing instance, as a user's would be
    # b2 alone would be refused (it must wait for b1's first walk): the second process names both
    procs = [
        subprocess.Popen(
            [*CLI, "materialize", *run_ids],
            env=cli_env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run_ids in (["b1"], ["b1", "b2"])
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err

    kept = read_all(data_root, "kept")
    assert kept["dedup_key"].is_unique
    assert len(kept) == 12  # 40 keys, 4 sites x per_site_cap 3: whichever run walks first keeps them all

    # and the two walks really were one after the other: from reading history (the "prior index" log line)
    # to the last check on what was written: the ledger lease on the data root lets one walk at a time.
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        spans = []
        for record in instance.get_run_records(dg.RunsFilter(job_name="filter_job")):
            events = [e for e in instance.all_logs(record.dagster_run.run_id) if e.step_key == "ledger"]
            walked = [e.timestamp for e in events if e.user_message.startswith("prior index")]
            if not walked:  # b1 asked twice: the run that waited found it filtered and did not walk it again
                assert any("already filtered by another walk" in e.user_message for e in events)
                continue
            start = min(walked)
            end = max(e.timestamp for e in events if e.dagster_event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION)
            spans.append((start, end))
        spans.sort()
        assert len(spans) >= 2, spans  # b1 and b2 (b1 again only if one process planned after the other committed it)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), f"ledger walks overlapped: {spans}"


def big_batch(data_root, run_id, n):
    tasks = [task(f"t{i}", site=f"s{i % 50}", key=["s", "#el", i]) for i in range(n)]
    write_batch(data_root, run_id, tasks, [attempt(t["task_id"]) for t in tasks])


def test_a_run_killed_while_writing_kept_leaves_nothing_partial_and_reruns_identically(
    cli, cli_env, tmp_path, data_root
):
    big_batch(data_root, "big", 120_000)
    reference = tmp_path / "reference"
    shutil.copytree(data_root, reference)

    def temp_files():  # (a walk writes under a staging folder of its own until it publishes)
        staging = data_root / "warehouse" / STAGING_DIR
        return [p for d in ("kept", "surplus") for p in staging.glob(f"*/warehouse/{d}/.*.tmp")]

    proc = subprocess.Popen([*CLI, "materialize", "big", "--per-site-cap", "100000"], env=cli_env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    caught = []
    while proc.poll() is None and not caught:
        caught = temp_files()
        if not caught:
            time.sleep(0.0005)
    proc.kill()
    proc.wait()
    assert caught, "the run finished before a kept/surplus write could be interrupted"
    assert not (data_root / "warehouse" / "kept" / "big.parquet").exists()  # the half-written file never got the name

    assert cli("big", "--per-site-cap", "100000").returncode == 0
    done = cli("big", "--per-site-cap", "100000", env={"FILTER_PIPELINE_DATA": str(reference)})
    assert done.returncode == 0
    leftovers = [p for p in (data_root / "warehouse").rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert leftovers == []
    assert not (data_root / "warehouse" / STAGING_DIR).exists() or not any(
        (data_root / "warehouse" / STAGING_DIR).iterdir()
    )
    for asset in ("judge_verdicts", "failure_pool", "prior_dedup_index", "kept", "surplus"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(data_root / "warehouse" / asset / "big.parquet"),
            pd.read_parquet(reference / "warehouse" / asset / "big.parquet"),
        )
    assert len(pd.read_parquet(data_root / "warehouse" / "kept" / "big.parquet")) == 120_000


def test_the_in_process_and_multiprocess_executors_write_the_same_outputs(cli, data_root, tmp_path, dagster_home):
    shutil.copytree(REPO / "data" / "runs", data_root / "runs", dirs_exist_ok=True)  # the sample batches
    shutil.copy(REPO / "data" / "labels.jsonl", data_root)
    other = tmp_path / "multiprocess"
    shutil.copytree(data_root, other)
    assert "coverage:" in cli().stdout  # the default: in_process
    assert cli(env={"FILTER_PIPELINE_DATA": str(other), EXECUTOR_ENV: "multiprocess"}).returncode == 0
    written = sorted(p.relative_to(data_root) for p in (data_root / "warehouse").rglob("*.parquet"))
    assert written == sorted(p.relative_to(other) for p in (other / "warehouse").rglob("*.parquet"))
    assert len(written) > 20
    for path in written:
        pd.testing.assert_frame_equal(pd.read_parquet(data_root / path), pd.read_parquet(other / path), obj=str(path))
