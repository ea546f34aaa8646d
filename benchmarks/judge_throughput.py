"""Judge throughput against a local OpenAI-compatible server that answers after a fixed latency.

    .venv/bin/python -m benchmarks.judge_throughput [--tasks 2000] [--latency 0.2] [--concurrency 1 16 64]

Prints judged tasks per second at each concurrency next to the ideal (concurrency / latency), one vote per
task so a task is one call. Only loopback traffic.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

from filter_pipeline.judge.client import judge_prompts
from filter_pipeline.judge.config import LLMJudgeConfig
from filter_pipeline.judge.prompt import Evidence, build_messages, success_criteria


@contextmanager
def server_process(latency: float, *options: str):
    """The test server in its own process: sharing this interpreter's lock would cap the client, not measure it.
    `options`: more of filter_pipeline_tests.openai_server's command-line options (rate limit, unparseable...)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "filter_pipeline_tests.openai_server", "--latency", str(latency), *options],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc.stdout.readline().strip()
    finally:
        stop(proc, seconds=10)


def stop(proc: subprocess.Popen, seconds: float, group: bool = False) -> None:
    """SIGTERM to the process (or its process group), then SIGKILL if it has not exited after `seconds`. A
    process can inherit SIGTERM ignored: a non-interactive shell starts background jobs with SIGINT ignored,
    and Dagster, once loaded in the process that started this one, maps SIGTERM to SIGINT's handler."""
    signal_to = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    signal_to(signal.SIGTERM)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        signal_to(signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds the server waits before answering")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()

    prompts = [
        build_messages(f"Add item {i} to the cart", success_criteria("add_to_cart", "shop.example", f'["shop.example","#add",{i}]', "url"),
                       Evidence([{"action": "click", "selector": f"#item-{i}"}] * 5, f"https://shop.example/cart/{i}",
                                "Your cart: 1 item. " * 200, None, (), "trajectory"), LLMJudgeConfig())
        for i in range(args.tasks)
    ]  # fmt: skip
    print(f"{args.tasks} tasks, 1 vote each, server latency {args.latency * 1000:.0f} ms")
    print(f"{'concurrency':>11} {'seconds':>8} {'tasks/s':>8} {'ideal':>8} {'of ideal':>8}")
    with server_process(args.latency) as base_url:
        for concurrency in args.concurrency:
            settings = LLMJudgeConfig(base_url=base_url, model="bench", votes=1, concurrency=concurrency)
            start = time.perf_counter()
            verdicts = judge_prompts(prompts, settings)
            seconds = time.perf_counter() - start
            assert all(v.status == "judged" for v in verdicts)
            rate, ideal = args.tasks / seconds, concurrency / args.latency
            print(f"{concurrency:>11} {seconds:>8.1f} {rate:>8.1f} {ideal:>8.1f} {rate / ideal:>8.0%}", flush=True)


if __name__ == "__main__":
    main()
