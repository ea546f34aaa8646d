"""The staged publish (CONTRACT §4): a walk's files are visible only once its commit record is published, by a
write conditional on the record read at the lease; a refused walk removes its own staged files only; a walk
killed after publishing is completed by the next launcher."""

import hashlib
import json
import os

import pytest
from upath import UPath

from filter_pipeline.storage.files import writer_named
from filter_pipeline.storage.publish import (
    CONFLICT_TRIES,
    MANIFEST,
    STAGING_DIR,
    PublishRefused,
    StagedWalk,
    commit_path,
    commit_state,
    complete_published,
    relative,
    write_commit,
)
from filter_pipeline_tests.rules.test_commits import record


def never_lost() -> None:
    pass


def stage(root: UPath, run_id: str, content: bytes) -> tuple[StagedWalk, dict]:
    walk = StagedWalk(root, commit_state(root / "warehouse", run_id))
    final = root / "warehouse" / "kept" / f"{run_id}.parquet"
    return walk, {"kept": walk.write(final, content, 1)}


def test_staged_files_are_invisible_until_the_publish_moves_them_into_place(tmp_path):
    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"new rows")
    kept = tmp_path / "warehouse" / "kept" / "r1.parquet"
    assert not kept.exists() and files["kept"]["path"] == "warehouse/kept/r1.parquet"
    walk.publish(record("r1", files=files), never_lost)
    assert kept.read_bytes() == b"new rows"
    assert json.loads(commit_path(root / "warehouse", "r1").read_bytes())["files"] == files
    assert not list((tmp_path / "warehouse" / STAGING_DIR).iterdir())


@pytest.mark.parametrize("first_walk", [True, False])
def test_a_walk_whose_record_changed_meanwhile_is_refused_and_removes_only_its_own_files(tmp_path, first_walk):
    root = UPath(tmp_path)
    if not first_walk:
        write_commit(root / "warehouse", record("r1", walked_at="2026-12-01T00:00:00+00:00"))
    stale, files = stage(root, "r1", b"stale rows")
    other, other_files = stage(root, "r2", b"another walk's staged rows")
    newer = record("r1", walked_at="2026-12-02T00:00:00+00:00")
    write_commit(root / "warehouse", newer)  # another walk committed r1 after the stale one read it
    (tmp_path / "warehouse" / "kept").mkdir(parents=True, exist_ok=True)
    (tmp_path / "warehouse" / "kept" / "r1.parquet").write_bytes(b"the newer walk's rows")
    with pytest.raises(PublishRefused, match=r"^r1: this walk was not published \(its commit record changed"):
        stale.publish(record("r1", files=files), never_lost)
    assert commit_path(root / "warehouse", "r1").read_bytes() == newer.to_json()
    assert (tmp_path / "warehouse" / "kept" / "r1.parquet").read_bytes() == b"the newer walk's rows"
    assert not stale.folder.exists() and other.folder.exists()


def test_a_walk_that_knows_its_lease_lost_publishes_nothing(tmp_path):
    from filter_pipeline.storage.lease import LeaseLost

    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"rows")

    def lost() -> None:
        raise LeaseLost("the ledger lease was taken over by another walk after it expired")

    with pytest.raises(PublishRefused, match="taken over by another walk"):
        walk.publish(record("r1", files=files), lost)
    assert not commit_path(root / "warehouse", "r1").exists() and not walk.folder.exists()


def test_a_publish_killed_before_its_moves_is_completed_and_a_dead_walks_unpublished_files_removed(tmp_path):
    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"committed rows")
    published = record("r1", files=files)
    (walk.folder / MANIFEST).write_bytes(
        json.dumps({"run_id": "r1", "digest": published.digest, "moves": walk.moves}).encode()
    )
    write_commit(root / "warehouse", published)  # killed right after the publish: nothing moved
    dead = tmp_path / "warehouse" / STAGING_DIR / writer_named("r2", 999999999)
    (dead / "warehouse" / "kept").mkdir(parents=True)
    (dead / "warehouse" / "kept" / "r2.parquet").write_bytes(b"never published")
    said = []
    assert complete_published(root, said.append) == ["r1"]
    assert (tmp_path / "warehouse" / "kept" / "r1.parquet").read_bytes() == b"committed rows"
    assert said == ["r1: completed the publish of its committed walk (its files moved into place)"]
    assert not walk.folder.exists() and not dead.exists()
    assert not (tmp_path / "warehouse" / "kept" / "r2.parquet").exists()


def test_a_live_walks_unpublished_files_are_left_alone(tmp_path):
    root = UPath(tmp_path)
    live, _ = stage(root, "r1", b"being walked")  # this process: alive
    assert complete_published(root, print) == [] and live.folder.exists()


def test_a_staging_folder_is_judged_gone_only_by_its_own_writer_whatever_dots_its_run_id_holds(tmp_path):
    from filter_pipeline.storage.files import WRITER

    root = UPath(tmp_path)
    staging = tmp_path / "warehouse" / STAGING_DIR
    dead = staging / writer_named("2026.12.05", 999999999)  # a run_id with dots; its walk gone
    # a walk of another machine whose name ends with this one's ("node1.vm" beside "vm"): its pid means nothing here
    theirs = staging / f"r1.node1-{WRITER}.999999999.00aa"
    for folder in (dead, theirs):
        (folder / "warehouse" / "kept").mkdir(parents=True)
    assert complete_published(root, print) == []
    assert not dead.exists() and theirs.exists()


def test_an_unpublished_staging_folder_nobody_wrote_to_for_an_hour_is_removed(tmp_path):
    from filter_pipeline.storage.files import ABANDONED_AFTER_SECONDS

    root = UPath(tmp_path)
    other_host = tmp_path / "warehouse" / STAGING_DIR / "r1.elsewhere.42.00aa"
    (other_host / "warehouse" / "kept").mkdir(parents=True)
    old = other_host / "warehouse" / "kept" / "r1.parquet"
    old.write_bytes(b"never published")
    assert complete_published(root, print) == [] and other_host.exists()  # recent: perhaps a walk still going
    then = old.stat().st_mtime - ABANDONED_AFTER_SECONDS - 60
    os.utime(old, (then, then))
    assert complete_published(root, print) == [] and not other_host.exists()


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_dead_walks_publish_that_lands_late_on_s3_finds_its_staged_files_and_is_completed(s3_server, s3_bucket):
    root = UPath(f"s3://{s3_bucket}/data", endpoint_url=s3_server.endpoint, use_listings_cache=False)
    walk, files = stage(root, "r1", b"committed rows")
    published = record("r1", files=files)
    dead = root / "warehouse" / STAGING_DIR / writer_named("r1", 999999999)  # its process is gone
    for staged, final in walk.moves.items():
        (dead / final).write_bytes((root / staged).read_bytes())
    moves = {relative(root, dead / final): final for final in walk.moves.values()}
    (dead / MANIFEST).write_bytes(json.dumps({"run_id": "r1", "digest": published.digest, "moves": moves}).encode())
    walk.discard()
    assert complete_published(root, print) == [] and (dead / MANIFEST).exists()  # its PUT may be in flight
    write_commit(root / "warehouse", published)  # the store applies the PUT the walk sent before it was killed
    assert complete_published(root, print) == ["r1"]
    assert (root / "warehouse" / "kept" / "r1.parquet").read_bytes() == b"committed rows"
    assert not (dead / MANIFEST).exists()


@pytest.mark.slow  # moto's S3 server is a process of its own
@pytest.mark.parametrize("conflicts", [1, CONFLICT_TRIES])
def test_a_409_on_the_publish_is_tried_again_until_the_store_decides(s3_server, s3_bucket, s3_faults, conflicts):
    from filter_pipeline_tests.s3_faults import CONFLICT

    root = UPath(f"s3://{s3_bucket}/data", endpoint_url=s3_faults.endpoint, use_listings_cache=False)
    answered = []

    def conflict(request):
        if request.method == "PUT" and request.path.endswith("/_commits/r1.json") and len(answered) < conflicts:
            answered.append(request)
            return CONFLICT
        return None

    s3_faults.fault = conflict
    walk, files = stage(root, "r1", b"rows")
    if conflicts < CONFLICT_TRIES:
        walk.publish(record("r1", files=files), never_lost)
        assert root.fs.cat_file(f"{s3_bucket}/data/warehouse/kept/r1.parquet") == b"rows"
    else:
        with pytest.raises(PublishRefused, match=r"in flight each time it tried \(the store answered 409\)"):
            walk.publish(record("r1", files=files), never_lost)
        assert not root.fs.exists(commit_path(root / "warehouse", "r1").path)
    assert len(answered) == conflicts


def removed_meanwhile(walk: StagedWalk) -> None:
    """Another launcher took the walk's staging folder for abandoned (the walk stalled for over an hour)."""
    import shutil

    shutil.rmtree(walk.folder.path)


def test_a_walk_whose_staged_files_were_removed_while_it_stalled_is_not_published(tmp_path, monkeypatch):
    from filter_pipeline.storage import publish

    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"rows")
    monkeypatch.setattr(publish, "pause_point", lambda point: point == "before_publish" and removed_meanwhile(walk))
    with pytest.raises(
        PublishRefused, match=r"^r1: this walk was not published \(its staged files \(warehouse/kept/r1"
    ):
        walk.publish(record("r1", files=files), never_lost)
    assert not commit_path(root / "warehouse", "r1").exists()


def test_a_walk_published_as_its_staged_files_were_removed_says_so_and_what_to_do(tmp_path, monkeypatch):
    from filter_pipeline.storage import publish

    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"rows")
    real_put = publish._put_commit

    def removed_just_before_the_put(*args):
        removed_meanwhile(walk)
        return real_put(*args)

    monkeypatch.setattr(publish, "_put_commit", removed_just_before_the_put)
    with pytest.raises(
        publish.PublishIncomplete,
        match=r"^r1: its commit was published, but its staged files \(warehouse/kept/r1.parquet\) were removed before "
        r".*: re-filter it with `filter-pipeline materialize r1`$",
    ):
        walk.publish(record("r1", files=files), never_lost)
    assert commit_path(root / "warehouse", "r1").exists()
    assert not (tmp_path / "warehouse" / "kept" / "r1.parquet").exists()


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_publish_applied_whose_every_reply_was_lost_stands_with_its_files(s3_server, s3_bucket, s3_faults):
    from filter_pipeline_tests.s3_faults import LOSE_REPLY

    # one try each (botocore and s3fs would otherwise retry the lost reply for half a minute)
    root = UPath(f"s3://{s3_bucket}/data", endpoint_url=s3_faults.endpoint, use_listings_cache=False,
                 config_kwargs={"retries": {"max_attempts": 1}})  # fmt: skip
    root.fs.retries = 1
    walk, files = stage(root, "r1", b"rows")
    s3_faults.fault = lambda request: (
        LOSE_REPLY if request.path.endswith("/_commits/r1.json") and request.method == "PUT" else None
    )
    walk.publish(record("r1", files=files), never_lost)
    assert s3_faults.applied and {action for action, _ in s3_faults.applied} == {LOSE_REPLY}  # no reply, ever
    assert root.fs.cat_file(f"{s3_bucket}/data/warehouse/kept/r1.parquet") == b"rows"


def test_a_data_root_given_relative_to_the_working_folder_publishes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = UPath("data")  # as `--data data`, or the default data root
    walk, files = stage(root, "r1", b"rows")
    walk.publish(record("r1", files=files), never_lost)
    assert (tmp_path / "data" / "warehouse" / "kept" / "r1.parquet").read_bytes() == b"rows"


class Interrupted(BaseException):
    """As Dagster's interrupt of a terminated run, or Ctrl-C: not an Exception."""


def test_a_publish_interrupted_after_its_write_leaves_its_files_for_the_next_launcher(tmp_path, monkeypatch):
    from filter_pipeline.storage import publish

    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"rows")
    real_put = publish._put_commit

    def written_then_interrupted(*args):
        real_put(*args)
        raise Interrupted()

    monkeypatch.setattr(publish, "_put_commit", written_then_interrupted)
    with pytest.raises(Interrupted):
        try:
            walk.publish(record("r1", files=files), never_lost)
        finally:
            walk.discard()  # as the ledger step does, whatever happened
    assert commit_path(root / "warehouse", "r1").exists() and walk.folder.exists()
    assert complete_published(root, print) == ["r1"]
    assert (tmp_path / "warehouse" / "kept" / "r1.parquet").read_bytes() == b"rows"


def test_a_publish_completed_while_the_audit_looked_is_not_reported_incomplete(tmp_path, monkeypatch):
    from filter_pipeline.storage import audit

    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"rows")
    published = record("r1", files=files)
    (walk.folder / MANIFEST).write_bytes(
        json.dumps({"run_id": "r1", "digest": published.digest, "moves": walk.moves}).encode()
    )
    write_commit(root / "warehouse", published)  # published, nothing moved yet
    dead = walk.folder.with_name(writer_named("r1", 999999999))  # its walk gone, as far as this machine can tell
    os.rename(walk.folder.path, dead.path)

    def completed_meanwhile(warehouse):
        complete_published(root, print)  # another launcher completes it after the audit listed the folder
        return None

    monkeypatch.setattr(audit, "lease_live", completed_meanwhile)
    assert "incomplete" not in [f.kind for f in audit.audit(root)]


@pytest.mark.slow  # moto's S3 server is a process of its own
def test_a_publish_completed_while_the_audit_looked_is_not_reported_incomplete_on_s3(s3_server, s3_bucket, monkeypatch):
    from filter_pipeline.storage import audit

    # the audit's filesystem caches listings (as AWS's default does); the launcher completing the publish is another
    root = UPath(f"s3://{s3_bucket}/data", endpoint_url=s3_server.endpoint, use_listings_cache=True)
    other = UPath(f"s3://{s3_bucket}/data", endpoint_url=s3_server.endpoint, use_listings_cache=False)
    staged = f"warehouse/{STAGING_DIR}/r1.elsewhere.42.00ff"  # its walk on another machine
    files = {
        "kept": {
            "path": "warehouse/kept/r1.parquet",
            "size": 4,
            "sha256": hashlib.sha256(b"rows").hexdigest(),
            "rows": 1,
        }
    }
    published = record("r1", files=files)
    moves = {f"{staged}/warehouse/kept/r1.parquet": "warehouse/kept/r1.parquet"}
    (other / staged / "warehouse" / "kept" / "r1.parquet").write_bytes(b"rows")
    (other / staged / MANIFEST).write_bytes(
        json.dumps({"run_id": "r1", "digest": published.digest, "moves": moves}).encode()
    )
    write_commit(other / "warehouse", published)

    def completed_meanwhile(warehouse):
        assert complete_published(other, print) == ["r1"]  # after the audit listed the folder
        return False  # and released its lease

    monkeypatch.setattr(audit, "lease_live", completed_meanwhile)
    assert "incomplete" not in [f.kind for f in audit.audit(root)]


def test_a_staged_file_another_launcher_moves_first_is_taken_as_moved_not_an_error(tmp_path, monkeypatch):
    from filter_pipeline.storage import publish

    root = UPath(tmp_path)
    walk, files = stage(root, "r1", b"committed rows")
    published = record("r1", files=files)
    write_commit(root / "warehouse", published)
    manifest = {"run_id": "r1", "digest": published.digest, "moves": walk.moves, "sha256": {
        e["path"]: e["sha256"] for e in files.values()}}  # fmt: skip
    replace = os.replace

    def another_launcher_moves_it_first(source, target):
        replace(source, target)  # (the launcher completing this publish, between the check and the move)
        replace(source, target)

    monkeypatch.setattr(publish.os, "replace", another_launcher_moves_it_first)
    publish._move_all(root, walk.folder, manifest)  # no error: the file in place is the one committed
    assert (tmp_path / "warehouse" / "kept" / "r1.parquet").read_bytes() == b"committed rows"
