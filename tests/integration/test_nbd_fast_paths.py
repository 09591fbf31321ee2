"""The server's fast paths, against an in-process server over real sockets.

Writes into the page cache are made by the connection's reply thread just
before it answers; the reader takes data from the socket without passing
through trio's scheduler.  These tests pin down what must still hold: errors
reach the client as NBD errors, a slow disk sends writes to worker threads,
and one busy connection does not starve the others.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import nbd.bulk
import nbd.image
from nbd import client as nbd_client
from nbd import codec
from nbd.constants import Command, Errno
from nbd.exports import Export, ExportTable
from tests.conftest import NBDServerFactory
from tests.nbdwire import open_export, serving

KiB = 1024
MiB = 1024 * KiB
TIMEOUT = 60


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a sparse image on it runs out of space when written."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_write_that_fails_in_the_reply_thread_is_answered_enospc(
    small_tmpfs: Path,
) -> None:
    image = small_tmpfs / "disk.img"
    with image.open("wb") as f:
        f.truncate(16 * MiB)  # sparse: far more than the 1 MiB filesystem holds
    table = ExportTable([Export("disk", image)])
    with trio.fail_after(TIMEOUT):
        async with serving(table) as (_server, port):
            client, _ = await open_export(port, "disk")
            chunk = os.urandom(256 * KiB)
            errors = []
            for i in range(16):  # 4 MiB into a 1 MiB filesystem
                reply = await client.call(Command.WRITE, i * len(chunk), len(chunk), 0, chunk)
                errors.append(reply.error)
            assert errors[0] == 0
            assert Errno.ENOSPC in errors, errors
            # The connection goes on: what was acknowledged reads back.
            assert await client.read(0, len(chunk)) == chunk
            await client.disconnect()


async def test_slow_page_cache_write_sends_writes_to_worker_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(4 * MiB))
    # Every write counts as slow: after the first, writes leave the reply thread.
    monkeypatch.setattr(nbd.image, "SLOW_THREAD_WRITE", -1.0)
    # The event loop's path: no runs (a run serves such writes in its own thread).
    monkeypatch.setattr(nbd.bulk, "BULK_MIN", 1 << 62)
    table = ExportTable([Export("disk", image)])
    with trio.fail_after(TIMEOUT):
        async with serving(table) as (server, port):
            client, _ = await open_export(port, "disk")
            data = [os.urandom(128 * KiB) for _ in range(8)]
            for i, block in enumerate(data):
                assert (
                    await client.call(Command.WRITE, i * 128 * KiB, 128 * KiB, 0, block)
                ).error == 0
            (tx,) = server._transmitting
            assert tx.threaded >= 7, f"only {tx.threaded} writes went to worker threads"
            for i, block in enumerate(data):
                assert await client.read(i * 128 * KiB, 128 * KiB) == block
            await client.disconnect()
    with image.open("rb") as f:
        assert f.read(8 * 128 * KiB) == b"".join(data)


async def test_slow_page_cache_write_does_not_end_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run waits for a slow write in its own thread; the event loop (and its
    buffer for each queued request) is not brought in."""
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(4 * MiB))
    monkeypatch.setattr(nbd.image, "SLOW_THREAD_WRITE", -1.0)  # every write is slow
    table = ExportTable([Export("disk", image)])
    with trio.fail_after(TIMEOUT):
        async with serving(table) as (server, port):
            client, _ = await open_export(port, "disk")
            data = [os.urandom(128 * KiB) for _ in range(8)]
            for i, block in enumerate(data):
                assert (
                    await client.call(Command.WRITE, i * 128 * KiB, 128 * KiB, 0, block)
                ).error == 0
            (tx,) = server._transmitting
            assert tx._bulk is not None, "no run served the writes"
            assert tx.threaded == 0, f"{tx.threaded} writes went to worker threads"
            for i, block in enumerate(data):
                assert await client.read(i * 128 * KiB, 128 * KiB) == block
            await client.disconnect()
    with image.open("rb") as f:
        assert f.read(8 * 128 * KiB) == b"".join(data)


def test_busy_connection_does_not_starve_another(
    tmp_path: Path, nbd_servers: NBDServerFactory
) -> None:
    """A client streaming writes without pause; another one's reads are answered meanwhile."""
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(8 * MiB))
    server = nbd_servers.start({"disk": image})
    busy = nbd_client.connect("127.0.0.1", server.port, "disk")
    other = nbd_client.connect("127.0.0.1", server.port, "disk")
    count = 40_000
    payload = b"\x5a" * 4096
    # Pipelined 4 KiB writes sent as fast as the socket takes them: the busy
    # connection always has a request waiting.
    requests = b"".join(
        codec.encode_request(Command.WRITE, i, (i * 4096) % (8 * MiB), 4096) + payload
        for i in range(count)
    )
    stream_done = threading.Event()
    failures: list[str] = []

    def stream() -> None:
        busy.sock.sendall(requests)
        stream_done.set()

    def drain() -> None:
        for _ in range(count):
            reply = _recv_exact(busy.sock, 16)
            if reply[4:8] != bytes(4):
                failures.append(f"write failed: {reply.hex()}")

    threads = [threading.Thread(target=stream), threading.Thread(target=drain)]
    for t in threads:
        t.start()
    try:
        answered_during_stream = 0
        for i in range(20):
            other.sock.sendall(codec.encode_request(Command.READ, i, 0, 4096))
            reply = _recv_exact(other.sock, 16 + 4096)
            assert reply[4:8] == bytes(4)
            if not stream_done.is_set():
                answered_during_stream += 1
    finally:
        for t in threads:
            t.join(TIMEOUT)
        busy.sock.close()
        other.sock.close()
    assert not failures, failures[:3]
    assert answered_during_stream >= 10, (
        f"only {answered_during_stream} of 20 reads were answered while the busy client streamed"
    )


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "server closed the connection"
        out += chunk
    return bytes(out)
