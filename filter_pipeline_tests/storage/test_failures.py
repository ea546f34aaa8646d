"""Validation failures on record (`warehouse/_failed/<run_id>.json`): what the order and the review app read."""

from upath import UPath

from filter_pipeline.storage.failures import (
    UNREADABLE_RECORD,
    clear_failure,
    failure_path,
    read_failure,
    read_failures,
    record_failure,
    refused_as_they_are,
)
from filter_pipeline_tests.builders import attempt, task, write_batch


def test_a_recorded_failure_is_read_back_by_run_until_cleared(tmp_path):
    warehouse = UPath(str(tmp_path))
    assert read_failures(warehouse) == {} and read_failure(failure_path(warehouse, "r1")) is None
    record_failure(warehouse, "r1", "runs/r1/executions.jsonl does not exist")
    record_failure(warehouse, "r2", "runs/r2/tasks.jsonl holds no valid task")
    assert read_failures(warehouse) == {
        "r1": "runs/r1/executions.jsonl does not exist",
        "r2": "runs/r2/tasks.jsonl holds no valid task",
    }
    assert clear_failure(warehouse, "r1") and not clear_failure(warehouse, "r1")
    assert read_failures(warehouse) == {"r2": "runs/r2/tasks.jsonl holds no valid task"}


def test_a_record_that_is_not_one_still_holds_its_run_as_failed(tmp_path):
    warehouse = UPath(str(tmp_path))
    record_failure(warehouse, "r1", "x")
    for content in ("{not json", "[1, 2]", '"a text"'):
        failure_path(warehouse, "r1").write_text(content)
        assert read_failures(warehouse) == {"r1": UNREADABLE_RECORD}, content


def test_a_refused_batch_is_listed_as_it_was_refused_until_a_file_of_it_is_changed_added_or_removed(tmp_path):
    warehouse, runs = UPath(str(tmp_path / "warehouse")), UPath(str(tmp_path / "runs"))
    for run_id in ("changed", "added", "removed", "same"):
        write_batch(tmp_path, run_id, [], [attempt("a")])
    (runs / "added" / "tasks.jsonl").unlink()
    for run_id in ("changed", "added", "removed", "same"):
        record_failure(warehouse, run_id, f"runs/{run_id} refused", runs / run_id)
    record_failure(warehouse, "no_inputs", "runs/no_inputs refused")  # (a record from before they were kept)
    assert refused_as_they_are(warehouse, runs) == {
        name: f"runs/{name} refused" for name in ("changed", "added", "removed", "same")
    }
    write_batch(tmp_path, "changed", [task("a")], [attempt("a")])
    (runs / "added" / "tasks.jsonl").write_text("")
    (runs / "removed" / "executions.jsonl").unlink()
    assert refused_as_they_are(warehouse, runs) == {"same": "runs/same refused"}
