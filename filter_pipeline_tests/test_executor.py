"""The threaded executor: independent steps at once, a lone step in the main thread, Dagster's semantics
for failures, skips, hooks and interrupts kept. Small op jobs run through `dg.execute_job`, as the CLI runs
filter_job."""

import os
import signal
import threading
import time

import dagster as dg
import pytest

from filter_pipeline.executor import threaded_executor

RECORD: list[tuple[str, str, bool, float, float]] = []  # (op, step thread name, in main thread, start, end)
BOTH_SIDES = threading.Barrier(2)


def _record(name: str, work=lambda: None) -> None:
    start = time.perf_counter()
    work()
    RECORD.append((name, threading.current_thread().name, threading.current_thread() is threading.main_thread(), start, time.perf_counter()))


@dg.op
def source() -> int:
    _record("source")
    return 1


@dg.op(config_schema={"meet": bool, "fail": bool, "interrupt": bool})
def left(context: dg.OpExecutionContext, x: int) -> int:
    def work():
        if context.op_config["meet"]:
            BOTH_SIDES.wait(timeout=10)  # returns only if `right` is running at the same time
        if context.op_config["interrupt"]:
            os.kill(os.getpid(), signal.SIGINT)  # what a terminate sends
            time.sleep(0.3)
        time.sleep(0.05)
        if context.op_config["fail"]:
            raise ValueError("left broke")

    _record("left", work)
    return x + 1


@dg.op(config_schema={"meet": bool})
def right(context: dg.OpExecutionContext, x: int) -> int:
    _record("right", lambda: BOTH_SIDES.wait(timeout=10) if context.op_config["meet"] else time.sleep(0.05))
    return x + 2


@dg.op
def join(a: int, b: int) -> int:
    _record("join")
    return a + b


HOOKED: list[str] = []


@dg.success_hook
def note_success(context: dg.HookContext):
    HOOKED.append(context.op.name)


def diamond(executor: dg.ExecutorDefinition) -> dg.JobDefinition:
    @dg.job(executor_def=executor, hooks={note_success})
    def diamond_job():
        x = source()
        join(left(x), right(x))

    return diamond_job


@dg.op
def after_a(x: int) -> int:
    _record("after_a")
    return x


@dg.op
def after_b(x: int) -> int:
    _record("after_b")
    return x


def threaded_fan() -> dg.JobDefinition:
    """source -> left, right; left -> after_a, after_b (ready together once left is done). No hooks: nothing
    but the executor looks for an interrupt between steps."""

    @dg.job(executor_def=threaded_executor)
    def fan_job():
        x = source()
        done = left(x)
        right(x)
        after_a(done)
        after_b(done)

    return fan_job


def threaded_diamond() -> dg.JobDefinition:
    return diamond(threaded_executor)


def in_process_diamond() -> dg.JobDefinition:
    return diamond(dg.in_process_executor)


def run(job_fn, instance, *, max_concurrent: int | None = None, **left_config) :
    RECORD.clear()
    HOOKED.clear()
    BOTH_SIDES.reset()
    config = {"meet": False, "fail": False, "interrupt": False, **left_config}
    run_config = {"ops": {"left": {"config": config}, "right": {"config": {"meet": config["meet"]}}}}
    if max_concurrent is not None:
        run_config["execution"] = {"config": {"max_concurrent": max_concurrent}}
    return dg.execute_job(dg.reconstructable(job_fn), instance, run_config=run_config)


def step_events(result, kind: dg.DagsterEventType) -> list[str]:
    return [e.step_key for e in result.all_events if e.event_type == kind]


def overlaps(a: str, b: str) -> bool:
    (_, _, _, start_a, end_a), (_, _, _, start_b, end_b) = (next(r for r in RECORD if r[0] == name) for name in (a, b))
    return start_a < end_b and start_b < end_a


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


def test_independent_steps_run_at_the_same_time_and_lone_ones_in_the_main_thread(instance):
    with run(threaded_diamond, instance, meet=True) as result:  # left and right each wait for the other
        assert result.success
        assert result.output_for_node("join") == 5
    assert overlaps("left", "right")
    in_main = {name: main for name, _, main, _, _ in RECORD}
    assert in_main == {"source": True, "left": False, "right": False, "join": True}
    assert sorted(HOOKED) == ["join", "left", "right", "source"]  # hooks run for steps in workers too
    for kind in (dg.DagsterEventType.STEP_START, dg.DagsterEventType.STEP_OUTPUT, dg.DagsterEventType.STEP_SUCCESS):
        assert sorted(step_events(result, kind)) == ["join", "left", "right", "source"]


def test_every_step_event_is_stored_as_in_process_stores_it(instance):
    with run(threaded_diamond, instance) as threaded, run(in_process_diamond, instance) as in_process:
        kinds = lambda result: sorted(  # noqa: E731
            (e.step_key, e.dagster_event.event_type_value) for e in instance.all_logs(result.run_id) if e.is_dagster_event and e.step_key
        )
        assert kinds(threaded) == kinds(in_process)
        assert len(kinds(threaded)) > 12


def test_max_concurrent_1_runs_one_step_at_a_time_in_the_main_thread(instance):
    with run(threaded_diamond, instance, max_concurrent=1) as result:
        assert result.success
    assert not overlaps("left", "right")
    assert all(main for _, _, main, _, _ in RECORD)


def test_a_step_failing_in_a_worker_fails_the_run_skips_its_downstream_and_lets_the_others_finish(instance):
    with run(threaded_diamond, instance, fail=True) as result:
        assert not result.success
        assert step_events(result, dg.DagsterEventType.STEP_FAILURE) == ["left"]
        assert "left broke" in str(result.failure_data_for_node("left").error.cause)
        assert sorted(step_events(result, dg.DagsterEventType.STEP_SUCCESS)) == ["right", "source"]
        assert "join" not in step_events(result, dg.DagsterEventType.STEP_START)


def test_an_interrupt_lets_the_steps_in_workers_finish_and_starts_nothing_after_them(instance):
    with run(threaded_diamond, instance, interrupt=True) as result:  # left sends SIGINT, then goes on a while
        assert not result.success
    stored = lambda kind: sorted(e.step_key for e in instance.all_logs(result.run_id, of_type=kind))  # noqa: E731
    assert stored(dg.DagsterEventType.STEP_SUCCESS) == ["left", "right", "source"]
    assert stored(dg.DagsterEventType.STEP_START) == ["left", "right", "source"]
    assert instance.get_run_by_id(result.run_id).status == dg.DagsterRunStatus.FAILURE


def test_after_an_interrupt_steps_ready_together_are_not_started_in_workers(instance):
    with run(threaded_fan, instance, interrupt=True) as result:
        assert not result.success
    stored = lambda kind: sorted(e.step_key for e in instance.all_logs(result.run_id, of_type=kind))  # noqa: E731
    assert stored(dg.DagsterEventType.STEP_SUCCESS) == ["left", "right", "source"]
    assert "after_b" not in stored(dg.DagsterEventType.STEP_START)  # after_a ran here, and the interrupt stopped it


def test_max_concurrent_below_1_is_refused(instance):
    with pytest.raises(Exception, match="max_concurrent must be at least 1, not 0"):
        run(threaded_diamond, instance, max_concurrent=0)
