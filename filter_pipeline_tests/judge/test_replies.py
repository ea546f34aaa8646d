"""Reading replies: the verdict in a model's reply (examples and properties), completions, retry hints."""

import json
import re
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filter_pipeline.judge.replies import (
    _NAME,
    NO_CHOICES,
    NO_MESSAGE,
    Choice,
    Usage,
    Verdict,
    _closed_blocks,
    duration_seconds,
    error_message,
    parse_reply,
    read_completion,
    retry_hint,
    strip_reasoning,
)  # fmt: skip

# --- examples ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"passed": true, "why": "ok"}', Verdict(True, "ok")),
        (
            'Sure! Here is my verdict:\n```json\n{"passed": false, "why": "no banner"}\n```\nThanks.',
            Verdict(False, "no banner"),
        ),
        ('I think {"passed": true, "why": "cart has it"} is right.', Verdict(True, "cart has it")),
        ('```\n{"passed": false, "why": "x"}\n```', Verdict(False, "x")),
        ('{"passed": true}', Verdict(True, "")),  # why is optional
        (
            '{"criteria": [{"name": "site", "passed": true}], "reasoning": "r", "passed": false, "why": "w"}',
            Verdict(False, "w"),
        ),
        # the last object is the verdict, whatever an object before it (a draft, the answer format quoted) said
        (
            '{"passed": true, "why": "first"} on second thought {"passed": false, "why": "second"}',
            Verdict(False, "second"),
        ),
        # reasoning blocks of other models' tags
        ('<seed:think>Draft: {"passed": true}</seed:think>The task failed: it is not done.', None),
        ('[THINK]Draft: {"passed": true}[/THINK]{"passed": false, "why": "no"}', Verdict(False, "no")),
        # a block opened after the answer began and never closed, around or after the verdict
        ('Example: {"passed": true, "why": "x"}\n<reasoning>\nThe cart is empty.\n{"passed": false}', None),
        ('{"passed": true, "why": "sent"}\n<think>Hmm, wait. The sent folder is actually empty', None),
        # an answer in another notation after the answer format quoted
        ("Example: {\"passed\": true, \"why\": \"x\"}\nMy answer:\n{'passed': False, 'why': 'no'}", None),
        ('Example: {"passed": true, "why": "x"}\nMy answer: {passed: false}', None),
        ('{"verdict": {"passed": true, "why": "wrapped"}}', Verdict(True, "wrapped")),  # an envelope
        ('{"result": {"verdict": {"passed": false, "why": "deep"}}}', Verdict(False, "deep")),
        # a verdict beside other fields of a wrapper: they may be criteria with a passed of their own (repaired)
        ('{"verdict": {"passed": false, "why": "no"}, "criteria": [{"name": "a", "passed": true}]}', None),
        ('{"result": {"verdict": {"passed": false}}, "checks": [{"name": "found", "passed": true}]}', None),
        ('{"verdict": "FAIL", "criteria": {"found": {"passed": true}}}', None),
        ('{"draft": {"passed": true, "why": "1"}, "final": {"passed": false, "why": "2"}}', None),
        ('{"criteria": [{"name": "a", "passed": true}], "verdict": "FAIL", "why": "looped"}', None),
        # a passed that is not a boolean: the verdict's wrong shape, never handed to a criterion
        ('{"criteria": [{"name": "a", "passed": true}], "passed": "false", "why": "w"}', None),
        ('{"criteria": [{"name": "a", "passed": true}], "passed": null}', None),
        ('{"criteria": [{"name": "a", "passed": true}], "passed": 0}', None),
        # the reply's last object holds no verdict: one before it (the answer format quoted) is not the answer
        ('Answer like {"passed": true, "why": "reached"}. Mine: {"verdict": "fail", "why": "Lisbon"}', None),
        ('{"passed": false, "why": "w"} and a note: {"confidence": 0.9}', None),
        ('{"passed": true, "why": 3}', Verdict(True, "3")),
        (
            '<think>the format is {"passed": true, "why": "x"}</think> {"passed": false, "why": "no order"}',
            Verdict(False, "no order"),
        ),
        ('<reasoning>{"passed": false}</reasoning>\n{"passed": true, "why": "done"}', Verdict(True, "done")),
        ('template opened it {"passed": true} </think>{"passed": false, "why": "after"}', Verdict(False, "after")),
        ('<think>still thinking, maybe {"passed": true, "why": "decoy"}', None),  # cut off inside its thinking
        ('Let me check. <think> The format is {"passed": true, "why": "..."}', None),  # opened later, never closed
        ('<think>{"passed": true}</think> I cannot decide.', None),
        ('{"passed": "yes", "why": "x"}', None),
        ('{"passed": 1, "why": "x"}', None),
        ("The task was completed.", None),
        ('{"passed": true, "why": "unterminated', None),
        # cut off inside the verdict: a criterion nested in it is not the verdict
        ('{"passed": false, "criteria": [{"passed": true}], "reasoning": "the page sho', None),
        ('{"passed": false, "criteria": [{"passed": true}, ', None),
        ('{"verdict": {"passed": true, "why": "w"}, "notes": "cut', None),
        ('{"passed": true, "why": "whole"} {"notes": "cut', None),  # the reply ends inside an object after it
        ('Format: {"passed": true, "why": "..."} Answer: {"reasoning": "the draft was never sent, the', None),
        ('{"criteria": [{"passed": true}], "passed": fal', None),  # cut inside a literal is cut off too
        # cut inside a later verdict: the earlier one (the answer format quoted) is not the answer
        (
            'Answer format: {"passed": true, "why": "<one sentence>"}. {"success": false, "score": 1, "passed": fal',
            None,
        ),
        ('{"passed": true, "why": "format"} {"score": 1, "passed": ', None),
        ('{"passed": true, "why": "format"} {"criteria": [{"name": "cart", "passed": false}], "reasoning": "no', None),
        # a `{` starting an object that does not decode: what follows may be nested in it (repaired)
        ('a stray { brace, then {"passed": false, "why": "n"}', None),  # where an object would start: broken
        ('{"passed": false, "why": "n"} and { a set } after it', None),
        # a brace of prose (after a letter, a slash, a backslash, a dot...) is no object: skipped
        ('see /cart/{id}, then {"passed": false, "why": "n"}', Verdict(False, "n")),
        ('The template {{name}} was filled. {"passed": true, "why": "y"}', Verdict(True, "y")),  # (anywhere)
        ('The template {{ "name": 1 }} {"passed": true, "why": "y"}', None),  # (a quote and a colon: broken)
        ('{"passed": false, "why": "n"} .badge{display:none}', None),  # a key after the brace: an object starts
        # a broken verdict after a prose character: still an object (a key follows), never its nested criterion
        ('verdict={"passed": false, "why": "no", "criteria": [{"name": "a", "passed": true}],}', None),
        ('**{"passed": false, "why": "no", "criteria": [{"name": "a", "passed": true}],}**', None),
        ('{"k": ["x"]}{"passed": false, "why": "no", "criteria": [{"name": "a", "passed": true}],}', None),
        ('answer={"passed": false, "why": "agent wrote {"passed": true} in the form"}', None),
        # an object listed in an array is one of several: a criterion as likely as a verdict
        ('{"passed": false, "why": "no"}\n[{"name": "added", "passed": true}]', None),
        ('[{"name": "searched", "passed": false}, {"name": "added", "passed": true}]', None),
        ('Here it is,\n{"passed": false, "why": "no"}', Verdict(False, "no")),  # a comma of prose lists nothing
        # a broken verdict after `=` or markdown, or with keys in other quotes: never its nested criterion
        ('verdict={ ..., "passed": false, "why": "x", "criteria": [{"name": "a", "passed": true}] }', None),
        ('**{key points: ["x"], "passed": false, "criteria": [{"name": "a", "passed": true}]}**', None),
        ('Antwort={\u201epassed\u201c: false, "criteria": [{"name": "a", "passed": true}]}', None),
        # a brace of prose ends at its own `}`: one holding an object is a broken object, not prose
        ('verdict{passed = false, why = see /cart/{id}, criterion = {"name": "mug", "passed": true}}', None),
        ('Final: \\boxed{\\textbf{FAIL}\n{"criterion": "mug added", "passed": true}}', None),
        ('Final: \\boxed{\\text{FAIL}} {"passed": false, "why": "no"}', Verdict(False, "no")),
        # a closing tag in the verdict's string does not close a block opened in the prose before it
        (
            'The agent began with <think> and never answered.\n{"passed": false, "why": "it printed only </think>", '
            '"criteria": [{"name": "search ran", "passed": true}]}',
            None,
        ),
        # a tag inside a JSON string, or after a broken object that may hold it in a string, is no tag
        (
            '{"reasoning": "ended with Done</think>", "criteria": [{"name": "a", "passed": true}], "passed": false,}',
            None,
        ),
        (
            'Format: {passed, why}\n{"reasoning": "it replied ok</think> and stopped", '
            '"criteria": [{"name": "a", "passed": true}], "passed": false, "why": "no"}',
            None,
        ),
        (
            '{"passed": true, "why": "agent answered \'<think>\'"}\nNo: {"passed": false, "why": "printed \'</think>\'"}',
            Verdict(False, "printed '</think>'"),
        ),
        # a comment, escaped quotes: a broken object, never a criterion inside it
        (
            '```jsonc\n{\n  // verdict first\n  "passed": false,\n  "criteria": [{"name": "a", "passed": true}]\n}\n```',
            None,
        ),
        ('{\\"passed\\": false, \\"why\\": \\"no\\"} Had it, {"passed": true, "why": "yes"}.', None),
        # a closing tag inside a JSON string is the string's text, not a tag
        (
            '{"passed": false, "why": "not sent", "reasoning": "it ended with Done.</think> but nothing was sent", '
            '"criteria": [{"name": "compose opened", "passed": true}]}',
            Verdict(False, "not sent"),
        ),
        ('at /cart/{id} the total is $\\boxed{0}$. {"passed": false, "why": "n"}', Verdict(False, "n")),
        ('it said {"x": "abc, then {"passed": true, "why": "y"}', None),
        ('{"n": ' + "1" * 5000 + '} {"passed": true, "why": "z"}', None),  # too long for int
        # the model's failing answer malformed after the answer format quoted: never the format, nor a criterion
        ('Answer format: {"passed": true, "why": "..."} then {"passed": false, "why": "empty",}', None),
        ('Answer format: {"passed": true, "why": "..."} then {"passed": false, "why": "line\nbreak"}', None),
        (
            '{"criteria": [{"name": "found", "passed": true}], "success": false, "passed": false, '
            '"why": "it clicked "Add" on the wrong item"}',
            None,
        ),
        ('{"passed": true, "why": "w"} {"n": ' + "[" * 100_000 + "]" * 100_000 + "}", None),  # an object too deep
        # a verdict too deep to decode, with a criterion's passed in it: no vote (the reply is repaired)
        ('{"passed": false, "criteria": [{"passed": true}], "n": ' + "[" * 1500 + "]" * 1500 + "}", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_reply(text, expected):
    assert parse_reply(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"passed": true, "why": "w"}', Verdict(True, "w")),
        ('Reasoning: fine.\n```json\n{"passed": true, "why": "w"}\n```\n', Verdict(True, "w")),
        ('{"passed": true, "why": "w"}\n``', Verdict(True, "w")),  # cut inside the fence's close
        ('<answer>{"passed": true, "why": "w"}</answer>', Verdict(True, "w")),
        ('[{"passed": true, "why": "w"}]', None),  # an object listed in an array: one of several
        ('Format: {"passed": true, "why": "w"}. Now, the agent clicked', None),  # still writing
        ('{"passed": true, "why": "w"} {"notes": "cut', None),
    ],
)
def test_a_reply_cut_off_after_its_verdict_object_holds_it_only_when_nothing_but_a_fence_follows(text, expected):
    assert parse_reply(text, cut_off=True) == expected


def test_a_verdict_nested_just_deeper_than_json_can_write_it_back_does_not_raise():
    for depth in range(985, 1000):
        deep = "[" * depth + "]" * depth
        for text in ('{"passed": true, "key_points": [' + deep + "]}", '{"passed": true, "why": ' + deep + "}"):
            assert parse_reply(text) in (None, Verdict(True, ""), Verdict(True, "(nested too deep to show)"))


def test_strip_reasoning_keeps_the_answer():
    assert strip_reasoning("<think>a</think>b<THINKING>c</THINKING>d").strip() == "bd"
    assert strip_reasoning("  <think>never closed").strip() == ""
    assert strip_reasoning("<seed:think>a</seed:think>b[THINK]c[/THINK]d").strip() == "bd"
    assert strip_reasoning("plain") == "plain"


# --- properties -------------------------------------------------------------------------------------

# Free text of the model: no braces (it would be JSON), no angle brackets (it would be a tag), no square brackets
# or commas (beside an object, they would list it in an array).
prose = st.text(st.characters(blacklist_characters="{}<>[],", blacklist_categories=("Cs",)), max_size=40)
words = st.text(st.characters(blacklist_characters="<>", blacklist_categories=("Cs",)), max_size=30)
verdicts = st.builds(Verdict, st.booleans(), words)
extra_fields = st.dictionaries(
    st.sampled_from(["reasoning", "criteria", "confidence", "notes"]),
    st.one_of(
        words, st.lists(st.fixed_dictionaries({"name": words, "passed": st.booleans()}), max_size=3), st.floats(0, 1)
    ),
    max_size=3,
)


@st.composite
def verdict_objects(draw) -> tuple[Verdict, str]:
    v = draw(verdicts)
    fields = {**draw(extra_fields), "passed": v.passed}
    if v.why or draw(st.booleans()):
        fields["why"] = v.why
    order = draw(st.permutations(list(fields)))
    text = json.dumps(
        {k: fields[k] for k in order}, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2]))
    )
    return v, text


def wrapped(text: str, how: str) -> str:
    return {"bare": text, "fenced": f"```json\n{text}\n```", "plain_fence": f"```\n{text}\n```"}[how]


wrappers = st.sampled_from(["bare", "fenced", "plain_fence"])
tags = st.sampled_from(["think", "thinking", "reasoning", "THINK"])


@settings(max_examples=120, deadline=None, database=None)
@given(
    st.lists(verdict_objects(), min_size=1, max_size=3),
    st.lists(wrappers, min_size=3, max_size=3),
    prose,
    prose,
    st.lists(st.tuples(tags, verdict_objects(), prose), max_size=2),
)
def test_the_last_verdict_object_outside_reasoning_wins(objects, hows, before, after, thoughts):
    thinking = "".join(f"<{tag}>{p} {obj} {p}</{tag}>" for tag, (_, obj), p in thoughts)
    body = f" {before} ".join(wrapped(text, how) for (_, text), how in zip(objects, hows))
    reply = f"{thinking}{before}\n{body}\n{after}"
    assert parse_reply(reply) == objects[-1][0]


@settings(max_examples=80, deadline=None, database=None)
@given(st.lists(st.tuples(tags, verdict_objects(), prose), min_size=1, max_size=3), prose, st.booleans())
def test_a_verdict_inside_a_reasoning_block_never_wins(thoughts, answer, closed):
    thinking = "".join(f"<{tag}>{p}{obj}{p}</{tag}>" for tag, (_, obj), p in thoughts)
    if not closed:  # cut off while thinking: the reply is an unclosed block
        thinking = f"<think>{thoughts[0][1][1]}"
    assert parse_reply(f"{thinking}{answer}") is None


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(verdict_objects(), min_size=1, max_size=3), prose, st.data())
def test_a_reply_cut_off_inside_its_last_verdict_holds_no_vote_whatever_came_before(objects, between, data):
    *earlier, last = (text for _, text in objects)
    named = last.index('"passed"') + len('"passed"')
    cut = last[: data.draw(st.integers(named, len(last) - 1), label="cut at")]
    assert parse_reply(f" {between} ".join([*earlier, cut])) is None


# A closed block as one regex says it: an opening tag, lazily, up to the first closing tag of its name (`\\1`,
# case aside; a namespaced name whose start is a reasoning name, `<think:think>`, backtracks to that start when
# the whole name is never closed). Right, but it searches the rest of the reply again from each opening tag
# that is never closed, and from each `<think` up to the next `>`.
BLOCK_AS_ONE_REGEX = re.compile(rf"<({_NAME})\b[^>]*>.*?</\1\s*>|\[(THINK)\].*?\[/\2\]", re.DOTALL | re.IGNORECASE)
block_pieces = st.sampled_from(
    ["<think>", "</think>", "<THINK >", "</Think >", "<thinking>", "</thinking>", "<reasoning x='<think>'>",
     "</reasoning>", "<seed:think>", "</seed:think>", "[THINK]", "[/think]", "[/THINK]", "<think", "x", " ", "{", "}",
     "<think:think>", "</think:think>", "<reasoning-x:think>", "</think\n>", "</[think>", "</[THINK >", "<", ">",
     "</", "[/",
     # letters a regex's case-insensitive literal takes for i, s and k, and its backreference does not
     "<th\u0131nk>", "</th\u0131nk>", "[TH\u0130NK]", "</rea\u017foning>", "</\u212aeep>"]
)  # fmt: skip


@settings(max_examples=600, deadline=None, database=None)
@given(st.lists(block_pieces, max_size=14))
def test_closed_blocks_are_the_ones_an_opening_tag_up_to_the_first_closing_tag_of_its_name_finds(pieces):
    text = "".join(pieces)
    assert list(_closed_blocks(text)) == [m.span() for m in BLOCK_AS_ONE_REGEX.finditer(text)]


def test_a_reply_repeating_a_tag_it_never_closes_is_read_in_one_pass():
    # (a model stuck in a loop: searched again from each tag, these replies would take minutes to read)
    answer = '{"passed": true}'
    for looping in ("<think>x " * 40_000, "<Think>a</think>" + "<think>" * 40_000, "<think " * 40_000 + ">"):
        assert strip_reasoning(looping) == ""
        assert parse_reply(looping + answer) is None  # (the answer is inside the block never closed)
    # the template opened the block: everything up to its closing tag is thinking, the answer follows
    assert parse_reply("<think>[THINK]" * 20_000 + "</reasoning>" + answer) == Verdict(True, "")
    # no `>` after them: no tag at all
    assert parse_reply("<think " * 40_000 + answer) == Verdict(True, "")
    # as many names as tags, none closed after its tag
    closed_before = "".join(f"</n{i}:think>" for i in range(10_000))
    assert parse_reply(closed_before + "".join(f"<n{i}:think>" for i in range(10_000)) + answer) is None


# --- completions ------------------------------------------------------------------------------------


def test_read_completion_takes_content_never_the_reasoning_field():
    payload = {
        "choices": [
            {
                "index": 1,
                "message": {"role": "assistant", "content": "b", "reasoning_content": "x"},
                "finish_reason": "length",
            },
            {
                "index": 0,
                "message": {"role": "assistant", "content": [{"type": "text", "text": "a"}], "reasoning": "y"},
                "finish_reason": "stop",
            },
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}},
    }
    choices, usage = read_completion(payload)
    assert choices == [Choice("a", "stop"), Choice("b", "length")] and choices[1].cut_off
    assert usage == Usage(10, 4, 8)
    assert read_completion({"choices": [{"message": {"content": None}}]})[1] == Usage(reported=False)
    for not_one in ({}, {"choices": None}, {"choices": [{"text": "legacy"}]}, {"choices": ["x"]}, [], "x"):
        assert read_completion(not_one) is None


def test_a_completion_without_a_message_or_without_choices_is_a_refusal_with_its_usage():
    usage = {"prompt_tokens": 1200, "completion_tokens": 0}
    filtered = {"choices": [{"index": 0, "message": None, "finish_reason": "content_filter"}], "usage": usage}
    assert read_completion(filtered) == ([Choice(None, "content_filter", withheld=NO_MESSAGE)], Usage(1200, 0))
    assert read_completion({"choices": [], "usage": usage}) == ([Choice(None, None, withheld=NO_CHOICES)], Usage(1200))
    assert read_completion({"choices": [{"message": None, "finish_reason": "stop"}]})[0][0].refused
    gateway_fault = {"message": None, "finish_reason": "error", "error": {"message": "upstream timed out"}}
    with_message = {"message": {"role": "assistant", "content": ""}, "finish_reason": "error"}  # (a fault too)
    for fault in ({"finish_reason": "stop"}, {"delta": {"content": "x"}}, gateway_fault, with_message):  # retried
        assert read_completion({"choices": [fault], "usage": usage}) is None


def test_error_message_is_the_servers_short_line():
    assert error_message('{"error": {"message": "bad\\n key", "type": "x"}}') == "bad key"
    assert error_message('{"error": "nope"}') == "nope"
    assert error_message('{"detail": "Not Found"}') == "Not Found"
    assert error_message("<html>\n  502 </html>") == "<html> 502 </html>"


# --- retry hints ------------------------------------------------------------------------------------

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.mark.parametrize(
    "headers, seconds",
    [
        ({"Retry-After": "2"}, 2.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"Retry-After": format_datetime(NOW + timedelta(seconds=30), usegmt=True)}, 30.0),
        ({"Retry-After": format_datetime(NOW - timedelta(seconds=30), usegmt=True)}, 0.0),  # already past
        ({"retry-after-ms": "1500", "Retry-After": "9"}, 1.5),  # the finer one first, as OpenAI's client does
        ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}, 1.0),
        ({"x-ratelimit-reset-requests": "20ms", "x-ratelimit-reset-tokens": "6m0s"}, None),  # none said used up
        # a request too large for the tokens left: no limit used up, the caller backs off
        (
            {
                "x-ratelimit-remaining-requests": "59",
                "x-ratelimit-reset-requests": "120ms",
                "x-ratelimit-remaining-tokens": "312",
                "x-ratelimit-reset-tokens": "6m0s",
            },
            None,
        ),
        # OpenAI's own example: requests used up, tokens to spare (whole again in 6 minutes): wait for a request
        (
            {
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "1s",
                "x-ratelimit-remaining-tokens": "149984",
                "x-ratelimit-reset-tokens": "6m0s",
            },
            1.0,
        ),
        (
            {
                "x-ratelimit-remaining-requests": "59",
                "x-ratelimit-reset-requests": "1s",
                "x-ratelimit-remaining-tokens": "0",
                "x-ratelimit-reset-tokens": "6m0s",
            },
            360.0,
        ),  # tokens used up
        (
            {
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "2s",
                "x-ratelimit-remaining-tokens": "0",
                "x-ratelimit-reset-tokens": "7s",
            },
            7.0,
        ),  # both: the longer
        ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "0.5s"}, 0.5),
        ({"llm_provider-retry-after": "3"}, 3.0),
        ({"llm_provider-retry-after-ms": "250"}, 0.25),
        ({"Retry-After": "soon"}, None),
        ({}, None),
    ],
)
def test_retry_hint_reads_every_form(headers, seconds):
    assert retry_hint(headers, now=NOW) == seconds


@pytest.mark.parametrize("skew", [-600, 0, 600])
def test_a_retry_after_date_counts_from_the_responses_own_date_whatever_this_clock_says(skew):
    server_now = NOW + timedelta(seconds=skew)  # the server's clock; this machine's is NOW
    headers = {"Date": format_datetime(server_now, usegmt=True),
               "Retry-After": format_datetime(server_now + timedelta(seconds=30), usegmt=True)}  # fmt: skip
    assert retry_hint(headers, now=NOW) == 30.0
    assert retry_hint({**headers, "Date": "not a date"}, now=NOW) == max(
        30.0 + skew, 0.0
    )  # (no usable Date: this clock)


@pytest.mark.parametrize(
    "text, seconds",
    [("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3.5s", 3723.5), ("7", 7.0), ("x1s", None), ("-1", None)],
)
def test_duration_seconds(text, seconds):
    assert duration_seconds(text) == pytest.approx(seconds) if seconds is not None else duration_seconds(text) is None


def test_choices_whose_index_is_missing_null_or_text_keep_the_servers_order():
    payload = {"choices": [{"index": None, "message": {"content": "a"}}, {"index": "1", "message": {"content": "b"}},
                           {"message": {"content": "c"}}, {"index": 0, "message": {"content": "d"}}]}  # fmt: skip
    choices, _ = read_completion(payload)
    assert [c.text for c in choices] == ["a", "b", "c", "d"]
    choices, _ = read_completion(
        {"choices": [{"index": 1, "message": {"content": "y"}}, {"index": 0, "message": {"content": "x"}}]}
    )
    assert [c.text for c in choices] == ["x", "y"]


def test_usage_counts_that_are_not_finite_numbers_count_zero():
    body = '{"choices": [{"message": {"content": "a"}}], "usage": {"prompt_tokens": 1e400, "completion_tokens": NaN}}'
    _, usage = read_completion(json.loads(body))
    assert usage == Usage(0, 0, 0)
