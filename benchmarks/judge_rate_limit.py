"""The judge against a rate-limited endpoint: time to judge everything against the ideal at that rate.

    .venv/bin/python -m benchmarks.judge_rate_limit [--tasks 50] [--rate 8] [--retry-after 1]
                                                    [--latency 0 0.05 0.2] [--concurrency 16]

The local OpenAI-compatible test server (its own process, loopback only) allows --rate requests a second (a
token bucket of --rate) and answers 429 with `Retry-After: --retry-after` beyond. For each server latency it
prints the tasks judged, the requests made (429s included), the seconds taken, the ideal (tasks / rate) and
the fraction of the allowed rate reached (ideal / seconds).
"""

import argparse
import time

from benchmarks.judge_throughput import server_process
from benchmarks.sample_prompts import task_messages
from filter_pipeline.judge.client import judge_prompts
from filter_pipeline.judge.config import LLMJudgeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=50)
    parser.add_argument("--rate", type=float, default=8.0, help="requests a second the server allows")
    parser.add_argument("--retry-after", default="1", help="the Retry-After header of its 429s")
    parser.add_argument("--latency", type=float, nargs="+", default=[0.0, 0.05, 0.2], help="seconds per reply")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

    prompts = [task_messages(i, [{"action": "click"}], f"https://shop/{i}", "Cart: 1 item") for i in range(args.tasks)]
    ideal = args.tasks / args.rate
    print(f"{args.tasks} tasks, {args.rate:g} requests/s allowed (429 + Retry-After: {args.retry_after} beyond), "
          f"concurrency {args.concurrency}, ideal {ideal:.2f} s")  # fmt: skip
    print(f"{'latency ms':>10} {'judged':>7} {'requests':>9} {'seconds':>8} {'of rate':>8}")
    for latency in args.latency:
        options = ["--rate", str(args.rate), "--retry-after", args.retry_after]
        with server_process(latency, *options) as base_url:
            settings = LLMJudgeConfig(base_url=base_url, model="bench", concurrency=args.concurrency)
            start = time.perf_counter()
            verdicts = judge_prompts(prompts, settings)
            seconds = time.perf_counter() - start
        judged = sum(v.status == "judged" for v in verdicts)
        requests = sum(v.requests for v in verdicts)
        print(f"{latency * 1000:>10.0f} {judged:>7} {requests:>9} {seconds:>8.2f} {ideal / seconds:>8.0%}", flush=True)


if __name__ == "__main__":
    main()
