"""The ledger lease on the data root (CONTRACT §4: walks never overlap on one warehouse): local disk and S3."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import pytest
from upath import UPath

from filter_pipeline.storage import files, lease
from filter_pipeline.storage.lease import LEASE_FILE, LedgerBusy, ledger_lease

HOLD = """
import sys, time
from upath import UPath
from filter_pipeline.storage.lease import ledger_lease
with ledger_lease(UPath(sys.argv[1]), "run r1 (test holder)"):
    print("held", flush=True)
    time.sleep(600)
"""


def holder_process(root) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_local_lease_held_by_another_process_names_the_holder_and_is_free_once_it_is_killed(tmp_path):
    proc = holder_process(tmp_path)
    try:
        with pytest.raises(LedgerBusy) as busy:
            with ledger_lease(UPath(tmp_path), "run r2"):
                pass
        assert f"the ledger of {tmp_path} is held by run r1 (test holder) (host " in str(busy.value)
        assert f"pid {proc.pid}) since 20" in str(busy.value)
    finally:
        proc.kill()  # SIGKILL: no clean-up runs; the OS drops its lock
        proc.wait()
    with ledger_lease(UPath(tmp_path), "run r2"):
        holder = json.loads((tmp_path / "warehouse" / lease.HOLDER_FILE).read_text())
        assert holder["holder"] == "run r2"


def test_local_lease_excludes_a_second_holder_in_the_same_process(tmp_path):
    with ledger_lease(UPath(tmp_path), "first"):
        with pytest.raises(LedgerBusy, match="held by first"):
            with ledger_lease(UPath(tmp_path), "second"):
                pass
    with ledger_lease(UPath(tmp_path), "second"):
        pass


def s3_root(s3_server, bucket):
    return UPath(f"s3://{bucket}/data", endpoint_url=s3_server.endpoint, use_listings_cache=False)


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_s3_lease_is_exclusive_renewed_while_held_and_deleted_at_the_end(s3_server, s3_bucket):
    root = s3_root(s3_server, s3_bucket)
    with ledger_lease(root, "run r1", ttl_seconds=1.2):
        with pytest.raises(
            LedgerBusy, match=rf"^the ledger of s3://{s3_bucket}/data is held by run r1 \(host .*, pid \d+\) since 20"
        ):
            with ledger_lease(root, "run r2"):
                pass
        time.sleep(2)  # past the first expiry: the heartbeat renewed it
        with pytest.raises(LedgerBusy, match="held by run r1"):
            with ledger_lease(root, "run r2"):
                pass
    assert not root.fs.exists(f"{s3_bucket}/data/warehouse/{LEASE_FILE}")
    with ledger_lease(root, "run r2"):
        pass


def expired_lease(root, holder="a dead walk") -> None:
    """A lease whose holder stopped renewing it long ago: by the store's clock, its TTL is over."""
    path = root / "warehouse" / LEASE_FILE
    record = {"holder": holder, "host": "gone", "pid": 1, "since": "x", "expires": 0, "ttl_seconds": -5}
    path.fs.pipe_file(path.path, json.dumps(record).encode())


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_an_expired_s3_lease_of_a_dead_holder_is_taken_over_without_hand_work(s3_server, s3_bucket):
    root = s3_root(s3_server, s3_bucket)
    expired_lease(root)
    with ledger_lease(root, "run r2"):
        current = json.loads(root.fs.cat_file((root / "warehouse" / LEASE_FILE).path))
        assert current["holder"] == "run r2"


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_of_two_takers_of_an_expired_s3_lease_exactly_one_wins(s3_server, s3_bucket, monkeypatch):
    root = s3_root(s3_server, s3_bucket)
    for _ in range(3):
        expired_lease(root)
        # both takers read the expired lease before either writes: only the conditional write decides
        barrier, waited = threading.Barrier(2), threading.local()
        real_cat = root.fs.cat_file

        def cat_then_wait(path, *args, **kwargs):
            data = real_cat(path, *args, **kwargs)
            if path.endswith(LEASE_FILE) and not getattr(waited, "once", False):  # (the first read of each taker)
                waited.once = True
                barrier.wait(timeout=10)
            return data

        monkeypatch.setattr(root.fs, "cat_file", cat_then_wait)
        outcomes: list[str] = []
        inside = threading.Event()
        release = threading.Event()

        def take(name):
            try:
                with ledger_lease(root, name):
                    outcomes.append(f"won {name}")
                    inside.set()
                    release.wait(10)
            except LedgerBusy as exc:
                outcomes.append(f"busy {exc}")

        takers = [threading.Thread(target=take, args=(f"taker {i}",)) for i in range(2)]
        for t in takers:
            t.start()
        assert inside.wait(10)
        time.sleep(0.3)
        release.set()
        for t in takers:
            t.join()
        monkeypatch.undo()
        assert sorted(o.split()[0] for o in outcomes) == ["busy", "won"], outcomes
        assert "just taken over by another walk" in next(o for o in outcomes if o.startswith("busy"))


def lease_record(root, **fields) -> None:
    path = root / "warehouse" / LEASE_FILE
    record = {"holder": "run r1 (elsewhere)", "host": "elsewhere", "pid": 1, "since": "x", "token": "theirs"}
    path.fs.pipe_file(path.path, json.dumps({**record, **fields}).encode())


@pytest.mark.slow  # moto's S3 server is a process of its own
@pytest.mark.parametrize(
    "holder_clock, ttl_seconds, wait, outcome",
    [
        ("5 minutes behind", 120, 0, "busy"),  # its `expires` is past on this clock, but it renewed just now
        ("an hour ahead", 1, 2.2, "taken over"),  # its `expires` is far ahead, but the store saw no renewal
    ],
)
def test_a_lease_expires_by_the_stores_clock_not_by_the_holders(
    s3_server, s3_bucket, holder_clock, ttl_seconds, wait, outcome
):
    root = s3_root(s3_server, s3_bucket)
    skew = -300 if "behind" in holder_clock else 3600
    lease_record(root, expires=time.time() + skew + ttl_seconds, ttl_seconds=ttl_seconds)
    time.sleep(wait)
    if outcome == "busy":
        with pytest.raises(LedgerBusy, match=r"held by run r1 \(elsewhere\)"):
            with ledger_lease(root, "run r2"):
                pass
    else:
        with ledger_lease(root, "run r2"):
            assert json.loads(root.fs.cat_file((root / "warehouse" / LEASE_FILE).path))["holder"] == "run r2"


def through(s3_faults, bucket):
    return UPath(f"s3://{bucket}/data", endpoint_url=s3_faults.endpoint, use_listings_cache=False)


def lease_write(condition: str):
    """A fault rule: the PUTs of the lease that carry `condition` (a header name)."""
    return lambda request: (
        request.method == "PUT" and request.path.endswith(LEASE_FILE) and condition in request.headers
    )


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_409_on_creating_the_lease_says_the_ledger_is_busy(s3_server, s3_bucket, s3_faults):
    from filter_pipeline_tests.s3_faults import CONFLICT

    creating = lease_write("if-none-match")
    s3_faults.fault = lambda request: CONFLICT if creating(request) else None
    with pytest.raises(LedgerBusy, match=rf"^another walk was taking the ledger of s3://{s3_bucket}/data at the same"):
        with ledger_lease(through(s3_faults, s3_bucket), "run r2"):
            pass
    assert [action for action, _ in s3_faults.applied] == [CONFLICT]


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_store_that_ignores_conditional_writes_is_refused_before_the_lease_is_taken(s3_server, s3_bucket, s3_faults):
    from filter_pipeline_tests.s3_faults import IGNORE_CONDITIONS

    for header in ("if-none-match", "if-match"):
        s3_faults.fault = lambda request, header=header: IGNORE_CONDITIONS if header in request.headers else None
        with pytest.raises(lease.StoreIgnoresConditions, match=r"applied a write whose condition .* did not hold"):
            with ledger_lease(through(s3_faults, s3_bucket), "run r2"):
                pass
        assert not s3_server.filesystem().exists(f"{s3_bucket}/data/warehouse/{LEASE_FILE}")
    s3_faults.fault = lambda request: None
    with ledger_lease(through(s3_faults, s3_bucket), "run r2"):
        pass


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_renewal_applied_whose_reply_was_lost_keeps_the_lease(s3_server, s3_bucket, s3_faults):
    from filter_pipeline_tests.s3_faults import LOSE_REPLY, once

    s3_faults.fault = once(lease_write("if-match"), LOSE_REPLY)  # the first renewal's reply
    with ledger_lease(through(s3_faults, s3_bucket), "run r1", ttl_seconds=1.2) as held:
        time.sleep(1.5)  # the first renewal (after 0.3 s) was applied, its reply lost; two more beats since
        assert s3_faults.applied, "no renewal was made"
        held.confirm()  # the store still holds this holder's record: not lost
        assert held.lost is None
    assert not s3_server.filesystem().exists(f"{s3_bucket}/data/warehouse/{LEASE_FILE}")  # deleted: it was ours


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_store_out_of_reach_when_the_lease_is_released_leaves_the_walks_own_error(s3_server, s3_bucket, s3_faults):
    from filter_pipeline_tests.s3_faults import DROP

    # (one try each in s3fs and botocore: their retries of a dropped connection take half a minute)
    root = UPath(
        f"s3://{s3_bucket}/data",
        endpoint_url=s3_faults.endpoint,
        use_listings_cache=False,
        config_kwargs={"retries": {"max_attempts": 1}},
    )
    root.fs.retries = 1  # (s3fs takes it as an attribute only; this proxy's port makes the instance this test's)
    with pytest.raises(ValueError, match="^the walk's own error$"):
        with ledger_lease(root, "run r1", ttl_seconds=60):
            s3_faults.fault = lambda request: DROP  # the network gone: the release's DELETE gets no answer
            raise ValueError("the walk's own error")
    assert [request.method for _, request in s3_faults.applied][:1] == ["DELETE"]
    # not deleted: it stays until its TTL is over
    assert json.loads(s3_server.filesystem().cat_file(f"{s3_bucket}/data/warehouse/{LEASE_FILE}"))["holder"] == "run r1"


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_live_lease_of_the_previous_version_is_not_taken_over(s3_server, s3_bucket):
    root = s3_root(s3_server, s3_bucket)
    lease_record(root, expires=time.time() + 120)  # no ttl_seconds, no token: as the earlier version wrote it
    with pytest.raises(LedgerBusy, match=r"held by run r1 \(elsewhere\)"):
        with ledger_lease(root, "run r2"):
            pass


def a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow  # moto's S3 server is a process of its own
@pytest.mark.parametrize("host, machine, pid, outcome", [
    ("here", "here", "dead", "taken"),  # killed (kill -9 leaves its lease): no need to wait out its TTL
    ("here", "here", "alive", "busy"),
    ("elsewhere", "elsewhere", "dead", "busy"),  # a pid of another machine says nothing here
    ("here", "elsewhere", "dead", "busy"),  # a laptop of the same default name, a container on the host's network
    ("here", None, "dead", "busy"),  # a holder that does not say (an earlier version)
])  # fmt: skip
@pytest.mark.skipif(files.MACHINE is None, reason="this system does not say which boot and PID namespace it is")
def test_a_live_lease_of_a_process_of_this_machine_that_is_gone_is_taken_over_at_once(
    s3_server, s3_bucket, host, machine, pid, outcome
):
    root = s3_root(s3_server, s3_bucket)
    holder = {"host": socket.gethostname() if host == "here" else "elsewhere",
              "machine": {"here": files.MACHINE, "elsewhere": "another boot:1"}.get(machine),
              "pid": a_dead_pid() if pid == "dead" else os.getppid()}  # fmt: skip
    lease_record(root, expires=time.time() + 120, ttl_seconds=120, **holder)
    if outcome == "busy":
        with pytest.raises(LedgerBusy, match=r"held by run r1 \(elsewhere\)"):
            with ledger_lease(root, "run r2"):
                pass
        return
    with ledger_lease(root, "run r2"):
        assert json.loads(root.fs.cat_file((root / "warehouse" / LEASE_FILE).path))["holder"] == "run r2"


@pytest.mark.slow  # moto's S3 server is a process of its own
@pytest.mark.parametrize("write", ["create", "takeover"])
def test_a_lease_written_whose_reply_was_lost_is_held_not_busy(s3_server, s3_bucket, s3_faults, write):
    from filter_pipeline_tests.s3_faults import LOSE_REPLY, once

    if write == "takeover":
        expired_lease(s3_root(s3_server, s3_bucket))
    s3_faults.fault = once(lease_write("if-none-match" if write == "create" else "if-match"), LOSE_REPLY)
    with ledger_lease(through(s3_faults, s3_bucket), "run r2") as held:
        assert s3_faults.applied, "no lease write was made"
        held.confirm()
        current = json.loads(s3_server.filesystem().cat_file(f"{s3_bucket}/data/warehouse/{LEASE_FILE}"))
        assert current["holder"] == "run r2"


@pytest.mark.parametrize(
    "date, store_clock",
    [
        ("Sat, 05 Dec 2026 01:02:03 GMT", True),
        ("Sat, 05 Dec 2026 01:02:03 -0000", True),  # a zone parsed as naive: taken as UTC
        ("not a date", False),  # garbled: this machine's clock, not a crash
        (None, False),  # a store that sends no Date
    ],
)
def test_the_stores_clock_is_its_answers_date(date, store_clock):
    from datetime import UTC, datetime

    head = {"ResponseMetadata": {"HTTPHeaders": {"date": date} if date else {}}}
    now = lease._store_now(head)
    if store_clock:
        assert now == datetime(2026, 12, 5, 1, 2, 3, tzinfo=UTC)
    else:
        assert now.tzinfo is not None and abs(now.timestamp() - time.time()) < 5


@pytest.mark.slow  # moto's S3 server is a process of its own
@pytest.mark.parametrize("expires", [1e18, float("inf")], ids=["far-ahead", "infinity"])
def test_an_earlier_versions_lease_blocks_no_longer_than_an_hour_whatever_it_says(
    s3_server, s3_bucket, monkeypatch, expires
):
    monkeypatch.setattr(lease, "ABANDONED_AFTER_SECONDS", 1)  # the hour, shortened
    monkeypatch.setenv("FILTER_PIPELINE_LEASE_SECONDS", "1")
    root = s3_root(s3_server, s3_bucket)
    lease_record(root, expires=expires)  # no ttl_seconds: as the earlier version wrote it (json writes Infinity)
    time.sleep(2.2)
    with ledger_lease(root, "run r2"):
        assert json.loads(root.fs.cat_file((root / "warehouse" / LEASE_FILE).path))["holder"] == "run r2"


@pytest.mark.slow  # botocore tries a refused connection several times
def test_whether_a_lease_is_live_is_unknown_when_the_store_cannot_be_reached(s3_bucket):
    from filter_pipeline_tests.servers import free_port

    nowhere = UPath(f"s3://{s3_bucket}/data/warehouse", endpoint_url=f"http://127.0.0.1:{free_port()}")
    assert lease.lease_live(nowhere) is None


@pytest.mark.parametrize(
    "record",
    [{"expires": 10**400}, {"ttl_seconds": 10**400}, {"expires": float("nan")}, {"ttl_seconds": float("inf")}],
    ids=["expires-too-long-for-a-float", "ttl-too-long-for-a-float", "expires-nan", "ttl-infinite"],
)
def test_a_lease_record_with_a_number_no_clock_can_use_is_expired(record):
    head = {"LastModified": datetime.now(UTC), "ResponseMetadata": {"HTTPHeaders": {}}}

    class Store:  # answers the one HEAD the check may make
        def call_s3(self, method, **kwargs):
            return head

        def split_path(self, path):
            return "bucket", "key", None

    assert lease._store_says_expired(Store(), "bucket/key", record) is True
