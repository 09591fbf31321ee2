"""The tests every catalog database passes (``CatalogBehaviour``): a test class that
inherits them supplies the ``catalog_url`` fixture of its database."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import URL, delete, func, inspect, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, StatementError

import backend.catalog.migrations.versions as revisions
from backend.api.errors import FailedPrecondition
from backend.catalog.db import (
    Catalog,
    finish_operation,
    get_publication,
    get_snapshot_by_name,
    get_volume_by_name,
    list_snapshots,
    list_volumes,
    pending_operations,
    publications_of,
    record_operation,
)
from backend.catalog.models import (
    Base,
    FsType,
    Operation,
    OperationKind,
    OperationState,
    Publication,
    PublicationState,
    Snapshot,
    SnapshotState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.pool import Pool
from backend.poolidentity import (
    IdentityCheck,
    catalog_pool_id,
    check_pool_identity,
    read_pool_id,
    record_catalog_pool_id,
    write_pool_id,
)

LATEST_REVISION = max(
    p.name.split("_")[0] for p in Path(revisions.__file__).parent.glob("[0-9]*_*.py")
)
TABLES = {
    "volumes",
    "snapshots",
    "publications",
    "operations",
    "pool_identity",
    "group_snapshots",
    "alembic_version",
}


def new_id() -> str:
    return uuid.uuid4().hex


def make_volume(name: str, volume_id: str | None = None) -> Volume:
    return Volume(
        id=volume_id or new_id(),
        name=name,
        type=VolumeType.NFS,
        size_bytes=1 << 30,
        fs_type=FsType.XFS,
        parameters={"fsType": "xfs"},
    )


class CatalogBehaviour:
    """Tests every catalog database passes; a subclass provides ``catalog_url``."""

    @pytest.fixture
    def catalog_url(self) -> str | URL:
        raise NotImplementedError

    @pytest.fixture
    def empty_catalog(self, catalog_url: str | URL) -> Iterator[Catalog]:
        catalog = Catalog(catalog_url)
        try:
            yield catalog
        finally:
            catalog.dispose()

    @pytest.fixture
    def catalog(self, empty_catalog: Catalog) -> Catalog:
        empty_catalog.migrate()
        return empty_catalog

    def test_migrate_on_empty_database_is_idempotent(self, empty_catalog: Catalog) -> None:
        assert set(inspect(empty_catalog.engine).get_table_names()) == set()
        empty_catalog.migrate()
        empty_catalog.migrate()
        assert set(inspect(empty_catalog.engine).get_table_names()) == TABLES
        with empty_catalog.engine.connect() as connection:
            versions = connection.execute(text("SELECT version_num FROM alembic_version")).all()
        # The last revision in the migrations directory, whatever it is called.
        assert versions == [(LATEST_REVISION,)]

    def test_migration_creates_exactly_the_models_schema(self, catalog: Catalog) -> None:
        with catalog.engine.connect() as connection:
            differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert differences == []

    def test_migrate_leaves_logging_alone(self, empty_catalog: Catalog) -> None:
        bystander = logging.getLogger("moorage.test.bystander")
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        empty_catalog.migrate()
        assert root.handlers == handlers
        assert root.level == level
        assert not bystander.disabled

    def test_volume_round_trips(self, catalog: Catalog) -> None:
        volume_id = new_id()
        with catalog.session() as session:
            session.add(make_volume("pvc-1", volume_id))
        with catalog.session() as session:
            volume = get_volume_by_name(session, "pvc-1")
            assert volume is not None
            assert volume.id == volume_id
            assert volume.type is VolumeType.NFS
            assert volume.fs_type is FsType.XFS
            assert volume.state is VolumeState.CREATING
            assert volume.squash == "root_squash"
            assert volume.parameters == {"fsType": "xfs"}
            assert volume.size_bytes == 1 << 30
            assert volume.source_snapshot_id is None
            assert get_volume_by_name(session, "pvc-2") is None

    def test_timestamps_are_aware_utc(self, catalog: Catalog) -> None:
        local = datetime(2025, 6, 1, 17, 30, tzinfo=timezone(timedelta(hours=5)))
        with catalog.session() as session:
            volume = make_volume("pvc-1")
            volume.created_at = local
            session.add(volume)
        with catalog.session() as session:
            loaded = get_volume_by_name(session, "pvc-1")
            assert loaded is not None
            assert loaded.created_at.utcoffset() == timedelta(0)
            assert loaded.created_at == datetime(2025, 6, 1, 12, 30, tzinfo=UTC)

    def test_naive_timestamp_is_refused(self, catalog: Catalog) -> None:
        volume = make_volume("pvc-1")
        volume.created_at = datetime(2025, 6, 1, 12, 30)
        with pytest.raises(StatementError, match="naive datetime"), catalog.session() as session:
            session.add(volume)

    def test_volume_name_is_unique(self, catalog: Catalog) -> None:
        with catalog.session() as session:
            session.add(make_volume("pvc-1"))
        with pytest.raises(IntegrityError), catalog.session() as session:
            session.add(make_volume("pvc-1"))
        with catalog.session() as session:
            assert session.scalar(select(func.count()).select_from(Volume)) == 1

    def test_session_rolls_back_when_the_block_raises(self, catalog: Catalog) -> None:
        with pytest.raises(RuntimeError), catalog.session() as session:
            session.add(make_volume("pvc-1"))
            session.flush()
            raise RuntimeError("boom")
        with catalog.session() as session:
            assert get_volume_by_name(session, "pvc-1") is None

    def test_publication_is_unique_per_volume_and_node(self, catalog: Catalog) -> None:
        volume_id = new_id()
        with catalog.session() as session:
            session.add(make_volume("pvc-1", volume_id))
            session.flush()
            session.add(Publication(volume_id=volume_id, node_id="n1", node_address="10.0.0.1"))
            session.add(Publication(volume_id=volume_id, node_id="n2", node_address="10.0.0.2"))
        with pytest.raises(IntegrityError), catalog.session() as session:
            session.add(Publication(volume_id=volume_id, node_id="n1", node_address="10.0.0.9"))
        with catalog.session() as session:
            publications = publications_of(session, volume_id)
            assert [p.node_id for p in publications] == ["n1", "n2"]
            assert all(p.state is PublicationState.PUBLISHING for p in publications)
            assert all(p.read_only is False for p in publications)
            first = get_publication(session, volume_id, "n1")
            assert first is not None and first.node_address == "10.0.0.1"
            assert get_publication(session, volume_id, "n3") is None

    def test_publication_needs_an_existing_volume(self, catalog: Catalog) -> None:
        with pytest.raises(IntegrityError), catalog.session() as session:
            session.add(Publication(volume_id=new_id(), node_id="n1", node_address="10.0.0.1"))

    def test_published_volume_row_cannot_be_deleted(self, catalog: Catalog) -> None:
        volume_id = new_id()
        with catalog.session() as session:
            session.add(make_volume("pvc-1", volume_id))
            session.flush()
            session.add(Publication(volume_id=volume_id, node_id="n1", node_address="10.0.0.1"))
        with pytest.raises(IntegrityError), catalog.session() as session:
            session.execute(delete(Volume).where(Volume.id == volume_id))

    def test_snapshot_survives_deletion_of_its_source_volume(self, catalog: Catalog) -> None:
        volume_id, snapshot_id = new_id(), new_id()
        with catalog.session() as session:
            session.add(make_volume("pvc-1", volume_id))
            session.add(
                Snapshot(
                    id=snapshot_id,
                    name="snap-1",
                    source_volume_id=volume_id,
                    volume_type=VolumeType.NFS,
                    fs_type=FsType.XFS,
                    size_bytes=1 << 30,
                    state=SnapshotState.READY,
                )
            )
        with catalog.session() as session:
            volume = session.get(Volume, volume_id)
            assert volume is not None
            session.delete(volume)
        with catalog.session() as session:
            assert session.get(Volume, volume_id) is None
            snapshot = get_snapshot_by_name(session, "snap-1")
            assert snapshot is not None
            assert snapshot.id == snapshot_id
            assert snapshot.source_volume_id == volume_id
            assert snapshot.state is SnapshotState.READY
            # A clone may name a snapshot whose source is gone.
            clone = make_volume("pvc-clone")
            clone.source_snapshot_id = snapshot_id
            session.add(clone)

    def test_volume_pages_by_token_list_each_once_in_id_order(self, catalog: Catalog) -> None:
        ids = [new_id() for _ in range(25)]
        with catalog.session() as session:
            session.add_all(make_volume(f"pvc-{i}", volume_id) for i, volume_id in enumerate(ids))
        seen: list[str] = []
        sizes: list[int] = []
        token: str | None = None
        while True:
            with catalog.session() as session:
                page = list_volumes(session, after_id=token, limit=10)
            if not page:
                break
            sizes.append(len(page))
            seen.extend(v.id for v in page)
            token = page[-1].id
        assert sizes == [10, 10, 5]
        assert seen == sorted(ids)

    def test_snapshot_pages_by_token_and_by_source(self, catalog: Catalog) -> None:
        sources = [new_id(), new_id()]
        ids = [new_id() for _ in range(7)]
        with catalog.session() as session:
            session.add_all(
                Snapshot(
                    id=snapshot_id,
                    name=f"snap-{i}",
                    source_volume_id=sources[i % 2],
                    volume_type=VolumeType.NBD,
                    size_bytes=4096,
                )
                for i, snapshot_id in enumerate(ids)
            )
        seen: list[str] = []
        token: str | None = None
        with catalog.session() as session:
            while page := list_snapshots(session, after_id=token, limit=3):
                seen.extend(s.id for s in page)
                token = page[-1].id
            of_first = list_snapshots(session, None, 100, source_volume_id=sources[0])
        assert seen == sorted(ids)
        assert [s.id for s in of_first] == sorted(ids[0::2])

    def test_operation_journal_round_trip(self, catalog: Catalog) -> None:
        volume_id = new_id()
        with catalog.session() as session:
            create = record_operation(
                session, OperationKind.CREATE_VOLUME, volume_id, {"size_bytes": 1 << 30}
            )
            expand = record_operation(session, OperationKind.EXPAND_VOLUME, volume_id)
            publish = record_operation(session, OperationKind.PUBLISH, volume_id, {"node": "n1"})
            create_id, expand_id, publish_id = create.id, expand.id, publish.id
        with catalog.session() as session:
            pending = pending_operations(session)
            assert [op.id for op in pending] == [create_id, expand_id, publish_id]
            assert pending[0].payload == {"size_bytes": 1 << 30}
            assert pending[0].kind is OperationKind.CREATE_VOLUME
            assert pending[0].finished_at is None
            assert pending[1].payload == {}
            finish_operation(pending[0])
            finish_operation(pending[1], error="resize2fs failed")
        with catalog.session() as session:
            assert [op.id for op in pending_operations(session)] == [publish_id]
            done = session.get(Operation, create_id)
            failed = session.get(Operation, expand_id)
            assert done is not None and failed is not None
            assert done.state is OperationState.DONE and done.error is None
            assert failed.state is OperationState.FAILED
            assert failed.error == "resize2fs failed"
            assert done.finished_at is not None
            assert done.finished_at.tzinfo is not None
            assert done.finished_at >= done.started_at

    def test_concurrent_sessions_from_eight_threads_all_land(self, catalog: Catalog) -> None:
        threads, per_thread = 8, 10
        start = threading.Barrier(threads)
        errors: list[BaseException] = []

        def insert(worker: int) -> None:
            try:
                start.wait(timeout=30)
                for i in range(per_thread):
                    name = f"pvc-{worker}-{i}"
                    # Read, then write: the service's shape of a unit of work.
                    with catalog.session() as session:
                        assert get_volume_by_name(session, name) is None
                        session.add(make_volume(name))
            except BaseException as e:
                errors.append(e)

        workers = [threading.Thread(target=insert, args=(w,)) for w in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert errors == []
        with catalog.session() as session:
            names = set(session.scalars(select(Volume.name)))
        assert names == {f"pvc-{w}-{i}" for w in range(threads) for i in range(per_thread)}

    def test_a_read_does_not_wait_for_a_writer_and_sees_the_last_commit(
        self, catalog: Catalog
    ) -> None:
        with catalog.session() as session:
            session.add(make_volume("pvc-committed"))
        writing, finish = threading.Event(), threading.Event()
        errors: list[BaseException] = []
        seen: list[str] = []

        def write() -> None:
            try:
                with catalog.session() as session:
                    session.add(make_volume("pvc-in-flight"))
                    session.flush()  # written, and the write transaction held open
                    writing.set()
                    finish.wait(timeout=60)
            except BaseException as e:
                errors.append(e)
                writing.set()

        def read() -> None:
            try:
                with catalog.read_session() as session:
                    seen.extend(session.scalars(select(Volume.name)))
            except BaseException as e:
                errors.append(e)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            assert writing.wait(timeout=30)
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(timeout=30)  # failure detection only: a read waits for nothing
            assert not reader.is_alive(), "the read waited for the write session"
        finally:
            finish.set()
            writer.join(timeout=60)
        assert errors == []
        assert seen == ["pvc-committed"]
        with catalog.read_session() as session:
            assert set(session.scalars(select(Volume.name))) == {"pvc-committed", "pvc-in-flight"}

    def test_a_read_session_cannot_write(self, catalog: Catalog) -> None:
        with pytest.raises(DBAPIError), catalog.read_session() as session:
            session.add(make_volume("pvc-1"))
        with catalog.read_session() as session:
            assert get_volume_by_name(session, "pvc-1") is None

    # pool identity (backend/poolidentity.py): on every catalog database

    def test_a_fresh_pool_and_catalog_are_paired_once(
        self, catalog: Catalog, tmp_path: Path
    ) -> None:
        pool = Pool(tmp_path / "pool")
        pool.ensure_layout()
        first = check_pool_identity(catalog, pool)
        assert first.recorded_now
        assert read_pool_id(pool.root) == catalog_pool_id(catalog) == first.pool_id
        again = check_pool_identity(catalog, pool)
        assert again == IdentityCheck(first.pool_id, recorded_now=False)

    def test_a_catalog_of_another_pool_is_refused_unless_claimed(
        self, catalog: Catalog, tmp_path: Path
    ) -> None:
        pool = Pool(tmp_path / "pool")
        pool.ensure_layout()
        write_pool_id(pool.root, "a" * 32)
        record_catalog_pool_id(catalog, "b" * 32)
        with pytest.raises(FailedPrecondition, match=r"belongs to pool b{32}.*--claim-pool"):
            check_pool_identity(catalog, pool)
        assert catalog_pool_id(catalog) == "b" * 32  # nothing changed by the refusal
        claimed = check_pool_identity(catalog, pool, claim=True)
        assert claimed.pool_id == catalog_pool_id(catalog) == read_pool_id(pool.root) == "a" * 32

    def test_an_empty_catalog_on_a_pool_with_images_is_refused(
        self, catalog: Catalog, tmp_path: Path
    ) -> None:
        pool = Pool(tmp_path / "pool")
        pool.ensure_layout()
        pool.image_path(new_id()).write_bytes(b"data")
        with pytest.raises(FailedPrecondition, match=r"new or empty.*1 volume images"):
            check_pool_identity(catalog, pool)
        assert catalog_pool_id(catalog) is None and read_pool_id(pool.root) is None
        check_pool_identity(catalog, pool, claim=True)
        assert catalog_pool_id(catalog) == read_pool_id(pool.root) is not None

    def test_a_pool_without_its_marker_is_refused(self, catalog: Catalog, tmp_path: Path) -> None:
        # e.g. the pool's filesystem is not mounted: an empty directory in its place
        pool = Pool(tmp_path / "pool")
        pool.ensure_layout()
        record_catalog_pool_id(catalog, "c" * 32)
        with catalog.session() as s:
            s.add(make_volume("pvc-1"))
        with pytest.raises(FailedPrecondition, match=r"no moorage-pool\.json.*mounted"):
            check_pool_identity(catalog, pool)
        assert read_pool_id(pool.root) is None
