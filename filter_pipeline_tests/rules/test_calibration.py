"""Judge calibration against human labels, checked against a hand count."""

import math

import pandas as pd
import pytest

from filter_pipeline.rules.calibration import (
    calibration,
    markdown,
    parse_labels,
    resolve,
    scores,
    summary,
    unmatched_labels,
    wilson_interval,
)
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
    assert rejects[0] == "labels.jsonl:2: expected {dir | run_id + task_id, success: true | false | null}"
    assert rejects[1].startswith("labels.jsonl:4: not JSON")
    assert rejects[2].startswith("labels.jsonl:5: not UTF-8")
    assert "lone surrogate" in rejects[3]


def test_a_labels_file_saved_with_a_byte_order_mark_loses_no_label():
    # (Notepad and PowerShell write one at the start of a UTF-8 file)
    labels, rejects = parse_labels(b'\xef\xbb\xbf{"dir": "a", "success": true}\n{"dir": "b", "success": false}\n')
    assert rejects == [] and rows(labels, "dir", "success") == [["a", True], ["b", False]]


def test_a_note_cut_mid_emoji_keeps_its_label_and_a_dir_holding_a_lone_surrogate_does_not():
    labels, rejects = parse_labels(
        b'{"dir": "a", "success": true, "note": "fine \\ud83d"}\n{"dir": "\\udc00", "success": true}\n'
    )
    assert rows(labels, "dir", "note") == [["a", "fine \ufffd"]]
    assert rejects == [
        "labels.jsonl:2: a lone surrogate (\\ud800-\\udfff) in dir, run_id or task_id, which is not text"
    ]


def test_wilson_interval_and_kappa_match_hand_computed_values():
    # 8 of 10: p 0.8, z^2 = 3.8416; centre (0.8 + 0.19208) / 1.38416 = 0.716738,
    # half 1.96 * sqrt(0.016 + 0.009604) / 1.38416 = 0.226581
    low, high = wilson_interval(8, 10)
    assert (low, high) == (pytest.approx(0.490157, abs=1e-6), pytest.approx(0.943319, abs=1e-6))
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    # tp 8, fp 2, fn 1, tn 4 (n 15): observed 12/15 = 0.8; chance (10*9 + 5*6) / 225 = 0.5333...;
    # kappa (0.8 - 8/15) / (1 - 8/15) = 4/7
    s = scores(8, 2, 1, 4)
    assert s["precision"] == 0.8 and (s["precision_low"], s["precision_high"]) == (low, high)
    assert s["recall"] == pytest.approx(8 / 9) and s["recall_low"] == pytest.approx(wilson_interval(8, 9)[0])
    assert s["kappa"] == pytest.approx(4 / 7)
    assert s["f1"] == pytest.approx(16 / 19)
    assert s["pass_rate_gap"] == pytest.approx((2 - 1) / 15)  # passes 10/15, successes 9/15
    assert scores(3, 0, 0, 0)["kappa"] is None  # every label and prediction a pass: chance explains it all
    assert scores(0, 0, 2, 1)["precision"] is None and scores(0, 0, 2, 1)["precision_low"] is None


def test_a_later_label_replaces_an_earlier_one_and_unsure_labels_are_not_counted():
    labels, rejects = parse_labels(
        '{"dir": "da", "success": false, "labeler": "x", "note": "first look"}\n'
        '{"run_id": "r", "task_id": "a", "success": true, "labeled_at": "2026-12-03T21:00:00Z"}\n'  # the same attempt
        '{"dir": "db", "success": true}\n'
        '{"dir": "db", "success": null}\n'  # unsure now: db is not counted
        '{"dir": "dc", "success": null}\n'
    )
    assert rejects == []
    tasks, attempts, verdicts = frames()
    resolved = resolve(labels, attempts, verdicts, tasks)
    assert resolved[["success", "judge"]].astype(object).values.tolist() == [[True, True]]


def test_labels_naming_no_parsed_attempt_or_task_are_each_named_by_their_line():
    labels, _ = parse_labels(
        '{"dir": "da", "success": true}\n'
        '{"dir": "da/", "success": true}\n'  # a trailing slash: not the attempt's dir
        '{"run_id": "r", "task_id": "b", "success": false}\n'
        '{"run_id": "r2", "task_id": "a", "success": false}\n'  # a batch not parsed (yet)
    )
    tasks, attempts, _ = frames()
    assert unmatched_labels(labels, attempts, tasks) == [
        "labels.jsonl:2: names no attempt of a parsed batch (dir 'da/'): a typo, or a batch not parsed yet "
        "(it counts once it matches)",
        "labels.jsonl:4: names no attempt of a parsed batch (run_id 'r2', task_id 'a'): a typo, or a batch not "
        "parsed yet (it counts once it matches)",
    ]
    assert unmatched_labels(labels.iloc[:0], attempts, tasks) == []


def test_judge_rows_are_per_model_and_prompt_version_beside_the_gate_and_markdown_puts_precision_first():
    tasks, attempts, verdicts = frames()
    verdicts = verdicts.assign(model=["m1", "m1", "m2", "m2"], prompt_version="v3")
    labels, _ = parse_labels("\n".join(f'{{"dir": "{d}", "success": true}}' for d in ("da", "db", "dc", "dd2")))
    table = calibration(resolve(labels, attempts, verdicts, tasks))
    overall = table[table["site"] == "(all)"]
    assert rows(overall, "predictor", "model", "prompt_version", "n", "tp", "fn") == [
        ["judge", "m1", "v3", 2, 2, 0],
        ["judge", "m2", "v3", 2, 0, 2],
        ["gate", None, None, 4, 4, 0],
    ]
    text = markdown(table)
    header = text.splitlines()[0]
    assert header.index("precision") < header.index("recall") < header.index("kappa")
    assert "| judge m1 v3 | (all) | 1.00 [0.34, 1.00] |" in text and "fewer than 50 labels" in text
    gate = overall[overall["predictor"] == "gate"].iloc[0].to_dict()
    assert summary(gate).startswith("precision 1.00 [0.51, 1.00], recall 1.00") and "under 50 labels" in summary(gate)


def test_the_gate_judges_rows_name_no_model_whether_its_verdicts_say_null_or_empty():
    tasks, attempts, verdicts = frames()
    verdicts = verdicts.assign(model=["", None, "", None], prompt_version=["", None, "", None])
    labels, _ = parse_labels("\n".join(f'{{"dir": "{d}", "success": true}}' for d in ("da", "db", "dc", "dd2")))
    overall = calibration(resolve(labels, attempts, verdicts, tasks)).query("site == '(all)'")
    assert rows(overall, "predictor", "model", "prompt_version", "n") == [
        ["judge", None, None, 4],
        ["gate", None, None, 4],
    ]


def test_a_task_label_names_productions_judged_attempt_when_the_scored_judge_saw_more_of_the_task():
    # a candidate judge also judged d's failed attempt dd1, labelled a failure by dir; d's label by task names
    # dd2, the attempt production judged, and no other
    labels, _ = parse_labels('{"dir": "dd1", "success": false}\n{"run_id": "r", "task_id": "d", "success": true}\n')
    tasks, attempts, verdicts = frames()
    candidate = pd.DataFrame({"run_id": ["r", "r"], "task_id": ["d", "d"], "dir": ["dd1", "dd2"],
                              "passed": pd.array([True, True], dtype="boolean"), "status": ["judged"] * 2})  # fmt: skip
    resolved = resolve(labels, attempts, verdicts, tasks, scored=candidate)
    assert rows(resolved, "success", "gate", "judge") == [[False, False, True], [True, True, True]]
    overall = calibration(resolved).query("site == '(all)' and predictor == 'judge'")
    assert rows(overall, "n", "tp", "fp") == [[2, 1, 1]]


def test_a_dir_two_runs_share_is_one_labelled_attempt_scored_on_its_own_runs_verdict():
    tasks, attempts, verdicts = frames()
    # r2 holds a copy of r's batch: its attempts name the same dirs; its judge failed what r's passed
    tasks, attempts = (pd.concat([f, f.assign(run_id="r2")], ignore_index=True) for f in (tasks, attempts))
    verdicts = pd.concat([verdicts, verdicts.assign(run_id="r2", passed=~verdicts["passed"])], ignore_index=True)
    labels, _ = parse_labels('{"dir": "da", "success": true}\n')
    resolved = resolve(labels, attempts, verdicts, tasks)
    assert rows(resolved, "success", "gate", "judge") == [[True, True, False]]  # once: r2's attempt, r2's verdict


def test_a_site_with_a_bar_or_a_line_break_stays_in_its_own_markdown_cell():
    tasks, attempts, verdicts = frames()
    tasks = tasks.assign(site=["shop|eu", "shop|eu", "two\nlines", "two\nlines"])
    labels, _ = parse_labels('{"dir": "da", "success": true}\n{"dir": "dc", "success": true}\n')
    text = markdown(calibration(resolve(labels, attempts, verdicts, tasks)))
    assert "| gate | shop\\|eu | 1.00 [0.21, 1.00] |" in text and "| gate | two lines | 1.00 [0.21, 1.00] |" in text
    rows_of_table = [line for line in text.splitlines() if line.startswith("|")]
    assert {line.replace("\\|", "").count("|") for line in rows_of_table} == {9}  # 8 cells each
