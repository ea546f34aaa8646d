"""CONTRACT §3.5 the prior-run dedup index, read off the data root: committed kept files, legacy kept.jsonl,
retired.json."""

import hashlib
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from upath import UPath

from filter_pipeline.rules.commits import HistoryIntegrityError
from filter_pipeline.rules.history import HistoryError, Retired
from filter_pipeline.rules.schemas import canonical_key, key_hash
from filter_pipeline.storage.history import build_prior_index, load_retired
from filter_pipeline_tests.builders import commit_files, write_kept, write_legacy_kept


def index(data, run_id="now", batch_keys=(), retired=None):
    texts = [canonical_key(k) for k in batch_keys]
    keys = pd.DataFrame(
        {
            "dedup_key": pd.Series(texts, dtype=object),
            "key_hash": pd.Series([key_hash(t) for t in texts], dtype="int64"),
        }
    )
    root = UPath(data)
    return build_prior_index(root, run_id, keys, retired or load_retired(root))


def counts_of(idx) -> dict:
    return {(m, s): n for m, s, n in idx.counts[["macro", "site", "n_kept"]].itertuples(index=False)}


def test_keys_and_counts_of_other_runs(tmp_path):
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s1"), ("b", ["k", 2], "m", "s2"))
    write_kept(tmp_path, "r2", ("c", ["k", 3], "m", "s1"))
    idx = index(tmp_path, batch_keys=[["k", 1], ["k", 3], ["k", 99]])
    assert idx.keys[["dedup_key", "run_id", "task_id"]].values.tolist() == [
        ['["k",1]', "r1", "a"],
        ['["k",3]', "r2", "c"],
    ]
    assert counts_of(idx) == {("m", "s1"): 2, ("m", "s2"): 1}  # counts cover every row, not just matching keys


def write_kept_with_hash(data, run_id: str, stored_hash: int, *rows: tuple) -> None:
    """A kept file whose key_hash column holds `stored_hash` on every row, whatever its text (a collision)."""
    write_kept(data, run_id, *rows, commit=False)
    path = UPath(data) / "warehouse" / "kept" / f"{run_id}.parquet"
    table = pq.read_table(path.path)
    forced = pa.array([stored_hash] * table.num_rows, pa.int64())
    pq.write_table(table.set_column(table.column_names.index("key_hash"), "key_hash", forced), path.path)
    commit_files(data, run_id, {"kept": path})


def rewrite_text_as_arrow_string(data, run_id: str) -> None:
    """The run's kept file as earlier versions wrote it: text columns of Arrow `string`, not `large_string`."""
    path = UPath(data) / "warehouse" / "kept" / f"{run_id}.parquet"
    table = pq.read_table(path.path)
    narrow = pa.schema([(f.name, pa.string() if f.type == pa.large_string() else f.type) for f in table.schema])
    pq.write_table(table.cast(narrow), path.path)
    commit_files(data, run_id, {"kept": path})


def test_kept_files_with_arrow_string_text_are_history_as_before_and_read_with_new_ones_as_one_table(tmp_path):
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s1"))
    rewrite_text_as_arrow_string(tmp_path, "r1")
    write_kept(tmp_path, "r2", ("b", ["k", 2], "m", "s1"))
    idx = index(tmp_path, batch_keys=[["k", 1], ["k", 2]])
    assert idx.keys[["dedup_key", "run_id"]].values.tolist() == [['["k",1]', "r1"], ['["k",2]', "r2"]]
    assert counts_of(idx) == {("m", "s1"): 2}
    folder = pd.read_parquet(tmp_path / "warehouse" / "kept")
    assert sorted(folder["task_id"]) == ["a", "b"] and folder["task_id"].dtype == "str"


def test_a_history_row_with_a_batch_keys_hash_but_other_text_is_no_match(tmp_path):
    shared = key_hash(canonical_key(["k", 1]))
    write_kept_with_hash(tmp_path, "r1", shared, ("a", ["k", 1], "m", "s"), ("b", ["k", 2], "m", "s"))
    write_kept_with_hash(tmp_path, "r2", shared, ("c", ["k", 2], "m", "s"), ("d", ["k", 1], "m", "s"))
    idx = index(tmp_path, batch_keys=[["k", 1], ["k", 3]])
    assert idx.keys[["dedup_key", "run_id", "task_id"]].values.tolist() == [
        ['["k",1]', "r1", "a"],
        ['["k",1]', "r2", "d"],
    ]


def test_the_run_itself_is_excluded_so_rematerializing_ignores_its_own_kept(tmp_path):
    write_kept(tmp_path, "now", ("a", ["k", 1], "m", "s"))
    idx = index(tmp_path, batch_keys=[["k", 1]])
    assert idx.keys.empty and idx.counts.empty


def test_retired_whole_run_and_retired_rows_do_not_count(tmp_path):
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s"))
    write_kept(tmp_path, "r2", ("b", ["k", 2], "m", "s"), ("c", ["k", 3], "m", "s"))
    write_kept(tmp_path, "r3", ("d", ["k", 4], "m", "s"))
    (tmp_path / "retired.json").write_text(
        json.dumps(
            [
                {"run_id": "r1", "reason": "bad site build"},
                {"run_id": "r2", "task_ids": ["b"], "reason": "mislabelled"},
                {"run_id": "r3", "task_ids": [], "reason": "retires nothing"},
            ]
        )
    )
    idx = index(tmp_path, batch_keys=[["k", i] for i in range(1, 5)])
    assert sorted(idx.keys["task_id"]) == ["c", "d"]
    assert counts_of(idx) == {("m", "s"): 2}


def test_legacy_kept_jsonl_counts_unless_the_run_has_a_commit(tmp_path):
    write_legacy_kept(tmp_path, "old", ("a", ["k", 1], "m", "s"), ("b", ["k", 2], "m", "s"))
    write_legacy_kept(tmp_path, "redone", ("x", ["k", 7], "m", "s"))
    write_kept(tmp_path, "redone", ("y", ["k", 8], "m", "s"))
    idx = index(tmp_path, batch_keys=[["k", 1], ["k", 7], ["k", 8]])
    assert sorted(zip(idx.keys["run_id"], idx.keys["task_id"])) == [("old", "a"), ("redone", "y")]
    assert counts_of(idx) == {("m", "s"): 3}


def test_a_legacy_row_holding_a_unicode_line_separator_is_one_row(tmp_path):
    # JSON strings may hold U+2028, U+2029 and U+0085 raw: they end no JSON Lines line
    row = {"task_id": "a\u2028b", "dedup_key": ["k\u0085", 1], "macro": "m", "site": "s\u2029"}
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "old" / "kept.jsonl").write_text(json.dumps(row, ensure_ascii=False) + "\n")
    idx = index(tmp_path, batch_keys=[["k\u0085", 1]])
    assert idx.keys["task_id"].tolist() == ["a\u2028b"]
    assert counts_of(idx) == {("m", "s\u2029"): 1}


@pytest.mark.parametrize(
    "line",
    [
        '{"task_id": "b"}',
        '{"task_id": "b", "macro": "m", "site": "s", "dedup_key": ["k", ' + "1" * 5000 + "]}",  # too long for int()
        '{"task_id": "b", "macro": "m", "site": "s", "dedup_key": "[\\"k\\", ' + "2" * 5000 + ']"}',  # in key text
        '{"task_id": "b", "macro": "m", "site": "s", "dedup_key": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"task_id": "b", "macro": "m", "site": "s", "dedup_key": "' + "[" * 100_000 + "]" * 100_000 + '"}',
        # a lone surrogate (valid JSON, not text: no Parquet file can hold it), and a field that is not a string
        '{"task_id": "b\\ud83d", "macro": "m", "site": "s", "dedup_key": ["k", 2]}',
        '{"task_id": "b", "macro": "m", "site": "s", "dedup_key": ["k\\udc00", 2]}',
        '{"task_id": "b", "macro": null, "site": "s", "dedup_key": ["k", 2]}',
        '{"task_id": "b", "macro": "m", "site": 7, "dedup_key": ["k", 2]}',
    ],
    ids=[
        "no-key",
        "long-integer",
        "long-integer-in-key-text",
        "nested-too-deep",
        "nested-too-deep-in-key-text",
        "lone-surrogate",
        "lone-surrogate-in-key",
        "null-macro",
        "number-site",
    ],  # fmt: skip
)
def test_bad_legacy_row_names_file_and_line(tmp_path, line):
    write_legacy_kept(tmp_path, "old", ("a", ["k", 1], "m", "s"))
    with open(tmp_path / "runs" / "old" / "kept.jsonl", "a") as f:
        f.write(line + "\n")
    with pytest.raises(HistoryError, match=r"runs/old/kept.jsonl:2: not a kept row"):
        index(tmp_path)


@pytest.mark.parametrize(
    "line, why",
    [('{"task_id": "b", "macro": "m", "site": "s"}', "missing field 'dedup_key'"), ('["b", "m"]', "not a JSON object"),
     ('{"task_id": "b", "macro": "m", "site": 3, "dedup_key": ["k"]}', "site is not a string")],
)  # fmt: skip
def test_a_bad_legacy_row_says_what_is_wrong_with_it(tmp_path, line, why):
    write_legacy_kept(tmp_path, "old", ("a", ["k", 1], "m", "s"))
    with open(tmp_path / "runs" / "old" / "kept.jsonl", "a") as f:
        f.write(line + "\n")
    with pytest.raises(HistoryError, match=rf"^runs/old/kept.jsonl:2: not a kept row \({why}\)$"):
        index(tmp_path)


def test_no_retired_json_retires_nothing(tmp_path):
    assert load_retired(UPath(tmp_path)) == Retired()


def test_counts_follow_the_files_as_they_are_now(tmp_path):
    """A run re-materialized or rows retired since an earlier read: each read counts the history afresh."""
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s1"))
    index(tmp_path, run_id="now", batch_keys=[["k", 1]])
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s1"), ("b", ["k", 2], "m", "s1"))  # re-materialized
    assert counts_of(index(tmp_path, run_id="")) == {("m", "s1"): 2}
    now_retired = Retired(tasks={"r1": frozenset({"b"})})
    assert counts_of(index(tmp_path, run_id="", retired=now_retired)) == {("m", "s1"): 1}
    assert counts_of(index(tmp_path, run_id="", retired=Retired(runs=frozenset({"r1"})))) == {}


def test_history_off_local_disk_is_read_as_on_disk():
    root = UPath("memory://history-read")
    write_kept(root, "r1", ("a", ["k", 1], "m", "s1"))
    idx = index(root, run_id="now", batch_keys=[["k", 1]])
    assert counts_of(idx) == {("m", "s1"): 1} and idx.keys["task_id"].tolist() == ["a"]


# --- history is what was committed, verified (CONTRACT §4) ----------------------------------------


def kept_path(data, run_id):
    return UPath(data) / "warehouse" / "kept" / f"{run_id}.parquet"


def test_a_kept_file_without_a_commit_is_not_history(tmp_path):
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s"))
    write_kept(tmp_path, "r2", ("b", ["k", 2], "m", "s"), commit=False)  # a walk killed before its commit
    idx = index(tmp_path, batch_keys=[["k", 1], ["k", 2]])
    assert idx.keys["task_id"].tolist() == ["a"]
    assert counts_of(idx) == {("m", "s"): 1}


def test_a_deleted_committed_kept_file_fails_with_one_line_naming_it(tmp_path):
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s"))
    kept_path(tmp_path, "r1").unlink()
    with pytest.raises(HistoryIntegrityError) as caught:
        index(tmp_path, batch_keys=[["k", 1]])
    assert str(caught.value) == (
        "warehouse/kept/r1.parquet is missing, but run r1 committed it: restore it, or re-filter r1 with "
        "`filter-pipeline materialize r1`"
    )


def test_a_kept_file_rewritten_by_another_tool_is_refused_never_read_as_new_keys(tmp_path):
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s"))
    # another tool: json.dumps defaults (", " separators), no key_hash column
    table = pa.table(
        {"task_id": ["a"], "macro": ["m"], "site": ["s"], "dedup_key": [json.dumps(["k", 1])], "run_id": ["r1"]}
    )
    pq.write_table(table, kept_path(tmp_path, "r1").path)
    with pytest.raises(
        HistoryIntegrityError,
        match=r"^warehouse/kept/r1.parquet changed since run r1 was committed \(sha256 [0-9a-f]{12}, \d+ bytes; committed [0-9a-f]{12}, \d+ bytes\): restore it, or re-filter r1 with `filter-pipeline materialize r1`$",
    ):
        index(tmp_path, batch_keys=[["k", 1]])


def test_a_committed_file_that_is_not_parquet_or_not_a_kept_file_is_refused(tmp_path):
    path = kept_path(tmp_path, "r1")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not parquet at all")
    commit_files(tmp_path, "r1", {"kept": path})
    with pytest.raises(
        HistoryIntegrityError, match=r"^warehouse/kept/r1.parquet \(committed by run r1\) is not readable Parquet"
    ):
        index(tmp_path)
    pq.write_table(pa.table({"task_id": ["a"], "macro": ["m"], "site": ["s"]}), path.path)
    commit_files(tmp_path, "r1", {"kept": path})
    with pytest.raises(HistoryIntegrityError, match=r"is not a kept file: no column dedup_key, key_hash: restore it"):
        index(tmp_path)


def test_an_unreadable_commit_record_is_refused_with_what_to_do(tmp_path):
    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s"))
    (tmp_path / "warehouse" / "_commits" / "r1.json").write_text("{half")
    with pytest.raises(HistoryIntegrityError, match=r"^warehouse/_commits/r1.json is not a commit record \(not JSON"):
        index(tmp_path)


def test_the_index_names_the_commits_and_legacy_files_it_read(tmp_path):
    from filter_pipeline.storage.history import read_commits

    write_kept(tmp_path, "r1", ("a", ["k", 1], "m", "s"))
    write_legacy_kept(tmp_path, "old", ("b", ["k", 2], "m", "s"))
    idx = index(tmp_path, batch_keys=[["k", 2]])
    legacy = hashlib.sha256((tmp_path / "runs" / "old" / "kept.jsonl").read_bytes()).hexdigest()
    assert idx.history == {"old": f"legacy:{legacy}", "r1": read_commits(UPath(tmp_path) / "warehouse")["r1"].digest}


def test_legacy_keys_in_any_json_spelling_are_compared_as_canonical_text(tmp_path):
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / "kept.jsonl").write_text(
        json.dumps({"task_id": "a", "macro": "m", "site": "s", "dedup_key": json.dumps(["k", "é", 1])})
        + "\n"  # text, ", " and \\u00e9
        + '{"task_id": "b", "macro": "m", "site": "s", "dedup_key": [ "k" , 2 ]}\n'
    )
    idx = index(tmp_path, batch_keys=[["k", "é", 1], ["k", 2]])
    assert idx.keys["dedup_key"].tolist() == ['["k","é",1]', '["k",2]']


def walk(data, run_id: str, *rows: tuple, retired=None, walked_at: str = "2026-12-01T00:00:00+00:00") -> None:
    """A committed walk of `run_id` as the ledger leaves it: its kept file, and the prior_kept_counts of every
    other committed run it read (minus `retired`), both named by its commit record with those runs' digests."""
    from filter_pipeline.rules.schemas import to_arrow
    from filter_pipeline.storage.history import read_commits
    from filter_pipeline.storage.parquet import write_parquet

    root = UPath(data)
    idx = index(data, run_id, retired=retired)
    counts_path = root / "warehouse" / "prior_kept_counts" / f"{run_id}.parquet"
    write_parquet(to_arrow(idx.counts, "prior_kept_counts"), counts_path)
    write_kept(data, run_id, *rows, commit=False)
    digests = {r: c.digest for r, c in read_commits(root / "warehouse").items() if r != run_id}
    files = {"kept": root / "warehouse" / "kept" / f"{run_id}.parquet", "prior_kept_counts": counts_path}
    commit_files(data, run_id, files, history=digests, walked_at=walked_at)


def test_coverage_counts_from_the_newest_walk_are_those_of_every_file(tmp_path):
    from filter_pipeline.rules.history import covering_walk
    from filter_pipeline.storage.history import kept_counts, read_commits

    root = UPath(tmp_path)

    def both():
        retired = load_retired(root)
        fast, runs = kept_counts(root, retired)
        full = index(tmp_path, "", retired=retired)
        assert runs == full.runs_read
        return counts_of(type("I", (), {"counts": fast})), counts_of(full)

    walk(tmp_path, "r1", ("a", ["k", 1], "m", "s1"), ("b", ["k", 2], "m", "s2"), walked_at="2026-12-01T00:00:01+00:00")
    walk(tmp_path, "r2", ("c", ["k", 3], "m", "s1"), walked_at="2026-12-01T00:00:02+00:00")
    fast, full = both()
    assert fast == full == {("m", "s1"): 2, ("m", "s2"): 1}
    assert covering_walk(read_commits(root / "warehouse"), {"r1", "r2"}, Retired()) == "r2"  # counted from r2's walk
    (tmp_path / "retired.json").write_text(json.dumps([{"run_id": "r1"}]))  # retired after the walks: not read
    fast, full = both()
    assert fast == full == {("m", "s1"): 1}
    (tmp_path / "retired.json").write_text(json.dumps([{"run_id": "r1", "task_ids": ["a"]}]))
    walk(tmp_path, "r3", ("d", ["k", 4], "m", "s2"), retired=load_retired(root), walked_at="2026-12-01T00:00:03+00:00")
    assert both()[0] == both()[1] == {("m", "s1"): 1, ("m", "s2"): 2}
    (tmp_path / "retired.json").unlink()  # a task retired when r3 walked counts again: r3's counts lack it
    fast, full = both()
    assert fast == full == {("m", "s1"): 2, ("m", "s2"): 2}
    (root / "warehouse" / "kept" / "r1.parquet").unlink()  # any committed file missing fails, as a full read does
    with pytest.raises(HistoryIntegrityError, match="r1.parquet is missing"):
        kept_counts(root, load_retired(root))


def test_coverage_counts_read_while_a_walk_commits_are_read_again_not_failed(tmp_path, monkeypatch):
    from filter_pipeline.storage import history

    root = UPath(tmp_path)
    walk(tmp_path, "r1", ("a", ["k", 1], "m", "s1"), walked_at="2026-12-01T00:00:01+00:00")
    read_first, reads = history.read_commits, []

    def records_then_r1_walked_again(warehouse):
        found = read_first(warehouse)
        reads.append(found)
        if len(reads) == 1:  # (r1 walked again and committed just after these records were read)
            monkeypatch.setattr(history, "read_commits", read_first)
            walk(tmp_path, "r1", ("a", ["k", 1], "m", "s1"), ("b", ["k", 2], "m", "s1"))
            monkeypatch.setattr(history, "read_commits", records_then_r1_walked_again)
        return found

    monkeypatch.setattr(history, "read_commits", records_then_r1_walked_again)
    counts, runs = history.kept_counts(root, load_retired(root))
    assert counts_of(type("I", (), {"counts": counts})) == {("m", "s1"): 2} and runs == 1
    assert len(reads) == 2 and reads[0] != reads[1]
