"""Large reads and writes, whose data goes through page-aligned buffers.

A real image (with holes) and a socketpair or an in-memory stream (as TLS
and stdio connections have): what matters is the data each read gets back,
what the writes leave in the file, and the error a failed read gets.
"""

from __future__ import annotations

import ctypes
import errno
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from nbd import codec
from nbd.constants import (
    SIMPLE_REPLY_MAGIC,
    Command,
    CommandFlag,
    Errno,
    ReplyType,
    TransmissionFlag,
)
from nbd.exports import Export
from nbd.handshake import Session
from nbd.image import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, Image, fallocate
from nbd.sender import ThreadedReplies
from nbd.transmission import Transmission
from nbd.transport import ALIGNED_MIN, ReplyQueue, Transport

SIZE = 8 * 1024 * 1024
HOLES = [(1 << 20, 256 * 1024), (3 << 20, 64 * 1024), (5 << 20, 1 << 20)]


class _Recorded(Image):
    """An image that notes its reads' buffers and can be told to fail one."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, read_only=False)
        self.addresses: list[int] = []  # where each large read's data went
        self.fail_at: int | None = None

    def read_nowait(self, buf: memoryview, offset: int) -> int:
        self._note(buf, offset)
        return super().read_nowait(buf, offset)

    def read_into(self, buf: memoryview, offset: int) -> None:
        self._note(buf, offset)
        super().read_into(buf, offset)

    def splice_to(self, pipe: int, offset: int, length: int) -> int:
        # A large read without a copy (a run of large reads, nbd.bulk)
        if offset == self.fail_at:
            raise OSError(errno.EIO, "injected read error")
        return super().splice_to(pipe, offset, length)

    def _note(self, buf: memoryview, offset: int) -> None:
        if len(buf) >= ALIGNED_MIN:
            self.addresses.append(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
        if offset == self.fail_at:
            raise OSError(errno.EIO, "injected read error")


def _image(tmp_path: Path, rng: random.Random) -> tuple[Path, bytes]:
    path = tmp_path / "disk.img"
    content = bytearray(rng.randbytes(SIZE))
    path.write_bytes(content)
    with path.open("r+b") as f:
        for offset, length in HOLES:
            fallocate(f.fileno(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
            content[offset : offset + length] = bytes(length)
    return path, bytes(content)


async def _exact(stream: trio.abc.ReceiveStream, n: int, pending: bytearray) -> bytes:
    while len(pending) < n:
        got = await stream.receive_some(65536)
        assert got, "server closed the connection"
        pending += got
    out = bytes(pending[:n])
    del pending[:n]
    return out


async def _replies(
    stream: trio.abc.ReceiveStream, reads: dict[int, tuple[int, int]], structured: bool
) -> dict[int, tuple[int, bytes]]:
    """Cookie -> (error, data) for each read; ``reads``: cookie -> (offset, length)."""
    pending = bytearray()
    parts: dict[int, bytearray] = {c: bytearray(n) for c, (_, n) in reads.items()}
    errors: dict[int, int] = {}
    done: set[int] = set()
    while len(done) < len(reads):
        (magic,) = struct.unpack(">I", await _exact(stream, 4, pending))
        if magic == SIMPLE_REPLY_MAGIC:
            error, cookie = struct.unpack(">IQ", await _exact(stream, 12, pending))
            if error:
                errors[cookie] = error
            else:
                parts[cookie][:] = await _exact(stream, reads[cookie][1], pending)
            done.add(cookie)
            continue
        assert structured, "a structured reply on a connection without them"
        flags, type_, cookie, length = struct.unpack(">HHQI", await _exact(stream, 16, pending))
        body = await _exact(stream, length, pending)
        start = reads[cookie][0]
        if type_ == ReplyType.OFFSET_DATA:
            (offset,) = struct.unpack_from(">Q", body)
            parts[cookie][offset - start : offset - start + length - 8] = body[8:]
        elif type_ == ReplyType.OFFSET_HOLE:
            offset, hole = struct.unpack(">QI", body)
            parts[cookie][offset - start : offset - start + hole] = bytes(hole)
        else:
            assert type_ == ReplyType.ERROR, f"unexpected chunk type {type_}"
            errors[cookie] = struct.unpack_from(">I", body)[0]
        if flags & 1:
            done.add(cookie)
    return {c: (errors.get(c, 0), b"" if c in errors else bytes(parts[c])) for c in reads}


def _requests(rng: random.Random, count: int) -> dict[int, tuple[int, int]]:
    """Reads over 64 KiB (up to 1 MiB), some over the holes, some with DF."""
    reads: dict[int, tuple[int, int]] = {}
    for cookie in range(count):
        length = rng.choice([64 * 1024 + 512, 256 * 1024, 300 * 1024, 1 << 20, 3 << 20])
        if cookie % 4 == 0:  # across a hole's edge
            hole, _ = HOLES[cookie % len(HOLES)]
            offset = max(0, hole - length // 2) // 512 * 512
        else:
            offset = rng.randrange(0, SIZE - length) // 512 * 512
        reads[cookie] = (offset, length)
    return reads


async def _serve_reads(
    tx: Transmission,
    client: trio.abc.Stream,
    reads: dict[int, tuple[int, int]],
    structured: bool,
    df: set[int] = frozenset(),  # type: ignore[assignment]
) -> dict[int, tuple[int, bytes]]:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.run)
            wire = b"".join(
                codec.encode_request(
                    Command.READ, c, offset, length, CommandFlag.DF if c in df else 0
                )
                for c, (offset, length) in reads.items()
            )
            await client.send_all(wire)
            got = await _replies(client, reads, structured)
            await client.send_all(codec.encode_request(Command.DISC, 0, 0, 0))
    return got


def _session(path: Path, image: Image, structured: bool) -> Session:
    return Session(
        export=Export("x", path),
        image=image,
        flags=TransmissionFlag.HAS_FLAGS,
        structured=structured,
        base_allocation=False,
        tls=False,
    )


@pytest.mark.parametrize("structured", [False, True])
async def test_large_reads_arrive_whole_read_into_aligned_buffers(
    tmp_path: Path, structured: bool
) -> None:
    rng = random.Random(22)
    path, content = _image(tmp_path, rng)
    image = _Recorded(path)
    ours, theirs = trio.socket.socketpair()
    tx = Transmission(
        Transport(trio.SocketStream(ours)),
        _session(path, image, structured),
        trio.CapacityLimiter(2),
        "t",
    )
    assert isinstance(tx.replies, ThreadedReplies)
    reads = _requests(rng, 64)
    df = {c for c in reads if c % 5 == 0} if structured else set()
    got = await _serve_reads(tx, trio.SocketStream(theirs), reads, structured, df)
    assert got == {c: (0, content[o : o + n]) for c, (o, n) in reads.items()}
    # Every large read went into a 64-byte aligned buffer (a fast kernel copy).
    assert image.addresses
    assert all(address % 64 == 0 for address in image.addresses)


@pytest.mark.parametrize("structured", [False, True])
async def test_a_failed_large_read_gets_its_error_and_the_others_their_data(
    tmp_path: Path, structured: bool
) -> None:
    rng = random.Random(7)
    path, content = _image(tmp_path, rng)
    image = _Recorded(path)
    reads = {c: (c * 512 * 1024, 256 * 1024) for c in range(8)}
    image.fail_at = reads[3][0]
    ours, theirs = trio.socket.socketpair()
    tx = Transmission(
        Transport(trio.SocketStream(ours)),
        _session(path, image, structured),
        trio.CapacityLimiter(2),
        "t",
    )
    got = await _serve_reads(tx, trio.SocketStream(theirs), reads, structured)
    expected = {c: (0, content[o : o + n]) for c, (o, n) in reads.items()}
    expected[3] = (int(Errno.EIO), b"")
    assert got == expected


async def test_a_stream_that_is_not_a_plain_socket_gets_the_same_data(tmp_path: Path) -> None:
    """TLS and stdio streams: no reply thread, replies through trio, the same data."""
    rng = random.Random(3)
    path, content = _image(tmp_path, rng)
    image = _Recorded(path)
    ours, theirs = trio.testing.memory_stream_pair()
    tx = Transmission(Transport(ours), _session(path, image, True), trio.CapacityLimiter(2), "t")
    assert isinstance(tx.replies, ReplyQueue)
    reads = _requests(rng, 16)
    got = await _serve_reads(tx, theirs, reads, True)
    assert got == {c: (0, content[o : o + n]) for c, (o, n) in reads.items()}
    assert image.addresses and all(address % 64 == 0 for address in image.addresses)


class _WriteRecorded(_Recorded):
    """Notes where each large write's payload came from."""

    def write_inline(self, data: memoryview, offset: int) -> bool:
        self._note(data, -1)
        return super().write_inline(data, offset)

    def writev_timed(self, views: list[memoryview], offset: int, *rest: Any) -> None:
        for view in views:
            self._note(view, -1)
        super().writev_timed(views, offset, *rest)

    def write(self, data: memoryview, offset: int, fua: bool = False) -> None:
        self._note(data, -1)
        super().write(data, offset, fua)


@pytest.mark.parametrize("plain", [True, False])
async def test_large_writes_land_whole_from_aligned_buffers(tmp_path: Path, plain: bool) -> None:
    """Sequential and scattered large writes, some with FUA (a worker thread)."""
    rng = random.Random(11)
    path, content = _image(tmp_path, rng)
    expected = bytearray(content)
    image = _WriteRecorded(path)
    if plain:
        ours, theirs = trio.socket.socketpair()
        server: trio.abc.Stream = trio.SocketStream(ours)
        client: trio.abc.Stream = trio.SocketStream(theirs)
    else:
        server, client = trio.testing.memory_stream_pair()
    tx = Transmission(Transport(server), _session(path, image, True), trio.CapacityLimiter(2), "t")
    wire = bytearray()
    cookies = []
    # Writes in flight together must not overlap (the protocol does not order
    # them): each range is written once, the image from start to end.
    offset = 0
    for cookie in range(64):
        length = rng.choice([64 * 1024 + 512, 256 * 1024, 1 << 20, 3 << 20])
        if offset + length > SIZE:
            break
        data = rng.randbytes(length)
        flags = CommandFlag.FUA if cookie % 5 == 0 else 0
        wire += codec.encode_request(Command.WRITE, cookie, offset, length, flags) + data
        expected[offset : offset + length] = data
        cookies.append(cookie)
        offset += length
        if cookie % 6 == 5:
            wire += codec.encode_request(Command.FLUSH, 1000 + cookie, 0, 0)
            cookies.append(1000 + cookie)
    assert len(cookies) > 8
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.run)
            await client.send_all(bytes(wire))
            pending = bytearray()
            for _ in cookies:
                magic, error, _cookie = struct.unpack(">IIQ", await _exact(client, 16, pending))
                assert (magic, error) == (SIMPLE_REPLY_MAGIC, 0)
            await client.send_all(codec.encode_request(Command.DISC, 0, 0, 0))
    assert path.read_bytes() == bytes(expected)
    assert image.addresses and all(address % 64 == 0 for address in image.addresses)
