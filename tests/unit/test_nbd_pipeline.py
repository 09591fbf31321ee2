"""nbd.pipeline's transmission client: requests on the wire, replies parsed from any
split of the byte stream, and a connection that dies failing every request once.

The server is the other end of a socketpair (this test writes its bytes), or the
parser is fed directly (``_space``/``_received``, what the reply reader does
after each ``recv_into``).  The real server and the loop device are in
tests/integration/test_fuse_block_io.py.
"""

from __future__ import annotations

import ctypes
import errno
import socket
from collections.abc import Callable, Iterator

import pytest
import trio

from nbd import codec
from nbd.client import Negotiated
from nbd.constants import REQUEST_MAGIC, Command, TransmissionFlag
from nbd.libnbd import NBDError
from nbd.pipeline import PipelinedConnection, PlainClient, is_plain

FLAGS = (
    TransmissionFlag.HAS_FLAGS
    | TransmissionFlag.SEND_FLUSH
    | TransmissionFlag.SEND_WRITE_ZEROES
    | TransmissionFlag.CAN_MULTI_CONN
)

EXPORT_SIZE = 16 << 20


@pytest.fixture
def pair() -> Iterator[tuple[PipelinedConnection, socket.socket]]:
    ours, server = socket.socketpair()
    conn = PipelinedConnection(
        PlainClient(Negotiated(ours, "disk", EXPORT_SIZE, FLAGS, None, False))
    )
    try:
        yield conn, server
    finally:
        conn.close()
        server.close()


class Outcomes:
    """Completion callbacks that remember every call."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}

    def done(self, name: str) -> Callable[[int], None]:
        self.calls[name] = []
        return self.calls[name].append


def reply(cookie: int, error: int = 0, data: bytes = b"") -> bytes:
    return codec.encode_simple_reply(cookie, error) + data


def feed(conn: PipelinedConnection, data: bytes) -> None:
    """What the reply reader does with ``data`` arriving, however it is split."""
    while data:
        space = conn._space()
        n = min(len(space), len(data))
        space[:n] = data[:n]
        conn._received(n)
        data = data[n:]


def requests(server: socket.socket, count: int) -> list[tuple[int, int, int, int, int]]:
    """``count`` requests as the server reads them: (flags, type, cookie, offset, length),
    a write's payload skipped."""
    server.settimeout(5)
    buffer = b""
    out: list[tuple[int, int, int, int, int]] = []
    while len(out) < count:
        while len(buffer) < codec.REQUEST.size:
            buffer += server.recv(65536)
        magic, flags, type_, cookie, offset, length = codec.REQUEST.unpack_from(buffer)
        assert magic == REQUEST_MAGIC
        buffer = buffer[codec.REQUEST.size :]
        if type_ == Command.WRITE:
            while len(buffer) < length:
                buffer += server.recv(65536)
            buffer = buffer[length:]
        out.append((flags, type_, cookie, offset, length))
    return out


def test_plain_uris_only() -> None:
    assert is_plain("nbd://127.0.0.1:10809/disk")
    assert is_plain("nbd+unix:///disk?socket=/run/x.sock")
    assert not is_plain("nbds://127.0.0.1/disk")
    assert not is_plain("nbds+unix:///disk?socket=/run/x.sock")
    assert not is_plain("http://x/y")


def test_what_the_handshake_told(pair: tuple[PipelinedConnection, socket.socket]) -> None:
    client = pair[0].client
    assert client.get_size() == EXPORT_SIZE
    assert client.can_flush() and client.can_zero() and client.can_multi_conn()
    assert not client.is_read_only() and not client.can_trim()


async def test_replies_split_at_every_byte_out_of_order_with_an_error() -> None:
    data_a, data_b = bytes(range(7)), b"\xaa" * 9
    ids = {"a": 1, "w": 2, "bad": 3, "odd": 4, "b": 5}  # cookies in the order sent
    # replies out of order: b, the write, a read failing, another, a
    stream = (
        reply(ids["b"], 0, data_b)
        + reply(ids["w"])
        + reply(ids["bad"], errno.EIO)
        + reply(ids["odd"], 12345)  # not an NBD error: EIO
        + reply(ids["a"], 0, data_a)
    )
    for split in range(len(stream) + 1):
        ours, server = socket.socketpair()
        conn = PipelinedConnection(
            PlainClient(Negotiated(ours, "disk", EXPORT_SIZE, FLAGS, None, False))
        )
        try:
            out = Outcomes()
            target_a = (ctypes.c_char * 7)()  # what the block file passes
            target_b = bytearray(9)
            bad = bytearray(4)
            conn.submit_pread(target_a, 7, 0, out.done("a"))
            conn.submit_pwrite(b"x" * 512, 4096, out.done("w"))
            conn.submit_pread(bad, 4, 0, out.done("bad"))
            conn.submit_pread(bytearray(4), 4, 0, out.done("odd"))
            conn.submit_pread(target_b, 9, 8192, out.done("b"))
            assert conn.in_flight == 5
            feed(conn, stream[:split])
            feed(conn, stream[split:])
            assert out.calls == {
                "a": [0],
                "w": [0],
                "bad": [errno.EIO],
                "odd": [errno.EIO],
                "b": [0],
            }
            assert bytes(target_a) == data_a and target_b == data_b and bad == bytearray(4)
            assert conn.in_flight == 0 and conn.alive
        finally:
            conn.close()
            server.close()


async def test_requests_go_out_as_the_protocol_says(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    conn, server = pair
    out = Outcomes()
    for i in range(40):
        conn.submit_pread(bytearray(4096), 4096, i * 4096, out.done(f"r{i}"))
    conn.submit_pwrite(b"w" * 100, 1 << 19, out.done("w"))
    await trio.testing.wait_all_tasks_blocked()  # the sender ran
    seen = await trio.to_thread.run_sync(requests, server, 41)
    assert [r[1] for r in seen] == [Command.READ] * 40 + [Command.WRITE]
    assert [r[3] for r in seen[:40]] == [i * 4096 for i in range(40)]
    assert seen[40][3:] == (1 << 19, 100)
    assert len({r[2] for r in seen}) == 41  # every cookie its own

    # the awaitable methods, answered by the "server"
    async def answer(count: int) -> None:
        for _ in range(count):  # one at a time: each call waits for its reply
            ((flags, type_, cookie, offset, length),) = await trio.to_thread.run_sync(
                requests, server, 1
            )
            data = b"\x5a" * length if type_ == Command.READ else b""
            server.sendall(reply(cookie, 0, data))
            answered.append((flags, type_, cookie, offset, length))

    answered: list[tuple[int, int, int, int, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer, 3)
        buffer = bytearray(3000)
        await conn.pread_into(buffer, 12345)
        await conn.flush()
        await conn.zero(8192, 65536, 2)
    assert buffer == b"\x5a" * 3000
    assert [(r[0], r[1], r[3], r[4]) for r in answered] == [
        (0, Command.READ, 12345, 3000),
        (0, Command.FLUSH, 0, 0),
        (2, Command.WRITE_ZEROES, 65536, 8192),
    ]


async def test_a_large_read_is_received_into_its_buffer(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    """Data longer than the receive buffer, sent in pieces: it still lands whole."""
    conn, server = pair
    size = 3 << 20
    payload = bytes(i % 251 for i in range(size))
    target = bytearray(size)
    result: list[int] = []
    conn.submit_pread(target, size, 0, result.append)
    (cookie,) = [r[2] for r in await trio.to_thread.run_sync(requests, server, 1)]
    await trio.to_thread.run_sync(server.sendall, reply(cookie, 0, payload))
    with trio.fail_after(10):
        while not result:
            await trio.sleep(0.01)
    assert result == [0] and target == payload


async def test_a_reply_to_no_request_kills_the_connection_and_fails_each_once(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    conn, server = pair
    out = Outcomes()
    conn.submit_pread(bytearray(512), 512, 0, out.done("a"))
    conn.submit_pwrite(b"z" * 512, 512, out.done("b"))
    got = await trio.to_thread.run_sync(requests, server, 2)
    server.sendall(reply(max(r[2] for r in got) + 100))
    with trio.fail_after(10):
        while conn.alive:
            await trio.sleep(0.01)
    assert out.calls == {"a": [errno.EPROTO], "b": [errno.EPROTO]}
    assert conn.in_flight == 0
    with pytest.raises(NBDError) as e:
        conn.submit_pread(bytearray(1), 1, 0, out.done("late"))
    assert e.value.errno == errno.EPROTO and out.calls["late"] == []
    conn.close()  # nothing is failed twice
    assert out.calls == {"a": [errno.EPROTO], "b": [errno.EPROTO], "late": []}


async def test_a_bad_magic_kills_the_connection(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    conn, _ = pair
    out = Outcomes()
    conn.submit_pread(bytearray(8), 8, 0, out.done("a"))
    feed(conn, b"\x00" * 16)
    assert not conn.alive and out.calls == {"a": [errno.EPROTO]}


async def test_a_read_cut_in_its_data_fails_once_when_the_server_goes(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    conn, server = pair
    out = Outcomes()
    conn.submit_pread(bytearray(4096), 4096, 0, out.done("a"))
    conn.submit_pread(bytearray(4096), 4096, 0, out.done("b"))
    got = await trio.to_thread.run_sync(requests, server, 2)
    server.sendall(reply(got[0][2], 0, b"\x01" * 100))  # a's data, cut short
    server.shutdown(socket.SHUT_WR)
    with trio.fail_after(10):
        while conn.alive:
            await trio.sleep(0.01)
    assert out.calls == {"a": [errno.ECONNRESET], "b": [errno.ECONNRESET]}


async def test_the_watchdog_expires_a_stalled_connection(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    conn, _ = pair
    out = Outcomes()
    conn.submit_pread(bytearray(8), 8, 0, out.done("a"))
    sent = trio.current_time()
    assert not conn.expire(5.0, sent + 4.9) and conn.alive
    assert conn.expire(5.0, sent + 5.0)
    assert conn.stalled_since is not None and conn.stalled_since <= sent + 0.001
    assert out.calls == {"a": [errno.ETIMEDOUT]}
    with pytest.raises(NBDError):
        await conn.flush()


async def test_close_fails_what_is_in_flight_once(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    conn, _ = pair
    out = Outcomes()
    conn.submit_pread(bytearray(8), 8, 0, out.done("a"))
    conn.close()
    conn.close()
    assert out.calls == {"a": [errno.ENOTCONN]} and not conn.alive


async def test_a_read_whose_data_stops_coming_is_expired(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    """The watchdog sees a read whose reply began but whose data stalled."""
    conn, _ = pair
    out = Outcomes()
    conn.submit_pread(bytearray(4096), 4096, 0, out.done("a"))
    sent = trio.current_time()
    feed(conn, reply(1, 0, b"\x01" * 10))
    assert conn.in_flight == 1 and out.calls == {"a": []}
    assert not conn.expire(5.0, sent + 4.9)
    assert conn.expire(5.0, sent + 5.0)
    assert out.calls == {"a": [errno.ETIMEDOUT]} and conn.in_flight == 0


class CountingSocket:
    """The connection's socket, counting ``sendmsg`` calls."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sendmsgs = 0

    def sendmsg(self, buffers: list[bytes]) -> int:
        self.sendmsgs += 1
        return self.sock.sendmsg(buffers)

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


async def test_a_batch_of_requests_leaves_in_one_sendmsg(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    conn, server = pair
    counting = CountingSocket(conn._sock)
    conn._sock = counting  # type: ignore[assignment]
    out = Outcomes()
    for i in range(32):  # what one /dev/fuse wake-up queues, without yielding
        conn.submit_pread(bytearray(4096), 4096, i * 4096, out.done(f"r{i}"))
    await trio.testing.wait_all_tasks_blocked()
    assert counting.sendmsgs == 1
    assert len(await trio.to_thread.run_sync(requests, server, 32)) == 32


@pytest.mark.parametrize(
    ("offset", "length", "target"),
    [
        (-1, 8, 8),  # negative offset
        (EXPORT_SIZE - 4, 8, 8),  # past the end
        (0, 1 << 32, 8),  # a length the header cannot carry
        (0, 8, 4),  # a buffer shorter than the read
    ],
)
async def test_a_refused_request_leaves_no_trace(
    pair: tuple[PipelinedConnection, socket.socket], offset: int, length: int, target: int
) -> None:
    """EINVAL before anything is recorded: nothing in flight, no callback, the
    connection alive and serving the next request."""
    conn, server = pair
    result: list[int] = []
    with pytest.raises(NBDError) as refused:
        conn.submit_pread(bytearray(target), length, offset, result.append)
    assert refused.value.errno == errno.EINVAL
    assert conn.in_flight == 0 and conn.alive and not result
    conn.submit_pread(bytearray(8), 8, 0, result.append)
    (cookie,) = [r[2] for r in await trio.to_thread.run_sync(requests, server, 1)]
    await trio.to_thread.run_sync(server.sendall, reply(cookie, 0, b"12345678"))
    with trio.fail_after(10):
        while not result:
            await trio.sleep(0.01)
    assert result == [0]
