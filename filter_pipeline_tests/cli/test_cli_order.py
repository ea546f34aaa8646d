"""The CLI keeps the ledger's order (first walks in run_id order, exit 2 when an unnamed lower batch blocks),
and runs with unjudged tasks exit 3 and are judged again by a later `materialize` naming no run."""

import json

import pandas as pd
import pytest

from filter_pipeline_tests.builders import attempt, commit_files, task, write_batch, write_kept
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply

pytestmark = pytest.mark.slow


def kept(data_root) -> list[str]:
    return sorted(pd.read_parquet(data_root / "warehouse" / "kept")["task_id"])


def test_named_runs_are_walked_in_run_id_order_with_one_line_saying_so(cli, data_root):
    write_batch(data_root, "b1", [task("y", key=["k"])], [attempt("y")])
    write_batch(data_root, "b2", [task("x", key=["k"])], [attempt("x")])
    done = cli("b2", "b1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "first walks go in run_id order: b1 b2 (given: b2 b1)"
    assert [line.split(":")[0] for line in lines[1:3]] == ["b1", "b2"]
    assert kept(data_root) == ["y"]  # the CLI's run_id-order result, whatever order the names came in


def test_a_named_run_behind_an_unnamed_lower_batch_exits_2_before_anything_runs(cli, data_root):
    write_batch(data_root, "b1", [task("y")], [attempt("y")])
    write_batch(data_root, "b2", [task("x")], [attempt("x")])
    done = cli("b2")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "filter-pipeline: b2: first walk must wait for b1 (complete, lower run_id, not yet filtered): name it too, "
        "run `filter-pipeline materialize` with no run, or retire it in retired.json"
    )
    assert not (data_root / "warehouse").exists()
    (data_root / "retired.json").write_text('[{"run_id": "b1", "reason": "bad build"}]')
    assert cli("b2").returncode == 0  # retired: no longer waited for


def test_unjudged_tasks_exit_3_and_a_later_materialize_judges_only_those_again(cli, data_root):
    write_batch(data_root, "b1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    down = {"b": True}

    def responder(call, n):
        if down["b"] and "do b" in call.prompt:
            return Reply(status=500, body='{"error": "upstream down"}')
        return Reply()

    with FakeOpenAI(responder) as server:
        env = {"FILTER_JUDGE_BASE_URL": server.base_url, "FILTER_JUDGE_MODEL": "m", "FILTER_JUDGE_VOTES": "1",
               "FILTER_JUDGE_TASK_BUDGET": "1", "FILTER_PIPELINE_REJUDGE_MAX_TRIES": "2"}  # fmt: skip
        first = cli("--judge", "llm", env=env)
        assert first.returncode == 3, first.stderr
        assert "b1: judged 1, unjudged 1" in first.stdout
        assert kept(data_root) == ["a"]

        before = len(server.calls)
        second = cli("--judge", "llm", env=env)  # still down: try 1 of 2
        assert second.returncode == 3, second.stderr
        assert "b1: judging its unjudged tasks again (try 1)" in second.stdout
        assert all("do b" in c.prompt for c in server.calls[before:])  # only the unjudged task is asked again

        down["b"] = False
        third = cli("--judge", "llm", env=env)  # try 2 of 2
        assert third.returncode == 0, third.stderr
        assert "b1: judged 2, unjudged 0" in third.stdout
        assert kept(data_root) == ["a", "b"]
        assert "nothing to materialize" in cli("--judge", "llm", env=env).stdout


def test_unjudged_tasks_of_an_llm_run_are_not_judged_again_by_the_gate(cli, data_root):
    write_batch(data_root, "b1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    down = lambda call, n: Reply(status=500, body='{"error": "down"}') if "do b" in call.prompt else Reply()  # noqa: E731
    with FakeOpenAI(down) as server:
        env = {"FILTER_JUDGE_BASE_URL": server.base_url, "FILTER_JUDGE_MODEL": "m", "FILTER_JUDGE_VOTES": "1",
               "FILTER_JUDGE_TASK_BUDGET": "1"}  # fmt: skip
        assert cli("--judge", "llm", env=env).returncode == 3
    verdicts = (data_root / "warehouse" / "judge_verdicts" / "b1.parquet").read_bytes()
    gate = cli()  # FILTER_JUDGE_KIND unset: the gate
    assert gate.returncode == 3, gate.stderr
    assert gate.stdout.splitlines() == ["nothing to materialize: no complete batch is waiting to be filtered"]
    assert gate.stderr.strip() == (
        "filter-pipeline: b1: 1 unjudged tasks left as they are: the run was judged by llm m v3 (votes 1), not by gate "
        "(judge them again with that judge: --judge, FILTER_JUDGE_KIND, FILTER_JUDGE_MODEL, "
        "FILTER_JUDGE_PROMPT_VERSION)"
    )
    assert (data_root / "warehouse" / "judge_verdicts" / "b1.parquet").read_bytes() == verdicts  # paid for, kept


def test_the_cap_on_tries_is_respected_and_a_run_that_spent_it_is_named_until_judged_or_retired(cli, data_root):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    responder = lambda call, n: Reply(status=500, body='{"error": "down"}') if "do a" in call.prompt else Reply()  # noqa: E731
    spent_line = (
        "1 run(s) still hold unjudged tasks after their last try (FILTER_PIPELINE_REJUDGE_MAX_TRIES): "
        "name them to judge them again: filter-pipeline materialize b1"
    )
    with FakeOpenAI(responder) as server:
        env = {"FILTER_JUDGE_BASE_URL": server.base_url, "FILTER_JUDGE_MODEL": "m", "FILTER_JUDGE_VOTES": "1",
               "FILTER_JUDGE_TASK_BUDGET": "1", "FILTER_PIPELINE_REJUDGE_MAX_TRIES": "1"}  # fmt: skip
        first = cli("--judge", "llm", env=env)
        assert first.returncode == 3 and "1 run(s) left tasks unjudged: a later" in first.stdout
        last_try = cli("--judge", "llm", env=env)  # its last try: named at once, never promised another
        assert "try 1" in last_try.stdout and last_try.returncode == 3
        assert last_try.stdout.splitlines()[-1] == spent_line and "left tasks unjudged" not in last_try.stdout
        spent = cli("--judge", "llm", env=env)  # the cap is reached: not asked again, but not forgotten
        assert spent.returncode == 3
        assert spent.stdout.splitlines() == [
            "nothing to materialize: no complete batch is waiting to be filtered",
            spent_line,
        ]

        write_batch(data_root, "b2", [task("c")], [attempt("c")])  # a new batch, judged in full, beside it
        asked = len(server.calls)
        beside = cli("--judge", "llm", env=env)
        assert beside.returncode == 3 and "b2: judged 1, unjudged 0" in beside.stdout
        assert beside.stdout.splitlines()[-1] == spent_line
        assert all("do c" in c.prompt for c in server.calls[asked:])  # b1 is not asked again unnamed

        asked = len(server.calls)
        named = cli("--judge", "llm", "b1", env=env)  # named: judged again whatever the cap
        assert named.returncode == 3 and len(server.calls) > asked
        # still unjudged: named again as the way to judge it, not promised to a call naming no run
        assert named.stdout.splitlines()[-1] == spent_line and "left tasks unjudged" not in named.stdout

        (data_root / "retired.json").write_text('[{"run_id": "b1", "reason": "endpoint never judged it"}]')
        retired = cli("--judge", "llm", env=env)  # retired: no longer waiting for anything
        assert retired.returncode == 0 and "still hold unjudged" not in retired.stdout


def test_a_run_with_unjudged_tasks_whose_batch_changed_is_not_judged_again_unless_named(cli, data_root):
    from upath import UPath

    from filter_pipeline.storage.files import input_fingerprints

    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    write_kept(data_root, "b1", ("a", ["k"], "m", "s"))
    inputs = input_fingerprints(UPath(data_root) / "runs" / "b1")
    commit_files(data_root, "b1", {"kept": data_root / "warehouse" / "kept" / "b1.parquet"}, unjudged=1, inputs=inputs)
    with open(data_root / "runs" / "b1" / "tasks.jsonl", "a") as f:  # the batch ran again since
        f.write(json.dumps(task("late")) + "\n")
    done = cli()
    assert "judging its unjudged tasks again" not in done.stdout and "nothing to materialize" in done.stdout
    assert "runs/b1 changed since it was filtered" in done.stderr
    assert "after their last try" not in done.stdout  # (it waits to be named because it changed: no try was made)


def test_a_run_with_unjudged_tasks_whose_batch_is_being_written_again_or_gone_is_left_as_it_is(cli, data_root):
    import shutil

    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    write_kept(data_root, "b1", ("a", ["k"], "m", "s"))
    commit_files(data_root, "b1", {"kept": data_root / "warehouse" / "kept" / "b1.parquet"}, unjudged=1)
    (data_root / "runs" / "b1" / "_SUCCESS").unlink()  # (its producer writes it again)
    written_again = cli()
    assert written_again.returncode == 0, written_again.stderr
    assert written_again.stdout.splitlines() == ["nothing to materialize: no complete batch is waiting to be filtered"]
    assert "runs/b1: no _SUCCESS yet" in written_again.stderr  # (a try would fail on it and count against the cap)
    shutil.rmtree(data_root / "runs" / "b1")
    gone = cli()
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout.splitlines() == ["nothing to materialize: no complete batch is waiting to be filtered"]


def test_a_batch_retired_before_it_was_filtered_is_left_alone_unless_named(cli, data_root):
    write_batch(data_root, "b1", [task("a")], [attempt("a")])
    write_batch(data_root, "b2", [task("b")], [attempt("b")])
    (data_root / "retired.json").write_text('[{"run_id": "b1", "reason": "bad build"}]')
    done = cli()  # (as the sensor leaves it: neither judged, nor paid for, nor walked)
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()[:1]] == ["b2"]
    assert not (data_root / "warehouse" / "judge_verdicts" / "b1.parquet").exists()
    named = cli("b1")
    assert named.returncode == 0 and kept(data_root) == ["a", "b"]
