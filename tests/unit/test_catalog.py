"""The catalog's behaviour on SQLite (WAL, in tmp_path): the tests every database must
pass (``CatalogBehaviour``, from ``tests/catalog_behaviour.py``) and SQLite's own."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import URL, inspect

from backend.catalog.db import CATALOG_FILE, Catalog, get_volume_by_name
from tests.catalog_behaviour import CatalogBehaviour, make_volume


class TestSQLiteCatalog(CatalogBehaviour):
    @pytest.fixture
    def catalog_url(self, tmp_path: Path) -> str | URL:
        return f"sqlite:///{tmp_path}/catalog.sqlite3"

    def test_connections_use_wal_full_sync_foreign_keys_and_busy_timeout(
        self, catalog: Catalog
    ) -> None:
        with catalog.engine.connect() as connection:

            def pragma(name: str) -> object:
                return connection.exec_driver_sql(f"PRAGMA {name}").scalar()

            assert pragma("journal_mode") == "wal"
            assert pragma("synchronous") == 2  # FULL
            assert pragma("foreign_keys") == 1
            assert pragma("busy_timeout") == 10_000

    def test_for_data_dir_keeps_the_catalog_in_the_data_dir(self, tmp_path: Path) -> None:
        data_dir = tmp_path / "data dir with space"
        data_dir.mkdir()
        catalog = Catalog.for_data_dir(data_dir)
        try:
            catalog.migrate()
            with catalog.session() as session:
                session.add(make_volume("pvc-1"))
        finally:
            catalog.dispose()
        assert (data_dir / CATALOG_FILE).is_file()
        reopened = Catalog.for_data_dir(data_dir)
        try:
            reopened.migrate()
            with reopened.session() as session:
                assert get_volume_by_name(session, "pvc-1") is not None
        finally:
            reopened.dispose()

    def test_migrate_runs_from_any_working_directory(
        self, empty_catalog: Catalog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        empty_catalog.migrate()
        assert "volumes" in inspect(empty_catalog.engine).get_table_names()


def modes(data_dir: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in data_dir.glob(f"{CATALOG_FILE}*")}


def test_the_catalog_and_its_wal_and_shm_are_private_to_their_owner(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)  # what would make them world-readable
    try:
        catalog = Catalog.for_data_dir(tmp_path)
        try:
            catalog.migrate()
            with catalog.session() as session:
                session.add(make_volume("pvc-private"))
            with catalog.engine.connect():  # open: the -wal and -shm are there
                found = modes(tmp_path)
        finally:
            catalog.dispose()
    finally:
        os.umask(old_umask)
    assert set(found) == {CATALOG_FILE, f"{CATALOG_FILE}-wal", f"{CATALOG_FILE}-shm"}
    assert found == dict.fromkeys(found, 0o600)


def test_a_world_readable_catalog_is_made_private_at_start(tmp_path: Path) -> None:
    catalog = Catalog.for_data_dir(tmp_path)
    catalog.migrate()
    catalog.dispose()
    (tmp_path / CATALOG_FILE).chmod(0o644)
    (tmp_path / f"{CATALOG_FILE}-wal").touch(0o644)  # an empty log: nothing to replay
    reopened = Catalog.for_data_dir(tmp_path)
    try:
        assert modes(tmp_path) == {CATALOG_FILE: 0o600, f"{CATALOG_FILE}-wal": 0o600}
        reopened.migrate()
    finally:
        reopened.dispose()


def test_a_downgrade_below_group_snapshots_leaves_no_journal_row_0004_cannot_load(
    tmp_path: Path,
) -> None:
    """0005 -> 0004: refused while a group operation is pending (nothing changed);
    otherwise the finished group operations go, and the others stay."""
    from alembic import command
    from sqlalchemy import text

    from backend.catalog.models import Operation, OperationKind, OperationState

    catalog = Catalog(URL.create("sqlite", database=str(tmp_path / "c.sqlite3")))
    try:
        catalog.migrate()
        with catalog.session() as s:
            for kind, state in (
                (OperationKind.CREATE_GROUP_SNAPSHOT, OperationState.PENDING),
                (OperationKind.DELETE_GROUP_SNAPSHOT, OperationState.DONE),
                (OperationKind.CREATE_SNAPSHOT, OperationState.DONE),
            ):
                s.add(Operation(kind=kind, target_id="t", payload={}, state=state))

        def downgrade() -> None:
            with catalog.engine.begin() as connection:
                command.downgrade(catalog._alembic_config(connection), "0004")

        def kinds() -> list[str]:
            with catalog.engine.connect() as connection:
                return sorted(connection.scalars(text("select kind from operations")))

        with pytest.raises(RuntimeError, match="1 group snapshot operations are pending"):
            downgrade()
        assert "group_snapshots" in inspect(catalog.engine).get_table_names()
        assert kinds() == ["create_group_snapshot", "create_snapshot", "delete_group_snapshot"]
        with catalog.engine.begin() as connection:
            connection.execute(text("update operations set state = 'done'"))
        downgrade()
        assert "group_snapshots" not in inspect(catalog.engine).get_table_names()
        assert kinds() == ["create_snapshot"]
    finally:
        catalog.dispose()
