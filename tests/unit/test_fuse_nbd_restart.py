"""A server on a unix socket that restarts is waited for, not taken for an export gone.

A restarting server removes its socket file and binds it again, so for a while
connect(2) says ENOENT, which is also what libnbd (and so the block file's
DEFINITIVE set) calls the handshake's NBD_REP_ERR_UNKNOWN, "no such export".
Only the latter must fail requests at once.  The server is moorage's own, in
this process, on a unix socket in the test's directory.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from fuse import nbdconnections
from fuse.nbdconnections import DEFINITIVE, ExportConnections, ExportUnavailable
from nbd.exports import Export, ExportTable
from nbd.libnbd import NBDClient, NBDError
from nbd.server import NBDServer, ServerConfig, open_unix_listener

SIZE = 1 << 20
CLIENTS = ["auto", "libnbd"]


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(range(256)) * (SIZE // 256))
    return path


@asynccontextmanager
async def serving(image: Path, sock: Path) -> AsyncIterator[None]:
    """moorage's NBD server on ``sock`` with export "disk"; stopped and its socket file
    removed on exit (what a server going down for a restart does)."""
    server = NBDServer(ExportTable([Export("disk", image)]), ServerConfig(shutdown_grace=2.0))
    async with trio.open_nursery() as nursery:
        listener = await open_unix_listener(str(sock))
        await nursery.start(server.serve, [listener])
        try:
            yield
        finally:
            server.shutdown()
    sock.unlink(missing_ok=True)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_missing_socket_file_is_nobody_listening(tmp_path: Path, client: str) -> None:
    uri = f"nbd+unix:///disk?socket={tmp_path / 'missing.sock'}"
    with pytest.raises(NBDError) as e:
        nbdconnections.connect(uri, client)
    assert e.value.errno == errno.ECONNREFUSED and e.value.errno not in DEFINITIVE


def test_a_socket_bound_just_after_libnbd_failed_to_connect_is_still_nobody_listening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarting server binds its socket again right after libnbd's connect(2) found
    none: that is still nobody listening (waited for), not "no such export"."""
    sock = tmp_path / "nbd.sock"
    bound: list[socket.socket] = []
    real_open = NBDClient.open

    def open_then_the_server_binds(uri: str, **kwargs: Any) -> Any:
        try:
            return real_open(uri, **kwargs)
        except NBDError:
            listener = socket.socket(socket.AF_UNIX)
            bound.append(listener)
            listener.bind(str(sock))
            listener.listen(1)
            raise

    monkeypatch.setattr(NBDClient, "open", open_then_the_server_binds)
    try:
        with pytest.raises(NBDError) as e:
            nbdconnections.connect(f"nbd+unix:///disk?socket={sock}", "libnbd")
        assert bound and sock.exists()
        assert e.value.errno == errno.ECONNREFUSED, e.value
    finally:
        for listener in bound:
            listener.close()


async def test_an_unknown_export_is_definitive_even_if_the_socket_goes_at_once(
    image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server answered "no such export" and then went down (its socket file gone)
    before the answer was looked at: the answer is what counts."""
    sock = tmp_path / "nbd.sock"
    real_open = NBDClient.open

    def open_then_the_socket_goes(uri: str, **kwargs: Any) -> Any:
        try:
            return real_open(uri, **kwargs)
        except NBDError:
            sock.unlink()
            raise

    monkeypatch.setattr(NBDClient, "open", open_then_the_socket_goes)
    async with serving(image, sock):
        with pytest.raises(NBDError) as e:
            await trio.to_thread.run_sync(
                nbdconnections.connect, f"nbd+unix:///nothing?socket={sock}", "libnbd"
            )
        assert not sock.exists()
    assert e.value.errno in DEFINITIVE, e.value


async def test_an_unknown_export_is_definitive(image: Path, tmp_path: Path) -> None:
    sock = tmp_path / "nbd.sock"
    async with serving(image, sock):
        for client in CLIENTS:
            with pytest.raises(NBDError) as e:
                await trio.to_thread.run_sync(
                    nbdconnections.connect, f"nbd+unix:///nothing?socket={sock}", client
                )
            assert e.value.errno in DEFINITIVE, client


@pytest.mark.parametrize("client", CLIENTS)
async def test_requests_wait_for_a_server_restarting_on_its_unix_socket(
    image: Path, tmp_path: Path, client: str
) -> None:
    """The server goes away with its socket file; a read made meanwhile waits (it is
    not failed as "no such export") and is answered by the server that comes back."""
    sock = tmp_path / "nbd.sock"
    uri = f"nbd+unix:///disk?socket={sock}"
    failures: list[int] = []

    def connect(uri: str) -> nbdconnections.Client:
        try:
            return nbdconnections.connect(uri, client)
        except NBDError as e:
            failures.append(e.errno or 0)
            raise

    async with serving(image, sock):
        export = await trio.to_thread.run_sync(
            functools.partial(ExportConnections.open, uri, 1, timeout=60.0, connect=connect)
        )
    assert not sock.exists()
    try:
        buffer = bytearray(4096)
        result: list[BaseException | None] = []

        async def read() -> None:
            try:
                await export.pread_into(buffer, 8192)
                result.append(None)
            except ExportUnavailable as e:
                result.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            with trio.fail_after(30):
                while not failures and not result:  # it tried, and found nobody
                    await trio.sleep(0.01)
            assert result == []  # still waiting
            async with serving(image, sock):
                with trio.fail_after(30):
                    while not result:
                        await trio.sleep(0.01)
        assert result == [None]
        assert buffer == image.read_bytes()[8192 : 8192 + 4096]
        assert set(failures) == {errno.ECONNREFUSED}, [os.strerror(f) for f in failures]
    finally:
        export.close()
