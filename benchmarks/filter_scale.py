"""The filter stage at scale, against the earlier script's approach, as whole processes.

    .venv/bin/python -m benchmarks.filter_scale                      # 2M history rows, 300k tasks
    .venv/bin/python -m benchmarks.filter_scale --repeat 5           # the same, five times each, with medians
    .venv/bin/python -m benchmarks.filter_scale --history-runs 400 --no-baseline --against-history-runs 40 --repeat 3
                                                                     # history x 10, alternating with 2M

Generates (fixed seed, cached under benchmarks/out/) a history of kept rows — as committed warehouse Parquet
files (each with its commit record, as the ledger step leaves them) for this project and as legacy
runs/*/kept.jsonl for the baseline — and one new batch (1–3 attempts per task, 40% of them failed: about 600k
attempt lines for 300k tasks, the shape whose peak RSS must stay under 1 GB), then times `filter-pipeline materialize` (process
start to exit, Dagster included) and the baseline script on it, printing wall time, peak RSS and this
project's split by step (and, with --repeat, the median ratio). It also prints what committing and verifying
cost: hashing every committed history file as the ledger step does, fingerprinting the batch's inputs and
writing its commit record, timed one after the other in this process (in the step they overlap other work,
so these are upper bounds), against the run's wall time. Each repeat also times the first batch of the repository's
sample (data/runs/2026-11-27: 8 tasks) alone, the fixed cost of any run: the process, Dagster's run, coverage
and calibration.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

from filter_pipeline.rules import commits
from filter_pipeline.rules.schemas import key_hash
from filter_pipeline.storage.files import input_fingerprints
from filter_pipeline.storage.history import read_commits, verified_bytes
from filter_pipeline.storage.publish import file_entry, write_commit

REPO = Path(__file__).resolve().parent.parent
ELEMENTS = ["#add", "#buy", "#send", "input[name=q]", "#save"]


def key_text(site: str, element: str, argument: int) -> str:
    return json.dumps([site, element, argument], ensure_ascii=False, separators=(",", ":"))


def generate(out: Path, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    sites = np.array([f"site{i:04d}.example" for i in range(args.sites)], dtype=object)
    macros = np.array([f"macro{i:02d}" for i in range(args.macros)], dtype=object)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    kept_dir = out / "warehouse" / "kept"
    kept_dir.mkdir(parents=True, exist_ok=True)

    for r in range(args.history_runs):
        run_id = f"h{r:04d}"
        n = args.history_rows
        s, m = rng.integers(0, args.sites, n), rng.integers(0, args.macros, n)
        e, a = rng.integers(0, len(ELEMENTS), n), rng.integers(0, args.arguments, n)
        keys = [key_text(sites[i], ELEMENTS[j], int(k)) for i, j, k in zip(s, e, a)]
        task_ids = [f"{run_id}-{i}" for i in range(n)]
        table = pa.table(
            {"task_id": task_ids, "macro": macros[m], "site": sites[s], "dedup_key": keys,
             "key_hash": [key_hash(k) for k in keys], "run_id": [run_id] * n}
        )  # fmt: skip
        pq.write_table(table, kept_dir / f"{run_id}.parquet")
        commit_history_run(out, run_id)
        if not args.no_baseline:
            run = out / "runs" / run_id
            run.mkdir(exist_ok=True)
            with open(run / "kept.jsonl", "w") as f:
                for t, mm, ss, k in zip(task_ids, macros[m], sites[s], keys):
                    f.write(f'{{"task_id":"{t}","macro":"{mm}","site":"{ss}","dedup_key":{k}}}\n')

    run = out / "runs" / "new"
    run.mkdir(exist_ok=True)
    n = args.tasks
    s, m = rng.integers(0, args.sites, n), rng.integers(0, args.macros, n)
    e, a = rng.integers(0, len(ELEMENTS), n), rng.integers(0, args.arguments, n)
    with open(run / "tasks.jsonl", "w") as f:
        for i in range(n):
            key = key_text(sites[s[i]], ELEMENTS[e[i]], int(a[i]))
            f.write(
                f'{{"task_id":"t{i}","macro":"{macros[m[i]]}","site":"{sites[s[i]]}","instruction":"do task {i}",'
                f'"dedup_key":{key},"start":{{"kind":"url","url":"https://{sites[s[i]]}/"}}}}\n'
            )
    n_attempts = rng.integers(1, 4, n)
    lines = []
    for i in range(n):
        for att in range(1, n_attempts[i] + 1):
            ok = bool(rng.random() < 0.6)
            steps = ",".join('{"action":"click","selector":"#x"}' for _ in range(int(rng.integers(1, 6))))
            error = "" if ok else ',"error":"assertion failed: banner missing"'
            backend = '{"ok":true,"detail":"row found"}' if ok else "null"
            lines.append(
                f'{{"task_id":"t{i}","attempt":{att},"ok":{"true" if ok else "false"}{error},'
                f'"dir":"runs/new/traj/t{i}/{att}","steps":[{steps}],"backend":{backend}}}\n'
            )
    rng.shuffle(lines)
    (run / "executions.jsonl").write_text("".join(lines))
    (run / "_SUCCESS").write_text("")


def commit_history_run(out: Path, run_id: str) -> None:
    """The commit record a walk of history run `run_id` would have left beside its kept file."""
    root = UPath(str(out))
    path = root / "warehouse" / "kept" / f"{run_id}.parquet"
    data = path.read_bytes()
    record = commits.CommitRecord(
        run_id=run_id, walked_at="2026-11-30T00:00:00+00:00",
        files={"kept": file_entry(root, path, data, pq.read_metadata(path.path).num_rows)},
        kept_keys=0, caps={"per_site_cap": 40, "caps": {}}, caps_source="run config",
        judge={"kind": "gate", "model": None, "prompt_version": None, "votes": "gate"}, history={}, inputs={}, unjudged=0,
    )  # fmt: skip
    write_commit(root / "warehouse", record)


def integrity_cost(data: Path) -> dict[str, float]:
    """Seconds of what commits add, timed serially here: verifying (reading and hashing) every committed
    history file, fingerprinting the new batch's inputs, writing a commit record."""
    root = UPath(str(data))
    records = read_commits(root / "warehouse")
    start = time.perf_counter()
    for run_id, record in records.items():
        if run_id != "new":
            verified_bytes(root, run_id, record.files["kept"])
    verify = time.perf_counter() - start
    start = time.perf_counter()
    inputs = input_fingerprints(root / "runs" / "new")
    fingerprint = time.perf_counter() - start
    start = time.perf_counter()
    write_commit(root / "warehouse", records["new"])
    write = time.perf_counter() - start
    assert inputs == records["new"].inputs
    return {"verify history": verify, "fingerprint inputs": fingerprint, "write commit": write}


BASELINE = r"""
# The earlier script, as the reference: json.loads line by line into a set and a dict, then a Python walk.
import json, os, sys
data, run_id, per_site_cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen, count = set(), {}
for other in sorted(os.listdir(os.path.join(data, "runs"))):
    path = os.path.join(data, "runs", other, "kept.jsonl")
    if other == run_id or not os.path.exists(path):
        continue
    for line in open(path):
        row = json.loads(line)
        seen.add(tuple(json.dumps(x) for x in row["dedup_key"]))
        count[(row["macro"], row["site"])] = count.get((row["macro"], row["site"]), 0) + 1
tasks = [json.loads(line) for line in open(os.path.join(data, "runs", run_id, "tasks.jsonl"))]
best = {}
for line in open(os.path.join(data, "runs", run_id, "executions.jsonl")):
    a = json.loads(line)
    if a["ok"] and a["attempt"] > best.get(a["task_id"], (0,))[0]:
        best[a["task_id"]] = (a["attempt"], a)
kept = []
for t in tasks:
    if t["task_id"] not in best:
        continue
    key = tuple(json.dumps(x) for x in t["dedup_key"])
    if key in seen or count.get((t["macro"], t["site"]), 0) >= per_site_cap:
        continue
    seen.add(key)
    count[(t["macro"], t["site"])] = count.get((t["macro"], t["site"]), 0) + 1
    kept.append(t["task_id"])
with open(os.path.join(data, "baseline_kept.txt"), "w") as f:
    f.write("\n".join(kept))
"""


def timed(cmd: list[str], env: dict) -> tuple[float, float, str, subprocess.CompletedProcess]:
    """(wall seconds, peak RSS in MB of this child, its system time and page faults as text, result); each
    command runs in a fresh child process. (On a VM that hands freed memory back to its host, every page a
    process touches first costs a fault: see README, Performance.)"""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%M %S %R", *cmd], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    rss_kb, system, faults = done.stderr.strip().splitlines()[-1].split() if done.stderr.strip() else (0, 0, 0)
    return wall, int(rss_kb) / 1024, f"sys {float(system):4.1f} s, {int(faults) // 1000:4d}k page faults", done


def step_split(home: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per step of the last filter_job run, and per phase (parse, index, walk, write), from the
    instance's event log: a phase runs from the event that starts it to the log line or event that ends it
    (parse: the time the parse reports)."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)) as instance:
        [record] = instance.get_run_records(dg.RunsFilter(job_name="filter_job"), limit=1)
        events = instance.all_logs(record.dagster_run.run_id)
    starts, split, marks = {}, {}, {}
    phases = {"write": 0.0}
    last_output: dict[str, float] = {}
    for event in events:
        kind = event.dagster_event_type
        if kind == dg.DagsterEventType.STEP_START:
            starts[event.step_key] = event.timestamp
        elif kind == dg.DagsterEventType.STEP_SUCCESS:
            split[event.step_key] = event.timestamp - starts[event.step_key]
        elif kind in (dg.DagsterEventType.STEP_INPUT, dg.DagsterEventType.STEP_OUTPUT):
            marks[event.step_key] = event.timestamp  # the step's last input, then its last output so far
            if kind == dg.DagsterEventType.STEP_OUTPUT:
                last_output[event.step_key] = event.timestamp
        elif kind == dg.DagsterEventType.HANDLED_OUTPUT:  # converted, written, recorded
            phases["write"] += event.timestamp - last_output[event.step_key]
        elif kind is None and event.user_message.startswith("parsed runs/"):
            phases["parse"] = float(re.search(r" in ([0-9.]+) s", event.user_message).group(1))
        elif kind is None and event.user_message.startswith("prior index:"):
            phases["index"], marks["index"] = event.timestamp - marks[event.step_key], event.timestamp
        elif kind is None and event.user_message.startswith(("staged ", "committed ")) and " s" in event.user_message:
            # the ledger's own: its files staged, then published and moved into place
            phases["write"] += float(re.search(r" in ([0-9.]+) s", event.user_message).group(1))
        elif kind is None and event.user_message.startswith("walk:"):
            phases["walk"] = event.timestamp - marks["index"]
    return split, {name: phases[name] for name in ("parse", "index", "walk", "write")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history-runs", type=int, default=40)
    parser.add_argument("--history-rows", type=int, default=50_000)
    parser.add_argument("--tasks", type=int, default=300_000)
    parser.add_argument("--sites", type=int, default=2000)
    parser.add_argument("--macros", type=int, default=50)
    parser.add_argument("--arguments", type=int, default=10_000_000)
    parser.add_argument("--per-site-cap", type=int, default=40)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the earlier script (it needs ~30 GB at 20M rows)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time both N times, alternating, and print the medians (the machine's noise is ~10%%)",
    )
    parser.add_argument(
        "--against-history-runs",
        type=int,
        help="also time the same batch against this many history runs, alternating, and print the ratio of medians",
    )
    args = parser.parse_args()

    name, data = dataset(args)
    history = args.history_runs * args.history_rows
    print(f"history {history:,} kept rows in {args.history_runs} runs; batch {args.tasks:,} tasks")
    other = None
    if args.against_history_runs:
        other = dataset(argparse.Namespace(**{**vars(args), "history_runs": args.against_history_runs}))
    ours, theirs, against, sample = [], [], [], []
    for n in range(1, args.repeat + 1):
        label = f"[{n}/{args.repeat}] " if args.repeat > 1 else ""
        ours.append(run_filter(data, args.out / f"{name}-home", args, label))
        if other is not None:
            against.append(run_filter(other[1], args.out / f"{other[0]}-home", args, f"{label}[{other[0]}] "))
        sample.append(run_sample(args.out, label))
        if not args.no_baseline:
            theirs.append(run_baseline(data, args, label))
            print(
                f"{label}ratio:           {ours[-1][0] / theirs[-1][0]:6.3f} x time, {ours[-1][1] / theirs[-1][1]:.2f} x memory"
            )
    print(f"the sample's first batch alone (fixed cost): median {statistics.median(sample):.2f} s (all: "
          f"{', '.join(f'{w:.2f}' for w in sorted(sample))})")  # fmt: skip
    if against:
        mine, theirs_median = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in against)
        print(f"history x{args.history_runs / args.against_history_runs:g}: median {mine:.1f} s against "
              f"{theirs_median:.1f} s with {args.against_history_runs} history runs: {mine / theirs_median:.2f} x")  # fmt: skip
    if args.repeat > 1:
        wall, rss = statistics.median(w for w, _ in ours), max(r for _, r in ours)
        line = f"median of {args.repeat}: filter-pipeline {wall:.1f} s (peak RSS up to {rss:.0f} MB)"
        if theirs:
            ratios = sorted(w / b for (w, _), (b, _) in zip(ours, theirs))
            line += f", baseline {statistics.median(b for b, _ in theirs):.1f} s; ratio {statistics.median(ratios):.3f} x time"
            line += f" (all runs, sorted: {', '.join(f'{r:.3f}' for r in ratios)})"
        print(line)


def dataset(args: argparse.Namespace) -> tuple[str, Path]:
    """(name, folder) of the data set `args` describe, generated unless it is there already."""
    name = f"h{args.history_runs}x{args.history_rows}-t{args.tasks}-s{args.seed}{'-nb' if args.no_baseline else ''}"
    data = args.out / name
    if not (data / "runs" / "new" / "_SUCCESS").exists() or not (data / "warehouse" / commits.COMMITS_DIR).exists():
        shutil.rmtree(data, ignore_errors=True)
        start = time.perf_counter()
        generate(data, args)
        print(f"generated {name} in {time.perf_counter() - start:.0f} s")
    return name, data


def fresh_instance(home: Path) -> None:
    """An empty Dagster instance at `home`, as `make setup` makes one. It exists before the timed run, as it does
    on every day but a user's first: creating its SQLite schema is a one-time cost, not a per-batch one."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
    subprocess.run(
        [sys.executable, "-c", f"import dagster as dg; dg.DagsterInstance.from_config({str(home)!r}).dispose()"],
        check=True,
    )


SAMPLE_RUN = "2026-11-27"  # the sample's first batch: walked first, so it can be named alone


def run_sample(out: Path, label: str) -> float:
    """One timed `filter-pipeline materialize` of the sample's first batch, in a fresh copy of the sample data on a
    fresh instance; wall s."""
    copy, home = out / "sample", out / "sample-home"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(REPO / "data", copy, ignore=shutil.ignore_patterns("warehouse"))
    fresh_instance(home)
    env = {**os.environ, "DAGSTER_HOME": str(home), "FILTER_JUDGE_KIND": "gate"}
    wall, rss, kernel, done = timed(
        [sys.executable, "-m", "filter_pipeline.cli.main", "materialize", "--data", str(copy), SAMPLE_RUN], env
    )
    if done.returncode != 0:
        sys.exit(f"filter-pipeline failed on the sample:\n{done.stdout}\n{done.stderr[-3000:]}")
    print(f"{label}the sample's {SAMPLE_RUN}: {wall:6.2f} s  peak RSS {rss:7.0f} MB  ({kernel})")
    return wall


def run_filter(data: Path, home: Path, args: argparse.Namespace, label: str) -> tuple[float, float]:
    """One timed `filter-pipeline materialize` of the batch on a fresh instance; (wall s, peak RSS MB)."""
    fresh_instance(home)
    for folder in ("judge_verdicts", "failure_pool", "prior_dedup_index", "prior_kept_counts", "surplus",
                   "batch_tasks", "batch_attempts", "batch_rejects", "dpo_pairs", "filter_report"):  # fmt: skip
        shutil.rmtree(data / "warehouse" / folder, ignore_errors=True)
    (data / "warehouse" / "kept" / "new.parquet").unlink(missing_ok=True)
    (data / "warehouse" / commits.COMMITS_DIR / "new.json").unlink(missing_ok=True)

    env = {**os.environ, "DAGSTER_HOME": str(home)}
    cli = [sys.executable, "-m", "filter_pipeline.cli.main", "materialize", "--data", str(data),
           "--per-site-cap", str(args.per_site_cap), "new"]  # fmt: skip
    wall, rss, kernel, done = timed(cli, env)
    if done.returncode != 0:
        sys.exit(f"filter-pipeline failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    summary = next(line for line in done.stdout.splitlines() if line.startswith("new:"))
    print(f"{label}filter-pipeline: {wall:6.1f} s  peak RSS {rss:7.0f} MB  ({kernel})   {summary}")
    split, phases = step_split(home)
    print("  split: " + ", ".join(f"{step} {sec:.1f} s" for step, sec in split.items()))
    print("  phases: " + ", ".join(f"{phase} {sec:.1f} s" for phase, sec in phases.items()))
    cost = integrity_cost(data)
    total = sum(cost.values())
    print(
        "  commits: "
        + ", ".join(f"{name} {sec:.2f} s" for name, sec in cost.items())
        + f"; together {total:.2f} s = {100 * total / wall:.1f}% of the run (upper bound: serial here)"
    )
    return wall, rss


def run_baseline(data: Path, args: argparse.Namespace, label: str) -> tuple[float, float]:
    """The earlier script on the same batch, checked to keep the same rows; (wall s, peak RSS MB)."""
    wall, rss, kernel, done = timed(
        [sys.executable, "-c", BASELINE, str(data), "new", str(args.per_site_cap)], dict(os.environ)
    )
    if done.returncode != 0:
        sys.exit(f"baseline failed:\n{done.stderr[-3000:]}")
    kept = set(pd.read_parquet(data / "warehouse" / "kept" / "new.parquet", columns=["task_id"])["task_id"])
    baseline_kept = set((data / "baseline_kept.txt").read_text().split())
    print(f"{label}baseline:        {wall:6.1f} s  peak RSS {rss:7.0f} MB  ({kernel})   kept {len(baseline_kept)}")
    print(f"{label}same kept rows as the baseline: {kept == baseline_kept}")
    if kept != baseline_kept:
        sys.exit(1)
    return wall, rss


if __name__ == "__main__":
    main()
