"""Parsing an execution batch: valid rows, one reject per bad record, and the fast path agreeing with the careful one."""

import json

import pandas as pd
import pytest
from upath import UPath

from filter_pipeline.rules import batch as batch_module
from filter_pipeline.rules.batch import BatchError, check_run_id, read_batch
from filter_pipeline_tests.builders import RAW_KEYS, attempt, jsonl, parse, task, write_batch


def test_tasks_and_attempts_parse_with_canonical_keys(tmp_path):
    b = parse(tmp_path, [task("a", key=["s", "#x", 1.0, True, None, "é"], extra_field={"x": 1})], [attempt("a", steps=3)])
    assert b.tasks["dedup_key"].tolist() == ['["s","#x",1.0,true,null,"é"]']
    assert b.tasks["start_kind"].tolist() == ["url"]
    assert b.attempts[["task_id", "attempt", "ok", "n_actions", "backend_ok"]].values.tolist() == [["a", 1, True, 3, True]]
    assert b.rejects.empty


@pytest.mark.parametrize(
    "line, field, message",
    [
        ("not json at all", None, "tasks.jsonl:2: line is not JSON"),
        ("[1, 2]", None, "tasks.jsonl:2: line is a JSON list, expected an object"),
        (json.dumps({k: v for k, v in task("b").items() if k != "macro"}), "macro", "missing field 'macro'"),
        (json.dumps(task("b", site=7)), "site", "field 'site' is a int (7), expected a string"),
        (json.dumps(task("b", key="s|#x|1")), "dedup_key", "field 'dedup_key' is a str"),
        (json.dumps(task("b", key=["s", ["nested"]])), "dedup_key", "must be an array of scalars"),
        (json.dumps(task("b", start={"url": "x"})), "start.kind", "field 'start.kind' is null"),
        (json.dumps(task("a")), "task_id", "task_id 'a' appears earlier in the file"),
    ],
)
def test_bad_task_line_is_one_reject_and_the_rest_is_kept(tmp_path, line, field, message):
    b = parse(tmp_path, [task("a"), line, task("c")], [attempt("a"), attempt("c")])
    assert b.tasks["task_id"].tolist() == ["a", "c"]
    assert len(b.rejects) == 1
    reject = b.rejects.iloc[0]
    assert (reject["file"], reject["line"]) == ("tasks.jsonl", 2)
    assert (None if pd.isna(reject["field"]) else reject["field"]) == field
    assert message in reject["message"]
    assert reject["raw"] == line[:4096]


def test_non_utf8_and_overlong_lines_are_rejected(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_module, "MAX_LINE_BYTES", 1000)
    run = write_batch(tmp_path, "r", [task("a")], [attempt("a")])
    with open(run / "tasks.jsonl", "ab") as f:
        f.write(b'{"task_id": "\xff\xfe"}\n')
        f.write(json.dumps(task("long", instruction="x" * 5000)).encode() + b"\n")
    b = read_batch(UPath(run), "r")
    assert b.tasks["task_id"].tolist() == ["a"]
    assert [m.split(": ", 1)[1][:22] for m in b.rejects["message"]] == ["line is not UTF-8 (inv", "line is 5,126 bytes, l"]
    assert b.rejects["raw"].str.len().max() <= 4096


@pytest.mark.parametrize(
    "record, field",
    [
        ({**attempt("a"), "attempt": "1"}, "attempt"),
        ({**attempt("a"), "attempt": True}, "attempt"),
        ({**attempt("a"), "ok": "yes"}, "ok"),
        ({**attempt("a"), "error": 5}, "error"),
        ({**attempt("a"), "steps": None}, "steps"),
        ({**attempt("a"), "backend": "fine"}, "backend"),
        ({**attempt("a"), "backend": {"ok": 1}}, "backend.ok"),
        ({**attempt("a"), "dir": "/etc/passwd"}, "dir"),
        ({**attempt("a"), "dir": "runs/r/../../secret"}, "dir"),
        (attempt("ghost"), "task_id"),
        (attempt("a", 1, ok=False, error="same number again"), "attempt"),
    ],
)
def test_bad_attempt_is_one_reject_and_the_rest_is_kept(tmp_path, record, field):
    b = parse(tmp_path, [task("a")], [attempt("a", 1), record, attempt("a", 2, ok=False, error="e")])
    assert b.attempts["attempt"].tolist() == [1, 2]
    assert b.rejects[["file", "line", "field"]].values.tolist() == [["executions.jsonl", 2, field]]


def test_batch_without_tasks_is_a_clear_error(tmp_path):
    run = write_batch(tmp_path, "r", [], [])
    with pytest.raises(BatchError, match=r"runs/r/tasks.jsonl holds no valid task"):
        read_batch(UPath(run), "r")
    (run / "tasks.jsonl").unlink()
    with pytest.raises(BatchError, match=r"runs/r/tasks.jsonl does not exist"):
        read_batch(UPath(run), "r")


def test_blank_lines_are_skipped_and_line_numbers_stay_physical(tmp_path):
    run = write_batch(tmp_path, "r", [task("a")], [])
    (run / "executions.jsonl").write_text("\n" + jsonl([attempt("a"), {"task_id": "a"}]))
    b = read_batch(UPath(run), "r")
    assert b.attempts["line"].tolist() == [2]
    assert b.rejects["line"].tolist() == [3]


def test_fast_path_gives_the_same_frame_as_the_careful_path(tmp_path):
    tasks = [task(f"t{i}") for i in range(5)]
    attempts = [
        attempt("t0", 1, ok=False, error="policy violation: x", backend=None),
        attempt("t0", 2),
        attempt("t1", 1, ok=False, backend={"ok": True}),
        {k: v for k, v in attempt("t2").items() if k != "backend"},
        attempt("t3", steps=0, extra="ignored"),
        attempt("t4", backend={"ok": False, "detail": None}),
    ]
    fast = parse(tmp_path / "fast", tasks, attempts)
    # a step that is not an object sends the whole file down the careful path
    careful = parse(tmp_path / "careful", tasks, [*attempts, {**attempt("t4", 9), "steps": [1]}])
    assert batch_module._fast_attempts((tmp_path / "fast" / "runs" / "r" / "executions.jsonl").read_bytes()) is not None
    assert careful.attempts.iloc[:-1].equals(fast.attempts)


@pytest.mark.parametrize("run_id", ["", ".", "..", "a/b", "../x", ".hidden", "a b", "x" * 129])
def test_run_id_must_be_a_plain_folder_name(run_id):
    with pytest.raises(ValueError, match="not a plain folder name"):
        check_run_id(run_id)


def test_plain_run_ids_are_accepted():
    assert check_run_id("2026-11-30_batch.7") == "2026-11-30_batch.7"


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


TRICKY_KEYS = [
    ["s", "#a", 1], ["s", "#a", "1"], ["s", "#a", 1.0], ["s", "#a", True], ["s", "#a", None],
    ["s", "a[1]", "x]y,[z"], ["s", "#a", 'quote " and \\ back'], ["sité", "#a", "ü\u2028"], ["s", "#a", 1e16], ["s", "#a", "seam ],[ inside"],
    [], ["s", "#a", -0.0, 12345678901234567890],
]  # fmt: skip


def test_fast_task_path_gives_the_same_frame_as_the_careful_path(tmp_path):
    tasks = [task(f"t{i}", key=k, note={"text": 'mentions "dedup_key" in prose'}) for i, k in enumerate(TRICKY_KEYS)]
    run = write_batch(tmp_path / "fast", "r", tasks, [])
    raw = (run / "tasks.jsonl").read_bytes()
    # whitespace the canonical form drops, to prove the key text is re-encoded, not copied
    (run / "tasks.jsonl").write_bytes(raw.replace(b'"dedup_key": [', b'"dedup_key" :  [ '))
    assert batch_module._fast_tasks((run / "tasks.jsonl").read_bytes()) is not None
    fast = read_batch(UPath(run), "r").tasks
    careful = parse(tmp_path / "careful", [*tasks, "not json"], []).tasks  # one bad line: careful path
    assert fast.equals(careful)
    assert fast["dedup_key"].tolist() == [json.dumps(k, ensure_ascii=False, separators=(",", ":")) for k in TRICKY_KEYS]


def test_fast_task_path_takes_compact_keys_as_written_only_where_that_is_their_canonical_text(tmp_path):
    line = '{{"task_id":"t{i}","macro":"m","site":"s","instruction":"i","dedup_key":{key},"start":{{"kind":"url"}}}}'
    run = write_batch(tmp_path / "fast", "r", [], [])
    (run / "tasks.jsonl").write_text("\n".join(line.format(i=i, key=key) for i, key in enumerate(RAW_KEYS)) + "\n")
    assert batch_module._fast_tasks((run / "tasks.jsonl").read_bytes()) is not None
    fast = read_batch(UPath(run), "r").tasks
    careful = parse(tmp_path / "careful", [*(json.loads(line.format(i=i, key=k)) for i, k in enumerate(RAW_KEYS)), "not json"], []).tasks
    assert fast.equals(careful)
    assert fast["dedup_key"].tolist() == [json.dumps(json.loads(k), ensure_ascii=False, separators=(",", ":")) for k in RAW_KEYS]


def test_fast_task_path_finds_the_key_after_nested_objects_and_brackets_in_strings(tmp_path):
    def nested_first(t: dict) -> dict:  # fields in another order: objects and an array of them before the key
        noise = {"text": "} ] { [ \\\" \"dedup_key\": [1] {"}
        deep = {"a": {"b": {"c": {"d": [{"e": "{"}]}}}}  # deeper than the fast match follows: the exact check
        return {"start": t["start"], "meta": [noise, deep], "task_id": t["task_id"], "macro": "m",
                "site": "s", "instruction": "}{", "dedup_key": t["dedup_key"]}  # fmt: skip

    tasks = [nested_first(task(f"t{i}", key=k)) for i, k in enumerate(TRICKY_KEYS)]
    tasks.insert(1, task("plain", key=["s", "#a", "plain"]))  # most lines in the usual order, some not
    run = write_batch(tmp_path / "fast", "r", tasks, [])
    assert batch_module._fast_tasks((run / "tasks.jsonl").read_bytes()) is not None
    fast = read_batch(UPath(run), "r").tasks
    careful = parse(tmp_path / "careful", [*tasks, "not json"], []).tasks
    assert fast.equals(careful)
    assert fast["dedup_key"].tolist()[:2] == ['["s","#a",1]', '["s","#a","plain"]']


def without_key_but_one_nested(t: dict) -> dict:
    """The task with no dedup_key of its own, only one inside another field's object."""
    rest = {k: v for k, v in t.items() if k != "dedup_key"}
    return {**rest, "start": {**t["start"], "dedup_key": ["nested"]}}


@pytest.mark.parametrize(
    "extra",
    [
        {"meta": {"dedup_key": ["nested"]}},  # named twice: only the careful path can tell which is which
        {"instruction": 7},
    ],
)
def test_fast_task_path_declines_what_it_cannot_be_sure_of(tmp_path, extra):
    run = write_batch(tmp_path, "r", [task("a"), task("b", **extra)], [])
    assert batch_module._fast_tasks((run / "tasks.jsonl").read_bytes()) is None


def test_a_dedup_key_inside_another_field_is_not_the_tasks_key(tmp_path):
    run = write_batch(tmp_path, "r", [task("a"), without_key_but_one_nested(task("b"))], [])
    assert batch_module._fast_tasks((run / "tasks.jsonl").read_bytes()) is None
    parsed = read_batch(UPath(run), "r")
    assert parsed.tasks["task_id"].tolist() == ["a"]
    assert parsed.rejects[["line", "field"]].values.tolist() == [[2, "dedup_key"]]


@pytest.mark.parametrize("text, records", [("a\nb\n", 2), ("a\nb", 2), ("a\n\nb\n", 2), ("\na\n", 1), ("a\n  \nb", 2), ("a\n \t", 1), ("", 0)])
def test_count_records_counts_non_blank_lines(tmp_path, text, records):
    (tmp_path / "executions.jsonl").write_text(text)
    assert batch_module.count_records(UPath(tmp_path)) == records


@pytest.mark.parametrize("scan", [1, 2, 3, 7, 1 << 20])
@pytest.mark.parametrize("text", [b"", b"a", b"\n", b"a\nb", b"a\nb\n", b"\n\nab\n\n\nc\n", "é\n€\n".encode() * 5])
def test_lines_are_counted_whatever_slice_of_the_data_each_scan_takes(monkeypatch, scan, text):
    monkeypatch.setattr(batch_module, "NEWLINE_SCAN_BYTES", scan)
    assert batch_module._line_count(text) == len(text.splitlines())
    assert batch_module._newline_positions(text).tolist() == [i for i, byte in enumerate(text) if byte == ord("\n")]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_count_records_reads_in_chunks_that_split_lines_anywhere(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(batch_module, "COUNT_CHUNK_BYTES", chunk)
    (tmp_path / "executions.jsonl").write_text("ab\n\n c\n \t\nlong line\r\nd")
    assert batch_module.count_records(UPath(tmp_path)) == 4


def test_a_batch_read_ahead_is_taken_as_parsed_when_its_files_are_unchanged(tmp_path):
    run = UPath(write_batch(tmp_path, "r", [task("a"), task("b")], [attempt("a"), attempt("b", ok=False)]))
    assert batch_module.read_ahead(run, "r")
    ahead = read_batch(run, "r")
    again = read_batch(run, "r")  # taken once: this one parses
    assert ahead.read_ahead and not again.read_ahead
    for got, want in ((ahead.tasks, again.tasks), (ahead.attempts, again.attempts), (ahead.rejects, again.rejects)):
        assert got.equals(want)


def test_a_batch_read_ahead_is_parsed_again_when_a_file_changed_since(tmp_path):
    run = UPath(write_batch(tmp_path, "r", [task("a")], [attempt("a")]))
    assert batch_module.read_ahead(run, "r")
    read_batch_module_wait(run)
    (tmp_path / "runs" / "r" / "tasks.jsonl").write_text(jsonl([task("a"), task("late")]))
    parsed = read_batch(run, "r")
    assert not parsed.read_ahead and parsed.tasks["task_id"].tolist() == ["a", "late"]


def read_batch_module_wait(run) -> None:
    """Wait for the read-ahead of `run` to finish (so a change made next is surely after it)."""
    [(_, parsed)] = [v for k, v in batch_module._read_ahead.items() if k[0] == str(run)]
    parsed.exception()


def test_a_broken_batch_read_ahead_fails_where_it_is_read_with_the_usual_error(tmp_path):
    run = UPath(write_batch(tmp_path, "r", [], []))
    assert batch_module.read_ahead(run, "r")
    with pytest.raises(BatchError, match="holds no valid task"):
        read_batch(run, "r")


def test_a_read_ahead_serves_only_its_own_batch_and_only_on_local_disk(tmp_path):
    one = UPath(write_batch(tmp_path, "one", [task("a")], [attempt("a")]))
    two = UPath(write_batch(tmp_path, "two", [task("b")], [attempt("b")]))
    assert batch_module.read_ahead(one, "one")
    assert not read_batch(two, "two").read_ahead
    assert read_batch(one, "one").read_ahead
    assert not batch_module.read_ahead(UPath("memory://data/runs/one"), "one")
