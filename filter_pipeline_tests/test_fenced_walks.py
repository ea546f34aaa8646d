"""Fenced walks (CONTRACT §4): a walk that lost its lease can never undo the walk that replaced it.

On moto's S3 server, walk A (the CLI, default caps) stops itself (SIGSTOP, through the walk's pause hook) at a
point of its walk, and its lease expires; walk B (another instance, `--per-site-cap 1`) takes over and commits
the same run; then A resumes (SIGCONT). B's commit, every file of the warehouse and `verify` are unchanged, A
says in one line that it was not published, and nothing A staged is left. Then: a walk killed after its publish,
completed by the next launcher; and two processes over the same runs walking each run once.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from upath import UPath

from filter_pipeline.storage.audit import audit
from filter_pipeline.storage.publish import PAUSE_ENV, STAGING_DIR
from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import CLI, REPO
from filter_pipeline_tests.test_races import homes

pytestmark = pytest.mark.slow

LEASE_SECONDS = "2"


@pytest.fixture
def s3_data(s3_server, s3_bucket, tmp_path):
    """An S3 data root with one batch r1 (3 sites x 3 tasks, distinct keys: cap 3 keeps 9, cap 1 keeps 3), and
    the environment of a CLI pointed at it with a short lease."""
    url = f"s3://{s3_bucket}/data"
    root = UPath(url, endpoint_url=s3_server.endpoint, use_listings_cache=False)
    tasks = [task(f"r1-{i}", site=f"site{i % 3}", key=["s", "#el", i]) for i in range(9)]
    write_batch(root, "r1", tasks, [attempt(t["task_id"]) for t in tasks])
    env = {**os.environ, "FILTER_PIPELINE_DATA": url, "FILTER_PIPELINE_ENDPOINT_URL": s3_server.endpoint,
           "FILTER_PIPELINE_LEASE_SECONDS": LEASE_SECONDS, "FILTER_PIPELINE_ORDER_RETRY_SECONDS": "1"}  # fmt: skip
    return root, env


def snapshot(root: UPath) -> dict[str, bytes]:
    """Every file of the warehouse (the lease aside) and its bytes."""
    fs, base = root.fs, (root / "warehouse").path
    fs.invalidate_cache()
    return {p[len(base) :]: fs.cat_file(p) for p in fs.find(base) if not p.endswith("_ledger.lease")}


def paused(
    args: list[str], env: dict, home: str, point: str, marker: Path, started: list
) -> tuple[subprocess.Popen, int]:
    """Start `filter-pipeline materialize ARGS` that stops itself at `point`; (its process, the stopped pid)."""
    proc = subprocess.Popen([*CLI, "materialize", *args], env={**env, "DAGSTER_HOME": home, PAUSE_ENV: f"{point}:{marker}"},
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    started.append(proc)
    while not (marker.exists() and marker.read_text()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            proc.wait(0.2)  # (returns only if it ended before reaching the point)
        except subprocess.TimeoutExpired:
            pass
    pid = int(marker.read_text())
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        pass  # written just before stopping itself
    return proc, pid


def materialize(args: list[str], env: dict, home: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "materialize", *args], env={**env, "DAGSTER_HOME": home}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("point", ["history_read", "files_staged", "before_publish"])
def test_stalled_walk_never_undoes_the_takeover(s3_data, tmp_path, point, started):
    root, env = s3_data
    home_a, home_b = homes(tmp_path)
    walk_a, pid = paused(["r1"], env, home_a, point, tmp_path / "paused.pid", started)
    walk_b = materialize(["r1", "--per-site-cap", "1"], env, home_b)
    assert walk_b.returncode == 0, walk_b.stderr[-3000:]
    assert "kept 3," in walk_b.stdout
    before = snapshot(root)
    assert "/_commits/r1.json" in before and audit(root) == []
    os.kill(pid, signal.SIGCONT)
    out, err = walk_a.communicate(timeout=300)
    assert walk_a.returncode == 1, err[-3000:]
    refused = [line for line in out.splitlines() if "was not published" in line]
    assert len(refused) == 1 and "removed its own staged files only" in refused[0], out
    after = snapshot(root)
    assert not any(f"/{STAGING_DIR}/" in name for name in after)  # A removed what it had staged, nothing more
    # B's commit, kept, surplus, report...: byte for byte
    assert after == {name: data for name, data in before.items() if f"/{STAGING_DIR}/" not in name}
    assert audit(root) == []


def test_a_walk_whose_commit_another_replaced_before_it_moved_its_files_says_so_and_fails(s3_data, tmp_path, started):
    root, env = s3_data
    home_a, home_b = homes(tmp_path)
    walk_a, pid = paused(["r1"], env, home_a, "published", tmp_path / "paused.pid", started)
    walk_b = materialize(["r1", "--per-site-cap", "1"], env, home_b)  # completes A's publish, then walks r1 again
    assert walk_b.returncode == 0, walk_b.stderr[-3000:]
    assert "kept 3," in walk_b.stdout
    before = snapshot(root)
    os.kill(pid, signal.SIGCONT)
    out, err = walk_a.communicate(timeout=300)
    assert walk_a.returncode == 1, err[-3000:]
    said = [line for line in out.splitlines() if "was replaced by another walk's" in line]
    assert len(said) == 1 and "this walk's figures describe none of it" in said[0], out
    assert not any(line.startswith("r1: judged") for line in out.splitlines())  # (no figures of its own walk)
    assert snapshot(root) == before and audit(root) == []  # B's commit and files, byte for byte


def test_a_walk_that_stalled_while_another_committed_another_run_fails_loudly_after_its_publish(
    s3_data, tmp_path, started
):
    root, env = s3_data
    home_a, home_b = homes(tmp_path)
    assert materialize(["r1"], env, home_b).returncode == 0
    tasks = [task(f"r2-{i}", site=f"site{i % 3}", key=["s", "#el", i]) for i in range(9)]  # (r1's keys)
    write_batch(root, "r2", tasks, [attempt(t["task_id"]) for t in tasks])
    retired = root / "retired.json"
    retired.write_text('[{"run_id": "r1", "reason": "audit"}]')  # r2 first walked with r1 retired...
    walk_a, pid = paused(["r2"], env, home_a, "before_publish", tmp_path / "paused.pid", started)
    retired.unlink()  # ...then r1 restored and walked again by B, which does not see r2, while A stalls
    walk_b = materialize(["r1"], env, home_b)
    assert walk_b.returncode == 0, walk_b.stderr[-3000:]
    os.kill(pid, signal.SIGCONT)
    out, err = walk_a.communicate(timeout=300)
    assert walk_a.returncode == 1, err[-3000:]
    said = [line for line in out.splitlines() if "another walk committed r1 after this walk had read" in line]
    assert len(said) == 1 and "re-filter r2" in said[0], out
    assert {f.kind for f in audit(root)} == {"duplicate", "cap"}  # what the line tells to look for
    assert materialize(["r2"], env, home_a).returncode == 0 and audit(root) == []  # and what repairs it


def test_a_walk_killed_after_its_publish_is_completed_by_the_next_launcher(s3_data, tmp_path, started):
    root, env = s3_data
    env = {**env, "FILTER_PIPELINE_LEASE_SECONDS": "60"}  # (A's lease outlives its pause, however slow the machine)
    home_a, home_b = homes(tmp_path)
    walk_a, pid = paused(["r1"], env, home_a, "published", tmp_path / "paused.pid", started)
    assert audit(root) == []  # a walk moving its files: its staged copies are the committed files
    os.kill(pid, signal.SIGKILL)
    walk_a.communicate(timeout=60)
    half = snapshot(root)
    assert "/_commits/r1.json" in half and "/kept/r1.parquet" not in half  # the readers' folder: nothing yet
    assert any(f"/{STAGING_DIR}/" in name for name in half)
    stopped = audit(root)
    assert [f.kind for f in stopped] == ["incomplete"]
    assert stopped[0].line.startswith("r1: its walk stopped after publishing its commit, before moving all its files")
    assert stopped[0].line.endswith("`filter-pipeline materialize` moves them")
    done = materialize([], env, home_b)  # nothing left to walk: the launcher completes the publish
    assert done.returncode == 0, done.stderr[-3000:]
    assert "r1: completed the publish" in done.stdout + done.stderr
    after = snapshot(root)
    assert after["/_commits/r1.json"] == half["/_commits/r1.json"] and "/kept/r1.parquet" in after
    assert not any(f"/{STAGING_DIR}/" in name for name in after)
    assert audit(root) == []


def test_two_launchers_over_the_same_runs_walk_each_run_once(cli_env, data_root, tmp_path):
    for n, run_id in enumerate(("r1", "r2", "r3")):
        tasks = [task(f"{run_id}-{i}", site=f"site{i}", key=["s", "#el", n, i]) for i in range(5)]
        write_batch(data_root, run_id, tasks, [attempt(t["task_id"]) for t in tasks])
    env = {**cli_env, "FILTER_PIPELINE_ORDER_RETRY_SECONDS": "1"}
    procs = [
        subprocess.Popen(
            [*CLI, "materialize"],
            env={**env, "DAGSTER_HOME": home},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for home in homes(tmp_path)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    for run_id in ("r1", "r2", "r3"):
        walked = [out for out in outs if f"{run_id}: judged" in out]
        skipped = [out for out in outs if f"{run_id}: already filtered by another walk" in out]
        # each run walked by exactly one launcher; the other one (if it asked) says it was already filtered
        assert len(walked) == 1 and len(walked) + len(skipped) <= 2, outs
    assert audit(UPath(data_root)) == []


def test_a_first_walk_committed_by_another_walk_while_waiting_is_reported_not_walked_again(
    cli_env, data_root, tmp_path, started
):
    tasks = [task(f"r1-{i}", site=f"site{i % 3}", key=["s", "#el", i]) for i in range(9)]
    write_batch(data_root, "r1", tasks, [attempt(t["task_id"]) for t in tasks])
    env = {**cli_env, "FILTER_PIPELINE_ORDER_RETRY_SECONDS": "1"}
    home_a, home_b = homes(tmp_path)
    # A holds the data root's lock, stopped just before publishing r1
    walk_a, pid = paused(["r1"], env, home_a, "before_publish", tmp_path / "paused.pid", started)
    walk_b = subprocess.Popen([*CLI, "materialize", "r1", "--per-site-cap", "1"], env={**env, "DAGSTER_HOME": home_b},
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    started.append(walk_b)
    for line in walk_b.stderr:  # B asked for r1's first walk, and waits for the lease
        if "another walker holds the data root's lease" in line:
            break
    os.kill(pid, signal.SIGCONT)
    out_a, err_a = walk_a.communicate(timeout=300)
    assert walk_a.returncode == 0 and "r1: judged 9, unjudged 0, kept 9" in out_a, err_a[-3000:]
    committed = (data_root / "warehouse" / "_commits" / "r1.json").read_bytes()
    out_b, _ = walk_b.communicate(timeout=300)
    assert walk_b.returncode == 0, out_b
    assert "r1: already filtered by another walk" in out_b and "r1: judged" not in out_b
    assert (data_root / "warehouse" / "_commits" / "r1.json").read_bytes() == committed  # A's walk, cap 3, stands
    assert audit(UPath(data_root)) == []


def test_a_store_that_ignores_conditional_writes_walks_nothing_and_says_why(s3_data, s3_faults, tmp_path):
    from filter_pipeline_tests.s3_faults import IGNORE_CONDITIONS

    root, env = s3_data
    s3_faults.fault = lambda request: IGNORE_CONDITIONS if request.conditional() else None
    done = materialize(["r1"], {**env, "FILTER_PIPELINE_ENDPOINT_URL": s3_faults.endpoint}, homes(tmp_path)[0])
    assert done.returncode == 1
    said = [line for line in (done.stdout + done.stderr).splitlines() if "applied a write whose condition" in line]
    assert len(said) == 1 and "need a store that honours conditional writes" in said[0], done.stdout + done.stderr
    assert not any("/_commits/" in name or "/kept/" in name for name in snapshot(root))


def test_a_publish_left_half_done_on_another_machine_is_reported_once_its_lease_expired(s3_data, tmp_path, started):
    root, env = s3_data
    walk_a, pid = paused(["r1"], env, homes(tmp_path)[0], "published", tmp_path / "paused.pid", started)
    os.kill(pid, signal.SIGKILL)
    walk_a.communicate(timeout=60)
    # as if it had run on another machine: this one cannot tell from its pid whether it is gone
    staging = root / "warehouse" / STAGING_DIR
    (folder,) = staging.iterdir()
    elsewhere = (staging / f"r1.elsewhere.42.{folder.name.rsplit('.', 1)[-1]}").path
    for path in root.fs.find(folder.path):
        root.fs.mv(path, elsewhere + path[len(folder.path) :])
    time.sleep(float(LEASE_SECONDS) + 1.5)  # its lease, no longer renewed, expired
    assert [f.kind for f in audit(root)] == ["incomplete"]
