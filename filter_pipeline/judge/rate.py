"""The rate controller: what the judge endpoint is spared, shared by every request of one client.

An adaptive concurrency window (halved on 429, grown back by one per `GROW_AFTER_SUCCESSES` successes, never
above `concurrency`) and one shared "not before" time, so a retry hint pauses every request, not only the
one that got it. A task's budget runs from its first request; once a task spends its whole budget without
any request succeeding meanwhile, the endpoint is down: tasks not yet asked end unjudged at once, but for one
probe now and then. A refusal stops every request: `EndpointRefused`.
"""

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from filter_pipeline.judge.replies import Usage

# Until the endpoint has answered one request, at most this many are in flight: a refusing endpoint costs
# that many requests whatever `concurrency` is (and a working one loses one round trip of ramp-up).
PROBE_REQUESTS = 4
# Additive increase of the concurrency window. Small enough that a window halved by a burst of 429s regrows
# within one rate-limit period (a rate limit, unlike a concurrency limit, is best met with a full window).
GROW_AFTER_SUCCESSES = 2
# While the endpoint is down, one task not yet asked is asked this often anyway, so that a recovery is seen.
PROBE_INTERVAL_SECONDS = 30.0


class EndpointRefused(Exception):
    """A refusal (`transport.REFUSALS`, an unknown model, a spent quota): retrying cannot help. str() is one line naming the endpoint URL
    (no credentials) and the HTTP status and the server's short message; never the API key."""


class Unanswered(Exception):
    """This request (so this vote) got no answer: budget spent, or a rejection retrying cannot fix."""


@dataclass
class TaskBudget:
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


def asked_to_wait(problem: str, seconds: float, task: TaskBudget) -> Unanswered:
    """Why `task` ends unanswered when the endpoint asks for a wait that ends past its budget."""
    return Unanswered(
        f"{problem} (the endpoint asked to wait {seconds:.1f} s, past this task's budget of {task.budget:g} s; "
        f"{task.requests} requests made)"
    )


class RateController:
    """One per client: every request of every task acquires a slot here first."""

    def __init__(self, concurrency: int, budget: float):
        self.limit = concurrency
        self.window = float(concurrency)
        self.budget = budget
        self.probe_interval = min(budget, PROBE_INTERVAL_SECONDS)  # while down: one task asked this often
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

    async def acquire(self, task: TaskBudget) -> int:
        """A slot for one request of `task` (release() it); returns the window's epoch. Waits out the shared
        pause, within the task's budget."""
        while True:
            if self.refused is not None:
                raise EndpointRefused(str(self.refused))  # a fresh one: a re-raised instance grows its traceback
            now = time.monotonic()
            if task.started is None and self.down and now >= self.probe_at:
                self.probe_at = now + self.probe_interval
                task.start(now)  # this task probes
            elif task.started is None and self.down:
                self._wake()  # (a task woken for a slot that leaves without it passes the slot on)
                raise Unanswered(
                    f"not asked: the judge endpoint has given no answer it could use for a whole task budget "
                    f"({self.budget:g} s; last: {self.last_problem})"
                )
            if now < self.not_before:
                task.start(now)
                if self.not_before >= task.deadline:
                    self._wake()
                    raise asked_to_wait(self.last_problem, self.not_before - now, task)
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

    def gave_up(self, task: TaskBudget) -> None:
        """`task` spent its budget on faults; if no request succeeded meanwhile, the endpoint is down: tasks
        not yet asked end unjudged at once (judged again later) instead of each spending a budget, but for
        one probe every PROBE_INTERVAL_SECONDS (or budget), whose success ends the outage."""
        if task.started is not None and self.last_success < task.started and not self.down:
            self.down = True
            self.probe_at = time.monotonic() + self.probe_interval

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
