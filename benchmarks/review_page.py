"""How fast the review app answers a big run's task page, and its first pages over many runs.

    .venv/bin/python -m benchmarks.review_page [--tasks 300000] [--requests 20]
    .venv/bin/python -m benchmarks.review_page --runs 365 --tasks 200 --requests 7   # a year of daily runs

Writes a committed run of --tasks tasks straight into a temporary warehouse (its batch_tasks, batch_attempts,
judge_verdicts, kept, surplus, failure_pool and commit record: every fate present), serves the review app on
loopback with uvicorn, and prints the first request of the run's page (the run's files read), then the median
and slowest of --requests requests of filtered pages (HTML and JSON) once the run's tables are cached, and
the queue's first request after a new label (which reorders it). With --runs N, N committed runs of --tasks
tasks each, and first the runs page and the queue as a freshly started app answers them (every run's
verdicts read). Only loopback traffic.
"""

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import uvicorn
from upath import UPath

from filter_pipeline.review.app import create_app
from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.rules.schemas import SCHEMAS, parquet_bytes, to_arrow
from filter_pipeline.storage.publish import write_commit

RUN_ID = "2026-12-01"


def _frame(asset: str, n: int, values: dict) -> pd.DataFrame:
    """A frame of the asset's columns: `values` given, every other column null."""
    return pd.DataFrame({c: values.get(c, [None] * n) for c in SCHEMAS[asset].names})


def write_run(root: Path, tasks: int, run_id: str = RUN_ID) -> None:
    ids = np.array([f"t{i:07}" for i in range(tasks)], dtype=object)
    site = np.array([f"site{i % 500}.example" for i in range(tasks)], dtype=object)
    macro = np.array([f"macro{i % 20}" for i in range(tasks)], dtype=object)
    common = {"task_id": ids, "site": site, "macro": macro, "run_id": [run_id] * tasks,
              "instruction": [f"On {s}, do task {i}." for i, s in enumerate(site)],
              "dedup_key": [f'["{s}","#x","{i}"]' for i, s in enumerate(site)]}  # fmt: skip
    judged = np.arange(tasks) % 10 < 8  # 80% have an ok attempt and a verdict
    dirs = np.array([f"runs/{run_id}/traj/{t}/1" for t in ids], dtype=object)
    verdicts = {k: np.asarray(v, dtype=object)[judged] for k, v in common.items()}
    n_v = int(judged.sum())
    verdicts |= {"dir": dirs[judged], "attempt": [1] * n_v, "status": ["judged"] * n_v, "passed": [True] * n_v,
                 "votes": ["gate"] * n_v, "judge": ["gate"] * n_v}  # fmt: skip
    frames = {
        "batch_tasks": _frame("batch_tasks", tasks, common),
        "batch_attempts": _frame("batch_attempts", tasks, {"task_id": ids, "attempt": [1] * tasks, "ok": judged,
                                                           "dir": dirs, "run_id": [run_id] * tasks}),
        "judge_verdicts": _frame("judge_verdicts", n_v, verdicts),
        "kept": _frame("judge_verdicts", n_v // 2, {k: v[: n_v // 2] for k, v in verdicts.items()}),
        "surplus": _frame("surplus", n_v - n_v // 2, {k: v[n_v // 2 :] for k, v in verdicts.items()}
                          | {"dropped": ["duplicate", "site_cap"] * ((n_v - n_v // 2) // 2) + ["target"] * ((n_v - n_v // 2) % 2)}),
        "failure_pool": _frame("failure_pool", tasks - n_v, {"task_id": ids[~judged], "stage": ["execute"] * (tasks - n_v),
                                                             "reason": ["backend_fail"] * (tasks - n_v), "attempt": [1] * (tasks - n_v),
                                                             "run_id": [run_id] * (tasks - n_v)}),
    }  # fmt: skip
    for asset, frame in frames.items():
        schema_of = "judge_verdicts" if asset == "kept" else asset
        path = root / "warehouse" / asset / f"{run_id}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(parquet_bytes(to_arrow(frame, schema_of)).to_pybytes())
    (root / "runs" / run_id).mkdir(parents=True)
    write_commit(UPath(str(root / "warehouse")), CommitRecord(
        run_id=run_id, walked_at="2026-12-01T00:00:00+00:00", files={}, kept_keys=n_v // 2,
        caps={"per_site_cap": 3, "caps": {}}, caps_source="deployment", judge={"kind": "gate"}, history={},
        inputs={}, unjudged=0))  # fmt: skip


def timed_get(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as response:
        size = len(response.read())
    return time.perf_counter() - start, size


def posted_label(base: str, task_id: str) -> None:
    body = json.dumps({"run_id": RUN_ID, "task_id": task_id, "success": False}).encode()
    request = urllib.request.Request(f"{base}/api/labels", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 201, response.status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=300_000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--runs", type=int, default=1, help="committed runs of --tasks tasks each")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        start = time.perf_counter()
        for k in range(args.runs - 1):  # (earlier runs, named to sort before RUN_ID)
            write_run(root, args.tasks, f"2025-{k:04d}")
        write_run(root, args.tasks)
        print(f"wrote {args.runs} committed run(s) of {args.tasks:,} tasks in {time.perf_counter() - start:.1f} s")
        server = uvicorn.Server(uvicorn.Config(create_app(UPath(str(root))), host="127.0.0.1", port=0,
                                               log_level="warning"))  # fmt: skip
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        cold_runs, _ = timed_get(f"{base}/")
        cold_queue, _ = timed_get(f"{base}/queue")
        print(f"a freshly started app over {args.runs} run(s): the runs page {cold_runs:.2f} s, the queue "
              f"{cold_queue:.2f} s")  # fmt: skip
        first, _ = timed_get(f"{base}/runs/{RUN_ID}")
        print(f"first request of the run's page (its files read, fates derived): {first:.2f} s")
        paths = [f"/runs/{RUN_ID}", f"/runs/{RUN_ID}?fate=surplus&offset=1000", f"/runs/{RUN_ID}?site=site7.example",
                 f"/api/runs/{RUN_ID}/tasks?fate=execute_fail&limit=500", f"/api/runs/{RUN_ID}/tasks?macro=macro3&offset=9000",
                 f"/runs/{RUN_ID}/tasks/t{args.tasks // 2 + 1:07}", "/queue"]  # fmt: skip
        times = {
            path: [timed_get(base + path)[0] for _ in range(max(1, args.requests // len(paths)))] for path in paths
        }
        every = [t for ts in times.values() for t in ts]
        for path, ts in times.items():
            print(f"  {path}: median {statistics.median(ts) * 1000:.0f} ms, slowest {max(ts) * 1000:.0f} ms")
        print(f"cached pages: median {statistics.median(every) * 1000:.0f} ms, slowest {max(every) * 1000:.0f} ms "
              f"over {len(every)} requests")  # fmt: skip
        after = []
        for k in range(3):
            posted_label(base, f"t{k + 1:07}")
            after.append(timed_get(f"{base}/queue")[0])
        print(f"/queue after a new label (which reorders it): median {statistics.median(after):.2f} s, slowest "
              f"{max(after):.2f} s over {len(after)} labels")  # fmt: skip
        server.should_exit = True
        thread.join()


if __name__ == "__main__":
    main()
