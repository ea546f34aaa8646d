"""UI backfills of N partitions against the batch sensor doing the same N batches, under `dagster dev`.

    .venv/bin/python -m benchmarks.backfill_order [--batches 10] [--tasks 60] [--judge gate|llm] [--latency 0.5]
                                                  [--run-slots 2] [--sensor-only]

Both sides start a fresh `dagster dev` (temp DAGSTER_HOME, instance/dagster.yaml) over a fresh copy of the
same N order-sensitive batches (shared keys and sites, built as in the backfill tests):
- backfill: the sensor is stopped, the partitions are registered in a shuffled order through the UI's
  mutation, and "Materialize all" is launched as an asset backfill over all N; timed from the launch until
  the backfill and all its runs are over;
- sensor: the batches are dropped into the data root with the sensor running; timed from the drop until
  every run is over and every batch has its kept file;
- job backfill: the same shuffled registration, then the partition picker of `filter_job` over all N on an
  instance with only --run-slots run slots (max_concurrent_runs) and the sensor on; timed from the launch
  until every batch is committed and no run is in flight. Runs whose ledger step would wait for a run stuck
  in the queue let their slot go (FILTER_PIPELINE_ORDER_QUEUED_SECONDS, default 60 s) and the sensor walks
  their batches in order: it prints how many did.
Prints each side's wall time, its number of runs, the order in which the kept files were written, and how
many kept/surplus rows differ between the two sides (0 when both walk in run_id order); `--sensor-only` times
the sensor side alone (how fast a burst of batches drains: its ledger runs and their walks). With `--judge llm`
the judge is the loopback test server (one vote per task, fixed latency, its own process).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.judge_throughput import server_process
from filter_pipeline_tests.dagster_dev import RUN_DONE, dagster_dev
from filter_pipeline_tests.test_backfill_order import differing_rows, instance_with_run_slots, walk_order, write_batches

SECONDS = 1800


def judge_env(kind: str, base_url: str | None) -> dict:
    if kind == "gate":
        return {"FILTER_JUDGE_KIND": "gate"}
    return {"FILTER_JUDGE_KIND": "llm", "FILTER_JUDGE_BASE_URL": base_url, "FILTER_JUDGE_MODEL": "bench",
            "FILTER_JUDGE_VOTES": "1", "FILTER_JUDGE_CONCURRENCY": "16"}  # fmt: skip


def fresh_root(work: Path, name: str) -> Path:
    data = work / name / "data"
    (data / "runs").mkdir(parents=True)
    return data


def backfill_side(work: Path, batches: Path, ids: list[str], env: dict, seed: int) -> tuple[float, int, Path]:
    data = fresh_root(work, "backfill")
    with dagster_dev(data, home=work / "backfill" / "home", env=env, sensor=False) as server:
        shutil.copytree(batches / "runs", data / "runs", dirs_exist_ok=True)
        order = random.Random(seed).sample(ids, len(ids))
        for run_id in order:
            server.add_dynamic_partition(run_id)
        start = time.perf_counter()
        backfill = server.launch_asset_backfill(order)
        state = server.wait_for_backfill(backfill, SECONDS)
        wall = time.perf_counter() - start
        runs = server.backfill_runs(backfill)
    print(f"backfill: registered {' '.join(order)}; status {state['status']}")
    return wall, len(runs), data / "warehouse"


def job_backfill_side(
    work: Path, batches: Path, ids: list[str], env: dict, seed: int, slots: int
) -> tuple[float, int, int, Path]:
    data, home = fresh_root(work, "job"), work / "job" / "home"
    instance_with_run_slots(home, slots)
    committed = lambda _: all((data / "warehouse" / "_commits" / f"{r}.json").exists() for r in ids)  # noqa: E731
    with dagster_dev(data, home=home, env=env, sensor=False) as server:
        shutil.copytree(batches / "runs", data / "runs", dirs_exist_ok=True)
        order = random.Random(seed).sample(ids, len(ids))
        for run_id in order:
            server.add_dynamic_partition(run_id)
        start = time.perf_counter()
        backfill = server.launch_job_backfill("filter_job", order)
        server.start_sensor()
        runs = server.wait_for_runs(committed, SECONDS)
        wall = time.perf_counter() - start
        stopped = sum(r.status == "FAILURE" for r in server.backfill_runs(backfill))
    return wall, len(runs), stopped, data / "warehouse"


def sensor_side(work: Path, batches: Path, ids: list[str], env: dict) -> tuple[float, list, Path]:
    data = fresh_root(work, "sensor")
    kept = lambda: all((data / "warehouse" / "kept" / f"{r}.parquet").exists() for r in ids)  # noqa: E731
    with dagster_dev(data, home=work / "sensor" / "home", env=env, sensor=True) as server:
        start = time.perf_counter()
        shutil.copytree(batches / "runs", data / "runs", dirs_exist_ok=True)
        deadline = time.time() + SECONDS
        while True:
            runs = server.runs()
            if kept() and runs and all(r.status in RUN_DONE for r in runs):
                break
            if time.time() > deadline:
                raise TimeoutError(f"the sensor did not filter {len(ids)} batches in {SECONDS} s:\n{server.log_tail()}")
            time.sleep(1)
        wall = time.perf_counter() - start
    return wall, runs, data / "warehouse"


def print_sensor_side(args: argparse.Namespace, wall: float, runs: int, warehouse: Path, ids: list[str]) -> None:
    ledger = [r for r in runs if r.job == "ledger_job"]
    print(f"{args.batches} batches x {args.tasks} tasks, judge {args.judge}: batch sensor {wall:.1f} s wall from the "
          f"drop until all are committed, {len(runs)} runs ({len(ledger)} ledger runs), kept written "
          f"{' '.join(walk_order(warehouse, ids))}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=60, help="tasks per batch")
    parser.add_argument("--judge", choices=["gate", "llm"], default="gate")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds the llm test server waits per answer")
    parser.add_argument("--seed", type=int, default=7, help="seed of the registration order")
    parser.add_argument("--run-slots", type=int, default=2, help="max_concurrent_runs for the job backfill")
    parser.add_argument("--sensor-only", action="store_true", help="time the batch sensor's side alone")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="filter-backfill-bench-"))
    try:
        batches = work / "batches"
        ids = write_batches(batches, args.batches, n_tasks=args.tasks)
        server = server_process(args.latency) if args.judge == "llm" else None
        base_url = server.__enter__() if server else None
        try:
            env = judge_env(args.judge, base_url)
            if args.sensor_only:
                return print_sensor_side(args, *sensor_side(work, batches, ids, env), ids)
            b_wall, b_runs, b_warehouse = backfill_side(work, batches, ids, env, args.seed)
            s_wall, s_run_list, s_warehouse = sensor_side(work, batches, ids, env)
            s_runs = len(s_run_list)
            j_wall, j_runs, j_stopped, j_warehouse = job_backfill_side(
                work, batches, ids, env, args.seed, args.run_slots
            )
        finally:
            if server:
                server.__exit__(None, None, None)
        print(f"{args.batches} batches x {args.tasks} tasks, judge {args.judge}"
              + (f" ({args.latency} s per answer)" if args.judge == "llm" else ""))  # fmt: skip
        print(
            f"asset backfill (Materialize all): {b_wall:7.1f} s wall, {b_runs} runs, kept written {' '.join(walk_order(b_warehouse, ids))}"
        )
        print(
            f"batch sensor:                     {s_wall:7.1f} s wall, {s_runs} runs, kept written {' '.join(walk_order(s_warehouse, ids))}"
        )
        print(
            f"job backfill (filter_job, {args.run_slots} run slots): {j_wall:7.1f} s wall, {j_runs} runs ({j_stopped} "
            f"let their slot go), kept written {' '.join(walk_order(j_warehouse, ids))}"
        )
        print(f"ratio backfill / sensor: {b_wall / s_wall:.2f}; job backfill / sensor: {j_wall / s_wall:.2f}")
        print(
            "kept/surplus rows that differ from the sensor's: asset backfill "
            f"{differing_rows(b_warehouse, s_warehouse, ids)}, job backfill {differing_rows(j_warehouse, s_warehouse, ids)}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
