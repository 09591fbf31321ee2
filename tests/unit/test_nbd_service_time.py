"""The time the NBD server spends on each request (ExportStats.service_ns): from
reading its header to queueing its reply, whichever way it is served.

A real image and a socketpair; the clock the transmission reads is one that
moves a fixed step each time it is read, so what is counted is known exactly
without timing anything: a path that reads it once at the start and once at
the end adds one step per request.  The reads are counted too: two per batch
or per request served alone, none for a batch that serves nothing (the hot
path pays for no clock it does not use).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from nbd import codec, transmission
from nbd.constants import SIMPLE_REPLY_MAGIC, Command, CommandFlag, TransmissionFlag
from nbd.exports import Export
from nbd.handshake import Session
from nbd.image import Image
from nbd.transmission import Transmission
from nbd.transport import Transport

SIZE = 1 << 20
STEP = 1000  # nanoseconds the fake clock moves each time it is read


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The fake clock's time, in a list: over STEP, how many times it was read."""
    now = [0]

    def read() -> int:
        now[0] += STEP
        return now[0]

    monkeypatch.setattr(transmission, "monotonic_ns", read)
    yield now


async def _exact(sock: trio.socket.SocketType, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = await sock.recv(n - len(out))
        assert got, "server closed the connection"
        out += got
    return bytes(out)


async def _reply(sock: trio.socket.SocketType, read_length: int = 0) -> tuple[int, int]:
    magic, error, cookie = struct.unpack(">IIQ", await _exact(sock, 16))
    assert magic == SIMPLE_REPLY_MAGIC
    if not error and read_length:
        await _exact(sock, read_length)
    return cookie, error


async def test_each_request_counts_the_time_from_its_header_to_its_reply(
    tmp_path: Path, clock: list[int]
) -> None:
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(SIZE))
    image = Image(path, read_only=False)
    session = Session(
        export=Export("x", path),
        image=image,
        flags=TransmissionFlag.HAS_FLAGS | TransmissionFlag.SEND_FUA,
        structured=False,
        base_allocation=False,
        tls=False,
    )
    ours, theirs = trio.socket.socketpair()
    tx = Transmission(Transport(trio.SocketStream(ours)), session, trio.CapacityLimiter(2), "t")
    stats = tx.stats
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.run)
            # plain small reads, sent together: served in batches, one step each
            await theirs.send(
                b"".join(codec.encode_request(Command.READ, c, 0, 512) for c in (1, 2, 3))
            )
            assert sorted([await _reply(theirs, 512) for _ in range(3)]) == [(1, 0), (2, 0), (3, 0)]
            assert (stats.requests, stats.service_ns) == (3, 3 * STEP)
            assert clock[0] == 2 * STEP, "one batch: two clock reads"
            # a FUA write goes to a worker thread: one step, counted when it ends
            fua = codec.encode_request(Command.WRITE, 4, 0, 4096, CommandFlag.FUA)
            await theirs.send(fua + bytes(4096))
            assert await _reply(theirs) == (4, 0)
            # a refused request (beyond the end) is answered at once: one step
            await theirs.send(codec.encode_request(Command.READ, 5, SIZE, 512))
            cookie, error = await _reply(theirs)
            assert cookie == 5 and error != 0
            await theirs.send(codec.encode_request(Command.DISC, 0, 0, 0))
    theirs.close()
    assert (stats.requests, stats.errors) == (5, 1)
    assert stats.service_ns == 5 * STEP
    # the write, the refused read and the disconnect each went past a batch
    # that served nothing: that batch read no clock, and the disconnect none
    assert clock[0] == 6 * STEP, "two reads per batch or request served alone, no others"
