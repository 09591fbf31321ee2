"""Holds on the NBD server's images (nbd.holds): the barrier of a group snapshot.

A hold stops every connection on its images from reading new requests, in
the listener and in every worker process, and is reached once what they
had read is served: from then on the images do not change until the hold is
released (or its lease runs out).  A hold that cannot be reached in its
timeout fails and is released everywhere.  Connections on other images go on.

Real sockets and real worker processes; the clients are ``tests.nbdwire``'s.
"""

from __future__ import annotations

import os
import signal
import struct
from pathlib import Path

import pytest
import trio

from nbd import codec
from nbd.constants import Command, CommandFlag
from nbd.exports import Export, ExportTable
from nbd.holds import HoldNotReached
from nbd.server import NBDServer, ServerConfig
from tests.conftest import sparse_image
from tests.nbdwire import Closed, WireClient, open_export, serving

MiB = 1 << 20
TIMEOUT = 60
# Long enough for a request the server had read to be served many times over.
SETTLE = 0.3
workers = pytest.mark.parametrize("workers", [1, 3])


def block(marker: int, size: int = 4096) -> bytes:
    return struct.pack(">Q", marker) * (size // 8)


def at(path: Path, offset: int, size: int = 4096) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(size)


def processes_of(server: NBDServer, name: str) -> set[int]:
    runtime = server.exports.runtime(name)
    assert runtime is not None
    if runtime.shared is None:
        return {0}
    region = runtime.shared.region
    return {p for p in range(region.processes) if region.row(runtime.shared.slot, p).connections}


async def clients_on(port: int, name: str, count: int) -> list[WireClient]:
    return [(await open_export(port, name))[0] for _ in range(count)]


@workers
async def test_a_hold_stops_writes_in_every_process_until_released(
    tmp_path: Path, workers: int
) -> None:
    a = sparse_image(tmp_path / "a.img", 4 * MiB)
    b = sparse_image(tmp_path / "b.img", 4 * MiB)
    table = ExportTable([Export("a", a), Export("b", b)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            on_a = await clients_on(port, "a", workers)
            (on_b,) = await clients_on(port, "b", 1)
            assert processes_of(server, "a") == set(range(workers))
            for i, client in enumerate(on_a):
                assert (
                    await client.call(Command.WRITE, i * 4096, 4096, payload=block(1))
                ).error == 0

            await server.hold_io("h1", [a], lease=60, timeout=10)
            for i, client in enumerate(on_a):
                await client.request(Command.WRITE, 100 + i, i * 4096, 4096, payload=block(2))
            # Another image's I/O goes on.
            assert (await on_b.call(Command.WRITE, 0, 4096, payload=block(3))).error == 0
            assert at(b, 0) == block(3)
            await trio.sleep(SETTLE)
            for i in range(workers):
                assert at(a, i * 4096) == block(1), f"write {i} served during the hold"

            server.release_io("h1")
            for client in on_a:
                assert (await client.reply()).error == 0
            for i in range(workers):
                assert at(a, i * 4096) == block(2)
            for client in (*on_a, on_b):
                await client.disconnect()


@workers
async def test_a_reached_hold_leaves_nothing_in_flight(tmp_path: Path, workers: int) -> None:
    """Writes pipelined on every path (inline, the reply thread, FUA in worker
    threads): once the hold is reached the image does not change any more."""
    a = sparse_image(tmp_path / "a.img", 32 * MiB)
    table = ExportTable([Export("a", a)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            on_a = await clients_on(port, "a", workers)
            sizes = (4096, 256 * 1024, 64 * 1024)
            for n, client in enumerate(on_a):
                for i in range(24):
                    size = sizes[i % 3]
                    flags = CommandFlag.FUA if i % 3 == 2 else 0
                    offset = (n * 24 + i) * 256 * 1024
                    await client.request(
                        Command.WRITE, i, offset, size, flags, payload=block(n * 100 + i, size)
                    )
            await server.hold_io("h2", [a], lease=60, timeout=10)
            reached = a.read_bytes()
            await trio.sleep(SETTLE)
            assert a.read_bytes() == reached, "a write landed after the hold was reached"
            server.release_io("h2")
            for client in on_a:
                for _ in range(24):
                    assert (await client.reply()).error == 0
                await client.disconnect()


@workers
async def test_a_hold_a_stalled_client_keeps_from_its_timeout_fails_and_is_released(
    tmp_path: Path, workers: int
) -> None:
    a = sparse_image(tmp_path / "a.img", 4 * MiB)
    table = ExportTable([Export("a", a)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            stalled, *others = await clients_on(port, "a", workers)
            # A write's header and half its payload: the server waits for the rest.
            request = codec.encode_request(Command.WRITE, 9, 0, 8192, 0)
            await stalled.send(request + block(7, 4096))
            await trio.sleep(SETTLE)
            with pytest.raises(HoldNotReached):
                await server.hold_io("h3", [a], lease=60, timeout=0.5)
            # Released everywhere: the other connections write at once.
            for i, client in enumerate(others, start=1):
                assert (
                    await client.call(Command.WRITE, i * 8192, 4096, payload=block(8))
                ).error == 0
                assert at(a, i * 8192) == block(8)
            stalled._pending[9] = (Command.WRITE, 8192)
            await stalled.send(block(7, 4096))
            assert (await stalled.reply()).error == 0
            assert at(a, 0, 8192) == block(7, 8192)
            for client in (stalled, *others):
                await client.disconnect()


@workers
async def test_a_hold_never_released_ends_with_its_lease(tmp_path: Path, workers: int) -> None:
    a = sparse_image(tmp_path / "a.img", 4 * MiB)
    table = ExportTable([Export("a", a)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            on_a = await clients_on(port, "a", workers)
            await server.hold_io("h4", [a], lease=1.0, timeout=10)
            for i, client in enumerate(on_a):
                assert (
                    await client.call(Command.WRITE, i * 4096, 4096, payload=block(5))
                ).error == 0
                assert at(a, i * 4096) == block(5)
            for client in on_a:
                await client.disconnect()


@workers
async def test_a_hold_ends_a_run_of_large_writes(tmp_path: Path, workers: int) -> None:
    """Plain 256 KiB writes that keep coming are served by a run in a thread
    (``nbd.bulk``), not by the event loop: the run must end at a hold, so the
    hold is reached while the client goes on sending, and nothing lands after."""
    size = 256 * 1024
    a = sparse_image(tmp_path / "a.img", 64 * MiB)
    table = ExportTable([Export("a", a)])
    slots = (64 * MiB) // size
    sent = 0
    done = trio.Event()

    async def stream(client: WireClient) -> None:
        nonlocal sent
        window = 8
        for _ in range(window):
            await client.request(Command.WRITE, sent, (sent % slots) * size, size,
                                 payload=block(sent, size))  # fmt: skip
            sent += 1
        while not done.is_set():
            assert (await client.reply()).error == 0
            await client.request(Command.WRITE, sent, (sent % slots) * size, size,
                                 payload=block(sent, size))  # fmt: skip
            sent += 1
        for _ in range(window):
            assert (await client.reply()).error == 0

    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            (client,) = await clients_on(port, "a", 1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream, client)
                while sent < 64:  # well into a run
                    await trio.sleep(0.01)
                await server.hold_io("h5", [a], lease=60, timeout=10)
                reached = a.read_bytes()
                await trio.sleep(SETTLE)
                assert a.read_bytes() == reached, "a write landed after the hold was reached"
                before = sent
                server.release_io("h5")
                while sent < before + 64:  # the stream goes on after the release
                    await trio.sleep(0.01)
                done.set()
            await client.disconnect()


async def test_a_release_queued_behind_a_respawned_workers_hold_ends_it(tmp_path: Path) -> None:
    """A worker killed during a hold is started again with the hold queued (the
    lease that is left); the release, sent before the new process has read
    anything (Python takes longer to start), reaches it right behind. A
    connection on that worker then writes at once, not after the lease (an
    hour here). Six rounds: with the release overtaking the hold inside the
    worker, about half of them were held for good."""
    a = sparse_image(tmp_path / "a.img", 4 * MiB)
    table = ExportTable([Export("a", a)])
    with trio.fail_after(TIMEOUT * 3):
        async with serving(table, ServerConfig(workers=2)) as (server, port):
            pool = server.pool
            assert pool is not None
            for round_ in range(6):
                await server.hold_io(f"r{round_}", [a], lease=3600, timeout=10)
                old = pool._workers[1].proc.pid
                os.kill(old, signal.SIGKILL)
                with trio.fail_after(TIMEOUT):
                    while pool._workers[1].proc.pid == old:
                        await trio.sleep(0.01)
                assert not pool._workers[1].ready  # the new one has not read its messages
                server.release_io(f"r{round_}")
                with trio.fail_after(TIMEOUT):
                    while not pool._workers[1].ready:
                        await trio.sleep(0.01)
                (client,) = await clients_on(port, "a", 1)  # on a tie the worker takes it
                with trio.fail_after(20):  # the lease is 3600 s
                    reply = await client.call(Command.WRITE, 0, 4096, payload=block(round_))
                assert reply.error == 0 and at(a, 0) == block(round_)
                assert processes_of(server, "a") == {1}
                await client.disconnect()


@workers
async def test_removing_an_export_ends_its_connections_parked_at_a_hold(
    tmp_path: Path, workers: int
) -> None:
    """A connection waiting at a hold is told to stop like one waiting for a
    request: the write it sent is never served, and the client sees the end."""
    a = sparse_image(tmp_path / "a.img", 4 * MiB)
    table = ExportTable([Export("a", a)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            on_a = await clients_on(port, "a", workers)
            await server.hold_io("h5", [a], lease=3600, timeout=10)
            for i, client in enumerate(on_a):
                await client.request(Command.WRITE, i, i * 4096, 4096, payload=block(6))
            table.remove("a")
            await server.sync_exports()
            for client in on_a:
                with pytest.raises(Closed):
                    await client.reply()
            server.release_io("h5")
            assert a.read_bytes() == bytes(4 * MiB), "a held write was served"


@workers
async def test_a_shutdown_ends_connections_parked_at_a_hold(tmp_path: Path, workers: int) -> None:
    """The server's drain stops the readers parked at a hold at once: it waits
    neither for the hold's lease nor for its own grace (both an hour here)."""
    a = sparse_image(tmp_path / "a.img", 4 * MiB)
    table = ExportTable([Export("a", a)])
    config = ServerConfig(workers=workers, shutdown_grace=3600)
    with trio.fail_after(TIMEOUT):
        async with serving(table, config) as (server, port):
            on_a = await clients_on(port, "a", workers)
            await server.hold_io("h6", [a], lease=3600, timeout=10)
            for i, client in enumerate(on_a):
                await client.request(Command.WRITE, i, i * 4096, 4096, payload=block(6))
        # serving() shut the server down and returned: every process drained.
        for client in on_a:
            with pytest.raises(Closed):
                await client.reply()
    assert a.read_bytes() == bytes(4 * MiB), "a held write was served"
