"""`filter-pipeline explain RUN_ID TASK_ID` as a user runs it, over the filtered sample."""

import json
import os
import subprocess

import pytest

from filter_pipeline_tests.conftest import CLI, REPO
from filter_pipeline_tests.review.conftest import (  # noqa: F401 (the fixtures)
    HOSTILE_TASK,
    filtered_sample,
    sample_root,
)

pytestmark = pytest.mark.slow


def explain(root, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "FILTER_PIPELINE_DATA": str(root)}
    return subprocess.run([*CLI, "explain", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_explain_tells_a_duplicates_story(filtered_sample):  # noqa: F811
    done = explain(filtered_sample, "2026-11-29", "2026-11-29-t004")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "task 2026-11-29-t004 of run 2026-11-29: surplus (duplicate)"
    assert "  duplicate of task 2026-11-28-t000 of run 2026-11-28, which kept the key first" in lines
    assert "  final URL: https://maps.example/done" in lines
    assert "verdict: passed (votes gate, judge gate)" in lines


def test_explain_tells_the_cap_a_surplus_task_met(filtered_sample):  # noqa: F811
    done = explain(filtered_sample, "2026-11-29", "2026-11-29-t000")
    assert done.returncode == 0 and done.stdout.startswith("task 2026-11-29-t000 of run 2026-11-29: surplus (site_cap)")
    assert "  cap met (site_cap): limit 3, reached by 3 kept rows in history and 0 in this run (deployment caps)" in (
        done.stdout.splitlines()
    )


def test_explain_tells_execute_failures_with_their_reasons_and_labels(filtered_sample):  # noqa: F811
    done = explain(filtered_sample, "2026-11-28", "2026-11-28-t013")
    assert done.returncode == 0 and done.stdout.startswith("task 2026-11-28-t013 of run 2026-11-28: execute_fail")
    assert "reason action_refused" in done.stdout and "reason backend_fail" in done.stdout
    for n in (1, 2):  # (each label says which attempt it is of)
        assert f"label: failure on runs/2026-11-28/traj/2026-11-28-t013/{n}, by ? at ?" in done.stdout
    assert "replaced by a later label" not in done.stdout  # one label per attempt there


def test_explain_says_where_a_tasks_rows_went(filtered_sample):  # noqa: F811
    done = explain(filtered_sample, "2026-11-28", "2026-11-28-t013")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == "  its attempts are rows of failure_pool (stage execute)"


def test_explain_of_a_missing_run_or_task_exits_1_with_one_line(filtered_sample, tmp_path):  # noqa: F811
    for args in [("nope", "t"), ("2026-11-28", "nope")]:
        done = explain(filtered_sample, *args)
        assert done.returncode == 1 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
        assert "nope" in done.stderr
    legacy = explain(filtered_sample, "2026-11-27", "2026-11-27-t004")  # in its tasks.jsonl, not kept
    assert legacy.returncode == 1 and legacy.stderr.strip() == (
        "filter-pipeline: no task '2026-11-27-t004' in run '2026-11-27' (filtered by the earlier script: only its "
        "kept rows, kept.jsonl, are known)"
    )
    done = explain(tmp_path / "missing", "r", "t")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1


def test_explain_of_a_run_id_that_is_not_a_folder_name_exits_2_naming_it(filtered_sample):  # noqa: F811
    for run_id in ("../..", "2026-11-28/../2026-11-29", ".hidden"):
        done = explain(filtered_sample, run_id, "t")
        assert done.returncode == 2 and done.stdout == "", done.stderr
        assert done.stderr.startswith(f"filter-pipeline: run_id {run_id!r} is not a plain folder name"), done.stderr


def test_explain_into_a_reader_that_stops_early_ends_quietly(filtered_sample):  # noqa: F811
    env = {**os.environ, "FILTER_PIPELINE_DATA": str(filtered_sample)}
    reader_gone = subprocess.Popen(
        [*CLI, "explain", "2026-11-29", "2026-11-29-t004"], env=env, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    reader_gone.stdout.close()  # as `| head -0` does, before the story is printed
    _, err = reader_gone.communicate(timeout=120)
    assert reader_gone.returncode == 141 and err == b"", err.decode()


def test_explain_prints_a_pages_control_characters_as_escapes_so_they_cannot_forge_a_line(sample_root):  # noqa: F811
    folder = sample_root / "runs" / "2026-11-28" / "traj" / HOSTILE_TASK / "1"  # its judged attempt
    record = json.loads((folder / "trajectory.json").read_text())
    record["final"]["observation"] = "title\x1b]0;owned\x07 set\r\nverdict: passed\u2028forged"
    (folder / "trajectory.json").write_text(json.dumps(record))
    done = explain(sample_root, "2026-11-28", HOSTILE_TASK)
    assert done.returncode == 0, done.stderr
    assert not any(c in done.stdout for c in "\x1b\x07\r\u2028")
    lines = done.stdout.splitlines()
    assert "  page text: title\\x1b]0;owned\\x07 set\\r\\nverdict: passed\\u2028forged" in lines
    assert [line for line in lines if line.startswith("verdict:")] == ["verdict: passed (votes gate, judge gate)"]


def test_explain_of_attempts_an_earlier_version_wrote_without_optional_columns_shows_them_as_dashes(
    filtered_sample,  # noqa: F811
):
    from upath import UPath

    from filter_pipeline.cli.explain import story_lines
    from filter_pipeline.review.data import Warehouse
    from filter_pipeline.review.story import story

    told = story(Warehouse(UPath(str(filtered_sample))), "2026-11-28", "2026-11-28-t013")
    for attempt in told["attempts"]:
        for column in ("backend_detail", "n_actions", "error", "backend_ok"):
            attempt.pop(column, None)
    attempts = [line for line in story_lines(told) if line.startswith("  1") or line.startswith("  2")]
    assert attempts and all("backend ok - (-), - steps" in line for line in attempts)
