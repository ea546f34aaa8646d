"""Validation failures on record (`warehouse/_failed/<run_id>.json`): what the order and the review app read."""

import pytest
from upath import UPath

from filter_pipeline.rules.batch import BatchError
from filter_pipeline.storage.failures import (
    UNREADABLE_RECORD,
    clear_failure,
    failure_path,
    read_failure,
    read_failures,
    record_failure,
    refused_as_they_are,
)
from filter_pipeline.storage.runs import read_batch
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


def refused(tmp_path, run_id: str, *, corrected_meanwhile=None) -> None:
    """Refuse `run_id`'s batch as the judge step does: its failure recorded with what the parse read (after
    `corrected_meanwhile()` runs, when given: a correction landing between the parse and the record)."""
    run_dir = UPath(str(tmp_path / "runs" / run_id))
    with pytest.raises(BatchError) as refusal:
        read_batch(run_dir, run_id)
    if corrected_meanwhile:
        corrected_meanwhile()
    record_failure(UPath(str(tmp_path / "warehouse")), run_id, str(refusal.value), refusal.value.inputs)


def test_a_refused_batch_is_listed_as_it_was_refused_until_a_file_of_it_is_changed_added_or_removed(tmp_path):
    warehouse, runs = UPath(str(tmp_path / "warehouse")), UPath(str(tmp_path / "runs"))
    names = ("changed", "added", "removed", "same", "its_attempts_changed", "corrected_meanwhile")
    for run_id in names:
        write_batch(tmp_path, run_id, [], [attempt("a")])  # (no valid task)
    (runs / "added" / "tasks.jsonl").unlink()
    correct = lambda run_id: lambda: write_batch(tmp_path, run_id, [task("a")], [attempt("a")])  # noqa: E731
    for run_id in names:
        refused(tmp_path, run_id, corrected_meanwhile=correct(run_id) if run_id == "corrected_meanwhile" else None)
    record_failure(warehouse, "no_inputs", "runs/no_inputs refused")  # (a record from before they were kept)
    as_they_are = refused_as_they_are(warehouse, runs, [*names, "no_inputs"])
    assert sorted(as_they_are) == ["added", "changed", "its_attempts_changed", "removed", "same"]
    assert as_they_are["added"] == "runs/added/tasks.jsonl does not exist: not an execution batch"
    assert refused_as_they_are(warehouse, runs, ["same"]) == {"same": as_they_are["same"]}
    correct("changed")()
    (runs / "added" / "tasks.jsonl").write_text("")
    (runs / "removed" / "executions.jsonl").unlink()
    (runs / "its_attempts_changed" / "executions.jsonl").write_text("")  # (no correction of its tasks)
    assert sorted(refused_as_they_are(warehouse, runs, list(names))) == ["its_attempts_changed", "same"]
