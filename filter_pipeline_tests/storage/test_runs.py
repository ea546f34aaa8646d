"""Reading a batch from its run folder: a dir that resolves outside the data root (through a symlink, however it is
spelled) is rejected; records are counted by their non-blank lines."""

import pytest
from upath import UPath

from filter_pipeline.storage import runs as runs_module
from filter_pipeline.storage.runs import read_batch
from filter_pipeline_tests.builders import attempt, jsonl, task, write_batch


def test_dir_resolving_outside_the_data_root_through_a_symlink_is_rejected(tmp_path):
    data = tmp_path / "data"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run = write_batch(data, "r", [task("a"), task("b")], [])
    (run / "traj").mkdir()
    (run / "traj" / "evil").symlink_to(outside)
    (run / "traj" / "fine").mkdir()
    (run / "traj" / "alias").symlink_to(run / "traj" / "fine")  # a symlink that stays inside is fine
    (run / "executions.jsonl").write_text(
        jsonl([{**attempt("a"), "dir": "runs/r/traj/evil/1"}, {**attempt("b"), "dir": "runs/r/traj/alias"}])
    )
    b = read_batch(UPath(run), "r")
    assert b.attempts["task_id"].tolist() == ["b"]
    assert b.rejects[["line", "field"]].values.tolist() == [[1, "dir"]]
    assert "resolves outside the data root" in b.rejects["message"].item()


@pytest.mark.parametrize(
    "spelled", ["runs/r/traj/./evil/1", "runs/r/traj//evil/1", "./runs/r/traj/evil/1", "runs/r/./traj/evil"]
)
def test_a_dir_spelled_with_dots_or_double_slashes_through_a_symlink_out_is_rejected_too(tmp_path, spelled):
    data = tmp_path / "data"
    (tmp_path / "elsewhere").mkdir()
    run = write_batch(data, "r", [task("a")], [{**attempt("a"), "dir": spelled}])
    (run / "traj").mkdir()
    (run / "traj" / "evil").symlink_to(tmp_path / "elsewhere")
    b = read_batch(UPath(run), "r")
    assert b.attempts.empty
    assert b.rejects[["line", "field"]].values.tolist() == [[1, "dir"]]


def test_dirs_under_other_top_folders_are_checked_too(tmp_path):
    data = tmp_path / "data"
    outside = tmp_path / "elsewhere"
    (outside / "x").mkdir(parents=True)
    run = write_batch(data, "r", [task("a"), task("b"), task("c")], [])
    (run / "traj" / "a").mkdir(parents=True)
    (data / "runs" / "linked").symlink_to(outside)  # a second top folder, itself leaving the root
    (run / "shots" / "c").mkdir(parents=True)  # a third, inside
    (run / "executions.jsonl").write_text(jsonl([
        {**attempt("a"), "dir": "runs/r/traj/a"}, {**attempt("b"), "dir": "runs/linked/x"}, {**attempt("c"), "dir": "runs/r/shots/c"},
    ]))  # fmt: skip
    b = read_batch(UPath(run), "r")
    assert b.attempts["task_id"].tolist() == ["a", "c"]
    assert b.rejects[["line", "field"]].values.tolist() == [[2, "dir"]]


def test_count_records_counts_a_legacy_runs_kept_rows(tmp_path):
    (tmp_path / "kept.jsonl").write_text('{"task_id": "a"}\n\n{"task_id": "b"}\n')
    assert runs_module.count_records(UPath(tmp_path), "kept.jsonl") == 2


def test_walk_order_reads_what_a_first_walk_waits_for_from_the_data_root(tmp_path):
    from filter_pipeline.storage.failures import record_failure

    for run_id in ("r1", "r2", "r3", "r4", "r5"):
        write_batch(tmp_path, run_id, [task("a")], [attempt("a")])
    write_batch(tmp_path, "r0", [task("a")], [attempt("a")], complete=False)  # still being written: not waited for
    record_failure(UPath(tmp_path) / "warehouse", "r2", "no valid task")
    (tmp_path / "retired.json").write_text('[{"run_id": "r3", "reason": "bad site"}]')
    now = runs_module.walk_order(UPath(tmp_path))
    assert (now.complete, now.failed, now.retired) == (["r1", "r2", "r3", "r4", "r5"], {"r2"}, {"r3"})
    assert now.blocking("r5", walked_before=[]) == ["r1", "r4"]
    assert now.blocking("r5", walked_before=["r1", "r4"]) == []


def test_only_folders_a_batch_can_be_are_said_to_be_still_being_written(tmp_path):
    write_batch(tmp_path, "r1", [task("a")], [attempt("a")], complete=False)
    for name in ("has space", ".partial"):  # (a hidden folder, a name refused once complete)
        (tmp_path / "runs" / name).mkdir()
    incomplete: list[str] = []
    runs_module.complete_batches(UPath(tmp_path) / "runs", UPath(tmp_path) / "warehouse", incomplete=incomplete)
    assert incomplete == ["r1"]
