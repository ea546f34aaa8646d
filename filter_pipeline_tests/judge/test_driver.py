"""The per-batch driver of the LLM judge, against a real HTTP server on 127.0.0.1: lazy prompts, identical
prompts asked once, resume from saved progress, evidence, cost, a refusing endpoint, a batch with nothing
to judge."""

import json
import logging
import threading
import time

import dagster as dg
import pandas as pd
import pytest
from upath import UPath

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge import client as llm_judge
from filter_pipeline.judge import driver
from filter_pipeline.judge import prompt as judge_prompt
from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.judge.resource import judge_from_env
from filter_pipeline.rules import filtering, report
from filter_pipeline.storage.parquet import write_parquet
from filter_pipeline_tests.builders import Pipeline, attempt, parse, rows, task, write_batch
from filter_pipeline_tests.judge.test_resource import llm, verdict_metadata
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply

PASS = '{"criteria": [{"criterion": "final state", "met": true}], "reasoning": "cart shows it", "passed": true, "why": "done"}'


def completion(content: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> str:
    """A chat completion body whose usage reports cached prompt tokens (as OpenAI and vLLM do)."""
    return json.dumps({
        "id": "c", "object": "chat.completion", "model": "judge-test",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
    })  # fmt: skip


def progress_rows(data_root, run_id: str = "r1") -> int:
    folder = data_root / "warehouse" / "_judge_progress" / run_id
    return sum(len(pd.read_parquet(part)) for part in folder.glob("*.parquet")) if folder.exists() else 0


def warnings(instance: dg.DagsterInstance, result) -> list[str]:
    return [e.user_message for e in instance.all_logs(result.run_id) if e.level == logging.WARNING]


def judge_batch(data_root, judge, run_id: str = "r1", previous=None, log=None, progress=None):
    """The judge resource on a written batch, as the judge_verdicts asset calls it (without Dagster's run)."""
    from filter_pipeline.storage.runs import read_batch

    batch = read_batch(UPath(data_root) / "runs" / run_id, run_id)
    return judge.judge(
        filtering.attempts_to_judge(batch.tasks, batch.attempts), UPath(data_root),
        record_steps=driver.RecordSteps(UPath(data_root) / "runs" / run_id), previous=previous,
        log=log or logging.getLogger("test"), progress=progress,
    )  # fmt: skip


# --- evidence ---------------------------------------------------------------------------------------


def test_missing_or_broken_trajectory_json_is_recorded_on_the_verdict_counted_and_warned(data_root, caplog):
    write_batch(data_root, "r1", [task("a"), task("b"), task("c")], [attempt("a"), attempt("b"), attempt("c")])
    (data_root / "runs/r/traj/a/1").mkdir(parents=True)
    (data_root / "runs/r/traj/a/1/trajectory.json").write_text(
        json.dumps({"steps": [], "final": {"url": "u", "observation": "o"}})
    )
    (data_root / "runs/r/traj/c/1").mkdir(parents=True)
    (data_root / "runs/r/traj/c/1/trajectory.json").write_text("{truncated")  # b has none at all
    with FakeOpenAI() as server, caplog.at_level(logging.WARNING):
        judgement = judge_batch(data_root, llm(server, votes=1))
    evidence = rows(judgement.verdicts, "task_id", "evidence")
    assert evidence[:2] == [["a", "trajectory"], ["b", "record_steps: trajectory.json missing"]]
    assert evidence[2][1].startswith("record_steps: trajectory.json not JSON (")
    assert judgement.metadata["evidence_missing"] == 2
    assert "| record_steps: trajectory.json not JSON | 1 |" in judgement.metadata["evidence"].value
    [warning] = [r.getMessage() for r in caplog.records if "trajectory.json" in r.getMessage()]
    assert "2 of 3 attempts" in warning and "runs/r/traj/b/1 (trajectory.json missing)" in warning
    assert report.judge_cost(judgement.verdicts, 3, 3)["evidence_missing"] == 2


def test_an_action_with_a_lone_surrogate_reaches_the_judge_as_a_replacement_character(data_root):
    steps = [{"action": "type", "text": "cut \ud83d"}]  # page text cut mid-emoji, as JavaScript escapes it
    write_batch(data_root, "r1", [task("a")], [attempt("a") | {"steps": steps}])  # no trajectory.json
    with FakeOpenAI() as server:
        judgement = judge_batch(data_root, llm(server, votes=1))
    assert rows(judgement.verdicts, "task_id", "status", "evidence") == [
        ["a", "judged", "record_steps: trajectory.json missing"]
    ]
    [call] = server.calls
    # sent as text a strict server takes: the half emoji as U+FFFD, not as the escape of a lone surrogate
    assert '"text": "cut \ufffd"' in call.prompt and "\\ud83d" not in json.dumps(call.body)


def test_an_integer_too_long_for_python_in_a_step_reaches_the_judge_as_its_digits(data_root):
    """Whether the steps come from the record (a) or from trajectory.json (b): the judge sees every step."""
    digits = "1" + "0" * 5000  # more than Python converts to an int
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    records = data_root / "runs" / "r1" / "executions.jsonl"
    records.write_text(records.read_text().replace('{"action": "click"}', f'{{"action": "scroll", "by": {digits}}}', 1))
    folder = data_root / "runs/r/traj/b/1"
    folder.mkdir(parents=True)
    (folder / "trajectory.json").write_text(f'{{"steps": [{{"action": "scroll", "by": -{digits}}}], "final": {{}}}}')
    with FakeOpenAI() as server:
        judgement = judge_batch(data_root, llm(server, votes=1))
    assert rows(judgement.verdicts, "task_id", "status", "evidence") == [
        ["a", "judged", "record_steps: trajectory.json missing"],
        ["b", "judged", "trajectory"],
    ]
    prompts = {("do a" in call.prompt): call.prompt for call in server.calls}
    assert '1. {"action": "scroll", "by": "10000' in prompts[True]
    assert '1. {"action": "scroll", "by": "-10000' in prompts[False]


def test_progress_counts_tasks_left_unjudged_apart_and_the_endpoints_trouble_is_warned(data_root, caplog):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])

    def responder(call, n):
        return Reply(status=503, body='{"error": "overloaded"}') if "do b" in call.prompt else Reply()

    with FakeOpenAI(responder) as server, caplog.at_level(logging.INFO):
        judge_batch(data_root, llm(server, votes=1, task_budget_seconds=0.5))
    lines = [r.getMessage() for r in caplog.records]
    assert "2/2 tasks done (asked 2, of them unjudged 1; reused 0, deduplicated 0)" in lines
    # (whether the endpoint is then also taken for down depends on whether a's answer came after b's first
    # request started: that line is not what this test checks)
    [trouble] = [line for line in lines if line.startswith("the judge endpoint") and "retrying" in line]
    assert f"{server.base_url}/chat/completions: HTTP 503 from the judge endpoint: overloaded; retrying" in trouble


def test_the_gate_reads_no_evidence(data_root):
    from filter_pipeline.judge.resource import JudgeResource

    write_batch(data_root, "r1", [task("a")], [attempt("a")])
    v = judge_batch(data_root, JudgeResource(kind="gate")).verdicts
    assert v["evidence"].isna().all() and v["requests"].tolist() == [0]


# --- asking -----------------------------------------------------------------------------------------


def test_prompts_are_built_as_request_slots_free_up(tmp_path):
    """Never more than 2 x concurrency prompts built and not yet answered: checked when each prompt is built
    against the requests the server has received (an answer needs its request first)."""
    n, concurrency = 120, 3
    batch = parse(tmp_path, [task(str(i)) for i in range(n)], [attempt(str(i)) for i in range(n)], run_id="r1")
    requests = filtering.attempts_to_judge(batch.tasks, batch.attempts)
    built, excess, lock = [0], [], threading.Lock()

    with FakeOpenAI(lambda call, k: Reply(content=PASS, delay=0.002)) as server:

        def counting_build(*args):
            with lock:
                built[0] += 1
                if built[0] > len(server.calls) + 2 * concurrency:
                    excess.append((built[0], len(server.calls)))
            return judge_prompt.messages_for_attempt(*args)

        config = LLMJudgeConfig(base_url=server.base_url, model="judge-test", votes=1, concurrency=concurrency)
        job = driver.DriveJob(
            requests=requests, config=config, data_root=UPath(tmp_path), record_steps=lambda line: [],
            reusable=driver.reusable_verdicts(None, None)[0], client_factory=lambda: llm_judge.JudgeClient(config),
            build=counting_build,
        )  # fmt: skip
        result = driver.drive(job)
    assert built[0] == n and len(server.calls) == n
    assert excess == []
    assert 0 < result.stats.peak_outstanding <= 2 * concurrency
    assert result.frame["status"].tolist() == ["judged"] * n


def test_identical_prompts_are_asked_once_and_the_verdict_copied(data_root):
    same = dict(instruction="Add the blue mug", key=["s", "#add", "mug"])
    tasks = [task("a", **same), task("b", **same), task("c"), task("d", **same)]
    write_batch(data_root, "r1", tasks, [attempt(t["task_id"]) for t in tasks])  # no trajectories: same steps
    with FakeOpenAI(lambda call, n: Reply(body=completion(PASS, 1000, 50, 0))) as server:
        judgement = judge_batch(data_root, llm(server, votes=1))
        assert len(server.calls) == 2
    v = judgement.verdicts
    assert rows(v, "task_id", "passed", "deduplicated", "requests", "prompt_tokens") == [
        ["a", True, False, 1, 1000], ["b", True, True, 0, 0], ["c", True, False, 1, 1000], ["d", True, True, 0, 0],
    ]  # fmt: skip
    assert v["cache_key"][0] == v["cache_key"][1] == v["cache_key"][3] != v["cache_key"][2]
    meta = judgement.metadata
    assert (meta["deduplicated"], meta["requests"], meta["prompt_tokens"]) == (2, 2, 2000)
    with FakeOpenAI() as again:  # materialized again: every verdict reused, each cost still counted once
        reused = judge_batch(data_root, llm(again, votes=1), previous=v)
        assert again.calls == []
    assert rows(reused.verdicts, "task_id", "cached", "deduplicated", "requests", "prompt_tokens") == [
        ["a", True, False, 1, 1000], ["b", False, True, 0, 0], ["c", True, False, 1, 1000], ["d", False, True, 0, 0],
    ]  # fmt: skip


def test_tokens_and_cost_at_the_configured_price(data_root, monkeypatch):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    monkeypatch.setenv("FILTER_JUDGE_PRICE_PROMPT", "2")
    monkeypatch.setenv("FILTER_JUDGE_PRICE_COMPLETION", "10")
    monkeypatch.setenv("FILTER_JUDGE_PRICE_CACHED", "0.5")
    with FakeOpenAI(lambda call, n: Reply(body=completion(PASS, 1000, 50, 400))) as server:
        monkeypatch.setenv("FILTER_JUDGE_BASE_URL", server.base_url)
        monkeypatch.setenv("FILTER_JUDGE_MODEL", "judge-test")
        monkeypatch.setenv("FILTER_JUDGE_VOTES", "1")
        judgement = judge_batch(data_root, judge_from_env("llm", env_vars=False))
    per_task = (600 * 2 + 400 * 0.5 + 50 * 10) / 1e6
    v = judgement.verdicts
    assert rows(v, "requests", "prompt_tokens", "completion_tokens", "cached_tokens") == [[1, 1000, 50, 400]] * 2
    assert v["cost"].tolist() == pytest.approx([per_task] * 2)
    assert judgement.metadata["cost"] == pytest.approx(2 * per_task) and judgement.metadata["cached_tokens"] == 800
    cost = report.judge_cost(v, 2, 2)
    assert cost["cost"] == pytest.approx(2 * per_task) and cost["requests"] == 2 and cost["cached_tokens"] == 800


def test_the_report_tells_what_the_verdicts_cost():
    v = pd.DataFrame({"judge": ["llm"] * 3, "status": ["judged", "judged", "error"], "cached": [True, False, False],
                      "deduplicated": [False, False, False], "requests": [3, 1, 5], "prompt_tokens": [300, 100, 0],
                      "completion_tokens": [30, 10, 0], "cached_tokens": [0, 50, 0], "cost": [0.3, 0.1, 0.0],
                      "evidence": ["trajectory", "record_steps: trajectory.json missing", None]})  # fmt: skip
    cost = report.judge_cost(v, passed=1, judged=2)
    assert (cost["requests"], cost["cache_hits"], cost["unjudged"]) == (9, 1, 1)
    assert cost["cost"] == pytest.approx(0.4) and "requests_now" not in cost  # (a materialization's: its metadata)
    assert cost["evidence_missing"] == 1 and cost["judge_pass_rate"] == 0.5
    assert report.judge_cost(v.assign(cost=None), 1, 2)["cost"] is None  # not priced


def test_unpriced_cost_is_null_and_says_so():
    assert driver.Prices().cost(1000, 10, 0) is None
    assert driver.Prices(prompt=1.0).cost(1000, 0, 400) == pytest.approx(1000 / 1e6)  # cached at the prompt price


# --- resume -----------------------------------------------------------------------------------------


def test_a_run_stopped_half_way_asks_again_only_what_was_not_saved(pipeline):
    n, stop_after = 30, 12
    tasks = [task(str(i)) for i in range(n)]
    write_batch(pipeline.data_root, "r1", tasks, [attempt(str(i)) for i in range(n)])

    def refusing_after_k(call, k):  # the endpoint starts refusing half way: the step fails
        return Reply(content=PASS) if k < stop_after else Reply(status=401, body='{"error": "key revoked"}')

    with FakeOpenAI(refusing_after_k) as server:
        job = pipeline.job(llm(server, votes=1, concurrency=2, save_every_verdicts=5))
        failed = job.execute_in_process(instance=pipeline.instance, partition_key="r1", raise_on_error=False)
    assert not failed.success
    [failure] = [e for e in failed.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    line = failure.step_failure_data.user_failure_data.description  # what the CLI shows of a failed step
    assert "401" in line and server.base_url in line and "\n" not in line
    saved = progress_rows(pipeline.data_root)
    assert stop_after - 2 * 2 <= saved <= stop_after  # the answers in flight when it refused may be lost

    with FakeOpenAI(lambda call, k: Reply(content=PASS)) as healthy:
        resumed = pipeline.run(llm(healthy, votes=1, concurrency=2, save_every_verdicts=5))
        assert len(healthy.calls) == n - saved
    meta = verdict_metadata(resumed)
    assert (meta["resumed_from_progress"], meta["requests"]) == (saved, n - saved)
    assert pipeline.output("judge_verdicts")["status"].tolist() == ["judged"] * n
    assert progress_rows(pipeline.data_root) == 0  # judge_verdicts holds them now: the parts are gone


def test_verdicts_of_the_previous_prompt_version_are_not_reused(data_root):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    with FakeOpenAI() as server:
        v1 = judge_batch(data_root, llm(server, votes=1, prompt_version="v1")).verdicts
        same = judge_batch(data_root, llm(server, votes=1, prompt_version="v1"), previous=v1).verdicts
        assert len(server.calls) == 2 and same["cached"].tolist() == [True, True]
        v2 = judge_batch(data_root, llm(server, votes=1), previous=v1)  # v3, the default
        assert len(server.calls) == 4
    assert v2.metadata["cache_hits"] == 0
    assert v2.verdicts["prompt_version"].tolist() == ["v3", "v3"]


# --- edges ------------------------------------------------------------------------------------------


def test_a_batch_without_any_ok_attempt_gives_zero_verdicts_and_succeeds(pipeline):
    write_batch(pipeline.data_root, "r1", [task("a"), task("b")],
                [attempt("a", ok=False, error="assertion failed: x"), attempt("b", ok=False)])  # fmt: skip
    with FakeOpenAI() as server:
        result = pipeline.run(llm(server))
        assert server.calls == []
    assert len(pipeline.output("judge_verdicts")) == 0
    assert verdict_metadata(result)["requests"] == 0
    assert pipeline.output("failure_pool")["stage"].tolist() == ["execute", "execute"]


class Judging(Pipeline):
    """judge_job alone (parse, judge, failure pool): the steps these tests look at."""

    def job(self, judge):
        if "r1" not in self.instance.get_dynamic_partitions("run_id"):
            self.instance.add_dynamic_partitions("run_id", ["r1"])
        return build_defs(str(self.data_root), judge, caps={}).resolve_job_def("judge_job")

    def run(self, judge, run_id: str = "r1") -> dg.ExecuteInProcessResult:
        result = self.job(judge).execute_in_process(instance=self.instance, partition_key=run_id)
        assert result.success
        return result


@pytest.fixture
def pipeline(data_root):
    with dg.DagsterInstance.ephemeral() as instance:
        yield Judging(data_root, instance)


@pytest.mark.slow
def test_a_killed_run_asks_again_only_what_was_not_saved():
    """A real SIGKILL of the judging process once half the verdicts are saved (benchmarks/judge_memory)."""
    import subprocess
    import sys

    from filter_pipeline_tests.conftest import REPO

    done = subprocess.run([sys.executable, "-m", "benchmarks.judge_memory", "--tasks", "--kill-at", "1200"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("rework:"))
    saved = int(line.split(" verdicts saved")[0].rsplit(" ", 1)[1])
    again = int(line.split("the resumed run made ")[1].split(" ")[0])
    assert 600 <= saved < 1200 and again == 1200 - saved, line


def test_verdicts_saved_before_judge_passed_existed_are_reused_with_their_passed_as_the_models_verdict():
    older = pd.DataFrame(
        {"cache_key": ["k1", "k2"], "passed": [True, False], "why": ["ok", "no"], "status": ["judged", "judged"]}
    )
    newer = pd.DataFrame(
        {"cache_key": ["k3"], "passed": [False], "judge_passed": [True], "why": ["ok"], "status": ["judged"]}
    )
    reusable, from_progress = driver.reusable_verdicts(older, newer)
    got = reusable.set_index("cache_key")["judge_passed"].to_dict()
    assert got == {"k1": True, "k2": False, "k3": True} and from_progress == 1
    # passed is derived again: k3's model passed it, and no minimum score is set now
    assert driver.passes(reusable.assign(score=[None, None, 2]), None).tolist() == [True, False, True]
    assert driver.passes(reusable.assign(score=[None, None, 2]), 3).tolist() == [True, False, False]


def test_verdicts_are_saved_on_time_while_the_endpoint_keeps_the_rest_waiting(data_root):
    # a answered at once, b after 3 s: a is saved after save_every_seconds, not when b's answer comes
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    saved_at, started = [], time.monotonic()

    def write(table, path):
        saved_at.append((time.monotonic() - started, table.num_rows))
        write_parquet(table, path)

    progress = driver.ProgressStore(UPath(data_root) / "warehouse" / "_judge_progress" / "r1", write=write)
    slow_b = lambda call, k: Reply(content=PASS, delay=3.0 if "do b" in json.dumps(call.body) else 0)  # noqa: E731
    with FakeOpenAI(slow_b) as server:
        judge = llm(server, votes=1, concurrency=2, save_every_verdicts=100, save_every_seconds=1)
        judge_batch(data_root, judge, progress=progress)
    assert saved_at[0][0] < 2.5 and saved_at[0][1] == 1  # a alone, while b was still waiting
    assert sum(rows for _, rows in saved_at) == 2


def test_the_earlier_spend_a_verdict_carries_is_its_own_unjudged_rows_in_its_own_run():
    from filter_pipeline.judge.driver import earlier_spend

    previous = pd.DataFrame({"run_id": ["r1", "r2", "r1", "r1"], "task_id": ["a", "a", "b", "c"], "attempt": [1, 1, 1, 1],
                             "cache_key": ["k", "k", "k2", "k3"], "status": ["error", "error", "judged", "error"],
                             "calls": [2, 7, 1, 3], "prompt_tokens": [10, 70, 5, None]})  # fmt: skip
    requests = pd.DataFrame(
        {"run_id": ["r1", "r1", "r1", "r1"], "task_id": ["a", "b", "c", "d"], "attempt": [1, 1, 1, 1]}
    )
    keys = pd.Series(["k", "k2", "other prompt", "k"])
    spent = earlier_spend(previous, requests, keys)
    # a: r1's unjudged row (not r2's), its requests from a file written before they were named so; b was judged,
    # c asked with another prompt, d never tried
    assert spent[["requests", "prompt_tokens"]].values.tolist() == [[2, 10], [0, 0], [0, 0], [0, 0]]
    assert earlier_spend(None, requests, keys).to_numpy().sum() == 0


def test_a_try_left_unjudged_by_a_materialization_that_did_not_finish_is_carried_by_the_row_that_replaces_it(
    data_root,
):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    progress = driver.ProgressStore(UPath(data_root) / "warehouse" / "_judge_progress" / "r1", write=write_parquet)
    down_for_b = lambda call, n: Reply(status=503, body="{}") if "do b" in call.prompt else Reply(content=PASS)  # noqa: E731
    with FakeOpenAI(down_for_b) as server:
        first = judge_batch(data_root, llm(server, votes=1, task_budget_seconds=0.5), progress=progress).verdicts
    # (its verdicts never written: as if it was stopped here; b's row says what its tries cost, one the budget cut
    # included, which the server may not have seen)
    tried = first.set_index("task_id").loc["b", "requests"]
    assert first.set_index("task_id").loc["b", "status"] == "error" and tried >= 1 and progress_rows(data_root) == 2
    with FakeOpenAI(lambda call, n: Reply(content=PASS)) as healthy:
        again = judge_batch(data_root, llm(healthy, votes=1), progress=progress).verdicts.set_index("task_id")
        assert len(healthy.calls) == 1  # b alone: a's verdict was saved
    assert again.loc["b", "status"] == "judged" and again.loc["b", "requests"] == tried + 1
    assert again.loc["a", "cached"] and again.loc["a", "requests"] == 1


def test_a_kill_between_writing_judge_verdicts_and_removing_its_parts_does_not_count_their_tries_twice(
    pipeline, monkeypatch
):
    write_batch(pipeline.data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b")])
    down_for_b = lambda call, n: Reply(status=503, body="{}") if "do b" in call.prompt else Reply(content=PASS)  # noqa: E731
    with FakeOpenAI(down_for_b) as server, monkeypatch.context() as killed:
        killed.setattr(driver.ProgressStore, "remove", lambda self: 0)  # (killed once judge_verdicts is written)
        pipeline.run(llm(server, votes=1, task_budget_seconds=0.5))
    first = pipeline.output("judge_verdicts").set_index("task_id")
    tried = first.loc["b", "requests"]  # (what its row says b's tries cost: a try cut by the budget included)
    assert first.loc["b", "status"] == "error" and tried >= 1
    assert progress_rows(pipeline.data_root) == 2  # left behind: a's verdict and b's tries, both in the file too
    with FakeOpenAI(lambda call, n: Reply(content=PASS)) as healthy:
        pipeline.run(llm(healthy, votes=1))
        assert len(healthy.calls) == 1
    again = pipeline.output("judge_verdicts").set_index("task_id")
    assert again.loc["b", "status"] == "judged" and again.loc["b", "requests"] == tried + 1  # each try once
    assert again.loc["a", "requests"] == 1 and progress_rows(pipeline.data_root) == 0


def test_the_earlier_spend_of_saved_progress_goes_to_the_first_request_asking_its_prompt():
    from filter_pipeline.judge.driver import earlier_spend

    progress = pd.DataFrame({"cache_key": ["k", "k", "k2"], "status": ["error", "error", "judged"],
                             "requests": [2, 3, 1], "prompt_tokens": [10, 30, 5]})  # fmt: skip
    requests = pd.DataFrame({"run_id": ["r1"] * 3, "task_id": ["a", "b", "c"], "attempt": [1, 1, 1]})
    spent = earlier_spend(None, requests, pd.Series(["k2", "k", "k"]), progress)
    # b asks k (two tries of an earlier materialization), c is its copy; k2 was judged: reused, not carried
    assert spent[["requests", "prompt_tokens"]].values.tolist() == [[0, 0], [5, 40], [0, 0]]


def test_record_steps_of_a_line_nested_deeper_than_json_follows_are_none_not_a_crash(tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    deep = '{"task_id": "a", "steps": [' + "[" * 5000 + "]" * 5000 + "]}\n"
    (run / "executions.jsonl").write_text(json.dumps({"task_id": "b", "steps": [{"action": "x"}]}) + "\n" + deep)
    steps = driver.RecordSteps(UPath(str(run)))
    assert (steps(1), steps(2)) == ([{"action": "x"}], [])
