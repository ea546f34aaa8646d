"""The labelling queue's order and the judge's precision interval; label lines as the review app reads them."""

import json
import math

import pandas as pd

from filter_pipeline.review.data import draw
from filter_pipeline.review.queue import (
    PHASE_REST,
    PHASE_SAMPLE,
    PHASE_SPLIT,
    PHASE_UNLABELLED_SITE,
    item,
    latest_labels,
    order,
    precision,
    queue_state,
    split_mask,
)
from filter_pipeline.review.story import inside_run
from filter_pipeline.rules.calibration import parse_labels, wilson_interval


def attempts(n: int, votes=lambda i: "3/3", site=lambda i: f"s{i % 3}", run_id: str = "r") -> pd.DataFrame:
    dirs = pd.Series([f"runs/{run_id}/traj/t{i:03}/1" for i in range(n)])
    return pd.DataFrame({"run_id": run_id, "task_id": [f"t{i:03}" for i in range(n)], "dir": dirs,
                         "site": [site(i) for i in range(n)], "votes": [votes(i) for i in range(n)], "passed": True,
                         "draw": draw(dirs)})  # fmt: skip


def test_votes_split_when_some_but_not_all_of_those_asked_passed():
    votes = ["2/3", "1/3", "1/2", "3/3", "1/1", "0/3", "0/1", "gate", None, "a/b", "3/2"]
    assert split_mask(pd.Series(votes, dtype=object)).tolist() == [True, True, True] + [False] * 8


def test_the_queue_serves_a_uniform_sample_then_split_votes_then_unlabelled_sites(monkeypatch):
    from filter_pipeline.review import queue

    monkeypatch.setattr(queue, "SAMPLE_SIZE", 10)
    frame = attempts(60, votes=lambda i: "2/3" if i % 10 == 7 else "3/3", site=lambda i: "new" if i >= 55 else "old")
    queue = order(frame, labelled_sites={"old"})
    items = [item(queue, i) for i in range(len(queue))]
    phases = [it.phase for it in items]
    assert len(items) == 60 and len({it.dir for it in items}) == 60
    assert phases[:10] == [PHASE_SAMPLE] * 10
    split = [it for it in items if it.phase == PHASE_SPLIT]
    assert split and all(int(it.task_id[1:]) % 10 == 7 for it in split)
    assert split_mask(frame.set_index("task_id").loc[[it.task_id for it in split], "votes"]).all()
    earlier = {it.task_id for it in items[:10] + split}
    new_site = {it.task_id for it in items if it.phase == PHASE_UNLABELLED_SITE}
    assert new_site and new_site == {f"t{i:03}" for i in range(55, 60)} - earlier
    assert phases == sorted(phases, key=[PHASE_SAMPLE, PHASE_SPLIT, PHASE_UNLABELLED_SITE, PHASE_REST].index)
    # the sample is drawn uniformly (a shuffle), not the first rows, and the same on every request
    assert [it.task_id for it in items[:10]] != [f"t{i:03}" for i in range(10)]
    assert order(frame, {"old"}).equals(queue)


def test_an_attempt_two_runs_judged_is_queued_as_the_latest_runs_whose_verdict_its_labels_are_scored_against():
    first, copy = attempts(3, run_id="r1"), attempts(3, run_id="r1").assign(run_id="r2", votes="1/3")
    queue = order(pd.concat([first, copy], ignore_index=True), labelled_sites=set())
    assert len(queue) == 3 and set(queue["run_id"]) == {"r2"}
    from filter_pipeline.rules.calibration import latest_labels as scored_labels

    labels, _ = parse_labels("".join(json.dumps({"dir": d, "success": True}) + "\n" for d in first["dir"]))
    judged = pd.concat([first, copy], ignore_index=True)[["run_id", "task_id", "dir"]]
    scored = scored_labels(labels, judged.assign(ok=True), judged, judged)
    assert set(scored["run_id"]) == {"r2"} and len(scored) == 3


def test_a_label_of_an_attempt_two_runs_judged_counts_once_against_the_latest_runs_verdict():
    first, copy = attempts(1, run_id="r1"), attempts(1, run_id="r1").assign(run_id="r2", passed=False)
    labels, _ = parse_labels(json.dumps({"dir": first["dir"][0], "success": True}).encode() + b"\n")
    figures = queue_state(pd.concat([first, copy], ignore_index=True), labels)[2]
    # as judge_calibration scores it: one label, of an attempt the latest run's judge failed
    assert (figures["labelled"], figures["judge_passed_labelled"], figures["precision"]) == (1, 0, None)


def test_attempts_keep_their_order_and_the_sample_its_members_as_runs_are_added(monkeypatch):
    from filter_pipeline.review import queue as queue_module

    monkeypatch.setattr(queue_module, "SAMPLE_SIZE", 10)
    first = attempts(60)
    later = pd.concat([first, attempts(60, run_id="r2")])
    before, after = order(first, {"s0", "s1", "s2"}), order(later, {"s0", "s1", "s2"})
    assert after[after["dir"].isin(set(first["dir"]))]["dir"].tolist() == before["dir"].tolist()
    sample_before = set(before.loc[before["phase"] == PHASE_SAMPLE, "dir"])
    sample_after = set(after.loc[after["phase"] == PHASE_SAMPLE, "dir"])
    assert len(sample_after) == 10 and sample_after - sample_before <= set(later["dir"]) - set(first["dir"])
    assert sample_after != sample_before  # (new attempts do enter it, as a uniform sample of all needs)


def test_the_unbiased_precision_counts_the_random_samples_labels_alone(monkeypatch):
    from filter_pipeline.review import queue as queue_module

    monkeypatch.setattr(queue_module, "SAMPLE_SIZE", 2)
    frame = attempts(6)
    queue = order(frame, set())
    sampled, rest = queue["dir"].tolist()[:2], queue["dir"].tolist()[2:]
    lines = "".join(json.dumps({"dir": d, "success": True}) + "\n" for d in sampled)
    lines += "".join(json.dumps({"dir": d, "success": False}) + "\n" for d in rest)
    figures = queue_state(frame, parse_labels(lines.encode())[0])[2]
    assert (figures["sample"]["precision"], figures["sample"]["judge_passed_labelled"]) == (1.0, 2)
    assert (figures["precision"], figures["judge_passed_labelled"]) == (2 / 6, 6)
    # a sample labelled out of order counts up to its first gap: the labels past it were chosen, not drawn
    second_only = json.dumps({"dir": sampled[1], "success": True}) + "\n"
    figures = queue_state(frame, parse_labels(second_only.encode())[0])[2]
    assert figures["sample"]["judge_passed_labelled"] == 0 and figures["judge_passed_labelled"] == 1


def test_a_later_label_of_the_same_attempt_replaces_the_earlier_and_unsure_is_not_counted():
    frame = attempts(4)
    lines = (b'{"dir": "runs/r/traj/t000/1", "success": false}\n'
             b'{"dir": "runs/r/traj/t000/1", "success": true, "labeler": "a"}\n'
             b'{"run_id": "r", "task_id": "t001", "success": false}\n'
             b'{"dir": "runs/r/traj/t002/1", "success": null}\nnot json\n{"dir": 3, "success": true}\n')  # fmt: skip
    labels = parse_labels(lines)[0]
    assert len(labels) == 4 and labels["labeler"].tolist()[1] == "a"
    latest = latest_labels(labels, frame)
    assert dict(zip(latest["dir"], latest["success"])) == {
        "runs/r/traj/t000/1": True, "runs/r/traj/t001/1": False, "runs/r/traj/t002/1": None}  # fmt: skip
    figures = precision(frame.merge(latest, on="dir"))
    low, high = wilson_interval(1, 2)
    assert (figures["labelled"], figures["unsure"], figures["judge_passed_labelled"]) == (2, 1, 2)
    assert figures["precision"] == 0.5 and math.isclose(figures["low"], low) and math.isclose(figures["high"], high)


def test_wilson_interval_matches_hand_computed_values():
    low, high = wilson_interval(4, 7)
    assert round(low, 4) == 0.2505 and round(high, 4) == 0.8418
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_a_trajectory_dir_must_stay_inside_its_run():
    assert inside_run("r", "runs/r/traj/t/1")
    for bad in ["runs/r/../s/traj/t/1", "runs/r//t", "runs/s/traj/t/1", "/etc", "runs/r/./x", None, "runs/r\\..\\x"]:
        assert not inside_run("r", bad), bad
