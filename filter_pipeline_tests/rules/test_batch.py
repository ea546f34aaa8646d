"""Parsing an execution batch: valid rows, one reject per bad record, and Arrow's read of executions.jsonl agreeing
with the line-by-line one."""

import json
import random

import pandas as pd
import pytest
from upath import UPath

from filter_pipeline.rules import batch as batch_module
from filter_pipeline.rules import records as records_module
from filter_pipeline.rules.batch import BatchError, check_run_id
from filter_pipeline.storage.runs import read_batch
from filter_pipeline_tests.builders import RAW_KEYS, attempt, jsonl, parse, rows, task, write_batch


def test_tasks_and_attempts_parse_with_canonical_keys(tmp_path):
    b = parse(
        tmp_path, [task("a", key=["s", "#x", 1.0, True, None, "é"], extra_field={"x": 1})], [attempt("a", steps=3)]
    )
    assert b.tasks["dedup_key"].tolist() == ['["s","#x",1.0,true,null,"é"]']
    assert b.tasks["start_kind"].tolist() == ["url"]
    assert b.attempts[["task_id", "attempt", "ok", "n_actions", "backend_ok"]].values.tolist() == [
        ["a", 1, True, 3, True]
    ]
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
    monkeypatch.setattr(records_module, "MAX_LINE_BYTES", 1000)
    run = write_batch(tmp_path, "r", [task("a")], [attempt("a")])
    with open(run / "tasks.jsonl", "ab") as f:
        f.write(b'{"task_id": "\xff\xfe"}\n')
        f.write(json.dumps(task("long", instruction="x" * 5000)).encode() + b"\n")
    b = read_batch(UPath(run), "r")
    assert b.tasks["task_id"].tolist() == ["a"]
    assert [m.split(": ", 1)[1][:22] for m in b.rejects["message"]] == [
        "line is not UTF-8 (inv",
        "line is 5,126 bytes, l",
    ]
    assert b.rejects["raw"].str.len().max() <= 4096


def test_the_line_limit_counts_the_carriage_return_of_a_crlf_line(tmp_path, monkeypatch):
    for module in (records_module, batch_module):  # (the record checks and the whole-file reader's own check)
        monkeypatch.setattr(module, "MAX_LINE_BYTES", 1000)
    line = json.dumps(task("edge", instruction=""))
    line = json.dumps(task("edge", instruction="x" * (1000 - len(line))))  # exactly the limit
    for ending, kept in ((b"\n", True), (b"\r\n", False)):
        run = write_batch(tmp_path / ending.hex(), "r", [task("a")], [attempt("a")])
        with open(run / "tasks.jsonl", "ab") as f:
            f.write(line.encode() + ending)
        b = read_batch(UPath(run), "r")
        assert ("edge" in b.tasks["task_id"].tolist()) is kept
        assert bool(b.rejects["message"].str.contains("line is 1,001 bytes").any()) is not kept


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


def test_arrow_reads_executions_as_the_record_checks_do(tmp_path):
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
    # a step that is not an object sends the whole file line by line through the record checks
    careful = parse(tmp_path / "careful", tasks, [*attempts, {**attempt("t4", 9), "steps": [1]}])
    assert (
        batch_module._arrow_attempts((tmp_path / "fast" / "runs" / "r" / "executions.jsonl").read_bytes()) is not None
    )
    assert careful.attempts.iloc[:-1].equals(fast.attempts)


@pytest.mark.parametrize("run_id", ["", ".", "..", "a/b", "../x", ".hidden", "a b", "x" * 129, "r1\n", "a...b"])
def test_run_id_must_be_a_plain_folder_name(run_id):
    with pytest.raises(ValueError, match="not a plain folder name"):
        check_run_id(run_id)


def test_plain_run_ids_are_accepted():
    assert check_run_id("2026-11-30_batch.7") == "2026-11-30_batch.7"


TRICKY_KEYS = [
    ["s", "#a", 1], ["s", "#a", "1"], ["s", "#a", 1.0], ["s", "#a", True], ["s", "#a", None],
    ["s", "a[1]", "x]y,[z"], ["s", "#a", 'quote " and \\ back'], ["sité", "#a", "ü\u2028"], ["s", "#a", 1e16], ["s", "#a", "seam ],[ inside"],
    [], ["s", "#a", -0.0, 12345678901234567890],
]  # fmt: skip


def test_task_keys_are_their_canonical_text_however_they_were_written(tmp_path):
    tasks = [task(f"t{i}", key=k, note={"text": 'mentions "dedup_key" in prose'}) for i, k in enumerate(TRICKY_KEYS)]
    run = write_batch(tmp_path, "r", tasks, [])
    raw = (run / "tasks.jsonl").read_bytes()
    # whitespace the canonical form drops, to prove the key text is re-encoded, not copied
    (run / "tasks.jsonl").write_bytes(raw.replace(b'"dedup_key": [', b'"dedup_key" :  [ '))
    parsed = read_batch(UPath(run), "r").tasks
    assert parsed["dedup_key"].tolist() == [
        json.dumps(k, ensure_ascii=False, separators=(",", ":")) for k in TRICKY_KEYS
    ]


def test_compact_task_keys_are_taken_as_written_only_where_that_is_their_canonical_text(tmp_path):
    line = '{{"task_id":"t{i}","macro":"m","site":"s","instruction":"i","dedup_key":{key},"start":{{"kind":"url"}}}}'
    run = write_batch(tmp_path, "r", [], [])
    (run / "tasks.jsonl").write_text("\n".join(line.format(i=i, key=key) for i, key in enumerate(RAW_KEYS)) + "\n")
    parsed = read_batch(UPath(run), "r").tasks
    assert parsed["dedup_key"].tolist() == [
        json.dumps(json.loads(k), ensure_ascii=False, separators=(",", ":")) for k in RAW_KEYS
    ]


def test_the_tasks_own_key_is_found_after_nested_objects_and_brackets_in_strings(tmp_path):
    def nested_first(t: dict) -> dict:  # fields in another order: objects and an array of them before the key
        noise = {"text": '} ] { [ \\" "dedup_key": [1] {'}
        deep = {"a": {"b": {"c": {"d": [{"e": "{"}]}}}}  # deeper than the fast match follows: the exact check
        return {"start": t["start"], "meta": [noise, deep], "task_id": t["task_id"], "macro": "m",
                "site": "s", "instruction": "}{", "dedup_key": t["dedup_key"]}  # fmt: skip

    tasks = [nested_first(task(f"t{i}", key=k)) for i, k in enumerate(TRICKY_KEYS)]
    tasks.insert(1, task("plain", key=["s", "#a", "plain"]))  # most lines in the usual order, some not
    run = write_batch(tmp_path, "r", tasks, [])
    parsed = read_batch(UPath(run), "r").tasks
    assert parsed["dedup_key"].tolist()[:2] == ['["s","#a",1]', '["s","#a","plain"]']


def without_key_but_one_nested(t: dict) -> dict:
    """The task with no dedup_key of its own, only one inside another field's object."""
    rest = {k: v for k, v in t.items() if k != "dedup_key"}
    return {**rest, "start": {**t["start"], "dedup_key": ["nested"]}}


def test_a_dedup_key_inside_another_field_is_not_the_tasks_key(tmp_path):
    run = write_batch(tmp_path, "r", [task("a"), without_key_but_one_nested(task("b"))], [])
    parsed = read_batch(UPath(run), "r")
    assert parsed.tasks["task_id"].tolist() == ["a"]
    assert parsed.rejects[["line", "field"]].values.tolist() == [[2, "dedup_key"]]


# --- records that are valid JSON but no use as data -----------------------------------------------------

LONG = "1" + "0" * 5000  # more digits than Python converts to an int (sys.get_int_max_str_digits: 4,300)
SURROGATE = "\\ud800"  # a lone surrogate, as a JSON escape: valid JSON, but not text


def with_raw(record: dict, fields: dict) -> str:
    """The record's JSON line with each of `fields` (added if absent) set to the given raw JSON text."""
    text = json.dumps({**record, **{k: f"@{k}@" for k in fields}})
    for name, raw in fields.items():
        text = text.replace(f'"@{name}@"', raw)
    return text


def task_line(**fields) -> str:
    """A tasks.jsonl line of task "b" with the given fields as raw JSON text."""
    return with_raw(task("b"), fields)


def attempt_line(**fields) -> str:
    """An executions.jsonl line of attempt 1 of "b" with the given fields as raw JSON text."""
    return with_raw(attempt("b", ok=False, error="e"), fields)


def outputs_are_writable(b) -> None:
    """Each frame written as its Parquet output, where a lone surrogate used to fail the whole batch."""
    import io

    import pyarrow.parquet as pq

    from filter_pipeline.rules.schemas import to_arrow

    for asset, frame in (("batch_tasks", b.tasks), ("batch_attempts", b.attempts), ("batch_rejects", b.rejects)):
        pq.write_table(to_arrow(frame, asset), io.BytesIO())


@pytest.mark.parametrize(
    "line, field, message",
    [
        (
            task_line(task_id=f'"b{SURROGATE}"'),
            "task_id",
            r"field 'task_id' holds a lone surrogate (\ud800), which is not text",
        ),
        (task_line(macro=f'"{SURROGATE}"'), "macro", r"field 'macro' holds a lone surrogate (\ud800)"),
        (task_line(site='"s\\udfff"'), "site", r"field 'site' holds a lone surrogate (\udfff)"),
        (
            task_line(dedup_key=f'["s", "#{SURROGATE}el", 1]'),
            "dedup_key[1]",
            r"field 'dedup_key[1]' holds a lone surrogate",
        ),
        (task_line(start=f'{{"kind": "url{SURROGATE}"}}'), "start.kind", "field 'start.kind' holds a lone surrogate"),
        (
            task_line(dedup_key=f'["s", {LONG}]'),
            "dedup_key[1]",
            "field 'dedup_key[1]' holds an integer of 5,001 digits, more than the 4,300 Python converts",
        ),
        (task_line(dedup_key=f'["s",-{LONG}]'), "dedup_key[1]", "holds an integer of 5,001 digits"),
        (task_line(start=LONG), "start", "field 'start' holds an integer of 5,001 digits"),
        (
            task_line(dedup_key='["s", 1e400]'),
            "dedup_key",
            "field 'dedup_key' holds NaN or Infinity (or a number too large for a float, such as 1e400)",
        ),
        (task_line(dedup_key='["s",1e400]'), "dedup_key", "holds NaN or Infinity"),
        (task_line(dedup_key='["s", NaN]'), "dedup_key", "holds NaN or Infinity"),
        (task_line(dedup_key='["s",-Infinity]'), "dedup_key", "holds NaN or Infinity"),
        (
            task_line(dedup_key="[" * 100_000 + "]" * 100_000),
            None,
            "line nests arrays or objects deeper than a JSON reader follows",
        ),
        (task_line(task_id='"b\xed\xa0\x80"'), None, "line is not UTF-8"),  # a surrogate as UTF-8-style bytes (CESU-8)
    ],
)
def test_a_task_that_is_json_but_not_data_is_one_reject_and_the_rest_is_kept(tmp_path, line, field, message):
    run = write_batch(tmp_path, "r", [task("a"), task("c")], [attempt("a"), attempt("c")])
    (run / "tasks.jsonl").write_bytes(
        jsonl([task("a")]).encode()
        + line.encode("latin-1" if "\xed" in line else "utf-8")
        + b"\n"
        + jsonl([task("c")]).encode()
    )
    b = read_batch(UPath(run), "r")
    assert b.tasks["task_id"].tolist() == ["a", "c"]
    assert b.tasks["dedup_key"].tolist() == ['["s","#el","a"]', '["s","#el","c"]']
    assert b.attempts["task_id"].tolist() == ["a", "c"]
    assert b.rejects[["file", "line"]].values.tolist() == [["tasks.jsonl", 2]]
    reject = b.rejects.iloc[0]
    assert (None if pd.isna(reject["field"]) else reject["field"]) == field
    assert reject["message"].startswith("tasks.jsonl:2: ") and message in reject["message"]
    outputs_are_writable(b)


@pytest.mark.parametrize(
    "line, field, message",
    [
        (
            attempt_line(task_id=f'"b{SURROGATE}"'),
            "task_id",
            r"field 'task_id' holds a lone surrogate (\ud800), which is not text",
        ),
        (attempt_line(dir=f'"runs/r/traj/{SURROGATE}"'), "dir", "field 'dir' holds a lone surrogate"),
        (
            attempt_line(attempt=LONG),
            "attempt",
            "field 'attempt' holds an integer of 5,001 digits, more than the 4,300 Python converts",
        ),
        (attempt_line(steps=LONG), "steps", "field 'steps' holds an integer of 5,001 digits"),
        (attempt_line(ok=f"-{LONG}"), "ok", "field 'ok' holds an integer of 5,001 digits"),
        (attempt_line(backend=f'{{"ok": {LONG}}}'), "backend.ok", "field 'backend.ok' holds an integer of 5,001"),
        (
            attempt_line(attempt="1" + "0" * 25),
            "attempt",
            "field 'attempt' is a int (10000000000000000000000000), expected an integer within 64 bits",
        ),
        (attempt_line(attempt="1e400"), "attempt", "field 'attempt' is a float (Infinity), expected an integer"),
        (
            attempt_line(steps="[" * 100_000 + "]" * 100_000),
            None,
            "line nests arrays or objects deeper than a JSON reader follows",
        ),
        (attempt_line(dir='"runs/r/traj/b\xff"'), None, "line is not UTF-8"),
    ],
)
def test_an_attempt_that_is_json_but_not_data_is_one_reject_and_the_rest_is_kept(tmp_path, line, field, message):
    run = write_batch(
        tmp_path, "r", [task("a"), task("b")], [attempt("a"), line, attempt("b", 2, ok=False, error="e2")]
    )
    raw = (run / "executions.jsonl").read_bytes()
    (run / "executions.jsonl").write_bytes(raw.replace("\xff".encode(), b"\xff"))  # the byte itself, not UTF-8
    b = read_batch(UPath(run), "r")
    assert b.tasks["task_id"].tolist() == ["a", "b"]
    assert rows(b.attempts, "task_id", "attempt", "error") == [["a", 1, None], ["b", 2, "e2"]]
    assert b.rejects[["file", "line"]].values.tolist() == [["executions.jsonl", 2]]
    reject = b.rejects.iloc[0]
    assert (None if pd.isna(reject["field"]) else reject["field"]) == field
    assert reject["message"].startswith("executions.jsonl:2: ") and message in reject["message"]
    outputs_are_writable(b)


def test_what_json_reads_but_pyarrow_refuses_elsewhere_in_a_record_is_kept(tmp_path):
    """1e400 (Infinity) or NaN in a field the pipeline does not use, valid surrogate pairs, digits in a
    string: the record is fine, whichever path reads it."""
    long_text = "7" * 5000  # digits, but in a string: the fast path declines, the careful one keeps it
    tasks = [task("a", instruction=long_text), task("b", note=float("inf"), instruction="smile \U0001f600")]
    attempts = [attempt("a", steps=1) | {"score": float("nan")}, attempt("b") | {"big": 1e308}]
    b = parse(tmp_path, tasks, attempts)
    assert b.rejects.empty
    assert b.tasks["instruction"].tolist() == [long_text, "smile \U0001f600"]
    assert b.attempts["task_id"].tolist() == ["a", "b"]
    outputs_are_writable(b)


def test_a_lone_surrogate_in_free_text_is_a_replacement_character_and_the_record_is_kept(tmp_path):
    """An instruction, an error or a backend detail cut mid-emoji (a harness cutting a message in UTF-16 writes
    the half it keeps as an escape): still text to read, so the task is judged and the failed attempt is a
    failure-pool row, with U+FFFD for the half surrogate; an identifier holding one is rejected (above)."""
    tasks = [task("a", instruction="click the \ud83d"), task("b", instruction="pair reversed \ude00\ud83d x")]
    attempts = [
        attempt("a", 1, ok=False, error="assertion failed: \ud800"),
        attempt("a", 2, backend={"ok": True, "detail": "row \udfff found"}),
        attempt("b"),
    ]
    b = parse(tmp_path, tasks, attempts)
    assert b.rejects.empty, b.rejects["message"].tolist()
    assert b.tasks["instruction"].tolist() == ["click the \ufffd", "pair reversed \ufffd\ufffd x"]
    assert rows(b.attempts, "task_id", "attempt", "error", "backend_detail") == [
        ["a", 1, "assertion failed: \ufffd", "detail a/1"],
        ["a", 2, None, "row \ufffd found"],
        ["b", 1, None, "detail b/1"],
    ]
    outputs_are_writable(b)


def test_a_lone_surrogate_in_a_field_no_row_keeps_is_let_be_whichever_path_reads_the_file(tmp_path):
    """Page text cut mid-emoji (JavaScript escapes the half it keeps) in an action, or in a field the stage
    does not read: the record is fine; its kept fields are as they were."""
    run = write_batch(tmp_path, "r", [task("a"), task("b")], [attempt("a"), attempt("b")])
    (run / "tasks.jsonl").write_text(
        with_raw(task("a"), {"note": f'{{"page": ["smile {SURROGATE}"]}}'}) + "\n"
        + task_line(extra=f'{{"{SURROGATE}": 1}}', **{"task_id.note": f'"{SURROGATE}"', "start_": f'"{SURROGATE}"'})
        + "\n"
    )  # fmt: skip
    (run / "executions.jsonl").write_text(
        with_raw(attempt("a"), {"steps": '[{"action": "type", "text": "cut \\ud83d"}, {"action": "click"}]'})
        + "\n"
        + with_raw(attempt("b", ok=False, error="e"), {"extra": f'{{"{SURROGATE}": [1]}}'})
        + "\n"
    )
    b = read_batch(UPath(run), "r")
    assert b.rejects.empty, b.rejects["message"].tolist()
    assert rows(b.tasks, "task_id", "dedup_key") == [["a", '["s","#el","a"]'], ["b", '["s","#el","b"]']]
    assert rows(b.attempts, "task_id", "ok", "error", "n_actions") == [["a", True, None, 2], ["b", False, "e", 2]]
    outputs_are_writable(b)


def test_an_integer_too_long_for_python_in_a_field_no_row_uses_is_let_be(tmp_path):
    """In an extra field, inside `start` beside its kind, inside a step or beside the backend's fields: the
    record is fine (CONTRACT §2: other fields must not break anything); its used fields are as they were."""
    run = write_batch(tmp_path, "r", [task("a"), task("b")], [attempt("a"), attempt("b")])
    (run / "tasks.jsonl").write_text(
        with_raw(task("a"), {"note": f"[{LONG}]"}) + "\n"
        + task_line(start=f'{{"kind": "url", "n": -{LONG}}}', **{"dedup_key.n": LONG}) + "\n"
    )  # fmt: skip
    (run / "executions.jsonl").write_text(
        with_raw(attempt("a"), {"steps": f'[{{"action": "type", "text": {LONG}}}, {{"action": "click"}}]'}) + "\n"
        + with_raw(attempt("b", ok=False, error="e"), {"backend": f'{{"ok": true, "detail": "d", "n": {LONG}}}'})
        + "\n"
    )  # fmt: skip
    b = read_batch(UPath(run), "r")
    assert b.rejects.empty, b.rejects["message"].tolist()
    assert rows(b.tasks, "task_id", "dedup_key", "start_kind") == [
        ["a", '["s","#el","a"]', "url"],
        ["b", '["s","#el","b"]', "url"],
    ]
    assert rows(b.attempts, "task_id", "ok", "n_actions", "backend_ok", "backend_detail") == [
        ["a", True, 2, True, "detail a/1"],
        ["b", False, 2, True, "d"],
    ]
    outputs_are_writable(b)


def test_integers_at_pythons_limit_are_kept(tmp_path):
    at_limit = "9" * 4300
    run = write_batch(tmp_path, "r", [task("a")], [attempt("a")])
    (run / "tasks.jsonl").write_text(task_line(dedup_key=f'["s",{at_limit}]').replace('"b"', '"a"', 1) + "\n")
    b = read_batch(UPath(run), "r")
    assert b.rejects.empty
    assert b.tasks["dedup_key"].tolist() == [f'["s",{at_limit}]']


def test_arrow_reads_a_long_integer_no_row_uses_as_the_record_checks_do(tmp_path):
    """Arrow skips a field it was not asked for, whatever it holds: a long integer there keeps the fast path,
    with the rows the record checks give."""
    attempts = [attempt("a"), attempt("b", extra=1)]
    fast = write_batch(tmp_path / "fast", "r", [task("a"), task("b")], attempts)
    path = fast / "executions.jsonl"
    path.write_text(path.read_text().replace('"extra": 1', f'"extra": {LONG}'))
    assert batch_module._arrow_attempts(path.read_bytes()) is not None
    careful = write_batch(tmp_path / "careful", "r", [task("a"), task("b")], [])
    (careful / "executions.jsonl").write_text(path.read_text() + "not json\n")
    got = [read_batch(UPath(run), "r") for run in (fast, careful)]
    assert got[0].attempts.equals(got[1].attempts)
    assert got[1].rejects["line"].tolist() == [3]


@pytest.mark.parametrize(
    "field, raw, rejected_field, arrow_reads",
    [
        ("attempt", LONG, "attempt", False),
        ("ok", LONG, "ok", False),
        ("dir", LONG, "dir", False),
        ("backend", f'{{"ok": {LONG}}}', "backend.ok", False),
        ("backend", f'{{"ok": true, "detail": {LONG}}}', "backend.detail", False),
        ("steps", f'[{{"action": "type", "text": {LONG}}}]', None, True),
        ("backend", f'{{"ok": true, "n": {LONG}}}', None, True),
        ("steps", f"[{LONG}]", None, False),  # a step that is not an object: Arrow declines, the checks count it
    ],
)
def test_arrow_and_the_record_checks_agree_on_a_long_integer_in_an_attempt(
    tmp_path, field, raw, rejected_field, arrow_reads
):
    """Where a row reads the field, Arrow finds the wrong type and leaves the file to the record checks, which
    reject the record there; anywhere else the record is kept, whichever reads it."""
    run = write_batch(tmp_path, "r", [task("a"), task("b")], [])
    (run / "executions.jsonl").write_text(json.dumps(attempt("b")) + "\n" + with_raw(attempt("a"), {field: raw}) + "\n")
    fast = batch_module._arrow_attempts((run / "executions.jsonl").read_bytes())
    assert (fast is not None) == arrow_reads
    b = read_batch(UPath(run), "r")
    if rejected_field is None:
        assert b.rejects.empty
        steps = 1 if field == "steps" else 2  # (the builder's attempts have two)
        assert rows(b.attempts, "task_id", "n_actions") == [["b", 2], ["a", steps]]
    else:
        assert rows(b.rejects, "line", "field") == [[2, rejected_field]]
        assert b.attempts["task_id"].tolist() == ["b"]


def test_an_attempt_nested_deeper_than_json_loads_follows_is_kept_whichever_way_the_file_is_read(tmp_path):
    """Arrow reads any depth: an attempt whose used fields are fine is kept, whether Arrow reads the file whole
    or the records are checked line by line (the deep line alone then goes to Arrow)."""
    deep = "[" * 5000 + "]" * 5000
    attempts = [with_raw(attempt("a"), {"steps": f'[{{"x": {deep}}}]'}), json.dumps(attempt("b"))]
    whole = write_batch(tmp_path / "whole", "r", [task("a"), task("b")], attempts)
    assert batch_module._arrow_attempts((whole / "executions.jsonl").read_bytes()) is not None
    by_line = write_batch(tmp_path / "by_line", "r", [task("a"), task("b")], [*attempts, "not json"])
    got = [read_batch(UPath(run), "r") for run in (whole, by_line)]
    for b in got:
        assert b.attempts[["task_id", "n_actions"]].values.tolist() == [["a", 1], ["b", 2]]
    assert got[1].rejects["line"].tolist() == [3]
    assert got[0].attempts.equals(got[1].attempts)


def test_a_task_nested_deeper_than_json_loads_follows_is_one_reject(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    b = parse(tmp_path, [task_line(note=deep).replace('"b"', '"a"', 1), json.dumps(task("b"))], [attempt("b")])
    assert b.tasks["task_id"].tolist() == ["b"]
    assert rows(b.rejects, "line", "field") == [[1, None]]
    assert "nests arrays or objects deeper than a JSON reader follows" in b.rejects["message"].item()


def test_invalid_utf8_in_a_field_the_pipeline_ignores_is_rejected(tmp_path):
    run = write_batch(tmp_path, "r", [task("a"), task("b")], [attempt("a"), attempt("b", note="x")])
    raw = (run / "executions.jsonl").read_bytes()
    (run / "executions.jsonl").write_bytes(raw.replace(b'"note": "x"', b'"note": "\xc3("'))
    assert batch_module._arrow_attempts((run / "executions.jsonl").read_bytes()) is None
    b = read_batch(UPath(run), "r")
    assert b.attempts["task_id"].tolist() == ["a"]
    assert rows(b.rejects, "line", "field") == [[2, None]]
    assert "line is not UTF-8" in b.rejects["message"].item()


def test_arrow_reads_tasks_as_the_record_checks_do(tmp_path):
    """Arrow reads tasks.jsonl whole (each key by orjson): the same rows as the record checks, which read the
    file line by line when one line is bad."""
    keys = TRICKY_KEYS[:-1]  # (the last holds a 20-digit integer, which sends the file line by line)
    tasks = [task(f"t{i}", key=k, start={"kind": "url", "url": "x", "n": [1]}) for i, k in enumerate(keys)]
    lines = [
        *map(json.dumps, tasks),
        json.dumps(task("utf8", instruction="café \U0001f600", site="sité"), ensure_ascii=False),
        json.dumps(task("twice", key=["first"]))[:-1] + ', "dedup_key": ["s", "written", "twice"]}',  # the last counts
        json.dumps(task("t0")),  # a second t0: the first is kept, whichever path reads the file
    ]
    fast = parse(tmp_path / "fast", lines, [])
    assert batch_module._arrow_tasks((tmp_path / "fast" / "runs" / "r" / "tasks.jsonl").read_bytes()) is not None
    careful = parse(tmp_path / "careful", [*lines, "not json"], [])
    assert careful.tasks.equals(fast.tasks)
    assert fast.tasks.set_index("task_id").loc["twice", "dedup_key"] == '["s","written","twice"]'
    assert rows(fast.rejects, "line", "field") == [[len(lines), "task_id"]]
    assert rows(careful.rejects, "line", "field") == [[len(lines), "task_id"], [len(lines) + 1, None]]


@pytest.mark.parametrize(
    "line",
    [
        json.dumps(task("b", key="s|#x|1")),
        json.dumps(task("b", key=["s", ["nested"]])),
        json.dumps({k: v for k, v in task("b").items() if k != "dedup_key"}),
        task_line(dedup_key='["s", NaN]'),
        json.dumps(task("")),
        json.dumps(task("b", start={"url": "x"})),
        json.dumps(task("b", start={"kind": 1})),
        json.dumps(task("b", instruction=None)),
        json.dumps(task("b"))[:-1] + ', "task_id": "d"}',
        json.dumps(task("b", note=12345678901234567890)),
        "",
    ],
    ids=[
        "key-text",
        "key-nested",
        "no-key",
        "key-nan",
        "empty-id",
        "no-kind",
        "kind-number",
        "null-field",
        "field-twice",
        "digit-run",
        "blank",
    ],  # fmt: skip
)
def test_a_task_line_arrow_cannot_vouch_for_sends_the_file_to_the_record_checks(tmp_path, line):
    data = jsonl([task("a"), line, task("c")]).encode()
    assert batch_module._arrow_tasks(data) is None
    assert batch_module._arrow_tasks(jsonl([task("a"), task("c")]).encode()) is not None


WHITESPACE_CHARS = [chr(c) for c in range(0x3001) if chr(c).isspace()]


@pytest.mark.parametrize(
    "path",
    [*WHITESPACE_CHARS, " \u3000 ", "a/..\n", "..\n", "a/..\n\n", "a\n", "runs/r/\u2028x", "C:\n", "runs/r/1"],
)
def test_arrow_finds_an_unsafe_dir_where_the_record_checks_do(tmp_path, path):
    """Unicode whitespace and a final newline, where Python's regex engine and Arrow's (RE2) differ."""
    run = write_batch(tmp_path, "r", [task("a"), task("b")], [attempt("a"), attempt("b", dir=path)])
    unsafe = records_module.unsafe_dir_reason(path) is not None
    assert (batch_module._arrow_attempts((run / "executions.jsonl").read_bytes()) is None) == unsafe
    b = read_batch(UPath(run), "r")
    assert rows(b.rejects, "line", "field") == ([[2, "dir"]] if unsafe else [])


def both_ways(tmp_path, tasks_text: str, attempts_text: str):
    """The batch as parsed, and whether Arrow vouched for each file (tasks, attempts)."""
    run = write_batch(tmp_path, "r", [], [])
    (run / "tasks.jsonl").write_bytes(tasks_text.encode("utf-8", "surrogatepass"))
    (run / "executions.jsonl").write_bytes(attempts_text.encode("utf-8", "surrogatepass"))
    vouched = (
        batch_module._arrow_tasks((run / "tasks.jsonl").read_bytes()) is not None,
        batch_module._arrow_attempts((run / "executions.jsonl").read_bytes()) is not None,
    )
    return read_batch(UPath(run), "r"), vouched


@pytest.mark.parametrize("first", ["null", "\n\nnull", "true", "[]", '"x"'])  # (a byte order mark: skipped, below)
def test_a_first_line_that_is_not_an_object_is_one_reject_in_either_file(tmp_path, first):
    """(Arrow's reader crashes the process on a `null` first: it is never asked for such a file.)"""
    b, vouched = both_ways(tmp_path, jsonl([first, task("a")]), jsonl([first, attempt("a")]))
    assert vouched == (False, False)
    assert b.tasks["task_id"].tolist() == ["a"] and b.attempts["task_id"].tolist() == ["a"]
    blank = first.count("\n")
    assert rows(b.rejects, "file", "line") == [["executions.jsonl", blank + 1], ["tasks.jsonl", blank + 1]]


@pytest.mark.parametrize("extra", [900, 1000, 1001, 1500, 1999, 2500])
def test_a_line_over_the_limit_is_a_reject_however_arrow_would_split_it(tmp_path, monkeypatch, extra):
    monkeypatch.setattr(records_module, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(batch_module, "MAX_LINE_BYTES", 1000)
    long_task = json.dumps(task("b", note=""))
    long_task = long_task.replace('"note": ""', f'"note": "{"x" * (extra - len(long_task))}"')
    long_attempt = json.dumps(attempt("b", note=""))
    long_attempt = long_attempt.replace('"note": ""', f'"note": "{"x" * (extra - len(long_attempt))}"')
    assert len(long_task) == len(long_attempt) == extra
    b, vouched = both_ways(tmp_path, jsonl([task("a"), long_task]), jsonl([attempt("a"), long_attempt]))
    over = extra > 1000
    assert vouched == (not over, not over)
    assert b.tasks["task_id"].tolist() == (["a"] if over else ["a", "b"])
    assert b.attempts["task_id"].tolist() == (["a"] if over else ["a", "b"])
    assert len(b.rejects) == (2 if over else 0)


def test_two_objects_on_one_line_are_one_reject_even_beside_a_blank_line(tmp_path):
    pair = json.dumps(attempt("a")) + " " + json.dumps(attempt("b"))
    b, vouched = both_ways(tmp_path, jsonl([task("a"), task("b")]), pair + "\n\n")
    assert vouched == (True, False)
    assert b.attempts.empty
    assert rows(b.rejects, "file", "line") == [["executions.jsonl", 1]]


@pytest.mark.parametrize(
    "number, json_reads", [("Inf", False), ("-Inf", False), ("-NaN", False), ("Infinity", True), ("NaN", True)]
)
def test_a_number_python_json_does_not_read_is_a_reject_though_arrow_reads_it(tmp_path, number, json_reads):
    """In a field no row uses, where Arrow's reader would take it."""
    b, vouched = both_ways(
        tmp_path,
        jsonl([task("a"), with_raw(task("b"), {"note": number})]),
        jsonl([attempt("a"), with_raw(attempt("b"), {"steps": f'[{{"value": {number}}}]'})]),
    )
    assert vouched == (False, json_reads)  # (orjson, which reads each task's key, takes none of them)
    assert b.attempts["task_id"].tolist() == (["a", "b"] if json_reads else ["a"])
    assert b.tasks["task_id"].tolist() == (["a", "b"] if json_reads else ["a"])


@pytest.mark.parametrize("deep_first", [False, True])
def test_an_attempt_both_too_deep_and_holding_a_long_integer_where_no_row_uses_it_is_kept(tmp_path, deep_first):
    deep = "[" * 1100 + "]" * 1100
    parts = {"deep": deep, "big": LONG} if deep_first else {"big": LONG, "deep": deep}
    b, vouched = both_ways(
        tmp_path, jsonl([task("a"), task("b")]), jsonl([attempt("a"), with_raw(attempt("b"), parts)])
    )
    assert vouched == (True, True)
    assert b.rejects.empty
    assert rows(b.attempts, "task_id", "n_actions") == [["a", 2], ["b", 2]]
    by_line, _ = both_ways(
        tmp_path / "by_line", jsonl([task("a"), task("b")]), jsonl([attempt("a"), with_raw(attempt("b"), parts), "x"])
    )
    assert by_line.attempts.equals(b.attempts)


@pytest.mark.parametrize("odd", ["null", " null", "\ufeff" + json.dumps(attempt("b"))])
@pytest.mark.parametrize("shift", [0, -5])
def test_a_line_that_is_not_an_object_where_arrow_starts_a_block_is_one_reject(tmp_path, monkeypatch, odd, shift):
    """Arrow starts each block of its read as it starts a file (a null there crashed the process, a BOM there
    was skipped): such a line is read by the record checks, wherever it sits."""
    monkeypatch.setattr(records_module, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(batch_module, "MAX_LINE_BYTES", 1000)  # (Arrow's block size)
    first = json.dumps(attempt("a", note=""))
    first = first.replace('"note": ""', f'"note": "{"x" * (999 + shift - len(first))}"')  # the next line at byte 1000
    b, vouched = both_ways(tmp_path, jsonl([task("a"), task("b")]), jsonl([first, odd, attempt("b", 2)]))
    assert vouched == (True, False)
    assert rows(b.rejects, "file", "line") == [["executions.jsonl", 2]]
    assert rows(b.attempts, "task_id", "attempt") == [["a", 1], ["b", 2]]


def test_text_holding_inf_or_nan_leaves_the_file_to_arrow():
    """'Info', 'Inflation' or '-NaN' in an error or an action's text are no numbers."""
    attempts = [attempt("a", ok=False, error="Info about -NaN", steps=0), attempt("b", note=["Inflation", "Inf"])]
    assert batch_module._arrow_attempts(jsonl(attempts).encode()) is not None


@pytest.mark.parametrize("tail", ["null", "\ufeff" + json.dumps(attempt("c"))])
def test_what_follows_a_bare_carriage_return_where_arrow_ends_a_block_is_read_by_the_record_checks(
    tmp_path, monkeypatch, tail
):
    """Arrow also splits its blocks after a `\\r`, which json reads as a space inside a line: a null there
    crashed the process, a BOM there was skipped (its object read as a row of its own)."""
    monkeypatch.setattr(records_module, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(batch_module, "MAX_LINE_BYTES", 1000)  # (Arrow's block size)
    second = json.dumps(attempt("b"))
    first = json.dumps(attempt("a", note=""))
    first = first.replace('"note": ""', f'"note": "{"x" * (998 - len(second) - len(first))}"')  # `\r` at byte 999
    attempts = jsonl([first, second + "\r" + tail, "", attempt("b", 2)])
    b, vouched = both_ways(tmp_path, jsonl([task("a"), task("b"), task("c")]), attempts)
    assert vouched == (True, False)
    assert rows(b.rejects, "file", "line") == [["executions.jsonl", 2]]
    assert rows(b.attempts, "task_id", "attempt") == [["a", 1], ["b", 2]]


@pytest.mark.parametrize("levels", [990, 1010])
@pytest.mark.parametrize("file, field", [("tasks.jsonl", "macro"), ("executions.jsonl", "error")])
def test_a_mistyped_field_nested_about_as_deep_as_json_follows_is_one_reject(tmp_path, levels, file, field):
    """Deep enough that json cannot write it back into the reject's message: the message says so."""
    deep = "[" * levels + "]" * levels
    tasks = [task("a"), with_raw(task("b"), {field: deep}) if file == "tasks.jsonl" else task("b")]
    attempts = [attempt("a"), with_raw(attempt("b"), {field: deep}) if file == "executions.jsonl" else attempt("b")]
    b = parse(tmp_path, tasks, attempts)
    assert [file, 2, field] in rows(b.rejects, "file", "line", "field")  # (with it, a task's attempt: an orphan)
    assert b.tasks["task_id"].tolist()[0] == "a" and b.attempts["task_id"].tolist() == ["a"]


@pytest.mark.parametrize("second", ["null", " null"])
def test_a_null_after_an_object_on_one_line_leaves_the_file_to_the_record_checks(second):
    data = jsonl([attempt("a"), json.dumps(attempt("b")) + second, "", attempt("c")]).encode()
    assert batch_module._arrow_attempts(data) is None


@pytest.mark.parametrize(
    "text, records",
    [("a\nb\n", 2), ("a\nb", 2), ("a\n\nb\n", 2), ("\na\n", 1), ("a\n  \nb", 2), ("a\n \t", 1), ("", 0),
     ("\n\n\n", 0), (" ", 0), ("\r\n\r\n", 0), ("x\x0c\n\x0b", 1), ("ab\n\n c\n \t\nlong line\r\nd", 4),
     ("\ufeff\na\n", 1), ("\ufeff", 0)],  # (a byte order mark first: skipped, as jsonl_lines skips it)
)  # fmt: skip
def test_non_blank_lines_counts_lines_holding_more_than_whitespace(text, records):
    assert batch_module.non_blank_lines(text.encode()) == records


def test_non_blank_lines_counts_what_jsonl_lines_gives():
    rng = random.Random(7)
    for _ in range(2000):
        data = bytes(rng.choice(b"ab \t\r\n\x0b\x0c") for _ in range(rng.randint(0, 12)))
        assert batch_module.non_blank_lines(data) == len(list(batch_module.jsonl_lines(data))), data
        assert batch_module.non_blank_lines(data) == sum(1 for line in data.split(b"\n") if line.strip()), data


def test_jsonl_lines_end_at_newlines_only():
    text = '{"a": "x\u2028y\u0085z"}\r\n\n {"b": 1}\r{"c": 2}'
    assert list(batch_module.jsonl_lines(text.encode())) == [
        (1, '{"a": "x\u2028y\u0085z"}\r'.encode()),
        (3, b' {"b": 1}\r{"c": 2}'),
    ]


def test_batch_counts_the_records_of_executions_jsonl_whatever_the_parse_made_of_them(tmp_path):
    run = write_batch(tmp_path, "r", [task("a")], [attempt("a"), attempt("a", n=2)])
    with (run / "executions.jsonl").open("a") as f:
        f.write("\n  \nnot json\n")  # a blank line, a line of spaces, a reject
    b = read_batch(run, "r")
    assert (len(b.attempts), len(b.rejects), b.attempt_records) == (2, 1, 3)


def test_a_byte_order_mark_at_the_start_of_each_file_is_skipped_whichever_path_reads_it(tmp_path, monkeypatch):
    """Windows tools write one at the start of a text file: it is not part of the first record, nor a line."""
    read_by_line = []
    line_by_line = batch_module._read_lines
    monkeypatch.setattr(
        batch_module, "_read_lines", lambda data, file, *a: read_by_line.append(file) or line_by_line(data, file, *a)
    )
    for first_blank in (False, True):  # (a blank line sends the file line by line rather than to Arrow's reader)
        run = write_batch(tmp_path / str(first_blank), "r", [task("a"), task("b")], [attempt("a"), attempt("b")])
        for name in ("tasks.jsonl", "executions.jsonl"):
            (run / name).write_bytes(b"\xef\xbb\xbf" + b"\n" * first_blank + (run / name).read_bytes())
        read_by_line.clear()
        b = read_batch(UPath(run), "r")
        assert read_by_line == (["tasks.jsonl", "executions.jsonl"] if first_blank else [])
        assert b.rejects.empty, b.rejects["message"].tolist()
        assert b.tasks["task_id"].tolist() == ["a", "b"] and b.attempts["task_id"].tolist() == ["a", "b"]
        assert b.attempt_records == 2 and b.tasks["line"].tolist() == [1 + first_blank, 2 + first_blank]


@pytest.mark.parametrize("first_blank", [False, True])
def test_a_second_byte_order_mark_is_part_of_the_first_line_as_in_every_json_lines_file(tmp_path, first_blank):
    """One mark is skipped, whichever path reads the file (labels.jsonl and a legacy kept.jsonl skip one too):
    a second one makes the first line a reject (alone on it, or with the first record), counted among the file's
    records."""
    run = write_batch(tmp_path, "r", [task("a"), task("b")], [attempt("a"), attempt("b")])
    for name in ("tasks.jsonl", "executions.jsonl"):
        (run / name).write_bytes(b"\xef\xbb\xbf" * 2 + b"\n" * first_blank + (run / name).read_bytes())
    b = read_batch(UPath(run), "r")
    assert b.rejects[["file", "line"]].values.tolist() == [["executions.jsonl", 1], ["tasks.jsonl", 1]]
    valid = ["a", "b"] if first_blank else ["b"]
    assert b.tasks["task_id"].tolist() == valid and b.attempts["task_id"].tolist() == valid
    assert b.attempt_records == 2 + first_blank
