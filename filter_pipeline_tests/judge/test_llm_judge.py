"""The LLM judge's client against a real HTTP server on 127.0.0.1: replies, votes, retries, faults.
(What it is shown: test_prompt.py; the per-batch driver: test_driver.py.)"""

import json
import time

import pytest

from filter_pipeline.judge.llm import EndpointRefused, LLMSettings, Vote, judge_prompts, majority, parse_reply
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply

PASS = '{"passed": true, "why": "done"}'
FAIL = '{"passed": false, "why": "wrong item"}'


def settings(server, **kw) -> LLMSettings:
    defaults = dict(base_url=server.base_url, model="judge-test", backoff_initial_seconds=0.01, backoff_max_seconds=0.05)
    return LLMSettings(**{**defaults, **kw})


def prompt(name: str) -> list[dict]:
    return [{"role": "user", "content": f"task {name}"}]


# --- replies ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"passed": true, "why": "ok"}', (True, "ok")),
        ('Sure! Here is my verdict:\n```json\n{"passed": false, "why": "no banner"}\n```\nThanks.', (False, "no banner")),
        ('I think {"passed": true, "why": "cart has it"} is right.', (True, "cart has it")),
        ('```\n{"passed": false, "why": "x"}\n```', (False, "x")),
        ('{"passed": "yes", "why": "x"}', None),
        ('{"passed": true}', None),
        ("The task was completed.", None),
        ("", None),
    ],
)
def test_parse_reply(text, expected):
    assert parse_reply(text) == expected


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
    ],
)
def test_majority_and_tie_rules(results, n, passed, tally, status):
    verdict = majority(votes(*results), n)
    assert (verdict.passed, verdict.votes, verdict.status) == (passed, tally, status)


# --- asking, against the server ---------------------------------------------------------------------


def test_a_model_answering_differently_per_vote_is_decided_by_majority():
    answers = {"a": [PASS, PASS, FAIL], "b": [PASS, FAIL, FAIL]}
    seen: dict[str, int] = {}

    def responder(call, n):
        name = call.prompt.split()[-1]
        i = seen[name] = seen.get(name, -1) + 1
        return Reply(content=answers[name][i])

    with FakeOpenAI(responder) as server:
        result = judge_prompts([prompt("a"), prompt("b")], settings(server, concurrency=1))
    assert [(v.passed, v.votes) for v in result] == [(True, "2/3"), (False, "1/3")]
    assert [v.why for v in result] == ["done", "wrong item"]


def test_429_and_500_are_retried_honouring_retry_after():
    def responder(call, n):
        if n == 0:
            return Reply(status=429, headers={"Retry-After": "0.3"}, body='{"error": "slow down"}')
        if n == 1:
            return Reply(status=500, body="oops")
        return Reply(content=PASS)

    with FakeOpenAI(responder) as server:
        start = time.perf_counter()
        [verdict] = judge_prompts([prompt("a")], settings(server, votes=1))
        elapsed = time.perf_counter() - start
    assert verdict.status == "judged" and verdict.passed is True
    assert verdict.requests == 3
    assert elapsed >= 0.3  # waited as told


def test_slow_replies_time_out_and_are_retried():
    with FakeOpenAI(lambda call, n: Reply(delay=1.0) if n == 0 else Reply(content=PASS)) as server:
        [verdict] = judge_prompts([prompt("a")], settings(server, votes=1, timeout_seconds=0.3))
    assert verdict.passed is True and verdict.requests == 1  # the timed-out call got no response
    assert len(server.calls) == 2


def test_unparseable_reply_is_not_a_vote_and_is_asked_again():
    replies = ["I believe it worked.", "```json\n{broken\n```", PASS]
    with FakeOpenAI(lambda call, n: Reply(content=replies[min(n, 2)])) as server:
        [verdict] = judge_prompts([prompt("a")], settings(server, votes=1))
    assert (verdict.passed, verdict.requests) == (True, 3)
    assert json.loads(verdict.raw_replies) == replies


def test_outage_makes_tasks_unjudged_with_a_reason():
    with FakeOpenAI(lambda call, n: Reply(status=503, body="down")) as server:
        result = judge_prompts([prompt("a"), prompt("b")], settings(server, max_attempts=3))
    assert [v.status for v in result] == ["error", "error"]
    assert all(v.passed is None for v in result)
    assert "HTTP 503 from the judge endpoint" in result[0].why
    assert len(server.calls) == 2 * 3 * 3  # tasks x votes x attempts


def test_unreachable_endpoint_is_unjudged_not_a_crash():
    with FakeOpenAI() as server:
        url = server.base_url
    result = judge_prompts([prompt("a")], LLMSettings(base_url=url, model="m", max_attempts=2, backoff_initial_seconds=0.01))
    assert result[0].status == "error" and "talking to the judge endpoint (after 2 tries)" in result[0].why


def test_a_refusing_endpoint_stops_judging_with_one_line():
    with FakeOpenAI(lambda call, n: Reply(status=401, body='{"error": "bad key"}')) as server:
        with pytest.raises(EndpointRefused, match="HTTP 401") as refused:
            judge_prompts([prompt("a")], settings(server, votes=1, api_key="sk-secret"))
    assert "\n" not in str(refused.value) and "sk-secret" not in str(refused.value)
    assert len(server.calls) == 1


def test_concurrency_is_bounded():
    active = peak = 0
    import threading

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
        judge_prompts([prompt(str(i)) for i in range(20)], settings(server, votes=1, concurrency=4))
    assert peak == 4


def test_api_key_is_sent_as_bearer_token_only_when_set():
    with FakeOpenAI() as server:
        judge_prompts([prompt("a")], settings(server, votes=1, api_key="sk-test-123"))
        judge_prompts([prompt("b")], settings(server, votes=1))
    assert server.calls[0].headers.get("Authorization") == "Bearer sk-test-123"
    assert "Authorization" not in server.calls[1].headers
