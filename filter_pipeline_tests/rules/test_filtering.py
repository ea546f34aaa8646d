"""CONTRACT §3, one rule per test, on plain frames (no Dagster)."""

import numpy as np
import pandas as pd
import pytest

from filter_pipeline.judge.resource import gate_verdicts
from filter_pipeline.rules import filtering
from filter_pipeline.rules.filtering import Caps, MacroLimits, walk_ledger
from filter_pipeline.rules.schemas import DETAIL_MAX_CHARS
from filter_pipeline.rules.vocabulary import GATE_VOTES, GATE_WHY
from filter_pipeline_tests.builders import attempt, counts, kept_history, parse, rows, task, verdicts

NO_HISTORY = kept_history()
NO_COUNTS = counts()


def failures(tmp_path, tasks, attempts) -> pd.DataFrame:
    batch = parse(tmp_path, tasks, attempts)
    return filtering.execute_failures(batch.tasks, batch.attempts)


# --- §3.1 execute failures --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error, reason",
    [
        ("policy violation: left the site", "policy_violation"),
        ("backend check failed: no row", "backend_fail"),
        ("assertion failed: banner missing", "script_assert"),
        ("action refused: disabled", "action_refused"),
        ("TimeoutError: slow page", "script_error"),
        ("Policy violation: capitalised is not the prefix", "script_error"),
        (" policy violation: leading space is not the prefix", "script_error"),
        ("", "unknown"),
    ],
)
def test_error_prefix_gives_reason(tmp_path, error, reason):
    pool = failures(tmp_path, [task("t")], [attempt("t", ok=False, error=error)])
    assert pool["reason"].tolist() == [reason]
    assert pool["stage"].tolist() == ["execute"]


def test_null_absent_and_empty_error_are_unknown_with_an_empty_detail(tmp_path):
    pool = failures(
        tmp_path,
        [task("a"), task("b"), task("c")],
        [attempt("a", ok=False), {**attempt("b", ok=False), "error": None}, attempt("c", ok=False, error="")],
    )
    assert pool["reason"].tolist() == ["unknown", "unknown", "unknown"]
    assert pool["detail"].tolist() == ["", "", ""]  # CONTRACT §3.1: "" on execute rows, never null
    assert pool["detail"].notna().all()


def test_detail_is_error_cut_to_500_chars_and_n_actions_counts_steps(tmp_path):
    long_error = "assertion failed: " + "x" * 900
    pool = failures(tmp_path, [task("t")], [attempt("t", ok=False, error=long_error, steps=5)])
    assert pool["detail"].tolist() == [long_error[:DETAIL_MAX_CHARS]]
    assert pool["n_actions"].tolist() == [5]


def test_backend_ok_from_attempt_and_false_when_backend_absent(tmp_path):
    pool = failures(
        tmp_path,
        [task("a"), task("b"), task("c")],
        [
            attempt("a", ok=False, error="assertion failed", backend={"ok": True, "detail": "row there"}),
            attempt("b", ok=False, error="assertion failed", backend=None),
            {k: v for k, v in attempt("c", ok=False, error="x").items() if k != "backend"},
        ],
    )
    assert pool["backend_ok"].tolist() == [True, False, False]
    assert pool["votes"].isna().all()


def test_every_failed_attempt_is_one_row_in_file_order(tmp_path):
    pool = failures(
        tmp_path,
        [task("a"), task("b")],
        [
            attempt("b", 2, ok=False, error="e2"),
            attempt("a", 1, ok=False, error="e1"),
            attempt("b", 1, ok=False, error="e0"),
        ],
    )
    assert list(zip(pool["task_id"], pool["attempt"])) == [("b", 2), ("a", 1), ("b", 1)]


# --- §3.2 what gets judged --------------------------------------------------------------------------


def test_judges_the_ok_attempt_with_the_highest_number_despite_interleaving(tmp_path):
    batch = parse(
        tmp_path,
        [task("a"), task("b")],
        [
            attempt("a", 3, ok=True),
            attempt("b", 1, ok=True),
            attempt("a", 5, ok=False, error="late failure"),
            attempt("a", 1, ok=True),
            attempt("b", 2, ok=False, error="e"),
            attempt("a", 4, ok=True, steps=7),
            attempt("a", 2, ok=True),
        ],
    )
    judged = filtering.attempts_to_judge(batch.tasks, batch.attempts)
    assert list(zip(judged["task_id"], judged["attempt"])) == [("a", 4), ("b", 1)]
    assert judged["n_actions"].tolist() == [7, 2]
    assert filtering.superseded_ok_attempts(batch.attempts, judged) == 3


def test_judged_in_tasks_file_order_and_tasks_without_ok_attempt_skipped(tmp_path):
    batch = parse(
        tmp_path,
        [task("z"), task("no_attempts"), task("only_failed"), task("a")],
        [attempt("a"), attempt("only_failed", ok=False, error="e"), attempt("z")],
    )
    judged = filtering.attempts_to_judge(batch.tasks, batch.attempts)
    assert judged["task_id"].tolist() == ["z", "a"]


def test_the_task_rows_the_parse_found_give_what_looking_each_task_up_gives(tmp_path):
    # a repeated task, an attempt of an unknown task and a repeated attempt number: rows the parse drops
    batch = parse(
        tmp_path,
        [task("z"), task("a"), task("z", instruction="again"), task("b")],
        [attempt("ghost"), attempt("b", ok=False, error="e"), attempt("a", 2), attempt("a", 2, ok=False),
         attempt("z", ok=False, error="x"), attempt("a", 1), attempt("z", 3)],
    )  # fmt: skip
    assert batch.task_at.tolist() == [2, 1, 0, 1, 0]  # b, a, z, a, z in tasks' rows z, a, b
    for rule in (filtering.execute_failures, filtering.attempts_to_judge):
        given = rule(batch.tasks, batch.attempts, batch.task_at)
        pd.testing.assert_frame_equal(given, rule(batch.tasks, batch.attempts))
        assert len(given) == 2


def test_gate_judge_passes_with_fixed_why_and_votes(tmp_path):
    batch = parse(tmp_path, [task("a")], [attempt("a")])
    verdict = gate_verdicts(filtering.attempts_to_judge(batch.tasks, batch.attempts))
    assert verdict[["passed", "why", "votes"]].values.tolist() == [[True, GATE_WHY, GATE_VOTES]]


# --- §3.4 judge failures ----------------------------------------------------------------------------


def test_failed_verdict_is_judge_fail_row_with_why_and_votes_unjudged_is_not():
    v = verdicts(
        {"task_id": "a", "passed": False, "why": "wrong item", "votes": "1/3", "n_actions": 4},
        {"task_id": "b", "passed": True, "votes": "3/3"},
        {"task_id": "c", "passed": None, "status": "error", "why": "endpoint down"},
    )
    pool = filtering.judge_failures(v)
    assert pool[["task_id", "stage", "reason", "detail", "votes", "n_actions"]].values.tolist() == [
        ["a", "judge", "judge_fail", "wrong item", "1/3", 4]
    ]
    assert pool["backend_ok"].isna().all()


# --- §3.6 the walk ----------------------------------------------------------------------------------


def walk(v, index=NO_HISTORY, prior=NO_COUNTS, caps=Caps(per_site_cap=3)):
    return walk_ledger(v, index, prior, caps, run_id="now")


def test_keys_differing_only_by_json_type_are_different_arguments():
    v = verdicts(*({"task_id": f"t{i}", "key": ["s", "#el", arg]} for i, arg in enumerate([1, "1", 1.0, True])))
    result = walk(v, caps=Caps(per_site_cap=10))
    assert result.kept["dedup_key"].tolist() == [
        '["s","#el",1]',
        '["s","#el","1"]',
        '["s","#el",1.0]',
        '["s","#el",true]',
    ]
    assert result.surplus.empty


def test_duplicate_inside_a_run_names_the_first_keeper():
    v = verdicts({"task_id": "a", "key": ["s", "#x", 1]}, {"task_id": "b", "key": ["s", "#x", 1]})
    result = walk(v)
    assert result.kept["task_id"].tolist() == ["a"]
    assert result.surplus[["task_id", "dropped", "dup_of_run_id", "dup_of_task_id"]].values.tolist() == [
        ["b", "duplicate", "now", "a"]
    ]


def test_duplicate_against_a_prior_run_names_that_run():
    v = verdicts({"task_id": "a", "key": ["s", "#x", 1]})
    result = walk(v, index=kept_history((["s", "#x", 1], "m", "s", "old", "t9")))
    assert result.kept.empty
    assert result.surplus[["dropped", "dup_of_run_id", "dup_of_task_id"]].values.tolist() == [
        ["duplicate", "old", "t9"]
    ]


def test_site_cap_counts_history():
    v = verdicts({"task_id": "a", "site": "s1"}, {"task_id": "b", "site": "s2"}, {"task_id": "c", "site": "s2"})
    result = walk(v, prior=counts(("m", "s1", 3), ("m", "s2", 2)))
    assert result.kept["task_id"].tolist() == ["b"]
    assert result.surplus[["task_id", "dropped"]].values.tolist() == [["a", "site_cap"], ["c", "site_cap"]]


def test_site_cap_is_per_macro_and_site():
    v = verdicts({"task_id": "a", "macro": "m1"}, {"task_id": "b", "macro": "m2"}, {"task_id": "c", "macro": "m1"})
    result = walk(v, caps=Caps(per_site_cap=1))
    assert result.kept["task_id"].tolist() == ["a", "b"]
    assert result.surplus["dropped"].tolist() == ["site_cap"]


def test_per_macro_site_cap_overrides_the_run_default():
    v = verdicts(*({"task_id": f"t{i}", "macro": "tight"} for i in range(3)), {"task_id": "x", "macro": "loose"})
    result = walk(v, caps=Caps(per_site_cap=5, macros={"tight": MacroLimits(site_cap=1)}))
    assert result.kept["task_id"].tolist() == ["t0", "x"]
    assert result.surplus["dropped"].tolist() == ["site_cap", "site_cap"]


def test_target_sums_the_macro_over_sites_history_included():
    v = verdicts(*({"task_id": f"t{i}", "site": f"s{i}"} for i in range(4)))
    result = walk(v, prior=counts(("m", "old", 2), ("other", "s0", 9)), caps=Caps(3, {"m": MacroLimits(target=4)}))
    assert result.kept["task_id"].tolist() == ["t0", "t1"]
    assert result.surplus["dropped"].tolist() == ["target", "target"]


def test_duplicate_is_checked_before_site_cap_and_site_cap_before_target():
    v = verdicts({"task_id": "dup", "key": ["k"]}, {"task_id": "capped"})
    result = walk(
        v,
        index=kept_history((["k"], "m", "s", "old", "o1")),
        prior=counts(("m", "s", 1)),
        caps=Caps(1, {"m": MacroLimits(target=0)}),
    )
    assert result.surplus["dropped"].tolist() == ["duplicate", "site_cap"]


def test_only_passing_judged_verdicts_are_walked():
    v = verdicts(
        {"task_id": "fail", "passed": False},
        {"task_id": "err", "passed": None, "status": "error"},
        {"task_id": "ok"},
    )
    result = walk(v)
    assert result.kept["task_id"].tolist() == ["ok"]
    assert result.surplus.empty


def test_dropped_verdicts_do_not_count_towards_caps():
    v = verdicts({"task_id": "a", "key": ["k"]}, {"task_id": "b", "key": ["k"]}, {"task_id": "c"})
    result = walk(v, caps=Caps(per_site_cap=2))
    assert result.kept["task_id"].tolist() == ["a", "c"]


def one_by_one(v, index, prior, caps, run_id="now") -> tuple[list, list]:
    """CONTRACT §3.6 read literally: every passing verdict in order, one at a time."""
    kept_by = {}
    for key, run, tid in zip(index["dedup_key"], index["run_id"], index["task_id"]):
        kept_by.setdefault(key, (run, tid))
    count = {(m, s): n for m, s, n in zip(prior["macro"], prior["site"], prior["n_kept"])}
    total = {}
    for (m, _), n in count.items():
        total[m] = total.get(m, 0) + n
    kept, surplus = [], []
    for row in v[(v["status"] == "judged") & (v["passed"] == True)].to_dict("records"):  # noqa: E712
        key, pair, macro, target = (
            row["dedup_key"],
            (row["macro"], row["site"]),
            row["macro"],
            caps.target(row["macro"]),
        )
        if key in kept_by:
            surplus.append([row["task_id"], "duplicate", *kept_by[key]])
        elif count.get(pair, 0) >= caps.site_cap(macro):
            surplus.append([row["task_id"], "site_cap", None, None])
        elif target is not None and total.get(macro, 0) >= target:
            surplus.append([row["task_id"], "target", None, None])
        else:
            kept_by[key] = (run_id, row["task_id"])
            count[pair], total[macro] = count.get(pair, 0) + 1, total.get(macro, 0) + 1
            kept.append(row["task_id"])
    return kept, surplus


@pytest.mark.parametrize("seed", range(40))
def test_the_walk_equals_the_one_by_one_walk_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    n, macros, sites = int(rng.integers(0, 120)), ["m0", "m1", "m2"], ["s0", "s1", "s2", "s3"]
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    v = verdicts(*(
        {"task_id": f"t{i}", "macro": pick(macros), "site": pick(sites), "key": [pick(sites), "#el", int(rng.integers(12))],
         "passed": bool(rng.random() < 0.8), "status": "judged" if rng.random() < 0.95 else "error"}
        for i in range(n)
    ))  # fmt: skip
    index = kept_history(*(([pick(sites), "#el", int(rng.integers(12))], pick(macros), pick(sites), f"old{j % 3}", f"o{j}")
                           for j in range(int(rng.integers(0, 6)))))  # fmt: skip
    prior = counts(*((m, s, int(rng.integers(0, 4))) for m in macros for s in sites if rng.random() < 0.5))
    limits = {m: MacroLimits(site_cap=pick([None, 0, 2, 5]), target=pick([None, 0, 6, 15, 40])) for m in macros[:2]}
    caps = Caps(per_site_cap=int(rng.integers(1, 8)), macros=limits)

    result = walk_ledger(v, index, prior, caps, run_id="now")

    kept, surplus = one_by_one(v, index, prior, caps)
    assert result.kept["task_id"].tolist() == kept
    assert rows(result.surplus, "task_id", "dropped", "dup_of_run_id", "dup_of_task_id") == surplus


def test_execute_failures_carry_their_tasks_columns_and_nulls_for_an_unknown_task():
    tasks = pd.DataFrame({"task_id": ["a", "b"], "macro": ["m1", "m2"], "site": ["s1", "s2"], "instruction": ["do a", "do b"],
                          "dedup_key": ['["a"]', '["b"]']})  # fmt: skip
    attempts = pd.DataFrame({"task_id": ["b", "zz", "a", "b"], "attempt": [1, 1, 1, 2], "ok": [False, False, True, False],
                             "error": ["x", "y", None, "z"], "dir": ["d1", "d2", "d3", "d4"]})  # fmt: skip
    pool = filtering.execute_failures(tasks, attempts)
    assert rows(pool, "task_id", "attempt", "macro", "site", "dedup_key") == [
        ["b", 1, "m2", "s2", '["b"]'],
        ["zz", 1, None, None, None],
        ["b", 2, "m2", "s2", '["b"]'],
    ]


# --- over a cap: the one rule of the ledger's check and of `verify` ----------------------------------------


def test_a_pair_is_over_its_site_cap_with_history_counted_in():
    sites, _ = filtering.over_caps(counts(("m", "s", 2), ("m", "t", 1)), counts(("m", "s", 2)), Caps(3))
    assert sites[["macro", "site", "total", "limit"]].values.tolist() == [["m", "s", 4, 3]]


def test_a_macro_is_over_its_target_with_every_site_of_history_counted_in():
    caps = Caps(9, {"m": MacroLimits(target=5), "quiet": MacroLimits(target=0)})
    _, macros = filtering.over_caps(counts(("m", "s", 2)), counts(("m", "other", 4), ("quiet", "s", 1)), caps)
    assert macros[["macro", "total", "limit"]].values.tolist() == [["m", 6, 5]]  # quiet kept nothing here


def test_a_macro_site_cap_overrides_the_per_site_cap_and_history_elsewhere_does_not_count():
    caps = Caps(1, {"m": MacroLimits(site_cap=5)})
    sites, macros = filtering.over_caps(counts(("m", "s", 5), ("n", "s", 1)), counts(("n", "t", 9)), caps)
    assert sites.empty and macros.empty


def test_a_macro_exactly_at_its_target_is_not_over_it_and_findings_come_in_name_order():
    caps = Caps(0, {"m": MacroLimits(site_cap=9, target=3), "n": MacroLimits(site_cap=9, target=2)})
    sites, macros = filtering.over_caps(
        counts(("n", "b", 10), ("n", "a", 10), ("m", "s", 2)), counts(("m", "t", 1)), caps
    )
    assert sites[["macro", "site"]].values.tolist() == [["n", "a"], ["n", "b"]]
    assert macros[["macro", "total", "limit"]].values.tolist() == [["n", 20, 2]]  # m: 3 of 3


def test_nothing_is_over_a_cap_where_nothing_was_kept_or_with_no_history():
    sites, macros = filtering.over_caps(counts(), counts(("m", "s", 99)), Caps(1, {"m": MacroLimits(target=1)}))
    assert sites.empty and macros.empty
    sites, macros = filtering.over_caps(counts(("m", "s", 2)), counts(), Caps(1, {"m": MacroLimits(target=1)}))
    assert sites.values.tolist() == [["m", "s", 2, 1]] and macros.values.tolist() == [["m", 2, 1]]


def test_limits_are_looked_up_per_row_by_macro():
    caps = Caps(5, {"m": MacroLimits(site_cap=2, target=7)})
    assert caps.site_caps(pd.Series(["x", "m", "x"])).tolist() == [5, 2, 5]
    assert caps.targets(pd.Series(["x", "m"])).tolist() == [pd.NA, 7]
    # a row without a macro has the per-site cap and no target, not another macro's
    assert caps.site_caps(pd.Series(["m", None], dtype="str")).tolist() == [2, 5]
    assert caps.targets(pd.Series(["m", None], dtype="str")).tolist() == [7, pd.NA]
    assert caps.targeted() == ["m"]
