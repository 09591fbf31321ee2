"""Small plain reads and writes served in batches (Transmission._serve_batch).

A real image and a socketpair: what matters is what the client gets back
and what ends up in the file, whatever way the requests arrive.
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import pytest
import trio

from nbd import codec
from nbd.constants import SIMPLE_REPLY_MAGIC, Command, CommandFlag, TransmissionFlag
from nbd.exports import Export
from nbd.handshake import Session
from nbd.image import Image
from nbd.transmission import Transmission
from nbd.transport import Transport

SIZE = 4 * 1024 * 1024


async def _send_all(sock: trio.socket.SocketType, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view) :]


async def _exact(sock: trio.socket.SocketType, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = await sock.recv(n - len(out))
        assert got, "server closed the connection"
        out += got
    return bytes(out)


async def _replies(
    sock: trio.socket.SocketType, lengths: dict[int, int], structured: bool
) -> dict[int, tuple[int, bytes]]:
    """Cookie -> (error, data) for each request; ``lengths``: cookie -> read length."""
    out: dict[int, tuple[int, bytes]] = {}
    while len(out) < len(lengths):
        (magic,) = struct.unpack(">I", await _exact(sock, 4))
        if magic == SIMPLE_REPLY_MAGIC:
            error, cookie = struct.unpack(">IQ", await _exact(sock, 12))
            data = await _exact(sock, lengths[cookie]) if not error else b""
            out[cookie] = (error, data)
            continue
        assert structured
        flags, type_, cookie, length = struct.unpack(">HHQI", await _exact(sock, 16))
        body = await _exact(sock, length)
        assert flags & 1 and type_ == 1, "one OFFSET_DATA chunk per small read"
        out[cookie] = (0, body[8:])
    return out


@pytest.mark.parametrize("structured", [False, True])
@pytest.mark.parametrize("piece", [7, 1000, 4096 + 28, 1 << 20])
async def test_reads_and_writes_however_they_arrive(
    tmp_path: Path, structured: bool, piece: int
) -> None:
    """Writes split anywhere (header, payload, between requests), reads between them.

    In each round the writes go to one half of the image and the reads to
    the other, which nothing changes during the round: replies may come in
    any order, yet each read's data is known.
    """
    rng = random.Random(piece)
    path = tmp_path / "disk.img"
    original = rng.randbytes(SIZE)
    path.write_bytes(original)
    image = Image(path, read_only=False)
    session = Session(
        export=Export("x", path),
        image=image,
        flags=TransmissionFlag.HAS_FLAGS,
        structured=structured,
        base_allocation=False,
        tls=False,
    )
    ours, theirs = trio.socket.socketpair()
    tx = Transmission(Transport(trio.SocketStream(ours)), session, trio.CapacityLimiter(2), "t")
    expected = bytearray(original)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.run)
            for round_ in range(4):
                wire = bytearray()
                lengths: dict[int, int] = {}
                wanted: dict[int, bytes] = {}
                half = SIZE // 2
                # Writes in flight together must not overlap (the protocol
                # does not order them): each has a 64 KiB slot of its own.
                slots = list(range(0, half, 65536))
                rng.shuffle(slots)
                for i in range(40 if piece >= 1000 else 10):
                    cookie = round_ * 1000 + i
                    length = rng.choice([512, 4096, 8192, 65536] if piece >= 1000 else [512, 4096])
                    if i % 3 == 0:
                        offset = rng.randrange(0, half - length) // 512 * 512
                        offset += half * ((round_ + 1) % 2)
                        lengths[cookie] = length
                        wanted[cookie] = bytes(expected[offset : offset + length])
                        wire += codec.encode_request(Command.READ, cookie, offset, length)
                    else:
                        offset = slots.pop() + rng.randrange(0, 65536 - length + 1) // 512 * 512
                        offset += half * (round_ % 2)
                        data = rng.randbytes(length)
                        # FUA takes the request-by-request path: both kinds mix.
                        flags = CommandFlag.FUA if i % 7 == 0 else 0
                        wire += codec.encode_request(Command.WRITE, cookie, offset, length, flags)
                        wire += data
                        lengths[cookie] = 0
                        wanted[cookie] = b""
                        expected[offset : offset + length] = data
                for start in range(0, len(wire), piece):
                    await _send_all(theirs, wire[start : start + piece])
                    await trio.sleep(0)
                got = await _replies(theirs, lengths, structured)
                assert got == {c: (0, data) for c, data in wanted.items()}
            await _send_all(theirs, codec.encode_request(Command.DISC, 0, 0, 0))
    theirs.close()
    with path.open("rb") as f:
        assert f.read() == bytes(expected)
    assert os.path.getsize(path) == SIZE
