"""Files on the data root (CONTRACT §4): atomic writes that a kill cannot leave half done, and the fingerprints
that tell whether a batch's inputs changed since its commit."""

import os
import subprocess
import sys

import pytest
from upath import UPath

from filter_pipeline.storage import files


def test_a_writer_killed_midway_leaves_the_old_file_and_its_temp_file_is_removed_by_the_next_write(tmp_path):
    target = UPath(tmp_path) / "f.json"
    files.atomic_write(target, b"old")
    script = (
        "import os, sys; from upath import UPath; from filter_pipeline.storage import files\n"
        "real = os.replace\n"
        "os.replace = lambda *a: os._exit(9)  # killed between the temp file and the rename\n"
        f"files.atomic_write(UPath({str(target)!r}), b'new')\n"
    )
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] != []
    files.atomic_write(target, b"newer")
    assert target.read_bytes() == b"newer"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_changed_inputs_are_told_by_size_or_content_not_by_a_touch(tmp_path):
    run = UPath(tmp_path) / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    (run / "executions.jsonl").write_text('{"task_id": "a", "attempt": 1}\n')
    recorded = files.input_fingerprints(run)
    assert files.inputs_changed(run, recorded) == []
    os.utime((run / "tasks.jsonl").path, ns=(1, 1))  # touched, same bytes
    assert files.inputs_changed(run, recorded) == []
    (run / "tasks.jsonl").write_text('{"task_id": "b"}\n')  # same size, other bytes
    assert files.inputs_changed(run, recorded) == ["tasks.jsonl"]
    (run / "executions.jsonl").unlink()
    assert files.inputs_changed(run, recorded) == ["executions.jsonl", "tasks.jsonl"]


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_changed_inputs_on_s3_are_told_by_etag(s3_server, s3_bucket):
    run = UPath(f"s3://{s3_bucket}/data/runs/r1", endpoint_url=s3_server.endpoint, use_listings_cache=False)
    (run / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    (run / "executions.jsonl").write_text("{}\n")
    recorded = files.input_fingerprints(run)
    assert recorded["tasks.jsonl"]["etag"] and files.inputs_changed(run, recorded) == []
    (run / "tasks.jsonl").write_text('{"task_id": "b"}\n')
    assert files.inputs_changed(run, recorded) == ["tasks.jsonl"]


def test_an_input_read_is_fingerprinted_as_the_bytes_read_so_a_later_rewrite_is_a_change(tmp_path):
    run = UPath(tmp_path) / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    data, read = files.read_input(run / "tasks.jsonl")
    assert data == b'{"task_id": "a"}\n'
    assert read == files.input_fingerprint(run / "tasks.jsonl")
    assert files.inputs_changed(run, {"tasks.jsonl": read}) == []
    (run / "tasks.jsonl").write_text('{"task_id": "b"}\n')  # same size, other bytes
    assert files.inputs_changed(run, {"tasks.jsonl": read}) == ["tasks.jsonl"]


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_an_input_read_on_s3_is_fingerprinted_by_its_etag(s3_server, s3_bucket):
    run = UPath(f"s3://{s3_bucket}/data/runs/r1", endpoint_url=s3_server.endpoint, use_listings_cache=False)
    (run / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    data, read = files.read_input(run / "tasks.jsonl")
    assert data == b'{"task_id": "a"}\n' and read == files.input_fingerprint(run / "tasks.jsonl")
    (run / "tasks.jsonl").write_text('{"task_id": "b"}\n')
    assert files.inputs_changed(run, {"tasks.jsonl": read}) == ["tasks.jsonl"]


def test_files_in_lists_a_suffix_in_name_order_without_writes_in_progress(tmp_path):
    for name in ("b.json", "a.json", ".a.json.tmp", ".c.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    assert list(files.files_in(UPath(tmp_path), ".json")) == ["a", "b"]
    assert files.files_in(UPath(tmp_path), ".json")["b"] == UPath(tmp_path) / "b.json"
    assert files.files_in(UPath(tmp_path / "missing"), ".json") == {}
    assert files.files_in(UPath(tmp_path / "a.json"), ".json") == {}  # a file is no folder (its listing is itself)


def test_folder_entries_tell_folders_and_links_to_folders_from_files(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "linked").symlink_to(tmp_path / "run")
    assert sorted(files.folder_entries(UPath(tmp_path))) == [("linked", True), ("notes.txt", False), ("run", True)]


def test_a_writer_tag_holds_no_dot_and_tells_pid_namespaces_of_one_hostname_apart():
    tag = files.writer_tag("ip-10-0-0-1.ec2.internal", None)
    assert tag == "ip-10-0-0-1-ec2-internal"  # (names holding it are read from their end, split at dots)
    here, there = files.writer_tag("vm", "boot:1"), files.writer_tag("vm", "boot:2")
    assert here != there and "." not in here and here.startswith("vm-")
