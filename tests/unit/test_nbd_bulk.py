"""Runs of large plain requests served by one thread (``nbd.bulk``).

A real image file and a real socketpair: the run is driven from a thread as
the transmission drives it, the client's side is a plain blocking socket.
What matters is what the client gets back, what lands in the file, where the
run stops (the request it leaves unread) and that it ends when told to.
"""

from __future__ import annotations

import errno
import gc
import os
import random
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from nbd import bulk, codec
from nbd.bulk import BulkRun, RunResult
from nbd.constants import (
    SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
    Command,
    CommandFlag,
    Errno,
    ReplyType,
    TransmissionFlag,
)
from nbd.exports import Export
from nbd.handshake import Session
from nbd.image import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, Image, fallocate
from nbd.transmission import HOLE_CHECK_MIN, Transmission, wire_errno
from nbd.transport import BufferPool, DataBuffer, Transport

SIZE = 8 << 20
HOLE = (6 << 20, 1 << 20)
KiB = 1024


class _Failing(Image):
    """Fails the write at ``fail_at`` with ENOSPC, a read over ``fail_read_at`` with EIO."""

    fail_at: int | None = None
    fail_read_at: int | None = None

    def read_into(self, buf: memoryview, offset: int) -> None:
        if self.fail_read_at is not None and offset <= self.fail_read_at < offset + len(buf):
            raise OSError(errno.EIO, "injected")
        super().read_into(buf, offset)

    def splice_to(self, pipe: int, offset: int, length: int) -> int:
        if self.fail_read_at is not None:
            if offset == self.fail_read_at:
                raise OSError(errno.EIO, "injected")
            length = min(length, 64 * KiB)  # several calls a read
        return super().splice_to(pipe, offset, length)

    def writev_timed(self, views: list[memoryview], offset: int) -> None:
        if offset == self.fail_at:
            raise OSError(errno.ENOSPC, "injected")
        super().writev_timed(views, offset)


@pytest.fixture
def image_path(tmp_path: Path) -> Path:
    path = tmp_path / "disk.img"
    path.write_bytes(random.Random(1).randbytes(SIZE))
    with path.open("r+b") as f:
        fallocate(f.fileno(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, *HOLE)
    return path


class _Rig:
    """A run over one end of a socketpair; the test is the client on the other."""

    def __init__(self, image: Image, structured: bool, stopping: Callable[[], bool]) -> None:
        ours, self.client = socket.socketpair()
        ours.setblocking(False)
        self._ours = ours
        self.client.settimeout(10)
        self.transport = Transport(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        self.image = image
        self.run = BulkRun(
            self.transport,
            image,
            BufferPool(),
            threading.Lock(),
            structured,
            512,
            False,
            stopping,
            HOLE_CHECK_MIN,
            lambda e, command, flags: int(wire_errno(e, command, flags)),
        )
        self.result: RunResult | None = None
        self._thread = threading.Thread(target=self._serve)

    def _serve(self) -> None:
        self.result = self.run.serve()

    def start(self) -> None:
        self._thread.start()

    def finish(self, timeout: float = 10) -> RunResult:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the run did not end"
        assert self.result is not None
        return self.result

    def send(self, data: bytes) -> threading.Thread:
        """Send from a thread of its own (the replies may fill the other direction)."""
        sender = threading.Thread(target=self.client.sendall, args=(data,))
        sender.start()
        return sender

    def exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.client.recv(n - len(out))
            assert got, "the server side closed"
            out += got
        return bytes(out)

    def simple_reply(self) -> tuple[int, int]:
        magic, error, cookie = struct.unpack(">IIQ", self.exact(16))
        assert magic == SIMPLE_REPLY_MAGIC
        return cookie, error

    def close(self) -> None:
        self.client.close()
        self.run.close()
        self._ours.close()  # trio's wrapper would need a running loop to close it
        self.image.close()


@pytest.fixture
def rig(image_path: Path) -> Iterator[Callable[..., _Rig]]:
    made: list[_Rig] = []

    def make(
        structured: bool = True, stopping: Callable[[], bool] = lambda: False, failing: bool = False
    ) -> _Rig:
        image = (_Failing if failing else Image)(image_path, read_only=False)
        r = _Rig(image, structured, stopping)
        made.append(r)
        return r

    yield make
    for r in made:
        r.run.cancelled = True
        r.finish()
        r.close()


def test_a_run_serves_large_writes_and_reads_and_leaves_the_next_request(
    rig: Callable[..., _Rig], image_path: Path
) -> None:
    r = rig(structured=True)
    rng = random.Random(2)
    data = {c: rng.randbytes(256 * KiB) for c in range(3)}
    wire = b"".join(
        codec.encode_request(Command.WRITE, c, c * 256 * KiB, 256 * KiB) + data[c] for c in data
    )
    # Read back the first two writes' ranges, as one read each.
    wire += codec.encode_request(Command.READ, 10, 0, 256 * KiB)
    wire += codec.encode_request(Command.READ, 11, 256 * KiB, 256 * KiB)
    small = codec.encode_request(Command.WRITE, 20, 0, 4 * KiB) + bytes(4 * KiB)
    sender = r.send(wire + small)
    r.start()
    assert sorted(r.simple_reply() for _ in data) == [(c, 0) for c in data]
    for cookie, offset in ((10, 0), (11, 256 * KiB)):
        magic, flags, type_, got_cookie, length = struct.unpack(">IHHQI", r.exact(20))
        assert (magic, flags, type_, got_cookie) == (
            STRUCTURED_REPLY_MAGIC,
            1,  # done
            int(ReplyType.OFFSET_DATA),
            cookie,
        )
        (got_offset,) = struct.unpack(">Q", r.exact(8))
        assert got_offset == offset and length == 8 + 256 * KiB
        assert r.exact(256 * KiB) == data[offset // (256 * KiB)]
    result = r.finish()
    sender.join()
    assert (result.requests, result.declined, result.error) == (5, True, None)
    assert (result.written_bytes, result.read_bytes) == (3 * 256 * KiB, 2 * 256 * KiB)
    assert result.service_ns > 0  # each request timed, for moorage_nbd_request_seconds
    # The small write is left to the event loop, whole and unread.
    t = r.transport
    t_buffered = bytes(t._rview[t._start : t._end])
    assert small.startswith(t_buffered) and len(t_buffered) >= 28
    with image_path.open("rb") as f:
        assert f.read(3 * 256 * KiB) == b"".join(data.values())


def test_a_read_over_a_hole_is_left_to_the_event_loop(rig: Callable[..., _Rig]) -> None:
    r = rig(structured=True)
    request = codec.encode_request(Command.READ, 1, HOLE[0] - 128 * KiB, 256 * KiB)
    r.send(request).join()
    r.start()
    result = r.finish()
    assert (result.requests, result.declined, result.error) == (0, True, None)
    t = r.transport
    assert bytes(t._rview[t._start : t._end]) == request
    r.client.setblocking(False)
    with pytest.raises(BlockingIOError):
        r.client.recv(1)  # nothing was answered


def test_flags_and_small_requests_are_left_to_the_event_loop(rig: Callable[..., _Rig]) -> None:
    for request in (
        codec.encode_request(Command.WRITE, 1, 0, 256 * KiB, CommandFlag.FUA),
        codec.encode_request(Command.READ, 1, 0, 64 * KiB),
        codec.encode_request(Command.FLUSH, 1, 0, 0),
        codec.encode_request(Command.READ, 1, SIZE - 128 * KiB, 256 * KiB),  # past the end
        codec.encode_request(Command.READ, 1, 100, 256 * KiB),  # unaligned
    ):
        r = rig()
        r.send(request).join()
        r.start()
        result = r.finish()
        assert (result.requests, result.declined) == (0, True), request
        t = r.transport
        assert bytes(t._rview[t._start : t._end]) == request


def test_a_quiet_socket_ends_the_run(rig: Callable[..., _Rig]) -> None:
    r = rig()
    r.start()
    result = r.finish()
    assert (result.requests, result.declined, result.error) == (0, False, None)


def test_a_write_is_answered_before_the_run_waits_for_more(
    rig: Callable[..., _Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies are gathered, but never held while the run waits for input."""
    monkeypatch.setattr(bulk, "IDLE", 3600.0)
    stop = threading.Event()
    r = rig(stopping=stop.is_set)
    r.start()
    for cookie in range(3):
        r.send(codec.encode_request(Command.WRITE, cookie, 0, 128 * KiB) + bytes(128 * KiB))
        assert r.simple_reply() == (cookie, 0)  # the run is still going
    stop.set()
    result = r.finish()
    assert (result.requests, result.declined, result.error) == (3, False, None)


def test_cancelling_a_run_that_waits_in_a_payload_ends_it(rig: Callable[..., _Rig]) -> None:
    r = rig()
    r.send(codec.encode_request(Command.WRITE, 1, 0, 256 * KiB) + bytes(100 * KiB)).join()
    r.start()
    time.sleep(0.1)  # the run now waits for the rest of the payload
    r.run.cancelled = True
    result = r.finish(timeout=5)
    assert result.error is not None and result.written_bytes == 0


def test_a_peer_that_leaves_in_a_payload_ends_the_run_with_an_error(
    rig: Callable[..., _Rig],
) -> None:
    r = rig()
    r.send(codec.encode_request(Command.WRITE, 1, 0, 256 * KiB) + bytes(100 * KiB)).join()
    r.client.shutdown(socket.SHUT_WR)
    r.start()
    result = r.finish()
    assert result.error is not None and result.written_bytes == 0


def test_a_failed_write_gets_its_error_and_the_run_goes_on(
    rig: Callable[..., _Rig],
) -> None:
    r = rig(failing=True)
    assert isinstance(r.image, _Failing)
    r.image.fail_at = 256 * KiB
    wire = b"".join(
        codec.encode_request(Command.WRITE, c, c * 256 * KiB, 256 * KiB) + bytes(256 * KiB)
        for c in range(3)
    )
    sender = r.send(wire)
    r.start()
    replies = dict(r.simple_reply() for _ in range(3))
    assert replies == {0: 0, 1: int(Errno.ENOSPC), 2: 0}
    result = r.finish()
    sender.join()
    assert (result.requests, result.errors, result.written_bytes) == (3, 1, 2 * 256 * KiB)


class _PeakPool(BufferPool):
    """Counts the buffers taken and not yet given back, and the most at once."""

    held = 0
    peak = 0

    def get(self, size: int) -> DataBuffer:
        self.held += 1
        self.peak = max(self.peak, self.held)
        return super().get(size)

    def put(self, buf: DataBuffer) -> None:
        self.held -= 1
        super().put(buf)


def test_after_a_slow_write_the_run_goes_on_with_one_buffer_at_a_time(
    rig: Callable[..., _Rig], image_path: Path
) -> None:
    # Handing the writes to the event loop here made it take a buffer for
    # each request the client had queued (up to 4 MiB per connection).
    r = rig()
    pool = r.run.pool = _PeakPool()
    r.image._blocking_writes_after = time.monotonic() + 3600  # a slow write just now
    rng = random.Random(5)
    data = {c: rng.randbytes(256 * KiB) for c in range(6)}
    wire = b"".join(
        codec.encode_request(Command.WRITE, c, c * 256 * KiB, 256 * KiB) + data[c] for c in data
    )
    sender = r.send(wire)
    r.start()
    replies = dict(r.simple_reply() for _ in data)
    assert replies == dict.fromkeys(data, 0)
    result = r.finish()
    sender.join()
    assert (result.requests, result.written_bytes, result.declined) == (6, 6 * 256 * KiB, False)
    assert (pool.peak, pool.held) == (1, 0)
    with open(image_path, "rb") as f:
        assert f.read(6 * 256 * KiB) == b"".join(data[c] for c in sorted(data))


class _CountingPool(BufferPool):
    """Counts the buffers taken: a read copied by the server takes one."""

    taken = 0

    def get(self, size: int) -> DataBuffer:
        self.taken += 1
        return super().get(size)


def _reads(r: _Rig, cookies_offsets: list[tuple[int, int]], length: int) -> bytes:
    return b"".join(codec.encode_request(Command.READ, c, o, length) for c, o in cookies_offsets)


def _simple_read_replies(r: _Rig, n: int, length: int) -> dict[int, tuple[int, bytes]]:
    """``n`` simple replies to reads of ``length``: cookie -> (error, data)."""
    out = {}
    for _ in range(n):
        cookie, error = r.simple_reply()
        out[cookie] = (error, r.exact(length) if not error else b"")
    return out


def test_a_read_goes_from_the_page_cache_to_the_socket_without_a_copy(
    rig: Callable[..., _Rig], image_path: Path
) -> None:
    r = rig(structured=False)
    pool = r.run.pool = _CountingPool()
    want = image_path.read_bytes()
    offsets = [(c, c * 512 * KiB) for c in range(4)]
    sender = r.send(_reads(r, offsets, 512 * KiB))
    r.start()
    replies = _simple_read_replies(r, 4, 512 * KiB)
    assert replies == {c: (0, want[o : o + 512 * KiB]) for c, o in offsets}
    result = r.finish()
    sender.join()
    assert (result.requests, result.read_bytes, result.errors) == (4, 4 * 512 * KiB, 0)
    assert pool.taken == 0  # spliced: no buffer held the data


def test_a_read_larger_than_the_pipe_is_copied(
    rig: Callable[..., _Rig], image_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk, "PIPE_SIZE", 64 * KiB)
    r = rig(structured=False)
    pool = r.run.pool = _CountingPool()
    want = image_path.read_bytes()
    offsets = [(1, 0), (2, 1024 * KiB)]
    sender = r.send(_reads(r, offsets, 256 * KiB))
    r.start()
    assert _simple_read_replies(r, 2, 256 * KiB) == {
        c: (0, want[o : o + 256 * KiB]) for c, o in offsets
    }
    r.finish()
    sender.join()
    assert pool.taken == 2


def test_a_read_the_file_fails_in_the_pipe_gets_its_error_and_the_run_goes_on(
    rig: Callable[..., _Rig], image_path: Path
) -> None:
    """A read error before the header went out is answered like a copied read's."""
    r = rig(structured=True, failing=True)
    assert isinstance(r.image, _Failing)
    # The read's first 64 KiB get into the pipe, then the file fails.
    r.image.fail_read_at = 320 * KiB
    want = image_path.read_bytes()
    sender = r.send(_reads(r, [(0, 0), (1, 256 * KiB), (2, 512 * KiB)], 256 * KiB))
    r.start()
    got: dict[int, tuple[int, bytes]] = {}
    for _ in range(3):
        magic, flags, type_, cookie, length = struct.unpack(">IHHQI", r.exact(20))
        assert magic == STRUCTURED_REPLY_MAGIC and flags == 1
        body = r.exact(length)
        if type_ == int(ReplyType.OFFSET_DATA):
            got[cookie] = (0, body[8:])
        else:
            assert type_ == int(ReplyType.ERROR)
            got[cookie] = (struct.unpack(">I", body[:4])[0], b"")
    assert got == {
        0: (0, want[: 256 * KiB]),
        1: (int(Errno.EIO), b""),
        2: (0, want[512 * KiB : 768 * KiB]),
    }
    result = r.finish()
    sender.join()
    assert (result.requests, result.errors, result.read_bytes) == (3, 1, 2 * 256 * KiB)


def test_a_read_past_the_end_of_a_shrunk_file_reads_zeroes(
    rig: Callable[..., _Rig], image_path: Path
) -> None:
    r = rig(structured=False)
    want = image_path.read_bytes()[: 128 * KiB] + bytes(128 * KiB)
    os.truncate(image_path, 128 * KiB)  # the image's size is still the old one
    sender = r.send(_reads(r, [(7, 0)], 256 * KiB))
    r.start()
    assert _simple_read_replies(r, 1, 256 * KiB) == {7: (0, want)}
    r.finish()
    sender.join()


def test_closing_a_run_closes_its_pipe(rig: Callable[..., _Rig]) -> None:
    before = set(os.listdir("/proc/self/fd"))
    r = rig(structured=False)
    opened = set(os.listdir("/proc/self/fd")) - before
    sender = r.send(_reads(r, [(1, 0)], 256 * KiB))
    r.start()
    _simple_read_replies(r, 1, 256 * KiB)
    r.finish()
    sender.join()
    with_pipe = set(os.listdir("/proc/self/fd")) - before - opened
    assert len(with_pipe) == 3  # the pipe's two ends and the socket's duplicate
    r.run.close()
    assert set(os.listdir("/proc/self/fd")) - before - opened == set()


# ------------------------------------------------------- through the transmission


def _session(path: Path, image: Image) -> Session:
    return Session(
        export=Export("x", path),
        image=image,
        flags=TransmissionFlag.HAS_FLAGS,
        structured=False,
        base_allocation=False,
        tls=False,
    )


def _transmission(path: Path) -> tuple[Transmission, trio.SocketStream]:
    """A transmission on a plain socket (it has a reply thread, so it uses runs); the client."""
    ours, theirs = trio.socket.socketpair()
    image = Image(path, read_only=False)
    tx = Transmission(
        Transport(trio.SocketStream(ours)), _session(path, image), trio.CapacityLimiter(2), "t"
    )
    return tx, trio.SocketStream(theirs)


async def test_a_sequential_copy_passes_the_event_loop_once_per_run(
    image_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[RunResult] = []
    serve = BulkRun.serve

    def counted(self: BulkRun) -> RunResult:
        result = serve(self)
        runs.append(result)
        return result

    monkeypatch.setattr(BulkRun, "serve", counted)
    tx, client = _transmission(image_path)
    data = random.Random(3).randbytes(4 << 20)
    wire = b"".join(
        codec.encode_request(Command.WRITE, c, c * 256 * KiB, 256 * KiB)
        + data[c * 256 * KiB : (c + 1) * 256 * KiB]
        for c in range(16)
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.run)
            await client.send_all(wire + codec.encode_request(Command.FLUSH, 99, 0, 0))
            pending = bytearray()
            while len(pending) < 17 * 16:
                got = await client.receive_some(4096)
                assert got
                pending += got
            errors = {struct.unpack_from(">IIQ", pending, i)[1] for i in range(0, len(pending), 16)}
            assert errors == {0}
            await client.send_all(codec.encode_request(Command.DISC, 0, 0, 0))
    assert image_path.read_bytes()[: 4 << 20] == data
    # All 16 writes in runs, started by the loop far fewer times than that.
    assert sum(r.requests for r in runs) == 16
    assert len([r for r in runs if r.requests]) <= 4
    assert tx.stats.written_bytes == 4 << 20
    # The runs' service time reaches the export's counter (the FLUSH adds its own).
    assert tx.stats.service_ns >= sum(r.service_ns for r in runs) > 0


async def test_a_connection_closed_while_a_run_waits_ends_at_once(
    image_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export goes away (its connections' scopes are cancelled) in the middle of a payload."""
    monkeypatch.setattr(bulk, "IDLE", 3600.0)
    tx, client = _transmission(image_path)
    run = None
    with trio.fail_after(10):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tx.run)
                await client.send_all(
                    codec.encode_request(Command.WRITE, 1, 0, 256 * KiB) + bytes(256 * KiB)
                )
                pending = bytearray()
                while len(pending) < 16:
                    pending += await client.receive_some(16)
                await client.send_all(codec.encode_request(Command.WRITE, 2, 0, 256 * KiB))
                await trio.sleep(0.1)  # the run waits for that payload
                run = tx._bulk
                assert run is not None
                scope.cancel()
    assert scope.cancelled_caught
    assert run is not None and run.cancelled


async def test_stop_reading_ends_a_run_that_waits_for_a_request(
    image_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk, "IDLE", 3600.0)
    tx, client = _transmission(image_path)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.run)
            await client.send_all(
                codec.encode_request(Command.WRITE, 1, 0, 256 * KiB) + bytes(256 * KiB)
            )
            pending = bytearray()
            while len(pending) < 16:
                pending += await client.receive_some(16)
            assert struct.unpack(">IIQ", pending) == (SIMPLE_REPLY_MAGIC, 0, 1)
            await trio.sleep(0.1)  # the run waits for the next request
            tx.stop_reading()
    # tx.run returned by itself: the nursery closed without a cancel.


async def test_a_finished_connection_frees_its_run_without_the_cycle_collector(
    image_path: Path,
) -> None:
    """The run's pooled buffers (up to a few MiB) go as soon as the connection does."""
    tx, client = _transmission(image_path)
    gc.disable()
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tx.run)
                await client.send_all(
                    codec.encode_request(Command.WRITE, 1, 0, 256 * KiB) + bytes(256 * KiB)
                )
                pending = bytearray()
                while len(pending) < 16:
                    pending += await client.receive_some(16)
                assert tx._bulk is not None
                run = weakref.ref(tx._bulk)
                await client.send_all(codec.encode_request(Command.DISC, 0, 0, 0))
        assert run() is None, "the run outlived its connection"
    finally:
        gc.enable()
