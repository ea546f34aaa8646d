"""Ctrl-C and SIGTERM during `filter-pipeline materialize`: one line saying what was saved and that a rerun
resumes, exit 130 (SIGINT) or 143 (SIGTERM); nothing of the interrupted walk is published, and a rerun
finishes the run."""

import os
import signal
import subprocess
import sys

import pytest

from filter_pipeline.storage.publish import STAGING_DIR
from filter_pipeline_tests.builders import attempt, task, write_batch
from filter_pipeline_tests.conftest import assert_verified
from filter_pipeline_tests.test_fenced_walks import paused


def test_sigterm_stops_a_call_that_ignores_sigint_as_a_scripts_background_job_does():
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a shell leaves to a script's `cmd &`\n"
        "from filter_pipeline.cli.interrupts import Signals\n"
        "signals = Signals()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(signals.exit_status)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 143


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_walk_says_what_was_saved_and_exits_with_the_signals_status(
    cli,
    cli_env,
    data_root,
    tmp_path,
    started,
    signum,
    status,
):
    tasks = [task(f"r1-{i}", site=f"site{i % 3}", key=["s", "#el", i]) for i in range(9)]
    write_batch(data_root, "r1", tasks, [attempt(t["task_id"]) for t in tasks])
    walk, pid = paused(["r1"], cli_env, cli_env["DAGSTER_HOME"], "history_read", tmp_path / "paused.pid", started)
    os.kill(pid, signum)  # delivered when it resumes: in the middle of the ledger's walk
    os.kill(pid, signal.SIGCONT)
    out, err = walk.communicate(timeout=300)
    assert walk.returncode == status, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("filter-pipeline: interrupted")]
    name = signal.Signals(signum).name
    assert said == [
        f"filter-pipeline: interrupted by {name} during r1: 9 judge verdicts saved, its walk not committed (nothing "
        "of it published); run `filter-pipeline materialize r1` again to resume from what was saved"
    ], err[-3000:]
    assert "FAILED" not in out and "Traceback" not in err
    warehouse = data_root / "warehouse"
    assert not (warehouse / "_commits" / "r1.json").exists() and not (warehouse / "kept" / "r1.parquet").exists()
    assert not list((warehouse / STAGING_DIR).glob("*")) if (warehouse / STAGING_DIR).exists() else True
    again = cli()
    assert again.returncode == 0 and "r1: judged 9, unjudged 0, kept 9" in again.stdout, again.stderr[-3000:]
    assert_verified(data_root)


def test_a_call_that_named_its_runs_is_told_to_name_the_ones_left_again_one_that_named_none_is_not(tmp_path):
    from types import SimpleNamespace

    from filter_pipeline.cli.interrupts import saved_line
    from filter_pipeline.shell.warehouse import DataRoot

    sigint, data = SimpleNamespace(name=lambda: "SIGINT"), DataRoot(path=str(tmp_path))
    # (a materialize naming no run leaves a re-walk of a run filtered before undone, and takes runs not named)
    pending = saved_line(sigint, data, "r2", committed=False, done=["r1"], named=["r2", "r3"])
    assert pending.endswith("run `filter-pipeline materialize r2 r3` again to resume from what was saved")
    done = saved_line(sigint, data, "r2", committed=True, done=["r1"], named=["r2", "r3"])
    assert done.endswith("its walk committed; r1 finished before it; run `filter-pipeline materialize r3` again to "
                         "resume from what was saved")  # fmt: skip
    unnamed = saved_line(sigint, data, "r2", committed=False, done=[])
    assert unnamed.endswith("run `filter-pipeline materialize` again to resume from what was saved")


def test_an_interrupt_after_a_named_run_failed_names_it_again_with_those_left(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from filter_pipeline.cli import materialize
    from filter_pipeline.cli.interrupts import Signals, saved_line
    from filter_pipeline.shell.warehouse import DataRoot

    said = []

    def run_one(instance, data, job, caps, tags, selection, signals, so_far, still_named):
        if so_far[-1] == "r1":
            return SimpleNamespace(success=False)  # (its endpoint refused it, say)
        said.append(saved_line(signals, data, so_far[-1], False, so_far[:-1], still_named))
        raise KeyboardInterrupt  # (Ctrl-C during r2)

    monkeypatch.setattr(materialize, "_run_one", run_one)
    monkeypatch.setattr(materialize, "failure_reason", lambda result: "refused")
    signals = Signals.__new__(Signals)
    signals.name, signals.done, signals.named_left = (lambda: "SIGINT"), [], []
    with pytest.raises(KeyboardInterrupt):
        materialize._run_batches(None, DataRoot(path=str(tmp_path)), {}, ["r1", "r2"], set(), {}, signals, True)
    # r1 did not finish: the command resumes both (naming r2 alone would be refused: its walk waits for r1)
    assert said[0].endswith("its walk not committed (nothing of it published); run `filter-pipeline materialize "
                            "r1 r2` again to resume from what was saved"), said  # fmt: skip
    assert "finished before it" not in said[0] and signals.named_left == ["r1", "r2"] and signals.done == []


@pytest.mark.parametrize(
    "done, left, said",
    [
        ([], None, "before a run started; run `filter-pipeline materialize r2 r1` again"),  # (before any run)
        (["r1"], ["r2"], "before a run started; r1 finished before it; run `filter-pipeline materialize r2` again"),
    ],
)
def test_an_interrupt_between_the_runs_of_a_call_that_named_them_names_again_those_left(
    monkeypatch, capsys, done, left, said
):
    from filter_pipeline.cli import main

    def interrupted(args, signals):
        if left is not None:  # (as `_run_batches` records it before each run)
            signals.done, signals.named_left = done, left
        raise KeyboardInterrupt

    monkeypatch.setattr(main, "_materialize", interrupted)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main.main(["materialize", "r2", "r1"]) == 130
    finally:  # (the call's handlers stay out of the other tests of this process)
        signal.signal(signal.SIGTERM, sigterm)
        signal.set_wakeup_fd(-1)
    assert (
        capsys.readouterr().err.strip()
        == f"filter-pipeline: interrupted by SIGINT {said} to resume from what was saved"
    )


def test_the_verdicts_an_interrupt_says_are_saved_count_each_judged_prompt_once(tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from filter_pipeline.cli.interrupts import verdicts_saved
    from filter_pipeline.shell.warehouse import DataRoot

    data = DataRoot(path=str(tmp_path))
    folder = tmp_path / "warehouse" / "_judge_progress" / "r1"
    folder.mkdir(parents=True)
    for i, (keys, statuses) in enumerate(
        [(["a", "b"], ["judged", "error"]), (["b", "c", "a"], ["judged", "judged", "judged"])]
    ):
        pq.write_table(pa.table({"cache_key": keys, "status": statuses}), folder / f"part-{i}.parquet")
    # a (saved twice: two parts of an interrupted materialization and its resume), b (an unjudged try, then
    # judged), c
    assert verdicts_saved(data, "r1") == "3 judge verdicts saved"
    for part in folder.iterdir():
        part.unlink()
    pq.write_table(pa.table({"cache_key": ["a"]}), folder / "part-x.parquet")  # (no status: no verdict it can tell)
    assert verdicts_saved(data, "r1") == "0 judge verdicts saved"
    # a judge_verdicts file beside parts is an earlier judging's (a re-judging interrupted): said apart
    (tmp_path / "warehouse" / "judge_verdicts").mkdir()
    statuses = ["judged", "error", "judged"]
    pq.write_table(pa.table({"status": statuses}), tmp_path / "warehouse" / "judge_verdicts" / "r1.parquet")
    assert verdicts_saved(data, "r1") == ("0 judge verdicts saved (2 more on file from an earlier judging)")
    (folder / "part-x.parquet").unlink()  # once judged, the file's verdicts: not the rows of tasks left unjudged
    assert verdicts_saved(data, "r1") == "2 judge verdicts saved"
    # a kill between writing judge_verdicts and removing the parts it was built from: the file's, not earlier
    built = pd.DataFrame({"status": statuses})
    built.attrs["judge_progress_parts"] = ["part-y.parquet"]
    built.to_parquet(tmp_path / "warehouse" / "judge_verdicts" / "r1.parquet")
    pq.write_table(pa.table({"cache_key": ["a", "c"], "status": ["judged", "judged"]}), folder / "part-y.parquet")
    assert verdicts_saved(data, "r1") == "2 judge verdicts saved"
