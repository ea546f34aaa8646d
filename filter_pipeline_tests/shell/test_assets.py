"""The assets under Dagster: lineage, metadata, and the ledger over several runs."""

import logging
import os

import dagster as dg
import pandas as pd
import pytest

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.jobs import ACROSS_RUNS_ASSETS
from filter_pipeline.shell.warehouse import DataRoot
from filter_pipeline.storage.parquet import read_parquet
from filter_pipeline_tests.builders import attempt, rows, task, write_batch, write_legacy_kept

ASSETS = [
    "batch_tasks",
    "batch_attempts",
    "batch_rejects",
    "judge_verdicts",
    "failure_pool",
    "prior_dedup_index",
    "prior_kept_counts",
    "kept",
    "surplus",
    "dpo_pairs",
    "coverage",
    "filter_report",
    "judge_calibration",
]


def materialize(instance, data_root, run_id, caps=None) -> dg.ExecuteInProcessResult:
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    if run_id not in instance.get_dynamic_partitions("run_id"):
        instance.add_dynamic_partitions("run_id", [run_id])
    run_config = {"ops": {"ledger": {"config": caps}}} if caps else {}
    return defs.resolve_job_def("filter_job").execute_in_process(
        instance=instance, partition_key=run_id, run_config=run_config, raise_on_error=False
    )


def output(data_root, asset, run_id) -> pd.DataFrame:
    return pd.read_parquet(data_root / "warehouse" / asset / f"{run_id}.parquet")


def metadata(result, asset) -> dict:
    [mat] = [m for m in result.get_asset_materialization_events() if m.asset_key.path[-1] == asset]
    return {k: v.value for k, v in mat.materialization.metadata.items()}


def test_lineage_descriptions_groups_and_schemas():
    graph = build_defs("data", JudgeResource(), caps={}).resolve_asset_graph()
    assert sorted(k.path[-1] for k in graph.get_all_asset_keys()) == sorted(ASSETS)
    parents = {k.path[-1]: sorted(p.path[-1] for p in graph.get(k).parent_keys) for k in graph.get_all_asset_keys()}
    assert parents["judge_verdicts"] == ["batch_attempts", "batch_tasks"]
    assert parents["failure_pool"] == ["batch_attempts", "batch_rejects", "batch_tasks", "judge_verdicts"]
    assert parents["kept"] == ["judge_verdicts", "prior_dedup_index", "prior_kept_counts"]
    assert parents["surplus"] == ["judge_verdicts", "prior_dedup_index", "prior_kept_counts"]
    assert parents["dpo_pairs"] == ["failure_pool", "kept"]
    assert parents["filter_report"] == ["batch_attempts", "failure_pool", "judge_verdicts", "kept", "surplus"]
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.description and node.group_name != "default", key
        assert "dagster/column_schema" in node.metadata, key
        assert key.path[-1] in ACROSS_RUNS_ASSETS or node.partitions_def.name == "run_id", key


def test_whole_graph_for_one_partition_with_counts_in_metadata(instance, data_root):
    write_batch(
        data_root,
        "r1",
        [task("a", key=["k"]), task("b", key=["k"]), task("c")],
        [attempt("a"), attempt("b"), attempt("c", ok=False, error="backend check failed: none"), "{broken"],
    )
    result = materialize(instance, data_root, "r1")
    assert result.success
    assert metadata(result, "kept")["dagster/row_count"] == 1
    assert metadata(result, "surplus")["dropped/duplicate"] == 1
    assert metadata(result, "failure_pool")["reason/backend_fail"] == 1
    assert metadata(result, "failure_pool")["reason/judge_fail"] == 0
    assert metadata(result, "batch_rejects")["file/executions.jsonl"] == 1
    assert metadata(result, "judge_verdicts")["passed"] == 2
    assert output(data_root, "kept", "r1")["run_id"].tolist() == ["r1"]


def test_the_ledger_starts_first_of_the_steps_ready_after_the_batch_is_judged(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    result = materialize(instance, data_root, "r1")
    started = [e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_START]
    assert started[:2] == ["judge_batch", "ledger"]


def test_one_step_materializes_the_batch_its_verdicts_and_its_failures_each_before_its_checks(instance, data_root):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b", ok=False, error="x")])
    result = materialize(instance, data_root, "r1")
    events = [
        e.asset_key.path[-1] if e.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION
        else e.asset_check_evaluation_data.check_name
        for e in result.all_events
        if e.step_key == "judge_batch" and e.event_type in (
            dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.ASSET_CHECK_EVALUATION
        )
    ]  # fmt: skip
    assert events == [
        "batch_tasks", "batch_attempts", "batch_rejects", "judge_verdicts", "all_tasks_judged",
        "failure_pool", "attempts_conserved", "execute_rows_match_failed_attempts",
    ]  # fmt: skip


def test_rematerializing_a_run_ignores_its_own_earlier_kept_rows(instance, data_root):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    assert materialize(instance, data_root, "r1").success
    first = output(data_root, "kept", "r1")
    assert materialize(instance, data_root, "r1").success
    pd.testing.assert_frame_equal(output(data_root, "kept", "r1"), first)
    assert output(data_root, "surplus", "r1").empty


def test_later_run_sees_earlier_runs_kept_rows_and_caps(instance, data_root):
    write_batch(data_root, "r1", [task(f"a{i}") for i in range(3)], [attempt(f"a{i}") for i in range(3)])
    write_batch(data_root, "r2", [task("b", key=["s", "#el", "a0"]), task("c")], [attempt("b"), attempt("c")])
    assert materialize(instance, data_root, "r1").success
    assert materialize(instance, data_root, "r2").success
    surplus = output(data_root, "surplus", "r2")
    assert rows(surplus, "task_id", "dropped", "dup_of_run_id", "dup_of_task_id") == [
        ["b", "duplicate", "r1", "a0"],
        ["c", "site_cap", None, None],
    ]
    index = output(data_root, "prior_dedup_index", "r2")
    assert index[["dedup_key", "run_id", "task_id"]].values.tolist() == [['["s","#el","a0"]', "r1", "a0"]]
    assert output(data_root, "prior_kept_counts", "r2")["n_kept"].tolist() == [3]


def test_nonsense_caps_fail_the_ledger_with_a_clear_message(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    result = materialize(instance, data_root, "r1", caps={"per_site_cap": -2})
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert "must be 0 or more, got -2" in str(failure.step_failure_data.error.cause or failure.step_failure_data.error)
    assert not (data_root / "warehouse" / "kept").exists()


def test_a_batch_with_no_valid_task_fails_its_run_with_one_line_saying_why(instance, data_root):
    write_batch(data_root, "r1", [], [])
    (data_root / "runs" / "r1" / "tasks.jsonl").write_text("garbage\n")
    result = materialize(instance, data_root, "r1")
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    error = failure.step_failure_data.error  # (what the UI shows first: not Dagster's wrapper)
    assert (failure.step_key, error.cls_name) == ("judge_batch", "Failure")
    assert error.message.strip().endswith(
        ": runs/r1/tasks.jsonl holds no valid task (1 line(s) rejected, first: tasks.jsonl:1: line is not JSON "
        "(Expecting value at column 1))"
    )


def step_failure(result) -> tuple[str, str, str]:
    [event] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    error = event.step_failure_data.error
    return event.step_key, error.cls_name, error.message


def test_a_partition_key_that_is_not_a_plain_run_id_fails_in_one_line_and_reads_or_writes_nothing(instance, data_root):
    # the UI registers any key: `../outside` names a complete batch beside runs/, and files beside warehouse/<asset>/
    write_batch(data_root, "outside", [task("a")], [attempt("a")]).rename(data_root / "outside")
    result = materialize(instance, data_root, "../outside")
    step, cls, message = step_failure(result)
    assert (step, cls) == ("judge_batch", "Failure") and "is not a plain folder name" in message
    assert not (data_root / "warehouse").exists()
    instance.add_dynamic_partitions("run_id", ["../x"])
    ledger_only = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("ledger_job")
    result = ledger_only.execute_in_process(instance=instance, partition_key="../x", raise_on_error=False)
    step, cls, message = step_failure(result)
    assert (step, cls) == ("ledger", "Failure") and "is not a plain folder name" in message


def test_a_batch_still_being_written_is_not_filtered_when_launched_by_hand(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")], complete=False)  # no _SUCCESS yet
    result = materialize(instance, data_root, "r1")
    step, cls, message = step_failure(result)
    assert (step, cls) == ("judge_batch", "Failure")
    assert "Failure: runs/r1 has no _SUCCESS: still being written (the harness writes it last); nothing is" in message
    assert "materialize it again once it is complete" in message  # (the sensor leaves it to whoever registered it)
    assert not (data_root / "warehouse" / "_commits").exists() and not (data_root / "warehouse" / "_failed").exists()
    result = materialize(instance, data_root, "gone")  # registered, its folder removed since
    assert "Failure: runs/gone does not exist (its partition outlived it?)" in step_failure(result)[2]


def test_coverage_counts_every_non_retired_run(instance, data_root):
    write_batch(data_root, "r1", [task("a"), task("b", site="s2")], [attempt("a"), attempt("b")])
    write_batch(data_root, "r2", [task("c")], [attempt("c")])
    assert materialize(instance, data_root, "r1").success
    assert materialize(instance, data_root, "r2").success
    (data_root / "retired.json").write_text('[{"run_id": "r2", "reason": "bad build"}]')
    job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("across_runs_job")
    result = job.execute_in_process(
        instance=instance, run_config={"ops": {"coverage": {"config": {"per_site_cap": 1}}}}
    )
    table = pd.read_parquet(data_root / "warehouse" / "coverage.parquet")
    assert rows(table, "level", "macro", "site", "kept", "limit", "full") == [
        ["macro", "m", None, 2, None, None],
        ["site", "m", "s", 1, 1, True],
        ["site", "m", "s2", 1, 1, True],
    ]
    assert metadata(result, "coverage")["full_sites"] == 2
    assert metadata(result, "coverage")["coverage"].count("](data:image/svg+xml;base64,") == 1


def test_coverage_of_a_warehouse_whose_history_cannot_be_read_fails_in_one_line_naming_why(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    assert materialize(instance, data_root, "r1").success
    job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("across_runs_job")
    (data_root / "warehouse" / "kept" / "r1.parquet").unlink()
    step, cls, message = step_failure(job.execute_in_process(instance=instance, raise_on_error=False))
    assert (step, cls) == ("coverage", "Failure") and "warehouse/kept/r1.parquet is missing" in message
    assert "`filter-pipeline verify` lists every finding" in message and "Traceback" not in message
    (data_root / "retired.json").write_text('{"run_id": "r1"}')  # not a list of entries
    step, cls, message = step_failure(job.execute_in_process(instance=instance, raise_on_error=False))
    assert (step, cls) == ("coverage", "Failure") and "retired.json" in message and "Traceback" not in message


def test_judge_calibration_reads_labels_across_runs(instance, data_root):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b", ok=False, error="x")])
    assert materialize(instance, data_root, "r1").success
    (data_root / "labels.jsonl").write_text(
        '{"dir": "runs/r/traj/a/1", "success": true}\n{"run_id": "r1", "task_id": "b", "success": false}\n'
    )
    job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("across_runs_job")
    assert job.execute_in_process(instance=instance).success
    table = pd.read_parquet(data_root / "warehouse" / "judge_calibration.parquet")
    gate = table[(table["predictor"] == "gate") & (table["site"] == "(all)")]
    assert gate[["n", "tp", "tn", "agreement"]].values.tolist() == [[2, 1, 1, 1.0]]


def test_bad_lines_in_labels_jsonl_are_reported_by_judge_calibration_without_failing_the_run(instance, data_root):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b", ok=False, error="x")])
    bad = ["not json", '{"dir": "x", "success": "yes"}'] * 12  # 24 bad lines: 20 shown, all counted
    (data_root / "labels.jsonl").write_text("\n".join(['{"dir": "runs/r/traj/a/1", "success": true}', *bad]) + "\n")
    result = materialize(instance, data_root, "r1")
    assert result.success  # the batch's run, with judge_calibration in it
    meta = metadata(result, "judge_calibration")
    assert (meta["labels"], meta["matched"], meta["rejected_lines"]) == (1, 1, 24)
    assert meta["rejects"].count("- `labels.jsonl:") == 20 and "`labels.jsonl:2: not JSON" in meta["rejects"]
    logged = instance.all_logs(result.run_id)
    warnings = [e.user_message for e in logged if e.step_key == "judge_calibration" and e.level == logging.WARNING]
    assert (
        len(warnings) == 21
        and warnings[0].startswith("labels.jsonl:2: not JSON")
        and "4 more line(s) rejected" in warnings[-1]
    )
    assert output(data_root, "kept", "r1")["task_id"].tolist() == ["a"]


def test_a_labels_jsonl_that_cannot_be_read_is_warned_by_judge_calibration_without_failing_the_run(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    (data_root / "labels.jsonl").mkdir()  # (read as a file, it fails as one without read permission does)
    result = materialize(instance, data_root, "r1")
    assert result.success and output(data_root, "kept", "r1")["task_id"].tolist() == ["a"]
    meta = metadata(result, "judge_calibration")
    assert (meta["labels"], meta["labels_fingerprint"]) == (0, "unreadable labels.jsonl")
    logged = instance.all_logs(result.run_id)
    [warning] = [e.user_message for e in logged if e.step_key == "judge_calibration" and e.level == logging.WARNING]
    assert warning.startswith("labels.jsonl cannot be read") and "no label counts until it can be" in warning


def test_a_batchs_rejected_lines_are_warned_by_the_judge_step_20_of_them_then_a_count(instance, data_root):
    orphans = [attempt(f"ghost{i}") for i in range(23)]  # attempts of tasks not in tasks.jsonl: rejected lines
    write_batch(data_root, "r1", [task("a")], [attempt("a"), *orphans])
    result = materialize(instance, data_root, "r1")
    assert result.success
    logged = instance.all_logs(result.run_id)
    warnings = [e.user_message for e in logged if e.step_key == "judge_batch" and e.level == logging.WARNING]
    assert len(warnings) == 21 and all("which is not in tasks.jsonl" in w for w in warnings[:20])
    assert warnings[-1] == "runs/r1: 3 more rejected line(s) (batch_rejects)"
    assert len(output(data_root, "batch_rejects", "r1")) == 23


def test_labels_naming_no_attempt_are_warned_by_judge_calibration_and_counted(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    (data_root / "labels.jsonl").write_text(
        '{"dir": "runs/r/traj/a/1", "success": true}\n{"dir": "runs/r/traj/a/1/", "success": true}\n'
    )
    result = materialize(instance, data_root, "r1")
    assert result.success
    meta = metadata(result, "judge_calibration")
    assert (meta["labels"], meta["matched"], meta["unmatched"]) == (2, 1, 1)
    logged = instance.all_logs(result.run_id)
    warnings = [e.user_message for e in logged if e.step_key == "judge_calibration" and e.level == logging.WARNING]
    assert warnings == [
        "labels.jsonl:2: names no attempt of a parsed batch (dir 'runs/r/traj/a/1/'): a typo, or a batch not "
        "parsed yet (it counts once it matches)"
    ]


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_on_s3_with_only_the_endpoint_setting_every_asset_reaches_the_store(s3_server, monkeypatch, instance):
    # no AWS_ENDPOINT_URL: the endpoint comes from the DataRoot setting alone, across-runs assets included
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3_server.filesystem().mkdir("endpoint-only")
    data = DataRoot(path="s3://endpoint-only/data", endpoint_url=s3_server.endpoint)
    write_batch(data.root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b", ok=False, error="x")])
    (data.root / "labels.jsonl").write_text('{"run_id": "r1", "task_id": "a", "success": true}\n')
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(data, JudgeResource(), caps={})
    assert defs.resolve_job_def("filter_job").execute_in_process(instance=instance, partition_key="r1").success
    assert defs.resolve_job_def("across_runs_job").execute_in_process(instance=instance).success
    table = read_parquet(data.warehouse / "judge_calibration.parquet")
    gate = table[(table["predictor"] == "gate") & (table["site"] == "(all)")]
    assert gate[["n", "tp"]].values.tolist() == [[1, 1]]
    assert read_parquet(data.warehouse / "coverage.parquet")["kept"].max() == 1


def run_job(instance, data_root, job: str, run_id: str, judge: JudgeResource | None = None, **options):
    defs = build_defs(str(data_root), judge or JudgeResource(), caps={})
    if run_id not in instance.get_dynamic_partitions("run_id"):
        instance.add_dynamic_partitions("run_id", [run_id])
    return defs.resolve_job_def(job).execute_in_process(
        instance=instance, partition_key=run_id, raise_on_error=False, **options
    )


def test_a_filtered_run_judged_by_a_run_that_does_not_walk_it_is_refused_in_one_line(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    assert materialize(instance, data_root, "r1").success
    verdicts = (data_root / "warehouse" / "judge_verdicts" / "r1.parquet").read_bytes()
    step, cls, message = step_failure(run_job(instance, data_root, "judge_job", "r1"))
    assert (step, cls) == ("judge_batch", "Failure")
    assert "r1 is already filtered, and this run judges it without walking it again" in message
    judging = ["batch_tasks", "batch_attempts", "batch_rejects", "judge_verdicts", "failure_pool"]
    judging_alone = run_job(
        instance, data_root, "filter_job", "r1", asset_selection=[dg.AssetKey(name) for name in judging]
    )  # (the judging step's assets alone, as "Materialize selected" launches them)
    assert "r1 is already filtered" in step_failure(judging_alone)[2]
    assert (data_root / "warehouse" / "judge_verdicts" / "r1.parquet").read_bytes() == verdicts
    assert materialize(instance, data_root, "r1").success  # judged and walked again: allowed


def test_a_legacy_run_judged_by_a_run_that_does_not_walk_it_is_refused_as_a_filtered_one_is(instance, data_root):
    write_batch(data_root, "old", [task("a"), task("b")], [attempt("a"), attempt("b")])
    write_legacy_kept(data_root, "old", ("a", ["k", 1], "m", "s"))  # (filtered by the earlier script)
    step, cls, message = step_failure(run_job(instance, data_root, "judge_job", "old"))
    assert (step, cls) == ("judge_batch", "Failure") and "old is already filtered" in message
    assert not (data_root / "warehouse" / "judge_verdicts").exists()


def test_an_llm_judge_that_cannot_work_fails_the_judge_step_in_one_line_before_anything_is_written(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    step, cls, message = step_failure(run_job(instance, data_root, "judge_job", "r1", JudgeResource(kind="llm")))
    assert (step, cls) == ("judge_batch", "Failure")
    assert "the llm judge needs FILTER_JUDGE_BASE_URL and FILTER_JUDGE_MODEL" in message
    assert not (data_root / "warehouse").exists()


def test_a_ledger_run_for_a_batch_never_judged_fails_in_one_line_saying_what_to_do(instance, data_root):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    step, cls, message = step_failure(run_job(instance, data_root, "ledger_job", "r1"))
    assert (step, cls) == ("ledger", "Failure")
    assert "warehouse/batch_attempts/r1.parquet does not exist: materialize the batch r1 with filter_job" in message


def filter_job_over_the_data_env() -> dg.JobDefinition:
    """`filter_job` over the data root FILTER_PIPELINE_DATA names, for `dg.reconstructable` (which caches a job
    by its function for the whole process: this test's own, not the CLI's, whose tests use other data roots)."""
    from filter_pipeline.settings import DATA_ENV

    return build_defs(os.environ[DATA_ENV], JudgeResource(), caps={}).resolve_job_def("filter_job")


def test_the_judge_step_of_a_filtered_run_re_executed_alone_is_refused(tmp_path, data_root, monkeypatch):
    from filter_pipeline.settings import DATA_ENV

    monkeypatch.setenv(DATA_ENV, str(data_root))
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    verdicts = data_root / "warehouse" / "judge_verdicts" / "r1.parquet"
    job = dg.reconstructable(filter_job_over_the_data_env)
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        instance.add_dynamic_partitions("run_id", ["r1"])
        first = dg.execute_job(job, instance, tags={"dagster/partition": "r1"})
        assert first.success
        before = verdicts.read_bytes()
        judge_step_alone = dg.ReexecutionOptions(first.run_id, step_selection=["judge_batch"])
        partition = {"dagster/partition": "r1"}
        with dg.execute_job(job, instance, tags=partition, reexecution_options=judge_step_alone) as again:
            assert not again.success
            assert "r1 is already filtered, and this run judges it without walking it again" in step_failure(again)[2]
    assert verdicts.read_bytes() == before
