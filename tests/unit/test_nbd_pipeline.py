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
import random
import socket
from collections.abc import Callable, Iterator

import pytest
import trio

from nbd import codec
from nbd.client import BlockSize, Negotiated
from nbd.constants import MAX_PAYLOAD, REQUEST_MAGIC, Command, TransmissionFlag
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


# ------------------------------------------------------------- block sizes


def sized(minimum: int, maximum: int) -> tuple[PipelinedConnection, socket.socket]:
    """A connection to an export that advertised these block sizes, and its server end."""
    ours, server = socket.socketpair()
    sizes = BlockSize(minimum, max(minimum, 512), maximum)
    negotiated = Negotiated(
        ours, "disk", EXPORT_SIZE, FLAGS | TransmissionFlag.SEND_TRIM, sizes, False
    )
    return PipelinedConnection(PlainClient(negotiated)), server


def test_block_sizes_the_handshake_did_not_tell_are_the_specs_defaults(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    client = pair[0].client
    assert (client.minimum, client.max_payload) == (1, MAX_PAYLOAD)


@pytest.mark.parametrize(
    ("minimum", "maximum", "step"),
    [
        (512, 65536, 65536),
        (4096, 10000, 8192),
        (4096, 1024, 4096),
        (1, (1 << 32) - 1, (1 << 32) - 1),
    ],
)
def test_the_longest_read_or_write_is_the_maximum_in_whole_blocks(
    minimum: int, maximum: int, step: int
) -> None:
    conn, server = sized(minimum, maximum)
    try:
        assert conn.client.minimum == minimum and conn.client.max_payload == step
    finally:
        conn.close()
        server.close()


async def test_a_request_not_aligned_to_the_minimum_block_is_refused_without_a_trace() -> None:
    """EINVAL before anything is recorded, for every command with an offset and a
    length (what libnbd's strict mode does); the next aligned request is the first
    the server sees."""
    conn, server = sized(4096, 1 << 20)
    try:
        out = Outcomes()
        refused: list[Callable[[], None]] = [
            lambda: conn.submit_pread(bytearray(4096), 4096, 512, out.done("r")),
            lambda: conn.submit_pread(bytearray(1000), 1000, 0, out.done("r2")),
            lambda: conn.submit_pwrite(b"x" * 4096, 2048, out.done("w")),
            lambda: conn.submit_pwrite(b"x" * 4097, 0, out.done("w2")),
        ]
        for submit in refused:
            with pytest.raises(NBDError) as e:
                submit()
            assert e.value.errno == errno.EINVAL
        for call in (
            conn.pread_into(bytearray(512), 0),
            conn.pwrite(b"y" * 4096, 100),
            conn.zero(4096, 4095),
            conn.trim(100, 0),
        ):
            with pytest.raises(NBDError) as e:
                await call
            assert e.value.errno == errno.EINVAL
        assert conn.in_flight == 0 and conn.alive
        assert all(calls == [] for calls in out.calls.values())
        assert not conn.expire(0.0, trio.current_time() + 1000)
        conn.submit_pread(bytearray(8192), 8192, 4096, out.done("ok"))
        seen = await trio.to_thread.run_sync(requests, server, 1)
        assert seen == [(0, Command.READ, 1, 4096, 8192)]
    finally:
        conn.close()
        server.close()


async def test_a_read_or_write_over_the_maximum_goes_in_parts_answered_as_one() -> None:
    """A server that advertised a 64 KiB maximum is never sent more in one request;
    the caller's one request completes once, when its last part is answered, with
    the parts' data where they belong."""
    conn, server = sized(512, 65536)
    try:
        length = 200 * 1024  # 3 parts of 64 KiB and one of 8 KiB
        parts = [(0, 65536), (65536, 65536), (131072, 65536), (196608, 8192)]
        data = random.Random(1).randbytes(length)
        out = Outcomes()
        conn.submit_pwrite(data, 1 << 20, out.done("w"))
        target = bytearray(length)
        conn.submit_pread(target, length, 2 << 20, out.done("r"))
        assert conn.in_flight == 8
        seen = await trio.to_thread.run_sync(requests_and_payloads, server, 8, 65536)
        assert [(r[1], r[3], r[4]) for r, _ in seen] == [
            (Command.WRITE, (1 << 20) + o, n) for o, n in parts
        ] + [(Command.READ, (2 << 20) + o, n) for o, n in parts]
        assert b"".join(p for _, p in seen[:4]) == data
        cookies = [r[2] for r, _ in seen]
        # answered last part first: nothing completes before the last part is answered
        for i in reversed(range(4)):
            assert out.calls == {"w": [], "r": []}
            offset, n = parts[i]
            stream = reply(cookies[i]) + reply(cookies[4 + i], 0, data[offset : offset + n])
            feed(conn, stream)
        assert out.calls == {"w": [0], "r": [0]}
        assert target == data and conn.in_flight == 0 and conn.alive
    finally:
        conn.close()
        server.close()


async def test_a_request_in_parts_fails_once_with_its_parts_error() -> None:
    conn, server = sized(512, 65536)
    try:
        out = Outcomes()
        conn.submit_pread(bytearray(3 * 65536), 3 * 65536, 0, out.done("r"))
        cookies = [
            r[2] for r, _ in await trio.to_thread.run_sync(requests_and_payloads, server, 3, 0)
        ]
        feed(conn, reply(cookies[0], 0, bytes(65536)) + reply(cookies[1], errno.ENOSPC))
        assert out.calls == {"r": []}  # a part is still in flight
        feed(conn, reply(cookies[2], 0, bytes(65536)))
        assert out.calls == {"r": [errno.ENOSPC]}
        # a connection that dies fails each unanswered part, the request once
        conn.submit_pwrite(bytes(4 * 65536), 0, out.done("w"))
        await trio.to_thread.run_sync(requests_and_payloads, server, 4, 65536)
        conn.close()
        assert out.calls == {"r": [errno.ENOSPC], "w": [errno.ENOTCONN]}
    finally:
        conn.close()
        server.close()


async def test_zeroes_and_trims_longer_than_the_maximum_go_whole() -> None:
    """They carry no payload: the spec lets their length exceed the maximum."""
    conn, server = sized(512, 65536)
    try:

        async def answer() -> None:
            for _ in range(2):
                ((request, _),) = await trio.to_thread.run_sync(requests_and_payloads, server, 1, 0)
                server.sendall(reply(request[2]))
                seen.append(request)

        seen: list[tuple[int, int, int, int, int]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            await conn.zero(1 << 20, 0)
            await conn.trim(1 << 20, 1 << 20)
        assert [(r[1], r[3], r[4]) for r in seen] == [
            (Command.WRITE_ZEROES, 0, 1 << 20),
            (Command.TRIM, 1 << 20, 1 << 20),
        ]
    finally:
        conn.close()
        server.close()


# ------------------------------------------------------------- the server side


def requests_and_payloads(
    server: socket.socket, count: int, piece: int
) -> list[tuple[tuple[int, int, int, int, int], bytes]]:
    """``count`` requests as the server reads them, ``piece`` bytes per recv at most
    (0: as much as there is), each with its payload (a WRITE's; else empty)."""
    server.settimeout(10)
    buffer = bytearray()

    def more() -> None:
        got = server.recv(piece or 1 << 20)
        if not got:
            raise ConnectionError("the client closed the connection")
        buffer.extend(got)

    out: list[tuple[tuple[int, int, int, int, int], bytes]] = []
    while len(out) < count:
        while len(buffer) < codec.REQUEST.size:
            more()
        magic, flags, type_, cookie, offset, length = codec.REQUEST.unpack_from(buffer)
        assert magic == REQUEST_MAGIC
        del buffer[: codec.REQUEST.size]
        payload = b""
        if type_ == Command.WRITE:
            while len(buffer) < length:
                more()
            payload = bytes(buffer[:length])
            del buffer[:length]
        out.append(((flags, type_, cookie, offset, length), payload))
    return out


# ------------------------------------------------------------- a full socket


class PartialSocket(CountingSocket):
    """The connection's socket, counting the ``sendmsg`` calls that sent only part."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.partial = 0

    def sendmsg(self, buffers: list[bytes]) -> int:
        sent = super().sendmsg(buffers)
        if sent < sum(memoryview(b).nbytes for b in buffers):
            self.partial += 1
        return sent


async def test_writes_through_a_full_socket_arrive_whole_and_in_order(
    pair: tuple[PipelinedConnection, socket.socket],
) -> None:
    """Several MiB of writes, with reads in between, into a socket the server empties
    7,777 bytes at a time: sendmsg sends part of a batch again and again, and every
    byte of every payload arrives where it belongs (a request resumed at the wrong
    offset, or its rest put on the wrong buffer, shows as a payload that differs)."""
    conn, server = pair
    partial = PartialSocket(conn._sock)
    conn._sock = partial  # type: ignore[assignment]
    rng = random.Random(22)
    out = Outcomes()
    expected: list[tuple[int, int, bytes]] = []  # (command, offset, payload), as queued

    def queue(sizes: list[int], base: int) -> None:
        for n in sizes:
            i = len(expected)
            offset, data = base + i * 4099, rng.randbytes(n)
            conn.submit_pwrite(data, offset, out.done(f"w{i}"))
            conn.submit_pread(bytearray(100), 100, offset, out.done(f"r{i}"))
            expected.extend([(Command.WRITE, offset, data), (Command.READ, offset, b"")])

    queue([3 << 20, 4096, (1 << 20) + 7, 5, 2 << 20], 0)  # one batch
    total = len(expected) + 4
    seen: list[tuple[tuple[int, int, int, int, int], bytes]] = []

    async def read_all() -> None:
        seen.extend(await trio.to_thread.run_sync(requests_and_payloads, server, total, 7777))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await trio.sleep(0.05)  # queued while the first batch is still being sent
        queue([(512 << 10) + 3, 1 << 20], 8 << 20)
    assert partial.partial > 0  # what this test is about did happen
    assert [(r[1], r[3], payload) for r, payload in seen] == expected
    for r, _ in seen:
        feed(conn, reply(r[2], 0, b"\x01" * 100 if r[1] == Command.READ else b""))
    assert all(calls == [0] for calls in out.calls.values()) and len(out.calls) == total
    assert conn.in_flight == 0 and conn.alive
