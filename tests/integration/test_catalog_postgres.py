"""The catalog's behaviour on PostgreSQL: the SQLite tests, run against a real server.

A throwaway cluster is made for the session with the Debian server binaries
(``initdb`` as the ``postgres`` user, since it refuses root), listening only
on a unix socket in a private directory; each test gets a fresh database.
The cluster is stopped and its directory removed at the end, also when set-up
or a test fails.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import URL

from backend.catalog.db import Catalog
from tests.catalog_behaviour import CatalogBehaviour

PG_USER = "postgres"
PG_PORT = 5432  # names the socket file only; the socket directory is private
_database_numbers = itertools.count()


def postgres_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/N/bin`` with initdb and pg_ctl."""
    candidates = [
        path.parent
        for path in Path("/usr/lib/postgresql").glob("*/bin/initdb")
        if (path.parent / "pg_ctl").exists()
    ]
    if not candidates:
        raise RuntimeError(
            "PostgreSQL server binaries not found under /usr/lib/postgresql "
            "(deploy/host/install-deps.sh installs them)"
        )
    return max(candidates, key=lambda p: int(p.parent.name))


def run_as_postgres(argv: list[str], cwd: Path, timeout: float = 60) -> None:
    """Run a server tool as the postgres user; fail with its output."""
    result = subprocess.run(
        ["runuser", "-u", PG_USER, "--", *argv],
        cwd=cwd,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{argv} exited {result.returncode}: "
            f"{result.stderr.decode(errors='replace')}{result.stdout.decode(errors='replace')}"
        )


@dataclass(frozen=True)
class Cluster:
    socket_dir: Path
    port: int

    def url(self, database: str) -> URL:
        return URL.create(
            "postgresql+psycopg",
            username=PG_USER,
            database=database,
            query={"host": str(self.socket_dir), "port": str(self.port)},
        )

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host=str(self.socket_dir),
            port=self.port,
            user=PG_USER,
            dbname="postgres",
            autocommit=True,
        )


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    bindir = postgres_bindir()
    entry = pwd.getpwnam(PG_USER)
    root = Path(tempfile.mkdtemp(prefix="moorage-pg-"))
    data, sockets, log = root / "data", root / "sock", root / "server.log"
    started = False
    try:
        os.chown(root, entry.pw_uid, entry.pw_gid)
        sockets.mkdir(mode=0o700)
        os.chown(sockets, entry.pw_uid, entry.pw_gid)
        run_as_postgres(
            [
                str(bindir / "initdb"),
                "-D", str(data),
                "-U", PG_USER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ],
            cwd=root,
        )  # fmt: skip
        # Throwaway data: no fsync. Unix socket only, no TCP listener.
        options = shlex.join(
            [
                "-k", str(sockets),
                "-p", str(PG_PORT),
                "-c", "listen_addresses=",
                "-c", "fsync=off",
                "-c", "full_page_writes=off",
            ]
        )  # fmt: skip
        started = True  # from here on, try to stop it whatever happens
        pg_ctl = str(bindir / "pg_ctl")
        run_as_postgres(
            [pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "start"], root
        )
        yield Cluster(socket_dir=sockets, port=PG_PORT)
    finally:
        try:
            if started and (data / "postmaster.pid").exists():
                run_as_postgres(
                    [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], root
                )
        finally:
            shutil.rmtree(root, ignore_errors=True)


class TestPostgresCatalog(CatalogBehaviour):
    @pytest.fixture
    def catalog_url(self, postgres_cluster: Cluster) -> Iterator[str | URL]:
        database = f"catalog_{os.getpid()}_{next(_database_numbers)}"
        with postgres_cluster.admin() as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        try:
            yield postgres_cluster.url(database)
        finally:
            with postgres_cluster.admin() as admin:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(database)
                    )
                )

    def test_runs_on_postgresql(self, catalog: Catalog) -> None:
        # Guards the fixture: these tests must not quietly run on another database.
        assert catalog.engine.dialect.name == "postgresql"
        with catalog.engine.connect() as connection:
            version = connection.exec_driver_sql("SHOW server_version_num").scalar()
            tcp = connection.exec_driver_sql("SHOW listen_addresses").scalar()
        assert int(str(version)) >= 150000
        assert tcp == ""  # the throwaway cluster listens on its unix socket only
