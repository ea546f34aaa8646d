"""The local Dagster instance (instance/dagster.yaml names `LocalInstance` as its `instance_class`): Dagster's
own, whose default SQLite storage has an event log that keeps each database's engine and one open connection.

Dagster's `SqliteEventLogStorage` creates and disposes of an engine for every event it stores and every query
it runs (NullPool): each event opens the database, and closing it, the last connection, checkpoints the WAL
into the database file. SQLAlchemy's statement cache, which lives on the engine, never gets a hit either.
Storing an event costs 5.4–7.7 ms that way (4.7–5.2 ms with only the engine kept), 1.3–1.5 ms with the
engine and a connection kept; a dynamic-partition lookup 3.7–4.9 ms instead of 0.45 ms. A run of a big
batch stores about 125 events and makes about 85 such lookups: about 1 s of a 10 s run, now 0.2 s (README,
Performance).

A kept connection is checked before each use against the database file's identity (device, inode): a file
deleted or replaced by another process (a run deleted, the instance wiped) is connected to afresh, as
Dagster's new connection would be. A connection back in the pool holds no transaction, so it holds no lock:
files, schema and locking are Dagster's, and this storage and Dagster's read and write the same instance side
by side. Each run's new database is also created without loading alembic's migration scripts twice (a CLI
run loaded them five times, now three: about 0.1 s).

Only the default storage changes: an instance that configures `storage:` (PostgreSQL in
deploy/dagster-postgres.yaml) gets what it configures.
"""

import os
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import dagster as dg
import sqlalchemy as db
import sqlalchemy.exc as db_exc
import yaml
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.event_log import SqlEventLogStorageMetadata
from dagster._core.storage.event_log.sqlite import sqlite_event_log
from dagster._core.storage.event_log.sqlite.sqlite_event_log import INDEX_SHARD_NAME, SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage as DagsterSqliteEventLogStorage
from dagster._core.storage.sql import create_engine, get_alembic_config, safe_commit
from dagster._core.storage.sqlite import LAST_KNOWN_STAMPED_SQLITE_ALEMBIC_REVISION
from dagster._core.storage.sqlite_storage import DagsterSqliteStorage
from dagster._serdes import ConfigurableClassData
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import QueuePool

# Engines (each with its open connection) kept, least recently used first out: the index and the runs being
# written or read. A long-lived webserver reads every run's shard in time; an engine evicted is closed, and
# built again when next needed.
MAX_ENGINES = 16

# What another process creating the same shard at the same moment makes a shard's creation fail with (Dagster's
# list): it is then tried again, up to INIT_RETRIES times, INIT_RETRY_SECONDS apart.
CONCURRENT_INIT = re.compile(r"table [A-Za-z_]* already exists|database is locked|UNIQUE constraint failed: alembic_version\.version_num")
INIT_RETRIES = 10
INIT_RETRY_SECONDS = 0.2


FILE_IDENTITY = "filter_pipeline.file_identity"  # key of a pooled connection's record.info


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None if there is none: what tells a database file replaced by
    another process (deleted, then created again) from the one a connection opened."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


@cache
def migration_scripts() -> ScriptDirectory:
    """Dagster's alembic migrations, loaded once per process (about 90 revision files: about 0.05 s a load)."""
    scripts = ScriptDirectory.from_config(get_alembic_config(sqlite_event_log.__file__))
    scripts.get_heads()  # (the revision map loads lazily, once)
    return scripts


class SqliteEventLogStorage(DagsterSqliteEventLogStorage):
    """Dagster's SQLite event log storage, keeping one engine and one open connection per shard (the index,
    each run's database) while the shard is among the MAX_ENGINES most recently used."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None):
        self._engines: OrderedDict[str, Engine] = OrderedDict()
        self._engines_lock = threading.Lock()  # (_connect holds _db_lock; has_table does not)
        self._tables: set[str] = set()  # tables seen to exist (none is dropped while an instance is open)
        super().__init__(base_dir, inst_data)

    def _engine(self, shard: str) -> Engine:
        with self._engines_lock:
            engine = self._engines.get(shard)
            if engine is None:
                engine = self._new_engine(shard)
                self._engines[shard] = engine
                if len(self._engines) > MAX_ENGINES:
                    self._engines.popitem(last=False)[1].dispose()
            self._engines.move_to_end(shard)
            return engine

    def _new_engine(self, shard: str) -> Engine:
        # SQLAlchemy's own pool for a SQLite file (Dagster passes NullPool), keeping one connection: _connect
        # serializes this storage's use of a shard; a second concurrent user (has_table) gets a passing one.
        engine = create_engine(
            self.conn_string_for_shard(shard),
            poolclass=QueuePool,
            pool_size=1,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS},
        )
        path = self.path_for_shard(shard)

        @event.listens_for(engine, "connect")
        def remember_file(dbapi_connection, record) -> None:
            record.info[FILE_IDENTITY] = file_identity(path)

        @event.listens_for(engine, "checkout")
        def check_file(dbapi_connection, record, proxy) -> None:
            if record.info.get(FILE_IDENTITY) != file_identity(path):
                # the pool drops this connection and connects again, to the file now at `path`
                raise db_exc.DisconnectionError(f"{path} was deleted or replaced since this connection opened it")

        return engine

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Connection]:
        # Dagster's _connect with the engine kept: the same lock, one-time schema init and transaction
        with self._db_lock:
            engine = self._engine(shard)
            if shard not in self._initialized_dbs:
                self._initdb(engine)
                self._initialized_dbs.add(shard)
            with engine.connect() as conn:
                with conn.begin():
                    yield conn

    def _initdb(self, engine: Engine, for_index_shard: bool = False) -> None:
        # Dagster's _initdb (a new shard gets its tables, WAL and an alembic stamp; a clash with another process
        # creating it too is retried) with the migration scripts loaded once per process: Dagster loads them to
        # check every shard and again to stamp a new one, at the start of every run.
        for retries_left in range(INIT_RETRIES, -1, -1):
            try:
                with engine.connect() as connection:
                    migration = MigrationContext.configure(connection)
                    if migration.get_current_revision() is None:
                        tables = db.inspect(engine).get_table_names()
                        # an index made before Dagster stamped SQLite shards: Dagster's own choice of revision
                        stamp = LAST_KNOWN_STAMPED_SQLITE_ALEMBIC_REVISION if for_index_shard and "event_logs" in tables else "head"
                        SqlEventLogStorageMetadata.create_all(engine)
                        connection.execute(db.text("PRAGMA journal_mode=WAL;"))
                        migration.stamp(migration_scripts(), stamp)
                        safe_commit(connection)
                return
            except (db_exc.DatabaseError, sqlite3.DatabaseError, sqlite3.OperationalError) as exc:
                if retries_left == 0 or not CONCURRENT_INIT.search(str(exc)):
                    raise
                time.sleep(INIT_RETRY_SECONDS)

    def has_table(self, table_name: str) -> bool:
        # asked before every dynamic-partition lookup: twice per partitioned input of every step
        if table_name in self._tables:
            return True
        engine = self._engine(INDEX_SHARD_NAME)
        with engine.connect() as conn:
            found = bool(engine.dialect.has_table(conn, table_name))
        if found:
            self._tables.add(table_name)
        return found

    def wipe(self) -> None:
        self._dispose_engines()  # their connections hold the run files Dagster's wipe deletes
        super().wipe()

    def dispose(self) -> None:
        super().dispose()
        self._dispose_engines()

    def _dispose_engines(self) -> None:
        with self._engines_lock:
            for engine in self._engines.values():
                engine.dispose()
            self._engines.clear()


class SqliteStorage(DagsterSqliteStorage):
    """Dagster's `storage: sqlite` (the same folders under `base_dir`: history/, history/runs/, schedules/),
    with `SqliteEventLogStorage` above as its event log."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None):
        super().__init__(base_dir, inst_data)
        events = self._event_log_storage
        self._event_log_storage = SqliteEventLogStorage(os.path.dirname(events.path_for_shard(INDEX_SHARD_NAME)))
        events.dispose()

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value) -> "SqliteStorage":  # type: ignore[override]
        return cls.from_local(inst_data=inst_data, **config_value)


class LocalInstance(dg.DagsterInstance):
    """Dagster's instance, whose storage by default (no `storage:` in dagster.yaml) is `SqliteStorage` above
    in the instance folder rather than Dagster's `storage: sqlite`. A configured `storage:` is used as it is."""

    @classmethod
    def config_schema(cls) -> dict:
        return {}  # no settings of its own

    @classmethod
    def config_defaults(cls, base_dir: str) -> dict:
        defaults = dict(InstanceRef.config_defaults(base_dir))
        defaults["storage"] = ConfigurableClassData(__name__, SqliteStorage.__name__, yaml.dump({"base_dir": base_dir}))
        return defaults
