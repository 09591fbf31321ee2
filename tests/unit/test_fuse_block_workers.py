"""The FUSE block file where more than one process serves the mount (``--workers``),
and the failure paths of its completion callbacks, without a kernel or a server.

- A FSYNC or FLUSH sends an NBD FLUSH whenever other processes serve the mount:
  the kernel may have given the writes to another process than the FSYNC.
- A worker acknowledges a refresh only once it has reconnected, tries again a few
  times, and the refresh fails with EIO when a live worker never acknowledged it.
- A worker stops (and none replaces it) once multi-conn is withdrawn.
- A completion callback that raises while a connection dies does not strand the
  other requests in flight; a request that cannot get a task fails with EIO.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

from fuse import blockfile
from fuse import fuseproto as fp
from fuse.blockfile import (
    DISK_INODE,
    REFRESH_TRIES,
    BlockFile,
    FuseError,
    SharedSize,
    Workers,
    announce_refresh,
    follow_refreshes,
    leave_when_single,
)
from fuse.nbdconnections import ExportConnections, ExportUnavailable, _Slot
from fuse.process import ABANDON_AFTER
from nbd.aio import _PENDING, AioConnection, _Callback
from nbd.libnbd import NBDError
from tests.unit.test_fuse_proto import Replies, init_body, request, send


class FlushCountingExport:
    """What BlockFile asks of an export, counting FLUSHes; refreshes fail ``failures`` times."""

    def __init__(self, size: int = 1 << 30, failures: int = 0) -> None:
        self.size = size
        self.read_only = False
        self.can_zero = True
        self.flushes = 0
        self.refreshes = 0
        self.failures = failures
        self.new_size = size

    def ready_connection(self) -> None:
        return None

    def answer_of(self, conn: object, error: int) -> bool:
        return False  # the connection was lost: the request is to be sent again

    async def flush(self) -> None:
        self.flushes += 1

    async def refresh(self) -> int:
        self.refreshes += 1
        if self.refreshes <= self.failures:
            raise ExportUnavailable("nbd://test: no connection")
        self.size = self.new_size
        return self.size


@pytest.fixture
def shared() -> Iterator[SharedSize]:
    s = SharedSize.create(1 << 30)
    try:
        yield s
    finally:
        s.close()


def mounted(export: FlushCountingExport, replies: Replies) -> tuple[BlockFile, int]:
    """A BlockFile past FUSE_INIT with ``disk`` open: (the file system, the handle)."""
    filesystem = BlockFile(export, write=replies)  # type: ignore[arg-type]
    send(filesystem, request(fp.INIT, 1, init_body()))
    send(filesystem, request(fp.OPEN, 2, fp.OPEN_IN.pack(os.O_RDWR, 0), nodeid=DISK_INODE))
    error, _, body = replies.last()
    assert error == 0
    return filesystem, fp.OPEN_OUT.unpack(body)[0]


# ------------------------------------------------------------------ fsync and workers


@pytest.mark.parametrize("opcode", [fp.FSYNC, fp.FLUSH])
async def test_a_sync_flushes_when_another_process_may_have_written(
    shared: SharedSize, opcode: int
) -> None:
    """This process wrote nothing, but another serving the mount may have: FLUSH."""
    export, replies = FlushCountingExport(), Replies()
    filesystem, fh = mounted(export, replies)
    filesystem.shared = shared
    body = fp.FSYNC_IN.pack(fh, 0, 0) if opcode == fp.FSYNC else fp.FLUSH_IN.pack(fh, 0, 0, 0)
    async with trio.open_nursery() as nursery:
        filesystem._later = nursery.start_soon
        send(filesystem, request(opcode, 10, body, nodeid=DISK_INODE))
    assert replies.last() == (0, 10, b"")
    assert export.flushes == 1
    # the final flush of a process that wrote nothing is sent too
    await filesystem.sync()
    assert export.flushes == 2


async def test_alone_a_sync_without_writes_needs_no_flush() -> None:
    """One process serves the mount: it knows every write, none is unflushed."""
    export, replies = FlushCountingExport(), Replies()
    filesystem, fh = mounted(export, replies)
    async with trio.open_nursery() as nursery:
        filesystem._later = nursery.start_soon
        send(filesystem, request(fp.FSYNC, 10, fp.FSYNC_IN.pack(fh, 0, 0), nodeid=DISK_INODE))
    assert replies.last() == (0, 10, b"")
    assert export.flushes == 0


def test_a_worker_waits_for_its_final_flush() -> None:
    """The mounting process does not kill a worker that is still in its final flush."""
    assert blockfile.WORKER_STOP_TIMEOUT > ABANDON_AFTER + blockfile.FINAL_FLUSH_TIMEOUT


# ------------------------------------------------------------------ refreshes


async def test_a_failed_refresh_is_retried_and_acknowledged_only_once_it_worked(
    shared: SharedSize, autojump_clock: trio.testing.MockClock
) -> None:
    export = FlushCountingExport(failures=REFRESH_TRIES - 1)
    export.new_size = 2 << 30
    filesystem = BlockFile(export, write=Replies())  # type: ignore[arg-type]
    acks: list[tuple[int, bool]] = []
    original_ack = shared.ack

    def ack(index: int, generation: int) -> None:
        acks.append((generation, export.size == export.new_size))
        original_ack(index, generation)

    shared.ack = ack  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_refreshes, filesystem, shared, 1)
        await trio.sleep(1)
        shared.publish(1, 2 << 30)
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    assert export.refreshes == REFRESH_TRIES
    assert (1, True) in acks and (1, False) not in acks
    assert shared.acked(1) == 1


async def test_a_refresh_that_keeps_failing_is_not_acknowledged(
    shared: SharedSize, autojump_clock: trio.testing.MockClock
) -> None:
    export = FlushCountingExport(failures=1000)
    export.new_size = 2 << 30
    filesystem = BlockFile(export, write=Replies())  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_refreshes, filesystem, shared, 1)
        await trio.sleep(1)
        assert shared.acked(1) == 0  # generation 0, size unchanged: acknowledged as is
        shared.publish(1, 2 << 30)
        await trio.sleep(600)
        nursery.cancel_scope.cancel()
    assert export.refreshes == REFRESH_TRIES  # bounded
    assert shared.acked(1) == 0


async def test_a_refresh_fails_when_a_live_worker_did_not_acknowledge(
    shared: SharedSize, autojump_clock: trio.testing.MockClock
) -> None:
    with pytest.raises(FuseError) as caught:
        await announce_refresh(shared, 0, 3, 2 << 30, lambda index: True, wait=5.0)
    assert caught.value.errno == errno.EIO
    assert shared.acked(0) == 1


async def test_a_refresh_does_not_wait_for_dead_workers_or_those_that_acknowledged(
    shared: SharedSize, autojump_clock: trio.testing.MockClock
) -> None:
    async def acknowledge() -> None:
        await trio.sleep(1)
        shared.ack(1, 1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(acknowledge)
        await announce_refresh(shared, 0, 3, 2 << 30, lambda index: index != 2, wait=5.0)
    assert shared.read() == (1, 2 << 30)


async def test_a_refresh_write_fails_with_eio_when_a_worker_did_not_follow(
    shared: SharedSize, autojump_clock: trio.testing.MockClock
) -> None:
    """The write to ``refresh`` itself gets EIO, and the kernel's size is dropped anyway."""
    export, replies = FlushCountingExport(), Replies()
    filesystem, _ = mounted(export, replies)
    filesystem.shared = shared

    async def refreshed(size: int) -> None:
        await announce_refresh(shared, 0, 2, size, lambda index: True, wait=5.0)

    filesystem.after_refresh = refreshed
    opened = fp.OPEN_IN.pack(os.O_WRONLY, 0)
    send(filesystem, request(fp.OPEN, 3, opened, nodeid=blockfile.REFRESH_INODE))
    fh = fp.OPEN_OUT.unpack(replies.last()[2])[0]
    async with trio.open_nursery() as nursery:
        filesystem._later = nursery.start_soon
        send(filesystem, request(fp.WRITE, 11, fp.WRITE_IN.pack(fh, 0, 1, 0, 0, 0, 0) + b"1"))
    assert replies.last()[:2] == (errno.EIO, 11)
    invalidations = [w for w in replies.written if fp.OUT_HEADER.unpack_from(w)[2] == 0]
    assert invalidations  # the size the kernel cached is dropped all the same


# ------------------------------------------------------------------ multi-conn withdrawn


def test_a_withdrawn_multi_conn_is_told(shared: SharedSize) -> None:
    export = ExportConnections.__new__(ExportConnections)
    export.uri, export.size, export.multi_conn = "nbd://test", 1 << 30, True
    export.on_multi_conn_withdrawn = shared.make_single
    export._note(_Slot(None, 1 << 30, True))
    assert not shared.single
    export._note(_Slot(None, 1 << 30, False))
    assert shared.single and not export.multi_conn


async def test_a_worker_stops_once_multi_conn_is_withdrawn(
    shared: SharedSize, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signals.append((pid, sig)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leave_when_single, shared, 1)
        await trio.sleep(5)
        assert signals == []
        shared.make_single()
        await trio.sleep(1)
    assert signals == [(os.getpid(), signal.SIGTERM)]


async def test_no_worker_is_started_once_multi_conn_is_withdrawn(
    shared: SharedSize, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = Workers(["true"], -1, 2, shared)
    started: list[int] = []
    monkeypatch.setattr(workers, "start", started.append)
    shared.make_single()
    with trio.fail_after(5):
        await workers.watch(1)
    assert started == []


# ------------------------------------------------------------------ callbacks that fail


def test_a_raising_callback_does_not_strand_the_other_requests() -> None:
    conn = AioConnection.__new__(AioConnection)
    conn.error = None
    conn._write_wanted = trio.Event()
    conn._in_flight = 0
    conn._ids = {}
    answered: list[int] = []

    def boom(error: int) -> None:
        raise RuntimeError("Nursery is closed to new arrivals")

    callbacks = [boom, answered.append, boom, answered.append]
    idents = [-(1000 + i) for i in range(len(callbacks))]  # not ids libnbd uses
    try:
        for ident, done in zip(idents, callbacks, strict=True):
            _PENDING[ident] = _Callback(conn, None, done)
            conn._ids[ident] = 0.0
            conn._in_flight += 1
        conn._die(NBDError("connection closed", errno.ENOTCONN))
        assert answered == [errno.ENOTCONN, errno.ENOTCONN]
        assert conn._in_flight == 0 and not conn._ids
    finally:
        for ident in idents:
            _PENDING.pop(ident, None)


def test_a_request_without_a_task_fails_with_eio() -> None:
    """A read sent from a completion callback met a lost connection and needs a task to
    be sent again, but the nursery is closed (the loop is ending): EIO, nothing raised
    into the callback that called."""
    export, replies = FlushCountingExport(), Replies()
    filesystem, _ = mounted(export, replies)

    def closed(fn: Any) -> None:
        raise RuntimeError("Nursery is closed to new arrivals")

    async def again(conn: Any) -> None:
        raise AssertionError("not sent again")

    filesystem._later = closed
    filesystem.busy += 1  # the request was taken
    filesystem._failed(12, None, errno.ENOTCONN, "read", again)  # type: ignore[arg-type]
    assert replies.last() == (errno.EIO, 12, b"")
    assert filesystem.busy == 0


def test_workers_are_sent_sigterm_once(shared: SharedSize) -> None:
    """A second SIGTERM would make a worker abandon its requests and its final flush."""

    class Proc:
        pid = 1
        sent: list[int] = []

        def poll(self) -> None:
            return None

        def send_signal(self, sig: int) -> None:
            self.sent.append(sig)

    workers = Workers(["true"], -1, 2, shared)
    proc = Proc()
    workers.procs[1] = proc  # type: ignore[assignment]
    workers.stop()
    workers.stop()  # the signal handler, then the end of the loop
    assert proc.sent == [signal.SIGTERM]
