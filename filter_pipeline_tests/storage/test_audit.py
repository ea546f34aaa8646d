"""The warehouse audit (`filter-pipeline verify`): clean is clean, and each kind of finding is one line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from upath import UPath

from filter_pipeline.rules.schemas import to_arrow
from filter_pipeline.storage.audit import audit
from filter_pipeline.storage.files import input_fingerprints
from filter_pipeline.storage.history import read_commits
from filter_pipeline_tests.builders import (
    attempt,
    commit_files,
    task,
    verdicts,
    write_batch,
    write_kept,
    write_legacy_kept,
)


def committed_run(data, run_id, kept_rows, n_verdicts=None, history=None, caps=None, inputs=None):
    """A run as its walk leaves it: kept rows, its verdicts (all passed), an empty surplus, one commit."""
    root = UPath(data)
    write_kept(data, run_id, *kept_rows, commit=False)
    n = len(kept_rows) if n_verdicts is None else n_verdicts
    frame = verdicts(*({"task_id": f"{run_id}-v{i}"} for i in range(n)))
    for folder in ("judge_verdicts", "surplus"):
        (root / "warehouse" / folder).mkdir(parents=True, exist_ok=True)
    pq.write_table(
        to_arrow(frame, "judge_verdicts"), (root / "warehouse" / "judge_verdicts" / f"{run_id}.parquet").path
    )
    pq.write_table(to_arrow(frame.iloc[0:0], "surplus"), (root / "warehouse" / "surplus" / f"{run_id}.parquet").path)
    files = {
        "kept": root / "warehouse" / "kept" / f"{run_id}.parquet",
        "surplus": root / "warehouse" / "surplus" / f"{run_id}.parquet",
    }
    commit_files(data, run_id, files, history=history, caps=caps, kept_keys=len(kept_rows), inputs=inputs)


def lines(data) -> list[str]:
    return [f.line for f in audit(UPath(data))]


def test_a_clean_warehouse_has_no_finding(tmp_path):
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    committed_run(tmp_path, "r2", [("b", ["k", 2], "m", "s")], history={"r1": "x"})
    write_legacy_kept(tmp_path, "old", ("c", ["k", 3], "m", "s2"))
    assert lines(tmp_path) == []


def test_a_missing_or_changed_committed_file_is_one_line_each(tmp_path):
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    committed_run(tmp_path, "r2", [("b", ["k", 2], "m", "s")])
    (tmp_path / "warehouse" / "kept" / "r1.parquet").unlink()
    pq.write_table(pa.table({"task_id": ["x"]}), tmp_path / "warehouse" / "surplus" / "r2.parquet")
    found = lines(tmp_path)
    assert found[0] == ("warehouse/kept/r1.parquet is missing, but run r1 committed it: restore it, or re-filter r1 "
                        "with `filter-pipeline materialize r1`")  # fmt: skip
    assert found[1].startswith("warehouse/surplus/r2.parquet changed since run r2 was committed (sha256 ")
    assert len(found) == 2


def test_a_key_kept_by_two_runs_is_found_unless_one_is_retired(tmp_path):
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    committed_run(tmp_path, "r2", [("b", ["k", 1], "m", "s2")])
    assert lines(tmp_path) == [
        'key ["k",1] is kept 2 times (r1/a, r2/b): retire all but one in retired.json, or re-filter the later runs'
    ]
    (tmp_path / "retired.json").write_text(json.dumps([{"run_id": "r2", "task_ids": ["b"], "reason": "dup"}]))
    assert lines(tmp_path) == []


def test_a_cap_exceeded_with_the_history_a_run_read_is_found_with_its_recorded_caps(tmp_path):
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    r1 = read_commits(UPath(tmp_path) / "warehouse")["r1"].digest  # the record r2 and r4 read
    committed_run(tmp_path, "r2", [("b", ["k", 2], "m", "s")], history={"r1": r1}, caps={"per_site_cap": 1, "caps": {}})
    r2 = read_commits(UPath(tmp_path) / "warehouse")["r2"].digest
    committed_run(
        tmp_path,
        "r4",
        [("d", ["k", 4], "n", "s")],
        history={"r1": r1, "r2": r2},
        caps={"per_site_cap": 9, "caps": {"n": {"target": 0}}},
    )
    assert lines(tmp_path) == [
        "run r2: m/s holds 2 kept rows with the history it read, over its site cap 1",
        "run r4: macro n holds 1 kept rows with the history it read, over its target 0",
    ]


def test_a_run_restored_from_retired_json_is_counted_with_the_runs_walked_while_it_was_retired(tmp_path):
    cap = {"per_site_cap": 2, "caps": {}}
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s"), ("b", ["k", 2], "m", "s")], caps=cap)
    (tmp_path / "retired.json").write_text(json.dumps([{"run_id": "r1", "task_ids": None, "reason": "bad site"}]))
    # r1 retired as a whole when r2 walked: r2's history does not hold it, and r1's walk never read r2
    committed_run(tmp_path, "r2", [("c", ["k", 3], "m", "s"), ("d", ["k", 4], "m", "s")], caps=cap)
    assert lines(tmp_path) == []
    (tmp_path / "retired.json").unlink()
    blind = "committed without either walk reading the other"
    assert lines(tmp_path) == [
        f"run r1: m/s holds 4 kept rows with the history it read and r2 ({blind}), over its site cap 2",
        f"run r2: m/s holds 4 kept rows with the history it read and r1 ({blind}), over its site cap 2",
    ]


def test_a_cap_exceeded_only_since_a_run_it_read_was_walked_again_names_that_run(tmp_path):
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    r1 = read_commits(UPath(tmp_path) / "warehouse")["r1"].digest
    committed_run(tmp_path, "r2", [("b", ["k", 2], "m", "s")], history={"r1": r1}, caps={"per_site_cap": 2, "caps": {}})
    assert lines(tmp_path) == []
    # r1 walked again with a one-off cap, keeping one row more: r2's walk counted the r1 it read
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s"), ("a2", ["k", 5], "m", "s")], caps={"per_site_cap": 5})
    assert lines(tmp_path) == [
        "run r2: m/s holds 3 kept rows with its history as it is now (r1 walked again since it read them), over "
        "its site cap 2"
    ]


def test_verdicts_not_conserved_are_found(tmp_path):
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")], n_verdicts=3)
    assert lines(tmp_path) == [
        "run r1: 3 verdicts but 1 kept + 0 surplus + 0 judge failures + 0 unjudged (the verdicts changed since its "
        "walk?): re-filter r1 with `filter-pipeline materialize r1`"
    ]


def test_an_uncommitted_kept_file_and_an_unreadable_commit_are_found(tmp_path):
    write_kept(tmp_path, "r9", ("a", ["k", 1], "m", "s"), commit=False)
    (tmp_path / "warehouse" / "_commits").mkdir()
    (tmp_path / "warehouse" / "_commits" / "r8.json").write_text("[]")
    assert lines(tmp_path) == [
        "warehouse/_commits/r8.json is not a commit record (its fields differ): delete it and re-filter r8 with "
        "`filter-pipeline materialize r8`",
        "warehouse/kept/r9.parquet has no commit record (its walk stopped before committing): it is not history; "
        "`filter-pipeline materialize` walks r9 again and commits it",
    ]


def test_a_committed_file_that_is_no_kept_file_is_said_as_the_ledger_says_it(tmp_path):
    from filter_pipeline.rules.history import HistoryIntegrityError, open_kept

    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    kept = tmp_path / "warehouse" / "kept" / "r1.parquet"
    pq.write_table(pa.table({"task_id": ["a"], "macro": ["m"], "site": ["s"]}), kept)
    commit_files(tmp_path, "r1", {"kept": UPath(kept)}, kept_keys=1)  # (committed as it is: no key column)
    with pytest.raises(HistoryIntegrityError) as ledger:
        open_kept(kept.read_bytes(), "warehouse/kept/r1.parquet", "r1")
    assert lines(tmp_path) == [str(ledger.value)]
    assert str(ledger.value).startswith(
        "warehouse/kept/r1.parquet (committed by run r1) is not a kept file: no column dedup_key, key_hash: "
    )


def test_a_commit_naming_no_kept_file_is_said_as_the_ledger_says_it(tmp_path):
    from filter_pipeline.rules.history import HistoryIntegrityError
    from filter_pipeline.storage.history import history_sources

    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    commit_files(tmp_path, "r1", {})
    with pytest.raises(HistoryIntegrityError) as ledger:  # (the ledger's every walk, r1's own included)
        history_sources(UPath(tmp_path), read_commits(UPath(tmp_path) / "warehouse"))
    assert lines(tmp_path)[0] == str(ledger.value)
    assert "names no kept file: delete it and re-filter r1" in str(ledger.value)


def test_a_commit_record_gone_while_the_audit_lists_them_is_no_finding(tmp_path):
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    (tmp_path / "warehouse" / "_commits" / "r2.json").symlink_to(tmp_path / "deleted.json")  # (listed, then gone)
    assert lines(tmp_path) == []


def test_a_walk_committing_while_the_audit_reads_is_no_finding(tmp_path, monkeypatch):
    from filter_pipeline.storage import audit as audit_module

    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")])
    read_first, reads = audit_module._commits, []

    def records_then_r1_walked_again(warehouse):
        found = read_first(warehouse)
        if not reads:  # (r1 walked again and committed just after these records were read)
            committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s"), ("b", ["k", 2], "m", "s")])
            committed_run(tmp_path, "r2", [("c", ["k", 3], "m", "s")])
        reads.append(found)
        return found

    monkeypatch.setattr(audit_module, "_commits", records_then_r1_walked_again)
    assert lines(tmp_path) == []
    assert len(reads) == 3  # the first pass, the records read again after its findings, the second pass


def test_a_batch_changed_since_it_was_filtered_is_found(tmp_path):
    run = write_batch(tmp_path, "r1", [task("a")], [attempt("a")])
    committed_run(tmp_path, "r1", [("a", ["k", 1], "m", "s")], inputs=input_fingerprints(run))
    assert lines(tmp_path) == []
    write_batch(tmp_path, "r1", [task("a"), task("b")], [attempt("a")])
    assert lines(tmp_path) == [
        "runs/r1/tasks.jsonl changed since r1 was filtered: re-filter it with `filter-pipeline materialize r1` (it is "
        "not re-filtered unless named)"
    ]
