"""nbd.aio (libnbd's asynchronous API driven by trio) against real servers.

Data is checked against the image file behind the server; the peers are
moorage's own server and qemu-nbd.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from nbd.aio import AioConnection
from nbd.libnbd import CmdFlag, NBDClient, NBDError
from tests.conftest import NBDServerFactory, free_port, sparse_image, wait_for_port

MiB = 1024 * 1024
SIZE = 64 * MiB
GONE = {errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE, errno.ESHUTDOWN}


@pytest.fixture(params=["moorage", "qemu-nbd"])
def server(
    request: pytest.FixtureRequest, tmp_path: Path, nbd_servers: NBDServerFactory
) -> Iterator[tuple[str, Path, int]]:
    """(URI, image, server pid) for each peer."""
    image = sparse_image(tmp_path / "disk.img", SIZE)
    if request.param == "moorage":
        s = nbd_servers.start({"disk": image})
        yield f"nbd://127.0.0.1:{s.port}/disk", image, s.proc.pid
        return
    port = free_port()
    proc = subprocess.Popen(
        [
            *("qemu-nbd", "-f", "raw", "-x", "disk", "-b", "127.0.0.1", "-p", str(port)),
            *("--persistent", "--shared=8", str(image)),
        ]
    )
    try:
        wait_for_port(port, proc)
        yield f"nbd://127.0.0.1:{port}/disk", image, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def _open(uri: str) -> AioConnection:
    return AioConnection(NBDClient.open(uri, meta_contexts=()))


async def test_many_requests_in_flight_on_one_connection(server: tuple[str, Path, int]) -> None:
    uri, image, pid = server
    conn = _open(uri)
    blocks = [os.urandom(64 * 1024) for _ in range(256)]  # 16 MiB
    back = [bytearray(64 * 1024) for _ in blocks]
    try:
        with trio.fail_after(60):
            threads_before = set(threading.enumerate())
            async with trio.open_nursery() as nursery:
                for i, block in enumerate(blocks):
                    nursery.start_soon(conn.pwrite, block, i * 64 * 1024)
            # No thread was started for the requests (idle ones may have ended).
            assert set(threading.enumerate()) <= threads_before
            await conn.flush()
            # The server stopped: every read is issued, none can be answered.
            os.kill(pid, signal.SIGSTOP)
            try:
                async with trio.open_nursery() as nursery:
                    for i, buf in enumerate(back):
                        nursery.start_soon(conn.pread_into, buf, i * 64 * 1024)
                    await trio.testing.wait_all_tasks_blocked()
                    assert conn.in_flight == len(back)
                    os.kill(pid, signal.SIGCONT)
            finally:
                os.kill(pid, signal.SIGCONT)
    finally:
        conn.close()
    assert [bytes(b) for b in back] == blocks
    with image.open("rb") as f:
        assert f.read(16 * MiB) == b"".join(blocks)
    assert conn.in_flight == 0


async def test_zero_and_server_errors_come_back_as_errno(server: tuple[str, Path, int]) -> None:
    uri, _, _ = server
    conn = _open(uri)
    try:
        with trio.fail_after(30):
            await conn.pwrite(b"\xab" * MiB, 0)
            await conn.zero(MiB // 2, MiB // 4, CmdFlag.NO_HOLE)
            buf = bytearray(MiB)
            await conn.pread_into(buf, 0)
            assert buf == b"\xab" * (MiB // 4) + bytes(MiB // 2) + b"\xab" * (MiB // 4)
            with pytest.raises(NBDError) as failed:
                await conn.pread_into(bytearray(4096), SIZE)  # past the end
            assert failed.value.errno == errno.EINVAL
            assert conn.alive  # an answer, not a lost connection
            await conn.pread_into(buf, 0)  # and the connection goes on
    finally:
        conn.close()


async def test_server_killed_fails_requests_in_flight_with_enotconn(
    tmp_path: Path, nbd_servers: NBDServerFactory
) -> None:
    image = sparse_image(tmp_path / "disk.img", SIZE)
    s = nbd_servers.start({"disk": image})
    conn = _open(f"nbd://127.0.0.1:{s.port}/disk")
    failures: list[int | None] = []
    try:
        with trio.fail_after(30):

            async def keep_writing() -> None:
                try:
                    for i in range(1_000_000):
                        await conn.pwrite(bytes(MiB), (i % 64) * MiB)
                except NBDError as e:
                    failures.append(e.errno)

            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(keep_writing)
                await trio.sleep(0.3)
                s.proc.send_signal(signal.SIGKILL)
            assert not conn.alive
            with pytest.raises(NBDError) as later:
                await conn.flush()  # a dead connection says why it died
            assert later.value.errno in GONE
    finally:
        conn.close()
    assert len(failures) == 4
    assert set(failures) <= GONE


async def test_close_fails_waiting_requests_and_later_ones(
    server: tuple[str, Path, int],
) -> None:
    uri, _, _ = server
    conn = _open(uri)
    with trio.fail_after(30):
        await conn.pwrite(b"x" * 4096, 0)
        errors: list[int | None] = []

        async def read_forever() -> None:
            try:
                while True:
                    await conn.pread_into(bytearray(MiB), 0)
            except NBDError as e:
                errors.append(e.errno)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_forever)
            await trio.sleep(0.1)
            conn.close()
        assert errors == [errno.ENOTCONN]
        with pytest.raises(NBDError):
            await conn.pwrite(b"y", 0)
    conn.close()  # idempotent
