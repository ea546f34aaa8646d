"""Asking the judge model, against a real HTTP server on 127.0.0.1 speaking the wire shapes of real servers:
requests per task, n, structured output, repairs, reasoning replies, retry hints, faults, refusals."""

import asyncio
import dataclasses
import json
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from filter_pipeline.judge.client import (
    RAW_REPLY_MAX_CHARS,
    REPAIR_PROMPT,
    EndpointRefused,
    JudgeClient,
    RateController,
    Vote,
    judge_prompts,
    majority,
)  # fmt: skip
from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.judge.rate import TaskBudget, Unanswered
from filter_pipeline.judge.transport import Transport
from filter_pipeline.judge.transport import _Fault as Fault
from filter_pipeline.rules.schemas import REASONING_MAX_CHARS
from filter_pipeline_tests.openai_server import FakeOpenAI, RateLimit, Reply, error_body

PASS = '{"passed": true, "why": "done"}'
FAIL = '{"passed": false, "why": "wrong item"}'
PROSE = "I believe the agent did it."


def settings(server, **kw) -> LLMJudgeConfig:
    defaults = dict(base_url=server.base_url, model="judge-test", backoff_initial_seconds=0.01,
                    backoff_max_seconds=0.05, task_budget_seconds=5.0)  # fmt: skip
    return LLMJudgeConfig(**{**defaults, **kw})


def prompt(name: str) -> list[dict]:
    return [{"role": "system", "content": "judge"}, {"role": "user", "content": f"task {name}"}]


def sequence(*replies: Reply):
    """A responder answering the calls in turn, the last reply from then on."""
    return lambda call, n: replies[min(n, len(replies) - 1)]


# --- cost: one request per task ---------------------------------------------------------------------


def test_at_the_defaults_a_task_costs_one_request_asking_for_structured_output():
    with FakeOpenAI(
        lambda call, n: Reply(content=PASS, prompt_tokens=120, completion_tokens=7, cached_tokens=100)
    ) as server:
        result = judge_prompts([prompt(str(i)) for i in range(5)], settings(server))
    assert len(server.calls) == 5
    assert [(v.passed, v.votes, v.status, v.requests) for v in result] == [(True, "1/1", "judged", 1)] * 5
    assert (result[0].prompt_tokens, result[0].completion_tokens, result[0].cached_tokens) == (120, 7, 100)
    body = server.calls[0].body
    assert (body["temperature"], body["max_tokens"], "n" in body) == (0.0, 800, False)
    assert body["response_format"]["type"] == "json_schema"
    schema = body["response_format"]["json_schema"]
    assert schema["strict"] is True and schema["schema"]["properties"]["passed"] == {"type": "boolean"}


def test_usage_without_cached_tokens_counts_zero():
    with FakeOpenAI(lambda call, n: Reply(content=PASS)) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.prompt_tokens, v.completion_tokens, v.cached_tokens) == (100, 10, 0)


def test_several_votes_at_temperature_0_are_refused_before_any_request(monkeypatch):
    for name in ("FILTER_JUDGE_VOTES", "FILTER_JUDGE_TEMPERATURE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="^judge votes=3 at temperature=0.0: identical samples"):
        JudgeClient(LLMJudgeConfig(base_url="http://x", model="m", votes=3))
    monkeypatch.setenv("FILTER_JUDGE_VOTES", "3")  # (where the value came from, when it came from there)
    with pytest.raises(ValueError, match=r"^judge votes=3 \(FILTER_JUDGE_VOTES\) at temperature=0.0: identical"):
        JudgeClient(LLMJudgeConfig(base_url="http://x", model="m", votes=3))
    assert JudgeClient(LLMJudgeConfig(base_url="http://x", model="m", votes=3, temperature=0.7)).config.votes == 3


def test_votes_are_n_samples_of_one_request_when_the_server_honours_n():
    with FakeOpenAI(lambda call, n: Reply(choices=[PASS, FAIL, PASS])) as server:
        [v] = judge_prompts([prompt("a")], settings(server, votes=3, temperature=0.7))
    assert (v.passed, v.votes, v.requests) == (True, "2/3", 1)
    assert len(server.calls) == 1 and server.calls[0].body["n"] == 3
    assert json.loads(v.raw_replies) == [PASS, FAIL, PASS]


def test_a_server_ignoring_n_gets_the_missing_votes_as_separate_requests_then_no_n():
    answers = iter([FAIL, FAIL, PASS, FAIL, FAIL, FAIL])
    lock = threading.Lock()

    def responder(call, n):
        with lock:
            return Reply(content=next(answers))

    with FakeOpenAI(responder, n="ignore") as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=1)
        first, second = judge_prompts([prompt("a"), prompt("b")], s)
    assert (first.requests, second.requests) == (3, 3)
    assert [c.body.get("n") for c in server.calls] == [3, None, None, None, None, None]
    assert {first.votes, second.votes} == {"1/3", "0/3"} and first.passed is second.passed is False


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_gateways_5xx_to_the_first_request_asking_n_is_retried_and_n_kept(status):
    first = Reply(status=status, body=error_body("upstream timed out", "server_error"))
    with FakeOpenAI(sequence(first, Reply(choices=[PASS, PASS, PASS]))) as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=1)
        first_task, second_task = judge_prompts([prompt("a"), prompt("b")], s)
    assert [c.body.get("n") for c in server.calls] == [3, 3, 3]
    assert (first_task.requests, second_task.requests, second_task.votes) == (2, 1, "3/3")


@pytest.mark.parametrize("mode", ["reject400", "reject500"])  # reject500: llama.cpp's server
def test_a_server_rejecting_n_gets_separate_requests_for_the_clients_lifetime(mode):
    with FakeOpenAI(lambda call, n: Reply(content=PASS), n=mode) as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=1)
        first, second = judge_prompts([prompt("a"), prompt("b")], s)
    assert [c.body.get("n") for c in server.calls] == [3] + [None] * 6
    assert (first.votes, first.status, first.requests, second.requests) == ("3/3", "judged", 4, 3)


@pytest.mark.parametrize(
    "order, n_sent, requests",
    [
        # n known to work: the 400 is the prompt's own (asked once more without the schema, as any 400 is)
        (["a", "long", "b"], [3, 3, 3, 3], [1, 2, 1]),
        # n not known yet: asked without n, then without the schema, each still a 400; n stays on
        (["long", "a", "b"], [3, None, None, 3, 3], [3, 1, 1]),
    ],
)
def test_a_400_of_one_prompt_alone_does_not_turn_n_off_for_the_others(order, n_sent, requests):
    too_long = Reply(status=400, body=error_body("This model's maximum context length is 8192 tokens."))
    with FakeOpenAI(
        lambda call, n: too_long if "task long" in json.dumps(call.body) else Reply(content=PASS)
    ) as server:
        result = judge_prompts(
            [prompt(name) for name in order], settings(server, votes=3, temperature=0.7, concurrency=1)
        )
    assert [c.body.get("n") for c in server.calls] == n_sent
    assert [v.requests for v in result] == requests
    assert [v.status for v in result] == ["error" if name == "long" else "judged" for name in order]
    assert "maximum context length" in result[order.index("long")].why


def test_a_rejected_response_format_is_dropped_for_the_clients_lifetime():
    with FakeOpenAI(lambda call, n: Reply(content=PASS), response_format="reject") as server:
        result = judge_prompts([prompt("a"), prompt("b")], settings(server, concurrency=1))
    assert ["response_format" in c.body for c in server.calls] == [True, False, False]
    assert [v.status for v in result] == ["judged", "judged"]
    assert [c.status for c in server.calls] == [400, 200, 200]


def test_a_400_that_goes_away_without_the_schema_drops_it_and_other_400s_are_task_errors():
    def responder(call, n):
        if "response_format" in call.body:
            return Reply(status=400, body=error_body("Invalid request"))
        if "too long" in call.prompt:
            return Reply(status=400, body=error_body("This model's maximum context length is 8192 tokens"))
        return Reply(content=PASS)

    with FakeOpenAI(responder) as server:
        ok, long = judge_prompts([prompt("a"), prompt("too long")], settings(server, concurrency=1))
    assert ok.status == "judged" and ["response_format" in c.body for c in server.calls] == [True, False, False]
    assert (
        long.status == "error"
        and long.requests == 1
        and "HTTP 400" in long.why
        and "maximum context length" in long.why
    )


# --- unparseable and cut-off replies ----------------------------------------------------------------


def test_an_unparseable_reply_is_repaired_by_a_different_request_never_resent():
    with FakeOpenAI(sequence(Reply(content=PROSE), Reply(content=PASS))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.status, v.requests) == (True, "judged", 2)
    first, repair = (c.body for c in server.calls)
    assert repair["messages"] == [
        *first["messages"],
        {"role": "assistant", "content": PROSE},
        {"role": "user", "content": REPAIR_PROMPT},
    ]
    assert json.loads(v.raw_replies) == [PROSE, PASS]


def test_a_repair_without_a_verdict_leaves_the_task_unjudged_after_two_requests():
    with FakeOpenAI(lambda call, n: Reply(content=PROSE)) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.status, v.votes, len(server.calls)) == (None, "error", None, 2)
    assert 'no JSON object with a boolean "passed"' in v.why


def completion_body(message: dict, finish_reason: str = "stop") -> str:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", **message},
                                    "finish_reason": finish_reason}], "usage": {"prompt_tokens": 5}})  # fmt: skip


@pytest.mark.parametrize(
    "message, finish_reason, why",
    [
        ({"content": None, "refusal": "I can't help with that request."}, "stop",
         "the judge model refused to answer: I can't help with that request."),
        ({"content": ""}, "content_filter", "the judge model refused to answer (finish_reason content_filter)"),
    ],
    ids=["refusal", "content-filter"],
)  # fmt: skip
def test_a_refusal_is_unjudged_with_its_reason_and_not_repaired(message, finish_reason, why):
    with FakeOpenAI(lambda call, n: Reply(body=completion_body(message, finish_reason))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.why, v.requests, len(server.calls)) == ("error", why, 1, 1)


def test_a_verdict_beside_a_refusal_field_counts():
    message = {"content": PASS, "refusal": "partly"}
    with FakeOpenAI(lambda call, n: Reply(body=completion_body(message))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.passed, v.requests) == ("judged", True, 1)


def test_reasoning_replies_decoy_verdicts_and_reasoning_fields_are_ignored():
    decoy = '<think>The format is {"passed": true, "why": "x"}. The order page is missing.</think>\n' + FAIL
    replies = {
        "think": Reply(content=decoy),
        "field": Reply(content=FAIL, reasoning_content=PASS),
        "only-field": Reply(content=None, reasoning_content=PASS),
    }

    def responder(call, n):
        name = call.text(1).split()[-1]
        return replies[name] if len(call.body["messages"]) == 2 else Reply(content=FAIL)

    with FakeOpenAI(responder) as server:
        think, field, only = judge_prompts([prompt("think"), prompt("field"), prompt("only-field")], settings(server))
    assert (think.passed, think.requests, field.passed, field.requests) == (False, 1, False, 1)
    assert (only.passed, only.requests) == (False, 2)  # the reasoning field is not an answer: repaired
    [repair] = [c for c in server.calls if len(c.body["messages"]) > 2]
    assert repair.text(1) == "task only-field" and repair.prompt == REPAIR_PROMPT


def test_a_reply_cut_off_at_the_token_limit():
    cut = Reply(content='{"reasoning": "the page shows', finish_reason="length")
    whole = Reply(content='{"reasoning": "r", "passed": true, "why": "kept"}', finish_reason="length")
    with FakeOpenAI(sequence(cut, Reply(content=FAIL))) as server:
        [repaired] = judge_prompts([prompt("a")], settings(server))
    assert (repaired.passed, repaired.requests) == (False, 2)
    assert [c.body["max_tokens"] for c in server.calls] == [800, 1600]  # the repair gets twice the allowance
    with FakeOpenAI(lambda call, n: whole) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.requests) == (True, 1)  # cut after a whole verdict object: it stands
    with FakeOpenAI(lambda call, n: cut) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.requests) == ("error", 2) and "cut off at the token limit" in v.why


def test_reasoning_model_settings_send_max_completion_tokens_and_no_temperature():
    with FakeOpenAI(lambda call, n: Reply(content=PASS)) as server:
        judge_prompts([prompt("a")], settings(server, reasoning_model=True, max_tokens=2000))
        judge_prompts([prompt("b")], settings(server, max_tokens=0))
    reasoning, unlimited = (c.body for c in server.calls)
    assert (
        reasoning["max_completion_tokens"] == 2000 and "temperature" not in reasoning and "max_tokens" not in reasoning
    )
    assert (
        "max_tokens" not in unlimited and "max_completion_tokens" not in unlimited and unlimited["temperature"] == 0.0
    )


# --- limits and faults ------------------------------------------------------------------------------

SOON = object()  # an HTTP-date two seconds ahead (the format has whole seconds)


@pytest.mark.parametrize(
    "headers, at_least",
    [
        ({"Retry-After": "0.6"}, 0.55),
        ({"Retry-After": SOON}, 0.9),
        ({"retry-after-ms": "600"}, 0.55),
        ({"x-ratelimit-reset-requests": "0.6s"}, 0.55),
        ({"llm_provider-retry-after": "0.6"}, 0.55),
    ],
    ids=["seconds", "http-date", "ms", "x-ratelimit-reset", "litellm"],
)
def test_a_429_is_retried_after_the_time_its_headers_say(headers, at_least):
    def responder(call, n):
        if n == 0:
            when = format_datetime(datetime.now(UTC) + timedelta(seconds=2), usegmt=True)
            return Reply(
                status=429,
                headers={k: when if v is SOON else v for k, v in headers.items()},
                body=error_body("slow down"),
            )
        return Reply(content=PASS)

    with FakeOpenAI(responder) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.requests) == ("judged", 2)
    assert server.calls[1].at - server.calls[0].at >= at_least


def test_a_retry_hint_pauses_every_request_not_only_its_own():
    def responder(call, n):
        if n == 0:
            return Reply(status=429, headers={"Retry-After": "0.5"}, body=error_body("slow down"))
        return Reply(content=PASS, delay=0.05)

    with FakeOpenAI(responder) as server:
        result = judge_prompts([prompt(str(i)) for i in range(12)], settings(server, concurrency=4))
    assert all(v.status == "judged" for v in result)
    first = server.calls[0].at
    later = [c.at - first for c in server.calls[4:]]  # calls 1-3 were already in flight
    assert len(later) == 9 and min(later) >= 0.45


@pytest.mark.parametrize("status", [408, 409, 500, 502, 503])
def test_transient_statuses_are_retried(status):
    with FakeOpenAI(
        sequence(Reply(status=status, body="{}"), Reply(status=status, body="{}"), Reply(content=PASS))
    ) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.status, v.requests, len(server.calls)) == (True, "judged", 3, 3)


def test_garbage_bodies_are_retried_as_faults():
    deep = "[" * 100_000 + "]" * 100_000  # nested deeper than json follows
    garbage = [Reply(body="<html>502 Bad Gateway</html>"), Reply(body='{"choices": []}'), Reply(body="\xff\xfe"),
               Reply(body=deep)]  # fmt: skip
    with FakeOpenAI(sequence(*garbage, Reply(content=PASS))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.requests) == (True, 5)


@pytest.mark.parametrize(
    "headers",
    [{"Retry-After": "0"}, {"Retry-After": "PAST"}, {"retry-after-ms": "0"}, {"x-ratelimit-reset-requests": "1ms"}],
    ids=["zero", "http-date-past", "ms-zero", "reset-1ms"],
)
def test_a_hint_of_no_wait_is_waited_at_least_as_the_first_backoff(headers):
    past = format_datetime(datetime.now(UTC) - timedelta(seconds=5), usegmt=True)
    limited = Reply(status=429, headers={k: past if v == "PAST" else v for k, v in headers.items()}, body="{}")
    with FakeOpenAI(lambda call, n: limited) as server:
        [v] = judge_prompts([prompt("a")], settings(server, backoff_initial_seconds=0.1, task_budget_seconds=1.0))
    gaps = [b.at - a.at for a, b in zip(server.calls, server.calls[1:])]
    assert v.status == "error" and 2 <= v.requests <= 12 and min(gaps) >= 0.09, (v.requests, min(gaps))


def test_a_task_retried_past_a_thousand_times_backs_off_at_the_maximum_without_overflowing():
    # the doubling of the backoff is bounded: 2 ** tries overflows a float past tries 1024
    s = LLMJudgeConfig(base_url="http://127.0.0.1:9/v1", model="m", backoff_initial_seconds=0.5, backoff_max_seconds=8)
    task = TaskBudget(1.0)
    task.start(time.monotonic())
    with pytest.raises(Unanswered, match="boom"):  # a wait of 4 to 8 s passes the 1 s budget
        asyncio.run(Transport(s)._back_off(Fault("boom"), task, tries=5000))


def test_a_task_still_rate_limited_at_the_end_of_its_budget_is_unjudged_with_the_429s_body():
    limited = Reply(
        status=429, headers={"Retry-After": "0.2"}, body=error_body("You exceeded your current quota for org-7")
    )
    with FakeOpenAI(lambda call, n: limited) as server:
        start = time.perf_counter()
        [v] = judge_prompts([prompt("a")], settings(server, task_budget_seconds=1.0))
        elapsed = time.perf_counter() - start
    assert v.status == "error" and "HTTP 429" in v.why and "You exceeded your current quota for org-7" in v.why
    assert 2 <= v.requests <= 6 and 0.7 <= elapsed < 5.0  # a request every 0.2 s until the budget ends


def test_a_timed_out_request_is_retried():
    with FakeOpenAI(sequence(Reply(delay=1.5), Reply(content=PASS))) as server:
        [v] = judge_prompts([prompt("a")], settings(server, timeout_seconds=0.5))
    assert v.passed is True and v.requests == len(server.calls) >= 2


def test_a_body_cut_off_by_the_timeout_is_a_timeout_not_the_status_with_an_empty_body():
    slow_body = Reply(status=503, body=error_body("upstream down", "server_error"), body_delay=1.0)
    with FakeOpenAI(lambda call, n: slow_body) as server:
        [v] = judge_prompts([prompt("a")], settings(server, timeout_seconds=0.3, task_budget_seconds=1.0))
    assert v.status == "error" and v.requests == len(server.calls) >= 2
    assert "timeout" in v.why and "HTTP 503" not in v.why and "(empty body)" not in v.why, v.why


def test_a_request_cut_short_by_the_task_budget_reports_what_the_endpoint_said_before():
    down = Reply(status=503, body=error_body("upstream down", "server_error"))
    with FakeOpenAI(sequence(down, replace(down, body_delay=3.0))) as server:
        [v] = judge_prompts([prompt("a")], settings(server, timeout_seconds=10.0, task_budget_seconds=0.5))
    assert v.status == "error" and v.requests == 2
    assert v.why.startswith("HTTP 503 from the judge endpoint: upstream down; the task budget ran out"), v.why


def test_an_outage_leaves_tasks_unjudged_and_later_tasks_are_not_even_asked():
    async def run(s):
        async with JudgeClient(s) as client:
            first = await asyncio.gather(*(client.judge(prompt(str(i))) for i in range(2)))
            start = time.perf_counter()
            later = await asyncio.gather(*(client.judge(prompt(f"later {i}")) for i in range(20)))
            return first, later, time.perf_counter() - start

    with FakeOpenAI(lambda call, n: Reply(status=503, body=error_body("upstream down", "server_error"))) as server:
        first, later, seconds = asyncio.run(run(settings(server, concurrency=2, task_budget_seconds=1.0)))
    assert all(v.status == "error" and v.passed is None for v in first + later)
    assert all("HTTP 503 from the judge endpoint: upstream down" in v.why and v.requests >= 1 for v in first), first
    assert sum(v.requests for v in first) >= 3  # retried within their budgets
    assert all(
        v.requests == 0 and "not asked: the judge endpoint has given no answer it could use" in v.why for v in later
    )
    assert seconds < 0.5 and not any("later" in c.prompt for c in server.calls)  # (waiting would take the 1 s budget)


def test_endpoint_trouble_is_told_as_it_happens_once_not_per_retry_and_the_outage_when_declared():
    told: list[str] = []

    async def run(s):
        async with JudgeClient(s, report=told.append) as client:
            return await asyncio.gather(*(client.judge(prompt(str(i))) for i in range(3)))

    with FakeOpenAI(
        lambda call, n: Reply(status=503, body=error_body("upstream down sk-key", "server_error"))
    ) as server:
        verdicts = asyncio.run(run(settings(server, api_key="sk-key", concurrency=3, task_budget_seconds=0.5)))
    assert sum(v.requests for v in verdicts) > 3  # many retries, told once
    assert told == [
        f"the judge endpoint {server.base_url}/chat/completions: HTTP 503 from the judge endpoint: upstream down "
        "***; retrying (each task for up to 0.5 s, FILTER_JUDGE_TASK_BUDGET)",
        f"the judge endpoint {server.base_url}/chat/completions gave no answer it could use for a whole task budget (0.5 s): "
        "tasks not yet asked end unjudged (asked again the next time they are judged), but for one probe every 0.5 s",
    ]


def test_a_key_the_server_echoes_across_the_cut_of_its_message_is_redacted_whole():
    key = "sk-secret-key-0123456789"
    told: list[str] = []

    async def run(s):
        async with JudgeClient(s, report=told.append) as client:
            return await client.judge(prompt("a"))

    body = error_body("x" * 280 + f" bad key {key} and more")  # the 300-character cut falls inside the key
    with FakeOpenAI(lambda call, n: Reply(status=503, body=body)) as server:
        verdict = asyncio.run(run(settings(server, api_key=key, task_budget_seconds=0.3)))
    assert verdict.status == "error" and "bad key ***" in verdict.why
    assert not any("sk-secret" in text for text in [verdict.why, *told]), told


def test_a_pause_asked_past_every_tasks_budget_ends_each_task_unjudged_none_left_waiting():
    # the first request is told to wait an hour (a spent quota); the requests beside it succeed, and the tasks
    # queued for their slots, once woken, find the pause past their budget: each must pass its slot on
    def responder(call, n):
        if n == 0:
            return Reply(status=429, headers={"Retry-After": "3600"}, body=error_body("quota exceeded"))
        return Reply(content=PASS, delay=0.2)

    result = []
    with FakeOpenAI(responder) as server:
        s = settings(server, concurrency=4, task_budget_seconds=10)
        judging = threading.Thread(
            target=lambda: result.extend(judge_prompts([prompt(str(i)) for i in range(20)], s)), daemon=True
        )
        judging.start()
        judging.join(timeout=30)
    assert not judging.is_alive(), "tasks left waiting for a slot nobody gives"
    assert len(result) == 20 and sum(v.status == "judged" for v in result) == 3  # the three beside the first
    assert all("asked to wait" in v.why for v in result if v.status == "error")


def test_while_down_one_task_probes_now_and_then_and_its_success_ends_the_outage():
    healthy = threading.Event()
    down = Reply(status=503, body=error_body("upstream down", "server_error"))

    async def run(s):
        async with JudgeClient(s) as client:
            await client.judge(prompt("first"))  # spends its budget: the endpoint is down
            skipped = await client.judge(prompt("skipped"))
            healthy.set()
            await asyncio.sleep(0.45)  # the probe interval is the budget here
            probe = await client.judge(prompt("probe"))
            after = await asyncio.gather(*(client.judge(prompt(f"after {i}")) for i in range(3)))
            return skipped, probe, after

    with FakeOpenAI(lambda call, n: Reply(content=PASS) if healthy.is_set() else down) as server:
        skipped, probe, after = asyncio.run(run(settings(server, task_budget_seconds=0.4)))
    assert (skipped.requests, skipped.status) == (0, "error")
    assert (probe.requests, probe.status) == (1, "judged")
    assert [v.status for v in after] == ["judged"] * 3


def test_an_unreachable_endpoint_is_unjudged_not_a_crash():
    with FakeOpenAI() as server:
        url = server.base_url
    [v] = judge_prompts(
        [prompt("a")], LLMJudgeConfig(base_url=url, model="m", task_budget_seconds=0.3, backoff_initial_seconds=0.01)
    )
    assert v.status == "error" and v.requests >= 2
    # which host refused, and how: a mistyped port reads as one
    port = url.split(":")[-1].split("/")[0]
    assert "ClientConnectorError talking to the judge endpoint (Cannot connect to host 127.0.0.1:" + port in v.why


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status, message",
    [
        (401, "Incorrect API key provided: sk-test-SECRET"),
        (403, "forbidden"),
        (404, "The model `judge-test` does not exist or you do not have access to it."),
        (400, "Invalid model name passed in model=judge-test. Call `/v1/models` to view available models"),
    ],
)
def test_a_refusing_endpoint_stops_everything_within_ten_requests(status, message):
    with FakeOpenAI(lambda call, n: Reply(status=status, body=error_body(message))) as server:
        url = server.base_url.replace("http://", "http://user:pw-SECRET@")
        s = settings(server, base_url=url, api_key="sk-test-SECRET", concurrency=64)
        with pytest.raises(EndpointRefused) as refused:
            judge_prompts([prompt(str(i)) for i in range(60)], s)
    assert len(server.calls) <= 10
    text = str(refused.value)
    assert f"HTTP {status}" in text and server.base_url + "/chat/completions" in text
    assert "SECRET" not in text and "\n" not in text


def test_a_refusal_raises_from_every_waiting_judge_call():
    async def run(url):
        async with JudgeClient(LLMJudgeConfig(base_url=url, model="m", concurrency=8)) as client:
            return await asyncio.gather(*(client.judge(prompt(str(i))) for i in range(20)), return_exceptions=True)

    with FakeOpenAI(lambda call, n: Reply(status=401, body=error_body("no key"))) as server:
        outcomes = asyncio.run(run(server.base_url))
    assert all(isinstance(o, EndpointRefused) for o in outcomes) and len(server.calls) <= 4


# --- concurrency ------------------------------------------------------------------------------------


def test_concurrency_is_bounded_and_reached():
    active = peak = 0
    lock = threading.Lock()

    def responder(call, n):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.05)
        with lock:
            active -= 1
        return Reply(content=PASS)

    with FakeOpenAI(responder) as server:
        judge_prompts([prompt(str(i)) for i in range(30)], settings(server, concurrency=6))
    assert peak == 6


def test_the_window_halves_once_per_burst_of_429s_and_grows_back():
    rate = RateController(concurrency=16, budget=10)
    epoch = rate.epoch
    for _ in range(8):  # eight requests of one window refused together
        rate.throttled(epoch)
    assert rate.window == 8
    rate.throttled(rate.epoch)
    assert rate.window == 4
    for _ in range(100):
        rate.succeeded()
    assert rate.window == 16  # never above concurrency


def test_a_rate_limited_endpoint_gets_every_task_judged():
    # 8 requests/s, 429 with Retry-After: 1 beyond: benchmarks/judge_rate_limit.py prints the rate reached
    with FakeOpenAI(lambda call, n: Reply(content=PASS), rate=RateLimit(8, 8, {"Retry-After": "1"})) as server:
        result = judge_prompts([prompt(str(i)) for i in range(50)], settings(server, task_budget_seconds=60))
    assert all(v.status == "judged" for v in result)
    assert sum(c.status == 200 for c in server.calls) == 50


def test_a_key_the_reply_echoes_across_the_cut_of_its_raw_text_or_reasoning_is_redacted_whole():
    key = "sk-live-0123456789abcdef"
    reasoning = "y" * (REASONING_MAX_CHARS - 6) + key  # the reasoning's cut falls inside the key
    content = json.dumps({"reasoning": reasoning, "passed": True})
    reply = "x" * (RAW_REPLY_MAX_CHARS - 12) + key + content  # so does the raw reply's
    with FakeOpenAI(lambda call, n: Reply(content=reply)) as server:
        [v] = judge_prompts([prompt("a")], settings(server, api_key=key))
    assert v.status == "judged"
    stored = json.dumps(dataclasses.asdict(v))
    assert "sk-live" not in stored and "***" in v.raw_replies and v.reasoning.endswith("***")


def test_a_base_url_with_a_user_but_no_password_sends_the_key_as_the_bearer_token():
    with FakeOpenAI() as server:
        url = server.base_url.replace("http://", "http://tok@")
        [v] = judge_prompts([prompt("a")], settings(server, base_url=url, api_key="sk-test-123"))
    assert v.status == "judged" and server.calls[0].headers.get("Authorization") == "Bearer sk-test-123"


@pytest.mark.parametrize("userinfo", ["", "tok@"])
def test_a_base_url_with_a_query_keeps_it_after_the_path(userinfo):  # Azure OpenAI's ?api-version=...
    with FakeOpenAI() as server:
        url = server.base_url.replace("http://", f"http://{userinfo}") + "?api-version=2024-10-21"
        [v] = judge_prompts([prompt("a")], settings(server, base_url=url, api_key="sk-test-123"))
    assert v.status == "judged" and server.calls[0].query == "api-version=2024-10-21"


def test_a_query_of_the_base_url_never_reaches_a_verdict_through_an_error_naming_the_url():
    def redirect_to_itself(call, n):  # a loop: aiohttp's error names the URL, query and all
        return Reply(status=307, headers={"Location": f"/v1/chat/completions?{call.query}"}, body="")

    with FakeOpenAI(redirect_to_itself) as server:
        url = server.base_url + "?code=SECRETCODE"
        [v] = judge_prompts([prompt("a")], settings(server, base_url=url, task_budget_seconds=0.3))
    assert v.status == "error" and "TooManyRedirects" in v.why, v.why
    assert "SECRETCODE" not in json.dumps(dataclasses.asdict(v)) and "/v1/chat/completions" in v.why


def test_urls_in_an_error_text_are_shown_without_query_whatever_their_case_or_brackets():
    from filter_pipeline.judge.transport import public_urls

    assert public_urls("see (HTTPS://h:8/x?token=S) and http://u:p@h/y#f") == "see (https://h:8/x) and http://h/y"


def test_api_key_is_sent_as_bearer_token_only_when_set():
    with FakeOpenAI() as server:
        judge_prompts([prompt("a")], settings(server, api_key="sk-test-123"))
        judge_prompts([prompt("b")], settings(server))
    assert server.calls[0].headers.get("Authorization") == "Bearer sk-test-123"
    assert "Authorization" not in server.calls[1].headers


# --- votes ------------------------------------------------------------------------------------------


def votes(*results) -> list[Vote]:
    return [Vote(passed=r, why=f"why {i}", error=None if r is not None else "boom") for i, r in enumerate(results)]


@pytest.mark.parametrize(
    "results, n, passed, tally, status",
    [
        ((True, True, False), 3, True, "2/3", "judged"),
        ((True, False, False), 3, False, "1/3", "judged"),
        ((True, False), 2, False, "1/2", "judged"),  # a tie fails
        ((True, True, None), 3, True, "2/3", "judged"),  # majority reached without the third vote
        ((True, False, None), 3, None, None, "error"),  # no majority: unjudged
        ((None, None, None), 3, None, None, "error"),
        ((None,), 1, None, None, "error"),
    ],
)
def test_majority_and_tie_rules(results, n, passed, tally, status):
    verdict_passed, why, verdict_votes, verdict_status = majority(votes(*results), n)
    assert (verdict_passed, verdict_votes, verdict_status) == (passed, tally, status)
    if status == "error":
        assert "boom" in why
