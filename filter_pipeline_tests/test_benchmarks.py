"""The benchmarks, run at a tiny size so they do not rot. Figures come from running them in full (README)."""

import re
import subprocess
import sys

import pytest

from filter_pipeline_tests.conftest import REPO

pytestmark = pytest.mark.slow


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_filter_scale_agrees_with_the_baseline_at_a_small_size(tmp_path):
    out = run(
        "benchmarks.filter_scale", "--history-runs", "3", "--history-rows", "2000", "--tasks", "3000",
        "--sites", "40", "--macros", "4", "--arguments", "2000", "--per-site-cap", "20", "--out", str(tmp_path),
        "--repeat", "2",
    )  # fmt: skip
    assert out.count("same kept rows as the baseline: True") == 2
    assert "median of 2: filter-pipeline" in out and "ratio" in out
    assert "split: judge_batch" in out and "ledger" in out
    assert out.count("k page faults") == 6  # each timed process's system time and faults: both sides, the sample
    assert out.count("the sample's 2026-11-27: ") == 2 and "the sample's first batch alone (fixed cost): median" in out
    phases = next(line for line in out.splitlines() if line.strip().startswith("phases:"))
    assert [part.split()[0] for part in phases.split(":", 1)[1].split(",")] == ["parse", "index", "walk", "write"]


def test_filter_scale_compares_two_history_sizes(tmp_path):
    out = run(
        "benchmarks.filter_scale", "--history-runs", "4", "--against-history-runs", "2", "--history-rows", "500",
        "--tasks", "500", "--sites", "10", "--macros", "2", "--arguments", "500", "--no-baseline", "--out", str(tmp_path),
    )  # fmt: skip
    assert "history 2,000 kept rows in 4 runs" in out and "[h2x500-t500-s20261130-nb] filter-pipeline:" in out
    assert re.search(r"history x2: median [0-9.]+ s against [0-9.]+ s with 2 history runs: [0-9.]+ x", out), out


def test_judge_throughput_runs_at_a_small_size():
    out = run("benchmarks.judge_throughput", "--tasks", "40", "--latency", "0.05", "--concurrency", "1", "8")
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0] in ("1", "8")]
    assert [r[0] for r in rows] == ["1", "8"]
    assert all(0 < float(r[4].rstrip("%")) <= 110 for r in rows)


def test_judge_rate_limit_judges_everything_at_a_small_size():
    out = run("benchmarks.judge_rate_limit", "--tasks", "12", "--rate", "8", "--retry-after", "0.5", "--latency", "0")
    [row] = [line.split() for line in out.splitlines() if line.split() and line.split()[0] == "0"]
    assert row[1] == "12" and int(row[2]) >= 12  # every task judged; the 429s are counted as requests


def test_judge_requests_compares_the_client_configurations_at_a_small_size():
    out = run("benchmarks.judge_requests", "--tasks", "40", "--latency", "0.01", "--unparseable", "0.2")
    # each row: the configuration's name, then requests, prompt, completion, cached tokens per task, unjudged, seconds
    rows = {
        line[:40].strip(): [float(x) for x in line[40:].split()]
        for line in out.splitlines()
        if line.startswith(("defaults", "votes"))
    }
    accepted, rejected, votes = (
        rows["defaults, response_format accepted"],
        rows["defaults, response_format rejected"],
        rows["votes 3 at temperature 0.7"],
    )
    assert accepted[0] == 1.0 and accepted[4] == 0  # structured output: one request a task, every task judged
    assert 1.0 < rejected[0] < 1.5  # prose answered by a repair request, not a resample
    assert votes[0] == 1.0 and votes[2] == 3 * accepted[2]  # three samples in one request (`n`), three completions
    # three samples, each prose apart: one request, and a repair for each sample without a verdict
    assert rows["votes 3, response_format rejected"][0] > rejected[0]


def test_parallel_batches_judge_together_and_walk_the_ledger_one_at_a_time_in_order():
    out = run(
        "benchmarks.parallel_batches", "--batches", "3", "--tasks", "60", "--latency", "0.3", "--concurrency", "2"
    )
    assert "runs failed: 0" in out
    # one ledger step per batch, or fewer when the sensor finds several judged and waiting: each walked once, in order
    assert "walking 3 batches, in run_id order: True, overlapping pairs: 0" in out
    judging = next(line for line in out.splitlines() if line.startswith("judging:"))
    assert "3 steps in 3 processes" in judging
    overlapping = int(judging.rsplit("overlapping pairs: ", 1)[1].rstrip(")"))
    assert overlapping >= 2, out  # with one run at a time there would be none


def test_a_helper_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    # what a benchmark's server inherits when the suite runs as a background job of a non-interactive shell
    from benchmarks.judge_throughput import stop

    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    stop(proc, seconds=0.5)
    assert proc.returncode == -9  # SIGKILL, not a minute's sleep


def test_review_page_runs_at_a_small_size():
    out = run("benchmarks.review_page", "--tasks", "2000", "--requests", "14", "--runs", "3")
    assert "wrote 3 committed run(s) of 2,000 tasks" in out and "first request of the run's page" in out
    assert "a freshly started app over 3 run(s): the runs page " in out and "s, the queue " in out
    assert "cached pages: median" in out and "over 14 requests" in out and "/queue: median" in out
    assert "/queue after a new label (which reorders it): median" in out


def test_verify_growth_counts_the_cap_findings_at_a_small_size():
    out = run("benchmarks.verify_growth", "--runs", "30", "--kept", "40", "--sites", "20")
    found = re.search(r"cap check over 30 runs of 40 kept rows: [0-9.]+ s, (\d+) cap findings", out)
    assert found and int(found.group(1)) > 0, out  # (1,200 kept rows over 50 macros x 20 sites: caps break)
