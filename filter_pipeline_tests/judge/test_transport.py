"""One chat completion over HTTP against a real server on 127.0.0.1: retry hints in every form, transient
statuses, timeouts and budgets, unreachable endpoints, base URLs, the key kept out of what is stored."""

import asyncio
import dataclasses
import json
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from filter_pipeline.judge.client import (
    JudgeClient,
    judge_prompts,
)  # fmt: skip
from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.judge.rate import TaskBudget, Unanswered
from filter_pipeline.judge.transport import Transport
from filter_pipeline.judge.transport import _Fault as Fault
from filter_pipeline_tests.judge.asking import PASS, prompt, sequence, settings
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply, error_body

SOON = object()  # an HTTP-date two seconds ahead (the format has whole seconds)


@pytest.mark.parametrize(
    "headers, at_least",
    [
        ({"Retry-After": "0.6"}, 0.55),
        ({"Retry-After": SOON}, 0.9),
        ({"retry-after-ms": "600"}, 0.55),
        ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "0.6s"}, 0.55),
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


@pytest.mark.parametrize("status", [408, 409, 500, 502, 503])
def test_transient_statuses_are_retried(status):
    with FakeOpenAI(
        sequence(Reply(status=status, body="{}"), Reply(status=status, body="{}"), Reply(content=PASS))
    ) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.status, v.requests, len(server.calls)) == (True, "judged", 3, 3)


DEEP = "[" * 100_000 + "]" * 100_000  # nested deeper than json follows
NO_CHOICES = '{"id": "c", "object": "chat.completion"}'  # (JSON, but no completion: a `choices: []` is one)
STREAM = 'data: {"choices": [{"delta": {"content": "{}"}}]}\n\ndata: [DONE]\n\n'  # (a stream no one asked for)


@pytest.mark.parametrize("body", ["<html>502 Bad Gateway</html>", NO_CHOICES, "\xff\xfe", DEEP, STREAM])
def test_a_2xx_answer_that_is_no_completion_is_asked_once_more(body):
    with FakeOpenAI(sequence(Reply(body=body), Reply(content=PASS))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.requests) == (True, 2)


def test_two_2xx_answers_in_a_row_that_are_no_completion_end_the_task_unjudged_as_each_may_be_billed():
    told = []
    with FakeOpenAI(lambda call, n: Reply(body=STREAM)) as server:

        async def run(s):
            async with JudgeClient(s, report=told.append) as client:
                return await asyncio.gather(*(client.judge(prompt(str(i))) for i in range(5)))

        verdicts = asyncio.run(run(settings(server, task_budget_seconds=60)))
    assert [(v.status, v.requests) for v in verdicts] == [("error", 2)] * 5 and len(server.calls) == 10
    assert all(v.why.startswith("HTTP 200 from the judge endpoint is not a chat completion: data: ") for v in verdicts)
    assert verdicts[0].why.endswith("(2 such answers in a row: not asked again, as each may be billed)")
    assert any("is not a chat completion" in line for line in told) and not any("down" in line for line in told)


@pytest.mark.parametrize("message", ["null", '{"role": "assistant", "content": ""}'])
def test_a_gateways_fault_passed_on_in_a_completion_is_retried_as_any_fault(message):
    failed = Reply(body=f'{{"choices": [{{"index": 0, "finish_reason": "error", "message": {message}}}]}}')
    with FakeOpenAI(sequence(failed, failed, failed, Reply(content=PASS))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.passed, v.requests) == ("judged", True, 4)


@pytest.mark.parametrize(
    "headers",
    [
        {"Retry-After": "0"},
        {"Retry-After": "PAST"},
        {"retry-after-ms": "0"},
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1ms"},
    ],
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


def test_a_first_request_has_its_whole_timeout_whatever_the_budget_for_retrying():
    with FakeOpenAI(sequence(Reply(content=PASS, delay=1.0))) as server:  # slower than the budget, within the timeout
        [v] = judge_prompts([prompt("a")], settings(server, timeout_seconds=5.0, task_budget_seconds=0.3))
    assert (v.status, v.passed, v.requests) == ("judged", True, 1), v.why


def test_a_request_cut_short_by_the_task_budget_reports_what_the_endpoint_said_before():
    down = Reply(status=503, body=error_body("upstream down", "server_error"))
    with FakeOpenAI(sequence(down, replace(down, body_delay=3.0))) as server:
        [v] = judge_prompts([prompt("a")], settings(server, timeout_seconds=10.0, task_budget_seconds=0.5))
    assert v.status == "error" and v.requests == 2
    assert v.why.startswith("HTTP 503 from the judge endpoint: upstream down; the task budget ran out"), v.why


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


def test_a_key_in_the_base_urls_path_never_reaches_a_line_naming_the_endpoint():
    from filter_pipeline.judge.rate import EndpointRefused

    key = "sk-secret-key-0123456789"
    with FakeOpenAI() as server:  # a gateway keyed by its path: no such route here, so a 404, a refusal
        gateway = settings(server, base_url=f"{server.base_url}/k/{key}", api_key=key)
        with pytest.raises(EndpointRefused) as refused:
            judge_prompts([prompt("a")], gateway)
    assert "/v1/k/***/chat/completions" in str(refused.value) and key not in str(refused.value), refused.value
    # (the name every line about the endpoint gives it: retries, a spent budget, no usage reported)
    assert Transport(gateway).public_url == f"{server.base_url}/k/***/chat/completions"


def test_an_unreachable_endpoint_is_unjudged_not_a_crash():
    with FakeOpenAI() as server:
        url = server.base_url
    [v] = judge_prompts(
        [prompt("a")], LLMJudgeConfig(base_url=url, model="m", task_budget_seconds=1.0, backoff_initial_seconds=0.01)
    )
    assert v.status == "error" and v.requests >= 2  # (tried again within the budget, however loaded the machine)
    # which host refused, and how: a mistyped port reads as one
    port = url.split(":")[-1].split("/")[0]
    assert "ClientConnectorError talking to the judge endpoint (Cannot connect to host 127.0.0.1:" + port in v.why


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


def test_secrets_of_the_base_url_the_server_repeats_in_an_error_never_reach_a_verdict_or_a_line():
    told: list[str] = []

    def echo(call, n):  # (a server repeating what it was sent: the request line and the credentials)
        said = f"bad request POST /v1/chat/completions?{call.query} with {call.headers.get('Authorization')}"
        return Reply(status=500, body=error_body(said))

    async def run(s):
        async with JudgeClient(s, report=told.append) as client:
            return await client.judge(prompt("a"))

    with FakeOpenAI(echo) as server:
        url = server.base_url.replace("http://", "http://judge:sk-user-part-secret@") + "?api-key=sk-query-secret"
        verdict = asyncio.run(run(settings(server, base_url=url, task_budget_seconds=0.3)))
    assert server.calls[0].headers["Authorization"].startswith("Basic ")  # (the user part, sent as Basic)
    assert verdict.status == "error" and "?api-key=*** with Basic ***" in verdict.why, verdict.why
    shown = json.dumps([dataclasses.asdict(verdict), told])
    assert "sk-user-part-secret" not in shown and "sk-query-secret" not in shown
    assert server.calls[0].headers["Authorization"].split()[1] not in shown


def test_urls_in_an_error_text_are_shown_without_query_whatever_their_case_or_brackets():
    from filter_pipeline.judge.transport import public_urls

    assert public_urls("see (HTTPS://h:8/x?token=S) and http://u:p@h/y#f") == "see (https://h:8/x) and http://h/y"


def test_api_key_is_sent_as_bearer_token_only_when_set():
    with FakeOpenAI() as server:
        judge_prompts([prompt("a")], settings(server, api_key="sk-test-123"))
        judge_prompts([prompt("b")], settings(server))
    assert server.calls[0].headers.get("Authorization") == "Bearer sk-test-123"
    assert "Authorization" not in server.calls[1].headers
