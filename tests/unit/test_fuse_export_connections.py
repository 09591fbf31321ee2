"""fuse.nbdconnections.ExportConnections around a refresh and a stop.

- A refresh that reconnects only some connections retires the others too: a
  connection left with the old size would refuse (EINVAL) requests into the space
  an online expand added.  Those are made again in the background (within the
  export's timeout).
- A stop (SIGTERM) fails requests waiting for a lost server at once and those
  a server leaves unanswered after the grace (not sent again on another
  connection), but the process's final FLUSH still reaches a server that
  answers, late or after the grace.

The server ends are socketpairs answered by :class:`Server` in this test's trio
loop (moorage's pipelined client on the other end); the clock is trio's MockClock,
so seconds of grace cost none.
"""

from __future__ import annotations

import errno
import socket
import threading
from typing import Final

import pytest
import trio
import trio.testing

from fuse.nbdconnections import STOP_GRACE, ExportConnections, ExportUnavailable
from nbd import codec
from nbd.client import Negotiated
from nbd.constants import REQUEST_MAGIC, Command, TransmissionFlag
from nbd.libnbd import NBDError
from nbd.pipeline import PlainClient

FLAGS: Final = (
    TransmissionFlag.HAS_FLAGS | TransmissionFlag.SEND_FLUSH | TransmissionFlag.CAN_MULTI_CONN
)
MiB: Final = 1 << 20
URI: Final = "nbd://127.0.0.1:1/disk"  # never dialled: connect is the test's


class Server:
    """The server end of one connection: READs answered with zeroes, WRITEs and
    FLUSHes with success, each ``delay`` seconds (trio time) after it arrived
    (None: never answered)."""

    def __init__(self, size: int, delay: float | None = 0.0) -> None:
        self.client_end, self.sock = socket.socketpair()
        self.size = size
        self.delay = delay
        self.commands: list[Command] = []
        self._sending = trio.Lock()

    def client(self) -> PlainClient:
        return PlainClient(Negotiated(self.client_end, "disk", self.size, FLAGS, None, False))

    async def serve(self, nursery: trio.Nursery) -> None:
        sock = trio.socket.from_stdlib_socket(self.sock)
        buffer = b""
        while True:
            try:
                data = await sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            buffer += data
            while len(buffer) >= codec.REQUEST.size:
                magic, _, type_, cookie, _, length = codec.REQUEST.unpack_from(buffer)
                assert magic == REQUEST_MAGIC
                body = length if type_ == Command.WRITE else 0
                if len(buffer) < codec.REQUEST.size + body:
                    break
                buffer = buffer[codec.REQUEST.size + body :]
                command = Command(type_)
                self.commands.append(command)
                if command == Command.DISC:
                    return
                data_out = bytes(length) if command == Command.READ else b""
                nursery.start_soon(self._answer, sock, codec.encode_simple_reply(cookie) + data_out)

    async def _answer(self, sock: trio.socket.SocketType, reply: bytes) -> None:
        if self.delay is None:
            await trio.sleep_forever()
        await trio.sleep(self.delay)
        async with self._sending:  # one reply at a time on the stream
            view = memoryview(reply)
            try:
                while view:
                    view = view[await sock.send(view) :]
            except OSError:
                pass  # the client let the connection go

    def close(self) -> None:
        self.sock.close()
        self.client_end.close()


class Dialer:
    """The export's ``connect``: each call takes the next of ``outcomes`` (a server
    whose client end is returned, or an errno raised as libnbd would)."""

    def __init__(self, nursery: trio.Nursery, outcomes: list[Server | int]) -> None:
        self.nursery = nursery
        self.outcomes = outcomes
        self.calls = 0

    def __call__(self, uri: str) -> PlainClient:
        self.calls += 1
        if not self.outcomes:
            raise NBDError("connection refused", errno.ECONNREFUSED)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, int):
            raise NBDError(f"connect: {errno.errorcode[outcome]}", outcome)
        trio.from_thread.run_sync(self.nursery.start_soon, outcome.serve, self.nursery)
        return outcome.client()


class GatedDialer(Dialer):
    """A :class:`Dialer` whose connect says it began (``dialling``), then waits for
    ``gate`` (at most 10 s, real time) before it goes on."""

    def __init__(self, nursery: trio.Nursery, outcomes: list[Server | int]) -> None:
        super().__init__(nursery, outcomes)
        self.dialling = trio.Event()
        self.gate = threading.Event()

    def __call__(self, uri: str) -> PlainClient:
        trio.from_thread.run_sync(self.dialling.set)
        self.gate.wait(10)
        return super().__call__(uri)


async def _started(nursery: trio.Nursery, servers: list[Server]) -> list[PlainClient]:
    for server in servers:
        nursery.start_soon(server.serve, nursery)
    return [server.client() for server in servers]


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    # jumps only once every task has waited a while in real time: the connects run
    # in threads, which a jump at once would take for a connect timeout
    return trio.testing.MockClock(autojump_threshold=0.05)


# ------------------------------------------------------------------ refresh


async def test_a_partial_refresh_leaves_no_connection_with_the_old_size(
    mock_clock: trio.testing.MockClock,
) -> None:
    """An online expand, then a refresh during which one connect fails: no connection
    keeps the old size, and a read in the new space, sent while the other connection
    is busy, is answered."""
    old = [Server(MiB), Server(MiB)]
    grown = Server(2 * MiB, delay=5.0)
    later = Server(2 * MiB)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [grown, errno.ECONNRESET, later])
        export = ExportConnections(URI, await _started(nursery, old), timeout=30.0, connect=dial)
        try:
            with trio.fail_after(10):
                assert await export.refresh() == 2 * MiB
            assert dial.calls == 2
            sizes = [s.conn.client.get_size() for s in export._slots if s.conn is not None]
            assert sizes and set(sizes) == {2 * MiB}, sizes
            first = export._slots[0].conn
            assert first is not None
            done: list[int] = []
            first.submit_pread(bytearray(4096), 4096, 0, done.append)  # busy for 5 s
            buffer = bytearray(b"\xff" * 4096)
            with trio.fail_after(30):
                await export.pread_into(buffer, MiB + 4096)  # EINVAL on a 1 MiB connection
            assert buffer == bytes(4096)
        finally:
            export.close()
            for server in [*old, grown, later]:
                server.close()
            nursery.cancel_scope.cancel()


async def _all_alive(export: ExportConnections) -> None:
    with trio.fail_after(60):
        while not all(s.conn is not None and s.conn.alive for s in export._slots):
            await trio.sleep(0.5)


async def test_a_connection_a_refresh_could_not_make_is_made_again_later(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The connection a refresh retired comes back in the background, after a failed
    attempt too, with the new size: the export goes on with all its connections."""
    old = [Server(MiB), Server(MiB)]
    grown = Server(2 * MiB)
    later = Server(2 * MiB)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [grown, errno.ECONNRESET, errno.ECONNREFUSED, later])
        export = ExportConnections(URI, await _started(nursery, old), timeout=30.0, connect=dial)
        try:
            with trio.fail_after(10):
                assert await export.refresh() == 2 * MiB
            await _all_alive(export)
            assert dial.calls == 4
            sizes = [s.conn.client.get_size() for s in export._slots if s.conn is not None]
            assert sizes == [2 * MiB, 2 * MiB]
            with trio.fail_after(10):
                async with trio.open_nursery() as reads:  # both connections used
                    for _ in range(8):
                        reads.start_soon(export.pread_into, bytearray(4096), MiB)
            assert Command.READ in grown.commands and Command.READ in later.commands
        finally:
            export.close()
            for server in [*old, grown, later]:
                server.close()
            nursery.cancel_scope.cancel()


async def test_a_connection_a_refresh_could_not_make_is_tried_again_for_the_timeout_only(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A server that refuses every new connection after the refresh: the retired
    connection is tried again for the export's timeout, then no more."""
    old = [Server(MiB), Server(MiB)]
    grown = Server(2 * MiB)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [grown, errno.ECONNRESET])  # then refused for good
        export = ExportConnections(URI, await _started(nursery, old), timeout=30.0, connect=dial)
        try:
            start = trio.current_time()
            with trio.fail_after(10):
                assert await export.refresh() == 2 * MiB
            await trio.sleep(35 - (trio.current_time() - start))
            tried = dial.calls
            assert tried > 3  # tried again, more than once
            await trio.sleep(100)
            assert dial.calls == tried  # and then no more
            assert not export._remaking
        finally:
            export.close()
            for server in [*old, grown]:
                server.close()
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ stop


async def test_the_last_flush_is_answered_when_the_server_takes_longer_than_the_grace(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A server whose FLUSH takes 5 s (its fsync): the stop's grace does not cut it."""
    server = Server(MiB, delay=STOP_GRACE + 2)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [])
        export = ExportConnections(URI, await _started(nursery, [server]), connect=dial)
        try:
            export.stop()
            with trio.fail_after(60):
                await export.flush()
            assert server.commands == [Command.FLUSH]
            assert dial.calls == 0
        finally:
            export.close()
            server.close()
            nursery.cancel_scope.cancel()


async def test_the_last_flush_after_the_grace_goes_on_a_connection_kept_idle(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The mounting process flushes once its workers have ended, seconds after the
    stop: the connections that had nothing in flight are still there for it."""
    server = Server(MiB)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [])
        export = ExportConnections(URI, await _started(nursery, [server]), connect=dial)
        try:
            export.stop()
            await trio.sleep(STOP_GRACE + 10)
            with trio.fail_after(60):
                await export.flush()
            assert server.commands == [Command.FLUSH]
            assert dial.calls == 0
        finally:
            export.close()
            server.close()
            nursery.cancel_scope.cancel()


async def test_a_request_unanswered_after_the_grace_fails_and_the_last_flush_reconnects(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A read the server leaves unanswered fails once the grace is over (its connection
    closed); the last FLUSH then goes on a connection made for it."""
    silent = Server(MiB, delay=None)
    fresh = Server(MiB)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [fresh])
        export = ExportConnections(URI, await _started(nursery, [silent]), connect=dial)
        try:
            conn = export.ready_connection()
            assert conn is not None
            done: list[int] = []
            conn.submit_pread(bytearray(4096), 4096, 0, done.append)
            export.stop()
            await trio.sleep(STOP_GRACE / 2)
            assert done == []  # within the grace, it may still be answered
            await trio.sleep(STOP_GRACE)
            assert done and done[0] != 0 and not conn.alive
            with trio.fail_after(60):
                await export.flush()
            assert dial.calls == 1 and fresh.commands == [Command.FLUSH]
        finally:
            export.close()
            for server in (silent, fresh):
                server.close()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("sent", ["in a task", "without a task"])
async def test_a_request_unanswered_after_the_grace_fails_rather_than_going_to_another_connection(
    mock_clock: trio.testing.MockClock, sent: str
) -> None:
    """Two connections (multi-conn): a read on the silent one fails once the grace is
    over, and is not sent again on the other, idle one, which the last FLUSH uses.
    Both ways a request is sent: by a task (``pread_into``), and at once then
    ``resubmit`` when its connection is lost (the block file's fast path)."""
    silent = Server(MiB, delay=None)
    idle = Server(MiB)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [])
        export = ExportConnections(
            URI, await _started(nursery, [silent, idle]), timeout=120.0, connect=dial
        )
        try:
            outcome: list[BaseException | None] = []
            ended = trio.Event()

            async def read() -> None:
                try:
                    if sent == "in a task":
                        await export.pread_into(bytearray(4096), 0)
                    else:
                        conn = export.ready_connection()
                        assert conn is not None and conn is export._slots[0].conn  # silent
                        lost = trio.Event()
                        errors: list[int] = []

                        def done(error: int) -> None:
                            errors.append(error)
                            lost.set()

                        conn.submit_pread(bytearray(4096), 4096, 0, done)
                        await lost.wait()
                        assert errors[0] != 0 and not export.answer_of(conn, errors[0])
                        await export.resubmit(
                            conn, errors[0], lambda c: c.pread_into(bytearray(4096), 0)
                        )
                except ExportUnavailable as e:
                    outcome.append(e)
                else:
                    outcome.append(None)
                ended.set()

            nursery.start_soon(read)
            await trio.sleep(0.01)
            assert silent.commands == [Command.READ]
            export.stop()
            stopped = trio.current_time()
            with trio.fail_after(STOP_GRACE + 1):
                await ended.wait()
            assert isinstance(outcome[0], ExportUnavailable), outcome
            assert trio.current_time() - stopped >= STOP_GRACE  # the grace was given
            assert idle.commands == []  # not sent again there
            with trio.fail_after(60):
                await export.flush()
            assert idle.commands == [Command.FLUSH] and dial.calls == 0
        finally:
            export.close()
            for server in (silent, idle):
                server.close()
            nursery.cancel_scope.cancel()


async def test_a_stop_fails_what_waits_for_a_lost_server_at_once_the_last_flush_too(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The server is gone (its connection closed, nobody listens): a read waiting for it
    fails as soon as the stop comes, and the last FLUSH makes one attempt and fails."""
    server = Server(MiB)
    async with trio.open_nursery() as nursery:
        dial = Dialer(nursery, [])  # every connect refused
        export = ExportConnections(
            URI, await _started(nursery, [server]), timeout=120.0, connect=dial
        )
        try:
            server.sock.shutdown(socket.SHUT_RDWR)  # the server went away
            failed: list[BaseException] = []

            async def read() -> None:
                try:
                    await export.pread_into(bytearray(4096), 0)
                except ExportUnavailable as e:
                    failed.append(e)

            nursery.start_soon(read)
            await trio.sleep(10)
            assert failed == [] and dial.calls > 0  # waiting for the server
            stopped = trio.current_time()
            export.stop()
            await trio.sleep(0.01)
            assert len(failed) == 1
            attempts = dial.calls
            with pytest.raises(ExportUnavailable):
                await export.flush()
            assert dial.calls == attempts + 1
            assert trio.current_time() - stopped < 1.0  # mock time: no wait for anything
        finally:
            export.close()
            server.close()
            nursery.cancel_scope.cancel()


async def test_a_connection_made_after_the_stop_serves_the_last_flush_not_the_request(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A read waits for a new connection whose attempt began before the stop and ends
    after it: the read fails (it waited for a connection), and the connection is kept
    for the last FLUSH."""
    server = Server(MiB)
    fresh = Server(MiB)
    async with trio.open_nursery() as nursery:
        dial = GatedDialer(nursery, [fresh])
        export = ExportConnections(
            URI, await _started(nursery, [server]), timeout=120.0, connect=dial
        )
        try:
            server.sock.shutdown(socket.SHUT_RDWR)  # the server went away
            outcome: list[BaseException | None] = []
            ended = trio.Event()

            async def read() -> None:
                try:
                    await export.pread_into(bytearray(4096), 0)
                except ExportUnavailable as e:
                    outcome.append(e)
                else:
                    outcome.append(None)
                ended.set()

            nursery.start_soon(read)
            with trio.fail_after(5):
                await dial.dialling.wait()
            export.stop()
            dial.gate.set()
            with trio.fail_after(1):
                await ended.wait()
            assert isinstance(outcome[0], ExportUnavailable), outcome
            assert fresh.commands == []
            with trio.fail_after(60):
                await export.flush()
            assert fresh.commands == [Command.FLUSH] and dial.calls == 1
        finally:
            dial.gate.set()
            export.close()
            for each in (server, fresh):
                each.close()
            nursery.cancel_scope.cancel()
