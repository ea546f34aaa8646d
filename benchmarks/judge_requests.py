"""Requests and tokens per task for the judge client's configurations, against one local endpoint.

    .venv/bin/python -m benchmarks.judge_requests [--tasks 2000] [--latency 0.2] [--unparseable 0.1]
                                                  [--concurrency 64]

The local OpenAI-compatible test server (its own process, loopback only) answers after --latency seconds; a
share --unparseable of the requests (drawn from a hash of the exact request, so an identical request gets
the identical reply, as at temperature 0) get prose without a verdict, unless structured output was asked
for and accepted (constrained decoding cannot produce prose). Tokens are about a quarter of the characters
sent and received; the system message counts as a cached prefix once the server has seen it.

Configurations compared, one row each:
- defaults, response_format accepted: one vote, structured output;
- defaults, response_format rejected: the client drops structured output and repairs unparseable replies;
- votes 3 at temperature 0.7: three samples per task (one request where the server takes `n`), with structured
  output accepted, then rejected (each sample drawn apart, each one without a verdict repaired).
"""

import argparse
import sys
import time

from benchmarks.judge_throughput import server_process
from benchmarks.sample_prompts import task_messages
from filter_pipeline.judge.client import judge_prompts
from filter_pipeline.judge.config import LLMJudgeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per reply")
    parser.add_argument("--unparseable", type=float, default=0.1, help="share of requests answered with prose")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()

    prompts = [
        task_messages(
            i,
            [{"action": "click", "selector": f"#item-{i}"}] * 5,
            f"https://shop.example/cart/{i}",
            "Your cart: 1 item. " * 50,
        )
        for i in range(args.tasks)
    ]
    print(f"{args.tasks} tasks, server latency {args.latency * 1000:.0f} ms, {args.unparseable:.0%} of requests "
          f"answered with prose, concurrency {args.concurrency}")  # fmt: skip
    print(
        f"{'client':<40} {'req/task':>8} {'prompt tok':>10} {'compl tok':>9} {'cached tok':>10} {'unjudged':>8} {'seconds':>8}"
    )

    configurations = [
        ("defaults, response_format accepted", "accept", {}),
        ("defaults, response_format rejected", "reject", {}),
        ("votes 3 at temperature 0.7", "accept", {"votes": 3, "temperature": 0.7}),
        ("votes 3, response_format rejected", "reject", {"votes": 3, "temperature": 0.7}),
    ]
    for name, response_format, settings in configurations:
        options = ["--unparseable", str(args.unparseable), "--response-format", response_format]
        with server_process(args.latency, *options) as base_url:
            start = time.perf_counter()
            config = LLMJudgeConfig(base_url=base_url, model="bench", concurrency=args.concurrency, **settings)
            verdicts = judge_prompts(prompts, config)
            seconds = time.perf_counter() - start
        requests = sum(v.requests for v in verdicts)
        cached = sum(v.cached_tokens for v in verdicts)
        n = args.tasks
        unjudged = sum(v.status != "judged" for v in verdicts)
        print(f"{name:<40} {requests / n:>8.2f} {sum(v.prompt_tokens for v in verdicts) / n:>10.0f} "
              f"{sum(v.completion_tokens for v in verdicts) / n:>9.1f} {cached / n:>10.0f} {unjudged:>8} {seconds:>8.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
