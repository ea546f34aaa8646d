"""The parts of a verdict (prompt v3: success, side effects, looping, blocked, score, key points, reasoning),
read from replies of a real HTTP server on 127.0.0.1, alone and by a majority of votes, and the minimum score."""

import json

import dagster as dg
import pytest

from filter_pipeline.judge.client import judge_prompts
from filter_pipeline.judge.replies import Parts, parse_reply
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules.schemas import REASONING_MAX_CHARS, VERDICT_PARTS
from filter_pipeline_tests.builders import Pipeline
from filter_pipeline_tests.judge.asking import prompt, settings
from filter_pipeline_tests.judge.test_resource import llm, sample_batch
from filter_pipeline_tests.openai_server import FakeOpenAI, Reply

PARTS = VERDICT_PARTS


def v3(passed: bool = True, why: str = "w", **parts) -> str:
    answer = {"key_points": ["cart holds 2 mugs"], "reasoning": "the cart page lists 2 mugs", "success": passed,
              "side_effects": False, "looping": False, "blocked": False, "score": 5 if passed else 2}  # fmt: skip
    answer.update(parts)
    return json.dumps({**{k: v for k, v in answer.items() if v is not ...}, "passed": passed, "why": why})


def judged(*contents: str, **kw) -> list:
    """One task's verdict from a server answering the calls with `contents` in turn (the last from then on)."""
    with FakeOpenAI(lambda call, n: Reply(content=contents[min(n, len(contents) - 1)])) as server:
        [verdict] = judge_prompts([prompt("a")], settings(server, **kw))
    return verdict


def parts_of(verdict) -> list:
    return [getattr(verdict, name) for name in PARTS]


def test_a_reply_with_every_part_fills_every_column():
    verdict = judged(v3(True))
    assert (verdict.passed, verdict.why) == (True, "w")
    assert parts_of(verdict) == [True, False, False, False, 5, '["cart holds 2 mugs"]', "the cart page lists 2 mugs"]


def test_missing_or_mistyped_parts_are_null_and_the_verdict_still_counts():
    verdict = judged(v3(False, success=..., looping="no", score=9, key_points="one", reasoning=...))
    assert (verdict.passed, verdict.status) == (False, "judged")
    assert parts_of(verdict) == [None, False, None, False, None, None, None]


def test_contradictory_parts_are_recorded_as_said_and_passed_alone_decides():
    verdict = judged(v3(True, success=False, blocked=True, score=1))
    assert verdict.passed is True  # the contract: the last object with a boolean passed is the verdict
    assert (verdict.success, verdict.blocked, verdict.score) == (False, True, 1)


def test_a_v2_shaped_reply_is_a_verdict_without_parts_but_its_reasoning():
    reply = '{"criteria": [{"criterion": "final state", "met": true}], "reasoning": "r2", "passed": true, "why": "ok"}'
    verdict = judged(reply)
    assert (verdict.passed, verdict.why, verdict.reasoning) == (True, "ok", "r2")
    assert parts_of(verdict)[:6] == [None] * 6


def test_reasoning_blocks_and_prose_before_the_verdict_are_its_reasoning_never_a_verdict_inside_them():
    reply = '<think>the cart shows {"passed": false} twice... no, once</think>\nThe cart has it.\n{"passed": true}'
    verdict = judged(reply)
    assert verdict.passed is True
    assert verdict.reasoning == 'the cart shows {"passed": false} twice... no, once\n\nThe cart has it.'
    assert judged("x" * 20 + '{"passed": true}').reasoning == "x" * 20


def test_reasoning_is_kept_in_full_up_to_its_cap():
    long = "because " * 2000
    assert len(long) > REASONING_MAX_CHARS > 500
    verdict = judged(v3(True, reasoning=long))
    assert verdict.reasoning == long[:REASONING_MAX_CHARS]
    assert len(json.loads(verdict.raw_replies)[0]) == 500  # the raw reply keeps its own cut


def test_several_votes_each_part_is_the_majority_and_the_score_the_median():
    replies = [
        v3(True, score=5, looping=True, blocked=..., key_points=["first"]),
        v3(False, score=2, looping=False, blocked=True),
        v3(True, score=4, looping=True, blocked=..., key_points=["third"]),
        v3(True, score=3, looping=False, blocked=...),
        v3(False, score=1, looping=False, blocked=False),
    ]
    with FakeOpenAI(lambda call, n: Reply(choices=replies)) as server:
        [verdict] = judge_prompts([prompt("a")], settings(server, votes=5, temperature=0.7))
    assert (verdict.passed, verdict.votes) == (True, "3/5")
    # success: 3 true of 5; looping: 2 true, 3 false; blocked: 1 true, 1 false (a tie); scores 1..5
    assert [verdict.success, verdict.looping, verdict.blocked, verdict.score] == [True, False, None, 3]
    assert verdict.key_points == '["first"]'  # the vote whose why the verdict carries


def test_an_even_number_of_scores_gives_the_lower_middle_one_a_score_some_vote_gave():
    replies = [v3(True, score=5), v3(True, score=2), v3(True, score=4), v3(False, score=1)]
    with FakeOpenAI(lambda call, n: Reply(choices=replies)) as server:
        [verdict] = judge_prompts([prompt("a")], settings(server, votes=4, temperature=0.7))
    assert verdict.score == 2


def test_parse_reply_reads_parts_from_the_verdict_object_only():
    found = parse_reply('{"score": 4, "blocked": true} then {"passed": false, "score": 2.0, "key_points": [1, "b"]}')
    assert found.passed is False
    assert found.parts == Parts(score=2, key_points=["1", "b"], reasoning='{"score": 4, "blocked": true} then')
    assert parse_reply('{"passed": true, "score": true}').parts.score is None  # a bool is not a score


# --- in the pipeline --------------------------------------------------------------------------------


@pytest.fixture
def pipeline(data_root):
    with dg.DagsterInstance.ephemeral() as instance:
        yield Pipeline(data_root, instance)


def scored(call, n) -> Reply:
    """Tasks a and b pass with score 5, c with 3; d is blocked (fails)."""
    if "do d" in call.prompt:
        return Reply(content=v3(False, blocked=True, success=False, score=1))
    return Reply(content=v3(True, score=3 if "do c" in call.prompt else 5))


def test_judge_verdicts_carry_the_parts_and_the_gate_leaves_them_null(pipeline):
    sample_batch(pipeline.data_root)
    pipeline.run(JudgeResource(kind="gate"), judging_only=True)
    gate = pipeline.output("judge_verdicts")
    assert gate[list(PARTS)].isna().all().all()
    with FakeOpenAI(scored) as server:
        pipeline.run(llm(server), judging_only=True)
    v = pipeline.output("judge_verdicts").set_index("task_id")
    assert v.loc["d", ["passed", "blocked", "success", "score"]].tolist() == [False, True, False, 1]
    assert v.loc["a", ["passed", "blocked", "score"]].tolist() == [True, False, 5]
    pool = pipeline.output("failure_pool")
    judge_rows = pool[pool["stage"] == "judge"].set_index("task_id")
    assert judge_rows.loc["d", "blocked"] == True  # noqa: E712
    assert pool[pool["stage"] == "execute"]["blocked"].isna().all()


def test_a_minimum_score_fails_low_scores_without_asking_again_and_lowering_it_restores_them(pipeline):
    sample_batch(pipeline.data_root)
    with FakeOpenAI(scored) as server:
        pipeline.run(llm(server), judging_only=True)
        asked = len(server.calls)
        pipeline.run(llm(server, min_score=4), judging_only=True)
        assert len(server.calls) == asked  # not part of the cache key: no request
        strict = pipeline.output("judge_verdicts").set_index("task_id")
        strict_pool = pipeline.output("failure_pool").set_index("task_id")
        pipeline.run(llm(server), judging_only=True)
        assert len(server.calls) == asked
        relaxed = pipeline.output("judge_verdicts").set_index("task_id")
    # the model's own verdict and why are stored as they are; passed is derived from them and the minimum
    assert strict.loc["c", ["passed", "judge_passed", "why", "votes", "score"]].tolist() == [False, True, "w", "1/1", 3]
    assert strict.loc["a", ["passed", "judge_passed"]].tolist() == [True, True]
    assert strict.loc["d", ["passed", "judge_passed"]].tolist() == [False, False]
    assert strict_pool[strict_pool["stage"] == "judge"].index.tolist() == ["c", "d"]
    assert strict_pool.loc["c", "detail"] == "score 3 is below the minimum score (FILTER_JUDGE_MIN_SCORE); the judge: w"
    assert strict_pool.loc["d", "detail"] == "w"  # the model failed it: its own why
    assert relaxed.loc["c", ["passed", "judge_passed", "why", "cached"]].tolist() == [True, True, "w", True]
    assert "c" not in pipeline.output("failure_pool")["task_id"].tolist()  # relaxed again: c passes


def test_a_model_why_that_looks_like_the_minimum_score_text_is_read_as_the_model_wrote_it(pipeline):
    # the failed verdict's why reads like a verdict failed by FILTER_JUDGE_MIN_SCORE; reusing it must keep it
    # failed, with its why, since the model's verdict is read from judge_passed, never from the text
    lookalike = "score 5 is below the minimum score 4 (FILTER_JUDGE_MIN_SCORE); the judge: w"

    def responder(call, n):
        if "do c" in call.prompt:
            return Reply(content=v3(False, score=2, why=lookalike))
        return Reply(content=v3(True, score=5))

    sample_batch(pipeline.data_root)
    with FakeOpenAI(responder) as server:
        pipeline.run(llm(server, min_score=4), judging_only=True)
        asked = len(server.calls)
        pipeline.run(llm(server), judging_only=True)
        assert len(server.calls) == asked
    v = pipeline.output("judge_verdicts").set_index("task_id")
    assert v.loc["c", ["passed", "judge_passed", "why", "cached"]].tolist() == [False, False, lookalike, True]
    pool = pipeline.output("failure_pool").set_index("task_id")
    assert pool.loc["c", "detail"] == lookalike
