"""A task's story (`review/story.py`, and `explain`'s text of it): its verdict's parts, its trajectory, its labels,
retired.json's word on it, and what a run still being written says."""

import json

import pytest
from upath import UPath

from filter_pipeline.cli.explain import story_lines
from filter_pipeline.review.data import ReviewError, Warehouse
from filter_pipeline.review.story import story


def test_a_story_shows_the_judges_parts_when_the_file_has_them_and_does_without(warehouse):
    newer = story(warehouse, "r1", "jf")["verdict"]
    assert (newer["blocked"], newer["score"], newer["reasoning"]) == (True, 1, "a CAPTCHA <b>wall</b>")
    older = story(warehouse, "r2", "jf")["verdict"]
    assert older["passed"] is False and "blocked" not in older and "score" not in older
    duplicate = story(warehouse, "r1", "d")["decision"]
    assert duplicate["duplicate_of"] == {"run_id": "r0", "task_id": "t0"}
    cap = story(warehouse, "r1", "c")["decision"]["cap"]
    assert (cap["reason"], cap["limit"], cap["kept_before"], cap["kept_in_run"]) == ("site_cap", 1, 1, 0)
    rejected = story(warehouse, "r1", "tasks.jsonl:9")
    assert rejected["decision"]["fate"] == "reject" and [r["line"] for r in rejected["rejects"]] == [9]
    with pytest.raises(ReviewError, match="no task 'zz' in run 'r1'"):
        story(warehouse, "r1", "zz")
    with pytest.raises(ReviewError, match="no run 'r9'"):
        warehouse.run("r9")
    (warehouse.root / "runs" / "r3").mkdir()  # a complete batch not materialized yet
    (warehouse.root / "runs" / "r3" / "_SUCCESS").touch()
    with pytest.raises(ReviewError, match="run 'r3' is not filtered yet: filter-pipeline materialize r3"):
        story(warehouse, "r3", "a")


def test_a_site_cap_met_under_a_macro_that_sets_only_a_target_is_the_per_site_cap(warehouse):
    record = warehouse.root / "warehouse" / "_commits" / "r1.json"
    commit = json.loads(record.read_text())
    # as the ledger records a caps file whose macro names a target alone: its site_cap null
    record.write_text(
        json.dumps(commit | {"caps": {"per_site_cap": 2, "caps": {"m": {"site_cap": None, "target": 10}}}})
    )
    cap = story(Warehouse(warehouse.root), "r1", "c")["decision"]["cap"]
    assert (cap["reason"], cap["limit"]) == ("site_cap", 2)


def test_a_trajectory_with_page_text_cut_mid_emoji_is_shown_with_a_replacement_character(warehouse, tmp_path):
    folder = tmp_path / "runs" / "r1" / "traj" / "k" / "1"
    folder.mkdir(parents=True)
    steps = [{"action": "type", "text": "cut \ud83d"}, {"action": "type", "text": "whole \U0001f600"}]
    (folder / "trajectory.json").write_text(json.dumps({"steps": steps, "final": {"url": "u", "observation": "o"}}))
    shown = story(warehouse, "r1", "k")["trajectory"]
    assert [step["text"] for step in shown["steps"]] == ["cut \ufffd", "whole \U0001f600"]
    json.dumps(shown, ensure_ascii=False).encode("utf-8")  # printable and servable: no UnicodeEncodeError


def test_a_trajectory_with_an_integer_too_long_for_python_is_shown_with_its_digits(warehouse, tmp_path):
    folder = tmp_path / "runs" / "r1" / "traj" / "k" / "1"
    folder.mkdir(parents=True)
    digits = "9" * 4400  # (more than the 4,300 Python reads as a number; a step within what a page shows whole)
    (folder / "trajectory.json").write_text(f'{{"steps": [{{"action": "scroll", "by": {digits}}}], "final": {{}}}}')
    shown = story(warehouse, "r1", "k")["trajectory"]
    assert "problem" not in shown and shown["steps"] == [{"action": "scroll", "by": digits}]


def test_a_trajectory_too_large_for_a_page_shows_its_head_and_counts_the_rest(warehouse, tmp_path, monkeypatch):
    from filter_pipeline.review import story as stories
    from filter_pipeline.review.app import Review

    monkeypatch.setattr(stories, "STEPS_SHOWN", 3)
    monkeypatch.setattr(stories, "CHARS_SHOWN", 50)
    monkeypatch.setattr(stories, "STEP_CHARS_SHOWN", 40)
    folder = tmp_path / "runs" / "r1" / "traj" / "k" / "1"
    folder.mkdir(parents=True)
    steps = [{"action": "click", "n": i} for i in range(10)]
    steps[1] = {"action": "type", "text": "x" * 80}  # one step too long to show whole
    record = {"steps": steps, "final": {"url": "u", "observation": "p" * 120}, "output": "short",
              "instruction": {"text": "i" * 60}}  # (not a string: cut as its JSON)  # fmt: skip
    (folder / "trajectory.json").write_text(json.dumps(record))
    found = story(warehouse, "r1", "k")
    shown = found["trajectory"]
    assert shown["steps"][0] == steps[0] and shown["steps"][2] == steps[2] and len(shown["steps"]) == 3
    assert (
        shown["steps"][1]
        == json.dumps(steps[1])[:40] + f"… ({len(json.dumps(steps[1])) - 40} more characters not shown)"
    )
    assert shown["instruction"] == json.dumps(record["instruction"])[:50] + "… (22 more characters not shown)"
    assert shown["steps_not_shown"] == 7 and shown["output"] == "short"
    assert shown["page_text"] == "p" * 50 + "… (70 more characters not shown)"
    html = (
        Review(warehouse.root).html("task.html", s=found, near={"prev": None, "next": None}, blind=False).body.decode()
    )
    assert "7 more steps in trajectory.json, not shown" in html and "p" * 51 not in html
    from filter_pipeline.cli.explain import story_lines

    assert "  (7 more steps in trajectory.json, not shown)" in story_lines(found)


def test_the_label_form_carries_its_attempt_exactly_whatever_its_ids_hold(warehouse):
    from html.parser import HTMLParser

    from filter_pipeline.review.app import Review

    odd = 'q\'uote "dq" &amp; <b> \u2028 \r\n \x00 é'  # (what an HTML attribute would garble or end at)
    found = story(warehouse, "r1", "k")
    found["task"]["task_id"], found["run_id"], found["judged_dir"] = f"t {odd}", f"r {odd}", f"runs/{odd}/1"
    html = (
        Review(warehouse.root).html("task.html", s=found, near={"prev": None, "next": None}, blind=False).body.decode()
    )

    class Form(HTMLParser):  # (an HTML parser reads the attribute as a browser does, character references and all)
        attempt = None

        def handle_starttag(self, tag, attrs):
            if tag == "form" and dict(attrs).get("class") == "label-form":
                Form.attempt = json.loads(dict(attrs)["data-attempt"])

    Form().feed(html)
    assert Form.attempt == {"dir": f"runs/{odd}/1", "run_id": f"r {odd}", "task_id": f"t {odd}"}


def test_the_task_page_shows_the_parts_escaped_and_hides_them_when_blind(warehouse):
    from filter_pipeline.review.app import Review

    review = Review(warehouse.root)
    found = story(warehouse, "r1", "jf")
    html = review.html("task.html", s=found, near={"prev": None, "next": None}, blind=False).body.decode()
    assert "<dt>blocked</dt><dd>yes</dd>" in html and "1 / 5" in html
    assert "a CAPTCHA &lt;b&gt;wall&lt;/b&gt;" in html and "<b>wall" not in html
    from filter_pipeline.review.queue import QueueItem

    figures = {"labelled": 0, "unsure": 0, "label_lines": 0, "precision": None, "sample": {"precision": None}}
    item = QueueItem("r1", "jf", "runs/r1/traj/jf/1", "s-jf", "random sample")
    blind = review.html("queue.html", s=found, item=item, figures=figures, blind=True, pos=0, total=1, next_pos=1,
                        remaining=1).body.decode()  # fmt: skip
    assert "Blind:" in blind and "Task jf" in blind and "CAPTCHA" not in blind and "judge_fail" not in blind


def test_a_trajectory_is_read_from_anywhere_inside_the_data_root_as_the_judge_reads_it(tmp_path):
    from filter_pipeline.review.story import trajectory
    from filter_pipeline.rules.schemas import TRAJECTORY_OUTSIDE_ROOT

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "trajectory.json").write_text(json.dumps({"instruction": "SECRET-OUTSIDE", "steps": []}))
    data = tmp_path / "data"
    inside = data / "runs" / "r1" / "traj" / "k"
    inside.mkdir(parents=True)
    (inside / "1").symlink_to(outside)  # the folder itself
    (inside / "2").mkdir()
    (inside / "2" / "trajectory.json").symlink_to(outside / "trajectory.json")  # or its file
    copied_from = data / "runs" / "r0" / "traj" / "k" / "1"  # a copied batch's dir names the original's folder
    copied_from.mkdir(parents=True)
    (copied_from / "trajectory.json").write_text(json.dumps({"instruction": "the original", "steps": []}))
    (copied_from / "shot.png").write_bytes(b"png")
    root = UPath(str(data))
    for n in (1, 2):
        found = trajectory(root, f"runs/r1/traj/k/{n}")
        assert found["problem"] == TRAJECTORY_OUTSIDE_ROOT and "instruction" not in found
        assert found["screenshots"] == []
    for bad in ("runs/r1/../../../elsewhere", "/etc", "s3://bucket/x", ""):
        assert trajectory(root, bad)["problem"] == TRAJECTORY_OUTSIDE_ROOT, bad
    for same in ("runs/r0/traj/k/1", "./runs/r0/traj/k/1/", "runs/r0/traj/k/./1"):  # (dirs the judge reads too)
        found = trajectory(root, same)
        assert found["instruction"] == "the original" and found["screenshots"] == ["shot.png"], same


def test_of_an_attempts_labels_only_the_latest_counts_and_the_story_says_which(warehouse):
    from filter_pipeline.rules.calibration import parse_labels

    labels, _ = parse_labels(
        '{"dir": "runs/r1/traj/k/1", "success": false}\n'
        '{"run_id": "r1", "task_id": "k", "success": true}\n'  # the same attempt: the task's judged one
        '{"dir": "runs/r1/traj/d/1", "success": true}\n'
    )
    found = story(warehouse, "r1", "k", labels)["labels"]
    assert [(label["success"], label["current"]) for label in found] == [(False, False), (True, True)]


def test_a_story_of_a_run_still_being_written_says_it_is_filtered_once_complete(tmp_path):
    (tmp_path / "runs" / "r3").mkdir(parents=True)
    (tmp_path / "runs" / "r3" / "tasks.jsonl").write_text('{"task_id": "a"}\n')
    with pytest.raises(ReviewError, match=r"^run 'r3' is not complete \(no _SUCCESS\): it is filtered once it is$"):
        story(Warehouse(UPath(str(tmp_path))), "r3", "b")
    (tmp_path / "runs" / "r3" / "_SUCCESS").touch()
    with pytest.raises(ReviewError, match=r"^run 'r3' is not filtered yet: filter-pipeline materialize r3$"):
        story(Warehouse(UPath(str(tmp_path))), "r3", "b")
    # (its one line, which names no macro, is already shown as the reject it will be)
    assert story(Warehouse(UPath(str(tmp_path))), "r3", "a")["decision"]["fate"] == "reject"


def test_a_kept_row_retired_json_retires_shows_reason_retired_as_soon_as_the_file_says_so(warehouse):
    assert story(warehouse, "r1", "k")["decision"] == {
        "fate": "kept",
        "reason": None,
        "where": "its judged attempt is a row of kept (training data)",
    }
    retired = warehouse.root / "retired.json"
    retired.write_text(json.dumps([{"run_id": "r1", "task_ids": ["k"], "reason": "wrong site"}]))
    decided = story(warehouse, "r1", "k")["decision"]
    assert (decided["reason"], decided["retired_because"]) == ("retired", "wrong site")
    told = story_lines(story(warehouse, "r1", "k"))  # (`explain`)
    assert "  retired by retired.json (wrong site): it stays in kept but no longer counts for dedup or caps" in told
    retired.write_text(json.dumps([{"run_id": "r1", "reason": "bad batch"}]))  # the whole run
    tasks = warehouse.run("r1").tasks
    assert tasks.loc[tasks["fate"] == "kept", "reason"].tolist() == ["retired"]
    assert tasks.loc[tasks["fate"] != "kept", "reason"].ne("retired").all()  # only kept rows are retired
    assert story(warehouse, "r1", "k")["decision"]["retired_because"] == "bad batch"
    retired.write_text(json.dumps([{"run_id": "r1"}]))  # (no reason given)
    assert story(warehouse, "r1", "k")["decision"]["retired_because"] is None


def test_a_retired_json_the_stage_refuses_is_said_above_the_story_not_taken_as_nothing_retired(warehouse):
    assert warehouse.problem() is None
    (warehouse.root / "retired.json").write_text(json.dumps([{"run_id": "r1", "task_ids": ["k"]}, {"task_ids": []}]))
    assert warehouse.problem() == (
        "retired.json[1] must be an object with a string 'run_id': the stage refuses it, and walks no batch until "
        "it is corrected or removed; no row is shown as retired meanwhile"
    )
    assert story(warehouse, "r1", "k")["decision"]["reason"] is None  # (the story is still told)


def test_the_story_of_a_task_of_a_refused_batch_says_why_and_what_to_do(tmp_path):
    from filter_pipeline.storage.failures import record_failure
    from filter_pipeline_tests.review.small_warehouse import refused_batch

    warehouse = refused_batch(tmp_path)
    record_failure(UPath(str(tmp_path / "warehouse")), "r5", "runs/r5/executions.jsonl does not exist")
    decided = story(warehouse, "r5", "a")["decision"]
    told = (
        "its batch was refused before its walk (runs/r5/executions.jsonl does not exist): correct its files, then "
        "filter-pipeline materialize r5"
    )
    assert (decided["fate"], decided["run_refused"]) == ("pending", told)
    assert f"  {told}" in story_lines(story(warehouse, "r5", "a"))
    with pytest.raises(ReviewError, match=r"^run 'r5': its batch was refused before its walk \(runs/r5/executions"):
        story(warehouse, "r5", "nope")


def test_a_legacy_runs_kept_task_is_said_to_be_a_row_of_its_kept_jsonl_not_of_the_warehouse(tmp_path):
    run = tmp_path / "runs" / "r0"
    run.mkdir(parents=True)
    (run / "kept.jsonl").write_text(json.dumps({"task_id": "a", "site": "s", "macro": "m", "dedup_key": ["k"]}) + "\n")
    decided = story(Warehouse(UPath(str(tmp_path))), "r0", "a")["decision"]
    assert (decided["fate"], decided["where"]) == (
        "kept",
        "its row is one of runs/r0/kept.jsonl, the earlier script's kept rows",
    )


def test_a_judge_failure_says_why_it_failed_even_one_the_judge_passed_below_the_minimum_score(warehouse):
    from pathlib import Path

    from filter_pipeline.rules.vocabulary import BELOW_MIN_SCORE_DETAIL
    from filter_pipeline_tests.review.small_warehouse import write_asset

    detail = BELOW_MIN_SCORE_DETAIL.format(score=3, why="fine")
    write_asset(Path(warehouse.root.path), "failure_pool", "r1", [
        {"task_id": "jf", "stage": "judge", "reason": "judge_fail", "detail": detail, "attempt": 1, "run_id": "r1"}])  # fmt: skip
    found = story(warehouse, "r1", "jf")
    assert found["decision"]["fate"] == "judge_fail" and found["decision"]["where"].endswith(f"(stage judge): {detail}")
    assert any(line.endswith(detail) for line in story_lines(found))  # (`explain`; the task page shows the same line)


@pytest.mark.parametrize(
    "record, output",
    [
        ({"output": "3 items"}, "3 items"),
        ({"final": {"answer": "sent"}}, "sent"),  # where the judge finds it too
        ({"answer": {"total": 12}}, '{"total": 12}'),
        ({"final": {"url": "https://x/"}}, None),
    ],
)
def test_the_agent_output_shown_is_the_one_the_judge_read(tmp_path, record, output):
    from filter_pipeline.judge.prompt import agent_output
    from filter_pipeline.review.story import trajectory

    folder = tmp_path / "runs" / "r1" / "traj" / "a" / "1"
    folder.mkdir(parents=True)
    (folder / "trajectory.json").write_text(json.dumps({"instruction": "i", "steps": [], **record}))
    shown = trajectory(UPath(str(tmp_path)), "runs/r1/traj/a/1")
    assert shown["output"] == output == agent_output(record, record.get("final", {}))


def test_an_unreadable_trajectory_is_named_as_the_judges_evidence_names_it(tmp_path):
    from filter_pipeline.review.story import trajectory
    from filter_pipeline.rules.schemas import TRAJECTORY_MISSING, TRAJECTORY_NOT_JSON, TRAJECTORY_NOT_OBJECT

    folder = tmp_path / "runs" / "r1" / "traj" / "a" / "1"
    folder.mkdir(parents=True)
    root = UPath(str(tmp_path))
    assert trajectory(root, "runs/r1/traj/a/1")["problem"] == TRAJECTORY_MISSING
    (folder / "trajectory.json").write_text("[1, 2]")
    assert trajectory(root, "runs/r1/traj/a/1")["problem"] == TRAJECTORY_NOT_OBJECT
    (folder / "trajectory.json").write_text("{not json")
    assert trajectory(root, "runs/r1/traj/a/1")["problem"].startswith(f"{TRAJECTORY_NOT_JSON} (")
    (folder / "trajectory.json").write_text('{"steps": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert trajectory(root, "runs/r1/traj/a/1")["problem"].startswith(f"{TRAJECTORY_NOT_JSON} (document nests")


def test_the_screenshots_shown_go_in_the_order_the_judge_takes_its_first_and_last_from(tmp_path):
    from filter_pipeline.judge.prompt import screenshots
    from filter_pipeline.review.story import trajectory

    folder = tmp_path / "runs" / "r1" / "traj" / "a" / "1"
    folder.mkdir(parents=True)
    (folder / "trajectory.json").write_text(json.dumps({"instruction": "i", "steps": []}))
    for step in (10, 2, 1):
        (folder / f"step_{step}.png").write_bytes(f"shot {step}".encode())
    (folder / "z é.png").write_bytes(b"shot z")  # any name the judge takes is shown
    (folder / "folder.png").mkdir()  # not a screenshot
    (tmp_path / "shared.png").write_bytes(b"shot shared")
    (folder / "step_3.png").symlink_to(tmp_path / "shared.png")  # a link elsewhere in the data root: taken
    (tmp_path.parent / "outside.png").write_bytes(b"outside the data root")
    (folder / "zz.png").symlink_to(tmp_path.parent / "outside.png")  # a link out of the data root: never
    root = UPath(str(tmp_path))
    shown = trajectory(root, "runs/r1/traj/a/1")["screenshots"]
    assert shown == ["step_1.png", "step_2.png", "step_3.png", "step_10.png", "z é.png"]
    assert screenshots(root, root / "runs/r1/traj/a/1") == (b"shot 1", b"shot z")


def test_numbers_json_cannot_carry_in_a_trajectory_are_served_as_their_text(tmp_path):
    from filter_pipeline.review.story import trajectory

    folder = tmp_path / "runs" / "r1" / "traj" / "a" / "1"
    folder.mkdir(parents=True)
    (folder / "trajectory.json").write_text('{"steps": [{"seconds": NaN, "big": 1e999, "low": -Infinity}]}')
    shown = trajectory(UPath(str(tmp_path)), "runs/r1/traj/a/1")
    assert shown["steps"] == [{"seconds": "NaN", "big": "Infinity", "low": "-Infinity"}]
    json.dumps(shown, allow_nan=False)  # (what the JSON API sends: it would raise on NaN)
