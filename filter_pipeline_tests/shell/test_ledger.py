"""The ledger step under Dagster (CONTRACT §4): it commits what it wrote, reads only verified committed
history, and a run is filtered only once committed."""

import json
import logging

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from upath import UPath

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.sensors import build_batch_sensor
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.audit import audit
from filter_pipeline.storage.history import read_commits
from filter_pipeline.storage.runs import complete_batches
from filter_pipeline_tests.builders import LogLines, attempt, sensor_context, task, write_batch

pytestmark = pytest.mark.slow  # (each test runs the whole job in process, several seconds a run)

LEDGER_FILES = ["prior_dedup_index", "prior_kept_counts", "kept", "surplus", "dpo_pairs", "filter_report"]


def materialize(instance, data_root, run_id, caps=None) -> dg.ExecuteInProcessResult:
    if run_id not in instance.get_dynamic_partitions("run_id"):
        instance.add_dynamic_partitions("run_id", [run_id])
    run_config = {"ops": {"ledger": {"config": caps}}} if caps else {}
    return (
        build_defs(str(data_root), JudgeResource(), caps={})
        .resolve_job_def("filter_job")
        .execute_in_process(instance=instance, partition_key=run_id, run_config=run_config, raise_on_error=False)
    )


def failure(result) -> str:
    [event] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    error = event.step_failure_data.error
    error = error.cause or error
    qualified, _, text = error.message.strip().partition(": ")  # ("pkg.module.Error", "why")
    return f"{event.step_key}: {text if qualified.endswith(error.cls_name) else error.message.strip()}"


def same_keys_batches(data_root, *run_ids, n=3):
    """Batches carrying the same n keys, on n sites (so no cap interferes)."""
    for run_id in run_ids:
        tasks = [task(f"{run_id}-{i}", site=f"s{i}", key=["s", "#el", i]) for i in range(n)]
        write_batch(data_root, run_id, tasks, [attempt(t["task_id"]) for t in tasks])


def kept(data_root, run_id) -> list[str]:
    return pd.read_parquet(data_root / "warehouse" / "kept" / f"{run_id}.parquet")["task_id"].tolist()


def filtered(data_root) -> dict[str, bool]:
    data = DataRoot(path=str(data_root))
    return {b.run_id: b.filtered for b in complete_batches(data.runs, data.warehouse)}


def test_a_walk_commits_every_file_it_wrote_with_sizes_hashes_caps_judge_inputs_and_history(instance, data_root):
    same_keys_batches(data_root, "r1", "r2")
    assert materialize(instance, data_root, "r1").success
    assert materialize(instance, data_root, "r2", caps={"per_site_cap": 2}).success
    records = read_commits(UPath(data_root) / "warehouse")
    r1, r2 = records["r1"], records["r2"]
    assert sorted(r2.files) == sorted([*LEDGER_FILES, "filter_report_html"])
    for asset in LEDGER_FILES:
        entry = r2.files[asset]
        assert entry["path"] == f"warehouse/{asset}/r2.parquet"
        assert entry["size"] == (data_root / entry["path"]).stat().st_size
        assert entry["rows"] == len(pd.read_parquet(data_root / entry["path"]))
    assert (r1.kept_keys, r2.kept_keys) == (3, 0)
    assert (r1.caps_source, r1.caps) == ("deployment", {"per_site_cap": 3, "caps": {}})
    assert (r2.caps_source, r2.caps) == ("run config", {"per_site_cap": 2, "caps": {}})
    assert r2.judge == {"kind": "gate", "model": None, "prompt_version": None, "votes": "gate", "settings": None}
    assert r2.history == {"r1": r1.digest}
    assert sorted(r2.inputs) == ["executions.jsonl", "tasks.jsonl"] and r2.unjudged == 0
    assert audit(UPath(data_root)) == []


def test_a_run_another_launcher_committed_while_this_one_judged_it_keeps_the_committed_verdicts(data_root, monkeypatch):
    same_keys_batches(data_root, "r1")
    committed = {}
    real = JudgeResource.judge

    def judged_while_another_launcher_commits(self, requests, *args, **kwargs):
        monkeypatch.setattr(JudgeResource, "judge", real)  # (the other launcher judges as usual)
        with dg.DagsterInstance.ephemeral() as laptop:  # (another Dagster instance on the same warehouse)
            assert materialize(laptop, data_root, "r1").success
        for asset in ("judge_verdicts", "failure_pool", "kept"):
            committed[asset] = pq.read_table(data_root / "warehouse" / asset / "r1.parquet").to_pylist()
        judgement = real(self, requests, *args, **kwargs)
        judgement.verdicts["passed"] = False  # this one's verdicts differ (the LLM's votes at a temperature)
        return judgement

    monkeypatch.setattr(JudgeResource, "judge", judged_while_another_launcher_commits)
    with dg.DagsterInstance.ephemeral() as deployment:
        result = materialize(deployment, data_root, "r1")
    assert result.success and len(committed["kept"]) == 3
    for asset in ("judge_verdicts", "failure_pool", "kept"):  # (written over, kept rows would be judge failures)
        assert pq.read_table(data_root / "warehouse" / asset / "r1.parquet").to_pylist() == committed[asset], asset
    [said] = [m.metadata["already_filtered"].value for m in result.asset_materializations_for_node("judge_batch")
              if m.asset_key.path[-1] == "judge_verdicts"]  # fmt: skip
    assert said.startswith("r1: already filtered by another walk") and "while this run waited or judged" in said
    assert audit(UPath(data_root)) == []


def test_a_walk_whose_verdicts_another_judge_step_wrote_again_meanwhile_commits_nothing(
    instance, data_root, monkeypatch
):
    from filter_pipeline.shell import ledger
    from filter_pipeline.storage.parquet import encode, write_bytes

    same_keys_batches(data_root, "r1")
    verdicts = UPath(data_root / "warehouse" / "judge_verdicts" / "r1.parquet")
    real, other = ledger.build_prior_index, {"content": False}

    def judged_again_meanwhile(*args, **kwargs):  # (another launcher's judge step writes its verdicts now)
        if other["content"]:
            write_bytes(encode(pd.read_parquet(verdicts.path).assign(passed=False), "judge_verdicts")[1], verdicts)
        else:  # (as a second gate judging writes them: the same bytes, a new file)
            write_bytes(verdicts.read_bytes(), verdicts)
        return real(*args, **kwargs)

    monkeypatch.setattr(ledger, "build_prior_index", judged_again_meanwhile)
    assert materialize(instance, data_root, "r1").success  # (the same verdicts written again: no matter)
    same_keys_batches(data_root, "r2")
    verdicts, other["content"] = UPath(data_root / "warehouse" / "judge_verdicts" / "r2.parquet"), True
    result = materialize(instance, data_root, "r2")
    assert not result.success and "judge_verdicts/r2.parquet written again with other content" in failure(result)
    assert sorted(read_commits(UPath(data_root / "warehouse"))) == ["r1"]  # (kept rows would contradict them)
    monkeypatch.setattr(ledger, "build_prior_index", real)
    assert materialize(instance, data_root, "r2").success and audit(UPath(data_root)) == []


def test_the_asset_checks_still_run_and_the_across_runs_job_carries_the_warehouse_audit(instance, data_root):
    same_keys_batches(data_root, "r1")
    result = materialize(instance, data_root, "r1")
    evaluations = {(e.asset_check_evaluation_data.check_name, e.asset_check_evaluation_data.passed)
                   for e in result.all_events if e.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION}  # fmt: skip
    assert {("verdicts_conserved", True), ("no_key_kept_twice", True), ("caps_respected", True)} <= evaluations
    assert "warehouse_verified" not in {name for name, _ in evaluations}  # the batch's run: its own checks only
    job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("across_runs_job")
    audit_run = job.execute_in_process(instance=instance)
    assert {(e.check_name, e.passed) for e in audit_run.get_asset_check_evaluations()} == {("warehouse_verified", True)}
    with open(data_root / "runs" / "r1" / "tasks.jsonl", "a") as f:
        f.write("\n")  # (changed since it was filtered: a finding)
    [found] = job.execute_in_process(instance=instance).get_asset_check_evaluations()
    assert (found.passed, found.severity) == (False, dg.AssetCheckSeverity.WARN)  # (a warning, as the UI says)
    (data_root / "warehouse" / "kept" / "r1.parquet").unlink()
    with pytest.raises(Exception):  # coverage itself cannot count a missing committed file
        job.execute_in_process(instance=instance)


def test_a_walk_that_breaks_an_invariant_commits_nothing_and_materializes_nothing(instance, data_root, monkeypatch):
    from filter_pipeline.rules import checks

    same_keys_batches(data_root, "r1")
    monkeypatch.setattr(checks, "no_key_kept_twice", lambda kept, others: checks.CheckOutcome(False, {}, "twice"))
    result = materialize(instance, data_root, "r1")
    assert not result.success
    assert read_commits(UPath(data_root) / "warehouse") == {}
    assert not (data_root / "warehouse" / "kept" / "r1.parquet").exists()
    # the UI shows the partition failed on its check, never materialized with files that were not published
    materialized = {
        e.asset_key.path[-1] for e in result.all_events if e.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION
    }
    assert materialized & set(LEDGER_FILES) == set()
    kept_def = build_defs(str(data_root), JudgeResource(), caps={}).resolve_assets_def("kept")
    status = instance.get_status_by_partition(dg.AssetKey("kept"), ["r1"], kept_def.partitions_def)
    assert status == {"r1": dg.AssetPartitionStatus.FAILED}
    said = [e.user_message for e in instance.all_logs(result.run_id) if "not committed" in e.user_message]
    assert said == ["r1: not committed (no_key_kept_twice failed): nothing of this walk is kept"]


def test_a_deleted_committed_kept_file_fails_the_next_walk_with_one_line_instead_of_keeping_its_keys_again(
    instance, data_root
):
    same_keys_batches(data_root, "r1", "r2")
    assert materialize(instance, data_root, "r1").success
    (data_root / "warehouse" / "kept" / "r1.parquet").unlink()
    result = materialize(instance, data_root, "r2")
    assert not result.success
    assert failure(result) == (
        "ledger: warehouse/kept/r1.parquet is missing, but run r1 committed it: restore it, or re-filter r1 with "
        "`filter-pipeline materialize r1`"
    )
    assert not filtered(data_root)["r2"] and not (data_root / "warehouse" / "kept" / "r2.parquet").exists()
    assert materialize(instance, data_root, "r1").success  # what the line says to do
    assert materialize(instance, data_root, "r2").success
    assert (kept(data_root, "r1"), kept(data_root, "r2")) == (["r1-0", "r1-1", "r1-2"], [])


def test_a_kept_file_rewritten_by_another_tool_is_refused_and_its_keys_are_never_kept_twice(instance, data_root):
    same_keys_batches(data_root, "r1", "r2")
    assert materialize(instance, data_root, "r1").success
    path = data_root / "warehouse" / "kept" / "r1.parquet"
    frame = pd.read_parquet(path)
    frame["dedup_key"] = [json.dumps(json.loads(k)) for k in frame["dedup_key"]]  # json.dumps defaults: ", "
    pq.write_table(pa.Table.from_pandas(frame.drop(columns=["key_hash"]), preserve_index=False), path)
    result = materialize(instance, data_root, "r2")
    assert not result.success
    assert failure(result).startswith("ledger: warehouse/kept/r1.parquet changed since run r1 was committed (sha256 ")
    [event] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert event.step_failure_data.error.cls_name == "Failure"  # (the UI shows its line, not a traceback)
    assert not (data_root / "warehouse" / "kept" / "r2.parquet").exists()


def test_a_walk_stopped_after_kept_but_before_its_commit_leaves_the_run_pending_and_the_next_walk_completes_it(
    instance, data_root
):
    same_keys_batches(data_root, "r1")
    assert materialize(instance, data_root, "r1").success
    before = {a: pd.read_parquet(data_root / "warehouse" / a / "r1.parquet") for a in LEDGER_FILES}
    # the state a SIGKILL leaves after kept/r1.parquet is in place: no commit, no surplus, pairs or report
    (data_root / "warehouse" / "_commits" / "r1.json").unlink()
    for asset in ("surplus", "dpo_pairs", "filter_report"):
        (data_root / "warehouse" / asset / "r1.parquet").unlink()
    assert filtered(data_root) == {"r1": False}
    assert [f.kind for f in audit(UPath(data_root))] == ["uncommitted"]
    assert materialize(instance, data_root, "r1").success
    assert filtered(data_root) == {"r1": True} and audit(UPath(data_root)) == []
    for asset in LEDGER_FILES:
        pd.testing.assert_frame_equal(
            pd.read_parquet(data_root / "warehouse" / asset / "r1.parquet"), before[asset], obj=asset
        )


def test_an_uncommitted_kept_file_of_another_run_is_not_history(instance, data_root):
    same_keys_batches(data_root, "r1", "r2")
    assert materialize(instance, data_root, "r1").success
    (data_root / "warehouse" / "_commits" / "r1.json").unlink()  # r1's walk never committed
    # ... and its batch is being written again (no _SUCCESS): r2's first walk need not wait for it
    (data_root / "runs" / "r1" / "_SUCCESS").unlink()
    assert materialize(instance, data_root, "r2").success
    assert kept(data_root, "r2") == ["r2-0", "r2-1", "r2-2"]


def test_a_batch_rewritten_between_its_judging_and_its_walk_commits_what_was_judged_and_is_reported_changed(
    instance, data_root
):
    same_keys_batches(data_root, "r1")
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    judged = defs.resolve_job_def("judge_job").execute_in_process(instance=instance, partition_key="r1")
    assert judged.success
    judged_tasks = (data_root / "runs" / "r1" / "tasks.jsonl").read_bytes()
    with open(data_root / "runs" / "r1" / "tasks.jsonl", "a") as f:  # the harness ran the batch again
        f.write(json.dumps(task("late")) + "\n")
    walked = defs.resolve_job_def("ledger_job").execute_in_process(instance=instance, partition_key="r1")
    assert walked.success
    assert kept(data_root, "r1") == ["r1-0", "r1-1", "r1-2"]  # the verdicts of the batch as judged
    recorded = read_commits(UPath(data_root) / "warehouse")["r1"].inputs["tasks.jsonl"]
    assert recorded["size"] == len(judged_tasks)
    data = DataRoot(path=str(data_root))
    assert [(b.filtered, b.changed) for b in complete_batches(data.runs, data.warehouse)] == [(True, True)]
    logged = [e.user_message for e in instance.all_logs(walked.run_id) if e.level == logging.WARNING]
    assert [line for line in logged if "changed since it was judged" in line] == [
        "runs/r1 changed since it was judged (tasks.jsonl): the walk commits the verdicts of the files as they "
        "were, and the run is then reported as changed; re-filter it with `filter-pipeline materialize r1`"
    ]


def test_the_walk_commits_the_fingerprints_its_verdicts_were_judged_from_not_a_later_judging(instance, data_root):
    same_keys_batches(data_root, "r1")
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    judge = defs.resolve_job_def("judge_job")
    assert judge.execute_in_process(instance=instance, partition_key="r1").success
    verdicts_file = data_root / "warehouse" / "judge_verdicts" / "r1.parquet"
    first_verdicts, judged_size = verdicts_file.read_bytes(), (data_root / "runs" / "r1" / "tasks.jsonl").stat().st_size
    with open(data_root / "runs" / "r1" / "tasks.jsonl", "a") as f:
        f.write(json.dumps(task("late")) + "\n")
    assert judge.execute_in_process(instance=instance, partition_key="r1").success  # judged again meanwhile...
    verdicts_file.write_bytes(first_verdicts)  # ... after the walk loaded the first judging's verdicts
    assert defs.resolve_job_def("ledger_job").execute_in_process(instance=instance, partition_key="r1").success
    assert read_commits(UPath(data_root) / "warehouse")["r1"].inputs["tasks.jsonl"]["size"] == judged_size
    data = DataRoot(path=str(data_root))
    assert [(b.filtered, b.changed) for b in complete_batches(data.runs, data.warehouse)] == [(True, True)]
    # what a user reading the files finds: the verdicts' own fingerprints, none in the files walked from them
    assert pd.read_parquet(verdicts_file).attrs["judged_inputs"]["tasks.jsonl"]["size"] == judged_size
    assert pd.read_parquet(data_root / "warehouse" / "kept" / "r1.parquet").attrs == {}


def without_judged_inputs(path):
    """The verdicts file as an earlier version of this project wrote it: no fingerprints in its metadata."""
    table = pq.read_table(path)
    pandas_metadata = json.loads(table.schema.metadata[b"pandas"])
    assert pandas_metadata.pop("attributes")["judged_inputs"]["tasks.jsonl"]["sha256"]
    pq.write_table(table.replace_schema_metadata({b"pandas": json.dumps(pandas_metadata)}), path)


def test_verdicts_judged_by_the_earlier_version_are_walked_with_the_fingerprints_it_recorded(instance, data_root):
    same_keys_batches(data_root, "r1")
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    assert defs.resolve_job_def("judge_job").execute_in_process(instance=instance, partition_key="r1").success
    verdicts_file = data_root / "warehouse" / "judge_verdicts" / "r1.parquet"
    judged = pd.read_parquet(verdicts_file).attrs["judged_inputs"]
    without_judged_inputs(verdicts_file)  # as the earlier version wrote them, with its record beside them
    (data_root / "warehouse" / "_judged_inputs").mkdir()
    (data_root / "warehouse" / "_judged_inputs" / "r1.json").write_text(json.dumps(judged))
    with open(data_root / "runs" / "r1" / "tasks.jsonl", "a") as f:  # rewritten before its first walk
        f.write(json.dumps(task("late")) + "\n")
    assert defs.resolve_job_def("ledger_job").execute_in_process(instance=instance, partition_key="r1").success
    assert read_commits(UPath(data_root) / "warehouse")["r1"].inputs == judged
    data = DataRoot(path=str(data_root))
    assert [(b.filtered, b.changed) for b in complete_batches(data.runs, data.warehouse)] == [(True, True)]


def test_a_rewalk_of_a_changed_batch_judged_without_fingerprints_keeps_it_reported_changed(instance, data_root):
    same_keys_batches(data_root, "r1")
    assert materialize(instance, data_root, "r1").success
    without_judged_inputs(data_root / "warehouse" / "judge_verdicts" / "r1.parquet")
    with open(data_root / "runs" / "r1" / "tasks.jsonl", "a") as f:
        f.write(json.dumps(task("late")) + "\n")
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    rewalk = defs.resolve_job_def("ledger_job").execute_in_process(instance=instance, partition_key="r1")
    assert rewalk.success  # (a re-walk alone, from the launchpad: the old verdicts walked again)
    data = DataRoot(path=str(data_root))
    assert [(b.filtered, b.changed) for b in complete_batches(data.runs, data.warehouse)] == [(True, True)]


def test_a_batch_changed_since_it_was_filtered_is_reported_by_the_sensor_and_not_rerun(instance, data_root):
    same_keys_batches(data_root, "r1")
    assert materialize(instance, data_root, "r1").success
    data = DataRoot(path=str(data_root))
    assert [b.changed for b in complete_batches(data.runs, data.warehouse)] == [False]
    with open(data_root / "runs" / "r1" / "tasks.jsonl", "a") as f:
        f.write(json.dumps(task("late")) + "\n")
    assert [(b.filtered, b.changed) for b in complete_batches(data.runs, data.warehouse)] == [(True, True)]
    context = sensor_context(instance, data.path)
    collected = LogLines(logging.WARNING)
    context.log.addHandler(collected)
    result = build_batch_sensor()(context)
    assert [line for line in collected.lines if "changed" in line] == [
        "runs/r1 changed since it was filtered (tasks.jsonl or executions.jsonl differ from its commit record): "
        "re-filter it with `filter-pipeline materialize r1`; it is not re-filtered unless named"
    ]
    assert [r for r in result.run_requests if r.job_name != "across_runs_job"] == []
