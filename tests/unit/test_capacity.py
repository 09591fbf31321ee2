"""Capacity decisions of the storage service, with the pool mocked (issue 17).

The sizes promised may not pass pool size x overcommit, pending expansions
counted, whichever path asks (create, expand, the retry of an expansion that
did not finish); an nfs volume, whose image is fully allocated, also needs
that much real free space now.  Refusals are ResourceExhausted and record
nothing.  A real catalog (SQLite in tmp_path) holds the decisions; the pool
is a mock whose file work can be held at a gate, so that many decisions are
taken while none has finished: the storm below.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
from sqlalchemy import URL, func, select

from backend import pool as pool_module
from backend.api.errors import CommandFailed, ResourceExhausted
from backend.catalog.db import Catalog
from backend.catalog.models import Operation, OperationKind, OperationState, Volume, VolumeState
from backend.exporting import ExporterStatus
from backend.imagefiles import allocate
from backend.operation import ServiceConfig
from backend.pool import Pool, SpaceReservations
from backend.service import StorageService

MiB = 1 << 20
TOTAL = 100 * MiB
WAIT = 30.0  # every wait here is bounded by this


class Gate:
    """Holds the pool's file work until released; counts who got there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = 0
        self.release = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.entered += 1
        assert self.release.wait(WAIT), "the gate was never opened"


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[Catalog]:
    c = Catalog(URL.create("sqlite", database=str(tmp_path / "catalog.sqlite3")))
    c.migrate()
    try:
        yield c
    finally:
        c.dispose()


@pytest.fixture
def pool(tmp_path: Path) -> MagicMock:
    p = MagicMock(name="pool")
    p.root = tmp_path / "pool"
    p.capacity.return_value = (TOTAL, TOTAL)
    p.grows_online.return_value = True
    p.used_bytes.return_value = 0
    # an nfs image: the size plus 8 MiB of filesystem; growing: the difference
    p.fs_volume_needs.side_effect = lambda size, fs_type, source=None: size + 8 * MiB
    p.fs_growth_needs.side_effect = lambda vol_id, size, fs_type: 8 * MiB
    # the real bookkeeping of real free space, over the mocked capacity
    p.space = SpaceReservations()
    p.reserve_space.side_effect = functools.partial(Pool.reserve_space, p)
    p.release_space.side_effect = functools.partial(Pool.release_space, p)
    return p


def service_for(catalog: Catalog, pool: MagicMock, **config: Any) -> StorageService:
    exporter = MagicMock(name="exporter")
    exporter.status.return_value = ExporterStatus(True, 0, 0)
    return StorageService(catalog, pool, exporter, ServiceConfig(**config))


@pytest.fixture
def service(catalog: Catalog, pool: MagicMock) -> StorageService:
    return service_for(catalog, pool)


def provisioned(service: StorageService) -> int:
    with service.catalog.session() as s:
        return int(s.scalar(select(func.coalesce(func.sum(Volume.size_bytes), 0))) or 0)


def count(service: StorageService, what: Any) -> int:
    with service.catalog.session() as s:
        return int(s.scalar(select(func.count()).select_from(what)) or 0)


def run_threads(calls: list[Callable[[], object]], gate: Gate) -> list[BaseException | None]:
    """Run every call in a thread of its own; open ``gate`` once each has got to the
    pool or failed, so all decisions are taken before any file work ends."""
    outcomes: list[BaseException | None] = [None] * len(calls)
    done = threading.Semaphore(0)

    def one(i: int) -> None:
        try:
            calls[i]()
        except BaseException as e:  # collected, asserted by the caller
            outcomes[i] = e
        finally:
            done.release()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + WAIT
    while True:
        failed = sum(1 for o in outcomes if o is not None)
        with gate.lock:
            arrived = gate.entered
        if arrived + failed >= len(calls):
            break
        assert time.monotonic() < deadline, f"{arrived} at the gate, {failed} failed"
        time.sleep(0.01)
    gate.release.set()
    for t in threads:
        t.join(WAIT)
        assert not t.is_alive()
    return outcomes


# --- the overcommit decision -------------------------------------------------------


def test_a_pending_expansion_counts_in_the_capacity_used(
    service: StorageService, pool: MagicMock
) -> None:
    vol = service.create_volume("a", "nbd", 40 * MiB)
    pool.expand_block_image.side_effect = CommandFailed(["truncate"], 1, "I/O error")
    with pytest.raises(CommandFailed):
        service.expand_volume(vol.id, 90 * MiB)
    assert service.get_volume(volume_id=vol.id).state == "expanding"  # to be finished later

    cap = service.capacity()
    assert cap.provisioned_bytes == 90 * MiB  # the size it is growing to
    assert cap.available_bytes == 10 * MiB
    with pytest.raises(ResourceExhausted):
        service.create_volume("b", "nbd", 20 * MiB)
    assert service.create_volume("c", "nbd", 10 * MiB).state == "ready"
    assert count(service, Volume) == 2


def test_the_retry_of_an_expansion_is_held_to_the_capacity_too(
    service: StorageService, pool: MagicMock
) -> None:
    vol = service.create_volume("a", "nbd", 40 * MiB)
    pool.expand_block_image.side_effect = CommandFailed(["truncate"], 1, "I/O error")
    with pytest.raises(CommandFailed):
        service.expand_volume(vol.id, 60 * MiB)
    pool.expand_block_image.side_effect = None

    # asking an expanding volume for more than the pool holds is refused ...
    with pytest.raises(ResourceExhausted, match="available"):
        service.expand_volume(vol.id, 110 * MiB)
    assert service.get_volume(volume_id=vol.id).size_bytes == 40 * MiB
    # ... and for more within it, decided and counted like a new expansion
    assert service.expand_volume(vol.id, 100 * MiB).size_bytes == 100 * MiB
    assert service.capacity().available_bytes == 0
    with pytest.raises(ResourceExhausted):
        service.create_volume("b", "nbd", MiB)
    with service.catalog.session() as s:
        ops = s.scalars(select(Operation).where(Operation.kind == OperationKind.EXPAND_VOLUME))
        assert [o.state for o in ops] == [OperationState.DONE]


def test_a_concurrent_storm_of_expansions_and_creates_ends_within_the_cap(
    service: StorageService, pool: MagicMock
) -> None:
    volumes = [service.create_volume(f"v{i}", "nbd", MiB).id for i in range(12)]
    gate = Gate()
    pool.expand_block_image.side_effect = gate
    pool.create_block_image.side_effect = gate
    calls: list[Callable[[], object]] = []
    for i, vol_id in enumerate(volumes):  # 12 x +7 MiB wanted, 88 MiB left
        calls.append(functools.partial(service.expand_volume, vol_id, 8 * MiB))
        if i % 4 == 0:
            calls.append(functools.partial(service.create_volume, f"new{i}", "nbd", 3 * MiB))

    outcomes = run_threads(calls, gate)

    refused = [o for o in outcomes if o is not None]
    assert refused and all(isinstance(o, ResourceExhausted) for o in refused), refused
    assert provisioned(service) <= TOTAL
    assert service.capacity().provisioned_bytes == provisioned(service)
    # every slot a refusal left was too small for it: nothing was refused needlessly
    assert TOTAL - provisioned(service) < 7 * MiB
    with service.catalog.session() as s:
        states = set(s.scalars(select(Volume.state)))
    assert states == {VolumeState.READY}


# --- real free space for nfs images -------------------------------------------------


def test_an_nfs_volume_needs_real_free_space_and_a_refusal_records_nothing(
    service: StorageService, pool: MagicMock
) -> None:
    pool.capacity.return_value = (TOTAL, 30 * MiB)
    with pytest.raises(ResourceExhausted) as refused:
        service.create_volume("share", "nfs", 24 * MiB)
    message = str(refused.value)
    assert f"{32 * MiB} bytes needed" in message and f"{30 * MiB} bytes free" in message
    assert count(service, Volume) == 0 and count(service, Operation) == 0
    pool.create_fs_volume.assert_not_called()
    # nbd volumes stay thin: the same size is fine
    assert service.create_volume("blk", "nbd", 24 * MiB).state == "ready"
    # what fits is made
    assert service.create_volume("small", "nfs", 16 * MiB).state == "ready"
    pool.create_fs_volume.assert_called_once()


def test_growing_an_nfs_volume_needs_real_free_space(
    service: StorageService, pool: MagicMock
) -> None:
    vol = service.create_volume("share", "nfs", 16 * MiB)
    pool.capacity.return_value = (TOTAL, 4 * MiB)  # growing needs 8 MiB (the mock)
    with pytest.raises(ResourceExhausted, match="free"):
        service.expand_volume(vol.id, 32 * MiB)
    pool.expand_fs_volume.assert_not_called()
    got = service.get_volume(volume_id=vol.id)
    assert (got.state, got.size_bytes) == ("ready", 16 * MiB)


def test_a_growth_the_pool_then_has_no_room_for_leaves_the_volume_ready_as_it_was(
    service: StorageService, pool: MagicMock
) -> None:
    vol = service.create_volume("share", "nfs", 16 * MiB)
    # decided with room, then another writer took it: fallocate found the pool full
    pool.expand_fs_volume.side_effect = ResourceExhausted("the pool is out of space")
    with pytest.raises(ResourceExhausted):
        service.expand_volume(vol.id, 32 * MiB)
    got = service.get_volume(volume_id=vol.id)
    assert (got.state, got.size_bytes) == ("ready", 16 * MiB)
    assert service.capacity().provisioned_bytes == 16 * MiB  # nothing pending any more
    with service.catalog.session() as s:
        op = s.scalars(select(Operation).where(Operation.kind == OperationKind.EXPAND_VOLUME)).one()
        assert op.state == OperationState.FAILED and "out of space" in (op.error or "")


def test_concurrent_nfs_creates_cannot_count_the_same_free_space(
    service: StorageService, pool: MagicMock
) -> None:
    pool.capacity.return_value = (TOTAL, 50 * MiB)  # room for one 40 MiB image, not two
    gate = Gate()
    pool.create_fs_volume.side_effect = gate
    calls: list[Callable[[], object]] = [
        lambda: service.create_volume("one", "nfs", 32 * MiB),
        lambda: service.create_volume("two", "nfs", 32 * MiB),
    ]
    outcomes = run_threads(calls, gate)
    assert sorted(type(o).__name__ for o in outcomes) == ["NoneType", "ResourceExhausted"]
    assert count(service, Volume) == 1
    assert pool.space.held() == 0  # released once the image was made
    # and after it: free space is the pool's own again
    pool.create_fs_volume.side_effect = None
    assert service.create_volume("three", "nfs", 32 * MiB).state == "ready"


def test_an_allocation_ends_its_reservation_so_no_byte_is_counted_twice() -> None:
    """Concurrent creates whose images are being allocated while others decide
    (e.g. 50 xfs volumes from 16 threads) must not be refused for space that is
    both already allocated and still held."""
    space = SpaceReservations()
    free = [100 * MiB]
    a = space.reserve("a", 40 * MiB, lambda: free[0], "a")
    space.reserve("b", 40 * MiB, lambda: free[0], "b")
    with pytest.raises(ResourceExhausted, match=f"{80 * MiB} of them promised"):
        space.reserve("c", 40 * MiB, lambda: free[0], "c")
    with space.allocating("a"):  # a's image takes its 40 MiB
        free[0] -= 40 * MiB
    assert space.held() == 40 * MiB  # b's only: a's ended with its allocation
    space.reserve("c", 20 * MiB, lambda: free[0], "c")  # 60 free, 40 held by b
    space.release(a)  # a no-op after the allocation
    assert space.held() == 60 * MiB


# --- health ------------------------------------------------------------------------


def test_health_is_not_ok_but_still_serving_when_the_pool_is_low_on_space(
    catalog: Catalog, pool: MagicMock
) -> None:
    service = service_for(catalog, pool, low_space_percent=10)
    pool.capacity.return_value = (1000 * MiB, 50 * MiB)
    h = service.health()
    assert (h.ok, h.serving, h.low_space) == (False, True, True)
    assert f"pool low on space: {50 * MiB} bytes free (5.0% < 10%)" in h.message
    assert "still serving" in h.message

    pool.capacity.return_value = (1000 * MiB, 100 * MiB)  # at the threshold: fine
    h = service.health()
    assert (h.ok, h.serving, h.low_space, h.message) == (True, True, False, "ok")

    assert service_for(catalog, pool, low_space_percent=0).health().ok
    pool.capacity.return_value = (1000 * MiB, 0)
    assert not service_for(catalog, pool, low_space_percent=0.5).health().ok


def test_health_down_is_not_serving(catalog: Catalog, pool: MagicMock) -> None:
    service = service_for(catalog, pool)
    service.exporter.status.return_value = ExporterStatus(False, 0, 0)  # type: ignore[attr-defined]
    pool.capacity.return_value = (1000 * MiB, 10 * MiB)
    h = service.health()
    assert (h.ok, h.serving, h.low_space) == (False, False, True)
    assert "ganesha is not running" in h.message and "still serving" not in h.message


# --- ENOSPC from the allocation itself ------------------------------------------------


def test_an_allocation_the_pool_has_no_room_for_is_resource_exhausted_and_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        os.ftruncate(fd, offset + length // 2)  # as if half was allocated past the end
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    image = tmp_path / "image"
    image.write_bytes(b"x" * 4096)
    with pytest.raises(ResourceExhausted, match=f"{MiB} bytes needed"):
        allocate(image, 4096, MiB)
    assert image.stat().st_size == 4096  # as it was

    # a pool that runs out while making an nfs image leaves no file behind
    def not_reached(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("mkfs or mount after a failed allocation")

    monkeypatch.setattr(pool_module, "mkfs", not_reached)
    monkeypatch.setattr(pool_module, "mount_loop", not_reached)
    pool = Pool(tmp_path / "pool")
    with pytest.raises(ResourceExhausted):
        pool.create_fs_volume("a" * 32, 64 * MiB, "ext4")
    assert list(pool.volumes_dir.iterdir()) == []


def test_nfs_images_are_mounted_without_discard() -> None:
    assert "discard" not in pool_module.VOLUME_MOUNT_OPTIONS.split(",")
