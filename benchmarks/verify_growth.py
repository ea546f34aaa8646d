"""How `verify`'s cap check grows with a warehouse of daily runs.

    .venv/bin/python -m benchmarks.verify_growth [--runs 365] [--kept 150] [--sites 2000]

Builds, in memory, --runs committed runs of --kept kept rows each over 50 macros and --sites sites, each run's
walk having read every run before it (a batch a day), and one early run walked again since (it read every
other run). Prints how long the audit's cap check (`rules.verify.cap_findings`: each run's kept rows with the
history its walk read, against its caps) takes over all of them, with the commit records' digests it compares
worked out on the way, and how many cap findings it made. Nothing is read from or written to disk.
"""

import argparse
import random
import time

import pyarrow as pa

from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.rules.verify import cap_findings

CAPS = {"per_site_cap": 3, "caps": {"m1": {"target": 1000}, "m7": {"site_cap": 2}}}


def record(run_id: str, history: dict[str, str]) -> CommitRecord:
    return CommitRecord(
        run_id=run_id, walked_at="2026-12-01T00:00:00+00:00", files={}, kept_keys=0, caps=CAPS,
        caps_source="deployment", judge={"kind": "gate"}, history=history, inputs={}, unjudged=0,
    )  # fmt: skip


def warehouse(runs: int, kept: int, sites: int, seed: int = 1) -> tuple[dict[str, CommitRecord], dict[str, pa.Table]]:
    """(run_id -> commit record, run_id -> kept rows) of `runs` daily runs, the first walked again last."""
    rng = random.Random(seed)
    records, live, read = {}, {}, {}
    for day in range(runs):
        run_id = f"day-{day:05d}"
        live[run_id] = pa.table({
            "task_id": [f"t{j}" for j in range(kept)], "key_hash": [day * kept + j for j in range(kept)],
            "macro": [f"m{rng.randrange(50)}" for _ in range(kept)],
            "site": [f"s{rng.randrange(sites)}" for _ in range(kept)],
        })  # fmt: skip
        records[run_id] = record(run_id, dict(read))
        read[run_id] = record(run_id, dict(read)).digest  # (an equal record's: the check works out its own)
    first = next(iter(records))
    records[first] = record(first, {r: d for r, d in read.items() if r != first})
    return records, live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=365)
    parser.add_argument("--kept", type=int, default=150, help="kept rows per run")
    parser.add_argument("--sites", type=int, default=2000)
    args = parser.parse_args()
    records, live = warehouse(args.runs, args.kept, args.sites)
    start = time.perf_counter()
    findings = cap_findings(records, live)
    print(f"cap check over {args.runs} runs of {args.kept} kept rows: {time.perf_counter() - start:.2f} s, "
          f"{len(findings)} cap findings")  # fmt: skip


if __name__ == "__main__":
    main()
