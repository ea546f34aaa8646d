"""The local instance (instance/dagster.yaml): Dagster's SQLite storage, files and all, with engines and connections kept."""

import contextlib
import shutil
import sqlite3
import threading
import time

import dagster as dg
import sqlalchemy
from alembic.script import ScriptDirectory
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.event_log.sqlite import SqliteEventLogStorage as DagsterSqliteEventLogStorage

from filter_pipeline import instance as local
from filter_pipeline_tests.conftest import REPO


def home_with(tmp_path, yaml_text: str | None = None):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "instance" / "dagster.yaml", home / "dagster.yaml")
    if yaml_text is not None:
        (home / "dagster.yaml").write_text(yaml_text)
    return home


def stock_yaml() -> str:
    """The project's dagster.yaml without its instance_class: Dagster's own instance on the same files."""
    text = (REPO / "instance" / "dagster.yaml").read_text()
    return text[: text.index("instance_class:")]


@dg.asset
def one() -> int:
    return 1


@dg.asset
def two(one: int) -> int:
    return one + 1


def materialize(instance) -> str:
    result = dg.materialize([one, two], instance=instance)
    assert result.success
    return result.run_id


def log_line(run_id: str, n: int) -> EventLogEntry:
    return EventLogEntry(
        error_info=None, level=20, user_message=f"line {n}", run_id=run_id, timestamp=time.time(),
        step_key="s", job_name="j", dagster_event=None,
    )  # fmt: skip


def test_the_project_instance_keeps_engines_on_dagsters_folders(tmp_path):
    home = home_with(tmp_path)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert type(instance) is local.LocalInstance
        assert type(instance.event_log_storage) is local.SqliteEventLogStorage
        run_id = materialize(instance)
    # where Dagster's `storage: sqlite` keeps them
    assert (home / "history" / "runs.db").exists()
    assert (home / "history" / "runs" / "index.db").exists()
    assert (home / "history" / "runs" / f"{run_id}.db").exists()


def test_dagsters_own_instance_reads_what_it_stored_and_the_other_way_round(tmp_path):
    home = home_with(tmp_path)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        ours = materialize(instance)
        ours_events = [e.dagster_event_type for e in instance.all_logs(ours)]
    (home / "dagster.yaml").write_text(stock_yaml())
    with dg.DagsterInstance.from_config(str(home)) as stock:
        assert type(stock.event_log_storage) is DagsterSqliteEventLogStorage
        assert [e.dagster_event_type for e in stock.all_logs(ours)] == ours_events
        assert stock.get_latest_materialization_event(dg.AssetKey("two")).run_id == ours
        theirs = materialize(stock)
        theirs_events = [e.dagster_event_type for e in stock.all_logs(theirs)]
    (home / "dagster.yaml").write_text((REPO / "instance" / "dagster.yaml").read_text())
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert [e.dagster_event_type for e in instance.all_logs(theirs)] == theirs_events
        assert instance.get_latest_materialization_event(dg.AssetKey("two")).run_id == theirs
        assert {r.run_id for r in instance.get_runs()} == {ours, theirs}


def test_an_engine_is_built_once_per_shard_not_once_per_event(tmp_path, monkeypatch):
    built = []
    real = local.create_engine
    monkeypatch.setattr(local, "create_engine", lambda url, **kw: built.append(str(url)) or real(url, **kw))
    storage = local.SqliteEventLogStorage(str(tmp_path))
    for n in range(20):
        storage.store_event(log_line("r1", n))
        storage.has_dynamic_partition("run_id", "b1")
    assert len(storage.get_logs_for_run("r1")) == 20
    assert sorted(url.rsplit("/", 1)[1] for url in built) == ["index.db", "r1.db"]
    storage.dispose()


def connections_opened(monkeypatch) -> list[str]:
    """The database file of every connection the storage's engines open from now on."""
    opened: list[str] = []
    real = local.create_engine

    def create_engine(url, **kwargs):
        engine = real(url, **kwargs)
        sqlalchemy.event.listen(engine, "connect", lambda dbapi_connection, record: opened.append(engine.url.database))
        return engine

    monkeypatch.setattr(local, "create_engine", create_engine)
    return opened


def test_a_shard_is_connected_to_once_not_once_per_event(tmp_path, monkeypatch):
    opened = connections_opened(monkeypatch)
    storage = local.SqliteEventLogStorage(str(tmp_path))
    for n in range(20):
        storage.store_event(log_line("r1", n))
        storage.has_dynamic_partition("run_id", "b1")
    assert len(storage.get_logs_for_run("r1")) == 20
    assert sorted(path.rsplit("/", 1)[1] for path in set(opened)) == ["index.db", "r1.db"]
    assert len(opened) <= 4  # (the shard's creation opens one more, once)
    storage.dispose()


def test_threads_sharing_one_storage_all_store_their_events(tmp_path):
    # the daemon and the webserver use one instance from many threads: a kept connection changes hands
    storage = local.SqliteEventLogStorage(str(tmp_path))
    storage.store_event(log_line("r1", -1))

    def store(n: int) -> None:
        for k in range(10):
            storage.store_event(log_line("r1", n * 10 + k))
            storage.has_table("dynamic_partitions")

    threads = [threading.Thread(target=store, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(int(e.user_message.split()[1]) for e in storage.get_logs_for_run("r1")) == list(range(-1, 40))
    storage.dispose()


def remove_shard(folder, run_id: str) -> None:
    for suffix in (".db", ".db-wal", ".db-shm"):
        (folder / f"{run_id}{suffix}").unlink(missing_ok=True)


def test_a_shard_another_process_deleted_and_created_again_is_written_where_it_now_is(tmp_path):
    ours = local.SqliteEventLogStorage(str(tmp_path))
    ours.store_event(log_line("r1", 0))
    remove_shard(tmp_path, "r1")  # another process deletes the run, and a new one with its id starts
    theirs = DagsterSqliteEventLogStorage(str(tmp_path))
    theirs.store_event(log_line("r1", 1))
    ours.store_event(log_line("r1", 2))  # not into the deleted file our connection had open
    assert [e.user_message for e in theirs.get_logs_for_run("r1")] == ["line 1", "line 2"]
    assert [e.user_message for e in ours.get_logs_for_run("r1")] == ["line 1", "line 2"]
    ours.dispose()
    theirs.dispose()


def test_a_wiped_instance_starts_its_runs_afresh(tmp_path):
    storage = local.SqliteEventLogStorage(str(tmp_path))
    storage.store_event(log_line("r1", 0))
    storage.wipe()
    assert not (tmp_path / "r1.db").exists()
    storage.store_event(log_line("r1", 1))
    assert [e.user_message for e in storage.get_logs_for_run("r1")] == ["line 1"]
    storage.dispose()


def test_a_kept_connection_holds_no_lock_between_uses(tmp_path):
    ours = local.SqliteEventLogStorage(str(tmp_path))
    ours.store_event(log_line("r1", 0))
    # another process writing the same shard straight away, without waiting for a busy timeout
    with contextlib.closing(sqlite3.connect(tmp_path / "r1.db", timeout=0)) as other:
        other.execute("BEGIN IMMEDIATE")
        other.execute("DELETE FROM event_logs")
        other.commit()
    ours.store_event(log_line("r1", 1))
    assert [e.user_message for e in ours.get_logs_for_run("r1")] == ["line 1"]
    ours.dispose()


def test_engines_of_the_least_recently_used_shards_are_let_go(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "MAX_ENGINES", 3)
    storage = local.SqliteEventLogStorage(str(tmp_path))
    for run_id in ["r1", "r2", "r3", "r1", "r4"]:
        storage.store_event(log_line(run_id, 0))
    assert list(storage._engines) == ["r3", "r1", "r4"]
    # a shard let go is opened again, with nothing lost
    storage.store_event(log_line("r2", 1))
    assert [e.user_message for e in storage.get_logs_for_run("r2")] == ["line 0", "line 1"]
    storage.dispose()


def test_a_table_is_looked_up_again_until_it_exists(tmp_path):
    storage = local.SqliteEventLogStorage(str(tmp_path))
    assert storage.has_table("dynamic_partitions")
    assert not storage.has_table("added_later")
    assert not storage.has_table("added_later")  # (an absence is not remembered)
    with storage.index_connection() as conn:
        conn.exec_driver_sql("CREATE TABLE added_later (x INTEGER)")
    assert storage.has_table("added_later")
    storage.dispose()


def test_a_configured_storage_is_used_as_configured(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    home = home_with(tmp_path)
    text = (home / "dagster.yaml").read_text() + f"\nstorage:\n  sqlite:\n    base_dir: {elsewhere}\n"
    (home / "dagster.yaml").write_text(text)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert type(instance) is local.LocalInstance
        assert type(instance.event_log_storage) is DagsterSqliteEventLogStorage
        run_id = materialize(instance)
    assert (elsewhere / "history" / "runs" / f"{run_id}.db").exists()
    assert not (home / "history").exists()


def shard_layout(path) -> tuple[list, list, str]:
    """A shard's schema (every table and index as created), its alembic revision and its journal mode."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        schema = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        revision = conn.execute("SELECT version_num FROM alembic_version").fetchall()
        return schema, revision, conn.execute("PRAGMA journal_mode").fetchone()[0]


def test_a_new_run_shard_is_created_as_dagster_creates_it(tmp_path):
    ours = local.SqliteEventLogStorage(str(tmp_path / "ours"))
    ours.store_event(log_line("r1", 0))
    theirs = DagsterSqliteEventLogStorage(str(tmp_path / "theirs"))
    theirs.store_event(log_line("r1", 0))
    made_by_us = shard_layout(tmp_path / "ours" / "r1.db")
    assert made_by_us == shard_layout(tmp_path / "theirs" / "r1.db")
    assert made_by_us[1] and made_by_us[2] == "wal"
    # and Dagster opens our shard as one of its own: nothing to create or stamp again
    assert [e.user_message for e in DagsterSqliteEventLogStorage(str(tmp_path / "ours")).get_logs_for_run("r1")] == ["line 0"]
    ours.dispose()
    theirs.dispose()


def test_the_migration_scripts_are_loaded_once_for_all_new_shards(tmp_path, monkeypatch):
    loads = []
    real = ScriptDirectory.from_config.__func__
    monkeypatch.setattr(ScriptDirectory, "from_config", classmethod(lambda cls, config: loads.append(1) or real(cls, config)))
    local.migration_scripts.cache_clear()
    storage = local.SqliteEventLogStorage(str(tmp_path))
    for run_id in ["r1", "r2", "r3"]:
        storage.store_event(log_line(run_id, 0))
    assert len(loads) == 1
    storage.dispose()


def test_processes_creating_the_same_shard_at_once_all_store_their_events(tmp_path):
    # separate storages, as separate processes have (the webserver, the daemon and a run worker)
    storages = [local.SqliteEventLogStorage(str(tmp_path)) for _ in range(4)]
    start = threading.Barrier(len(storages))

    def store(n: int) -> None:
        start.wait()
        storages[n].store_event(log_line("r1", n))

    threads = [threading.Thread(target=store, args=(n,)) for n in range(len(storages))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(e.user_message for e in storages[0].get_logs_for_run("r1")) == [f"line {n}" for n in range(4)]
    assert len(shard_layout(tmp_path / "r1.db")[1]) == 1  # stamped once
    for storage in storages:
        storage.dispose()
