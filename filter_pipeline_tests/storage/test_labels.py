"""Label appends: one line each, none lost when several writers append at once (local disk and moto S3)."""

import json
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context

import pytest
from upath import UPath

from filter_pipeline.storage import labels as labels_module
from filter_pipeline.storage.labels import LABELS_FILE, append_label, label_line, now_iso


def _record(i: int) -> dict:
    return {"dir": f"runs/r/traj/t{i}/1", "success": [True, False, None][i % 3], "note": "é" * (i % 7),
            "labeler": f"w{i % 4}", "labeled_at": now_iso()}  # fmt: skip


def _lines(data: bytes) -> list[dict]:
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def test_a_label_is_one_compact_line_with_an_iso_utc_time():
    line = label_line({"dir": "runs/r/traj/t/1", "success": None, "note": "naïve"})
    assert line == '{"dir":"runs/r/traj/t/1","success":null,"note":"naïve"}\n'.encode()
    assert len(now_iso()) == 20 and now_iso().endswith("Z") and now_iso()[10] == "T"


def test_concurrent_local_appends_from_threads_lose_none(tmp_path):
    root = UPath(str(tmp_path))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: append_label(root, _record(i)), range(400)))
    lines = _lines((tmp_path / LABELS_FILE).read_bytes())
    assert sorted(line["dir"] for line in lines) == sorted(_record(i)["dir"] for i in range(400))


def test_a_label_appended_to_a_file_without_its_final_newline_starts_a_line_of_its_own(tmp_path):
    (tmp_path / LABELS_FILE).write_bytes(label_line(_record(1)).rstrip(b"\n"))  # edited by hand
    append_label(UPath(str(tmp_path)), _record(2))
    append_label(UPath(str(tmp_path)), _record(3))
    assert [line["dir"] for line in _lines((tmp_path / LABELS_FILE).read_bytes())] == [
        _record(i)["dir"] for i in (1, 2, 3)
    ]


@pytest.mark.slow
def test_a_label_appended_on_s3_to_an_object_without_its_final_newline_starts_a_line_of_its_own(s3_bucket):
    root = UPath(f"s3://{s3_bucket}/filter", use_listings_cache=False)
    (root / LABELS_FILE).write_bytes(label_line(_record(1)).rstrip(b"\n"))
    append_label(root, _record(2))
    assert [line["dir"] for line in _lines((root / LABELS_FILE).read_bytes())] == [_record(i)["dir"] for i in (1, 2)]


def _append_many(args) -> None:
    root, start = args
    for i in range(start, start + 100):
        append_label(UPath(root), _record(i))


@pytest.mark.slow
def test_concurrent_local_appends_from_processes_lose_none(tmp_path):
    # (an executor's shutdown waits for its workers to finish; a Pool's exit terminates them, which can hang)
    with ProcessPoolExecutor(4, mp_context=get_context("spawn")) as pool:
        list(pool.map(_append_many, [(str(tmp_path), start) for start in range(0, 400, 100)]))
    assert len(_lines((tmp_path / LABELS_FILE).read_bytes())) == 400


@pytest.mark.slow
def test_concurrent_appends_on_s3_lose_none_and_retry_on_412(s3_bucket, monkeypatch):
    lost = []
    original = labels_module._lost_race

    def counting(exc):
        lost.append(exc)
        return original(exc)

    monkeypatch.setattr(labels_module, "_lost_race", counting)
    root = UPath(f"s3://{s3_bucket}/filter", use_listings_cache=False)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: append_label(root, _record(i)), range(40)))
    lines = _lines((root / LABELS_FILE).read_bytes())
    assert sorted(line["dir"] for line in lines) == sorted(_record(i)["dir"] for i in range(40))
    assert lost and all(original(exc) for exc in lost)  # writers did collide, and each collision was retried


@pytest.mark.slow
def test_an_s3_write_that_fails_for_another_reason_is_one_line(s3_bucket):
    root = UPath("s3://no-such-bucket-for-labels/filter", use_listings_cache=False)
    with pytest.raises(labels_module.LabelWriteError) as caught:
        append_label(root, _record(1))
    assert len(str(caught.value).splitlines()) == 1


def test_a_labels_file_that_exists_but_cannot_be_read_is_one_line_and_none_is_no_file(tmp_path):
    from filter_pipeline.storage.labels import read_labels

    assert read_labels(UPath(str(tmp_path))) is None
    (tmp_path / "labels.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"^labels.jsonl cannot be read \(Is a directory\)$"):
        read_labels(UPath(str(tmp_path)))


def test_a_local_labels_file_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / LABELS_FILE).mkdir()  # (a folder in its place; no permission or a full disk fail the same way)
    with pytest.raises(
        labels_module.LabelWriteError, match=r"labels.jsonl: the label could not be written \(Is a directory\)$"
    ):
        append_label(UPath(str(tmp_path)), _record(1))
