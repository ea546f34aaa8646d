"""Commit records (CONTRACT §4): written atomically, read back exactly, refused when they are not one."""

import os
import subprocess
import sys

import pytest
from upath import UPath

from filter_pipeline.rules.commits import CommitRecord, HistoryIntegrityError, read_commits
from filter_pipeline.storage import files as commits
from filter_pipeline.storage.publish import write_commit


def record(run_id="r1", **changes) -> CommitRecord:
    fields = dict(
        run_id=run_id, walked_at="2026-12-01T00:00:00+00:00",
        files={"kept": {"path": f"warehouse/kept/{run_id}.parquet", "size": 3, "sha256": "ab", "rows": 1}},
        kept_keys=1, caps={"per_site_cap": 3, "caps": {}}, caps_source="deployment",
        judge={"kind": "gate", "model": None, "prompt_version": None, "votes": None},
        history={"r0": "legacy:cd"}, inputs={"tasks.jsonl": {"size": 1, "sha256": "ef", "mtime_ns": 1}}, unjudged=0,
    )  # fmt: skip
    return CommitRecord(**{**fields, **changes})


def test_a_written_record_reads_back_equal_with_the_same_digest(tmp_path):
    warehouse = UPath(tmp_path) / "warehouse"
    write_commit(warehouse, record("r1"))
    write_commit(warehouse, record("r2", history={"r1": record("r1").digest}))
    found = read_commits(warehouse)
    assert found == {"r1": record("r1"), "r2": record("r2", history={"r1": record("r1").digest})}
    assert found["r1"].digest == record("r1").digest != record("r1", unjudged=1).digest
    assert [p.name for p in (tmp_path / "warehouse" / "_commits").iterdir()] != []
    assert not [p for p in (tmp_path / "warehouse" / "_commits").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "content, message",
    [
        (
            "{",
            r"^warehouse/_commits/r1.json is not a commit record \(not JSON: .*\): delete it and re-filter r1 with `filter-pipeline materialize r1`$",
        ),
        ('{"run_id": "r1"}', r"^warehouse/_commits/r1.json is not a commit record \(its fields differ\)"),
    ],
)
def test_a_broken_record_is_refused_with_one_line(tmp_path, content, message):
    folder = tmp_path / "warehouse" / "_commits"
    folder.mkdir(parents=True)
    (folder / "r1.json").write_text(content)
    with pytest.raises(HistoryIntegrityError, match=message):
        read_commits(UPath(tmp_path) / "warehouse")


def test_a_record_under_another_runs_name_is_refused(tmp_path):
    warehouse = UPath(tmp_path) / "warehouse"
    write_commit(warehouse, record("r1"))
    os.rename(tmp_path / "warehouse" / "_commits" / "r1.json", tmp_path / "warehouse" / "_commits" / "r2.json")
    with pytest.raises(HistoryIntegrityError, match="is not the commit record of run r2"):
        read_commits(warehouse)


def test_a_writer_killed_midway_leaves_the_old_file_and_its_temp_file_is_removed_by_the_next_write(tmp_path):
    target = UPath(tmp_path) / "f.json"
    commits.atomic_write(target, b"old")
    script = (
        "import os, sys; from upath import UPath; from filter_pipeline.storage import files as commits\n"
        "real = os.replace\n"
        "os.replace = lambda *a: os._exit(9)  # killed between the temp file and the rename\n"
        f"commits.atomic_write(UPath({str(target)!r}), b'new')\n"
    )
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] != []
    commits.atomic_write(target, b"newer")
    assert target.read_bytes() == b"newer"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_changed_inputs_are_told_by_size_or_content_not_by_a_touch(tmp_path):
    run = UPath(tmp_path) / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    (run / "executions.jsonl").write_text('{"task_id": "a", "attempt": 1}\n')
    recorded = commits.input_fingerprints(run)
    assert commits.inputs_changed(run, recorded) == []
    os.utime((run / "tasks.jsonl").path, ns=(1, 1))  # touched, same bytes
    assert commits.inputs_changed(run, recorded) == []
    (run / "tasks.jsonl").write_text('{"task_id": "b"}\n')  # same size, other bytes
    assert commits.inputs_changed(run, recorded) == ["tasks.jsonl"]
    (run / "executions.jsonl").unlink()
    assert commits.inputs_changed(run, recorded) == ["executions.jsonl", "tasks.jsonl"]


def test_changed_inputs_on_s3_are_told_by_etag(s3_server, s3_bucket):
    run = UPath(f"s3://{s3_bucket}/data/runs/r1", endpoint_url=s3_server.endpoint, use_listings_cache=False)
    (run / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    (run / "executions.jsonl").write_text("{}\n")
    recorded = commits.input_fingerprints(run)
    assert recorded["tasks.jsonl"]["etag"] and commits.inputs_changed(run, recorded) == []
    (run / "tasks.jsonl").write_text('{"task_id": "b"}\n')
    assert commits.inputs_changed(run, recorded) == ["tasks.jsonl"]
