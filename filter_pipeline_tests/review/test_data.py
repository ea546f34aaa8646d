"""The review data layer over a small warehouse written here: every fate, a run not committed yet, verdict
files with and without the judge's newer columns, and the cache that notices a rewritten file."""

import json
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from upath import UPath

from filter_pipeline.cli.explain import story_lines
from filter_pipeline.review.data import ReviewError, UnreadableFile, UnreadableRun, Warehouse, page
from filter_pipeline.review.fates import _rejected_tasks
from filter_pipeline.review.story import story
from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.rules.history import parse_legacy
from filter_pipeline.rules.schemas import SCHEMAS, parquet_bytes, to_arrow
from filter_pipeline.storage.publish import write_commit

TASKS = ["k", "d", "c", "jf", "u", "ef"]  # kept, duplicate, site_cap, judge_fail, unjudged, execute failures only


# the columns an older version of the stage (judge prompt v2) did not write
OLDER_VERSION_LACKS = ("success", "side_effects", "looping", "blocked", "score", "key_points", "reasoning")


def _write(
    root: Path, asset: str, run_id: str, rows: list[dict], schema_of: str | None = None, extra: dict | None = None
):
    frame = pd.DataFrame({c: [r.get(c) for r in rows] for c in SCHEMAS[schema_of or asset].names})
    table = to_arrow(frame, schema_of or asset)
    if extra is None:  # a file as the older version wrote it
        table = table.drop_columns([c for c in OLDER_VERSION_LACKS if c in table.column_names])
    for name, (values, arrow_type) in (extra or {}).items():  # (replacing the column where the schema has it)
        table = table.drop_columns([name]) if name in table.column_names else table
        table = table.append_column(name, pa.array(values, type=arrow_type))
    path = root / "warehouse" / asset / f"{run_id}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(parquet_bytes(table).to_pybytes())


def write_run(root: Path, run_id: str, committed: bool = True, newer_columns: bool = False) -> None:
    (root / "runs" / run_id).mkdir(parents=True, exist_ok=True)
    (root / "runs" / run_id / "_SUCCESS").touch()
    task = lambda t: {"task_id": t, "site": f"s-{t}", "macro": "m", "instruction": f"do {t}", "run_id": run_id}  # noqa: E731
    _write(root, "batch_tasks", run_id, [task(t) | {"dedup_key": f'["s","#x","{t}"]'} for t in TASKS])
    _write(root, "batch_attempts", run_id, [{"task_id": t, "attempt": 1, "ok": t != "ef", "run_id": run_id,
                                              "dir": f"runs/{run_id}/traj/{t}/1", "n_actions": 2} for t in TASKS])  # fmt: skip
    judged = [t for t in TASKS if t != "ef"]
    verdicts = [task(t) | {"attempt": 1, "dir": f"runs/{run_id}/traj/{t}/1", "status": "error" if t == "u" else "judged",
                           "passed": None if t == "u" else t != "jf", "votes": "2/1", "cost": 0.5} for t in judged]  # fmt: skip
    extra = {"blocked": ([False, False, False, True, None], pa.bool_()), "score": ([5, 4, 4, 1, None], pa.int64()),
             "reasoning": (["fine", "fine", "fine", "a CAPTCHA <b>wall</b>", None], pa.large_string())}  # fmt: skip
    _write(root, "judge_verdicts", run_id, verdicts, extra=extra if newer_columns else None)
    _write(root, "failure_pool", run_id, [
        {"task_id": "ef", "stage": "execute", "reason": "backend_fail", "attempt": 1, "run_id": run_id},
        {"task_id": "jf", "stage": "judge", "reason": "judge_fail", "attempt": 1, "run_id": run_id}])  # fmt: skip
    _write(root, "batch_rejects", run_id, [{"file": "tasks.jsonl", "line": 9, "message": "tasks.jsonl:9: not JSON",
                                            "raw": "{oops", "run_id": run_id}])  # fmt: skip
    if not committed:
        return
    _write(root, "kept", run_id, verdicts[:1], schema_of="judge_verdicts")
    _write(root, "surplus", run_id, [verdicts[1] | {"dropped": "duplicate", "dup_of_run_id": "r0", "dup_of_task_id": "t0"},
                                     verdicts[2] | {"dropped": "site_cap"}])  # fmt: skip
    _write(root, "prior_kept_counts", run_id, [{"macro": "m", "site": "s-c", "n_kept": 1}])
    write_commit(UPath(str(root / "warehouse")), CommitRecord(
        run_id=run_id, walked_at="2026-12-01T00:00:00+00:00", files={}, kept_keys=1,
        caps={"per_site_cap": 3, "caps": {"m": {"site_cap": 1}}}, caps_source="deployment", judge={"kind": "gate"},
        history={}, inputs={}, unjudged=1))  # fmt: skip


@pytest.fixture
def warehouse(tmp_path) -> Warehouse:
    write_run(tmp_path, "r1", newer_columns=True)
    write_run(tmp_path, "r2", committed=False)
    return Warehouse(UPath(str(tmp_path)))


def test_every_fate_and_its_reason(warehouse):
    tasks = warehouse.run("r1").tasks
    assert dict(zip(tasks["task_id"], zip(tasks["fate"], tasks["reason"]))) == {
        "k": ("kept", None), "d": ("surplus", "duplicate"), "c": ("surplus", "site_cap"),
        "jf": ("judge_fail", "judge_fail"), "u": ("unjudged", None), "ef": ("execute_fail", "backend_fail"),
        "tasks.jsonl:9": ("reject", "tasks.jsonl:9: not JSON")}  # fmt: skip
    pending = warehouse.run("r2").tasks.set_index("task_id")["fate"].to_dict()
    assert pending["k"] == pending["d"] == "pending" and pending["jf"] == "judge_fail"


def test_an_execute_failures_reason_is_its_last_attempts_whatever_the_files_order(warehouse, tmp_path):
    _write(tmp_path, "failure_pool", "r1", [
        {"task_id": "ef", "stage": "execute", "reason": "policy_violation", "attempt": 2, "run_id": "r1"},
        {"task_id": "ef", "stage": "execute", "reason": "script_error", "attempt": 1, "run_id": "r1"}])  # fmt: skip
    tasks = Warehouse(UPath(str(tmp_path))).run("r1").tasks.set_index("task_id")
    assert (tasks.loc["ef", "fate"], tasks.loc["ef", "reason"]) == ("execute_fail", "policy_violation")


def test_a_task_without_any_attempt_is_an_execute_fail_that_says_so(tmp_path):
    write_run(tmp_path, "r1")
    tasks = [{"task_id": t, "site": "s", "macro": "m", "run_id": "r1"} for t in [*TASKS, "never-run"]]
    _write(tmp_path, "batch_tasks", "r1", tasks)
    fates = Warehouse(UPath(str(tmp_path))).run("r1").tasks.set_index("task_id")
    assert (fates.loc["never-run", "fate"], fates.loc["never-run", "reason"]) == ("execute_fail", "no_attempt")
    assert (fates.loc["ef", "fate"], fates.loc["ef", "reason"]) == ("execute_fail", "backend_fail")


def test_a_run_whose_judging_has_not_finished_decides_nothing_yet(tmp_path):
    write_run(tmp_path, "r1", committed=False)
    for asset in ("judge_verdicts", "failure_pool"):  # (written when the judge step ends)
        (tmp_path / "warehouse" / asset / "r1.parquet").unlink()
    tasks = Warehouse(UPath(str(tmp_path))).run("r1").tasks
    decided = tasks[tasks["fate"] != "reject"]
    assert set(decided["fate"]) == {"pending"} and decided["reason"].isna().all() and len(decided) == len(TASKS)


def test_run_summaries_give_state_funnel_rates_blocked_and_cost(warehouse):
    r1, r2 = sorted(warehouse.runs(), key=lambda r: r["run_id"])
    assert (r1["state"], r2["state"]) == ("unjudged", "pending")
    assert (r1["tasks"], r1["judged"], r1["passed"], r1["kept"], r1["reject"]) == (6, 4, 3, 1, 1)
    assert r1["judge_pass_rate"] == 0.75 and r1["keep_rate"] == 1 / 6 and r1["cost"] == 2.5
    assert r1["blocked"] == 1 and r2["blocked"] is None  # the newer column counted where the file has it


def test_only_batch_folders_the_stage_accepts_are_runs_and_one_still_being_written_says_so(tmp_path):
    write_run(tmp_path, "r1")
    (tmp_path / "runs" / "README.md").write_text("what the harness writes here")
    (tmp_path / "runs" / "bad name").mkdir()  # (refused by the sensor and `materialize`: never filtered)
    (tmp_path / "runs" / "_SUCCESS" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "r2" / "traj").mkdir(parents=True)  # the harness is still writing r2
    warehouse = Warehouse(UPath(str(tmp_path)))
    assert warehouse.run_ids() == ["r1", "r2"]
    assert [(r["run_id"], r["state"]) for r in warehouse.runs()] == [("r2", "incomplete"), ("r1", "unjudged")]
    (tmp_path / "runs" / "r2" / "_SUCCESS").touch()
    assert warehouse.runs()[0]["state"] == "pending"


def test_a_batch_folder_behind_a_symlink_is_a_run_as_the_stage_takes_it(tmp_path):
    (tmp_path / "elsewhere" / "r1").mkdir(parents=True)  # a batch not judged yet: known by its folder only
    (tmp_path / "elsewhere" / "r1" / "_SUCCESS").touch()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r1").symlink_to(tmp_path / "elsewhere" / "r1")
    (tmp_path / "runs" / "r2").symlink_to(tmp_path / "nowhere")  # (dangling: no folder, no run)
    warehouse = Warehouse(UPath(str(tmp_path)))
    assert warehouse.run_ids() == ["r1"] and warehouse.runs()[0]["state"] == "pending"


def test_a_page_is_filtered_and_sliced(warehouse):
    tasks = warehouse.run("r1").tasks
    assert page(tasks, {"fate": "surplus"}, 0, 10)[0] == 2
    total, rows = page(tasks, {"fate": None, "site": "s-d"}, 0, 10)
    assert total == 1 and rows[0]["task_id"] == "d"
    total, rows = page(tasks, {}, 5, 10)
    assert total == 7 and [r["task_id"] for r in rows] == ["ef", "tasks.jsonl:9"] and "dedup_key" not in rows[0]


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
    digits = "9" * 5000
    (folder / "trajectory.json").write_text(f'{{"steps": [{{"action": "scroll", "by": {digits}}}], "final": {{}}}}')
    shown = story(warehouse, "r1", "k")["trajectory"]
    assert "problem" not in shown and shown["steps"] == [{"action": "scroll", "by": digits}]


def test_a_rewritten_file_is_read_again_and_an_unchanged_one_is_not(warehouse, tmp_path):
    first = warehouse.run("r2")
    assert warehouse.run("r2") is first
    write_run(tmp_path, "r2", committed=True)
    path = tmp_path / "warehouse" / "kept" / "r2.parquet"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = warehouse.run("r2")
    assert again is not first and again.summary["state"] == "unjudged"
    assert json.loads(json.dumps(again.summary))["kept"] == 1


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


def test_the_runs_page_and_the_queue_read_each_of_many_runs_once(tmp_path, monkeypatch):
    from filter_pipeline.review import data
    from filter_pipeline.review.queue import QueueMemo

    for i in range(5):
        write_run(tmp_path, f"r{i}")
    monkeypatch.setattr(data, "CACHED_RUNS", 2)  # fewer run tables in memory than runs
    loads = []
    real = data.load_run
    monkeypatch.setattr(data, "load_run", lambda run_id, files: loads.append(run_id) or real(run_id, files))
    warehouse = Warehouse(UPath(str(tmp_path)))
    assert len(warehouse.runs()) == 5 and sorted(loads) == [f"r{i}" for i in range(5)]
    memo, labels = QueueMemo(), pd.DataFrame(columns=["dir", "run_id", "task_id", "success", "line"])
    queue = memo.state(warehouse, labels)[0]
    assert len(queue) == 5 * 4 and len(warehouse.runs()) == 5 and memo.state(warehouse, labels)[0] is queue
    assert len(loads) == 5


def test_a_task_rejected_for_an_over_long_integer_in_its_key_is_still_named_by_its_task_id():
    raw = '{"task_id": "lk", "site": "s", "dedup_key": ["s", ' + "1" * 5000 + "]}"
    rows = _rejected_tasks(pd.DataFrame([{"file": "tasks.jsonl", "line": 3, "message": "m", "raw": raw}]))
    assert rows[["task_id", "site", "fate"]].values.tolist() == [["lk", "s", "reject"]]


def test_a_task_rejected_for_a_lone_surrogate_is_shown_with_a_replacement_character():
    raw = '{"task_id": "t\\ud83d", "site": "s", "macro": "\\ud83d", "instruction": "do \\udc00 it"}'
    rows = _rejected_tasks(pd.DataFrame([{"file": "tasks.jsonl", "line": 2, "message": "m", "raw": raw}]))
    assert rows[["task_id", "macro", "instruction", "fate"]].values.tolist() == [
        ["t\ufffd", "\ufffd", "do \ufffd it", "reject"]
    ]


def test_a_legacy_runs_keys_are_shown_as_the_ledger_compares_them(tmp_path):
    lines = [
        {"task_id": "a", "site": "s", "macro": "m", "dedup_key": ["s", "#x", 1]},
        {"task_id": "b", "site": "s", "macro": "m", "dedup_key": '["s", "#y", 2.0]'},  # an export's key text
        {"task_id": "c", "site": "s", "macro": "m", "dedup_key": {"not": "an array"}},  # the ledger refuses it
    ]
    run = tmp_path / "runs" / "r0"
    run.mkdir(parents=True)
    (run / "kept.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    shown = Warehouse(UPath(str(tmp_path))).run("r0").tasks.set_index("task_id")["dedup_key"].to_dict()
    assert shown == {"a": '["s","#x",1]', "b": '["s","#y",2.0]', "c": '{"not": "an array"}'}
    ledger, _ = parse_legacy((run / "kept.jsonl").read_bytes()[: -len(json.dumps(lines[2])) - 1], "r0")
    assert ledger["dedup_key"].to_pylist() == [shown["a"], shown["b"]]


def test_a_legacy_run_nested_too_deep_is_shown_as_far_as_it_can_be(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    run = tmp_path / "runs" / "r0"
    run.mkdir(parents=True)
    (run / "kept.jsonl").write_text(
        json.dumps({"task_id": "a", "site": "s", "macro": "m", "dedup_key": deep}) + "\n"  # key text too deep
        + '{"task_id": "b", "site": "s", "macro": "m", "dedup_key": ' + deep + "}\n"  # a line too deep
    )  # fmt: skip
    shown = Warehouse(UPath(str(tmp_path))).run("r0").tasks.set_index("task_id")["dedup_key"].to_dict()
    assert shown == {"a": deep}


def test_a_run_with_an_unreadable_file_is_one_line_on_the_runs_page_and_the_queue_goes_on(tmp_path):
    from filter_pipeline.review.app import Review
    from filter_pipeline.review.queue import QueueMemo

    write_run(tmp_path, "r1")
    write_run(tmp_path, "r2")
    broken = tmp_path / "warehouse" / "dpo_pairs" / "r2.parquet"
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_bytes(b"PAR1 cut short")
    warehouse = Warehouse(UPath(str(tmp_path)))
    r2, r1 = warehouse.runs()
    assert r2["run_id"] == "r2" and r2["state"].startswith("unreadable (") and r2["tasks"] is None
    assert len(r2["state"].splitlines()) == 1 and r1["state"] == "unjudged"
    labels = pd.DataFrame(columns=["dir", "run_id", "task_id", "success", "line"])
    queue = QueueMemo().state(warehouse, labels)[0]
    assert set(queue["run_id"]) == {"r1"} and len(queue) == 4
    page_html = Review(UPath(str(tmp_path))).html("runs.html", runs=warehouse.runs()).body.decode()
    assert "unreadable (" in page_html and ">None<" not in page_html
    with pytest.raises(UnreadableRun, match=r"^run r2 cannot be read: ") as raised:
        warehouse.run("r2")  # (its own page: a 500 with that line)
    assert r2["state"] == f"unreadable ({str(raised.value).removeprefix('run r2 cannot be read: ')})"


def test_a_trajectory_folder_that_leads_out_of_the_run_is_not_read(tmp_path):
    from filter_pipeline.review.story import trajectory

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "trajectory.json").write_text(json.dumps({"instruction": "SECRET-OUTSIDE", "steps": []}))
    inside = tmp_path / "runs" / "r1" / "traj" / "k"
    inside.mkdir(parents=True)
    (inside / "1").symlink_to(outside)  # the folder itself
    (inside / "2").mkdir()
    (inside / "2" / "trajectory.json").symlink_to(outside / "trajectory.json")  # or its file
    (inside / "3").mkdir()
    (inside / "3" / "trajectory.json").write_text(json.dumps({"instruction": "mine", "steps": []}))
    root = UPath(str(tmp_path))
    for n in (1, 2):
        found = trajectory(root, "r1", f"runs/r1/traj/k/{n}")
        assert found["problem"] == "no trajectory folder inside the run" and "instruction" not in found
    assert trajectory(root, "r1", "runs/r1/traj/k/3")["instruction"] == "mine"


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
        story(Warehouse(UPath(str(tmp_path))), "r3", "a")
    (tmp_path / "runs" / "r3" / "_SUCCESS").touch()
    with pytest.raises(ReviewError, match=r"^run 'r3' is not filtered yet: filter-pipeline materialize r3$"):
        story(Warehouse(UPath(str(tmp_path))), "r3", "a")


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


def test_a_retired_json_the_stage_refuses_is_one_line_not_nothing_retired(warehouse):
    (warehouse.root / "retired.json").write_text(json.dumps([{"task_ids": ["k"]}]))
    with pytest.raises(
        UnreadableFile, match=r"^retired.json\[0\] must be an object with a string 'run_id' \(the stage"
    ):
        story(warehouse, "r1", "k")


def test_a_batch_not_parsed_yet_shows_the_valid_tasks_of_its_tasks_jsonl_as_pending(tmp_path):
    from filter_pipeline_tests.builders import attempt, task, write_batch

    write_batch(tmp_path, "r5", [task("a"), task("b", site="s2"), task("a")], [attempt("a")])
    warehouse = Warehouse(UPath(str(tmp_path)))
    tasks = warehouse.run("r5").tasks
    assert tasks[["task_id", "fate", "site"]].values.tolist() == [["a", "pending", "s"], ["b", "pending", "s2"]]
    [line] = warehouse.runs()
    assert (line["tasks"], line["state"], line["keep_rate"]) == (2, "pending", None)
    assert story(warehouse, "r5", "b")["decision"]["fate"] == "pending"
    _write(tmp_path, "batch_tasks", "r5", [{"task_id": "c", "run_id": "r5"}])  # the judge step parsed it
    assert warehouse.run("r5").tasks["task_id"].tolist() == ["c"]


def test_a_tasks_rejects_are_the_lines_naming_it_as_their_task_id():
    from filter_pipeline.review.story import task_rejects

    raw = ['{"task_id": "site", "attempt": 1, "ok": "yes"}', '{"task_id": "t2", "site": "site"}',
           '{"task_id":"site","attempt":2}', '{"task_id": "sites"}']  # fmt: skip
    rejects = pd.DataFrame({"file": "executions.jsonl", "line": [1, 2, 3, 4], "message": "m", "raw": raw})
    assert [r["line"] for r in task_rejects(rejects, "site")] == [1, 3]


def test_a_filter_choice_is_sent_as_it_is_whitespace_included(warehouse):
    from filter_pipeline.review.app import Review

    spaced = "  spaced  site  "
    html = Review(warehouse.root).html(
        "run.html", run_id="r1", summary=warehouse.run("r1").summary, choices={"site": [spaced], "macro": [], "reason": []},
        links={"prev": None, "next": None}, page_count=1, total=0, offset=0, limit=100,
        filters={"fate": None, "site": spaced, "macro": None, "reason": None}, tasks=[],
    ).body.decode()  # fmt: skip
    assert f'<option value="{spaced}" selected>' in html  # (a browser sends an option's text with its spaces collapsed)


def test_a_page_past_the_last_row_says_so(warehouse):
    from filter_pipeline.review.app import Review

    html = Review(warehouse.root).html(
        "run.html", run_id="r1", summary=warehouse.run("r1").summary, choices={"site": [], "macro": [], "reason": []},
        links={"prev": None, "next": None}, page_count=1, total=7, offset=500, limit=100,
        filters={"fate": None, "site": None, "macro": None, "reason": None}, tasks=[],
    ).body.decode()  # fmt: skip
    assert "7 tasks match; no row at 501 or after." in html
