"""UI backfills under a real `dagster dev`, launched through GraphQL as the UI launches them, with the
partitions registered out of order (2, 0, 3, 1): kept and surplus of every run must equal, row by row,
what `filter-pipeline materialize` gives on a copy of the same batches, walked in run_id order
(CONTRACT §4: the ledger's order holds whoever launches the run).

The judge is the LLM judge on a loopback chat-completions server that answers the lowest run_ids last
(as a slow batch would), so a ledger that walks in the order the judge steps finish walks them out of
order; the batches share keys and sites, so the order of walks changes what is kept."""

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from filter_pipeline.shell.jobs import FIRST_WALK_TAG, RANGE_END_TAG, RANGE_START_TAG
from filter_pipeline.shell.waiting import DEFERRED_TAG
from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import CLI, REPO, assert_verified
from filter_pipeline_tests.dagster_dev import dagster_dev
from filter_pipeline_tests.openai_server import Call, FakeOpenAI, Reply

pytestmark = pytest.mark.slow

BACKFILL_SECONDS = 900
REGISTRATION_ORDER = [2, 0, 3, 1]
# columns that measure the judge call, not its outcome
MEASUREMENTS = ["latency_ms", "calls"]


def run_ids(n: int) -> list[str]:
    return [f"r{i:02d}" for i in range(n)]


def order_sensitive_batch(data: Path, run_id: str, seed: int, n_tasks: int = 60) -> None:
    """One batch whose tasks share keys and (macro, site) cells with every other batch built here: which
    batch is walked first decides which of them keeps a key or a cap slot. Some attempts fail, some tasks
    have a failed attempt before an ok one."""
    rng = random.Random(seed)
    tasks, attempts = [], []
    for i in range(n_tasks):
        tid = f"{run_id}-t{i:02d}"
        site = f"s{rng.randrange(6)}"
        tasks.append(task(tid, macro=f"m{rng.randrange(3)}", site=site, key=[site, "#el", rng.randrange(12)]))
        if rng.random() < 0.25:
            attempts.append(
                attempt(tid, 1, ok=False, error=rng.choice(["assertion failed: x", "policy violation", "boom"]))
            )
        if rng.random() < 0.9:
            attempts.append(attempt(tid, 2, ok=True))
    rng.shuffle(attempts)  # attempts of several tasks interleaved, as a harness writes them
    write_batch(data, run_id, tasks, attempts)


def write_batches(data: Path, n: int, n_tasks: int = 60) -> list[str]:
    ids = run_ids(n)
    for i, run_id in enumerate(ids):
        order_sensitive_batch(data, run_id, seed=1000 + i, n_tasks=n_tasks)
    return ids


class SlowForLowRunIds:
    """Judge replies: pass unless the task number is a multiple of 7; replies for run r<k> of n wait
    (n - 1 - k) * `step` seconds, so the judge steps of lower run_ids finish later. `fast` turns the
    waits off (the reference CLI run: the verdicts do not depend on them)."""

    def __init__(self, n: int, step: float):
        self.n, self.step, self.fast = n, step, False

    def __call__(self, call: Call, _: int) -> Reply:
        match = re.search(r"do r(\d+)-t(\d+)", call.prompt)
        run, number = (int(match.group(1)), int(match.group(2))) if match else (0, 1)
        passed = number % 7 != 0
        content = json.dumps({"passed": passed, "why": "reached the goal" if passed else "wrong element"})
        return Reply(content=content, delay=0.0 if self.fast else (self.n - 1 - run) * self.step)


def judge_env(server: FakeOpenAI) -> dict:
    # one vote per task and every request of a batch in flight at once: a batch's judging takes one delay
    return {
        "FILTER_JUDGE_KIND": "llm", "FILTER_JUDGE_BASE_URL": server.base_url, "FILTER_JUDGE_MODEL": "judge-test",
        "FILTER_JUDGE_VOTES": "1", "FILTER_JUDGE_CONCURRENCY": "64",
    }  # fmt: skip


def cli_reference(tmp: Path, batches: Path, env: dict) -> Path:
    """`filter-pipeline materialize` (every batch, run_id order) on a copy of `batches`, own DAGSTER_HOME;
    returns the copy's warehouse."""
    data, home = tmp / "cli_data", tmp / "cli_home"
    shutil.copytree(batches, data)
    home.mkdir()
    shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
    result = subprocess.run(
        [*CLI, "materialize"], cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, **env, "DAGSTER_HOME": str(home), "FILTER_PIPELINE_DATA": str(data)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return data / "warehouse"


def outcome(warehouse: Path, run_id: str) -> pd.DataFrame:
    """Every passing verdict of the run with where the walk put it: `kept`, or surplus by its reason."""
    kept = pd.read_parquet(warehouse / "kept" / f"{run_id}.parquet").assign(dropped="kept")
    surplus = pd.read_parquet(warehouse / "surplus" / f"{run_id}.parquet")
    return pd.concat([kept, surplus], ignore_index=True)[["task_id", "dedup_key", "dropped"]]


def differing_rows(warehouse: Path, reference: Path, ids: list[str]) -> int:
    """How many passing verdicts land elsewhere (kept / surplus reason) than in the reference."""
    both = [
        outcome(warehouse, r).merge(
            outcome(reference, r), on=["task_id", "dedup_key"], how="outer", suffixes=("", "_ref")
        )
        for r in ids
    ]
    merged = pd.concat(both, ignore_index=True)
    return int((merged["dropped"] != merged["dropped_ref"]).sum())


def walk_order(warehouse: Path, ids: list[str]) -> list[str]:
    """The order the kept files were written in: the order of the walks."""
    return sorted(ids, key=lambda r: (warehouse / "kept" / f"{r}.parquet").stat().st_mtime_ns)


def assert_same_ledger_as_cli(warehouse: Path, reference: Path, ids: list[str]) -> None:
    missing = [f"{a}/{r}" for a in ("kept", "surplus") for r in ids if not (warehouse / a / f"{r}.parquet").exists()]
    assert not missing, f"no output for {missing}"
    differ = differing_rows(warehouse, reference, ids)
    assert differ == 0, (
        f"{differ} kept/surplus rows differ from the CLI's run_id order; the ledger walked {walk_order(warehouse, ids)}"
    )
    for asset in ("kept", "surplus"):
        for run_id in ids:
            name = f"{asset}/{run_id}.parquet"
            got = pd.read_parquet(warehouse / name).drop(columns=MEASUREMENTS, errors="ignore")
            want = pd.read_parquet(reference / name).drop(columns=MEASUREMENTS, errors="ignore")
            pd.testing.assert_frame_equal(got, want, obj=name)


@pytest.fixture(scope="module")
def judge():
    # the backfill daemon starts a backfill's runs several seconds apart, in partition order: each run_id's
    # judging must outlast that spacing for the finish order to be the reverse of the run_id order
    with FakeOpenAI(SlowForLowRunIds(n=4, step=15.0)) as server:
        yield server


@pytest.fixture(scope="module")
def four_batches(tmp_path_factory, judge):
    """Four order-sensitive batches and the CLI's warehouse over a copy of them (run_id order)."""
    root = tmp_path_factory.mktemp("four")
    batches = root / "batches"
    ids = write_batches(batches, 4)
    judge.responder.fast = True
    try:
        reference = cli_reference(root, batches, judge_env(judge))
    finally:
        judge.responder.fast = False
    # the batches are order-sensitive: every later run loses keys to earlier runs, and caps bite
    surplus = pd.read_parquet(reference / "surplus")
    cross_run = surplus[(surplus["dropped"] == "duplicate") & (surplus["dup_of_run_id"] != surplus["run_id"])]
    assert set(cross_run["run_id"]) == set(ids[1:]), surplus.groupby(["run_id", "dropped"]).size()
    assert (surplus["dropped"] == "site_cap").any() and len(pd.read_parquet(reference / "kept")) > 0
    return batches, ids, reference


def registered_out_of_order(server, batches: Path, data: Path, ids: list[str]) -> list[str]:
    """With the sensor stopped, drop the batches into the data root and register them through the UI's
    mutation in the order 2, 0, 3, 1."""
    order = [ids[i] for i in REGISTRATION_ORDER]
    assert server.sensor_status() == "STOPPED"
    shutil.copytree(batches / "runs", data / "runs", dirs_exist_ok=True)
    for run_id in order:
        server.add_dynamic_partition(run_id)
    assert server.partition_keys() == order
    return order


def test_a_partition_backfill_of_filter_job_in_registration_order_gives_the_clis_results(tmp_path, four_batches, judge):
    batches, ids, reference = four_batches
    data = tmp_path / "data"
    (data / "runs").mkdir(parents=True)
    with dagster_dev(data, home=tmp_path / "home", env=judge_env(judge), sensor=False) as server:
        order = registered_out_of_order(server, batches, data, ids)
        backfill = server.launch_job_backfill("filter_job", order)  # the job page's partition picker: all four
        state = server.wait_for_backfill(backfill, BACKFILL_SECONDS)
        runs = server.backfill_runs(backfill)
    assert state["status"] == "COMPLETED_SUCCESS", state
    assert sorted(r.partition for r in runs if r.status == "SUCCESS") == ids, [(r.partition, r.status) for r in runs]
    assert_same_ledger_as_cli(data / "warehouse", reference, ids)
    assert_verified(data)


def test_an_asset_backfill_materialize_all_gives_the_clis_results(tmp_path, four_batches, judge):
    batches, ids, reference = four_batches
    data = tmp_path / "data"
    (data / "runs").mkdir(parents=True)
    with dagster_dev(data, home=tmp_path / "home", env=judge_env(judge), sensor=False) as server:
        order = registered_out_of_order(server, batches, data, ids)
        backfill = server.launch_asset_backfill(order)  # "Materialize all" on the asset graph, all four partitions
        state = server.wait_for_backfill(backfill, BACKFILL_SECONDS)
        runs = server.backfill_runs(backfill)
    assert state["status"] == "COMPLETED_SUCCESS", (state, [(r.job, r.partition, r.status) for r in runs])
    assert runs and all(r.status == "SUCCESS" for r in runs), [(r.job, r.partition, r.status) for r in runs]
    assert_same_ledger_as_cli(data / "warehouse", reference, ids)
    assert_verified(data)


# A job backfill of more partitions than run slots, registered highest first: the queue starts the highest
# runs first, their ledger steps wait for lower runs queued behind them, and every slot is held by a waiting
# run. The waiting steps must let go (deferring their walk, the run green, the reason on its tag), and the batch
# sensor walk the rest in order, with nobody acting.
SLOTS = 2
MANY = 10
GATE_ENV = {
    "FILTER_JUDGE_KIND": "gate",
    "FILTER_PIPELINE_ORDER_RETRY_SECONDS": "3",
    "FILTER_PIPELINE_ORDER_QUEUED_SECONDS": "10",
    "FILTER_PIPELINE_ORDER_MAX_WAIT_SECONDS": "1800",  # past the test's wait: only letting go unjams it in time
}


def instance_with_run_slots(home: Path, slots: int) -> None:
    home.mkdir(parents=True)
    config = (REPO / "instance" / "dagster.yaml").read_text()
    assert "max_concurrent_runs: 8" in config
    (home / "dagster.yaml").write_text(config.replace("max_concurrent_runs: 8", f"max_concurrent_runs: {slots}"))


def test_a_job_backfill_wider_than_the_run_slots_registered_highest_first_finishes_with_the_clis_results(tmp_path):
    batches = tmp_path / "batches"
    ids = write_batches(batches, MANY, n_tasks=30)
    reference = cli_reference(tmp_path, batches, GATE_ENV)
    data, home = tmp_path / "data", tmp_path / "home"
    (data / "runs").mkdir(parents=True)
    instance_with_run_slots(home, SLOTS)
    with dagster_dev(data, home=home, env=GATE_ENV, sensor=False) as server:
        shutil.copytree(batches / "runs", data / "runs", dirs_exist_ok=True)
        highest_first = ids[::-1]
        for run_id in highest_first:
            server.add_dynamic_partition(run_id)
        backfill = server.launch_job_backfill("filter_job", highest_first)
        server.start_sensor()  # as it runs in a deployment: on
        committed = lambda _: all((data / "warehouse" / "_commits" / f"{r}.json").exists() for r in ids)  # noqa: E731
        runs = server.wait_for_runs(committed, BACKFILL_SECONDS)
        state = server.wait_for_backfill(backfill, BACKFILL_SECONDS)
        backfill_runs = server.backfill_runs(backfill)
    assert state["status"] == "COMPLETED_SUCCESS", (state, [(r.job, r.partition, r.status) for r in backfill_runs])
    assert all(r.status == "SUCCESS" for r in runs), [(r.job, r.partition, r.status) for r in runs]
    deferred = [r for r in backfill_runs if DEFERRED_TAG in r.tags]
    assert deferred, "no waiting run had to let its slot go: the test did not build the jam it is about"
    assert all("deferred instead of waiting" in r.tags[DEFERRED_TAG] for r in deferred)
    walked_by_sensor = {
        w for r in runs if r.job == "ledger_job" and r.status == "SUCCESS" for w in r.tags[FIRST_WALK_TAG].split()
    }  # (one sensor ledger run walks every judged batch waiting in a row)
    assert {r.partition for r in deferred} <= walked_by_sensor, (deferred, walked_by_sensor)
    assert_same_ledger_as_cli(data / "warehouse", reference, ids)
    assert_verified(data)


# A backlog: batches judged while the sensor was off (an outage, a burst faster than its ticks), one of them
# registered after later run_ids. The sensor must walk them all in one ledger run, in run_id order, with the
# CLI's results; ticks while it runs launch no second one.
BACKLOG = 5
BACKLOG_REGISTRATION_ORDER = [0, 1, 3, 4, 2]


def test_a_backlog_of_judged_batches_is_walked_by_one_sensor_ledger_run_in_run_id_order(tmp_path):
    batches = tmp_path / "batches"
    ids = write_batches(batches, BACKLOG, n_tasks=30)
    reference = cli_reference(tmp_path, batches, GATE_ENV)
    data = tmp_path / "data"
    (data / "runs").mkdir(parents=True)
    committed = lambda _: all((data / "warehouse" / "_commits" / f"{r}.json").exists() for r in ids)  # noqa: E731
    with dagster_dev(data, home=tmp_path / "home", env=GATE_ENV, sensor=False) as server:
        shutil.copytree(batches / "runs", data / "runs", dirs_exist_ok=True)
        order = [ids[i] for i in BACKLOG_REGISTRATION_ORDER]
        for run_id in order:
            server.add_dynamic_partition(run_id)
        judging = server.launch_job_backfill("judge_job", order)
        assert server.wait_for_backfill(judging, BACKFILL_SECONDS)["status"] == "COMPLETED_SUCCESS"
        server.start_sensor()
        runs = server.wait_for_runs(committed, BACKFILL_SECONDS)
        verdicts = {r: (data / "warehouse" / "judge_verdicts" / f"{r}.parquet").read_bytes() for r in ids}
        again = server.launch_job_backfill("judge_job", order[:2])  # filtered now: judging alone is refused
        assert server.wait_for_backfill(again, BACKFILL_SECONDS)["status"] != "COMPLETED_SUCCESS"
        refused = server.backfill_runs(again)
    assert len(refused) == 2 and all(r.status == "FAILURE" for r in refused), [(r.partition, r.status) for r in refused]
    assert {r: (data / "warehouse" / "judge_verdicts" / f"{r}.parquet").read_bytes() for r in ids} == verdicts
    [ledger] = [r for r in runs if r.job == "ledger_job"]
    assert ledger.status == "SUCCESS"
    assert ledger.tags[FIRST_WALK_TAG] == " ".join(ids) and ledger.tags["dagster/run_key"] == f"{ids[0]}:ledger"
    assert (ledger.tags[RANGE_START_TAG], ledger.tags[RANGE_END_TAG]) == (order[0], order[-1])
    assert walk_order(data / "warehouse", ids) == ids
    assert_same_ledger_as_cli(data / "warehouse", reference, ids)
    assert_verified(data)


# "Materialize selected" over all but one registered partition: the asset backfill splits the ledger's single
# run into one range per block of selected partitions adjacent in registration order, here [r00, r02] and
# [r01, r03], and each range holds a run that waits for a run of the other. Each must walk what it may, then wait.
INTERLEAVED_REGISTRATION_ORDER = [2, 0, 4, 3, 1]  # r04 registered, never selected: nothing waits for it
INTERLEAVED_ENV = {**GATE_ENV, "FILTER_PIPELINE_ORDER_MAX_WAIT_SECONDS": "300"}  # (a deadlock fails in time)


def test_an_asset_backfill_split_into_interleaved_ranges_gives_the_clis_results(tmp_path):
    batches = tmp_path / "batches"
    ids = write_batches(batches, 5, n_tasks=30)
    reference = cli_reference(tmp_path, batches, GATE_ENV)
    data = tmp_path / "data"
    (data / "runs").mkdir(parents=True)
    with dagster_dev(data, home=tmp_path / "home", env=INTERLEAVED_ENV, sensor=False) as server:
        shutil.copytree(batches / "runs", data / "runs", dirs_exist_ok=True)
        order = [ids[i] for i in INTERLEAVED_REGISTRATION_ORDER]
        for run_id in order:
            server.add_dynamic_partition(run_id)
        selected = [r for r in order if r != ids[4]]
        backfill = server.launch_asset_backfill(selected)
        state = server.wait_for_backfill(backfill, BACKFILL_SECONDS)
        runs = server.backfill_runs(backfill)
    assert state["status"] == "COMPLETED_SUCCESS", (state, [(r.job, r.partition, r.status) for r in runs])
    assert all(r.status == "SUCCESS" for r in runs), [(r.job, r.partition, r.status) for r in runs]
    ranges = sorted((r.tags[RANGE_START_TAG], r.tags[RANGE_END_TAG]) for r in runs if RANGE_START_TAG in r.tags)
    assert ranges == [(ids[2], ids[0]), (ids[3], ids[1])], "the backfill did not split the ledger as this test needs"
    assert_same_ledger_as_cli(data / "warehouse", reference, ids[:4])
    assert not (data / "warehouse" / "_commits" / f"{ids[4]}.json").exists()
    assert_verified(data)
