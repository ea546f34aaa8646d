"""Each task's fate and reason, and a run's line on the runs page, over the small warehouse written here."""

import pandas as pd
from upath import UPath

from filter_pipeline.review.data import Warehouse
from filter_pipeline.review.fates import FATE_WHERE, NO_ATTEMPT_WHERE, _rejected_tasks, fate_where
from filter_pipeline_tests.review.small_warehouse import TASKS, refused_batch, write_asset, write_run


def test_every_fate_and_its_reason(warehouse):
    tasks = warehouse.run("r1").tasks
    assert dict(zip(tasks["task_id"], zip(tasks["fate"], tasks["reason"]))) == {
        "k": ("kept", None), "d": ("surplus", "duplicate"), "c": ("surplus", "site_cap"),
        "jf": ("judge_fail", "judge_fail"), "u": ("unjudged", None), "ef": ("execute_fail", "backend_fail"),
        "tasks.jsonl:9": ("reject", "tasks.jsonl:9: not JSON")}  # fmt: skip
    pending = warehouse.run("r2").tasks.set_index("task_id")["fate"].to_dict()
    assert pending["k"] == pending["d"] == "pending" and pending["jf"] == "judge_fail"


def test_an_execute_failures_reason_is_its_last_attempts_whatever_the_files_order(warehouse, tmp_path):
    write_asset(tmp_path, "failure_pool", "r1", [
        {"task_id": "ef", "stage": "execute", "reason": "policy_violation", "attempt": 2, "run_id": "r1"},
        {"task_id": "ef", "stage": "execute", "reason": "script_error", "attempt": 1, "run_id": "r1"}])  # fmt: skip
    tasks = Warehouse(UPath(str(tmp_path))).run("r1").tasks.set_index("task_id")
    assert (tasks.loc["ef", "fate"], tasks.loc["ef", "reason"]) == ("execute_fail", "policy_violation")


def test_a_task_without_any_attempt_is_an_execute_fail_that_says_so(tmp_path):
    write_run(tmp_path, "r1")
    tasks = [{"task_id": t, "site": "s", "macro": "m", "run_id": "r1"} for t in [*TASKS, "never-run"]]
    write_asset(tmp_path, "batch_tasks", "r1", tasks)
    fates = Warehouse(UPath(str(tmp_path))).run("r1").tasks.set_index("task_id")
    assert (fates.loc["never-run", "fate"], fates.loc["never-run", "reason"]) == ("execute_fail", "no_attempt")
    assert (fates.loc["ef", "fate"], fates.loc["ef", "reason"]) == ("execute_fail", "backend_fail")
    where = {t: fate_where(fates.loc[t, "fate"], fates.loc[t, "reason"]) for t in ("never-run", "ef")}
    assert where == {"never-run": NO_ATTEMPT_WHERE, "ef": FATE_WHERE["execute_fail"]}
    assert "failure_pool" not in NO_ATTEMPT_WHERE


def test_a_run_whose_judging_has_not_finished_decides_nothing_yet(tmp_path):
    write_run(tmp_path, "r1", committed=False)
    for asset in ("judge_verdicts", "failure_pool"):  # (written when the judge step ends)
        (tmp_path / "warehouse" / asset / "r1.parquet").unlink()
    tasks = Warehouse(UPath(str(tmp_path))).run("r1").tasks
    decided = tasks[tasks["fate"] != "reject"]
    assert set(decided["fate"]) == {"pending"} and decided["reason"].isna().all() and len(decided) == len(TASKS)


def test_run_summaries_give_state_funnel_rates_blocked_and_cost(warehouse):
    r1, r2 = sorted(warehouse.runs()[1], key=lambda r: r["run_id"])
    assert (r1["state"], r2["state"]) == ("unjudged", "pending")
    assert (r1["tasks"], r1["judged"], r1["passed"], r1["kept"], r1["reject"]) == (6, 4, 3, 1, 1)
    assert r1["judge_pass_rate"] == 0.75 and r1["keep_rate"] == 1 / 6 and r1["cost"] == 2.5
    assert r1["blocked"] == 1 and r2["blocked"] is None  # the newer column counted where the file has it


def test_a_task_rejected_for_an_over_long_integer_in_its_key_is_still_named_by_its_task_id():
    raw = '{"task_id": "lk", "site": "s", "dedup_key": ["s", ' + "1" * 5000 + "]}"
    rows = _rejected_tasks(pd.DataFrame([{"file": "tasks.jsonl", "line": 3, "message": "m", "raw": raw}]), set())
    assert rows[["task_id", "site", "fate"]].values.tolist() == [["lk", "s", "reject"]]


def test_a_task_rejected_for_a_lone_surrogate_is_shown_with_a_replacement_character():
    raw = '{"task_id": "t\\ud83d", "site": "s", "macro": "\\ud83d", "instruction": "do \\udc00 it"}'
    rows = _rejected_tasks(pd.DataFrame([{"file": "tasks.jsonl", "line": 2, "message": "m", "raw": raw}]), set())
    assert rows[["task_id", "macro", "instruction", "fate"]].values.tolist() == [
        ["t\ufffd", "\ufffd", "do \ufffd it", "reject"]
    ]


def test_a_second_line_of_a_valid_task_is_named_by_its_line_so_its_link_opens_the_reject():
    rejects = pd.DataFrame([{"file": "tasks.jsonl", "line": 7, "message": "task_id 'a' appears earlier in the file",
                             "raw": '{"task_id": "a", "site": "s"}'}])  # fmt: skip
    assert _rejected_tasks(rejects, {"a"})["task_id"].tolist() == ["tasks.jsonl:7"]
    assert _rejected_tasks(rejects, {"b"})["task_id"].tolist() == ["a"]  # (no valid task of that name)
    twice = pd.concat([rejects, rejects.assign(line=8)], ignore_index=True)  # two rejected lines of one name
    assert _rejected_tasks(twice, set())["task_id"].tolist() == ["a", "tasks.jsonl:8"]


def test_a_tasks_rejects_are_the_lines_naming_it_as_their_task_id():
    from filter_pipeline.review.story import task_rejects

    raw = ['{"task_id": "site", "attempt": 1, "ok": "yes"}', '{"task_id": "t2", "site": "site"}',
           '{"task_id":"site","attempt":2}', '{"task_id": "sites"}']  # fmt: skip
    rejects = pd.DataFrame({"file": "executions.jsonl", "line": [1, 2, 3, 4], "message": "m", "raw": raw})
    assert [r["line"] for r in task_rejects(rejects, "site")] == [1, 3]


def test_a_batch_the_stage_refused_is_failed_with_the_reason_until_it_is_parsed_or_walked(tmp_path):
    from filter_pipeline.storage.failures import clear_failure, record_failure

    warehouse = refused_batch(tmp_path)
    assert warehouse.runs()[1][0]["state"] == "pending"
    record_failure(UPath(str(tmp_path / "warehouse")), "r5", "runs/r5/executions.jsonl does not exist")
    assert warehouse.runs()[1][0]["state"] == "failed (runs/r5/executions.jsonl does not exist)"
    write_asset(tmp_path, "batch_tasks", "r5", [{"task_id": "a", "run_id": "r5"}])  # corrected, parsed, not walked
    assert warehouse.runs()[1][0]["state"] == "pending"
    (tmp_path / "warehouse" / "batch_tasks" / "r5.parquet").unlink()
    clear_failure(UPath(str(tmp_path / "warehouse")), "r5")  # (as its walk does)
    assert warehouse.runs()[1][0]["state"] == "pending"


def test_a_rejected_line_nested_deeper_than_json_follows_is_a_reject_row_not_a_crash():
    deep = '{"task_id": "deep", "extra": ' + "[" * 5000 + "]" * 5000 + "}"
    rejects = pd.DataFrame([{"file": "tasks.jsonl", "line": 3, "message": "tasks.jsonl:3: too deep", "raw": deep}])
    assert _rejected_tasks(rejects, set())[["task_id", "fate"]].values.tolist() == [["tasks.jsonl:3", "reject"]]
