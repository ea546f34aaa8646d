"""N batches launched together: their judging runs in parallel, their ledger walks one at a time in run_id order.

    .venv/bin/python -m benchmarks.parallel_batches [--batches 6] [--tasks 400] [--latency 0.5] [--concurrency 4]
                                                    [--executor in_process|multiprocess]

Drops N complete batches into a fresh data root at once and lets `dagster-daemon` (the batch sensor, the run
queue; the ledger's lease keeps the walks one at a time) do the rest, with the LLM judge talking to the local
OpenAI-compatible test server (one vote per task, fixed latency, in its own process; loopback only). Then
reads the step timings back from the instance's event log and prints:
- each batch's judge_batch step and ledger step (start, end, seconds, process id);
- judging: the sum of the judge steps against the wall time they spanned (the speed-up over one at a time);
- the ledger: the batches its steps walked (a sensor ledger run walks every judged batch waiting), whether in
  run_id order, and whether any two steps overlapped.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from benchmarks.judge_throughput import server_process, stop
from filter_pipeline.shell.jobs import FIRST_WALK_TAG, PARTITION_TAG

REPO = Path(__file__).resolve().parent.parent
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED]  # fmt: skip


@dataclass(frozen=True)
class Span:
    run_ids: list[str]  # the batches the step worked on (a sensor's ledger run may walk several)
    step: str
    start: float
    end: float
    pid: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


def write_batches(data: Path, batches: int, tasks: int) -> list[str]:
    run_ids = [f"2026-12-{i + 1:02d}" for i in range(batches)]
    for run_id in run_ids:
        run = data / "runs" / run_id
        run.mkdir(parents=True)
        with open(run / "tasks.jsonl", "w") as f:
            for i in range(tasks):
                site = f"site{i % 20}"
                f.write(json.dumps({"task_id": f"t{i}", "macro": f"macro{i % 4}", "site": site, "instruction": f"open item {i}",
                                    "dedup_key": [site, "#item", i], "start": {"kind": "url"}}) + "\n")  # fmt: skip
        with open(run / "executions.jsonl", "w") as f:
            for i in range(tasks):
                f.write(json.dumps({"task_id": f"t{i}", "attempt": 1, "ok": True, "dir": f"runs/{run_id}/traj/t{i}/1",
                                    "steps": [{"action": "click"}] * 3, "backend": {"ok": True, "detail": "ok"}}) + "\n")  # fmt: skip
    for run_id in run_ids:  # all complete at (nearly) the same moment
        (data / "runs" / run_id / "_SUCCESS").write_text("")
    return run_ids


def step_spans(instance: dg.DagsterInstance, job: str, step: str) -> list[Span]:
    spans = []
    for record in instance.get_run_records(dg.RunsFilter(job_name=job)):
        run = record.dagster_run
        start = end = pid = None
        for entry in instance.all_logs(run.run_id):
            event = entry.dagster_event
            if event is None or event.step_key != step:
                continue
            if event.event_type == dg.DagsterEventType.STEP_START:
                start, pid = entry.timestamp, event.pid
            elif event.event_type == dg.DagsterEventType.STEP_SUCCESS:
                end = entry.timestamp
        if start is not None and end is not None:
            # a ledger run over several batches has no partition tag; its first-walk tag names them all
            walked = run.tags.get(FIRST_WALK_TAG, run.tags.get(PARTITION_TAG, ""))
            spans.append(Span(walked.split(), step, start, end, pid))
    return sorted(spans, key=lambda s: s.start)


def overlapping_pairs(spans: list[Span]) -> int:
    return sum(1 for i, a in enumerate(spans) for b in spans[i + 1 :] if a.start < b.end and b.start < a.end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=400, help="tasks per batch (one ok attempt each)")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds the judge server takes per call")
    parser.add_argument("--concurrency", type=int, default=4, help="judge requests in flight per batch")
    parser.add_argument(
        "--executor",
        choices=["in_process", "multiprocess"],
        default="in_process",
        help="(the README's figures: in_process)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="parallel-batches-"))
    home, data = work / "home", work / "data"
    home.mkdir()
    shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
    run_ids = write_batches(data, args.batches, args.tasks)
    ideal = args.tasks * args.latency / args.concurrency
    print(f"{args.batches} batches x {args.tasks} tasks, judge latency {args.latency * 1000:.0f} ms, "
          f"{args.concurrency} in flight per batch (one batch alone: >= {ideal:.1f} s of judging), "
          f"executor {args.executor}", flush=True)  # fmt: skip

    log_path = work / "daemon.log"
    with server_process(args.latency) as base_url, open(log_path, "w") as log:
        env = {
            **os.environ, "DAGSTER_HOME": str(home), "FILTER_PIPELINE_DATA": str(data),
            "FILTER_PIPELINE_EXECUTOR": args.executor, "FILTER_JUDGE_KIND": "llm", "FILTER_JUDGE_BASE_URL": base_url,
            "FILTER_JUDGE_MODEL": "bench", "FILTER_JUDGE_VOTES": "1", "FILTER_JUDGE_CONCURRENCY": str(args.concurrency),
        }  # fmt: skip
        # the instance's storage is created here before the daemon opens it: two processes creating the same
        # SQLite tables at once collide ("table ... already exists")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            started = time.time()
            daemon = subprocess.Popen(
                [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                kept = [data / "warehouse" / "kept" / f"{r}.parquet" for r in run_ids]
                while not (
                    all(p.exists() for p in kept) and not instance.get_run_records(dg.RunsFilter(statuses=IN_FLIGHT))
                ):
                    if time.time() - started > args.timeout or daemon.poll() is not None:
                        sys.exit(
                            f"not done after {time.time() - started:.0f} s; daemon log tail:\n{log_path.read_text()[-3000:]}"
                        )
                    time.sleep(1)
                wall = time.time() - started
                judge = step_spans(instance, "judge_job", "judge_batch")
                ledger = step_spans(instance, "ledger_job", "ledger")
                failed = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
            finally:
                stop(daemon, seconds=60, group=True)

    origin = min(s.start for s in judge + ledger)
    print(f"{'batch':<12} {'step':<15} {'start':>6} {'end':>6} {'seconds':>8} {'pid':>7}")
    for span in sorted(judge + ledger, key=lambda s: (s.step != "judge_batch", s.start)):
        print(f"{' '.join(span.run_ids):<12} {span.step:<15} {span.start - origin:>6.1f} {span.end - origin:>6.1f} "
              f"{span.seconds:>8.1f} {span.pid:>7}")  # fmt: skip
    judge_sum = sum(s.seconds for s in judge)
    judge_wall = max(s.end for s in judge) - min(s.start for s in judge)
    print(f"runs failed: {len(failed)}")
    print(f"judging: {len(judge)} steps in {len({s.pid for s in judge})} processes, {judge_sum:.1f} s of judging "
          f"in {judge_wall:.1f} s of wall time: speed-up {judge_sum / judge_wall:.2f}x over one at a time "
          f"(overlapping pairs: {overlapping_pairs(judge)})")  # fmt: skip
    walked = [run_id for s in ledger for run_id in s.run_ids]
    print(f"ledger: {len(ledger)} steps walking {len(walked)} batches, in run_id order: {walked == run_ids}, "
          f"overlapping pairs: {overlapping_pairs(ledger)}")  # fmt: skip
    print(f"whole: {wall:.1f} s from the daemon's start to the last kept file")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
