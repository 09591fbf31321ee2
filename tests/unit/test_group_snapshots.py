"""Group snapshots in the storage service (backend/group_snapshot_ops.py).

A real catalog and a real pool directory (nbd images are plain files, copied
as the pool copies them); the exporter is a recorder, and the nfs members'
freeze is recorded around the pool's own method, so the order of the
barrier's steps can be checked: filesystems frozen, NBD I/O held and
images flushed, every member copied, then the hold released and the
filesystems thawed.  The barrier on real NBD connections is proven in
tests/integration/test_nbd_holds.py, and end to end in
tests/integration/test_csi_group_snapshots.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import URL, select

from backend.api.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from backend.catalog.db import Catalog
from backend.catalog.models import (
    FsType,
    GroupSnapshot,
    Operation,
    Snapshot,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.exporting import ExporterStatus
from backend.operation import ServiceConfig
from backend.pool import Pool
from backend.reconcile import _finish_operations
from backend.service import StorageService

MiB = 1 << 20
NBD_A = "a" * 32
NBD_B = "b" * 32
NFS_C = "c" * 32


class Recorder:
    """The exporter: records what the group snapshot asks of it, in ``events``."""

    def __init__(self, events: list[str], fail_hold: bool = False) -> None:
        self.events = events
        self.fail_hold = fail_hold
        self.held: list[tuple[str, list[Path]]] = []

    def hold_nbd_io(
        self, hold_id: str, images: Sequence[Path], lease: float, timeout: float
    ) -> None:
        assert 0 < timeout < lease
        if self.fail_hold:
            self.events.append("hold failed")
            raise Unavailable("NBD clients' I/O could not be held: a client stalled")
        self.held.append((hold_id, list(images)))
        self.events.append("hold")

    def release_nbd_io(self, hold_id: str) -> None:
        assert hold_id == self.held[-1][0]
        self.events.append("release")

    def status(self) -> ExporterStatus:
        return ExporterStatus(True, 0, 0)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the group snapshot called exporter.{name}")


@pytest.fixture
def events() -> list[str]:
    return []


@pytest.fixture
def service(
    tmp_path: Path, events: list[str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[StorageService]:
    catalog = Catalog(URL.create("sqlite", database=str(tmp_path / "catalog.sqlite3")))
    catalog.migrate()
    pool = Pool(tmp_path / "pool")
    pool.ensure_layout()
    for vol_id, marker in ((NBD_A, b"A"), (NBD_B, b"B"), (NFS_C, b"C")):
        pool.image_path(vol_id).write_bytes(marker * MiB)
    with catalog.session() as s:
        for vol_id, name, kind in ((NBD_A, "a", VolumeType.NBD), (NBD_B, "b", VolumeType.NBD)):
            s.add(
                Volume(
                    id=vol_id,
                    name=name,
                    type=kind,
                    size_bytes=MiB,
                    parameters={},
                    state=VolumeState.READY,
                )
            )
        s.add(
            Volume(
                id=NFS_C, name="c", type=VolumeType.NFS, size_bytes=MiB, fs_type=FsType.XFS,
                parameters={}, nfs_export_id=3, state=VolumeState.READY,
            )
        )  # fmt: skip

    @contextlib.contextmanager
    def frozen_together(volumes: Sequence[tuple[str, str]]) -> Iterator[None]:
        events.append(f"freeze {sorted(v for v, _ in volumes)}")
        try:
            yield
        finally:
            events.append("thaw")

    real_snapshot, real_flush = pool.snapshot, pool.flush_image

    def snapshot(vol_id: str, snap_id: str, fs_type: str | None) -> Path:
        assert fs_type is None, "a member is frozen by the group, not again by the copy"
        events.append(f"copy {vol_id[0]}")
        return real_snapshot(vol_id, snap_id, fs_type)

    def flush_image(vol_id: str) -> None:
        events.append(f"flush {vol_id[0]}")
        real_flush(vol_id)

    monkeypatch.setattr(pool, "frozen_together", frozen_together)
    monkeypatch.setattr(pool, "snapshot", snapshot)
    monkeypatch.setattr(pool, "flush_image", flush_image)
    svc = StorageService(catalog, pool, Recorder(events), ServiceConfig())
    try:
        yield svc
    finally:
        catalog.dispose()


def recorded(service: StorageService) -> tuple[int, int, list[str]]:
    """(group rows, snapshot rows, states of journal entries)."""
    with service.catalog.read_session() as s:
        groups = len(s.scalars(select(GroupSnapshot)).all())
        snaps = len(s.scalars(select(Snapshot)).all())
        ops = [o.state.value for o in s.scalars(select(Operation))]
    return groups, snaps, ops


def test_every_member_is_copied_inside_one_barrier(
    service: StorageService, events: list[str]
) -> None:
    g = service.create_group_snapshot("g1", [NBD_B, NFS_C, NBD_A])
    assert events == [
        f"freeze {[NFS_C]}",
        "hold",
        "flush b",
        "flush a",
        "copy b",
        "copy c",
        "copy a",
        "release",
        "thaw",
    ]
    exporter: Recorder = service.exporter  # type: ignore[assignment]
    assert exporter.held[0][1] == [service.pool.image_path(NBD_B), service.pool.image_path(NBD_A)]
    assert g.ready_to_use and g.state == "ready"
    assert [s.source_volume_id for s in g.snapshots] == [NBD_B, NFS_C, NBD_A]
    for snap, marker in zip(g.snapshots, b"BCA", strict=True):
        assert snap.ready_to_use and snap.group_snapshot_id == g.id
        assert service.pool.snapshot_path(snap.id).read_bytes() == bytes([marker]) * MiB
    listed, _ = service.list_snapshots(source_volume_id=NBD_A)
    assert [x.group_snapshot_id for x in listed] == [g.id]
    assert service.get_group_snapshot(g.id) == g


def test_the_same_request_again_is_the_same_group_and_another_is_refused(
    service: StorageService, events: list[str]
) -> None:
    g = service.create_group_snapshot("g1", [NBD_A, NBD_B])
    events.clear()
    assert service.create_group_snapshot("g1", [NBD_B, NBD_A]) == g
    assert events == []  # nothing taken twice
    with pytest.raises(AlreadyExists):
        service.create_group_snapshot("g1", [NBD_A])
    assert recorded(service) == (1, 2, ["done"])


def test_a_refused_request_records_nothing(service: StorageService, events: list[str]) -> None:
    with service.catalog.session() as s:
        v = s.get(Volume, NBD_B)
        assert v is not None
        v.state = VolumeState.EXPANDING
    for bad, error in (
        (("g", []), InvalidArgument),
        (("g", [NBD_A, NBD_A]), InvalidArgument),
        (("g", [NBD_A, "nope"]), InvalidArgument),
        (("bad name!", [NBD_A]), InvalidArgument),
        (("g", [NBD_A, "d" * 32]), NotFound),
        (("g", [NBD_A, NBD_B]), FailedPrecondition),
    ):
        with pytest.raises(error):
            service.create_group_snapshot(*bad)
    assert recorded(service) == (0, 0, [])
    assert events == []


def test_a_hold_not_reached_leaves_no_snapshot_and_thaws(
    service: StorageService, events: list[str]
) -> None:
    service.context.exporter.fail_hold = True  # type: ignore[attr-defined]
    with pytest.raises(Unavailable):
        service.create_group_snapshot("g1", [NBD_A, NFS_C])
    assert events == [f"freeze {[NFS_C]}", "hold failed", "thaw"]
    assert recorded(service) == (0, 0, ["failed"])
    assert service.pool.list_snapshot_images() == set()


def test_members_are_deleted_with_their_group_only(service: StorageService) -> None:
    g = service.create_group_snapshot("g1", [NBD_A, NBD_B])
    with pytest.raises(InvalidArgument, match="group"):
        service.delete_snapshot(g.snapshots[0].id)
    assert len(service.pool.list_snapshot_images()) == 2
    service.delete_group_snapshot(g.id)
    service.delete_group_snapshot(g.id)
    assert service.pool.list_snapshot_images() == set()
    assert recorded(service)[:2] == (0, 0)
    with pytest.raises(NotFound):
        service.get_group_snapshot(g.id)


def test_an_interrupted_group_is_taken_again_whole_at_start(
    service: StorageService, events: list[str]
) -> None:
    """A crash after the intent (and after one copy): reconcile takes every member
    again, so no member keeps a copy from another instant."""
    ops = service.group_snapshots
    ops.finish_group_snapshot = lambda group_id: None  # type: ignore[method-assign]
    g = service.create_group_snapshot("g1", [NBD_A, NBD_B])
    del ops.finish_group_snapshot  # the class's again
    assert g.state == "creating" and not g.ready_to_use
    first = g.snapshots[0].id
    service.pool.snapshot_path(first).write_bytes(b"old" * 100)  # a copy from before the crash
    service.pool.image_path(NBD_A).write_bytes(b"N" * MiB)  # written since
    events.clear()
    assert _finish_operations(service) == [f"finished interrupted create_group_snapshot of {g.id}"]
    done = service.get_group_snapshot(g.id)
    assert done.ready_to_use
    assert service.pool.snapshot_path(first).read_bytes() == b"N" * MiB
    assert events[:4] == ["freeze []", "hold", "flush a", "flush b"]
    assert events[-2:] == ["release", "thaw"]


def test_without_reflink_a_group_too_large_to_copy_within_the_lease_is_refused(
    service: StorageService, events: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each member here has 1 MiB allocated; with a limit of 2 MiB, three members
    are refused before anything is recorded or held, and two are taken."""
    from backend import group_snapshot_ops

    monkeypatch.setattr(group_snapshot_ops, "PLAIN_COPY_LIMIT", 2 * MiB)
    monkeypatch.setattr(service.pool, "supports_reflink", lambda: False)
    with pytest.raises(FailedPrecondition, match="cannot snapshot these volumes together"):
        service.create_group_snapshot("g1", [NBD_A, NBD_B, NFS_C])
    assert recorded(service) == (0, 0, [])
    assert events == []
    assert service.create_group_snapshot("g2", [NBD_A, NBD_B]).ready_to_use
    # With reflink the copies take no time to speak of: no limit.
    monkeypatch.setattr(service.pool, "supports_reflink", lambda: True)
    assert service.create_group_snapshot("g3", [NBD_A, NBD_B, NFS_C]).ready_to_use


def test_no_member_is_copied_once_the_lease_is_over(
    service: StorageService, events: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold takes its whole lease to be placed (a clock moved on by the
    exporter): the group fails before the first copy, not after the last."""
    from backend import group_snapshot_ops

    now = [1000.0]
    # The module's own clock only, not time.monotonic for everything else.
    monkeypatch.setattr(group_snapshot_ops, "time", SimpleNamespace(monotonic=lambda: now[0]))
    exporter: Recorder = service.exporter  # type: ignore[assignment]
    real_hold = exporter.hold_nbd_io

    def slow_hold(hold_id: str, images: Sequence[Path], lease: float, timeout: float) -> None:
        real_hold(hold_id, images, lease, timeout)
        now[0] += lease

    monkeypatch.setattr(exporter, "hold_nbd_io", slow_hold)
    with pytest.raises(Unavailable, match="lease"):
        service.create_group_snapshot("g1", [NBD_A, NBD_B, NFS_C])
    assert not [e for e in events if e.startswith("copy")]
    assert events[-2:] == ["release", "thaw"]
    assert recorded(service) == (0, 0, ["failed"])
    assert service.pool.list_snapshot_images() == set()


def test_a_delete_waits_for_a_create_taking_the_same_group_again(
    service: StorageService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group left CREATING is taken again by a second create; a delete that
    arrives while its members are copied runs after the create, not in the
    middle (it would remove files and rows under the copies)."""
    ops = service.group_snapshots
    ops.finish_group_snapshot = lambda group_id: None  # type: ignore[method-assign]
    g = service.create_group_snapshot("g1", [NBD_A, NBD_B])
    del ops.finish_group_snapshot
    copying = service.pool.snapshot
    deleter: list[threading.Thread] = []

    def snapshot(vol_id: str, snap_id: str, fs_type: str | None) -> Path:
        if not deleter:  # the first copy: a delete comes in now
            deleter.append(threading.Thread(target=service.delete_group_snapshot, args=(g.id,)))
            deleter[0].start()
            deleter[0].join(2)  # bounded: with the locks right it cannot end here
        return copying(vol_id, snap_id, fs_type)

    monkeypatch.setattr(service.pool, "snapshot", snapshot)
    again = service.create_group_snapshot("g1", [NBD_A, NBD_B])
    assert again.id == g.id and again.ready_to_use
    assert all(service.pool.snapshot_path(m.id).exists() for m in again.snapshots)
    deleter[0].join(30)
    assert not deleter[0].is_alive()
    with pytest.raises(NotFound):
        service.get_group_snapshot(g.id)
    assert recorded(service)[:2] == (0, 0)
    assert service.pool.list_snapshot_images() == set()
