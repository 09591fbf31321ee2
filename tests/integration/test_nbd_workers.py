"""The NBD server's worker processes against real clients.

A server with ``--workers N`` hands its connections to N-1 worker processes
besides itself, least busy first: with one worker, the first connection goes
to the worker and the second stays in the listener.  What must hold for an
export as a whole holds across them: a FLUSH on one connection makes the
writes acknowledged on another durable, a throttle limit bounds the sum of
the connections, and counters add up.  A worker that dies is replaced; all
of them die with the listener.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import trio

from nbd.exports import Export, ExportTable
from nbd.server import NBDServer, ServerConfig
from tests.conftest import NBDServerFactory, NBDServerProcess, sparse_image
from tests.integration.test_nbd_durability import SyncWatch
from tests.nbd_tools import TIMEOUT, MiB, QemuIOSession, nbd_target, qemu_io, read_range
from tests.nbdwire import open_export, serving

_SERVING = re.compile(r"moorage\.nbd(\[worker (\d+)\])?: [^ ]+: serving export ")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started that are still there."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def worker_pids(server: NBDServerProcess) -> list[int]:
    return [
        c
        for c in children(server.proc.pid)
        if b"nbd.worker" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def serving_processes(server: NBDServerProcess) -> list[int]:
    """Which process (0: the listener, N: worker N) served each connection, in order."""
    return [int(m.group(2) or 0) for m in _SERVING.finditer(server.log_text())]


def wait_for(predicate: object, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (not yet reaped by its parent) is gone too.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


# --------------------------------------------------------------- durability


def test_flush_on_one_process_makes_another_process_writes_durable(
    tmp_path: Path, nbd_servers: NBDServerFactory
) -> None:
    size = 16 * MiB
    img = sparse_image(tmp_path / "d.img", size)
    server = nbd_servers.start({"d": img}, workers=2)
    writer = QemuIOSession(server.uri("d"), tmp_path / "writer.trace")
    wait_for(lambda: len(serving_processes(server)) == 1, "the writer is served")
    flusher = QemuIOSession(server.uri("d"), tmp_path / "flusher.trace")
    wait_for(lambda: len(serving_processes(server)) == 2, "the flusher is served")
    # The two connections are in the two processes (which in which depends on
    # when the listener heard that the fixture's probe connection ended).
    writer_in, flusher_in = serving_processes(server)
    assert {writer_in, flusher_in} == {0, 1}, server.log_text()
    (worker,) = worker_pids(server)
    pids = {0: server.proc.pid, 1: worker}
    watch = SyncWatch(pids[flusher_in], tmp_path / "strace-flusher.log")
    writer_watch = SyncWatch(pids[writer_in], tmp_path / "strace-writer.log")
    regions = [(0, 4096, 0x41), (3 * MiB + 5, 1000, 0x42), (8 * MiB, 2 * MiB, 0x43)]
    try:
        for offset, length, byte in regions:
            writer.cmd(f"write -P {byte:#x} {offset} {length}")  # acknowledged, no FUA
        before = watch.count()
        flusher.cmd("flush")
        # The FLUSH reply is out only after the process that served it synced
        # the image, which makes the other process's acknowledged writes
        # durable: that one never synced.
        assert watch.count() > before, watch.log.read_text()
        assert writer_watch.count() == 0, writer_watch.log.read_text()
        # kill -9 the whole server right after the FLUSH, clients connected.
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        wait_for(lambda: gone(worker), "the worker dies with the listener")
    finally:
        watch.stop()
        writer_watch.stop()
        writer.close()
        flusher.close()
    expected = bytearray(size)
    for offset, length, byte in regions:
        expected[offset : offset + length] = bytes([byte]) * length
    assert read_range(img, 0, size) == bytes(expected)
    fresh = nbd_servers.start({"d": img})
    qemu_io(
        nbd_target(fresh.uri("d")),
        *(f"read -P {byte:#x} {offset} {length}" for offset, length, byte in regions),
        f"read -P 0 {10 * MiB} {6 * MiB}",
    )


# --------------------------------------------------------------- processes


def test_one_worker_means_one_process(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    img = sparse_image(tmp_path / "d.img", 4 * MiB)
    server = nbd_servers.start({"d": img}, workers=1)
    qemu_io(nbd_target(server.uri("d")), "write -P 0x5a 0 4096", "read -P 0x5a 0 4096")
    assert worker_pids(server) == []
    assert serving_processes(server) == [0]


def test_a_dead_worker_is_replaced(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    img = sparse_image(tmp_path / "d.img", 4 * MiB)
    server = nbd_servers.start({"d": img}, workers=3)
    wait_for(lambda: len(worker_pids(server)) == 2, "two workers")
    first, second = sorted(worker_pids(server))
    client = QemuIOSession(server.uri("d"), tmp_path / "client.trace")
    try:
        client.cmd("write -P 0x77 0 4096")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: gone(first), "the worker is killed")
        wait_for(lambda: len(set(worker_pids(server)) - {first}) == 2, "a new worker")
        (new,) = set(worker_pids(server)) - {first, second}
        wait_for(lambda: f"(pid {new}) ready" in server.log_text(), "the new worker ready")
    finally:
        client.close()
    assert second in worker_pids(server)
    ended_re = rf"NBD worker (\d) \(pid {first}\) ended \(killed by SIGKILL\)"
    ended = re.search(ended_re, server.log_text())
    assert ended, server.log_text()
    # The new worker, under the old one's number, serves again.
    sessions = [QemuIOSession(server.uri("d"), tmp_path / f"c{i}.trace") for i in range(3)]
    try:
        for s in sessions:
            s.cmd("read -P 0x77 0 4096")
    finally:
        for s in sessions:
            s.close()
    assert int(ended.group(1)) in serving_processes(server)[-3:], server.log_text()
    assert server.stop() == 0
    assert all(gone(pid) for pid in (first, second))


# ---------------------------------------------------- shared limits, counters


def fio_read_iops(uri: str, jobs: int, seconds: int = 3) -> float:
    argv = [
        "fio", "--name=limit", "--ioengine=nbd", f"--uri={uri}", "--rw=randread",
        "--bs=4k", "--iodepth=8", f"--numjobs={jobs}", "--group_reporting",
        "--time_based", f"--runtime={seconds}", "--size=16M", "--output-format=json",
    ]  # fmt: skip
    return float(json.loads(_fio(argv))["jobs"][0]["read"]["iops"])


def _fio(argv: list[str]) -> str:
    import subprocess

    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout[result.stdout.index("{") :]  # fio's engine says hello first


def rows(server: NBDServer, name: str) -> list[tuple[int, int]]:
    """(requests, open connections) of export ``name`` in each process."""
    runtime = server.exports.runtime(name)
    assert runtime is not None and runtime.shared is not None
    shared = runtime.shared
    return [
        (r.requests, r.connections)
        for r in (shared.region.row(shared.slot, p) for p in range(shared.region.processes))
    ]


async def test_an_iops_limit_holds_across_processes(tmp_path: Path) -> None:
    img = sparse_image(tmp_path / "d.img", 16 * MiB)
    table = ExportTable([Export("d", img, iops_limit=100)])
    with trio.fail_after(120):
        async with serving(table, ServerConfig(workers=3)) as (server, port):
            uri = f"nbd://127.0.0.1:{port}/d"
            # Four connections on three processes, 8 requests in flight each:
            # held to the export's limit as a whole (100 ms of burst).
            iops = await trio.to_thread.run_sync(fio_read_iops, uri, 4)
            assert iops <= 100 * 1.2 + 10, iops
            served = [requests for requests, _ in rows(server, "d")]
            assert sum(1 for n in served if n) == 3, served
            # The limit changed live reaches every process.
            table.add(Export("d", img, iops_limit=30))
            await server.sync_exports()
            iops = await trio.to_thread.run_sync(fio_read_iops, uri, 4)
            assert iops <= 30 * 1.2 + 10, iops
            table.add(Export("d", img))
            await server.sync_exports()
            unlimited = await trio.to_thread.run_sync(fio_read_iops, uri, 4, 1)
            assert unlimited > 4 * (100 * 1.2 + 10), unlimited


async def test_counters_and_connections_add_up_over_processes(tmp_path: Path) -> None:
    img = sparse_image(tmp_path / "d.img", 4 * MiB)
    table = ExportTable([Export("d", img)])
    with trio.fail_after(60):
        async with serving(table, ServerConfig(workers=3)) as (server, port):
            clients = [(await open_export(port, "d"))[0] for _ in range(3)]
            for i, client in enumerate(clients):
                for _ in range(i + 1):
                    assert await client.read(0, 4096) == bytes(4096)
            per_process = rows(server, "d")
            assert [c for _, c in per_process] == [1, 1, 1], per_process
            ((name, stats, connections),) = table.stats()
            assert (name, connections) == ("d", 3)
            assert stats.requests == 6 and stats.read_bytes == 6 * 4096, stats
            assert server.active_connections == 3
            for client in clients:
                await client.disconnect()
            with trio.fail_after(TIMEOUT):
                while server.active_connections or table.stats()[0][2]:
                    await trio.sleep(0.02)


# ------------------------------------------------------------------ failures


def our_workers() -> list[int]:
    """The worker processes of the in-process server this test runs."""
    return [
        c for c in children(os.getpid()) if b"nbd.worker" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


async def test_a_worker_killed_with_connections_open_lets_them_go(tmp_path: Path) -> None:
    """Its shared counts of open connections go back to 0, and the slot of an
    export removed meanwhile is used again."""
    img = sparse_image(tmp_path / "d.img", 4 * MiB)
    table = ExportTable([Export("d", img)])
    with trio.fail_after(60):
        async with serving(table, ServerConfig(workers=2)) as (server, port):
            runtime = table.runtime("d")
            assert runtime is not None and runtime.shared is not None
            slot = runtime.shared.slot
            # On a tie the worker gets the connection.
            client, _ = await open_export(port, "d")
            assert await client.read(0, 4096) == bytes(4096)
            assert [c for _, c in rows(server, "d")] == [0, 1]
            (worker,) = our_workers()
            os.kill(worker, signal.SIGKILL)
            with trio.fail_after(TIMEOUT):
                while table.stats()[0][2]:
                    await trio.sleep(0.02)
            assert [c for _, c in rows(server, "d")] == [0, 0]
            table.remove("d")
            await server.sync_exports()
            table.add(Export("e", img))
            await server.sync_exports()
            again = table.runtime("e")
            assert again is not None and again.shared is not None
            assert again.shared.slot == slot
            with trio.move_on_after(TIMEOUT):
                await client.disconnect()


async def test_a_worker_that_stops_reading_never_shares_a_client(tmp_path: Path) -> None:
    """A worker stopped (SIGSTOP) while connections are handed to it: each client
    is served by one process (the listener, or the worker before it is killed
    for taking nothing), never by both."""
    from nbd import codec, workers

    img = sparse_image(tmp_path / "d.img", 4 * MiB)
    table = ExportTable([Export("d", img)])
    socks: list[trio.socket.SocketType] = []
    with trio.fail_after(120):
        async with serving(table, ServerConfig(workers=2)) as (server, port):
            (worker,) = our_workers()
            # A small send buffer: a few hand-offs fill the control channel.
            assert server.pool is not None
            channel = server.pool._workers[1].sock
            channel.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            os.kill(worker, signal.SIGSTOP)
            try:
                # Enough hand-offs to fill the stopped worker's control channel.
                for _ in range(40):
                    s = trio.socket.socket()
                    await s.connect(("127.0.0.1", port))
                    socks.append(s)
                # Bounded: the listener gives up on the worker within
                # HANDOFF_TIMEOUT of its channel filling up.
                with trio.move_on_after(3 * workers.HANDOFF_TIMEOUT):
                    while not gone(worker):
                        await trio.sleep(0.05)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGCONT)
            received = [b""] * len(socks)

            async def take(i: int) -> None:
                while chunk := await socks[i].recv(4096):
                    received[i] += chunk

            # Whatever is coming comes at once: one greeting, or the
            # connection closed with the worker; never two greetings.
            with trio.move_on_after(3):
                async with trio.open_nursery() as nursery:
                    for i in range(len(socks)):
                        nursery.start_soon(take, i)
            for s in socks:
                s.close()
            assert all(len(got) in (0, codec.GREETING.size) for got in received), received
            assert gone(worker), "the worker that took nothing is killed"
