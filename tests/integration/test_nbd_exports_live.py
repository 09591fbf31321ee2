"""Exports that come and go while serving, client networks, shutdown, stdio and
socket activation.

Why this file is long: most tests are one scenario walked message by message with the
wire client (the table changed under connected and still-negotiating clients, a shutdown
with requests in flight, a server on stdio or behind socket activation), checked after
every step. The three sections share only the image helpers and could be separate files.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from ipaddress import ip_network
from pathlib import Path

import pytest
import trio

from nbd import codec
from nbd.constants import (
    BASE_ALLOCATION,
    Command,
    Info,
    Option,
    OptionReply,
)
from nbd.exports import Export, ExportTable
from nbd.image import Image
from nbd.server import NBDServer, ServerConfig
from tests.conftest import REPO, free_port, sparse_image
from tests.nbdwire import (
    Closed,
    WireClient,
    connect,
    nbdinfo_json,
    nbdinfo_size,
    open_export,
    serving,
)

KiB = 1024
MiB = 1024 * KiB
TIMEOUT = 20


def make_image(path: Path, size: int, seed: int) -> Path:
    """A sparse image with random data in its first and last 64 KiB."""
    rng = random.Random(seed)
    sparse_image(path, size)
    with path.open("r+b") as f:
        f.write(rng.randbytes(64 * KiB))
        f.seek(size - 64 * KiB)
        f.write(rng.randbytes(64 * KiB))
    return path


def head(path: Path, n: int = 64 * KiB) -> bytes:
    with path.open("rb") as f:
        return f.read(n)


async def wait_until(predicate: Callable[[], bool], timeout: float = 5) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


def open_connections(table: ExportTable, name: str) -> int:
    """The open connections of export ``name`` as the table reports them to metrics."""
    return next((n for export, _, n in table.stats() if export == name), 0)


async def option_reply_types(client: WireClient, option: int, data: bytes) -> list[int]:
    return [r for r, _ in await client.option(option, data)]


async def list_exports(client: WireClient) -> set[str]:
    names = set()
    for reply, body in await client.option(Option.LIST):
        if reply == OptionReply.SERVER:
            (n,) = codec.U32.unpack_from(body)
            names.add(body[4 : 4 + n].decode())
        else:
            assert reply == OptionReply.ACK
    return names


# ------------------------------------------------------------ live table

# The table's tests run on one process and on three (the listener and two
# workers, the connections spread over them): a change is complete once
# ``sync_exports`` returns, as the storage node waits for it.
live_workers = pytest.mark.parametrize("workers", [1, 3])


def serving_processes(server: NBDServer, name: str) -> set[int]:
    """The processes (0: the listener) with a connection open on export ``name``."""
    runtime = server.exports.runtime(name)
    assert runtime is not None
    shared = runtime.shared
    if shared is None:
        return {0} if open_connections(server.exports, name) else set()
    region = shared.region
    return {p for p in range(region.processes) if region.row(shared.slot, p).connections}


@live_workers
async def test_added_export_visible_to_new_clients(tmp_path: Path, workers: int) -> None:
    a = make_image(tmp_path / "a.img", 2 * MiB, 1)
    b = make_image(tmp_path / "b.img", 3 * MiB, 2)
    table = ExportTable([Export("a", a)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            on_a, _ = await open_export(port, "a")
            before = await connect(port)
            await before.greeting()
            assert await list_exports(before) == {"a"}
            go_b = codec.encode_info_request("b", [])
            assert await option_reply_types(before, Option.GO, go_b) == [OptionReply.ERR_UNKNOWN]

            table.add(Export("b", b, description="added later"))
            await server.sync_exports()

            # Visible at once, even to a client already haggling.
            assert await list_exports(before) == {"a", "b"}
            neg = await before.go("b", [Info.DESCRIPTION])
            assert neg.size == 3 * MiB
            assert neg.infos[Info.DESCRIPTION] == b"added later"
            assert await before.read(0, 64 * KiB) == head(b)
            assert await nbdinfo_size(f"nbd://127.0.0.1:{port}/b") == 3 * MiB
            listed = json.loads(
                (
                    await trio.run_process(
                        ["nbdinfo", "--list", "--json", f"nbd://127.0.0.1:{port}"],
                        capture_stdout=True,
                    )
                ).stdout
            )
            assert {x["export-name"] for x in listed["exports"]} == {"a", "b"}
            # The connection that was already open is undisturbed.
            assert await on_a.read(0, 64 * KiB) == head(a)
            # A client landing on any process sees the new export.
            on_b = [(await open_export(port, "b"))[0] for _ in range(workers)]
            for client in on_b:
                assert await client.read(0, 64 * KiB) == head(b)
            assert serving_processes(server, "b") == set(range(workers))
            for client in (on_a, before, *on_b):
                await client.disconnect()


@live_workers
async def test_removed_export_closes_its_connections(tmp_path: Path, workers: int) -> None:
    a = make_image(tmp_path / "a.img", 2 * MiB, 1)
    b = make_image(tmp_path / "b.img", 2 * MiB, 2)
    table = ExportTable([Export("a", a), Export("b", b)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            a1, _ = await open_export(port, "a")
            a2, _ = await open_export(port, "a", structured=True)
            b1, _ = await open_export(port, "b")
            haggling = await connect(port)
            await haggling.greeting()
            await wait_until(lambda: open_connections(table, "a") == 2)
            # A request of a2 in flight when the export goes away.
            await a2.request(Command.READ, 1, 0, 64 * KiB)
            await a2.request(Command.READ, 2, 64 * KiB, 64 * KiB)
            # With workers, a's two connections are in two of them.
            assert len(serving_processes(server, "a")) == min(workers, 2)

            assert table.remove("a")
            await server.sync_exports()

            assert await a1.expect_closed() == b""
            await a2.expect_closed()  # replies to the reads may or may not have made it
            assert await b1.read(0, 64 * KiB) == head(b)
            go_a = codec.encode_info_request("a", [])
            assert await option_reply_types(haggling, Option.GO, go_a) == [OptionReply.ERR_UNKNOWN]
            assert (await haggling.go("b")).size == 2 * MiB
            assert open_connections(table, "a") == 0
            await wait_until(lambda: open_connections(table, "b") == 2)
            await b1.disconnect()
            await haggling.disconnect()
            await wait_until(lambda: server.active_connections == 0)


@live_workers
async def test_replaced_export_closes_old_connections(tmp_path: Path, workers: int) -> None:
    a = make_image(tmp_path / "a.img", 2 * MiB, 1)
    a2 = make_image(tmp_path / "a2.img", 4 * MiB, 3)
    table = ExportTable([Export("a", a)])
    with trio.fail_after(TIMEOUT):
        async with serving(table, ServerConfig(workers=workers)) as (server, port):
            old, _ = await open_export(port, "a")
            table.add(Export("a", a2))
            await server.sync_exports()
            assert await old.expect_closed() == b""
            new, neg = await open_export(port, "a")
            assert neg.size == 4 * MiB
            assert await new.read(0, 64 * KiB) == head(a2)
            await new.disconnect()


async def test_allowed_networks(tmp_path: Path) -> None:
    img = make_image(tmp_path / "x.img", 2 * MiB, 1)
    table = ExportTable(
        [
            Export("secret", img, allowed_clients=frozenset({ip_network("10.9.9.9/32")})),
            Export("local", img, allowed_clients=frozenset({ip_network("127.0.0.0/8")})),
            Export("open", img),
        ]
    )
    with trio.fail_after(TIMEOUT):
        async with serving(table) as (_, port):
            client = await connect(port)
            await client.greeting()
            await client.structured_reply()
            assert await list_exports(client) == {"local", "open"}
            for option in (Option.INFO, Option.GO):
                hidden = codec.encode_info_request("secret", [])
                missing = codec.encode_info_request("nonexistent", [])
                assert await option_reply_types(client, option, hidden) == [OptionReply.ERR_UNKNOWN]
                assert await option_reply_types(client, option, missing) == [
                    OptionReply.ERR_UNKNOWN
                ]
            meta = codec.encode_meta_context_request("secret", [BASE_ALLOCATION])
            for option in (Option.LIST_META_CONTEXT, Option.SET_META_CONTEXT):
                assert await option_reply_types(client, option, meta) == [OptionReply.ERR_UNKNOWN]
            # The allowed ones open as usual.
            assert (await client.go("local")).size == 2 * MiB
            assert await client.read(0, 64 * KiB) == head(img)
            await client.disconnect()

            listed = json.loads(
                (
                    await trio.run_process(
                        ["nbdinfo", "--list", "--json", f"nbd://127.0.0.1:{port}"],
                        capture_stdout=True,
                    )
                ).stdout
            )
            assert {x["export-name"] for x in listed["exports"]} == {"local", "open"}
            failed = await trio.run_process(
                ["nbdinfo", "--size", f"nbd://127.0.0.1:{port}/secret"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert failed.returncode != 0

            # NBD_OPT_EXPORT_NAME cannot be answered with an error: a hard disconnect.
            client = await connect(port)
            await client.greeting()
            await client.send(codec.encode_option(Option.EXPORT_NAME, b"secret"))
            assert await client.expect_closed() == b""

            # The default export is the one export this client may see, if unique.
            client = await connect(port)
            await client.greeting()
            default = codec.encode_info_request("", [])
            assert await option_reply_types(client, Option.GO, default) == [OptionReply.ERR_UNKNOWN]
            table.remove("open")
            assert await list_exports(client) == {"local"}
            neg = await client.go("", [Info.NAME])
            assert neg.infos[Info.NAME] == b"local"
            await client.disconnect()


# --------------------------------------------------------------- shutdown


@dataclass
class Running:
    server: NBDServer
    port: int
    stopped: trio.Event


@asynccontextmanager
async def running(table: ExportTable, config: ServerConfig | None = None) -> AsyncIterator[Running]:
    """A server whose ``serve()`` returning is observable (``stopped``)."""
    server = NBDServer(table, config)
    stopped = trio.Event()

    async def run(task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        try:
            await server.serve_tcp("127.0.0.1", 0, task_status=task_status)
        finally:
            stopped.set()

    async with trio.open_nursery() as nursery:
        listeners: list[trio.SocketListener] = await nursery.start(run)
        try:
            yield Running(server, int(listeners[0].socket.getsockname()[1]), stopped)
        finally:
            server.shutdown()


async def test_graceful_shutdown_finishes_request_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    img = make_image(tmp_path / "x.img", 2 * MiB, 1)
    started = threading.Event()
    release = threading.Event()
    real_flush = Image.flush

    def slow_flush(self: Image) -> None:
        started.set()
        release.wait(TIMEOUT)
        real_flush(self)

    monkeypatch.setattr(Image, "flush", slow_flush)
    with trio.fail_after(TIMEOUT):
        async with running(ExportTable([Export("x", img)])) as r:
            client, _ = await open_export(r.port, "x")
            haggling = await connect(r.port)
            await haggling.greeting()
            await client.request(Command.FLUSH, 1, 0, 0)
            await trio.to_thread.run_sync(started.wait)

            r.server.shutdown()
            await trio.sleep(0.1)
            await client.request(Command.READ, 2, 0, 4096)
            assert not r.stopped.is_set()

            # New clients are turned away; one still haggling gets no export.
            with pytest.raises(OSError):
                await trio.open_tcp_stream("127.0.0.1", r.port)
            try:
                go = codec.encode_info_request("x", [])
                assert await option_reply_types(haggling, Option.GO, go) == [
                    OptionReply.ERR_SHUTDOWN
                ]
            except Closed:
                pass

            release.set()
            reply = await client.reply()
            assert (reply.cookie, reply.error) == (1, 0)
            try:
                later = await client.reply()
            except Closed:
                pass
            else:
                # read before the server stopped reading: served, never an error
                # (a kernel client would take one as EIO for good)
                assert (later.cookie, later.error) == (2, 0)
                await client.expect_closed()
            with trio.fail_after(5):
                await r.stopped.wait()


async def test_shutdown_does_not_wait_forever_for_a_client_that_stops_reading(
    tmp_path: Path,
) -> None:
    img = make_image(tmp_path / "x.img", 16 * MiB, 1)
    config = ServerConfig(shutdown_grace=0.5)
    with trio.fail_after(TIMEOUT):
        async with running(ExportTable([Export("x", img)]), config) as r:
            client, _ = await open_export(r.port, "x", structured=True)
            try:
                batch = b"".join(
                    codec.encode_request(Command.READ, i, 0, 4 * MiB) for i in range(8)
                )
                await client.send(batch)  # ... and never read the 32 MiB of replies
                await trio.sleep(0.3)
                r.server.shutdown()
                with trio.fail_after(5):
                    await r.stopped.wait()
            finally:
                await client.aclose()


async def test_shutdown_never_cuts_a_reply_in_half(tmp_path: Path) -> None:
    """Replies being written when shutdown starts go out whole, and correct."""
    img = make_image(tmp_path / "x.img", 16 * MiB, 1)
    with img.open("r+b") as f:
        f.write(random.Random(5).randbytes(16 * MiB))
    expected = img.read_bytes()
    with trio.fail_after(TIMEOUT):
        async with running(ExportTable([Export("x", img)])) as r:
            client, _ = await open_export(r.port, "x")
            batch = b""
            for i in range(8):
                client._pending[i] = (Command.READ, 1 * MiB)
                batch += codec.encode_request(Command.READ, i, i * MiB, 1 * MiB)
            await client.send(batch)
            await trio.sleep(0.3)  # the server is now blocked writing replies
            r.server.shutdown()
            await trio.sleep(0.3)
            answered = 0
            while True:
                try:
                    reply = await client.reply()
                except Closed as e:
                    # The connection may end, but only between two messages (and
                    # with a FIN: every request was read, so no reset either).
                    assert "EOF with 0 of" in str(e), f"connection closed mid-reply: {e}"
                    break
                offset = reply.cookie * MiB
                assert reply.error == 0  # what was read is served, shutdown or not
                assert reply.read_data(offset, MiB) == expected[offset : offset + MiB], (
                    f"reply {reply.cookie} carries the wrong data"
                )
                answered += 1
            assert answered >= 1
            with trio.fail_after(5):
                await r.stopped.wait()


# ------------------------------------------------------- stdio, activation


def server_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "moorage", "nbd", "serve", *args]


async def _exercise(client: WireClient, img: Path, name: str) -> None:
    """Handshake, read, write, read back, flush, disconnect."""
    await client.greeting()
    await client.structured_reply()
    neg = await client.go(name)
    assert neg.size == img.stat().st_size
    assert await client.read(0, 64 * KiB) == head(img)
    data = random.Random(7).randbytes(8 * KiB)
    assert (await client.call(Command.WRITE, 1 * MiB, len(data), payload=data)).error == 0
    assert await client.read(1 * MiB, len(data)) == data
    assert (await client.call(Command.FLUSH, 0, 0)).error == 0
    await client.disconnect()
    with img.open("rb") as f:
        f.seek(1 * MiB)
        assert f.read(len(data)) == data


async def test_stdio_mode_over_a_socketpair(tmp_path: Path) -> None:
    img = make_image(tmp_path / "x.img", 4 * MiB, 1)
    ours, theirs = socket.socketpair()
    with trio.fail_after(TIMEOUT), (tmp_path / "server.log").open("wb") as log:
        proc = await trio.lowlevel.open_process(
            server_argv("--stdio", "--export", f"x={img}"),
            stdin=theirs.fileno(),
            stdout=theirs.fileno(),
            stderr=log,
            cwd=REPO,
        )
        theirs.close()
        try:
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
            await _exercise(WireClient(stream), img, "x")
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_stdio_mode_over_pipes(tmp_path: Path) -> None:
    img = make_image(tmp_path / "x.img", 4 * MiB, 1)
    with trio.fail_after(TIMEOUT), (tmp_path / "server.log").open("wb") as log:
        proc = await trio.lowlevel.open_process(
            server_argv("--stdio", "--export", f"x={img}"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=REPO,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            await _exercise(WireClient(trio.StapledStream(proc.stdin, proc.stdout)), img, "")
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_socket_activation_by_libnbd(tmp_path: Path) -> None:
    """``nbdinfo -- [ CMD ]`` and ``nbdcopy -- [ CMD ]`` start us with LISTEN_FDS."""
    img = make_image(tmp_path / "x.img", 4 * MiB, 1)
    cmd = ["[", *server_argv("--export", f"x={img}"), "]"]
    with trio.fail_after(60):
        result = await trio.run_process(
            ["nbdinfo", "--json", "--no-content", "--", *cmd], capture_stdout=True, cwd=REPO
        )
        info = json.loads(result.stdout)
        assert info["exports"][0]["export-size"] == 4 * MiB
        assert info["exports"][0]["export-name"] == "x"
        # nbdcopy asks for block status on the default export and copies everything.
        out = tmp_path / "copy.img"
        await trio.run_process(["nbdcopy", "--", *cmd, str(out)], cwd=REPO)
        assert out.read_bytes() == img.read_bytes()


WRAPPER = """\
import os, sys
os.dup2(int(sys.argv[1]), 3)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_PID"] = str(os.getpid()) if sys.argv[2] == "match" else "1"
os.execv(sys.argv[3], sys.argv[3:])
"""


@pytest.mark.parametrize("pid_matches", [True, False])
async def test_socket_activation_tcp(tmp_path: Path, pid_matches: bool) -> None:
    """A listening TCP socket on fd 3; used only if LISTEN_PID is the server's own pid."""
    img = make_image(tmp_path / "x.img", 4 * MiB, 1)
    activated = socket.socket()
    activated.bind(("127.0.0.1", 0))
    activated.listen(16)
    activated_port = activated.getsockname()[1]
    listen_port = free_port()
    argv = [
        sys.executable,
        "-c",
        WRAPPER,
        str(activated.fileno()),
        "match" if pid_matches else "other",
        *server_argv("--listen", f"127.0.0.1:{listen_port}", "--export", f"x={img}"),
    ]
    with trio.fail_after(TIMEOUT), (tmp_path / "server.log").open("wb") as log:
        proc = await trio.lowlevel.open_process(
            argv, pass_fds=(activated.fileno(),), stderr=log, cwd=REPO
        )
        activated.close()
        try:
            port = activated_port if pid_matches else listen_port
            unused = listen_port if pid_matches else activated_port
            while True:  # the activated socket accepts at once; --listen takes a moment
                try:
                    client = await connect(port)
                    break
                except OSError:
                    await trio.sleep(0.05)
            await _exercise(client, img, "x")
            assert await nbdinfo_size(f"nbd://127.0.0.1:{port}/x") == 4 * MiB
            info = json.loads(await nbdinfo_json(f"nbd://127.0.0.1:{port}"))
            assert info["exports"][0]["export-size"] == 4 * MiB
            if pid_matches:
                with pytest.raises(OSError):
                    await trio.open_tcp_stream("127.0.0.1", unused)
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
