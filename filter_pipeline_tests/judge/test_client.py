"""Asking the judge model, against a real HTTP server on 127.0.0.1 speaking the wire shapes of real servers:
requests per task, n, structured output, repairs, reasoning replies, votes (retries and the rate controller:
test_transport.py, test_rate.py)."""

import asyncio
import dataclasses
import json
import threading

import pytest

from filter_pipeline.judge.client import (
    REPAIR_PROMPT,
    JudgeClient,
    Vote,
    judge_prompts,
    majority,
)  # fmt: skip
from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.rules.schemas import RAW_REPLY_MAX_CHARS, REASONING_MAX_CHARS
from filter_pipeline_tests.judge.asking import FAIL, PASS, PROSE, prompt, sequence, settings
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply, error_body

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


def test_completions_without_usage_count_zero_tokens_and_say_so_once():
    body = json.dumps({"id": "c", "object": "chat.completion", "model": "m",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": PASS}, "finish_reason": "stop"}]})  # fmt: skip
    told: list[str] = []

    async def run(s):
        async with JudgeClient(s, report=told.append) as client:
            return await asyncio.gather(*(client.judge(prompt(str(i))) for i in range(3)))

    with FakeOpenAI(lambda call, n: Reply(body=body)) as server:
        verdicts = asyncio.run(run(settings(server)))
    assert [(v.status, v.prompt_tokens, v.completion_tokens) for v in verdicts] == [("judged", 0, 0)] * 3
    assert told == [f"the judge endpoint {server.base_url}/chat/completions reports no token usage in its "
                    "completions: their tokens, and the cost, count as 0"]  # fmt: skip


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


def test_n_once_it_worked_stays_on_when_an_earlier_fallback_without_n_answers_late():
    # task a's request asking n gets a 400 (which, before n ever worked, may be n's rejection): it is asked
    # again without n, and answered late; meanwhile the other tasks' requests asking n get their 3 choices, and
    # those asked after a's late answer still ask n
    def responder(call, n):
        asks_n = call.body.get("n", 1) > 1
        if "task a" in json.dumps(call.body):
            return (
                Reply(status=400, body=error_body("'n' is not supported")) if asks_n else Reply(content=PASS, delay=0.5)
            )
        return Reply(choices=[PASS] * 3, delay=0.1)

    with FakeOpenAI(responder) as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=2)
        a, *others = judge_prompts([prompt(name) for name in "abcdefghij"], s)
    assert a.requests == 4 and [v.requests for v in others] == [1] * 9
    assert all(c.body.get("n") == 3 for c in server.calls if "task a" not in json.dumps(c.body))


def test_a_server_rejecting_n_gets_separate_requests_for_the_clients_lifetime():
    with FakeOpenAI(lambda call, n: Reply(content=PASS), n="reject400") as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=1)
        first, second = judge_prompts([prompt("a"), prompt("b")], s)
    assert [c.body.get("n") for c in server.calls] == [3] + [None] * 6
    assert (first.votes, first.status, first.requests, second.requests) == ("3/3", "judged", 4, 3)


def test_a_server_answering_n_with_500_gets_separate_requests_after_it_answered_without_n():
    # llama.cpp's server: every request asking n > 1 gets a 500. Each task in flight asks it without n at once;
    # once one such request was answered, the next 500 to a request asking n turns n off for the client
    with FakeOpenAI(lambda call, n: Reply(content=PASS), n="reject500") as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=1)
        results = judge_prompts([prompt(name) for name in "abcdef"], s)
    asked = [(c.body.get("n"), c.status) for c in server.calls]
    assert asked[:2] == [(3, 500), (None, 200)] and asked.count((3, 500)) <= 2
    assert set(asked[asked.index((None, 200)) :]) <= {(None, 200), (3, 500)}
    assert [v.votes for v in results] == ["3/3"] * 6 and [v.requests for v in results[3:]] == [3, 3, 3]


def test_a_passing_500_to_the_first_request_asking_n_does_not_turn_n_off():
    # a server's passing error must not turn n off for the run: every vote would then pay for the prompt again
    first = Reply(status=500, body=error_body("internal error", "server_error"))
    with FakeOpenAI(sequence(first, Reply(content=PASS), Reply(choices=[PASS, FAIL, PASS]))) as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=1)
        a, b, c = judge_prompts([prompt(name) for name in "abc"], s)
    asked = {task: [call.body.get("n") for call in server.calls if f"task {task}" in call.prompt] for task in "abc"}
    assert asked == {"a": [3, None, None, None], "b": [3], "c": [3]}
    assert (a.requests, b.requests, c.requests) == (4, 1, 1) and (b.votes, c.votes) == ("2/3", "2/3")


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
        # what the filter let through ends anywhere, here inside prose after the answer format quoted
        ({"content": 'Format: {"passed": true, "why": "..."}. The draft was never sent, the'}, "content_filter",
         "the judge model refused to answer (finish_reason content_filter)"),
        ({"content": PASS}, "content_filter", "the judge model refused to answer (finish_reason content_filter)"),
    ],
    ids=["refusal", "content-filter", "content-filter-after-a-quoted-format", "content-filter-after-a-verdict"],
)  # fmt: skip
def test_a_refusal_is_unjudged_with_its_reason_and_not_repaired(message, finish_reason, why):
    with FakeOpenAI(lambda call, n: Reply(body=completion_body(message, finish_reason))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.why, v.requests, len(server.calls)) == ("error", why, 1, 1)


def withheld_body(choices: list) -> str:
    """A completion the endpoint's content filter stopped, its prompt paid for."""
    return json.dumps({"id": "c", "object": "chat.completion", "model": "m", "choices": choices,
                       "usage": {"prompt_tokens": 1200, "completion_tokens": 0, "total_tokens": 1200}})  # fmt: skip


@pytest.mark.parametrize(
    "choices, why",
    [
        ([{"index": 0, "message": None, "finish_reason": "content_filter"}],
         "the judge model refused to answer (no message, finish_reason content_filter)"),
        ([], "the judge model refused to answer (no choices)"),
    ],
    ids=["message-null", "no-choices"],
)  # fmt: skip
def test_a_completion_withheld_by_the_content_filter_is_a_refusal_paid_once(choices, why):
    with FakeOpenAI(lambda call, n: Reply(body=withheld_body(choices))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.passed, v.why, v.requests, len(server.calls)) == ("error", None, why, 1, 1)
    assert v.prompt_tokens == 1200


def test_a_completion_without_choices_refuses_every_vote_it_was_asked_for_and_says_nothing_of_n():
    refused = Reply(body=withheld_body([]))
    with FakeOpenAI(sequence(refused, Reply(choices=[PASS, PASS, PASS]))) as server:
        s = settings(server, votes=3, temperature=0.7, concurrency=1)
        filtered, judged = judge_prompts([prompt("a"), prompt("b")], s)
    assert (filtered.status, filtered.requests, judged.votes, judged.requests) == ("error", 1, "3/3", 1)
    assert "(no choices)" in filtered.why
    assert [c.body.get("n") for c in server.calls] == [3, 3]


def test_a_server_ignoring_n_that_refuses_the_prompt_is_not_asked_for_the_other_votes():
    refusal = completion_body({"content": None, "refusal": "I can't help with that."})
    with FakeOpenAI(lambda call, n: Reply(body=refusal), n="ignore") as server:
        [v] = judge_prompts([prompt("a")], settings(server, votes=3, temperature=0.7))
    assert (v.status, v.requests, len(server.calls)) == ("error", 1, 1)
    assert v.why.endswith("3 without an answer (the judge model refused to answer: I can't help with that.)")


def test_once_n_is_known_to_be_ignored_a_refused_prompt_is_asked_once_not_once_per_vote():
    refusal = Reply(body=completion_body({"content": None, "refusal": "No."}))

    async def judge_a_then_b(server):
        async with JudgeClient(settings(server, votes=3, temperature=0.7)) as client:
            return await client.judge(prompt("a")), await client.judge(prompt("b"))

    with FakeOpenAI(lambda call, n: refusal if call.prompt == "task b" else Reply(content=PASS), n="ignore") as server:
        a, b = asyncio.run(judge_a_then_b(server))
    assert (a.votes, a.requests) == ("3/3", 3)  # (a's first request learnt that n is ignored)
    assert (b.status, b.requests) == ("error", 1)


def test_a_repair_the_content_filter_stopped_is_a_refusal_whatever_it_holds():
    stopped = Reply(body=completion_body({"content": PASS}, "content_filter"))
    with FakeOpenAI(sequence(Reply(content=PROSE), stopped)) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.status, v.passed, v.requests) == ("error", None, 2)
    assert v.why.endswith("its repair was stopped: the judge model refused to answer (finish_reason content_filter)")


def test_a_verdict_beside_a_refusal_field_is_one_vote_and_the_others_are_asked():
    first = Reply(body=completion_body({"content": PASS, "refusal": "Some details were withheld."}))
    with FakeOpenAI(sequence(first, Reply(content=FAIL), Reply(content=FAIL)), n="ignore") as server:
        [v] = judge_prompts([prompt("a")], settings(server, votes=3, temperature=0.7, concurrency=1))
    assert (v.votes, v.passed, v.requests) == ("1/3", False, 3)


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
    # cut inside a failing verdict whose criteria passed: repaired, never read as the criterion's pass
    inside = Reply(content='{"criteria": [{"passed": true}], "passed": false, "why": "no ord', finish_reason="length")
    with FakeOpenAI(sequence(inside, Reply(content=FAIL))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.requests) == (False, 2)


def test_a_reply_cut_off_inside_its_verdict_after_quoting_the_answer_format_is_repaired():
    quoted = 'Answer format: {"passed": true, "why": "<one sentence>"}. The cart holds another item. '
    cut = Reply(content=quoted + '{"success": false, "score": 1, "passed": fal', finish_reason="length")
    with FakeOpenAI(sequence(cut, Reply(content=FAIL))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.why, v.requests) == (False, "wrong item", 2)
    assert server.calls[1].prompt == REPAIR_PROMPT


@pytest.mark.parametrize(
    "content, finish_reason",
    [
        # the answer format quoted, then an answer in another shape: the reply's last object holds no verdict
        (
            'You asked for JSON like {"passed": true, "why": "reached"}. Mine:\n{"verdict": "fail", "why": "Lisbon"}',
            "stop",
        ),  # fmt: skip
        # cut off while still reasoning after quoting the format: the quoted object was not its last word
        ('I must end with {"passed": true, "why": "the goal is reached"}. The agent typed Porto but then', "length"),
    ],
)
def test_a_quoted_answer_format_is_never_the_verdict(content, finish_reason):
    with FakeOpenAI(sequence(Reply(content=content, finish_reason=finish_reason), Reply(content=FAIL))) as server:
        [v] = judge_prompts([prompt("a")], settings(server))
    assert (v.passed, v.why, v.requests) == (False, "wrong item", 2)
    assert server.calls[1].prompt == REPAIR_PROMPT


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


@pytest.mark.parametrize("placeholder", ["none", "EMPTY", "ollama"])
def test_a_placeholder_key_is_no_secret_and_the_judges_words_stay_whole(placeholder):
    content = json.dumps({"reasoning": f"{placeholder} of the checks failed", "passed": False, "why": placeholder})
    with FakeOpenAI(lambda call, n: Reply(content=content)) as server:
        [v] = judge_prompts([prompt("a")], settings(server, api_key=placeholder))
    assert (v.reasoning, v.why) == (f"{placeholder} of the checks failed", placeholder) and "***" not in v.raw_replies
    assert server.calls[0].headers["Authorization"] == f"Bearer {placeholder}"  # (still sent as it is)


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


def test_a_short_key_that_is_no_placeholder_is_masked_like_any_other():
    content = json.dumps({"reasoning": "the key letmein was echoed", "passed": True, "why": "ok"})
    with FakeOpenAI(lambda call, n: Reply(content=content)) as server:
        [v] = judge_prompts([prompt("a")], settings(server, api_key="letmein"))
    assert v.reasoning == "the key *** was echoed" and "letmein" not in v.raw_replies


@pytest.mark.parametrize(
    "base_url, said, shown",
    [
        # a signed query as written (lowercase escapes) and as the client sends it (uppercase, `/` decoded)
        ("http://h/v1?sig=abc%2bdef%2fghi%3d", "GET /v1?sig=abc%2Bdef/ghi%3D failed", "GET /v1?sig=*** failed"),
        ("http://u:p%2Bss+w0rd%21@h/v1", "password p+ss+w0rd! refused", "password *** refused"),  # (`+` is no space)
        ("http://u:p%C3%A4sswort1@h/v1", "Authorization: Basic dTpw5HNzd29ydDE=", "Authorization: Basic ***"),
        # parameters not named as secrets, and words that only hold such a name, stay
        (
            "http://h/v1?accessToken=supersecret123&clientSecret=othersecret45",
            "supersecret123 othersecret45",
            "*** ***",
        ),
        ("http://h/v1?design=abcdefghij&author=someone-long", "design abcdefghij by someone-long", None),
        ("http://lm-studio@h/v1?api-key=not-needed", "lm-studio says not-needed", None),  # (placeholders: no secret)
        ("http://h/v1?api-version=2024-10-21", "as of 2024-10-21", None),
    ],
)
def test_the_base_urls_secrets_are_masked_in_every_form_a_server_repeats_and_nothing_else(base_url, said, shown):
    assert LLMJudgeConfig(base_url=base_url, model="m").redact(said) == (shown or said)


def test_the_longest_secret_is_masked_first_whichever_setting_holds_it():
    config = LLMJudgeConfig(base_url="http://h/v1?api-key=sk-abcdef12345-extra", model="m", api_key="sk-abcdef12345")
    assert config.redact("sent sk-abcdef12345-extra and sk-abcdef12345") == "sent *** and ***"
