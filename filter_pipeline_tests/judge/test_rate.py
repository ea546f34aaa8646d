"""The rate controller against a real HTTP server on 127.0.0.1: one pause for every request, the concurrency
window, outages declared and probed, refusals stopping everything."""

import asyncio
import threading
import time

import pytest

from filter_pipeline.judge.client import EndpointRefused, JudgeClient, judge_prompts
from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.judge.rate import PROBE_REQUESTS, RateController
from filter_pipeline_tests.judge.asking import PASS, prompt, settings
from filter_pipeline_tests.openai_server import FakeOpenAI, RateLimit, Reply, error_body


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


def test_a_wait_asked_past_the_budget_is_told_as_the_end_of_the_task_not_as_a_retry():
    told: list[str] = []

    async def run(s):
        async with JudgeClient(s, report=told.append) as client:
            return await client.judge(prompt("a"))

    with FakeOpenAI(
        lambda call, n: Reply(status=429, headers={"Retry-After": "86400"}, body=error_body("slow down"))
    ) as server:
        verdict = asyncio.run(run(settings(server, task_budget_seconds=10)))
    assert verdict.status == "error" and verdict.requests == 1
    assert len(told) == 1 and "asks to wait 86400 s, longer than a task may wait" in told[0]
    assert "retrying" not in told[0]


def test_the_end_of_tasks_is_told_even_right_after_a_retry_was():
    told: list[str] = []
    waits = iter(["1", "86400"])

    async def run(s):
        async with JudgeClient(s, report=told.append) as client:
            return await client.judge(prompt("a"))

    with FakeOpenAI(
        lambda call, n: Reply(status=429, headers={"Retry-After": next(waits)}, body=error_body("slow"))
    ) as server:
        verdict = asyncio.run(run(settings(server, task_budget_seconds=10)))
    assert verdict.status == "error" and verdict.requests == 2
    assert ["retrying" in line for line in told] == [True, False] and "longer than a task may wait" in told[1]


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


@pytest.mark.parametrize(
    "status, message",
    [
        (401, "Incorrect API key provided: sk-test-SECRET"),
        (403, "forbidden"),
        (404, "The model `judge-test` does not exist or you do not have access to it."),
        (400, "Invalid model name passed in model=judge-test. Call `/v1/models` to view available models"),
        (402, "Insufficient credits. Add more using https://example.test/credits"),  # OpenRouter's
        (407, "Proxy Authentication Required"),
        (429, "You exceeded your current quota, please check your plan and billing details."),  # OpenAI's
    ],
)
def test_a_refusing_endpoint_stops_everything_after_the_probe_requests(status, message):
    code = "insufficient_quota" if status == 429 else None
    with FakeOpenAI(lambda call, n: Reply(status=status, body=error_body(message, code=code))) as server:
        url = server.base_url.replace("http://", "http://user:pw-SECRET@")
        s = settings(server, base_url=url, api_key="sk-test-SECRET", concurrency=64)
        with pytest.raises(EndpointRefused) as refused:
            judge_prompts([prompt(str(i)) for i in range(60)], s)
    assert len(server.calls) <= PROBE_REQUESTS
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
