"""Peak memory of LLM judging, and the rework after a kill half way.

    .venv/bin/python -m benchmarks.judge_memory [--tasks 30000 300000] [--kill-at 20000] [--concurrency 32]

For each size: writes a batch with one trajectory.json per task (steps, final URL, a page text of about
2 kB), then runs `judge_job` (parse, judge, failure pool) in a fresh process against a loopback
chat-completions server that answers at once, and prints the process's peak RSS, wall time and requests.
Then the rework: a run of --kill-at tasks is killed (SIGKILL) once half its verdicts are saved, and run
again; printed are the requests of the resumed run against the tasks left. Only loopback traffic.
"""

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RUN_ID = "bench"
REPLY = json.dumps({
    "id": "c", "object": "chat.completion", "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": '{"reasoning": "ok", "passed": true, "why": "done"}'},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 900, "completion_tokens": 20},
}).encode()  # fmt: skip


# --- a light endpoint: the test server keeps every request it saw, which at 300k would measure itself ---


def serve() -> None:
    """Answer every chat completion at once with a pass; GET /count gives the requests seen so far."""
    count = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                count[0] += 1
            self._send(REPLY)

        def do_GET(self):  # noqa: N802
            self._send(str(count[0]).encode())

        def _send(self, data: bytes):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024

        def handle_error(self, request, client_address):
            pass  # a client killed mid-request (the rework run) resets its connections

    server = Server(("127.0.0.1", 0), Handler)
    print(f"http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    sys.stdout.close()
    server.serve_forever()


@contextmanager
def endpoint():
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.judge_memory", "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def requests_seen(base_url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(base_url.rsplit("/v1", 1)[0] + "/count") as response:
        return int(response.read())


# --- the batch ----------------------------------------------------------------------------------------


def write_batch(root: Path, n: int) -> None:
    """tasks.jsonl, executions.jsonl (one ok attempt per task) and a trajectory folder per task."""
    run = root / "runs" / RUN_ID
    run.mkdir(parents=True)
    page = "Your cart holds the items below. Free delivery from 30 EUR. " * 30
    with open(run / "tasks.jsonl", "w") as tasks, open(run / "executions.jsonl", "w") as executions:
        for i in range(n):
            site = f"shop{i % 50}.example"
            tasks.write(json.dumps({"task_id": f"t{i}", "macro": "add_to_cart", "site": site,
                                    "instruction": f"On {site}, add item {i} to the cart.",
                                    "dedup_key": [site, "#add-to-cart", f"item {i}"], "start": {"kind": "url"}}) + "\n")  # fmt: skip
            rel = f"runs/{RUN_ID}/traj/{i // 1000}/t{i}"
            steps = [{"action": "goto", "url": f"https://{site}/p/{i}"}, {"action": "click", "selector": "#add-to-cart"},
                     {"action": "goto", "url": f"https://{site}/cart"}]  # fmt: skip
            executions.write(json.dumps({"task_id": f"t{i}", "attempt": 1, "ok": True, "dir": rel, "steps": steps,
                                         "backend": {"ok": True, "detail": "cart has 1 item"}}) + "\n")  # fmt: skip
            folder = root / rel
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "trajectory.json").write_text(json.dumps(
                {"instruction": f"add item {i}", "steps": steps,
                 "final": {"url": f"https://{site}/cart", "observation": f"Cart: item {i} (1). {page}"}}))  # fmt: skip
    (run / "_SUCCESS").write_text("")


# --- one judging run, in its own process --------------------------------------------------------------


def judge_child(data: str, base_url: str, concurrency: int) -> None:
    """Run judge_job for the batch; print a JSON line with peak RSS and the judge's metadata."""
    import dagster as dg

    from filter_pipeline.definitions import build_defs
    from filter_pipeline.judge.config import LLMJudgeConfig
    from filter_pipeline.judge.resource import JudgeResource

    judge = JudgeResource(
        kind="llm", llm=LLMJudgeConfig(base_url=base_url, model="bench", votes=1, concurrency=concurrency)
    )
    start = time.perf_counter()
    with dg.DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("run_id", [RUN_ID])
        job = build_defs(data, judge, caps={}).resolve_job_def("judge_job")
        result = job.execute_in_process(instance=instance, partition_key=RUN_ID)
        [mat] = [m for m in result.get_asset_materialization_events() if m.asset_key.path[-1] == "judge_verdicts"]
        meta = {k: v.value for k, v in mat.materialization.metadata.items() if isinstance(v.value, (int, float, str))}
    print(json.dumps({
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.perf_counter() - start,
        **{k: meta.get(k) for k in ("requests", "cache_hits", "resumed_from_progress", "progress_parts_saved", "judged")},
    }), flush=True)  # fmt: skip


def child(data: Path, base_url: str, concurrency: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.judge_memory", "--child", str(data), base_url, str(concurrency)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "DAGSTER_HOME": str(data.parent / "dagster_home")},
    )  # fmt: skip


def saved_verdicts(data: Path) -> int:
    import pyarrow.parquet as pq

    folder = data / "warehouse" / "_judge_progress" / RUN_ID
    total = 0
    for part in folder.glob("*.parquet") if folder.exists() else []:
        try:
            total += pq.read_metadata(part).num_rows
        except Exception:  # noqa: BLE001 - a part being renamed into place: counted next time
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, nargs="*", default=[30_000, 300_000])
    parser.add_argument("--kill-at", type=int, default=20_000, help="tasks of the rework run (0: skip it)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="judge_memory_"))
    (work / "dagster_home").mkdir()
    try:
        with endpoint() as base_url:
            print(f"{'tasks':>8} {'peak RSS MB':>12} {'seconds':>8} {'requests':>9}")
            for n in args.tasks:
                data = work / f"data{n}"
                write_batch(data, n)
                before = requests_seen(base_url)
                proc = child(data, base_url, args.concurrency)
                out, _ = proc.communicate()
                figures = json.loads(out.strip().splitlines()[-1])
                print(
                    f"{n:>8} {figures['peak_rss_mb']:>12.0f} {figures['seconds']:>8.1f} {requests_seen(base_url) - before:>9}",
                    flush=True,
                )
                shutil.rmtree(data, ignore_errors=True)
            if args.kill_at:
                n = args.kill_at
                data = work / "rework"
                write_batch(data, n)
                before = requests_seen(base_url)
                proc = child(data, base_url, args.concurrency)
                while saved_verdicts(data) < n // 2 and proc.poll() is None:
                    time.sleep(0.05)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                first, saved = requests_seen(base_url) - before, saved_verdicts(data)
                before = requests_seen(base_url)
                out, _ = child(data, base_url, args.concurrency).communicate()
                figures = json.loads(out.strip().splitlines()[-1])
                again = requests_seen(base_url) - before
                print(f"rework: {n} tasks, killed after {first} requests with {saved} verdicts saved; "
                      f"the resumed run made {again} requests for the {n - saved} left "
                      f"(reused {figures['resumed_from_progress']} saved verdicts)")  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve()
    elif sys.argv[1:2] == ["--child"]:
        judge_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
