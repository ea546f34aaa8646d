"""The across-runs assets kept current with the files beside the warehouse (`shell/freshness.py`): the labels
sensor refreshes judge_calibration when labels.jsonl changes, the retired sensor coverage when retired.json does."""

import json

import dagster as dg
import pandas as pd

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.shell.freshness import build_labels_sensor, build_retired_sensor
from filter_pipeline_tests.builders import Pipeline, attempt, sensor_context, task, write_batch


def labels_tick(instance, data_root) -> dg.SensorResult:
    return build_labels_sensor()(sensor_context(instance, data_root))


def retired_tick(instance, data_root) -> dg.SensorResult:
    return build_retired_sensor()(sensor_context(instance, data_root))


def filtered(instance, data_root, run_id: str, task_ids: list[str]) -> dg.Definitions:
    """Batch `run_id` of these tasks (one site each, one ok attempt each) filtered with the gate judge."""
    write_batch(data_root, run_id, [task(t, site=f"s-{t}") for t in task_ids], [attempt(t) for t in task_ids])
    Pipeline(data_root, instance).run(JudgeResource(), run_id)
    return build_defs(str(data_root), JudgeResource(), caps={})


def refreshed(instance, defs: dg.Definitions, tick, asset: str) -> dg.RunRequest:
    """The one run the sensor's `tick` asks for, checked to refresh `asset` alone, after running it."""
    [request] = tick().run_requests
    assert (request.job_name, request.asset_selection) == ("across_runs_job", [dg.AssetKey(asset)])
    across = defs.resolve_job_def("across_runs_job")
    assert across.execute_in_process(instance=instance, asset_selection=request.asset_selection).success
    return request


def test_the_labels_sensor_refreshes_judge_calibration_alone_when_labels_change(instance, data_root):
    tick = lambda: labels_tick(instance, data_root)  # noqa: E731
    first = tick()
    assert first.run_requests == [] and first.skip_reason.skip_message == (
        "nothing to score yet: no judge_verdicts in the warehouse"
    )
    defs = filtered(instance, data_root, "r1", ["a", "b"])
    assert tick().run_requests == []  # no labels file, none scored

    (data_root / "labels.jsonl").write_text('{"run_id": "r1", "task_id": "a", "success": true}\n')
    request = refreshed(instance, defs, tick, "judge_calibration")
    assert request.run_key.startswith("labels.jsonl:")
    assert tick().run_requests == [] and tick().skip_reason.skip_message == (
        "judge_calibration is up to date with labels.jsonl"
    )
    calibration = pd.read_parquet(data_root / "warehouse" / "judge_calibration.parquet")
    assert calibration[calibration["site"] == "(all)"]["n"].tolist() == [1, 1]

    with (data_root / "labels.jsonl").open("a") as f:
        f.write('{"run_id": "r1", "task_id": "b", "success": false}\n')
    [again] = tick().run_requests
    assert again.run_key != request.run_key


def test_the_retired_sensor_refreshes_coverage_alone_when_retired_json_changes(instance, data_root):
    tick = lambda: retired_tick(instance, data_root)  # noqa: E731
    first = tick()
    assert first.run_requests == [] and first.skip_reason.skip_message == (
        "nothing to count yet: no kept in the warehouse"
    )
    defs = filtered(instance, data_root, "r1", ["a", "b"])
    assert tick().run_requests == []  # no retired.json: coverage is up to date

    retire_a = json.dumps([{"run_id": "r1", "task_ids": ["a"], "reason": "wrong"}])
    (data_root / "retired.json").write_text(retire_a)
    request = refreshed(instance, defs, tick, "coverage")
    assert request.run_key.startswith("retired.json:")
    assert tick().run_requests == [] and tick().skip_reason.skip_message == "coverage is up to date with retired.json"
    coverage = pd.read_parquet(data_root / "warehouse" / "coverage.parquet")
    assert coverage[coverage["level"] == "site"].set_index("site")["kept"].to_dict() == {"s-b": 1}  # (a retired)

    (data_root / "retired.json").unlink()  # retired rows count again
    back = refreshed(instance, defs, tick, "coverage")
    (data_root / "retired.json").write_text(retire_a)  # and are retired again: a run key not run before
    assert refreshed(instance, defs, tick, "coverage").run_key not in {request.run_key, back.run_key}


def test_an_unreadable_labels_file_is_refreshed_once_as_the_asset_builds_without_it(instance, data_root):
    tick = lambda: labels_tick(instance, data_root)  # noqa: E731
    defs = filtered(instance, data_root, "r1", ["a"])
    (data_root / "labels.jsonl").mkdir()  # (cannot be read as a file)
    refreshed(instance, defs, tick, "judge_calibration")  # built without labels, warning why
    assert tick().run_requests == [] and tick().skip_reason.skip_message == (
        "judge_calibration is up to date with labels.jsonl"
    )


def test_an_unreadable_retired_json_is_a_skip_naming_it_not_a_failing_tick(instance, data_root):
    tick = lambda: retired_tick(instance, data_root)  # noqa: E731
    filtered(instance, data_root, "r1", ["a"])
    (data_root / "retired.json").mkdir()  # coverage refuses to count without it: no refresh to ask for
    skipped = tick()
    assert skipped.run_requests == []
    assert skipped.skip_reason.skip_message.startswith("retired.json cannot be read")
    assert skipped.skip_reason.skip_message.endswith(": coverage is refreshed once it can be read")
