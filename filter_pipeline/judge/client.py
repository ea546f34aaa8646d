"""Asking the judge model: the chat messages of one task in, one verdict out.

Speaks the OpenAI chat-completions protocol (`POST {base_url}/chat/completions`), which vLLM, SGLang,
llama.cpp server, Ollama, LiteLLM and hosted APIs all serve. The client is aiohttp: at 64 requests in flight
httpx's async pool reached 14% of the ideal rate here, aiohttp 95% (benchmarks/judge_throughput.py).

What a task costs: one request at the defaults (one vote at temperature 0). N votes at a temperature above 0
are N samples of one request (`n`), or N requests where the server ignores or rejects `n`. An unparseable
reply is never asked again identically: the reply is repaired by one follow-up request that differs from the
first, and structured output (`response_format` with a JSON schema) is asked for where the server takes it.

What the endpoint is spared: every request of a client passes one rate controller: an adaptive concurrency
window (halved on 429, grown back by one per `GROW_AFTER_SUCCESSES` successes, never above `concurrency`) and
one shared "not before" time, so a retry hint pauses every request, not only the one that got it. Transient
faults (408, 409, 429, 5xx, transport errors, replies that are not a completion) are retried against a
per-task time budget, backing off without holding a slot. A refusal (401, 403, 404, an unknown model) stops
the whole client: `EndpointRefused`.
"""

import asyncio
import hashlib
import json
import math
import os
import random
import re
import ssl
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from filter_pipeline.judge.prompt import PROMPT_VERSION, prompt_of
from filter_pipeline.judge.replies import (
    PART_FLAGS,
    Choice,
    Parts,
    Usage,
    error_message,
    parse_reply,
    read_completion,
    retry_hint,
    strip_reasoning,
)  # fmt: skip
from filter_pipeline.rules.schemas import REASONING_MAX_CHARS, STATUS_ERROR, STATUS_JUDGED

if TYPE_CHECKING:  # aiohttp itself is imported when a client opens: gate-judged runs never load it
    import aiohttp

RAW_REPLY_MAX_CHARS = 500
SERVER_TEXT_MAX_CHARS = 300
# Until the endpoint has answered one request, at most this many are in flight: a refusing endpoint costs
# that many requests whatever `concurrency` is (and a working one loses one round trip of ramp-up).
PROBE_REQUESTS = 4
# Additive increase of the concurrency window. Small enough that a window halved by a burst of 429s regrows
# within one rate-limit period (a rate limit, unlike a concurrency limit, is best met with a full window).
GROW_AFTER_SUCCESSES = 2
# While the endpoint is down, one task not yet asked is asked this often anyway, so that a recovery is seen.
PROBE_INTERVAL_SECONDS = 30.0

REPAIR_PROMPT = (
    'Your reply held no verdict I could read. Answer with only the JSON object {"passed": true or false, '
    '"why": "<one short sentence>"}, nothing else.'
)

_MENTIONS_SCHEMA = re.compile(r"response_format|json_schema|json schema|structured output|guided", re.IGNORECASE)
_MENTIONS_N = re.compile(r"\bn\b|choice", re.IGNORECASE)
_UNKNOWN_MODEL = re.compile(
    r"model_not_found|(?:unknown|invalid|no such)\s+model|\b(?:model|deployment)\b[^.]{0,120}?"
    r"(?:does not exist|doesn't exist|not found|is unknown)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class LLMSettings:
    """How the judge model is asked. Invalid combinations are refused here, before any request."""

    base_url: str
    model: str
    api_key: str | None = None
    votes: int = 1
    concurrency: int = 16
    timeout_seconds: float = 60.0  # one request
    temperature: float = 0.0
    max_tokens: int = 800  # 0: not sent (the server's default applies); the answer reasons before its verdict
    prompt_version: str = PROMPT_VERSION
    max_prompt_chars: int = 24_000  # about 6k tokens
    include_screenshot: bool = False
    task_budget_seconds: float = 600.0  # retries of one task stop once it has spent this long
    reasoning_model: bool = False  # max_completion_tokens instead of max_tokens, and no temperature
    structured_output: bool = True  # response_format with a JSON schema, until the server rejects it
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 8.0

    def __post_init__(self) -> None:
        if self.votes < 1:
            raise ValueError(f"judge votes={self.votes}: at least 1")
        if self.votes > 1 and self.temperature <= 0 and not self.reasoning_model:
            raise ValueError(
                f"judge votes={self.votes} at temperature={self.temperature}: identical samples at temperature 0 "
                "cannot disagree; set votes=1, or a temperature above 0 (e.g. 0.7) for a majority of samples"
            )
        if self.concurrency < 1:
            raise ValueError(f"judge concurrency={self.concurrency}: at least 1")
        if self.max_tokens < 0:
            raise ValueError(f"judge max_tokens={self.max_tokens}: 0 (not sent) or more")
        if not self.task_budget_seconds > 0 or not self.timeout_seconds > 0:
            raise ValueError("judge task_budget_seconds and timeout_seconds must be above 0")


class JudgeSetupError(ValueError):
    """A judge setting the client cannot work with (an unreadable SSL_CERT_FILE): one line naming it."""


class EndpointRefused(Exception):
    """401, 403, 404 or an unknown model: retrying cannot help. str() is one line naming the endpoint URL
    (no credentials) and the HTTP status and the server's short message; never the API key."""


@dataclass
class Vote:
    passed: bool | None = None  # None: no valid vote within the task's budget
    why: str = ""
    error: str | None = None
    parts: Parts = field(default_factory=Parts)


@dataclass
class TaskVerdict:
    passed: bool | None  # None: unjudged
    why: str
    votes: str | None  # "P/N" with N = settings.votes; None when unjudged
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
        return True, passes[0].why, f"{len(passes)}/{n}", STATUS_JUDGED
    if 2 * len(fails) >= n:
        return False, fails[0].why, f"{len(passes)}/{n}", STATUS_JUDGED
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
        return {name: None for name in (*PART_FLAGS, "score", "key_points", "reasoning")}
    answered = [v.parts for v in votes if v.passed is not None]
    out: dict = {}
    for name in PART_FLAGS:
        said = [getattr(p, name) for p in answered if getattr(p, name) is not None]
        yes, no = sum(said), len(said) - sum(said)
        out[name] = True if yes > no else False if no > yes else None
    scores = [p.score for p in answered if p.score is not None]
    out["score"] = statistics.median_low(scores) if scores else None
    lead = next(v.parts for v in votes if v.passed is passed)
    out["key_points"] = json.dumps(lead.key_points, ensure_ascii=False) if lead.key_points is not None else None
    out["reasoning"] = lead.reasoning[:REASONING_MAX_CHARS] if lead.reasoning is not None else None
    return out


def ssl_context() -> ssl.SSLContext:
    """The system's trusted certificates, plus the CA bundle that SSL_CERT_FILE names (a corporate proxy's CA,
    say), as curl and the OpenAI SDK honour it. Raises JudgeSetupError (one line) when that file cannot be read."""
    context = ssl.create_default_context()
    bundle = os.environ.get("SSL_CERT_FILE")
    if bundle:
        try:
            context.load_verify_locations(cafile=bundle)
        except (OSError, ssl.SSLError) as exc:
            raise JudgeSetupError(
                f"SSL_CERT_FILE={bundle}: not a readable CA bundle ({exc.__class__.__name__})"
            ) from None
    return context


# --- one task's accounting ----------------------------------------------------------------------------


class _Unanswered(Exception):
    """This request (so this vote) got no answer: budget spent, or a rejection retrying cannot fix."""


class _NRejected(Exception):
    """The server does not take `n` > 1."""


@dataclass
class _Rejected:
    status: int
    text: str


@dataclass
class _Task:
    budget: float
    deadline: float = math.inf
    started: float | None = None  # time.monotonic() of its first request
    requests: int = 0
    usage: list[Usage] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)

    def start(self, now: float) -> None:
        """The budget runs from the first request (or the first wait the endpoint imposed), never while the
        task only queues for a slot behind other tasks."""
        if self.started is None:
            self.started, self.deadline = now, now + self.budget


# --- the rate controller ------------------------------------------------------------------------------


class RateController:
    """One per client: every request of every task acquires a slot here first."""

    def __init__(self, concurrency: int, budget: float):
        self.limit = concurrency
        self.window = float(concurrency)
        self.budget = budget
        self.in_flight = 0
        self.not_before = 0.0  # time.monotonic() before which no request starts
        self.epoch = 0  # bumped by each decrease: the 429s of one burst halve the window once
        self.successes = 0
        self.verified = False  # the endpoint has answered a request
        self.refused: EndpointRefused | None = None
        self.last_success = -math.inf  # time.monotonic()
        self.down = False  # a task spent its whole budget without any request succeeding meanwhile
        self.probe_at = math.inf  # while down, the next time one task not yet asked is asked anyway
        self.last_problem = ""
        self._waiters: deque[asyncio.Future] = deque()

    def _open(self) -> int:
        cap = self.limit if self.verified else min(self.limit, PROBE_REQUESTS)
        return min(int(self.window), cap) - self.in_flight

    async def acquire(self, task: _Task) -> int:
        """A slot for one request of `task` (release() it); returns the window's epoch. Waits out the shared
        pause, within the task's budget."""
        while True:
            if self.refused is not None:
                raise EndpointRefused(str(self.refused))  # a fresh one: a re-raised instance grows its traceback
            now = time.monotonic()
            if task.started is None and self.down and now >= self.probe_at:
                self.probe_at = now + min(self.budget, PROBE_INTERVAL_SECONDS)
                task.start(now)  # this task probes
            elif task.started is None and self.down:
                raise _Unanswered(
                    f"not asked: the judge endpoint has answered nothing for a whole task budget "
                    f"({self.budget:.0f} s; last: {self.last_problem})"
                )
            if now < self.not_before:
                task.start(now)
                if self.not_before >= task.deadline:
                    raise _Unanswered(
                        f"{self.last_problem} (the endpoint asked to wait {self.not_before - now:.1f} s, "
                        f"past this task's budget of {task.budget:.0f} s; {task.requests} requests made)"
                    )
                await asyncio.sleep(self.not_before - now)
                continue
            if self._open() > 0:
                self.in_flight += 1
                task.start(now)
                return self.epoch
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:  # cancelled (a sibling vote raised): never strand a wake-up meant for a slot
                if waiter.done() and not waiter.cancelled():
                    self._wake()
                else:
                    waiter.cancel()
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                raise

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self, everyone: bool = False) -> None:
        room = len(self._waiters) if everyone else self._open()
        while room > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1

    def succeeded(self) -> None:
        self.verified = True
        self.down = False
        self.last_success = time.monotonic()
        self.successes += 1
        if self.successes >= GROW_AFTER_SUCCESSES:
            self.successes = 0
            self.window = min(float(self.limit), self.window + 1)
        self._wake()

    def failed(self, problem: str) -> None:
        self.last_problem = problem

    def gave_up(self, task: _Task) -> None:
        """`task` spent its budget on faults; if no request succeeded meanwhile, the endpoint is down: tasks
        not yet asked end unjudged at once (judged again later) instead of each spending a budget, but for
        one probe every PROBE_INTERVAL_SECONDS (or budget), whose success ends the outage."""
        if task.started is not None and self.last_success < task.started and not self.down:
            self.down = True
            self.probe_at = time.monotonic() + min(self.budget, PROBE_INTERVAL_SECONDS)

    def throttled(self, epoch: int) -> None:
        """A 429: halve the window, once for all the requests that started in the same window."""
        if epoch == self.epoch:
            self.epoch += 1
            self.window = max(1.0, self.window / 2)
            self.successes = 0

    def pause(self, seconds: float) -> None:
        self.not_before = max(self.not_before, time.monotonic() + seconds)

    def refuse(self, exc: EndpointRefused) -> None:
        self.refused = exc
        self._wake(everyone=True)


# --- the client ---------------------------------------------------------------------------------------


def public_url(url: str) -> str:
    """`url` without credentials or query (userinfo, `?api-key=`)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


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
    """One per endpoint and materialization: one aiohttp session, one rate controller shared by every request.

    `async with JudgeClient(settings) as client: verdict = await client.judge(messages)`; `verdict_schema`
    replaces the prompt version's answer schema in structured-output requests (a prompt asking for other reasoning fields)."""

    def __init__(self, settings: LLMSettings, verdict_schema: dict | None = None):
        self.settings = settings
        self.schema = verdict_schema or prompt_of(settings.prompt_version)[1]
        self.url = settings.base_url.rstrip("/") + "/chat/completions"
        self.public_url = public_url(self.url)
        if settings.api_key and urlsplit(self.url).password is not None:
            self.url = self.public_url  # the bearer token authenticates; aiohttp refuses both at once
        self.headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.rate = RateController(settings.concurrency, settings.task_budget_seconds)
        self.structured = settings.structured_output
        self.n_ok: bool | None = None  # does the server honour n > 1? None: not known yet
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "JudgeClient":
        import aiohttp

        self._aiohttp = aiohttp
        self.transport_errors = (aiohttp.ClientError, asyncio.TimeoutError)
        # trust_env: HTTPS_PROXY / HTTP_PROXY / NO_PROXY (and ~/.netrc), as curl and the OpenAI SDK honour them
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.settings.concurrency, ssl=ssl_context()),
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout_seconds),
            trust_env=True,
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def judge(self, messages: list[dict]) -> TaskVerdict:
        """Never raises for per-task trouble (that is status error); raises EndpointRefused once the endpoint
        has refused (after at most PROBE_REQUESTS requests over the whole client if it refuses from the
        start: the first refusal stops new requests from starting)."""
        task = _Task(self.settings.task_budget_seconds)
        votes = await self._votes(messages, task)
        passed, why, tally, status = majority(votes, self.settings.votes)
        parts = combine_parts(votes, passed)
        for name in ("key_points", "reasoning"):
            parts[name] = self._redact(parts[name])
        replies = task.replies
        return TaskVerdict(
            passed=passed, why=self._redact(why), votes=tally, status=status, requests=task.requests,
            prompt_tokens=sum(u.prompt_tokens for u in task.usage),
            completion_tokens=sum(u.completion_tokens for u in task.usage),
            cached_tokens=sum(u.cached_tokens for u in task.usage),
            latency_ms=(time.monotonic() - task.started) * 1000 if task.started is not None else 0.0,
            call_latencies_ms=task.latencies_ms,
            raw_replies=self._redact(json.dumps([r[:RAW_REPLY_MAX_CHARS] for r in replies], ensure_ascii=False)),
            replies_sha256=hashlib.sha256(json.dumps(replies, ensure_ascii=False).encode()).hexdigest(), **parts,
        )  # fmt: skip

    # --- votes ------------------------------------------------------------------------------------------

    async def _votes(self, messages: list[dict], task: _Task) -> list[Vote]:
        n = self.settings.votes
        if n == 1 or self.n_ok is False:
            return await _all(self._vote(messages, task) for _ in range(n))
        try:
            choices = await self._ask(messages, task, n=n)
        except _NRejected:
            choices = []
        except _Unanswered as exc:
            return [Vote(error=str(exc))] * n
        if choices:
            self.n_ok = len(choices) >= n  # fewer choices: the server ignores n
        got = await _all(self._read(messages, c, task) for c in choices[:n])
        return got + await _all(self._vote(messages, task) for _ in range(n - len(got)))

    async def _vote(self, messages: list[dict], task: _Task) -> Vote:
        try:
            choices = await self._ask(messages, task, n=1)
        except _Unanswered as exc:
            return Vote(error=str(exc))
        return await self._read(messages, choices[0], task)

    async def _read(self, messages: list[dict], choice: Choice, task: _Task) -> Vote:
        """The vote in `choice`; when it holds none, one repair request: the reply is sent back with a
        request for only the JSON object (more tokens when it was cut off). Never the same request again."""
        task.replies.append(choice.text or "")
        verdict = parse_reply(choice.text)
        if verdict is not None:
            return Vote(verdict.passed, verdict.why, parts=verdict.parts)
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
        except _Unanswered as exc:
            return Vote(error=f"{trouble}; its repair got no answer: {exc}")
        task.replies.append(repaired.text or "")
        verdict = parse_reply(repaired.text)
        if verdict is not None:
            return Vote(verdict.passed, verdict.why, parts=verdict.parts)
        again = "was cut off too" if repaired.cut_off else "held none either"
        return Vote(error=f"{trouble}; the repair request {again}")

    # --- one completion ---------------------------------------------------------------------------------

    def _max_tokens(self, factor: int) -> int:
        return self.settings.max_tokens * factor

    def _body(self, messages: list[dict], n: int, token_factor: int, structured: bool) -> dict:
        s = self.settings
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

    async def _ask(self, messages: list[dict], task: _Task, n: int, token_factor: int = 1) -> list[Choice]:
        """The choices of one completion (at least one; fewer than `n` once `n` is known not to work).
        Downgrades what the server rejects, for the client's lifetime: structured output (a 400/422 naming
        it, or one that goes away without it), n (400/422, or a 5xx before n ever worked: llama.cpp answers
        500). What a request carries is decided when it gets its slot, so every request that starts after a
        downgrade has it. Raises _NRejected, _Unanswered, EndpointRefused."""
        without_schema = False

        def body() -> dict:
            asked = n if self.n_ok is not False else 1
            return self._body(messages, asked, token_factor, self.structured and not without_schema)

        while True:
            sent, result = await self._send(body, task)
            if isinstance(result, _Rejected):
                sent_schema = "response_format" in sent
                if sent_schema and _MENTIONS_SCHEMA.search(result.text):
                    self.structured = False
                    continue
                if sent.get("n", 1) > 1 and (result.status in (400, 422) or result.status >= 500):
                    self.n_ok = False
                    raise _NRejected
                if sent_schema and result.status in (400, 422):
                    without_schema = True
                    continue
                raise _Unanswered(f"HTTP {result.status} from the judge endpoint: {self._server_text(result.text)}")
            choices, usage = result
            task.usage.append(usage)
            if without_schema:
                self.structured = False  # the same request went through without it
            return choices

    async def _send(
        self, make_body: Callable[[], dict], task: _Task
    ) -> tuple[dict, tuple[list[Choice], Usage] | _Rejected]:
        """(the body sent, one completion), retrying transient faults within the task's budget; a rejection
        that retrying cannot fix comes back as _Rejected (a refusal raises EndpointRefused)."""
        aiohttp = self._aiohttp
        s = self.settings
        tries = 0
        problem = ""
        while True:
            epoch = await self.rate.acquire(task)
            body = make_body()
            task.requests += 1
            tries += 1
            status, headers, text, before, problem = None, {}, "", problem, ""
            start = time.perf_counter()
            try:
                timeout = max(min(s.timeout_seconds, task.deadline - time.monotonic()), 0.001)
                async with self.session.post(
                    self.url, json=body, headers=self.headers, timeout=aiohttp.ClientTimeout(total=timeout)
                ) as response:
                    # The status counts only with its whole body: a body cut off by the timeout is a
                    # timeout, not an empty answer from the server.
                    data = await response.read()
                    status, headers = response.status, dict(response.headers)
                    text = data.decode("utf-8", errors="replace")
            except self.transport_errors as exc:
                if isinstance(exc, asyncio.TimeoutError) and timeout < s.timeout_seconds and before:
                    # Cut short by the task's budget, this timeout says nothing about the endpoint; what it
                    # answered before does.
                    problem = f"{before}; the task budget ran out during the next request"
                elif isinstance(exc, asyncio.TimeoutError):
                    problem = f"timeout ({timeout:.1f} s) waiting for the judge endpoint"
                else:
                    problem = f"{type(exc).__name__} talking to the judge endpoint"
            finally:
                task.latencies_ms.append((time.perf_counter() - start) * 1000)
                self.rate.release()

            hint = None
            if status is not None and 200 <= status < 300:
                try:
                    completion = read_completion(json.loads(text))
                except ValueError:
                    completion = None
                if completion is not None:
                    self.rate.succeeded()
                    return body, completion
                problem = f"HTTP {status} from the judge endpoint is not a chat completion: {self._server_text(text)}"
            elif status is not None and self._refusal(status, text):
                refused = self._refused(status, text)
                self.rate.refuse(refused)
                raise refused
            elif status == 429 or (status is not None and (status in (408, 409) or status >= 500)):
                if status >= 500 and body.get("n", 1) > 1 and self.n_ok is not True:
                    return body, _Rejected(status, text)
                hint = retry_hint(headers)
                if status == 429:
                    self.rate.throttled(epoch)
                if hint is not None and status in (429, 503):
                    self.rate.pause(hint)
                problem = f"HTTP {status} from the judge endpoint: {self._server_text(text)}"
            elif status is not None:
                return body, _Rejected(status, text)
            self.rate.failed(problem)
            base = min(s.backoff_max_seconds, s.backoff_initial_seconds * 2 ** (tries - 1))
            wait = hint if hint is not None else base / 2 + random.uniform(0, base / 2)
            if time.monotonic() + wait >= task.deadline:
                self.rate.gave_up(task)
                spent = time.monotonic() - (task.started or time.monotonic())
                raise _Unanswered(
                    f"{problem} (gave up after {task.requests} requests in {spent:.1f} s; "
                    f"task budget {task.budget:.0f} s)"
                )
            if not (hint is not None and status in (429, 503)):  # a shared pause is waited out in acquire()
                await asyncio.sleep(wait)

    # --- refusals and server text -----------------------------------------------------------------------

    def _refusal(self, status: int, text: str) -> bool:
        return status in (401, 403, 404) or (status == 400 and bool(_UNKNOWN_MODEL.search(error_message(text))))

    def _refused(self, status: int, text: str) -> EndpointRefused:
        todo = {401: "check FILTER_JUDGE_API_KEY", 403: "check FILTER_JUDGE_API_KEY and its permissions"}.get(
            status, "check FILTER_JUDGE_BASE_URL and FILTER_JUDGE_MODEL"
        )
        return EndpointRefused(
            f"the judge endpoint {self.public_url} refused the request for model {self.settings.model!r}: "
            f"HTTP {status}: {self._server_text(text)} ({todo})"
        )

    def _server_text(self, text: str) -> str:
        message = error_message(text)
        if len(message) > SERVER_TEXT_MAX_CHARS:
            message = message[:SERVER_TEXT_MAX_CHARS] + "..."
        return self._redact(message) or "(empty body)"

    def _redact(self, text: str) -> str:
        key = self.settings.api_key
        return text.replace(key, "***") if key and text else text


def judge_prompts(
    prompts: list[list[dict]], settings: LLMSettings, on_done: Callable[[int], None] = lambda n: None
) -> list[TaskVerdict]:
    """One verdict per prompt, in order, through one JudgeClient. Per-task trouble is status error; a
    refusing endpoint raises EndpointRefused."""
    if not prompts:
        return []

    async def run() -> list[TaskVerdict]:
        async with JudgeClient(settings) as client:
            done = 0

            async def one(messages: list[dict]) -> TaskVerdict:
                nonlocal done
                verdict = await client.judge(messages)
                done += 1
                on_done(done)
                return verdict

            return await _all(one(m) for m in prompts)

    return asyncio.run(run())
