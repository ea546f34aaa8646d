"""One chat completion over HTTP: the aiohttp session, retries of transient faults, refusals.

Speaks the OpenAI chat-completions protocol (`POST {base_url}/chat/completions`), which vLLM, SGLang,
llama.cpp server, Ollama, LiteLLM and hosted APIs all serve. The client is aiohttp, whose pool keeps up with
many requests in flight. Every request passes the rate controller (judge/rate.py). Transient faults (408, 409, 429, 5xx, transport errors)
are retried against the task's time budget, backing off without holding a slot; a 2xx that is no completion is
asked once more (`UNREADABLE_ANSWERS`). A refusal
(`REFUSALS`, an unknown model, a 429 for a spent quota) stops the whole client: `EndpointRefused`. Proxies and CA bundles are
taken from the environment as curl and the OpenAI SDK take them.
"""

import asyncio
import base64
import json
import math
import os
import random
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import unquote, urlsplit, urlunsplit
from urllib.request import getproxies, proxy_bypass

from filter_pipeline.judge.rate import EndpointRefused, RateController, TaskBudget, Unanswered, asked_to_wait
from filter_pipeline.judge.replies import Choice, Usage, error_message, passes_on_a_fault, read_completion, retry_hint

if TYPE_CHECKING:  # aiohttp itself is imported when a client opens: gate-judged runs never load it
    import aiohttp

    from filter_pipeline.judge.config import LLMJudgeConfig

SERVER_TEXT_MAX_CHARS = 300
# A 2xx answer that is no chat completion (an HTML page, a stream the request did not ask for) may be billed: the
# request is sent once more, and after this many in a row not again (its vote or repair is lost) rather than paid
# for until the task's budget ends (a completion whose choice says `finish_reason` `error` is a gateway's fault
# passed on: retried as any fault).
UNREADABLE_ANSWERS = 2
# Endpoint trouble is told to the run's log at most this often: seen while it lasts, without a line per retry.
REPORT_EVERY_SECONDS = 60.0
_UNKNOWN_MODEL = re.compile(
    r"model_not_found|(?:unknown|invalid|no such)\s+model|\b(?:model|deployment)\b[^.]{0,120}?"
    r"(?:does not exist|doesn't exist|not found|is unknown)",
    re.IGNORECASE,
)
Completion = tuple[list[Choice], Usage]
# a gateway's or an overloaded server's answer, whatever the body asked: never a rejection of the body itself
GATEWAY_STATUSES = (502, 503, 504)
# what no retry mends, and what to do about it (the judge's settings by field: `_hint` names their variables):
# the whole client stops (EndpointRefused)
REFUSALS = {
    401: "check {api_key}",
    402: "the account behind {api_key} has no credit or quota left",
    403: "check {api_key} and its permissions",
    404: "check {base_url} and {model}",
    407: "check the proxy's credentials (HTTPS_PROXY / HTTP_PROXY)",
}
_NO_QUOTA = "insufficient_quota"


def _hint(template: str) -> str:
    """`template` with each `{field}` of the judge's settings replaced by its environment variable."""
    from filter_pipeline.judge.config import ENV  # (here: the client loads without Dagster, which config needs)

    return template.format(**ENV)


class JudgeSetupError(ValueError):
    """A judge setting the client cannot work with (an unreadable SSL_CERT_FILE): one line naming it."""


@dataclass
class Rejected:
    """A rejection that retrying cannot fix (a 4xx other than a refusal, or a 5xx the caller rejects)."""

    status: int
    text: str


@dataclass
class _Fault:
    """A transient fault: retried after a backoff, or after `hint` seconds shared by every request."""

    problem: str
    hint: float | None = None
    shared: bool = False  # the hint pauses the whole client (waited out in RateController.acquire)
    unreadable: bool = False  # a 2xx that is no chat completion (UNREADABLE_ANSWERS)


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


def public_url(url: str) -> str:
    """`url` without credentials or query (userinfo, `?api-key=`)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


_URL = re.compile(r"https?://[^\s'\"<>()]+", re.IGNORECASE)


def public_urls(text: str) -> str:
    """`text` with every URL in it as `public_url` gives it: an error's text (aiohttp's names the request URL,
    or where a redirect pointed) carries no credentials or query."""

    def shown(found: re.Match) -> str:
        try:
            return public_url(found.group())
        except ValueError:  # (a port that is no number: nothing of it is shown)
            return "<a URL>"

    return _URL.sub(shown, text)


def env_proxy(url: str) -> tuple[str | None, dict | None]:
    """(the proxy the environment names for `url`, the headers that authenticate to it): HTTPS_PROXY /
    HTTP_PROXY unless NO_PROXY covers the host, as aiohttp's trust_env finds it (from the same `urllib.request`
    functions), its credentials as a `Proxy-Authorization` header; (None, None) for none."""
    target = urlsplit(url)
    proxy = getproxies().get(target.scheme)
    if not proxy or proxy_bypass(target.hostname or ""):
        return None, None
    parts = urlsplit(proxy)
    if parts.username is None:
        return proxy, None
    credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
    return public_url(proxy), {"Proxy-Authorization": "Basic " + base64.b64encode(credentials).decode()}


@dataclass
class _Answer:
    """What one POST gave: the status with its whole body, or (status None) the transport's trouble."""

    status: int | None
    headers: dict
    text: str
    problem: str = ""


class Transport:
    """One aiohttp session to `{base_url}/chat/completions` (its query, if any, after the path) and the rate
    controller every request passes."""

    def __init__(self, config: "LLMJudgeConfig", report: Callable[[str], None] | None = None):
        self.config = config
        self.report = report or (lambda line: None)  # where endpoint trouble is told as it happens
        self._reported_at = {True: -math.inf, False: -math.inf}  # by kind: retrying, or ending tasks
        self._no_usage_told = False
        base = urlsplit(config.base_url)  # (a query stays after the path: Azure OpenAI's ?api-version=...)
        self.url = urlunsplit(base._replace(path=base.path.rstrip("/") + "/chat/completions"))
        if config.api_key and "@" in base.netloc:  # the bearer token authenticates; aiohttp refuses both at once
            self.url = urlunsplit(urlsplit(public_url(self.url))._replace(query=base.query))
        # what every line about the endpoint names it: a gateway may take the key in the URL's path too
        self.public_url = config.redact(public_url(self.url))
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.rate = RateController(config.concurrency, config.task_budget_seconds)
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self.transport_errors = (aiohttp.ClientError, asyncio.TimeoutError)
        # trust_env: HTTPS_PROXY / HTTP_PROXY / NO_PROXY and ~/.netrc, as curl and the OpenAI SDK honour them.
        # With an API key the proxy is found here instead (`env_proxy`) and ~/.netrc is not read: aiohttp refuses
        # a request whose Authorization header meets a ~/.netrc entry for its host, and the key is what
        # authenticates.
        self.proxy, self.proxy_headers = env_proxy(self.url) if self.headers else (None, None)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.config.concurrency, ssl=ssl_context()),
            timeout=aiohttp.ClientTimeout(total=self.config.timeout_seconds),
            trust_env=not self.headers,
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def send(
        self, make_body: Callable[[], dict], task: TaskBudget, rejects_5xx: Callable[[dict], bool]
    ) -> tuple[dict, Completion | Rejected]:
        """(the body sent, one completion), retrying transient faults within the task's budget; a rejection
        that retrying cannot fix comes back as Rejected, as does a 5xx (but a gateway's, GATEWAY_STATUSES) to a
        body `rejects_5xx` names (a refusal raises EndpointRefused; a spent budget Unanswered). The body is made
        when the request gets its slot."""
        tries, problem, unreadable = 0, "", 0
        while True:
            epoch = await self.rate.acquire(task)
            body = make_body()
            task.requests += 1
            tries += 1
            answer = await self._post(body, task, problem, retry=tries > 1)
            outcome = self._outcome(answer, epoch, rejects_5xx(body))
            if not isinstance(outcome, _Fault):
                return body, outcome
            problem = outcome.problem
            unreadable = unreadable + 1 if outcome.unreadable else 0
            if unreadable >= UNREADABLE_ANSWERS:  # (this request's alone: the endpoint is not taken for down)
                self.rate.failed(problem)
                self._tell_trouble(problem, retrying=False)
                raise Unanswered(
                    f"{problem} ({unreadable} such answers in a row: not asked again, as each may be billed)"
                )
            await self._back_off(outcome, task, tries)

    async def _post(self, body: dict, task: TaskBudget, before: str, retry: bool) -> _Answer:
        """One request, its slot released when it ends; `before` is the problem of the task's last request. A
        retry ends by the task's budget; a first try has its whole timeout (the budget is for retrying)."""
        timeout = self.config.timeout_seconds
        if retry:
            timeout = max(min(timeout, task.deadline - time.monotonic()), 0.001)
        start = time.perf_counter()
        try:
            async with self.session.post(
                self.url,
                json=body,
                headers=self.headers,
                timeout=self._aiohttp.ClientTimeout(total=timeout),
                proxy=self.proxy,
                proxy_headers=self.proxy_headers,
            ) as response:
                # The status counts only with its whole body: a body cut off by the timeout is a timeout, not
                # an empty answer from the server.
                data = await response.read()
                return _Answer(response.status, dict(response.headers), data.decode("utf-8", errors="replace"))
        except self.transport_errors as exc:
            if isinstance(exc, self._aiohttp.ClientHttpProxyError) and exc.status == 407:  # (https: the tunnel's)
                return _Answer(407, {}, "Proxy Authentication Required")
            if isinstance(exc, asyncio.TimeoutError) and timeout < self.config.timeout_seconds and before:
                # Cut short by the task's budget, this timeout says nothing about the endpoint; what it
                # answered before does.
                problem = f"{before}; the task budget ran out during the next request"
            elif isinstance(exc, asyncio.TimeoutError):
                problem = f"timeout ({timeout:.1f} s) waiting for the judge endpoint"
            else:  # (aiohttp's text names the host and port and what happened: "Connect call failed")
                said = self.config.redacted(
                    public_urls(str(exc)), SERVER_TEXT_MAX_CHARS, single_line=True, cut_mark="..."
                )
                problem = f"{type(exc).__name__} talking to the judge endpoint" + (f" ({said})" if said else "")
            return _Answer(None, {}, "", problem)
        finally:
            task.latencies_ms.append((time.perf_counter() - start) * 1000)
            self.rate.release()

    def _outcome(self, answer: _Answer, epoch: int, rejects_5xx: bool) -> Completion | Rejected | _Fault:
        status, text = answer.status, answer.text
        if status is None:
            return _Fault(answer.problem)
        if 200 <= status < 300:
            try:
                payload = json.loads(text)
            except (ValueError, RecursionError):  # not JSON, or nested deeper than json follows
                payload = None
            completion = read_completion(payload)
            if completion is not None:
                self.rate.succeeded()
                self._tell_if_no_usage(completion[1])
                return completion
            if passes_on_a_fault(payload):
                return _Fault(f"HTTP {status} from the judge endpoint passes on a fault (finish_reason error): "
                              f"{self.server_text(text)}")  # fmt: skip
            problem = f"HTTP {status} from the judge endpoint is not a chat completion: {self.server_text(text)}"
            return _Fault(problem, unreadable=True)
        if self._refusal(status, text):
            refused = self._refused(status, text)
            self.rate.refuse(refused)
            raise refused
        if status not in (408, 409, 429) and status < 500:
            return Rejected(status, text)
        if status >= 500 and status not in GATEWAY_STATUSES and rejects_5xx:
            return Rejected(status, text)
        hint = retry_hint(answer.headers)
        if hint is not None:
            # a hint of no wait at all (`Retry-After: 0`, a date already past) must not retry at full speed
            hint = max(hint, self.config.backoff_initial_seconds)
        if status == 429:
            self.rate.throttled(epoch)
        shared = hint is not None and status in (429, 503)
        if shared:
            self.rate.pause(hint)
        return _Fault(f"HTTP {status} from the judge endpoint: {self.server_text(text)}", hint, shared)

    async def _back_off(self, fault: _Fault, task: TaskBudget, tries: int) -> None:
        """Wait before the task's next try (a shared pause is waited out in acquire()); raises Unanswered
        when the wait would pass the task's budget."""
        self.rate.failed(fault.problem)
        if fault.hint is not None and fault.hint >= task.budget:
            # (not an outage: the endpoint answered, asking for longer than any task may wait)
            self._tell_trouble(f"{fault.problem}; it asks to wait {fault.hint:g} s, longer than a task may wait: "
                               "tasks asked now end unjudged (judged again later)", retrying=False)  # fmt: skip
            raise asked_to_wait(fault.problem, fault.hint, task)
        self._tell_trouble(fault.problem)
        c = self.config
        # (the exponent bounded: a float overflows past 2 ** 1023, long after the doubling reached the maximum)
        base = min(c.backoff_max_seconds, c.backoff_initial_seconds * 2.0 ** min(tries - 1, 64))
        wait = fault.hint if fault.hint is not None else base / 2 + random.uniform(0, base / 2)
        if time.monotonic() + wait >= task.deadline:
            spent = time.monotonic() - (task.started or time.monotonic())
            self._give_up(task, f"{fault.problem} (gave up after {task.requests} requests in {spent:.1f} s; "
                                f"task budget {task.budget:g} s)")  # fmt: skip
        if not fault.shared:
            await asyncio.sleep(wait)

    def _give_up(self, task: TaskBudget, why: str) -> NoReturn:
        """End `task`, its budget spent, unanswered (`why`); if no request succeeded since it started, the endpoint
        is down (`RateController.gave_up`), which is told once."""
        was_down = self.rate.down
        self.rate.gave_up(task)
        if self.rate.down and not was_down:
            self.report(
                f"the judge endpoint {self.public_url} gave no answer it could use for a whole task budget "
                f"({task.budget:g} s): tasks not yet asked end unjudged (asked again the next time they are "
                f"judged), but for one probe every {self.rate.probe_interval:g} s"
            )
        raise Unanswered(why)

    def _tell_if_no_usage(self, usage: Usage) -> None:
        if not usage.reported and not self._no_usage_told:
            self._no_usage_told = True
            self.report(
                f"the judge endpoint {self.public_url} reports no token usage in its completions: their tokens, "
                "and the cost, count as 0"
            )

    def _tell_trouble(self, problem: str, retrying: bool = True) -> None:
        now = time.monotonic()
        if now - self._reported_at[retrying] >= REPORT_EVERY_SECONDS:  # (an end of tasks is told beside retries)
            self._reported_at[retrying] = now
            budget = _hint(f"each task for up to {self.config.task_budget_seconds:g} s, {{task_budget_seconds}}")
            self.report(
                f"the judge endpoint {self.public_url}: {problem}" + (f"; retrying ({budget})" if retrying else "")
            )

    # --- refusals and server text -----------------------------------------------------------------------

    def _refusal(self, status: int, text: str) -> bool:
        return (
            status in REFUSALS
            or (status == 400 and bool(_UNKNOWN_MODEL.search(error_message(text))))
            or (status == 429 and _NO_QUOTA in text)  # (OpenAI's "exceeded your current quota": no wait ends it)
        )

    def _refused(self, status: int, text: str) -> EndpointRefused:
        # (a 429 that refuses is a spent quota, as a 402; a 400 refuses an unknown model, as a 404)
        todo = REFUSALS.get(402 if status == 429 else status, REFUSALS[404])
        return EndpointRefused(
            f"the judge endpoint {self.public_url} refused the request for model {self.config.model!r}: "
            f"HTTP {status}: {self.server_text(text)} ({_hint(todo)})"
        )

    def server_text(self, text: str) -> str:
        """The server's message in an error body, redacted and cut, for an exception or a verdict's why."""
        said = public_urls(error_message(text))
        return self.config.redacted(said, SERVER_TEXT_MAX_CHARS, cut_mark="...") or "(empty body)"
