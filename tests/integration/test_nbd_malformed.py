"""Hand-made, often malformed, NBD traffic against an in-process server.

Every test checks the answer the protocol prescribes, and that a second,
well-behaved client is served correctly afterwards.

Why this file is long: it walks the protocol's malformed and edge-case inputs phase by
phase (handshake options, truncated messages, transmission requests, structured replies
and block status, pipelining), much of it as parametrized tables, and all tests but one
use the same in-process server over a data-and-hole image (``env``) and its check that
another client is still served.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from nbd import codec
from nbd.codec import Request
from nbd.constants import (
    BASE_ALLOCATION,
    IHAVEOPT,
    MAX_OPTION_LENGTH,
    MAX_PAYLOAD,
    ClientFlag,
    Command,
    CommandFlag,
    Errno,
    Info,
    Option,
    OptionReply,
    ReplyFlag,
    ReplyType,
    StateFlag,
    TransmissionFlag,
)
from nbd.exports import Export, ExportTable
from nbd.server import NBDServer
from nbd.transmission import Transmission
from tests.nbdwire import (
    Chunk,
    WireClient,
    assert_served,
    connect,
    nbdinfo_json,
    nbdinfo_size,
    open_export,
    serving,
)

KiB = 1024
MiB = 1024 * KiB
SIZE = 64 * MiB
# Layout of the test image: data, hole, data, hole up to SIZE.
DATA1 = (0, 128 * KiB)
HOLE1 = (128 * KiB, 1 * MiB)
DATA2 = (1 * MiB, 1 * MiB + 64 * KiB)
TIMEOUT = 20


@pytest.fixture
def image(tmp_path: Path) -> Path:
    rng = random.Random(1234)
    path = tmp_path / "disk.img"
    with path.open("wb") as f:
        f.truncate(SIZE)
        for start, end in (DATA1, DATA2):
            f.seek(start)
            f.write(rng.randbytes(end - start))
    return path


def content(image: Path, offset: int, length: int) -> bytes:
    with image.open("rb") as f:
        f.seek(offset)
        return f.read(length)


class Env:
    def __init__(self, server: NBDServer, port: int, image: Path) -> None:
        self.server = server
        self.port = port
        self.image = image

    async def assert_healthy(self) -> None:
        """Another client, ours and libnbd's, is still served correctly."""
        await assert_served(self.port, "disk", self.image)
        assert await nbdinfo_size(f"nbd://127.0.0.1:{self.port}/disk") == SIZE

    async def client(self, name: str = "disk", *, structured: bool = False) -> WireClient:
        client, neg = await open_export(self.port, name, structured=structured)
        assert neg.size == SIZE
        return client

    async def raw(self) -> WireClient:
        """Connected, greeting read, client flags sent: ready for options."""
        client = await connect(self.port)
        flags = await client.greeting()
        assert flags == 3
        return client


@asynccontextmanager
async def env(image: Path, **export_args: object) -> AsyncIterator[Env]:
    ro = image.with_name("ro.img")
    ro.write_bytes(content(image, 0, 1 * MiB))
    table = ExportTable(
        [
            Export("disk", image),
            Export("ro", ro, read_only=True),
            Export("aligned", image, min_block_size=512),
        ]
    )
    with trio.fail_after(TIMEOUT):
        async with serving(table) as (server, port):
            yield Env(server, port, image)


def _error_chunk_errno(chunk: Chunk) -> int:
    assert chunk.type == ReplyType.ERROR
    (error,) = struct.unpack_from(">I", chunk.body)
    return int(error)


# ------------------------------------------------------------- handshake


async def test_bad_option_magic_closes_connection(image: Path) -> None:
    async with env(image) as e:
        client = await e.raw()
        await client.send(struct.pack(">QII", 0x1234567890ABCDEF, Option.GO, 0))
        assert await client.expect_closed() == b""
        await e.assert_healthy()


@pytest.mark.parametrize("flags", [1 << 2, 1 << 31, 0xFFFFFFFF, ClientFlag.FIXED_NEWSTYLE | 1 << 5])
async def test_unknown_client_flags_disconnect(image: Path, flags: int) -> None:
    async with env(image) as e:
        client = await connect(e.port)
        await client.greeting(flags)
        # Even a well-formed option gets no answer: the server has hung up.
        await client.send(codec.encode_option(Option.LIST))
        assert await client.expect_closed() == b""
        await e.assert_healthy()


@pytest.mark.parametrize("option", [0, 99, 0x7FFFFFFF, 0xFFFFFFFF, Option.PEEK_EXPORT])
async def test_unknown_option_err_unsup_then_go(image: Path, option: int) -> None:
    async with env(image) as e:
        client = await e.raw()
        replies = await client.option(option, b"some data the server must skip")
        assert [r for r, _ in replies] == [OptionReply.ERR_UNSUP]
        neg = await client.go("disk")
        assert neg.size == SIZE
        assert await client.read(0, 4096) == content(image, 0, 4096)
        await client.disconnect()
        await e.assert_healthy()


@pytest.mark.parametrize("option", [Option.INFO, Option.GO])
async def test_info_go_unknown_export(image: Path, option: Option) -> None:
    async with env(image) as e:
        client = await e.raw()
        for name in ["nope", "DISK", "disk ", "disk/"]:
            replies = await client.option(option, codec.encode_info_request(name, []))
            assert [r for r, _ in replies] == [OptionReply.ERR_UNKNOWN], name
        # The haggling goes on.
        assert (await client.go("disk")).size == SIZE
        await client.disconnect()
        await e.assert_healthy()


MALFORMED_INFO = {
    "empty": b"",
    "short": b"\0\0\0",
    "name-past-end": struct.pack(">I", 100) + b"disk" + struct.pack(">H", 0),
    "count-too-big": struct.pack(">I", 4) + b"disk" + struct.pack(">HH", 2, Info.NAME),
    "count-too-small": struct.pack(">I", 4) + b"disk" + struct.pack(">HH", 0, Info.NAME),
    "odd-trailer": struct.pack(">I", 4) + b"disk" + struct.pack(">H", 0) + b"\0",
    "nul-in-name": struct.pack(">I", 5) + b"disk\0" + struct.pack(">H", 0),
    "bad-utf8": struct.pack(">I", 2) + b"\xff\xfe" + struct.pack(">H", 0),
    "name-too-long": struct.pack(">I", 5000) + b"a" * 5000 + struct.pack(">H", 0),
}


@pytest.mark.parametrize("option", [Option.INFO, Option.GO])
@pytest.mark.parametrize("case", sorted(MALFORMED_INFO))
async def test_malformed_info_data_err_invalid(image: Path, option: Option, case: str) -> None:
    async with env(image) as e:
        client = await e.raw()
        replies = await client.option(option, MALFORMED_INFO[case])
        assert [r for r, _ in replies] == [OptionReply.ERR_INVALID]
        assert (await client.go("disk")).size == SIZE
        await client.disconnect()
        await e.assert_healthy()


@pytest.mark.parametrize("data", [b"nope", b"disk\0", b"\xff", b"a" * 5000])
async def test_export_name_unknown_or_invalid_disconnects(image: Path, data: bytes) -> None:
    async with env(image) as e:
        client = await e.raw()
        await client.send(codec.encode_option(Option.EXPORT_NAME, data))
        assert await client.expect_closed() == b""
        await e.assert_healthy()


async def test_export_name_known_enters_transmission(image: Path) -> None:
    async with env(image) as e:
        client = await connect(e.port)
        await client.greeting(ClientFlag.FIXED_NEWSTYLE)  # no NO_ZEROES: 124 zero bytes follow
        await client.send(codec.encode_option(Option.EXPORT_NAME, b"disk"))
        size, flags = struct.unpack(">QH", await client.recv_exact(10))
        assert (size, await client.recv_exact(124)) == (SIZE, bytes(124))
        assert flags & TransmissionFlag.HAS_FLAGS
        assert await client.read(DATA2[0], 4096) == content(image, DATA2[0], 4096)
        await client.disconnect()


async def test_oversized_option_disconnects(image: Path) -> None:
    async with env(image) as e:
        client = await e.raw()
        await client.send(struct.pack(">QII", IHAVEOPT, Option.INFO, MAX_OPTION_LENGTH + 1))
        assert await client.expect_closed() == b""
        await e.assert_healthy()


async def test_starttls_without_tls_err_unsup(image: Path) -> None:
    async with env(image) as e:
        client = await e.raw()
        replies = await client.option(Option.STARTTLS)
        assert [r for r, _ in replies] == [OptionReply.ERR_UNSUP]
        # Still in clear text, still haggling.
        await client.structured_reply()
        assert (await client.go("disk")).size == SIZE
        assert await client.read(0, 4096) == content(image, 0, 4096)
        await client.disconnect()
        await e.assert_healthy()


async def test_set_meta_context_base_wildcard_selects_nothing(image: Path) -> None:
    """``base:`` MUST be ignored by SET_META_CONTEXT (only LIST treats it as a wildcard)."""
    async with env(image) as e:
        client = await e.raw()
        await client.structured_reply()
        listed = await client.option(
            Option.LIST_META_CONTEXT, codec.encode_meta_context_request("disk", ["base:"])
        )
        assert [r for r, _ in listed] == [OptionReply.META_CONTEXT, OptionReply.ACK]
        assert listed[0][1][4:] == BASE_ALLOCATION.encode()
        replies = await client.set_meta_context("disk", ["base:"])
        assert [r for r, _ in replies] == [OptionReply.ACK]
        await client.go("disk")
        reply = await client.call(Command.BLOCK_STATUS, 0, 4096)
        assert reply.error == Errno.EINVAL
        await client.disconnect()


async def test_set_meta_context_requires_structured_replies(image: Path) -> None:
    async with env(image) as e:
        client = await e.raw()
        replies = await client.set_meta_context("disk", [BASE_ALLOCATION])
        assert [r for r, _ in replies] == [OptionReply.ERR_INVALID]
        assert (await client.go("disk")).size == SIZE
        await client.disconnect()


# ----------------------------------------------------- truncated messages


async def _truncate_client_flags(e: Env) -> WireClient:
    client = await connect(e.port)
    await client.recv_exact(codec.GREETING.size)
    await client.send(b"\0\0")
    return client


async def _truncate_option_header(e: Env) -> WireClient:
    client = await e.raw()
    await client.send(codec.encode_option(Option.GO)[:9])
    return client


async def _truncate_option_data(e: Env) -> WireClient:
    client = await e.raw()
    await client.send(codec.encode_option(Option.GO, codec.encode_info_request("disk", []))[:20])
    return client


async def _truncate_request_header(e: Env) -> WireClient:
    client = await e.client()
    await client.send(codec.encode_request(Command.READ, 1, 0, 4096)[:14])
    return client


TRUNCATIONS = {
    "client-flags": _truncate_client_flags,
    "option-header": _truncate_option_header,
    "option-data": _truncate_option_data,
    "request-header": _truncate_request_header,
}


@pytest.mark.parametrize("where", sorted(TRUNCATIONS))
async def test_truncated_message_then_close(image: Path, where: str) -> None:
    async with env(image) as e:
        client = await TRUNCATIONS[where](e)
        await trio.sleep(0.05)
        await client.aclose()
        with trio.fail_after(5):
            while e.server.active_connections:
                await trio.sleep(0.01)
        await e.assert_healthy()


# ---------------------------------------------------------- transmission


async def test_bad_request_magic_closes(image: Path) -> None:
    async with env(image) as e:
        client = await e.client()
        bad = struct.pack(">IHHQQI", 0x25609514, 0, Command.READ, 1, 0, 4096)
        await client.send(bad)
        assert await client.expect_closed() == b""
        await e.assert_healthy()


async def test_client_disappears_mid_write_payload(image: Path) -> None:
    async with env(image) as e:
        before = content(image, 0, 1 * MiB)
        client = await e.client()
        header = codec.encode_request(Command.WRITE, 7, 0, 1 * MiB)
        await client.send(header + b"\xaa" * (512 * KiB))
        await trio.sleep(0.05)
        await client.aclose()
        with trio.fail_after(5):
            while e.server.active_connections:
                await trio.sleep(0.01)
        # Half a write is no write.
        assert content(image, 0, 1 * MiB) == before
        await e.assert_healthy()


@pytest.mark.parametrize("structured", [False, True])
@pytest.mark.parametrize("command", [9, 42, 0xFFFF, Command.RESIZE])
async def test_unknown_command_einval(image: Path, structured: bool, command: int) -> None:
    async with env(image) as e:
        client = await e.client(structured=structured)
        reply = await client.call(command, 0, 512)
        assert reply.error == Errno.EINVAL
        assert await client.read(0, 4096) == content(image, 0, 4096)
        await client.disconnect()
        await e.assert_healthy()


UNKNOWN_FLAGS = [
    (Command.READ, 1 << 15),
    (Command.READ, CommandFlag.FUA),
    (Command.READ, CommandFlag.REQ_ONE),
    (Command.WRITE, CommandFlag.NO_HOLE),
    (Command.WRITE, CommandFlag.FAST_ZERO),
    (Command.WRITE, 1 << 9),
    (Command.FLUSH, CommandFlag.FUA),
    (Command.TRIM, CommandFlag.DF),
    (Command.CACHE, 1 << 12),
    (Command.WRITE_ZEROES, CommandFlag.DF),
]


@pytest.mark.parametrize(("command", "flags"), UNKNOWN_FLAGS)
async def test_unknown_flags_einval(image: Path, command: Command, flags: int) -> None:
    async with env(image) as e:
        before = content(image, 0, 8192)
        client = await e.client(structured=True)
        length = 0 if command == Command.FLUSH else 4096
        payload = b"\x55" * length if command == Command.WRITE else b""
        reply = await client.call(command, 0, length, flags, payload)
        assert reply.error == Errno.EINVAL
        # Nothing was changed, and a write's payload did not desynchronise us.
        assert await client.read(0, 8192) == before
        await client.disconnect()
        await e.assert_healthy()


async def test_df_without_structured_replies_einval(image: Path) -> None:
    async with env(image) as e:
        client = await e.client(structured=False)
        reply = await client.call(Command.READ, 0, 4096, CommandFlag.DF)
        assert (reply.error, reply.data) == (Errno.EINVAL, None)
        assert await client.read(0, 4096) == content(image, 0, 4096)
        await client.disconnect()
        await e.assert_healthy()


OUT_OF_RANGE = [
    (SIZE, 1),
    (SIZE - 512, 1024),
    (SIZE + 4096, 4096),
    (2**64 - 512, 1024),  # offset + length wraps around 64 bits
    (2**63, 4096),
]


@pytest.mark.parametrize("structured", [False, True])
@pytest.mark.parametrize(("offset", "length"), OUT_OF_RANGE)
async def test_read_out_of_range_einval(
    image: Path, structured: bool, offset: int, length: int
) -> None:
    async with env(image) as e:
        client = await e.client(structured=structured)
        reply = await client.call(Command.READ, offset, length)
        assert reply.error == Errno.EINVAL
        if structured:
            assert len(reply.chunks) == 1
            assert _error_chunk_errno(reply.chunks[0]) == Errno.EINVAL
        else:
            assert reply.data is None
        # The last bytes are still readable.
        assert await client.read(SIZE - 512, 512) == content(image, SIZE - 512, 512)
        await client.disconnect()
        await e.assert_healthy()


@pytest.mark.parametrize(("offset", "length"), OUT_OF_RANGE[:4])
async def test_write_past_end_enospc_payload_consumed(
    image: Path, offset: int, length: int
) -> None:
    async with env(image) as e:
        client = await e.client()
        reply = await client.call(Command.WRITE, offset, length, payload=b"\xee" * length)
        assert reply.error == Errno.ENOSPC
        # The payload was consumed: the next request is parsed correctly.
        data = b"\x11" * 4096
        assert (await client.call(Command.WRITE, SIZE - 4096, 4096, payload=data)).error == 0
        assert await client.read(SIZE - 4096, 4096) == data
        zeroes = await client.call(Command.WRITE_ZEROES, SIZE - 512, 1024)
        assert zeroes.error == Errno.ENOSPC
        await client.disconnect()
        assert image.stat().st_size == SIZE
        await e.assert_healthy()


async def test_write_on_read_only_export_eperm(image: Path) -> None:
    async with env(image) as e:
        ro = image.with_name("ro.img")
        before = ro.read_bytes()
        client, neg = await open_export(e.port, "ro")
        assert neg.flags & TransmissionFlag.READ_ONLY
        for fua in (0, CommandFlag.FUA):
            reply = await client.call(Command.WRITE, 0, 64 * KiB, fua, b"\x99" * (64 * KiB))
            assert reply.error == Errno.EPERM
        assert (await client.call(Command.TRIM, 0, 4096)).error == Errno.EPERM
        assert (await client.call(Command.WRITE_ZEROES, 0, 4096)).error == Errno.EPERM
        # Payloads consumed, nothing written.
        assert await client.read(0, 64 * KiB) == before[: 64 * KiB]
        assert (await client.call(Command.FLUSH, 0, 0)).error == 0
        await client.disconnect()
        assert ro.read_bytes() == before
        await e.assert_healthy()


async def test_oversize_write_einval_stays_in_sync(image: Path) -> None:
    async with env(image) as e:
        client = await e.client()
        length = MAX_PAYLOAD + 4096
        header = codec.encode_request(Command.WRITE, 0xB16, 0, length)
        client._pending[0xB16] = (Command.WRITE, length)
        with trio.fail_after(TIMEOUT):
            await client.stream.send_all(header + b"\x77" * length)
        reply = await client.reply()
        assert (reply.cookie, reply.error) == (0xB16, Errno.EINVAL)
        assert await client.read(0, 64 * KiB) == content(image, 0, 64 * KiB)
        assert b"\x77" * 4096 not in content(image, 0, 2 * MiB)
        await client.disconnect()
        await e.assert_healthy()


@pytest.mark.parametrize("structured", [False, True])
async def test_read_larger_than_max_payload_einval(image: Path, structured: bool) -> None:
    async with env(image) as e:
        client = await e.client(structured=structured)
        reply = await client.call(Command.READ, 0, MAX_PAYLOAD + 512)
        assert (reply.error, reply.data) == (Errno.EINVAL, None)
        # Exactly the maximum is fine.
        data = await client.read(0, MAX_PAYLOAD)
        assert data[: 2 * MiB] == content(image, 0, 2 * MiB)
        assert data[2 * MiB :] == bytes(MAX_PAYLOAD - 2 * MiB)
        await client.disconnect()
        await e.assert_healthy()


async def test_misaligned_reads_and_writes_einval_trim_shrunk(image: Path) -> None:
    async with env(image) as e:
        client, neg = await open_export(e.port, "aligned")
        minimum, preferred, maximum = struct.unpack(">III", neg.infos[Info.BLOCK_SIZE])
        assert (minimum, maximum) == (512, MAX_PAYLOAD)
        assert preferred >= 512
        for offset, length in [(1, 512), (0, 100), (256, 512), (512, 513)]:
            reply = await client.call(Command.READ, offset, length)
            assert (reply.error, reply.data) == (Errno.EINVAL, None), (offset, length)
        before = content(image, 0, 8192)
        reply = await client.call(Command.WRITE, 100, 512, payload=b"\x33" * 512)
        assert reply.error == Errno.EINVAL
        assert await client.read(0, 8192) == before
        # TRIM is advisory: an unaligned one succeeds and punches only whole blocks.
        assert (await client.call(Command.WRITE, 0, 1536, payload=b"\x44" * 1536)).error == 0
        assert (await client.call(Command.TRIM, 100, 1300)).error == 0
        assert await client.read(0, 1536) == b"\x44" * 512 + bytes(512) + b"\x44" * 512
        await client.disconnect()
        info = json.loads(await nbdinfo_json(f"nbd://127.0.0.1:{e.port}/aligned"))
        assert info["exports"][0]["block_size_minimum"] == 512
        assert info["exports"][0]["block_size_maximum"] == MAX_PAYLOAD
        await e.assert_healthy()


@pytest.mark.parametrize(("offset", "length"), [(0, 4096), (4096, 0), (1, 1)])
async def test_flush_with_offset_or_length_einval(image: Path, offset: int, length: int) -> None:
    async with env(image) as e:
        client = await e.client()
        assert (await client.call(Command.FLUSH, offset, length)).error == Errno.EINVAL
        assert (await client.call(Command.FLUSH, 0, 0)).error == 0
        await client.disconnect()
        await e.assert_healthy()


@pytest.mark.parametrize("structured", [False, True])
async def test_block_status_without_meta_context_einval(image: Path, structured: bool) -> None:
    async with env(image) as e:
        client = await e.client(structured=structured)
        reply = await client.call(Command.BLOCK_STATUS, 0, 1 * MiB)
        assert reply.error == Errno.EINVAL
        if structured:
            assert [c.type for c in reply.chunks] == [ReplyType.ERROR]
        assert await client.read(0, 4096) == content(image, 0, 4096)
        await client.disconnect()
        await e.assert_healthy()


# -------------------------------------------------- structured replies


def _chunk_ranges(chunks: list[Chunk]) -> list[tuple[int, int, int]]:
    """(type, offset, length) of each content chunk."""
    out = []
    for c in chunks:
        if c.type == ReplyType.OFFSET_DATA:
            (offset,) = struct.unpack_from(">Q", c.body)
            out.append((int(c.type), offset, len(c.body) - 8))
        elif c.type == ReplyType.OFFSET_HOLE:
            offset, length = struct.unpack(">QI", c.body)
            out.append((int(c.type), offset, length))
        else:
            raise AssertionError(f"unexpected chunk type {c.type}")
    return out


async def test_structured_read_holes_and_data(image: Path) -> None:
    async with env(image) as e:
        client = await e.client(structured=True)
        hole, data = ReplyType.OFFSET_HOLE, ReplyType.OFFSET_DATA

        # All hole.
        reply = await client.call(Command.READ, 2 * MiB, 1 * MiB)
        assert _chunk_ranges(reply.chunks) == [(hole, 2 * MiB, 1 * MiB)]
        assert reply.read_data(2 * MiB, 1 * MiB) == bytes(1 * MiB)

        # All data.
        reply = await client.call(Command.READ, 0, 128 * KiB)
        assert _chunk_ranges(reply.chunks) == [(data, 0, 128 * KiB)]
        assert reply.read_data(0, 128 * KiB) == content(image, 0, 128 * KiB)

        # Data, hole, data, hole.
        reply = await client.call(Command.READ, 0, 2 * MiB)
        assert _chunk_ranges(reply.chunks) == [
            (data, DATA1[0], DATA1[1] - DATA1[0]),
            (hole, HOLE1[0], HOLE1[1] - HOLE1[0]),
            (data, DATA2[0], DATA2[1] - DATA2[0]),
            (hole, DATA2[1], 2 * MiB - DATA2[1]),
        ]
        assert [c.done for c in reply.chunks] == [False, False, False, True]
        assert reply.read_data(0, 2 * MiB) == content(image, 0, 2 * MiB)

        # DF: one content chunk, holes included as zeroes.
        reply = await client.call(Command.READ, 0, 2 * MiB, CommandFlag.DF)
        assert _chunk_ranges(reply.chunks) == [(data, 0, 2 * MiB)]
        assert reply.chunks[0].flags == ReplyFlag.DONE
        assert reply.read_data(0, 2 * MiB) == content(image, 0, 2 * MiB)
        await client.disconnect()
        await e.assert_healthy()


HOLE_ZERO = StateFlag.HOLE | StateFlag.ZERO


async def _block_status(
    client: WireClient, offset: int, length: int, flags: int = 0
) -> list[tuple[int, int]]:
    reply = await client.call(Command.BLOCK_STATUS, offset, length, flags)
    assert reply.error == 0, reply
    assert len(reply.chunks) == 1
    chunk = reply.chunks[0]
    assert (chunk.type, chunk.done) == (ReplyType.BLOCK_STATUS, True)
    context_id, extents = codec.decode_block_status(chunk.body)
    assert context_id == 1  # what SET_META_CONTEXT answered
    return extents


async def test_block_status_extents(image: Path) -> None:
    async with env(image) as e:
        client, _ = await open_export(e.port, "disk", meta=True)
        extents = await _block_status(client, 0, SIZE)
        assert extents == [
            (DATA1[1] - DATA1[0], 0),
            (HOLE1[1] - HOLE1[0], HOLE_ZERO),
            (DATA2[1] - DATA2[0], 0),
            (SIZE - DATA2[1], HOLE_ZERO),
        ]
        # A range starting inside a run.
        assert await _block_status(client, 64 * KiB, 2 * MiB) == [
            (64 * KiB, 0),
            (HOLE1[1] - HOLE1[0], HOLE_ZERO),
            (DATA2[1] - DATA2[0], 0),
            (64 * KiB + 2 * MiB - DATA2[1], HOLE_ZERO),
        ]
        # REQ_ONE: exactly one extent, not longer than asked.
        assert await _block_status(client, 0, SIZE, CommandFlag.REQ_ONE) == [(128 * KiB, 0)]
        assert await _block_status(client, HOLE1[0], SIZE - HOLE1[0], CommandFlag.REQ_ONE) == [
            (HOLE1[1] - HOLE1[0], HOLE_ZERO)
        ]
        assert await _block_status(client, 4096, 8192, CommandFlag.REQ_ONE) == [(8192, 0)]
        # Past the end.
        assert (await client.call(Command.BLOCK_STATUS, SIZE - 512, 1024)).error == Errno.EINVAL
        await client.disconnect()
        await e.assert_healthy()


async def test_block_status_on_default_export(image: Path) -> None:
    """Meta context set and GO both on the default export name "" (what nbdinfo --map does)."""
    table = ExportTable([Export("disk", image)])
    with trio.fail_after(TIMEOUT):
        async with serving(table) as (_, port):
            client, neg = await open_export(port, "", meta=True)
            assert neg.size == SIZE
            assert await _block_status(client, 0, 2 * MiB, CommandFlag.REQ_ONE) == [(128 * KiB, 0)]
            await client.disconnect()
            result = await trio.run_process(
                ["nbdinfo", "--map", "--json", f"nbd://127.0.0.1:{port}"], capture_stdout=True
            )
            extents = json.loads(result.stdout)
            assert [(x["offset"], x["length"]) for x in extents][:2] == [
                (0, 128 * KiB),
                (128 * KiB, HOLE1[1] - HOLE1[0]),
            ]


async def test_write_zeroes_fast_zero(image: Path) -> None:
    async with env(image) as e:
        client, neg = await open_export(e.port, "disk", meta=True)
        assert neg.flags & TransmissionFlag.SEND_FAST_ZERO
        assert neg.flags & TransmissionFlag.SEND_WRITE_ZEROES
        # May punch holes: must succeed fast on a file, and read back as zeroes.
        reply = await client.call(Command.WRITE_ZEROES, 0, 64 * KiB, CommandFlag.FAST_ZERO)
        assert reply.error == 0
        assert await client.read(0, 64 * KiB) == bytes(64 * KiB)
        assert (await _block_status(client, 0, 64 * KiB))[0][1] & StateFlag.ZERO
        # Without holes: either done, or refused fast with ENOTSUP and nothing changed.
        before = content(image, DATA2[0], 64 * KiB)
        reply = await client.call(
            Command.WRITE_ZEROES, DATA2[0], 64 * KiB, CommandFlag.FAST_ZERO | CommandFlag.NO_HOLE
        )
        assert reply.error in (0, Errno.ENOTSUP)
        expected = bytes(64 * KiB) if reply.error == 0 else before
        assert await client.read(DATA2[0], 64 * KiB) == expected
        # The rest of the data is untouched.
        assert await client.read(64 * KiB, 64 * KiB) == content(image, 64 * KiB, 64 * KiB)
        await client.disconnect()
        await e.assert_healthy()


# ----------------------------------------------------------- pipelining


@pytest.mark.parametrize("structured", [False, True])
async def test_many_requests_in_flight(image: Path, structured: bool) -> None:
    async with env(image) as e:
        client = await e.client(structured=structured)
        rng = random.Random(99)
        expected: dict[int, tuple[int, int]] = {}
        batch = b""
        for _ in range(64):
            cookie = rng.getrandbits(64)
            offset = rng.randrange(0, 2 * MiB - 64 * KiB)
            length = rng.choice([1, 512, 4096, 65536, 100_000])
            expected[cookie] = (offset, length)
            client._pending[cookie] = (Command.READ, length)
            batch += codec.encode_request(Command.READ, cookie, offset, length)
        await client.send(batch)
        seen: set[int] = set()
        for _ in range(64):
            reply = await client.reply()
            assert reply.cookie in expected and reply.cookie not in seen
            seen.add(reply.cookie)
            offset, length = expected[reply.cookie]
            assert reply.read_data(offset, length) == content(image, offset, length)
        assert seen == set(expected)
        await client.disconnect()
        await e.assert_healthy()


async def test_a_bug_met_by_one_connection_closes_only_that_connection(
    image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception inside one request ends its connection, not the server."""
    original = Transmission._dispatch

    async def buggy(self: Transmission, req: Request, payload: bytearray | None) -> None:
        if req.type == Command.FLUSH:
            raise RuntimeError("injected bug")
        await original(self, req, payload)

    monkeypatch.setattr(Transmission, "_dispatch", buggy)
    async with env(image) as e:
        victim = await e.client()
        bystander = await e.client()
        await victim.send(codec.encode_request(Command.FLUSH, 1, 0, 0))
        assert await victim.expect_closed(5) == b""  # closed, without a reply
        assert await bystander.read(0, 4096) == content(image, 0, 4096)
        await bystander.disconnect()
        await e.assert_healthy()


async def test_an_image_grown_under_a_connection_serves_its_new_end(image: Path) -> None:
    """An expanded volume: the kernel nbd driver is resized over netlink and keeps its
    connection, so what lies past the handshake's size but inside the image now is
    served; past the new end is still refused, and the size never shrinks."""
    async with env(image) as e:
        client = await e.client()
        assert (await client.call(Command.READ, SIZE, 4096)).error == Errno.EINVAL
        os.truncate(image, 2 * SIZE)
        data = b"\x5a" * 4096
        assert (await client.call(Command.WRITE, 2 * SIZE - 4096, 4096, payload=data)).error == 0
        assert await client.read(2 * SIZE - 4096, 4096) == data
        assert (await client.call(Command.READ, 2 * SIZE, 512)).error == Errno.EINVAL
        over = await client.call(Command.WRITE, 2 * SIZE, 512, payload=b"\x01" * 512)
        assert over.error == Errno.ENOSPC
        await client.disconnect()
        assert image.stat().st_size == 2 * SIZE
        # and a new connection is told the new size
        assert await nbdinfo_size(f"nbd://127.0.0.1:{e.port}/disk") == 2 * SIZE
