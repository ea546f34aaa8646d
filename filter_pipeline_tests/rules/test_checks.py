"""The invariants: they hold on real outputs and fail on data built to break them."""

import dagster as dg
import pandas as pd

from filter_pipeline.definitions import build_defs
from filter_pipeline.judge.resource import JudgeResource
from filter_pipeline.rules import checks, filtering
from filter_pipeline.rules.filtering import Caps, MacroLimits
from filter_pipeline.rules.schemas import conform
from filter_pipeline_tests.builders import attempt, counts, parse, task, verdicts, write_batch


def batch_and_judged(tmp_path):
    b = parse(
        tmp_path,
        [task("a"), task("b")],
        [attempt("a", 1), attempt("a", 2), attempt("b", ok=False, error="e"), "{not json"],
    )
    return b, filtering.attempts_to_judge(b.tasks, b.attempts)


def test_attempts_conserved_holds_and_breaks(tmp_path):
    b, judged = batch_and_judged(tmp_path)
    ok = checks.attempts_conserved(4, b.attempts, b.rejects, judged)
    assert ok.passed and ok.metadata["superseded_ok_attempts"] == 1
    assert not checks.attempts_conserved(5, b.attempts, b.rejects, judged).passed  # a record lost
    assert not checks.attempts_conserved(4, b.attempts.iloc[1:], b.rejects, judged).passed


def test_execute_rows_must_equal_failed_attempts(tmp_path):
    b, _ = batch_and_judged(tmp_path)
    pool = filtering.execute_failures(b.tasks, b.attempts)
    assert checks.execute_rows_match_failed_attempts(pool, b.attempts).passed
    assert not checks.execute_rows_match_failed_attempts(pool.iloc[0:0], b.attempts).passed
    doubled = pd.concat([pool, pool], ignore_index=True)
    assert checks.execute_rows_match_failed_attempts(doubled, b.attempts).metadata["duplicated"] == 1


def test_execute_rows_of_the_right_count_but_one_doubled_and_one_missing_are_caught():
    failed = pd.DataFrame({"task_id": ["a", "b", "c"], "attempt": [1, 1, 2], "ok": [False, False, False]})

    def pool(*ids):
        return pd.DataFrame({"task_id": [t for t, _ in ids], "attempt": [n for _, n in ids], "stage": "execute"})

    assert checks.execute_rows_match_failed_attempts(pool(("c", 2), ("a", 1), ("b", 1)), failed).passed  # any order
    swapped = checks.execute_rows_match_failed_attempts(pool(("a", 1), ("a", 1), ("c", 2)), failed)
    assert not swapped.passed
    assert {k: swapped.metadata[k] for k in ("missing", "unexpected", "duplicated")} == {
        "missing": 1,
        "unexpected": 0,
        "duplicated": 1,
    }
    wrong_attempt = checks.execute_rows_match_failed_attempts(pool(("a", 1), ("b", 1), ("c", 1)), failed)
    assert not wrong_attempt.passed and wrong_attempt.metadata["unexpected"] == 1


def test_verdicts_conserved_holds_and_breaks():
    v = verdicts({"task_id": "a"}, {"task_id": "b", "key": ["s", "#el", "a"]}, {"task_id": "c", "passed": False},
                 {"task_id": "d", "passed": None, "status": "error"})  # fmt: skip
    result = filtering.walk_ledger(v, conform(pd.DataFrame(), "prior_dedup_index"), counts(), Caps(3), "r")
    assert checks.verdicts_conserved(v, result.kept, result.surplus).passed
    assert not checks.verdicts_conserved(v, result.kept, result.surplus.iloc[0:0]).passed  # b lost
    assert not checks.verdicts_conserved(v, pd.concat([result.kept, result.kept]), result.surplus.iloc[0:0]).passed


def test_no_key_kept_twice_within_or_across_runs():
    kept = verdicts({"task_id": "a", "key": ["k1"]}, {"task_id": "b", "key": ["k2"]})
    elsewhere = conform(pd.DataFrame({"dedup_key": ['["k2"]']}), "prior_dedup_index")
    assert checks.no_key_kept_twice(kept, elsewhere.iloc[0:0]).passed
    assert checks.no_key_kept_twice(kept, elsewhere).metadata["kept_by_another_run"] == 1
    twice = verdicts({"task_id": "a", "key": ["k1"]}, {"task_id": "b", "key": ["k1"]})
    assert not checks.no_key_kept_twice(twice, elsewhere.iloc[0:0]).passed


def test_caps_respected_counts_history():
    kept = verdicts({"task_id": "a", "site": "s"}, {"task_id": "b", "site": "s"})
    assert checks.caps_respected(kept, counts(("m", "s", 1)), Caps(3)).passed
    over = checks.caps_respected(kept, counts(("m", "s", 2)), Caps(3))
    assert not over.passed and over.description == "m/s: 4 > 3"
    assert not checks.caps_respected(kept, counts(("m", "other", 5)), Caps(9, {"m": MacroLimits(target=6)})).passed


def test_every_materialization_runs_the_checks(data_root):
    write_batch(data_root, "r1", [task("a"), task("b")], [attempt("a"), attempt("b", ok=False, error="x")])
    with dg.DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("run_id", ["r1"])
        job = build_defs(str(data_root), JudgeResource(), caps={}).resolve_job_def("filter_job")
        result = job.execute_in_process(instance=instance, partition_key="r1")
    evaluations = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert evaluations == {
        "all_tasks_judged": True,
        "attempts_conserved": True,
        "execute_rows_match_failed_attempts": True,
        "verdicts_conserved": True,
        "no_key_kept_twice": True,
        "caps_respected": True,
    }
