"""Asking the judge model: the chat messages of one task in, one verdict out.

What a task costs: one request at the defaults (one vote at temperature 0). N votes at a temperature above 0
are N samples of one request (`n`), or N requests where the server ignores or rejects `n`. An unparseable
reply is never asked again identically: the reply is repaired by one follow-up request that differs from the
first, and structured output (`response_format` with a JSON schema) is asked for where the server takes it.
What the endpoint is spared (the rate controller, retries, refusals) is judge/rate.py's and judge/transport.py's.
"""

import asyncio
import hashlib
import json
import re
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from filter_pipeline.judge.prompt import prompt_of
from filter_pipeline.judge.rate import EndpointRefused, TaskBudget, Unanswered
from filter_pipeline.judge.replies import NO_CHOICES, Choice, Parts, parse_reply, strip_reasoning
from filter_pipeline.judge.transport import JudgeSetupError, Rejected, Transport, ssl_context
from filter_pipeline.rules.schemas import (
    RAW_REPLY_MAX_CHARS,
    REASONING_MAX_CHARS,
    VERDICT_FLAGS,
    VERDICT_PARTS,
    votes_text,
)
from filter_pipeline.rules.vocabulary import STATUS_ERROR, STATUS_JUDGED

if TYPE_CHECKING:
    from filter_pipeline.judge.config import LLMJudgeConfig

__all__ = ["EndpointRefused", "JudgeClient", "JudgeSetupError", "judge_prompts", "ssl_context"]

REFUSAL_MAX_CHARS = 300  # of a model's refusal, quoted in the verdict's why
REPAIR_PROMPT = (
    'Your reply held no verdict I could read. Answer with only the JSON object {"passed": true or false, '
    '"why": "<one short sentence>"}, nothing else.'
)

_MENTIONS_SCHEMA = re.compile(r"response_format|json_schema|json schema|structured output|guided", re.IGNORECASE)


@dataclass
class Vote:
    passed: bool | None = None  # None: no valid vote within the task's budget
    why: str = ""
    error: str | None = None
    parts: Parts = field(default_factory=Parts)
    refused: bool = False  # the model or the endpoint declined: asked again, the prompt would be declined too


@dataclass
class TaskVerdict:
    passed: bool | None  # None: unjudged
    why: str
    votes: str | None  # "P/N" with N = config.votes; None when unjudged
    status: str  # STATUS_JUDGED or STATUS_ERROR
    requests: int  # HTTP requests made for this task (retries included)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens when the server reports it, else 0
    latency_ms: float  # from the task's first request to its verdict
    call_latencies_ms: list[float]
    raw_replies: str  # JSON list of the replies, each cut to RAW_REPLY_MAX_CHARS
    replies_sha256: str
    # the verdict's parts (prompt v3; None where the votes do not say): see combine_parts
    success: bool | None = None
    side_effects: bool | None = None
    looping: bool | None = None
    blocked: bool | None = None
    score: int | None = None
    key_points: str | None = None  # JSON list of texts
    reasoning: str | None = None  # cut to REASONING_MAX_CHARS


def majority(votes: list[Vote], n: int) -> tuple[bool | None, str, str | None, str]:
    """(passed, why, "P/N", status) of `n` votes: passes > n/2 passes; fails >= n/2 fails (a tie fails);
    otherwise unjudged, with a why naming the first vote's trouble."""
    passes = [v for v in votes if v.passed is True]
    fails = [v for v in votes if v.passed is False]
    if 2 * len(passes) > n:
        return True, passes[0].why, votes_text(len(passes), n), STATUS_JUDGED
    if 2 * len(fails) >= n:
        return False, fails[0].why, votes_text(len(passes), n), STATUS_JUDGED
    errors = [v.error for v in votes if v.error]
    if n == 1 and errors:
        return None, errors[0], None, STATUS_ERROR
    unanswered = n - len(passes) - len(fails)
    reason = f"no majority of {n} votes: {len(passes)} pass, {len(fails)} fail, {unanswered} without an answer"
    return None, f"{reason} ({errors[0]})" if errors else reason, None, STATUS_ERROR


def combine_parts(votes: list[Vote], passed: bool | None) -> dict:
    """The parts of a verdict reached by `votes`: each boolean part is the majority of the answered votes
    that give it (a tie, or no vote giving it: None), `score` the median of the scores given (the lower
    middle one of an even count, so always a score a vote gave); `key_points` and `reasoning` are those of
    the vote whose `why` the verdict carries (the first vote on the winning side). All None when unjudged."""
    if passed is None:
        return dict.fromkeys(VERDICT_PARTS)
    answered = [v.parts for v in votes if v.passed is not None]
    out: dict = {}
    for name in VERDICT_FLAGS:
        said = [getattr(p, name) for p in answered if getattr(p, name) is not None]
        yes, no = sum(said), len(said) - sum(said)
        out[name] = True if yes > no else False if no > yes else None
    scores = [p.score for p in answered if p.score is not None]
    out["score"] = statistics.median_low(scores) if scores else None
    lead = next(v.parts for v in votes if v.passed is passed)
    out["key_points"] = json.dumps(lead.key_points, ensure_ascii=False) if lead.key_points is not None else None
    out["reasoning"] = lead.reasoning  # (cut to REASONING_MAX_CHARS by the client, once the key is redacted)
    return out


async def _all(coros: Iterable[Awaitable]) -> list:
    """Results of `coros`, run at once; the first exception cancels the others and propagates."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class JudgeClient:
    """One per endpoint and materialization: one HTTP transport (one aiohttp session, one rate controller
    shared by every request), the votes of each task and the repair of replies that hold no verdict.

    `async with JudgeClient(config) as client: verdict = await client.judge(messages)`; `report` is told
    endpoint trouble as it happens (a line per REPORT_EVERY_SECONDS at most). Settings that cannot work raise
    ValueError here, before any request."""

    def __init__(self, config: "LLMJudgeConfig", report: Callable[[str], None] | None = None):
        config.check()
        self.config = config
        self.schema = prompt_of(config.prompt_version)[1]  # (asked for in structured-output requests)
        self.http = Transport(config, report)
        self.structured = config.structured_output
        self.n_ok: bool | None = None  # does the server honour n > 1? None: not known yet
        self.answered_without_n = False  # after a 5xx to a request asking n (`_learn_n`)

    async def __aenter__(self) -> "JudgeClient":
        await self.http.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()

    async def judge(self, messages: list[dict]) -> TaskVerdict:
        """Never raises for per-task trouble (that is status error); raises EndpointRefused once the endpoint
        has refused (after at most PROBE_REQUESTS requests over the whole client if it refuses from the
        start: the first refusal stops new requests from starting)."""
        task = TaskBudget(self.config.task_budget_seconds)
        votes = await self._votes(messages, task)
        passed, why, tally, status = majority(votes, self.config.votes)
        parts = combine_parts(votes, passed)
        parts["key_points"] = self.config.redact(parts["key_points"])
        parts["reasoning"] = self.config.redacted(parts["reasoning"], REASONING_MAX_CHARS)
        replies = [self.config.redacted(reply, RAW_REPLY_MAX_CHARS) for reply in task.replies]
        return TaskVerdict(
            passed=passed, why=self.config.redact(why), votes=tally, status=status, requests=task.requests,
            prompt_tokens=sum(u.prompt_tokens for u in task.usage),
            completion_tokens=sum(u.completion_tokens for u in task.usage),
            cached_tokens=sum(u.cached_tokens for u in task.usage),
            latency_ms=(time.monotonic() - task.started) * 1000 if task.started is not None else 0.0,
            call_latencies_ms=task.latencies_ms,
            raw_replies=json.dumps(replies, ensure_ascii=False),
            replies_sha256=hashlib.sha256(json.dumps(task.replies, ensure_ascii=False).encode()).hexdigest(), **parts,
        )  # fmt: skip

    # --- votes ------------------------------------------------------------------------------------------

    async def _votes(self, messages: list[dict], task: TaskBudget) -> list[Vote]:
        n = self.config.votes
        if n == 1:
            return [await self._vote(messages, task)]
        if self.n_ok is False:  # (one vote first: a prompt the model declines is not asked, and paid, n times)
            first = await self._vote(messages, task)
            return (
                [first] * n if first.refused else [first, *await _all(self._vote(messages, task) for _ in range(n - 1))]
            )
        try:
            choices = await self._ask(messages, task, n=n)
        except Unanswered as exc:
            return [Vote(error=str(exc))] * n
        if choices[0].withheld == NO_CHOICES:  # the request itself refused: so is every sample, and n is not known
            return [await self._read(messages, choices[0], task)] * n
        got = await _all(self._read(messages, c, task) for c in choices[:n])
        refused = next((vote for vote in got if vote.refused), None)
        if refused is not None:  # (the votes not sent: asked, the prompt would be declined the same way, and paid)
            return got + [refused] * (n - len(got))
        return got + await _all(self._vote(messages, task) for _ in range(n - len(got)))

    async def _vote(self, messages: list[dict], task: TaskBudget) -> Vote:
        try:
            choices = await self._ask(messages, task, n=1)
        except Unanswered as exc:
            return Vote(error=str(exc))
        return await self._read(messages, choices[0], task)

    async def _read(self, messages: list[dict], choice: Choice, task: TaskBudget) -> Vote:
        """The vote in `choice`; when it holds none, one repair request: the reply is sent back with a
        request for only the JSON object (more tokens when it was cut off). Never the same request again."""
        task.replies.append(choice.text or "")
        if choice.filtered:  # (what the filter let through may stop anywhere: it is not the model's answer)
            return Vote(error=self._refusal(choice), refused=True)
        verdict = parse_reply(choice.text, choice.cut_off)
        if verdict is not None:
            return Vote(verdict.passed, verdict.why, parts=verdict.parts)
        if choice.refused:  # no repair request: it would be declined the same way, and paid for
            return Vote(error=self._refusal(choice), refused=True)
        said = strip_reasoning(choice.text or "").strip()
        follow_up = [*messages, *([{"role": "assistant", "content": said}] if said else [])]
        follow_up.append({"role": "user", "content": REPAIR_PROMPT})
        trouble = (
            f"the reply was cut off at the token limit (finish_reason length, max {self._max_tokens(1) or 'default'})"
            if choice.cut_off
            else 'the reply held no JSON object with a boolean "passed"'
        )
        try:
            [repaired, *_] = await self._ask(follow_up, task, n=1, token_factor=2 if choice.cut_off else 1)
        except Unanswered as exc:
            return Vote(error=f"{trouble}; its repair got no answer: {exc}")
        task.replies.append(repaired.text or "")
        if repaired.filtered:
            return Vote(error=f"{trouble}; its repair was stopped: {self._refusal(repaired)}", refused=True)
        verdict = parse_reply(repaired.text, repaired.cut_off)
        if verdict is not None:
            return Vote(verdict.passed, verdict.why, parts=verdict.parts)
        again = "was cut off too" if repaired.cut_off else "held none either"
        return Vote(error=f"{trouble}; the repair request {again}")

    def _refusal(self, choice: Choice) -> str:
        """The why of a refused vote: the model's own words, else what the completion withheld and its
        finish_reason."""
        said = self.config.redacted(choice.refusal or "", REFUSAL_MAX_CHARS, single_line=True)
        if said:
            return f"the judge model refused to answer: {said}"
        how = [choice.withheld] if choice.withheld else []
        reason = choice.finish_reason
        if isinstance(reason, str) and reason.strip():
            how.append(f"finish_reason {self.config.redacted(reason, REFUSAL_MAX_CHARS, single_line=True)}")
        return "the judge model refused to answer" + (f" ({', '.join(how)})" if how else "")

    def _rejects_5xx(self, body: dict) -> bool:
        """A 5xx to a request asking n > 1 samples, before n ever worked, may be n's rejection (llama.cpp
        answers 500; a gateway's 502/503/504 is retried as the fault it is): `_ask` asks it again without n."""
        return body.get("n", 1) > 1 and self.n_ok is not True

    def _learn_n(self, sent: dict, n: int, choices: list[Choice], after_5xx: bool) -> None:
        """What an answer to a request for `n` > 1 samples says of n. Fewer choices than asked to a request
        asking n: the server ignores n. An answer without n after a 400/422 to it: the server rejects n. An
        answer without n after a 5xx says nothing yet: a server's passing error must not turn n off for the
        client's lifetime, every vote then paying for the prompt again (a 5xx to a request asking n after such
        an answer is n's rejection, `_ask`). Once n worked, a late answer to a request asked without n says
        nothing of n."""
        if "n" in sent and len(choices) >= n:
            self.n_ok = True
        elif self.n_ok is None and ("n" in sent or not after_5xx):
            self.n_ok = False
        elif self.n_ok is None:
            self.answered_without_n = True

    # --- one completion ---------------------------------------------------------------------------------

    def _max_tokens(self, factor: int) -> int:
        return self.config.max_tokens * factor

    def _body(self, messages: list[dict], n: int, token_factor: int, structured: bool) -> dict:
        s = self.config
        body: dict[str, Any] = {"model": s.model, "messages": messages}
        if not s.reasoning_model:
            body["temperature"] = s.temperature
        if s.max_tokens > 0:
            body["max_completion_tokens" if s.reasoning_model else "max_tokens"] = self._max_tokens(token_factor)
        if n > 1:
            body["n"] = n
        if structured:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": self.schema, "strict": True},
            }
        return body

    async def _ask(self, messages: list[dict], task: TaskBudget, n: int, token_factor: int = 1) -> list[Choice]:
        """The choices of one completion (at least one; fewer than `n` once `n` is known not to work).
        Downgrades what the server rejects, for the client's lifetime: structured output (a 400/422 naming
        it, or one that goes away without it) and n (`_learn_n`: a 400/422 before n ever worked that goes away
        without it, or a 5xx but a gateway's after a request asked again without n for one was answered; a 400
        of this prompt alone, as a context length, leaves n as it was). What a request carries is decided when
        it gets its slot, so every request that starts after a downgrade has it. Raises Unanswered,
        EndpointRefused."""
        without_schema = without_n = after_5xx = False

        def body() -> dict:
            asked = n if self.n_ok is not False and not without_n else 1
            return self._body(messages, asked, token_factor, self.structured and not without_schema)

        while True:
            sent, result = await self.http.send(body, task, self._rejects_5xx)
            if isinstance(result, Rejected):
                sent_schema = "response_format" in sent
                if sent_schema and _MENTIONS_SCHEMA.search(result.text):
                    self.structured = False
                    continue
                if (
                    sent.get("n", 1) > 1
                    and self.n_ok is not True
                    and (result.status in (400, 422) or result.status >= 500)
                ):
                    without_n = True  # (the caller then knows n is not taken, from the one choice it gets)
                    after_5xx = result.status >= 500
                    if after_5xx and self.answered_without_n:
                        self.n_ok = False  # (the server answers without n, and again not with it)
                    continue
                if sent_schema and result.status in (400, 422):
                    without_schema = True
                    continue
                raise Unanswered(f"HTTP {result.status} from the judge endpoint: {self.http.server_text(result.text)}")
            choices, usage = result
            task.usage.append(usage)
            if without_schema:
                self.structured = False  # the same request went through without it
            if n > 1 and choices[0].withheld != NO_CHOICES:  # (a refused request says nothing of n)
                self._learn_n(sent, n, choices, after_5xx)
            return choices


def judge_prompts(prompts: list[list[dict]], config: "LLMJudgeConfig") -> list[TaskVerdict]:
    """One verdict per prompt, in order, through one JudgeClient. Per-task trouble is status error; a
    refusing endpoint raises EndpointRefused."""
    if not prompts:
        return []

    async def run() -> list[TaskVerdict]:
        async with JudgeClient(config) as client:
            return await _all(client.judge(m) for m in prompts)

    return asyncio.run(run())
