"""Judge calibration against human labels, checked against a hand count."""

import pandas as pd
import pytest

from filter_pipeline.rules.calibration import calibration, parse_labels, resolve
from filter_pipeline_tests.builders import rows


def frames():
    tasks = pd.DataFrame({"run_id": ["r"] * 4, "task_id": ["a", "b", "c", "d"], "site": ["s1", "s1", "s2", "s2"]})
    attempts = pd.DataFrame({"run_id": ["r"] * 5, "task_id": ["a", "b", "c", "d", "d"],
                             "dir": ["da", "db", "dc", "dd1", "dd2"], "ok": [True, True, True, False, True]})  # fmt: skip
    verdicts = pd.DataFrame({"run_id": ["r"] * 4, "task_id": ["a", "b", "c", "d"], "dir": ["da", "db", "dc", "dd2"],
                             "passed": pd.array([True, True, False, False], dtype="boolean"),
                             "status": ["judged"] * 4})  # fmt: skip
    return tasks, attempts, verdicts


def test_precision_recall_agreement_match_a_hand_count():
    labels, rejects = parse_labels(
        '{"dir": "da", "success": true}\n'  # judge pass, gate pass: TP, TP
        '{"dir": "db", "success": false}\n'  # judge pass, gate pass: FP, FP
        '{"run_id": "r", "task_id": "c", "success": true}\n'  # judge fail, gate pass: FN, TP
        '{"dir": "dd1", "success": false}\n'  # judge never saw it; gate fail: TN for the gate only
        '{"dir": "nowhere", "success": true}\n'  # matches nothing: dropped
    )
    assert rejects == []
    tasks, attempts, verdicts = frames()
    table = calibration(resolve(labels, attempts, verdicts, tasks))
    overall = table[table["site"] == "(all)"].set_index("predictor")
    assert overall.loc["judge", ["n", "tp", "fp", "fn", "tn"]].tolist() == [3, 1, 1, 1, 0]
    assert overall.loc["judge", ["precision", "recall"]].tolist() == [0.5, 0.5]
    assert overall.loc["judge", "agreement"] == pytest.approx(1 / 3)
    assert overall.loc["gate", ["n", "tp", "fp", "fn", "tn"]].tolist() == [4, 2, 1, 0, 1]
    assert overall.loc["gate", ["precision", "recall", "agreement"]].tolist() == [2 / 3, 1.0, 0.75]
    assert rows(table[table["predictor"] == "judge"], "site", "n") == [["(all)", 3], ["s1", 2], ["s2", 1]]


def test_lines_that_are_not_labels_are_rejects_naming_their_line_and_the_rest_is_parsed():
    data = b"\n".join([
        b'{"dir": "a", "success": true}',
        b'{"dir": "b", "success": "yes"}',  # 2: not a bool
        b"",
        b"not json",  # 4
        b'{"dir": "\xff", "success": true}',  # 5: not UTF-8
        b'{"dir": "\\ud800", "success": true}',  # 6: a lone surrogate
        b'{"run_id": "r", "task_id": "t", "success": false, "n": 1' + b"0" * 5000 + b"}",  # 7: an integer too long
        b"[" * 100_000 + b"]" * 100_000,  # 8: too deep
        b'{"run_id": "r", "task_id": "t", "success": false}',  # 9, no newline after it
    ])  # fmt: skip
    labels, rejects = parse_labels(data)
    assert rows(labels, "dir", "run_id", "task_id", "success") == [["a", None, None, True], [None, "r", "t", False]]
    assert [m.split(": ", 1)[0] for m in rejects] == [f"labels.jsonl:{n}" for n in (2, 4, 5, 6, 7, 8)]
    assert rejects[0] == "labels.jsonl:2: expected {dir | run_id + task_id, success: bool}"
    assert rejects[1].startswith("labels.jsonl:4: not JSON")
    assert rejects[2].startswith("labels.jsonl:5: not UTF-8")
    assert "lone surrogate" in rejects[3]
