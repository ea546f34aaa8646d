"""The deployment's caps are every launcher's default (the launchpad's scaffold included); invalid caps from
a run config are refused before any step writes anything or calls the judge."""

import dagster as dg
import pytest

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.config import load_caps_file
from filter_pipeline_tests.builders import attempt, task, write_batch

DEPLOYMENT = {"per_site_cap": 1, "caps": {"m": {"site_cap": 2, "target": 5}}}


def config_default(job: dg.JobDefinition, op: str) -> dict:
    """What the launchpad scaffolds for an op's config: the default in the job's run config schema."""
    ops = job.run_config_schema.config_type.fields["ops"].config_type
    return ops.fields[op].config_type.fields["config"].default_value


def test_the_launchpad_default_is_the_deployments_caps(tmp_path):
    caps_file = tmp_path / "caps.yaml"
    caps_file.write_text("per_site_cap: 1\ncaps:\n  m: {site_cap: 2, target: 5}\n")
    defs = build_defs("data", JudgeResource(), caps=load_caps_file(caps_file))
    for job in ("filter_job", "ledger_job"):
        assert config_default(defs.resolve_job_def(job), "ledger") == {**DEPLOYMENT, "include_judge_failures": False}
    assert config_default(defs.resolve_job_def("across_runs_job"), "coverage") == DEPLOYMENT
    # no deployment caps: the built-in defaults
    assert config_default(build_defs("data", JudgeResource(), caps={}).resolve_job_def("filter_job"), "ledger") == {
        "per_site_cap": 3, "caps": {}, "include_judge_failures": False
    }  # fmt: skip


def test_a_run_without_caps_config_walks_with_the_deployments_caps(instance, data_root):
    tasks = [task(f"t{i}", site="s") for i in range(4)] + [task("n1", macro="n", site="s")]
    write_batch(data_root, "r1", tasks, [attempt(t["task_id"]) for t in tasks])
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(str(data_root), JudgeResource(), caps=DEPLOYMENT)
    result = defs.resolve_job_def("filter_job").execute_in_process(instance=instance, partition_key="r1")
    assert result.success
    kept = [m for m in result.get_asset_materialization_events() if m.asset_key.path[-1] == "kept"][0]
    assert kept.materialization.metadata["dagster/row_count"].value == 3  # m: site_cap 2; n: per_site_cap 1
    assert kept.materialization.metadata["caps_source"].value == "deployment"

    again = defs.resolve_job_def("ledger_job").execute_in_process(
        instance=instance, partition_key="r1", run_config={"ops": {"ledger": {"config": {"per_site_cap": 4}}}}
    )
    kept = [m for m in again.get_asset_materialization_events() if m.asset_key.path[-1] == "kept"][0]
    assert kept.materialization.metadata["caps_source"].value == "run config"
    [run_report] = [m for m in again.get_asset_materialization_events() if m.asset_key.path[-1] == "filter_report"]
    assert run_report.materialization.metadata["caps_source"].value == "run config"
    said = [e.user_message for e in instance.all_logs(again.run_id) if "caps from the run config" in e.user_message]
    assert said == ['caps from the run config, not the deployment\'s: {"per_site_cap": 4, "caps": {"m": '
                    '{"site_cap": 2, "target": 5}}}']  # fmt: skip


@pytest.mark.parametrize("caps", [{"per_site_cap": -1}, {"caps": {"m": {"site_cap": -3}}}])
def test_a_negative_cap_in_the_run_config_is_refused_before_any_step_writes_or_judges(instance, data_root, caps):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    result = defs.resolve_job_def("filter_job").execute_in_process(
        instance=instance, partition_key="r1", run_config={"ops": {"ledger": {"config": caps}}}, raise_on_error=False
    )
    assert not result.success
    started = [e.step_key for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_START]
    assert started == ["judge_batch"]  # refused at its start: nothing parsed, written or judged
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert "must be 0 or more" in failure.step_failure_data.error.message
    assert not (data_root / "warehouse").exists()


@pytest.mark.parametrize("job, op", [("ledger_job", "ledger"), ("across_runs_job", "coverage")])
def test_a_negative_cap_given_to_a_job_whose_first_step_takes_caps_is_one_line_not_a_traceback(
    instance, data_root, job, op
):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    assert defs.resolve_job_def("judge_job").execute_in_process(instance=instance, partition_key="r1").success
    result = defs.resolve_job_def(job).execute_in_process(
        instance=instance,
        partition_key="r1" if job == "ledger_job" else None,
        run_config={"ops": {op: {"config": {"caps": {"m": {"site_cap": -5}}}}}},
        raise_on_error=False,
    )
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert [(e.step_key, e.step_failure_data.error.cls_name) for e in failures] == [(op, "Failure")]
    [line] = failures[0].step_failure_data.error.message.strip().splitlines()
    assert line.endswith(f": run config ops.{op}.config: caps.m.site_cap: must be 0 or more, got -5; nothing was "
                         "judged, walked or written with them")  # fmt: skip


@pytest.mark.parametrize("job", ["filter_job", "ledger_job"])
def test_the_ledgers_other_settings_beside_the_caps_are_taken(instance, data_root, job):
    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    instance.add_dynamic_partitions("run_id", ["r1"])
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    if job == "ledger_job":
        assert defs.resolve_job_def("judge_job").execute_in_process(instance=instance, partition_key="r1").success
    config = {"per_site_cap": 2, "include_judge_failures": True}
    result = defs.resolve_job_def(job).execute_in_process(
        instance=instance, partition_key="r1", run_config={"ops": {"ledger": {"config": config}}}
    )
    assert result.success


def test_a_mistyped_cap_is_refused_at_launch(instance, data_root):
    defs = build_defs(str(data_root), JudgeResource(), caps={})
    with pytest.raises(dg.DagsterInvalidConfigError):
        defs.resolve_job_def("filter_job").execute_in_process(
            instance=instance, run_config={"ops": {"ledger": {"config": {"per_site_cap": "three"}}}}
        )
    assert not (data_root / "warehouse").exists()
