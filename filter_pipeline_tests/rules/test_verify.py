"""The audit's rules on tables and records (`rules/verify.py`; `storage/test_audit.py` reads them off a
warehouse): caps with the history a walk read, keys kept twice, conservation, and how many lines are shown."""

import random

import pyarrow as pa
import pytest

from filter_pipeline.rules.commits import CommitRecord
from filter_pipeline.rules.filtering import Caps, over_caps
from filter_pipeline.rules.history import as_text, kept_pairs, sum_counts
from filter_pipeline.rules.schemas import to_pandas
from filter_pipeline.rules.verify import (
    MAX_LINES_PER_KIND,
    Finding,
    cap_findings,
    cap_lines,
    capped,
    conservation,
    duplicate_findings,
    duplicate_suspects,
    running_priors,
    suspect_rows,
)


def record(run_id: str, caps: dict | None = None, history: dict | None = None, **rows: int) -> CommitRecord:
    """A commit record of `run_id` with these caps, the history its walk read and the rows it wrote per asset."""
    return CommitRecord(
        run_id=run_id, walked_at="2026-12-01T00:00:00+00:00", files={a: {"rows": n} for a, n in rows.items()},
        kept_keys=rows.get("kept", 0), caps=caps or {}, caps_source="deployment", judge={"kind": "gate"},
        history=history or {}, inputs={}, unjudged=0,
    )  # fmt: skip


def kept(*rows: tuple) -> pa.Table:
    """Non-retired kept rows (task_id, dedup_key, macro, site), with the key's hash as the text's."""
    task_ids, keys, macros, sites = (list(c) for c in zip(*rows))
    return pa.table({"task_id": task_ids, "dedup_key": keys, "key_hash": [hash(k) for k in keys],
                     "macro": macros, "site": sites})  # fmt: skip


def test_a_site_cap_is_checked_with_the_history_the_walk_read_and_not_with_a_later_run_whose_walk_read_it():
    r1 = record("r1", caps={"per_site_cap": 2}, kept=2)
    live = {"r1": kept(("a", "k1", "m", "s"), ("b", "k2", "m", "s")), "r2": kept(("c", "k3", "m", "s"))}
    read_r1 = record("r2", caps={"per_site_cap": 2}, history={"r1": r1.digest}, kept=1)
    # r1, walked first, within its cap: r2's walk read it, so r2 alone answers for the third row
    assert cap_findings({"r1": r1, "r2": read_r1}, live) == [
        Finding("cap", "run r2: m/s holds 3 kept rows with the history it read, over its site cap 2")
    ]


def test_two_walks_that_never_read_each_other_are_each_checked_with_the_other():
    # a walk that stalled past its lease before its publish, while another walk committed another run: neither
    # read the other, and together they break the cap neither breaks alone
    live = {"r0": kept(("a", "k1", "m", "s")), "r1": kept(("b", "k2", "m", "s")), "r2": kept(("c", "k3", "m", "s"))}
    r1 = record("r1", kept=1)
    r0 = record("r0", caps={"per_site_cap": 2}, history={"r1": r1.digest}, kept=1)
    r2 = record("r2", caps={"per_site_cap": 2}, history={"r1": r1.digest}, kept=1)
    blind = "committed without either walk reading the other"
    assert [f.line for f in cap_findings({"r0": r0, "r1": r1, "r2": r2}, live)] == [
        f"run r0: m/s holds 3 kept rows with the history it read and r2 ({blind}), over its site cap 2",
        f"run r2: m/s holds 3 kept rows with the history it read and r0 ({blind}), over its site cap 2",
    ]
    r2_read_both = record("r2", caps={"per_site_cap": 3}, history={"r0": r0.digest, "r1": r1.digest}, kept=1)
    assert cap_findings({"r0": r0, "r1": r1, "r2": r2_read_both}, live) == []  # the later walk read the earlier


def test_a_breach_made_by_a_run_walked_again_since_is_said_to_be_its():
    live = {"r1": kept(("a", "k1", "m", "s"), ("b", "k2", "m", "s")), "r2": kept(("c", "k3", "m", "s"))}
    r2 = record("r2", caps={"per_site_cap": 2}, history={"r1": "the digest of an earlier walk of r1"}, kept=1)
    [finding] = cap_findings({"r1": record("r1", kept=2), "r2": r2}, live)
    assert "with its history as it is now (r1 walked again since it read them)" in finding.line


def test_a_macro_target_counts_every_site_of_the_macro():
    r1 = record("r1", kept=2)
    live = {"r1": kept(("a", "k1", "m", "s1"), ("b", "k2", "m", "s2")), "r2": kept(("c", "k3", "m", "s3"))}
    r2 = record("r2", caps={"per_site_cap": 10, "caps": {"m": {"target": 2}}}, history={"r1": r1.digest}, kept=1)
    assert cap_findings({"r1": r1, "r2": r2}, live) == [
        Finding("cap", "run r2: macro m holds 3 kept rows with the history it read, over its target 2")
    ]


def test_running_priors_count_for_each_run_the_kept_rows_of_the_runs_before_it():
    live = {
        "r1": kept(("a", "k1", "m", "s"), ("b", "k2", "m", "t")),
        "r2": kept(("c", "k3", "n", "s"), ("d", "k4", "m", "s")),
        "r3": kept(("e", "k5", "m", "s"), ("f", "k6", "n", "u")),
    }
    running = running_priors({r: sum_counts([kept_pairs(t)]) for r, t in live.items()})
    first_pairs, first_macros = running["r1"]
    assert first_pairs["prior"].tolist() == [0, 0] and first_macros.to_dict() == {"m": 0}
    pairs, macros = running["r3"]
    assert dict(zip(zip(pairs["macro"], pairs["site"]), pairs["prior"])) == {("m", "s"): 2, ("n", "u"): 0}
    assert macros.to_dict() == {"m": 3, "n": 1}


def test_findings_are_the_same_whether_a_walk_read_the_runs_before_it_or_any_others():
    # running totals answer for walks that read exactly the runs before them; summing the runs read answers for
    # the others (a run walked again, walks blind to each other): both give what summing would give everywhere
    rng = random.Random(7)
    runs = [f"r{i:02d}" for i in range(12)]
    live = {
        r: kept(*((f"{r}-{j}", f"{r}-{j}", f"m{rng.randrange(3)}", f"s{rng.randrange(4)}") for j in range(5)))
        for r in runs
    }
    caps = {"per_site_cap": 6, "caps": {"m1": {"target": 25}, "m2": {"site_cap": 4}}}
    records: dict[str, CommitRecord] = {}
    for at, r in enumerate(runs):
        read = runs[:at] if rng.random() < 0.6 else rng.sample([o for o in runs if o != r], rng.randrange(len(runs)))
        records[r] = record(r, caps=caps, history={o: "digest" for o in read}, kept=5)
    found = cap_findings(records, live)
    counts = {r: sum_counts([kept_pairs(t)]) for r, t in live.items()}
    summed = []
    for r, rec in records.items():
        unseen = [o for o in runs if o != r and o not in rec.history and r not in records[o].history]
        prior = sum_counts([counts[o] for o in sorted(rec.history) + unseen])
        broken = over_caps(to_pandas(as_text(counts[r])), to_pandas(as_text(prior)), Caps.recorded(caps))
        summed += cap_lines(r, *broken, sorted(rec.history), unseen)
    assert len(found) > 3 and found == summed


def test_a_key_kept_by_two_runs_is_one_finding_naming_both_and_a_hash_alone_is_none():
    live = {"r1": kept(("a", "k1", "m", "s"), ("b", "k2", "m", "s")), "r2": kept(("c", "k1", "m", "s"))}
    runs, suspects = duplicate_suspects(live)
    assert runs == ["r1", "r2"] and suspects == {hash("k1")}
    rows = [row for r in runs for row in suspect_rows(r, live[r], suspects)]
    assert duplicate_findings(rows) == [Finding(
        "duplicate", "key k1 is kept 2 times (r1/a, r2/c): retire all but one in retired.json, or re-filter the later runs"
    )]  # fmt: skip
    same_hash = [("k1", "r1", "a"), ("other text", "r2", "c")]  # (a hash collision: the texts differ)
    assert duplicate_findings(same_hash) == []


def test_conservation_holds_when_every_verdict_is_kept_surplus_a_judge_failure_or_unjudged():
    verdicts = pa.table({"status": ["judged", "judged", "judged", "error"], "passed": [True, True, False, None]})
    assert conservation("r1", record("r1", kept=1, surplus=1), verdicts) == []
    [finding] = conservation("r1", record("r1", kept=1), verdicts)
    assert finding.kind == "conservation" and "4 verdicts but 1 kept + 0 surplus + 1 judge failures + 1 unjudged" in (
        finding.line
    )


def test_beyond_the_lines_shown_per_kind_one_line_says_how_many_more():
    findings = [Finding("cap", f"c{i}") for i in range(MAX_LINES_PER_KIND + 3)] + [Finding("duplicate", "d")]
    shown = capped(findings)
    assert [f.line for f in shown if f.kind == "cap"][-1] == "... and 3 more findings of kind 'cap'"
    assert len(shown) == MAX_LINES_PER_KIND + 2 and Finding("duplicate", "d") in shown


def test_a_finding_of_a_kind_the_check_does_not_count_is_refused():
    with pytest.raises(ValueError, match="'changes' is not one of"):
        Finding("changes", "warehouse/x changed")
