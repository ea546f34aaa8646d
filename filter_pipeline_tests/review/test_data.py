"""The review data layer (`review/data.py`): which folders are runs, reading each file once and again when it
changes, pages of the task table, runs that cannot be read, legacy runs, batches not parsed yet."""

import json
import os

import pandas as pd
import pyarrow.parquet as pq
import pytest
from upath import UPath

from filter_pipeline.review.data import ReviewError, UnreadableRun, Warehouse, page
from filter_pipeline.review.story import story
from filter_pipeline.rules.history import parse_legacy
from filter_pipeline_tests.review.small_warehouse import write_asset, write_run


def test_only_batch_folders_the_stage_accepts_are_runs_and_one_still_being_written_says_so(tmp_path):
    write_run(tmp_path, "r1")
    (tmp_path / "runs" / "README.md").write_text("what the harness writes here")
    (tmp_path / "runs" / "bad name").mkdir()  # (refused by the sensor and `materialize`: never filtered)
    (tmp_path / "runs" / "_SUCCESS" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "r2" / "traj").mkdir(parents=True)  # the harness is still writing r2
    warehouse = Warehouse(UPath(str(tmp_path)))
    assert warehouse.run_ids() == ["r1", "r2"]
    assert [(r["run_id"], r["state"]) for r in warehouse.runs()[1]] == [("r2", "incomplete"), ("r1", "unjudged")]
    (tmp_path / "runs" / "r2" / "_SUCCESS").touch()
    assert warehouse.runs()[1][0]["state"] == "pending"


def test_warehouse_files_named_otherwise_than_a_run_id_are_no_runs_and_such_a_name_is_refused(tmp_path):
    write_run(tmp_path, "r1")
    for folder, suffix in (("judge_verdicts", ".parquet"), ("_commits", ".json")):
        path = tmp_path / "warehouse" / folder / f"r1{suffix}"
        for copy in ("r1 copy", "a..b"):  # (a copy a file manager made; a name with `..`)
            (path.parent / f"{copy}{suffix}").write_bytes(path.read_bytes())
    warehouse = Warehouse(UPath(str(tmp_path)))
    assert warehouse.run_ids() == ["r1"] and warehouse.rooted_run_ids() == {"r1"}
    with pytest.raises(ReviewError, match="run_id 'r1 copy' is not a plain folder name"):
        warehouse.check_run("r1 copy")
    with pytest.raises(ReviewError, match="no run 'r2' in "):
        warehouse.check_run("r2")


def test_a_batch_folder_behind_a_symlink_is_a_run_as_the_stage_takes_it(tmp_path):
    (tmp_path / "elsewhere" / "r1").mkdir(parents=True)  # a batch not judged yet: known by its folder only
    (tmp_path / "elsewhere" / "r1" / "_SUCCESS").touch()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r1").symlink_to(tmp_path / "elsewhere" / "r1")
    (tmp_path / "runs" / "r2").symlink_to(tmp_path / "nowhere")  # (dangling: no folder, no run)
    warehouse = Warehouse(UPath(str(tmp_path)))
    assert warehouse.run_ids() == ["r1"] and warehouse.runs()[1][0]["state"] == "pending"


def test_a_page_is_filtered_and_sliced(warehouse):
    tasks = warehouse.run("r1").tasks
    assert page(tasks, {"fate": "surplus"}, 0, 10)[0] == 2
    total, rows = page(tasks, {"fate": None, "site": "s-d"}, 0, 10)
    assert total == 1 and rows[0]["task_id"] == "d"
    total, rows = page(tasks, {}, 5, 10)
    assert total == 7 and [r["task_id"] for r in rows] == ["ef", "tasks.jsonl:9"] and "dedup_key" not in rows[0]


def test_a_rewritten_file_is_read_again_and_an_unchanged_one_is_not(warehouse, tmp_path):
    first = warehouse.run("r2")
    assert warehouse.run("r2") is first
    write_run(tmp_path, "r2", committed=True)
    path = tmp_path / "warehouse" / "kept" / "r2.parquet"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = warehouse.run("r2")
    assert again is not first and again.summary["state"] == "unjudged"
    assert json.loads(json.dumps(again.summary))["kept"] == 1


def test_the_runs_page_reads_only_its_runs_and_the_queue_only_verdicts(tmp_path, monkeypatch):
    from filter_pipeline.review import data
    from filter_pipeline.review.queue import QueueMemo

    for i in range(5):
        write_run(tmp_path, f"r{i}")
    monkeypatch.setattr(data, "CACHED_RUNS", 2)  # fewer run tables in memory than runs
    loads = []
    real = data.load_run
    monkeypatch.setattr(data, "load_run", lambda root, run_id, files: loads.append(run_id) or real(root, run_id, files))
    listings, listed = [], Warehouse.run_ids
    monkeypatch.setattr(Warehouse, "run_ids", lambda self: listings.append(1) or listed(self))
    warehouse = Warehouse(UPath(str(tmp_path)))
    total, newest = warehouse.runs(0, 2)
    assert total == 5 and [r["run_id"] for r in newest] == ["r4", "r3"] and loads == ["r4", "r3"]
    assert len(listings) == 1  # the data root listed once for the page, not once more per run
    assert [r["run_id"] for r in warehouse.runs(4, 2)[1]] == ["r0"] and loads == ["r4", "r3", "r0"]
    assert len(warehouse.runs()[1]) == 5 and sorted(loads) == [f"r{i}" for i in range(5)]
    memo, labels = QueueMemo(), pd.DataFrame(columns=["dir", "run_id", "task_id", "success", "line"])
    queue = memo.state(warehouse, labels)[0]
    assert len(queue) == 5 * 4 and memo.state(warehouse, labels)[0] is queue
    assert len(loads) == 5  # the queue read each run's verdicts, none of its whole tables
    assert len(warehouse.runs()[1]) == 5 and len(loads) == 5  # and summaries stay known beyond CACHED_RUNS


def test_the_queue_reads_a_runs_verdicts_once_until_they_change(tmp_path, monkeypatch):
    from filter_pipeline.review import data
    from filter_pipeline.review.queue import QueueMemo

    write_run(tmp_path, "r1")
    reads = []
    real = data.frame
    monkeypatch.setattr(data, "frame", lambda path, columns: reads.append(path.name) or real(path, columns))
    warehouse, memo = Warehouse(UPath(str(tmp_path))), QueueMemo()
    labels = pd.DataFrame(columns=["dir", "run_id", "task_id", "success", "line"])
    first = memo.state(warehouse, labels)[0]
    assert reads == ["r1.parquet"] and memo.state(warehouse, labels)[0] is first
    verdicts = tmp_path / "warehouse" / "judge_verdicts" / "r1.parquet"
    table = pq.read_table(verdicts)
    pq.write_table(table.slice(0, 1), verdicts)  # (a re-judged run: one verdict left)
    assert len(memo.state(warehouse, labels)[0]) == 1 and reads == ["r1.parquet"] * 2


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
    r2, r1 = warehouse.runs()[1]
    assert r2["run_id"] == "r2" and r2["state"].startswith("unreadable (") and r2["tasks"] is None
    assert len(r2["state"].splitlines()) == 1 and r1["state"] == "unjudged"
    labels = pd.DataFrame(columns=["dir", "run_id", "task_id", "success", "line"])
    queue = QueueMemo().state(warehouse, labels)[0]
    assert set(queue["run_id"]) == {"r1"} and len(queue) == 4
    page_html = (
        Review(UPath(str(tmp_path))).html("runs.html", runs=warehouse.runs()[1], total=2, offset=0).body.decode()
    )
    assert "unreadable (" in page_html and ">None<" not in page_html
    with pytest.raises(UnreadableRun, match=r"^run r2 cannot be read: warehouse/dpo_pairs/r2.parquet: ") as raised:
        warehouse.run("r2")  # (its own page: a 500 with that line)
    assert r2["state"] == f"unreadable ({str(raised.value).removeprefix('run r2 cannot be read: ')})"


def test_a_file_a_run_committed_that_is_gone_makes_the_run_unreadable_not_its_rows_undecided(tmp_path):
    write_run(tmp_path, "r1")
    (tmp_path / "warehouse" / "kept" / "r1.parquet").unlink()  # (deleted by hand, or lost with a copy)
    warehouse = Warehouse(UPath(str(tmp_path)))
    expected = "warehouse/kept/r1.parquet is missing, but run r1 committed it"
    with pytest.raises(UnreadableRun, match=f"^run r1 cannot be read: {expected}"):
        warehouse.run("r1")  # (its pages: a 500 with that line; `explain`: exit 1)
    [r1] = warehouse.runs()[1]
    assert r1["state"].startswith(f"unreadable ({expected}") and r1["kept"] is None


@pytest.mark.parametrize("asset", ["judge_verdicts", "batch_attempts", "failure_pool", "batch_tasks"])
def test_a_judge_steps_file_a_committed_run_lacks_makes_it_unreadable_not_its_fates_wrong(tmp_path, asset):
    write_run(tmp_path, "r1")
    (tmp_path / "warehouse" / asset / "r1.parquet").unlink()  # (kept pending, or a task without attempts, else)
    expected = f"warehouse/{asset}/r1.parquet is missing, but run r1 was walked from it"
    with pytest.raises(UnreadableRun, match=f"^run r1 cannot be read: {expected}"):
        Warehouse(UPath(str(tmp_path))).run("r1")


def test_a_file_a_published_walk_has_not_moved_yet_is_read_from_its_staging_folder_not_the_one_in_place(tmp_path):
    from filter_pipeline.storage.history import read_commit
    from filter_pipeline.storage.publish import MANIFEST, STAGING_DIR

    write_run(tmp_path, "r1")
    root = UPath(str(tmp_path))
    # a walk killed after its publish, before moving kept into place (the next launcher completes the move)
    folder = tmp_path / "warehouse" / STAGING_DIR / "r1.elsewhere.1.ff"
    (folder / "warehouse" / "kept").mkdir(parents=True)
    (tmp_path / "warehouse" / "kept" / "r1.parquet").rename(folder / "warehouse" / "kept" / "r1.parquet")
    write_asset(tmp_path, "kept", "r1", [], schema_of="judge_verdicts")  # (in place: the walk before's, a re-walk)
    moves = {f"warehouse/{STAGING_DIR}/{folder.name}/warehouse/kept/r1.parquet": "warehouse/kept/r1.parquet"}
    digest = read_commit(root / "warehouse", "r1").digest
    (folder / MANIFEST).write_text(json.dumps({"run_id": "r1", "digest": digest, "moves": moves}))
    tasks = Warehouse(root).run("r1").tasks
    assert tasks.loc[tasks["task_id"] == "k", "fate"].item() == "kept"


def test_a_run_whose_commit_record_cannot_be_read_has_no_keep_rate_and_no_surplus(tmp_path):
    write_run(tmp_path, "r1")
    record = tmp_path / "warehouse" / "_commits" / "r1.json"
    record.write_bytes(record.read_bytes()[:100])  # (cut short)
    [r1] = Warehouse(UPath(str(tmp_path))).runs()[1]
    assert r1["state"] == "pending (unreadable commit record)"
    assert (r1["keep_rate"], r1["kept"], r1["surplus"]) == (None, 0, 0)
    assert set(r1["surplus_by_reason"].values()) == {0}


def test_a_batch_not_parsed_yet_shows_its_tasks_attempts_and_rejected_lines_as_the_stage_will_parse_them(tmp_path):
    from filter_pipeline_tests.builders import attempt, task, write_batch

    write_batch(tmp_path, "r5", [task("a"), task("b", site="s2"), task("a")], [attempt("a", ok=False), attempt("x")])
    warehouse = Warehouse(UPath(str(tmp_path)))
    tasks = warehouse.run("r5").tasks
    assert tasks[["task_id", "fate", "site"]].values.tolist() == [
        ["a", "pending", "s"], ["b", "pending", "s2"], ["tasks.jsonl:3", "reject", "s"]]  # fmt: skip
    [line] = warehouse.runs()[1]
    assert (line["tasks"], line["state"], line["keep_rate"], line["rejects"]) == (2, "pending", None, 2)
    assert story(warehouse, "r5", "b")["decision"]["fate"] == "pending"
    assert [(a["attempt"], a["ok"]) for a in story(warehouse, "r5", "a")["attempts"]] == [(1, False)]
    messages = warehouse.run("r5").rejects["message"].tolist()
    assert messages == ["executions.jsonl:2: attempt of task_id 'x' which is not in tasks.jsonl",
                        "tasks.jsonl:3: task_id 'a' appears earlier in the file"]  # fmt: skip
    write_asset(tmp_path, "batch_tasks", "r5", [{"task_id": "c", "run_id": "r5"}])  # the judge step parsed it
    assert warehouse.run("r5").tasks["task_id"].tolist() == ["c"]


def test_a_batch_not_judged_yet_counts_its_tasks_with_an_ok_attempt_from_its_attempts(tmp_path):
    from filter_pipeline_tests.builders import attempt, task, write_batch

    attempts = [attempt("a", ok=False), attempt("a", 2), attempt("b"), attempt("b", 2), attempt("c", ok=False)]
    write_batch(tmp_path, "r5", [task("a"), task("b"), task("c")], attempts)
    [line] = Warehouse(UPath(str(tmp_path))).runs()[1]
    assert (line["tasks"], line["attempts"], line["with_ok_attempt"]) == (3, 5, 2)


def test_a_batch_refused_for_holding_no_valid_task_shows_the_lines_it_rejected(tmp_path):
    from filter_pipeline.storage.failures import record_failure
    from filter_pipeline_tests.builders import attempt, task, write_batch

    write_batch(tmp_path, "r5", [{**task("a"), "macro": None}, task("")], [attempt("a")])
    record_failure(UPath(str(tmp_path / "warehouse")), "r5", "runs/r5/tasks.jsonl holds no valid task")
    warehouse = Warehouse(UPath(str(tmp_path)))
    tasks = warehouse.run("r5").tasks
    assert tasks[["task_id", "fate"]].values.tolist() == [["a", "reject"], ["tasks.jsonl:2", "reject"]]
    [line] = warehouse.runs()[1]
    assert line["state"].startswith("failed (") and (line["tasks"], line["rejects"]) == (0, 2)
    assert story(warehouse, "r5", "a")["decision"]["reason"].startswith("tasks.jsonl:1: ")


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


def test_a_verdicts_file_copied_beside_a_runs_takes_none_of_its_attempts_in_the_queue(tmp_path):
    import shutil

    from filter_pipeline.review.queue import QueueMemo

    write_run(tmp_path, "r1")
    verdicts = tmp_path / "warehouse" / "judge_verdicts"
    shutil.copy(verdicts / "r1.parquet", verdicts / "r1.bak.parquet")  # (a backup: no batch, no commit)
    warehouse = Warehouse(UPath(str(tmp_path)))
    assert "r1.bak" in warehouse.run_ids()  # (still listed, as a judged run: its name is a run_id's)
    queue, _, _ = QueueMemo().state(warehouse, pd.DataFrame(columns=["dir", "success", "line"]))
    assert set(queue["run_id"]) == {"r1"}  # its attempts are r1's, whose task pages tell their story
