"""The warehouse's Parquet files: written whole (atomic local writes, temp files of killed writes cleaned),
read as one frame per asset folder with real nulls."""

import os
import time

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from upath import UPath

from filter_pipeline.rules.schemas import empty_frame, to_arrow
from filter_pipeline.storage import files, parquet
from filter_pipeline.storage.parquet import read_parquet, write_parquet


def test_whole_asset_folder_reads_as_one_frame_with_real_nulls(tmp_path):
    folder = UPath(tmp_path) / "warehouse" / "failure_pool"
    with_nulls = pd.DataFrame(
        [{"task_id": "a", "reason": "unknown", "detail": None, "backend_ok": None, "run_id": "r1"}]
    )
    write_parquet(to_arrow(with_nulls, "failure_pool"), folder / "r1.parquet")
    write_parquet(to_arrow(empty_frame("failure_pool"), "failure_pool"), folder / "r2.parquet")
    frame = pd.read_parquet(tmp_path / "warehouse" / "failure_pool")
    assert frame["task_id"].tolist() == ["a"]
    assert frame["detail"].isna().all()
    assert read_parquet(folder / "r1.parquet")["backend_ok"].dtype == "boolean"


def test_read_folder_gives_every_partition_file_with_the_rows_the_filters_keep(tmp_path):
    folder = UPath(tmp_path) / "warehouse" / "failure_pool"
    for run_id, dirs in (("r2", ["d3"]), ("r1", ["d1", "d2"])):
        rows = pd.DataFrame({"task_id": [f"{run_id}-{d}" for d in dirs], "dir": dirs, "run_id": run_id})
        write_parquet(to_arrow(rows, "failure_pool"), folder / f"{run_id}.parquet")
    (folder / ".r3.parquet.host.1.tmp").write_bytes(b"half written")  # a temp file: not a partition
    frame = parquet.read_folder(folder, ["task_id", "run_id"], filters=[("dir", "in", ["d1", "d3"])])
    assert frame.to_dict("records") == [{"task_id": "r1-d1", "run_id": "r1"}, {"task_id": "r2-d3", "run_id": "r2"}]
    assert parquet.read_folder(folder, ["dir"])["dir"].tolist() == ["d1", "d2", "d3"]


def test_a_folder_read_as_one_frame_carries_no_one_files_attributes(tmp_path):
    folder = UPath(tmp_path) / "warehouse" / "judge_verdicts"
    for run_id in ("r1", "r2"):
        verdicts = pd.DataFrame({"task_id": [f"{run_id}-a"], "run_id": run_id})
        verdicts.attrs["judged_inputs"] = {"tasks.jsonl": {"size": len(run_id)}}  # (each file's own)
        write_parquet(to_arrow(verdicts, "judge_verdicts"), folder / f"{run_id}.parquet")
    assert read_parquet(folder / "r2.parquet").attrs["judged_inputs"] == {"tasks.jsonl": {"size": 2}}
    assert parquet.read_folder(folder, ["task_id"]).attrs == {}


def test_local_write_is_atomic_and_cleans_temp_files_of_a_killed_write(tmp_path, monkeypatch):
    target = UPath(tmp_path) / "kept" / "r1.parquet"
    write_parquet(to_arrow(empty_frame("kept"), "kept"), target)
    stale = tmp_path / "kept" / ".r1.parquet.deadbeef.tmp"
    stale.write_bytes(b"half a parquet file")
    old = time.time() - files.ABANDONED_AFTER_SECONDS - 60
    os.utime(stale, (old, old))  # left by a write killed over an hour ago

    def disk_full(descriptor):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "fsync", disk_full)  # the new file is written in part, then its sync fails
    with pytest.raises(OSError, match="disk full"):
        parquet.write_bytes(b"PAR1 half a file", target)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["r1.parquet"]
    assert pq.read_table(target).num_rows == 0  # the old file is intact

    def cannot_encode(table, where, **options):
        raise pa.ArrowInvalid("cannot encode")

    monkeypatch.setattr(pq, "write_table", cannot_encode)
    with pytest.raises(pa.ArrowInvalid):
        write_parquet(to_arrow(empty_frame("kept"), "kept"), target)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["r1.parquet"]
    assert pq.read_table(target).num_rows == 0

    rows = pd.DataFrame([{"task_id": "a", "run_id": "r1"}])
    write_parquet(to_arrow(rows, "kept"), target)
    assert pq.read_table(target).column("task_id").to_pylist() == ["a"]
