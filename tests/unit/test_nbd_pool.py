"""nbd.workers: the listener's side of its worker processes, driven with a fake
worker (a sleeping process and the far end of a real control channel)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from ipaddress import ip_network
from pathlib import Path

import pytest
import trio
import trio.testing

from nbd import control, workers
from nbd.exports import Export, ExportError, ExportTable
from nbd.server import ServerConfig
from nbd.workers import WorkerPool, _Worker


@contextlib.contextmanager
def fake_worker(pool: WorkerPool, index: int = 1) -> Iterator[tuple[_Worker, socket.socket]]:
    """A worker the pool knows (ready, nothing acknowledged) and the worker's end of
    its control channel, which the test reads (or does not)."""
    ours, theirs = control.socketpair()
    proc = subprocess.Popen(["sleep", "300"])
    send, receive = trio.open_memory_channel[workers._Queued](float("inf"))
    worker = _Worker(index, proc, trio.socket.from_stdlib_socket(ours), send, receive)
    worker.ready = True
    pool._workers[index] = worker
    try:
        yield worker, theirs
    finally:
        proc.kill()
        proc.wait()
        worker.sock.close()
        theirs.close()


def make_pool(tmp_path: Path, served_here: list[trio.abc.Stream]) -> WorkerPool:
    async def serve_here(stream: trio.abc.Stream) -> None:
        served_here.append(stream)

    table = ExportTable([Export("a", tmp_path)])
    # The listener is busier than any worker: connections go to a worker.
    pool = WorkerPool(table, ServerConfig(workers=2), serve_here, lambda: 100)
    table.share(pool._runtime, pool._changed)
    return pool


def fill(sock: socket.socket) -> None:
    """Fill a control channel until a send would block."""
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            sock.send(control.encode({"op": "sync", "seq": 0}))


def drain_descriptors(sock: socket.socket) -> int:
    """Read every packet waiting on ``sock``; how many descriptors they carried."""
    sock.setblocking(False)
    count = 0
    space = socket.CMSG_SPACE(control.MAX_FDS * 4)
    while True:
        try:
            _, ancillary, _, _ = sock.recvmsg(control.MAX_MESSAGE, space)
        except BlockingIOError:
            return count
        for _, _, payload in ancillary:
            for i in range(0, len(payload) - len(payload) % 4, 4):
                os.close(int.from_bytes(payload[i : i + 4], "little"))
                count += 1


async def test_a_hand_off_that_times_out_is_never_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that stops reading its channel: the connection is served by the
    listener or by the worker, never both; the worker is killed."""
    monkeypatch.setattr(workers, "HANDOFF_TIMEOUT", 0.2)
    served_here: list[trio.abc.Stream] = []
    pool = make_pool(tmp_path, served_here)
    with fake_worker(pool) as (worker, theirs):
        # The worker reads nothing: the listener's end fills up.
        with socket.socket(fileno=os.dup(worker.sock.fileno())) as listener_end:
            fill(listener_end)
        a, b = trio.socket.socketpair()
        stream = trio.SocketStream(a)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool._send_loop, worker, nursery.cancel_scope)
            await pool.route(stream)
            assert served_here == [stream]
            # The worker was killed, and reading its channel now finds no socket.
            assert worker.proc.wait(10) == -9
            assert drain_descriptors(theirs) == 0
            nursery.cancel_scope.cancel()
        b.close()
        a.close()


async def test_a_dead_workers_connections_are_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed with connections open: its shared counts of them go to 0
    (its other counters stay), and the slot of a removed export is reused."""
    pool = make_pool(tmp_path, [])
    runtime = pool.table.runtime("a")
    assert runtime is not None and runtime.shared is not None
    slot = runtime.shared.slot
    with fake_worker(pool) as (worker, theirs):
        monkeypatch.setattr(pool, "_spawn", lambda index: worker)
        pool.region.row(slot, 1).connections = 3
        pool.region.row(slot, 1).requests = 5
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool._supervise, 1, trio.Event())
            await trio.testing.wait_all_tasks_blocked()
            pool._stopping = True
            worker.proc.kill()
            theirs.close()
        assert worker.gone
        sums, connections = pool.region.totals(slot)
        assert connections == 0 and sums["requests"] == 5
    pool.table.remove("a")
    pool.table.add(Export("b", tmp_path))
    again = pool.table.runtime("b")
    assert again is not None and again.shared is not None and again.shared.slot == slot


async def test_a_slot_still_in_use_does_not_hold_up_later_ones(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, [])
    for name in ("b", "c"):
        pool.table.add(Export(name, tmp_path))
    slots = {}
    for name in ("a", "b", "c"):
        runtime = pool.table.runtime(name)
        assert runtime is not None and runtime.shared is not None
        slots[name] = runtime.shared.slot
    with fake_worker(pool) as (worker, _):
        pool.region.row(slots["a"], 1).connections = 1  # still closing there
        pool.table.remove("a")
        pool.table.remove("b")
        worker.acked = pool._seq  # both removals taken
        pool.table.add(Export("d", tmp_path))
        d = pool.table.runtime("d")
        assert d is not None and d.shared is not None and d.shared.slot == slots["b"]


def test_a_replacement_that_cannot_be_placed_keeps_the_export(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, [])
    pool._next_slot = pool.region.slots  # every slot taken
    with pytest.raises(ExportError):
        pool.table.add(Export("a", tmp_path, read_only=True))
    assert [e for e in pool.table] == [Export("a", tmp_path)]


@pytest.mark.parametrize(
    "ack", [{"op": "ack"}, {"op": "ack", "seq": "x"}, {"op": "ack", "seq": []}]
)
async def test_a_malformed_message_from_a_worker_ends_only_that_worker(
    tmp_path: Path, ack: control.Message
) -> None:
    pool = make_pool(tmp_path, [])
    with fake_worker(pool) as (worker, theirs):
        theirs.send(control.encode(ack))
        await pool._run_worker(worker, trio.Event())  # returns: nothing raised
        assert worker.proc.wait(10) == -9


async def test_an_export_too_large_to_tell_the_workers_is_refused(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, [])
    networks = frozenset(ip_network(f"10.{i >> 8}.{i & 255}.0/24") for i in range(20000))
    with fake_worker(pool) as (worker, _):
        with pytest.raises(ExportError, match="too long"):
            pool.table.add(Export("big", tmp_path, allowed_clients=networks))
        assert pool.table.runtime("big") is None
        with pytest.raises(trio.WouldBlock):
            worker.inbox.receive_nowait()  # nothing was sent to the worker


async def test_synced_does_not_wait_for_or_kill_a_starting_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "SYNC_TIMEOUT", 0.2)
    pool = make_pool(tmp_path, [])
    with fake_worker(pool) as (worker, _):
        worker.ready = False  # its start includes every change so far
        pool.table.add(Export("b", tmp_path))
        await pool.synced()
        with pytest.raises(subprocess.TimeoutExpired):
            worker.proc.wait(1)  # not killed


async def test_synced_has_one_deadline_for_every_worker(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """Two workers that never acknowledge: both are killed after one
    SYNC_TIMEOUT (in the test's virtual time), not one after the other."""
    pool = make_pool(tmp_path, [])
    with fake_worker(pool, 1) as (first, _), fake_worker(pool, 2) as (second, _):
        pool.table.add(Export("b", tmp_path))
        start = trio.current_time()
        await pool.synced()
        assert trio.current_time() - start < 2 * workers.SYNC_TIMEOUT
        assert first.proc.wait(10) == -9 and second.proc.wait(10) == -9


async def test_reaping_a_worker_that_does_not_exit_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without pidfd_open too: the worker is killed, and waited for a bounded time."""
    monkeypatch.setattr(workers, "STOP_MARGIN", 0.2)

    def no_pidfd(pid: int) -> int:
        raise OSError("no pidfd_open here")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    proc = subprocess.Popen(["sleep", "300"])
    try:
        with trio.fail_after(30):
            assert await workers._reap(proc) == -9
    finally:
        proc.kill()
        proc.wait()


async def test_sync_exports_waits_for_workers_that_are_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server knows its pool before the pool has started."""
    from nbd.server import NBDServer

    server = NBDServer(ExportTable(), ServerConfig(workers=2))
    seen: list[bool] = []

    async def run(self: WorkerPool, *, task_status: trio.TaskStatus[None]) -> None:
        seen.append(server.pool is self)
        task_status.started()
        self.region.close()

    monkeypatch.setattr(WorkerPool, "run", run)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, [])
        server.shutdown()
    assert seen == [True]


async def test_a_worker_ignores_sigterm() -> None:
    """A SIGTERM to the process group leaves the draining to the listener."""
    ours, theirs = control.socketpair()
    with ours, theirs:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nbd.worker", str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
        )
        try:
            with trio.fail_after(30):
                while not _ignores(proc.pid, signal.SIGTERM):
                    assert proc.poll() is None
                    await trio.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            ours.close()  # the listener's end: the worker stops
            with trio.fail_after(30):
                while proc.poll() is None:
                    await trio.sleep(0.02)
            assert proc.returncode == 0
        finally:
            proc.kill()
            proc.wait()


def _ignores(pid: int, sig: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False
