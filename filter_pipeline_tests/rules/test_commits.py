"""Commit records (CONTRACT §4): read back exactly, refused when they are not one."""

import os
import re
import time
from datetime import UTC, datetime

import pytest
from upath import UPath

from filter_pipeline.rules.commits import CommitRecord, HistoryIntegrityError
from filter_pipeline.storage.history import read_commits
from filter_pipeline.storage.publish import walked_now, write_commit


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


def test_a_records_digest_is_worked_out_once_and_is_its_bytes_hash(monkeypatch):
    import hashlib

    serialised = []
    to_json = CommitRecord.to_json
    monkeypatch.setattr(CommitRecord, "to_json", lambda self: serialised.append(1) or to_json(self))
    r = record("r2", history={f"r{i}": "ab" for i in range(100)})
    assert {r.digest for _ in range(50)} == {hashlib.sha256(to_json(r)).hexdigest()}
    assert len(serialised) == 1  # (a warehouse's audit asks each record's digest once per later run)
    assert r == record("r2", history={f"r{i}": "ab" for i in range(100)})  # (equality is the fields')


def test_walked_at_tells_apart_moments_of_the_same_second():
    # a re-walk launched 0.1 s after the commit before it, in the same second, is asked after that commit
    launched = datetime(2026, 12, 1, 0, 0, 0, 350_000, tzinfo=UTC).timestamp()
    assert record(walked_at="2026-12-01T00:00:00.250000+00:00").walked_timestamp < launched
    assert record(walked_at="2026-12-01T00:00:00.450000+00:00").walked_timestamp > launched
    # a record written to the second only reads as the start of its second: earlier than the launch
    assert record(walked_at="2026-12-01T00:00:00+00:00").walked_timestamp < launched
    assert record(walked_at="not a time").walked_timestamp == 0.0


def test_a_walk_committing_now_says_when_to_the_microsecond():
    before = time.time()
    stamp = walked_now()
    after = time.time()
    assert before - 1e-6 <= record(walked_at=stamp).walked_timestamp <= after + 1e-6
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", stamp)


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


LLM_V3 = {"kind": "llm", "model": "m", "prompt_version": "v3", "votes": "1", "settings": "d1"}
GATE = {"kind": "gate", "model": None, "prompt_version": None, "votes": "gate", "settings": None}


@pytest.mark.parametrize(
    "recorded, current, differs",
    [
        (LLM_V3, {**LLM_V3}, None),
        ({"kind": "gate", "model": "", "prompt_version": None, "votes": "gate"}, GATE, None),
        (None, GATE, None),  # a record that names no judge: nothing to compare
        ("not a dict", GATE, None),
        ({**LLM_V3, "votes": None}, {**LLM_V3, "votes": "3"}, None),  # a setting the record does not name
        (LLM_V3, GATE, "judged by llm m v3 (votes 1), not by gate"),
        (LLM_V3, {**LLM_V3, "model": "m2"}, "judged by llm m v3 (votes 1), not by llm m2 v3 (votes 1)"),
        (LLM_V3, {**LLM_V3, "prompt_version": "v4"}, "judged by llm m v3 (votes 1), not by llm m v4 (votes 1)"),
        (LLM_V3, {**LLM_V3, "votes": "3"}, "judged by llm m v3 (votes 1), not by llm m v3 (votes 3)"),
        (
            LLM_V3,
            {**LLM_V3, "settings": "d2"},  # another temperature, say
            "judged by llm m v3 (votes 1), not by llm m v3 (votes 1) (other temperature, screenshot or prompt-size "
            "settings)",
        ),
        ({k: v for k, v in LLM_V3.items() if k != "settings"}, {**LLM_V3, "settings": "d2"}, None),  # an older record
    ],
)
def test_another_judge_is_told_by_kind_model_prompt_version_votes_and_settings(recorded, current, differs):
    from filter_pipeline.rules.commits import another_judge

    assert another_judge(recorded, current) == differs


def test_the_judge_a_record_names_is_the_one_the_verdicts_name_even_when_it_judged_no_task():
    import pandas as pd

    from filter_pipeline.rules.commits import judge_settings
    from filter_pipeline.rules.schemas import JUDGED_BY

    all_unjudged = pd.DataFrame({"judge": ["llm"] * 2, "model": ["m"] * 2, "prompt_version": ["v3"] * 2,
                                 "votes": [None, None], "status": ["error"] * 2})  # fmt: skip
    all_unjudged.attrs[JUDGED_BY] = LLM_V3
    assert judge_settings(all_unjudged) == LLM_V3
    older = all_unjudged.assign(votes=["1/1", None])  # (verdicts written before they named their judge)
    older.attrs.clear()
    assert judge_settings(older) == {**LLM_V3, "settings": None}
