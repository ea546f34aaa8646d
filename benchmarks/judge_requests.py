"""Requests and tokens per task: the judge client of commit 6e847e5 at its defaults against today's.

    .venv/bin/python -m benchmarks.judge_requests [--tasks 2000] [--latency 0.2] [--unparseable 0.1]
                                                  [--concurrency 64]

The local OpenAI-compatible test server (its own process, loopback only) answers after --latency seconds; a
share --unparseable of the requests (drawn from a hash of the exact request, so an identical request gets
the identical reply, as at temperature 0) get prose without a verdict, unless structured output was asked
for and accepted (constrained decoding cannot produce prose). Tokens are about a quarter of the characters
sent and received; the system message counts as a cached prefix once the server has seen it.

Clients compared, one row each:
- old: commit 6e847e5's llm.py, read from git history (votes 3 at temperature 0, an unparseable reply asked
  again identically up to 5 times per vote);
- new, response_format accepted: today's client at its defaults;
- new, response_format rejected: today's client dropping structured output, repairing unparseable replies.
"""

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.judge_throughput import server_process
from benchmarks.sample_prompts import task_messages
from filter_pipeline.judge.client import judge_prompts
from filter_pipeline.judge.config import LLMJudgeConfig

REPO = Path(__file__).resolve().parent.parent
OLD_COMMIT = "6e847e5"


def old_client():
    """commit 6e847e5's filter_pipeline/judge/llm.py as a module, or None without the git history."""
    done = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:filter_pipeline/judge/llm.py"], cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        return None
    spec = importlib.util.spec_from_loader(f"judge_llm_{OLD_COMMIT}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(done.stdout, f"{OLD_COMMIT}:filter_pipeline/judge/llm.py", "exec"), module.__dict__)
    return module


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

    old = old_client()
    runs = [("new, response_format accepted", "accept", None), ("new, response_format rejected", "reject", None)]
    if old is not None:
        runs.insert(0, (f"old ({OLD_COMMIT}: votes 3, temperature 0)", "accept", old))
    else:
        print(f"old: not measured (no git history with commit {OLD_COMMIT} here)")
    for name, response_format, module in runs:
        options = ["--unparseable", str(args.unparseable), "--response-format", response_format]
        with server_process(args.latency, *options) as base_url:
            start = time.perf_counter()
            if module is not None:
                settings = module.LLMSettings(base_url=base_url, model="bench", concurrency=args.concurrency)
                verdicts = module.judge_prompts(prompts, settings)
                requests = sum(v.calls for v in verdicts)
                cached = "n/a"
            else:
                verdicts = judge_prompts(
                    prompts, LLMJudgeConfig(base_url=base_url, model="bench", concurrency=args.concurrency)
                )
                requests = sum(v.requests for v in verdicts)
                cached = f"{sum(v.cached_tokens for v in verdicts) / args.tasks:.0f}"
            seconds = time.perf_counter() - start
        n = args.tasks
        unjudged = sum(v.status != "judged" for v in verdicts)
        print(f"{name:<40} {requests / n:>8.2f} {sum(v.prompt_tokens for v in verdicts) / n:>10.0f} "
              f"{sum(v.completion_tokens for v in verdicts) / n:>9.1f} {cached:>10} {unjudged:>8} {seconds:>8.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
