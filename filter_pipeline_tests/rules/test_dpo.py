"""DPO pairs: kept trajectories against clean negatives of the same task."""

import pandas as pd

from filter_pipeline.judge.resource import gate_verdicts
from filter_pipeline.rules import filtering
from filter_pipeline.rules.dpo import dpo_pairs
from filter_pipeline.rules.filtering import Caps
from filter_pipeline.rules.schemas import conform
from filter_pipeline_tests.builders import attempt, counts, parse, rows, task, verdicts


def pool_and_kept(tmp_path, attempts, judge_rows=()):
    b = parse(tmp_path, [task("a"), task("b"), task("c")], attempts)
    pool = pd.concat(
        [filtering.execute_failures(b.tasks, b.attempts), filtering.judge_failures(verdicts(*judge_rows))],
        ignore_index=True,
    )
    kept = verdicts({"task_id": "a", "n_actions": 3}, {"task_id": "b", "n_actions": 2})
    return kept.assign(dir=["runs/r/traj/a/9", "runs/r/traj/b/9"], run_id="r"), pool


def test_each_kept_task_pairs_with_its_clean_failed_attempts(tmp_path):
    kept, pool = pool_and_kept(
        tmp_path,
        [attempt("a", 1, ok=False, error="policy violation: x", steps=5), attempt("a", 2, ok=False, error="action refused"),
         attempt("c", 1, ok=False, error="e")],
    )  # fmt: skip
    result = dpo_pairs(kept, pool)
    assert rows(
        result.pairs,
        "task_id",
        "chosen_dir",
        "rejected_attempt",
        "rejected_reason",
        "rejected_n_actions",
        "chosen_n_actions",
    ) == [
        ["a", "runs/r/traj/a/9", 1, "policy_violation", 5, 3],
        ["a", "runs/r/traj/a/9", 2, "action_refused", 2, 3],
    ]
    assert result.kept_without_negative == 1  # b failed nowhere; c was not kept


def test_a_rejected_side_is_never_backend_ok(tmp_path):
    kept, pool = pool_and_kept(
        tmp_path,
        [attempt("a", 1, ok=False, error="assertion failed", backend={"ok": True, "detail": "row there"}),
         attempt("b", 1, ok=False, error="assertion failed", backend={"ok": False, "detail": "none"})],
    )  # fmt: skip
    result = dpo_pairs(kept, pool)
    assert result.pairs["task_id"].tolist() == ["b"]
    assert result.excluded == {"backend_ok": 1, "blocked": 0, "judge_fail_gate_passed": 0}
    assert result.kept_without_negative == 1


def test_judge_failures_are_paired_only_when_asked(tmp_path):
    kept, pool = pool_and_kept(
        tmp_path, [], judge_rows=[{"task_id": "a", "passed": False, "why": "wrong", "votes": "1/3"}]
    )
    assert dpo_pairs(kept, pool).pairs.empty
    assert dpo_pairs(kept, pool).excluded["judge_fail_gate_passed"] == 1
    paired = dpo_pairs(kept, pool, include_judge_failures=True).pairs
    assert rows(paired, "task_id", "rejected_stage", "rejected_detail") == [["a", "judge", "wrong"]]


def test_a_walks_own_judge_failures_never_pair_so_including_them_adds_nothing(tmp_path):
    """One verdict a task: a task whose verdict failed is never kept, so no kept row has a judge failure beside it."""
    tasks = [task("a"), task("b"), task("c")]
    attempts = [attempt("a", 1, ok=False, error="boom"), attempt("a", 2), attempt("b", 1), attempt("b", 2),
                attempt("c", 1, ok=False, error="boom"), attempt("c", 2)]  # fmt: skip
    b = parse(tmp_path, tasks, attempts)
    asked = gate_verdicts(filtering.attempts_to_judge(b.tasks, b.attempts))
    failed = asked["task_id"].isin(["b", "c"]).to_numpy()  # the judge fails b and c, whatever their attempts
    judged = conform(asked.assign(passed=~failed, why=["", "wrong item", "stopped midway"]), "judge_verdicts")
    pool = pd.concat(
        [filtering.execute_failures(b.tasks, b.attempts), filtering.judge_failures(judged)], ignore_index=True
    )
    kept = filtering.walk_ledger(judged, conform(pd.DataFrame(), "prior_dedup_index"), counts(), Caps(3), "r").kept

    with_judge_failures, without = dpo_pairs(kept, pool, include_judge_failures=True), dpo_pairs(kept, pool)
    assert len(judged) == 3 and (pool["stage"] == "judge").sum() == 2
    assert rows(with_judge_failures.pairs, "task_id", "rejected_stage") == [["a", "execute"]]
    assert with_judge_failures.pairs.equals(without.pairs)
    assert without.excluded["judge_fail_gate_passed"] == 0


def test_a_blocked_attempt_is_never_a_negative_even_with_judge_failures_included(tmp_path):
    kept, pool = pool_and_kept(
        tmp_path,
        [],
        judge_rows=[
            {"task_id": "a", "passed": False, "why": "captcha", "votes": "1/1", "blocked": True},
            {"task_id": "b", "passed": False, "why": "wrong item", "votes": "1/1", "blocked": False},
        ],
    )
    assert pool[pool["stage"] == "judge"]["blocked"].tolist() == [True, False]
    result = dpo_pairs(kept, pool, include_judge_failures=True)
    assert rows(result.pairs, "task_id", "rejected_detail") == [["b", "wrong item"]]
    assert result.excluded == {"backend_ok": 0, "blocked": 1, "judge_fail_gate_passed": 0}
    assert dpo_pairs(kept, pool).excluded == {"backend_ok": 0, "blocked": 1, "judge_fail_gate_passed": 1}
    older_pool = pool.drop(columns="blocked")  # a pool written before verdicts said blocked
    assert len(dpo_pairs(kept, older_pool, include_judge_failures=True).pairs) == 2


def test_pairs_follow_kept_order_then_pool_order(tmp_path):
    kept, pool = pool_and_kept(
        tmp_path,
        [attempt("b", 1, ok=False, error="e1"), attempt("a", 1, ok=False, error="e2"),
         attempt("b", 2, ok=False, error="e3"), attempt("a", 2, ok=False, error="e4")],
    )  # fmt: skip
    result = dpo_pairs(kept, pool)
    assert rows(result.pairs, "task_id", "rejected_attempt", "chosen_n_actions") == [
        ["a", 1, 3],
        ["a", 2, 3],
        ["b", 1, 2],
        ["b", 2, 2],
    ]
    assert result.kept_without_negative == 0
