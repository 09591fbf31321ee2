"""The catalog database: engines, one session per unit of work, migrations.

SQLite under the data dir by default; any SQLAlchemy URL (PostgreSQL with
psycopg) by option. Sessions are never shared across threads: each unit of
work opens its own, ``Catalog.session()`` to change the catalog (one writer
at a time) or ``Catalog.read_session()`` to read it (a consistent snapshot,
beside the writer, never waiting for it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Connection, Engine, create_engine, event, make_url, select
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from backend.catalog.models import (
    GroupSnapshot,
    Operation,
    OperationKind,
    OperationState,
    Publication,
    Snapshot,
    Volume,
    utcnow,
)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
CATALOG_FILE = "catalog.sqlite3"
BUSY_TIMEOUT_MS = 10_000

# WAL: readers never block the writer. synchronous=FULL: WAL with NORMAL already
# survives a SIGKILL of the daemon, but a power loss or kernel crash may undo
# the last commits; the journal's intent record must be durable before the
# pool is touched, as NBD's acknowledged writes are. One WAL fsync per commit
# is nothing at the rate a control plane writes.
_SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
    f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}",
)


def private_sqlite_files(path: Path) -> None:
    """Create the database file ``path`` mode 0600 if missing; take group's and
    others' permissions from it and from its -wal, -shm and -journal files."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{suffix}", 0o600)


def _sqlite_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    # Take transaction control away from the sqlite3 module (which would begin
    # lazily, at the first write) so that _sqlite_begin decides how to begin.
    dbapi_connection.isolation_level = None
    for pragma in _SQLITE_PRAGMAS:
        dbapi_connection.execute(pragma)


def _sqlite_connect_read_only(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    _sqlite_connect(dbapi_connection, record)
    # The database itself refuses a write in a read session.
    dbapi_connection.execute("PRAGMA query_only=ON")


def _sqlite_begin(connection: Connection) -> None:
    # IMMEDIATE takes the write lock up front, waiting up to busy_timeout for it.
    # A deferred transaction that reads and then writes fails at once with
    # SQLITE_BUSY when another writer committed in between (busy_timeout does
    # not apply to that), and a unit of work here is usually read-then-write.
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def _sqlite_begin_read(connection: Connection) -> None:
    # Deferred: in WAL mode the first read takes a snapshot of the last commit
    # and neither waits for the writer nor makes it wait.
    connection.exec_driver_sql("BEGIN")


class Catalog:
    """The catalog database at ``url``."""

    def __init__(self, url: str | URL) -> None:
        self.url: URL = make_url(url)
        self.engine: Engine = create_engine(self.url)
        backend = self.url.get_backend_name()
        if backend == "sqlite":
            event.listen(self.engine, "connect", _sqlite_connect)
            event.listen(self.engine, "begin", _sqlite_begin)
            # Read sessions on connections of their own, made read-only.
            self._read_engine = create_engine(self.url)
            event.listen(self._read_engine, "connect", _sqlite_connect_read_only)
            event.listen(self._read_engine, "begin", _sqlite_begin_read)
        elif backend == "postgresql":
            # One snapshot for the whole read, and the server refuses writes in it.
            self._read_engine = self.engine.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
        else:
            self._read_engine = self.engine
        # Objects stay readable after their session commits and closes.
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self._read_engine, expire_on_commit=False)
        # SQLite has one writer at a time and every write session begins
        # IMMEDIATE; threads waiting in SQLite's busy handler poll with
        # sleeps, so queue them on a lock instead, which wakes the next one
        # as soon as the previous commits.  Read sessions take no part.
        self._serial: contextlib.AbstractContextManager[object] = (
            threading.Lock() if backend == "sqlite" else contextlib.nullcontext()
        )

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> Catalog:
        """The default catalog: ``DATA_DIR/catalog.sqlite3`` (the directory must exist).

        The file is made, or made again, private to its owner (0600); SQLite
        gives its -wal and -shm files the database file's mode.
        """
        path = data_dir.absolute() / CATALOG_FILE
        private_sqlite_files(path)
        return cls(URL.create("sqlite", database=str(path)))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One unit of work that changes the catalog: one writer at a time;
        commits when the block ends, rolls back if it raises."""
        with self._serial, self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """One unit of work that only reads: a snapshot of the last commit,
        taken beside a writer without waiting for it.  SQLite and PostgreSQL
        refuse a write in it."""
        with self._read_sessions() as session, session.begin():
            yield session

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (a no-op when it is there)."""
        with self.engine.begin() as connection:
            config = self._alembic_config(connection)
            command.upgrade(config, "head")

    def _alembic_config(self, connection: Connection) -> Config:
        # No ini file and no fileConfig: the daemon owns logging.
        config = Config(attributes={"connection": connection})
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        url = self.url.render_as_string(hide_password=False)
        # Config values go through configparser interpolation.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
        return config

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
        self._read_engine.dispose()

    def __repr__(self) -> str:
        return f"Catalog({self.url.render_as_string(hide_password=True)!r})"


# ---------------------------------------------------------------- queries
# Thin helpers for the service layer; each takes the caller's session.


def get_volume_by_name(session: Session, name: str) -> Volume | None:
    return session.scalars(select(Volume).where(Volume.name == name)).one_or_none()


def list_volumes(session: Session, after_id: str | None, limit: int) -> Sequence[Volume]:
    """Up to ``limit`` volumes with ids after ``after_id``, by id: a stable pagination order."""
    query = select(Volume).order_by(Volume.id).limit(limit)
    if after_id is not None:
        query = query.where(Volume.id > after_id)
    return session.scalars(query).all()


def get_snapshot_by_name(session: Session, name: str) -> Snapshot | None:
    return session.scalars(select(Snapshot).where(Snapshot.name == name)).one_or_none()


def list_snapshots(
    session: Session,
    after_id: str | None,
    limit: int,
    source_volume_id: str | None = None,
) -> Sequence[Snapshot]:
    """Like ``list_volumes``; optionally only the snapshots of one source volume."""
    query = select(Snapshot).order_by(Snapshot.id).limit(limit)
    if after_id is not None:
        query = query.where(Snapshot.id > after_id)
    if source_volume_id is not None:
        query = query.where(Snapshot.source_volume_id == source_volume_id)
    return session.scalars(query).all()


def get_group_snapshot_by_name(session: Session, name: str) -> GroupSnapshot | None:
    return session.scalars(select(GroupSnapshot).where(GroupSnapshot.name == name)).one_or_none()


def group_members(session: Session, group_id: str) -> Sequence[Snapshot]:
    """The member snapshots of a group snapshot, by id."""
    query = select(Snapshot).where(Snapshot.group_snapshot_id == group_id).order_by(Snapshot.id)
    return session.scalars(query).all()


def get_publication(session: Session, volume_id: str, node_id: str) -> Publication | None:
    query = select(Publication).where(
        Publication.volume_id == volume_id, Publication.node_id == node_id
    )
    return session.scalars(query).one_or_none()


def publications_of(session: Session, volume_id: str) -> Sequence[Publication]:
    query = select(Publication).where(Publication.volume_id == volume_id).order_by(Publication.id)
    return session.scalars(query).all()


def record_operation(
    session: Session,
    kind: OperationKind,
    target_id: str,
    payload: dict[str, Any] | None = None,
) -> Operation:
    """Journal an intent (state pending); it is durable once the session commits."""
    operation = Operation(
        kind=kind,
        target_id=target_id,
        payload=payload if payload is not None else {},
        state=OperationState.PENDING,
        started_at=utcnow(),
    )
    session.add(operation)
    session.flush()  # assigns the id
    return operation


def finish_operation(operation: Operation, error: str | None = None) -> None:
    """Mark a journaled operation done, or failed with ``error``."""
    operation.state = OperationState.DONE if error is None else OperationState.FAILED
    operation.error = error
    operation.finished_at = utcnow()


def pending_operations(session: Session) -> Sequence[Operation]:
    """Operations begun and never finished (a crash came between), oldest first."""
    query = (
        select(Operation).where(Operation.state == OperationState.PENDING).order_by(Operation.id)
    )
    return session.scalars(query).all()
