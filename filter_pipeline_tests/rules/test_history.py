"""CONTRACT §2 retired.json: its shape, and what each entry retires and why."""

import json

import pytest

from filter_pipeline.rules.history import HistoryError, Retired, parse_retired


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "retired.json is not valid JSON"),
        ('{"run_id": "r1"}', "must be a JSON list"),
        ('[{"reason": "x"}]', r"retired.json\[0\] must be an object with a string 'run_id'"),
        ('[{"run_id": "r1", "task_ids": "a"}]', r"retired.json\[0\].task_ids must be a list of strings"),
        # a lone surrogate: valid JSON, but no text (no Parquet file or Arrow string can hold it)
        ('[{"run_id": "r1", "task_ids": ["a\\ud83d"]}]', r"retired.json\[0\].task_ids holds a lone surrogate"),
        ('[{"run_id": "r\\udc00"}]', r"retired.json\[0\].run_id holds a lone surrogate, which is not text"),
    ],
)
def test_malformed_retired_json_is_refused_with_the_reason(content, message):
    with pytest.raises(HistoryError, match=message):
        parse_retired(content.encode())


def test_a_hand_edited_retired_json_may_start_with_a_byte_order_mark_and_its_reason_be_cut_mid_emoji():
    parsed = parse_retired(b'\xef\xbb\xbf[{"run_id": "r1", "task_ids": ["a"], "reason": "bad \\ud83d"}]')
    assert parsed.tasks == {"r1": frozenset({"a"})} and parsed.reasons == {("r1", "a"): "bad \ufffd"}


def test_no_retired_json_retires_nothing():
    assert parse_retired(None) == Retired()


def retired(*entries: dict) -> Retired:
    return parse_retired(json.dumps(list(entries)).encode())


def test_an_entry_without_task_ids_retires_its_whole_run_and_a_list_exactly_its_rows():
    found = retired({"run_id": "r1"}, {"run_id": "r2", "task_ids": ["a", "b"]}, {"run_id": "r3", "task_ids": []})
    assert found.runs == {"r1"} and found.tasks == {"r2": {"a", "b"}, "r3": set()}
    assert found.run_is_retired("r1") and not found.run_is_retired("r2") and not found.run_is_retired("r3")


def test_each_row_is_retired_for_its_own_entrys_reason_else_its_runs():
    found = retired(
        {"run_id": "r1", "reason": "bad batch"},
        {"run_id": "r1", "task_ids": ["a"], "reason": "wrong site"},
        {"run_id": "r2", "task_ids": ["b"], "reason": "  "},  # (blank: no reason given)
        {"run_id": "r2", "task_ids": ["c"], "reason": 7},  # (not text)
    )
    assert found.reason_of("r1", "a") == "wrong site" and found.reason_of("r1", "z") == "bad batch"
    assert found.reason_of("r2", "b") is None and found.reason_of("r2", "c") is None
    assert found.reason_of("r3", "a") is None
