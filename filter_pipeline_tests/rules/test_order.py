"""The ledger's order rule (CONTRACT §4), the records of validation failures, and the re-judging schedule."""

from upath import UPath

from filter_pipeline.rules import order
from filter_pipeline.rules.order import blocking_runs, rejudge_due, walk_order
from filter_pipeline.storage.failures import clear_failure, read_failures, record_failure

COMPLETE = ["b0", "b1", "b2", "b3"]


def test_a_first_walk_waits_for_every_lower_complete_batch_not_yet_filtered():
    assert blocking_runs("b3", COMPLETE, committed=["b0"], failed=[], retired=[]) == ["b1", "b2"]
    assert blocking_runs("b1", COMPLETE, committed=["b0"], failed=[], retired=[]) == []
    assert blocking_runs("b0", COMPLETE, committed=[], failed=[], retired=[]) == []


def test_retired_and_recorded_failures_do_not_hold_later_batches_back():
    assert blocking_runs("b3", COMPLETE, committed=["b0"], failed=["b1"], retired=["b2"]) == []
    assert blocking_runs("b3", COMPLETE, committed=[], failed=["b1"], retired=["b2"]) == ["b0"]


def test_a_rewalk_of_a_committed_run_never_waits():
    assert blocking_runs("b2", COMPLETE, committed=["b2"], failed=[], retired=[]) == []


def test_runs_walked_before_in_the_same_step_do_not_block():
    assert blocking_runs("b3", COMPLETE, committed=[], failed=[], retired=[], walked_before=["b0", "b1", "b2"]) == []
    assert blocking_runs("b3", COMPLETE, committed=[], failed=[], retired=[], walked_before=["b1", "b2"]) == ["b0"]


def test_incomplete_or_higher_batches_never_block():
    assert blocking_runs("b1", ["b1", "b2", "b3"], committed=[], failed=[], retired=[]) == []
    assert blocking_runs("a9", COMPLETE, committed=[], failed=[], retired=[]) == []


def test_first_walks_take_run_id_order_and_rewalks_keep_their_places():
    assert walk_order(["b2", "b0", "b3", "b1"], committed=[]) == ["b0", "b1", "b2", "b3"]
    assert walk_order(["b3", "b0", "b1"], committed=["b0"]) == ["b1", "b0", "b3"]
    assert walk_order(["b1", "b1", "b0"], committed=[]) == ["b0", "b1"]


def test_failure_records_are_written_read_and_cleared(tmp_path):
    warehouse = UPath(tmp_path) / "warehouse"
    assert read_failures(warehouse) == {}
    record_failure(warehouse, "b1", "runs/b1/tasks.jsonl holds no valid task")
    assert read_failures(warehouse) == {"b1": "runs/b1/tasks.jsonl holds no valid task"}
    assert [p.name for p in (warehouse / "_failed").iterdir()] == ["b1.json"]  # no temp file left
    assert clear_failure(warehouse, "b1") and not clear_failure(warehouse, "b1")
    assert read_failures(warehouse) == {}


def test_rejudging_backs_off_doubling_and_stops_at_the_cap():
    def due(tries, now, **kw):
        return rejudge_due("r", 2, tries, last_at=1000, now=now, backoff_seconds=300, max_tries=3, **kw)

    assert due(0, 1299) is None and due(0, 1300).try_number == 1
    assert due(1, 1599) is None and due(1, 1600).try_number == 2  # 600 s after the first try
    assert due(2, 2199) is None and due(2, 2200).try_number == 3
    assert due(3, 10**9) is None  # the cap
    assert due(1, 1001, wait=False).try_number == 2  # a user's materialize does not wait ...
    assert due(3, 10**9, wait=False) is None  # ... but the cap holds
    assert rejudge_due("r", 0, 0, 0, 10**9, 300, 3) is None  # nothing unjudged


def test_a_blocker_queued_past_the_limit_is_stuck_with_its_longest_time_in_the_queue():
    now = 10_000.0
    queued = [("r3", now - 90), ("r1", now - 5), ("r3", now - 200), ("r2", now - 60)]
    assert order.stuck_in_queue(queued, now, limit=60) == {"r2": 60.0, "r3": 200.0}
    assert order.stuck_in_queue(queued, now, limit=300) == {}


def test_a_stopped_wait_names_the_queued_runs_and_who_walks_the_batch_later():
    line = order.describe_stuck(order.describe_wait("r5", ["r2"]), "r5", {"r2": 75.4})
    assert "r2 (queued 75 s)" in line and "batch sensor walks r5" in line and "\n" not in line


def test_the_wait_line_speaks_of_one_batch_or_of_several():
    assert "waits for r2: a complete batch with a lower run_id" in order.describe_wait("r5", ["r2"])
    several = order.describe_wait("r5", ["r1", "r2"])
    assert "waits for r1, r2: complete batches with a lower run_id" in several and "retire them in" in several


def test_a_stopped_ranged_walk_names_what_it_did_not_walk_and_what_it_committed_but_did_not_record():
    assert order.describe_stop("b1", ["b2", "b3"], ["b0"]) == (
        "b1 was not committed; not walked, to keep run_id order: b2, b3; "
        "committed, but not recorded as materialized (materializing again walks them again): b0"
    )
    assert order.describe_stop("b0", ["b1"], []) == "b0 was not committed; not walked, to keep run_id order: b1"
    assert order.describe_stop("b2", [], ["b0", "b1"]).endswith("(materializing again walks them again): b0, b1")
