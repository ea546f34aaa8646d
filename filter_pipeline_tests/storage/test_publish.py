"""The staged publish (CONTRACT §4): a walk's files are visible only once its commit record is published, by a
write conditional on the record read at the lease; a refused walk removes its own staged files only; a walk
killed after publishing is completed by the next launcher."""

import json
import os

import pytest
from upath import UPath

from filter_pipeline.storage.files import HOST
from filter_pipeline.storage.publish import (
    MANIFEST,
    STAGING_DIR,
    PublishRefused,
    StagedWalk,
    commit_path,
    commit_state,
    complete_published,
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
    dead = tmp_path / "warehouse" / STAGING_DIR / f"r2.{HOST}.999999999.00ff"
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


def test_an_unpublished_staging_folder_nobody_wrote_to_for_an_hour_is_removed(tmp_path):
    from filter_pipeline.storage.files import STALE_TEMP_SECONDS

    root = UPath(tmp_path)
    other_host = tmp_path / "warehouse" / STAGING_DIR / "r1.elsewhere.42.00aa"
    (other_host / "warehouse" / "kept").mkdir(parents=True)
    old = other_host / "warehouse" / "kept" / "r1.parquet"
    old.write_bytes(b"never published")
    assert complete_published(root, print) == [] and other_host.exists()  # recent: perhaps a walk still going
    then = old.stat().st_mtime - STALE_TEMP_SECONDS - 60
    os.utime(old, (then, then))
    assert complete_published(root, print) == [] and not other_host.exists()
