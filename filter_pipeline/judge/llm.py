"""The LLM judge's client: how the model is asked (votes, retries, bounded concurrency), and how its
replies become one verdict per task. (What it is shown: `judge.prompt`.)

`JudgeClient`, `TaskVerdict` and `EndpointRefused` are the interface the per-batch driver (`judge.driver`)
codes against; this module adapts the v1 asker to that shape until the rewritten client takes its place.

Speaks the OpenAI chat-completions protocol (`POST {base_url}/chat/completions`), which vLLM, SGLang,
llama.cpp server, Ollama and hosted APIs all serve. The client is aiohttp: at 64 requests in flight httpx's
async pool reached 14% of the ideal rate here, aiohttp 95% (see benchmarks/judge_throughput.py).
"""

import asyncio
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from filter_pipeline.rules.schemas import STATUS_ERROR, STATUS_JUDGED

if TYPE_CHECKING:  # aiohttp itself is imported when a judge first asks: gate-judged runs never load it
    import aiohttp

RAW_REPLY_MAX_CHARS = 500
MAX_RETRY_AFTER_SECONDS = 60.0
REFUSED_STATUSES = (401, 403, 404)  # wrong key, no access, wrong URL or model: asking again cannot help


@dataclass(frozen=True)
class LLMSettings:
    base_url: str
    model: str
    api_key: str | None = None
    votes: int = 3
    concurrency: int = 16
    timeout_seconds: float = 60.0
    temperature: float = 0.0
    max_tokens: int = 300
    max_attempts: int = 5  # per vote: HTTP faults and unparseable replies both spend it
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 8.0


# --- reading a reply --------------------------------------------------------------------------------

_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)


def parse_reply(text: str | None) -> tuple[bool, str] | None:
    """(passed, why) from a reply holding {"passed": bool, "why": str}, bare, fenced, or inside prose."""
    if not text:
        return None
    candidates = [m.group(1) for m in _FENCED.finditer(text)] + [text.strip()]
    decoder = json.JSONDecoder()
    candidates += [text[m.start():] for m in re.finditer(r"\{", text)]
    for candidate in candidates:
        try:
            value, _ = decoder.raw_decode(candidate)
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("passed"), bool) and isinstance(value.get("why"), str):
            return value["passed"], value["why"]
    return None


# --- asking -----------------------------------------------------------------------------------------


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class _Unparseable(Exception):
    pass


class _Fatal(Exception):
    """A reply that retrying cannot fix (400...)."""


class EndpointRefused(Exception):
    """The endpoint refuses every request (401, 403, 404, unknown model): judging stops. Its message is one
    line naming the endpoint and the status, never the key."""


@dataclass
class Vote:
    passed: bool | None = None  # None: no valid vote within the retry budget
    why: str = ""
    error: str | None = None
    replies: list[str] = field(default_factory=list)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latencies_ms: list[float] = field(default_factory=list)


@dataclass
class TaskVerdict:
    passed: bool | None
    why: str
    votes: str | None
    status: str  # STATUS_JUDGED / STATUS_ERROR
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_ms: float
    call_latencies_ms: list[float]
    raw_replies: str
    replies_sha256: str


def majority(votes: list[Vote], n: int) -> TaskVerdict:
    """Majority of `n` votes: passes > n/2 passes; fails >= n/2 fails (a tie fails); otherwise no verdict."""
    passes = [v for v in votes if v.passed is True]
    fails = [v for v in votes if v.passed is False]
    replies = [r for v in votes for r in v.replies]
    raw = json.dumps([r[:RAW_REPLY_MAX_CHARS] for r in replies], ensure_ascii=False)
    common = dict(
        requests=sum(v.requests for v in votes),
        prompt_tokens=sum(v.prompt_tokens for v in votes),
        completion_tokens=sum(v.completion_tokens for v in votes),
        cached_tokens=sum(v.cached_tokens for v in votes),
        latency_ms=0.0,
        call_latencies_ms=[ms for v in votes for ms in v.latencies_ms],
        raw_replies=raw,
        replies_sha256=hashlib.sha256(json.dumps(replies, ensure_ascii=False).encode()).hexdigest(),
    )
    if 2 * len(passes) > n:
        return TaskVerdict(True, passes[0].why, f"{len(passes)}/{n}", STATUS_JUDGED, **common)
    if 2 * len(fails) >= n:
        return TaskVerdict(False, fails[0].why, f"{len(passes)}/{n}", STATUS_JUDGED, **common)
    errors = [v.error for v in votes if v.error]
    reason = f"no majority of {n} votes: {len(passes)} pass, {len(fails)} fail, {len(errors)} without an answer"
    return TaskVerdict(None, f"{reason} ({errors[0]})" if errors else reason, None, STATUS_ERROR, **common)


class _Asker:
    """One HTTP client and one concurrency bound shared by every vote of a materialization."""

    def __init__(self, settings: LLMSettings, session: "aiohttp.ClientSession"):
        import aiohttp

        self.transport_errors = (aiohttp.ClientError, asyncio.TimeoutError)
        self.settings = settings
        self.session = session
        self.url = settings.base_url.rstrip("/") + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.slots = asyncio.Semaphore(settings.concurrency)
        backoff = wait_exponential_jitter(
            multiplier=settings.backoff_initial_seconds,
            max=settings.backoff_max_seconds,
            jitter=settings.backoff_initial_seconds,
        )

        def wait(state) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, _Retryable) and exc.retry_after is not None:
                return min(exc.retry_after, MAX_RETRY_AFTER_SECONDS)
            return backoff(state)

        self.wait = wait

    async def vote(self, messages: list[dict]) -> Vote:
        """One vote; raises EndpointRefused on 401/403/404."""
        vote = Vote()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.settings.max_attempts),
            wait=self.wait,
            retry=retry_if_exception_type((_Retryable, _Unparseable, *self.transport_errors)),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self._ask_once(messages, vote)
        except (_Retryable, _Unparseable, _Fatal) as exc:
            vote.error = f"{exc} (after {vote.requests} call(s))"
        except self.transport_errors as exc:
            what = "timeout" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
            vote.error = f"{what} talking to the judge endpoint (after {self.settings.max_attempts} tries)"
        return vote

    async def _ask_once(self, messages: list[dict], vote: Vote) -> None:
        s = self.settings
        body = {"model": s.model, "messages": messages, "temperature": s.temperature, "max_tokens": s.max_tokens}
        async with self.slots:
            start = time.perf_counter()
            async with self.session.post(self.url, json=body, headers=self.headers) as response:
                status, retry_after, text = response.status, _retry_after(response), await response.text()
            vote.latencies_ms.append((time.perf_counter() - start) * 1000)
        vote.requests += 1
        if status in REFUSED_STATUSES:
            raise EndpointRefused(f"the judge endpoint {s.base_url} refused the request: HTTP {status} (model {s.model!r})")
        if status == 429 or status >= 500:
            raise _Retryable(f"HTTP {status} from the judge endpoint", retry_after)
        if status >= 400:
            raise _Fatal(f"HTTP {status} from the judge endpoint: {text[:200]}")
        try:
            payload = json.loads(text)
            content = payload["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Unparseable("the endpoint's response is not a chat completion") from None
        usage = payload.get("usage") or {}
        vote.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        vote.completion_tokens += int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        vote.cached_tokens += int((details.get("cached_tokens") if isinstance(details, dict) else 0) or 0)
        vote.replies.append(content if isinstance(content, str) else json.dumps(content))
        parsed = parse_reply(content if isinstance(content, str) else None)
        if parsed is None:
            raise _Unparseable("no reply held a {\"passed\": bool, \"why\": str} object")
        vote.passed, vote.why = parsed


def _retry_after(response: "aiohttp.ClientResponse") -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


class JudgeClient:
    """`async with JudgeClient(settings) as client: await client.judge(messages)`: one HTTP session and
    one concurrency bound for a whole materialization."""

    def __init__(self, settings: LLMSettings):
        self.settings = settings
        self._session = None
        self._asker: _Asker | None = None

    async def __aenter__(self) -> "JudgeClient":
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.settings.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout_seconds),
        )
        self._asker = _Asker(self.settings, self._session)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def judge(self, messages: list[dict]) -> TaskVerdict:
        """The verdict on one prompt by majority of the settings' votes; endpoint trouble gives status error.
        Raises EndpointRefused only."""
        start = time.perf_counter()
        votes = await asyncio.gather(*(self._asker.vote(messages) for _ in range(self.settings.votes)))
        verdict = majority(list(votes), self.settings.votes)
        verdict.latency_ms = (time.perf_counter() - start) * 1000
        return verdict


async def _judge_all(prompts: list[list[dict]], settings: LLMSettings) -> list[TaskVerdict]:
    async with JudgeClient(settings) as client:
        return list(await asyncio.gather(*(client.judge(m) for m in prompts)))


def judge_prompts(prompts: list[list[dict]], settings: LLMSettings) -> list[TaskVerdict]:
    """One verdict per prompt, in order (the whole list in flight at once: for small lists and benchmarks;
    a batch goes through `judge.driver`). Raises EndpointRefused; other endpoint trouble is status error."""
    if not prompts:
        return []
    return asyncio.run(_judge_all(prompts, settings))
