"""The `threaded` executor: a run's steps in one process, several at once when the graph allows.

Why: after `judge_verdicts`, `failure_pool` and the `ledger` depend only on it, and `dpo_pairs`,
`filter_report` and `coverage` only on the ledger. Much of their work is Arrow and numpy, which release the
GIL, so on two cores running them side by side took a 300k-task run from 5.38 to 5.05 s (medians of six
alternating pairs; their Python still takes turns on the GIL). Dagster's `in_process` executor runs one step
at a time, and `multiprocess` pays a process start and Dagster's import (seconds) per step.

How: the loop is `in_process`'s (Dagster's `inner_plan_execution_iterator`). A step that is ready alone,
with nothing else running, runs in the main thread exactly as `in_process` runs it, so the judge (whose LLM
calls can take hours, and which always runs alone) is interrupted by a terminate as before. When several
steps are ready, up to `max_concurrent` run in worker threads while the main thread passes their events on
and starts what becomes ready. A step in a worker thread is not interrupted (Python delivers signals to
the main thread only): after an interrupt nothing new starts in a worker, the running ones finish (these
are the second-long pandas steps), and the run stops as `in_process` would.
"""

import os
import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial

import dagster as dg
from dagster._core.events import DagsterEvent, EngineEventData
from dagster._core.execution.api import ExecuteRunWithPlanIterable
from dagster._core.execution.compute_logs import create_compute_log_file_key
from dagster._core.execution.context.system import PlanExecutionContext, PlanOrchestrationContext, StepExecutionContext
from dagster._core.execution.context_creation_job import PlanExecutionContextManager
from dagster._core.execution.plan.active import ActiveExecution
from dagster._core.execution.plan.execute_plan import (
    _handle_compute_log_setup_error,
    _handle_compute_log_teardown_error,
    _trigger_hook,
    dagster_event_sequence_for_step,
)
from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext
from dagster._core.execution.plan.plan import ExecutionPlan
from dagster._core.execution.retries import RetryMode, get_retries_config
from dagster._core.executor.in_process import InProcessExecutor
from dagster._utils.interrupts import check_captured_interrupt
from dagster._utils.timing import time_execution_scope
from dagster_shared.utils.timing import format_duration

WAIT_SECONDS = 0.5  # how long the main thread waits for a worker's event before looking at the plan again


@dataclass
class _Step:
    """A step in flight: its context and the events it produced (for its hooks)."""

    context: StepExecutionContext
    events: list[DagsterEvent] = field(default_factory=list)


_FINISHED = object()  # a worker's last message: its step's event stream has ended


class _Workers:
    """The steps running in worker threads, and what their threads tell the main thread: (step key, event),
    (step key, exception that escaped the step), (step key, _FINISHED)."""

    def __init__(self):
        self.steps: dict[str, _Step] = {}
        self.messages: queue.SimpleQueue = queue.SimpleQueue()
        self.errors: list[BaseException] = []

    def start(self, context: StepExecutionContext) -> None:
        key = context.step.key
        self.steps[key] = _Step(context)
        threading.Thread(target=self._run, args=(key, context), name=f"step {key}", daemon=True).start()

    def _run(self, key: str, context: StepExecutionContext) -> None:
        try:
            for event in dagster_event_sequence_for_step(context):
                self.messages.put((key, event))
        except BaseException as exc:  # noqa: BLE001 - raised by the main thread once no step of its own runs
            self.messages.put((key, exc))
        finally:
            self.messages.put((key, _FINISHED))

    def pass_on(self, job_context: PlanExecutionContext, active: ActiveExecution, wait: bool) -> Iterator[DagsterEvent]:
        """Yield and hand to the plan the workers' events so far (with `wait`: at least one message, or
        WAIT_SECONDS of none); finish each step whose worker is done."""
        while self.steps:
            try:
                key, message = self.messages.get(timeout=WAIT_SECONDS) if wait else self.messages.get_nowait()
            except queue.Empty:
                return
            wait = False
            step = self.steps[key]
            if message is _FINISHED:
                del self.steps[key]
                yield from _finish(job_context, active, step)
            elif isinstance(message, BaseException):
                self.errors.append(message)
            else:
                step.events.append(message)
                yield message
                active.handle_event(message)

    def raise_errors(self) -> None:
        if self.errors:
            raise self.errors[0]

    def wait_for_all(self) -> None:
        """Until every worker is done, their events stored by their steps but not passed on (the run is
        ending with an exception)."""
        while self.steps:
            key, message = self.messages.get()
            if message is _FINISHED:
                del self.steps[key]


def threaded_plan_iterator(
    job_context: PlanExecutionContext, execution_plan: ExecutionPlan, max_concurrent: int
) -> Iterator[DagsterEvent]:
    """Dagster's in-process plan loop, with up to `max_concurrent - 1` extra steps in worker threads.

    Guarantees: every event of every step is yielded and handed to the plan (`handle_event`) by the main
    thread, and a step's hooks run once it has finished. No worker is left running when this returns or
    raises: on an exception (an interrupt among them) the workers' steps finish first, their events stored
    by the steps themselves as always, then the exception propagates.
    """
    with InstanceConcurrencyContext(job_context.instance, job_context.dagster_run) as concurrency:
        with execution_plan.start(
            retry_mode=job_context.retry_mode,
            instance_concurrency_context=concurrency,
            step_dependency_config=job_context.step_dependency_config,
        ) as active:
            with ExitStack() as capture_stack:
                # the process's stdout/stderr captured once for every step, as in_process does
                manager = job_context.instance.compute_log_manager
                log_key = manager.build_log_key_for_run(job_context.run_id, create_compute_log_file_key())
                step_keys = [step.key for step in execution_plan.get_steps_to_execute_in_topo_order()]
                try:
                    log_context = capture_stack.enter_context(manager.capture_logs(log_key))
                    yield DagsterEvent.capture_logs(job_context, step_keys, log_key, log_context)
                except Exception:
                    yield from _handle_compute_log_setup_error(job_context, sys.exc_info())

                yield from _steps(job_context, active, max_concurrent)

                try:
                    capture_stack.close()
                except Exception:
                    yield from _handle_compute_log_teardown_error(job_context, sys.exc_info())


def _steps(job_context: PlanExecutionContext, active: ActiveExecution, max_concurrent: int) -> Iterator[DagsterEvent]:
    workers = _Workers()
    try:
        while not active.is_complete:
            workers.raise_errors()
            steps = active.get_steps_to_execute(limit=max_concurrent - len(workers.steps))
            yield from active.concurrency_event_iterator(job_context)
            if steps and ((len(steps) == 1 and not workers.steps) or check_captured_interrupt()):
                for step in steps:  # alone, or the run is being stopped: here, where an interrupt reaches the step
                    yield from _run_here(job_context, active, _Step(job_context.for_step(step, active.get_known_state())))
                continue
            for step in steps:
                workers.start(job_context.for_step(step, active.get_known_state()))
            if workers.steps:
                yield from workers.pass_on(job_context, active, wait=True)
            else:
                active.sleep_til_ready()
        workers.raise_errors()
    except BaseException:
        workers.wait_for_all()
        raise


def _run_here(job_context: PlanExecutionContext, active: ActiveExecution, step: _Step) -> Iterator[DagsterEvent]:
    """The step in this (the main) thread, as in_process runs it."""
    for event in dagster_event_sequence_for_step(step.context):
        step.events.append(event)
        yield event
        active.handle_event(event)
    yield from _finish(job_context, active, step)


def _finish(job_context: PlanExecutionContext, active: ActiveExecution, step: _Step) -> Iterator[DagsterEvent]:
    """What in_process does after a step's events: check it ended, plan the skips that follow, run hooks."""
    active.verify_complete(job_context, step.context.step.key)
    for event in active.plan_events_iterator(job_context):
        step.events.append(event)
        yield event
    yield from _trigger_hook(step.context, step.events)


class ThreadedExecutor(InProcessExecutor):
    """`in_process` with up to `max_concurrent` steps at once (see the module docstring)."""

    def __init__(self, retries: RetryMode, max_concurrent: int):
        super().__init__(retries=retries)
        self.max_concurrent = max_concurrent

    def execute(self, plan_context: PlanOrchestrationContext, execution_plan: ExecutionPlan) -> Iterator[DagsterEvent]:
        step_keys = execution_plan.step_keys_to_execute
        yield DagsterEvent.engine_event(
            plan_context,
            f"Executing steps in process (pid: {os.getpid()}), up to {self.max_concurrent} at once in threads",
            event_specific_data=EngineEventData.in_process(os.getpid(), step_keys),
        )
        with time_execution_scope() as timer:
            yield from self._run_plan(plan_context)
        yield DagsterEvent.engine_event(
            plan_context,
            f"Finished steps in process (pid: {os.getpid()}) in {format_duration(timer.millis)}",
            event_specific_data=EngineEventData.in_process(os.getpid(), step_keys),
        )

    def _run_plan(self, plan_context: PlanOrchestrationContext) -> Iterator[DagsterEvent]:
        yield from ExecuteRunWithPlanIterable(
            execution_plan=plan_context.execution_plan,
            iterator=partial(threaded_plan_iterator, max_concurrent=self.max_concurrent),
            execution_context_manager=PlanExecutionContextManager(
                job=plan_context.job,
                retry_mode=plan_context.retry_mode,
                execution_plan=plan_context.execution_plan,
                run_config=plan_context.run_config,
                dagster_run=plan_context.dagster_run,
                instance=plan_context.instance,
                raise_on_error=plan_context.raise_on_error,
                output_capture=plan_context.output_capture,
                step_dependency_config=self.step_dependency_config,
            ),
        )


@dg.executor(
    name="threaded",
    config_schema={
        "max_concurrent": dg.Field(
            int,
            default_value=2,
            description="Most steps running at once, in threads of the run's process (1: one at a time, as "
            "in_process). Each step's Arrow and numpy work uses a core; two suits a 2-core machine.",
        ),
        "retries": get_retries_config(),
    },
)
def threaded_executor(init_context: dg.InitExecutorContext) -> ThreadedExecutor:
    """Steps of a run in one process, in threads, several at once where the asset graph allows: the
    in-process executor's behaviour and events, minus the waiting of independent steps on each other."""
    config = init_context.executor_config
    if config["max_concurrent"] < 1:
        raise ValueError(f"the threaded executor's max_concurrent must be at least 1, not {config['max_concurrent']}")
    return ThreadedExecutor(retries=RetryMode.from_config(config["retries"]), max_concurrent=config["max_concurrent"])
