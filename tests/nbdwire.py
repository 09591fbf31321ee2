"""A tiny NBD client speaking raw bytes, for tests that misbehave on purpose.

Built on ``nbd.codec`` for the encodings, but it never validates what the test
is about to send: the point is to send whatever bytes a test wants and to
read back exactly what the server answers.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from nbd import codec
from nbd.constants import (
    BASE_ALLOCATION,
    SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
    ClientFlag,
    Command,
    Info,
    Option,
    OptionReply,
    ReplyFlag,
    ReplyType,
)
from nbd.exports import ExportTable
from nbd.server import NBDServer, ServerConfig

IO_TIMEOUT = 10.0


class Closed(Exception):
    """The server closed the connection."""


@dataclass
class Chunk:
    flags: int
    type: int
    cookie: int
    body: bytes

    @property
    def done(self) -> bool:
        return bool(self.flags & ReplyFlag.DONE)


@dataclass
class Reply:
    cookie: int
    error: int = 0
    data: bytes | None = None  # payload of a simple READ reply
    chunks: list[Chunk] = field(default_factory=list)
    structured: bool = False

    def read_data(self, offset: int, length: int) -> bytes:
        """Reassemble a successful READ reply (simple or structured) into bytes."""
        assert self.error == 0, f"read failed with error {self.error}"
        if not self.structured:
            assert self.data is not None
            return self.data
        out = bytearray(length)
        covered = 0
        for c in self.chunks:
            if c.type == ReplyType.OFFSET_DATA:
                (off,) = struct.unpack_from(">Q", c.body)
                data = c.body[8:]
                out[off - offset : off - offset + len(data)] = data
                covered += len(data)
            elif c.type == ReplyType.OFFSET_HOLE:
                _off, n = struct.unpack(">QI", c.body)
                covered += n
        assert covered == length, f"chunks cover {covered} of {length} bytes"
        return bytes(out)


@dataclass
class Negotiated:
    size: int
    flags: int
    infos: dict[int, bytes]


class WireClient:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buf = bytearray()
        self._pending: dict[int, tuple[int, int]] = {}  # cookie -> (command, length)
        self._partial: dict[int, list[Chunk]] = {}
        self.structured = False

    # ------------------------------------------------------------ bytes

    async def send(self, data: bytes) -> None:
        with trio.fail_after(IO_TIMEOUT):
            await self.stream.send_all(data)

    async def recv_exact(self, n: int) -> bytes:
        with trio.fail_after(IO_TIMEOUT):
            while len(self._buf) < n:
                try:
                    data = await self.stream.receive_some(max(65536, n - len(self._buf)))
                except trio.BrokenResourceError as e:
                    raise Closed(str(e)) from e
                if not data:
                    raise Closed(f"EOF with {len(self._buf)} of {n} bytes")
                self._buf += data
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def expect_closed(self, timeout: float = IO_TIMEOUT) -> bytes:
        """Wait for the server to close; returns whatever it sent first."""
        got = bytes(self._buf)
        self._buf.clear()
        with trio.fail_after(timeout):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return got
                if not data:
                    return got
                got += data

    async def aclose(self) -> None:
        await self.stream.aclose()

    # -------------------------------------------------------- handshake

    async def greeting(self, flags: int = ClientFlag.FIXED_NEWSTYLE | ClientFlag.NO_ZEROES) -> int:
        server_flags = codec.decode_greeting(await self.recv_exact(codec.GREETING.size))
        await self.send(codec.CLIENT_FLAGS.pack(flags))
        return server_flags

    async def option_reply(self) -> tuple[int, int, bytes]:
        option, reply, length = codec.decode_option_reply_header(
            await self.recv_exact(codec.OPTION_REPLY_HEADER.size)
        )
        data = await self.recv_exact(length) if length else b""
        return option, reply, data

    async def option(self, option: int, data: bytes = b"") -> list[tuple[int, bytes]]:
        """Send an option; return its replies up to and including the final one."""
        await self.send(codec.encode_option(option, data))
        replies: list[tuple[int, bytes]] = []
        while True:
            opt, reply, body = await self.option_reply()
            assert opt == option, f"reply for option {opt}, expected {option}"
            replies.append((reply, body))
            if reply == OptionReply.ACK or reply & (1 << 31):
                return replies

    async def structured_reply(self) -> None:
        replies = await self.option(Option.STRUCTURED_REPLY)
        assert replies == [(OptionReply.ACK, b"")], replies
        self.structured = True

    async def set_meta_context(self, name: str, queries: list[str]) -> list[tuple[int, bytes]]:
        return await self.option(
            Option.SET_META_CONTEXT, codec.encode_meta_context_request(name, queries)
        )

    async def go(self, name: str, infos: list[int] | None = None) -> Negotiated:
        replies = await self.option(
            Option.GO, codec.encode_info_request(name, infos or [Info.BLOCK_SIZE])
        )
        final, body = replies[-1]
        assert final == OptionReply.ACK, f"GO {name!r} failed: {final:#x} {body!r}"
        found: dict[int, bytes] = {}
        for reply, data in replies[:-1]:
            assert reply == OptionReply.INFO
            (kind,) = struct.unpack_from(">H", data)
            found[kind] = data[2:]
        size, flags = struct.unpack(">QH", found[Info.EXPORT])
        return Negotiated(size, flags, found)

    # ----------------------------------------------------- transmission

    async def request(
        self,
        command: int,
        cookie: int,
        offset: int,
        length: int,
        flags: int = 0,
        payload: bytes = b"",
    ) -> None:
        self._pending[cookie] = (command, length)
        await self.send(codec.encode_request(command, cookie, offset, length, flags) + payload)

    async def reply(self) -> Reply:
        """The next complete reply (all chunks of a structured one)."""
        while True:
            (magic,) = struct.unpack(">I", await self.recv_exact(4))
            if magic == SIMPLE_REPLY_MAGIC:
                error, cookie = struct.unpack(">IQ", await self.recv_exact(12))
                command, length = self._pending.pop(cookie)
                data = None
                if command == Command.READ and error == 0:
                    data = await self.recv_exact(length)
                return Reply(cookie, error, data)
            if magic != STRUCTURED_REPLY_MAGIC:
                raise AssertionError(f"bad reply magic {magic:#x}")
            flags, type_, cookie, length = struct.unpack(">HHQI", await self.recv_exact(16))
            chunk = Chunk(flags, type_, cookie, await self.recv_exact(length) if length else b"")
            chunks = self._partial.setdefault(cookie, [])
            chunks.append(chunk)
            if chunk.done:
                del self._partial[cookie]
                self._pending.pop(cookie)
                error = 0
                for c in chunks:
                    if c.type & (1 << 15):
                        (error,) = struct.unpack_from(">I", c.body)
                return Reply(cookie, error, None, chunks, structured=True)

    async def call(
        self, command: int, offset: int, length: int, flags: int = 0, payload: bytes = b""
    ) -> Reply:
        cookie = 0x5EED0000 + len(self._pending)
        await self.request(command, cookie, offset, length, flags, payload)
        reply = await self.reply()
        assert reply.cookie == cookie, f"reply cookie {reply.cookie:#x}, expected {cookie:#x}"
        return reply

    async def read(self, offset: int, length: int) -> bytes:
        reply = await self.call(Command.READ, offset, length)
        return reply.read_data(offset, length)

    async def disconnect(self) -> None:
        await self.send(codec.encode_request(Command.DISC, 0, 0, 0))
        await self.aclose()


async def connect(port: int) -> WireClient:
    with trio.fail_after(IO_TIMEOUT):
        return WireClient(await trio.open_tcp_stream("127.0.0.1", port))


async def open_export(
    port: int, name: str, *, structured: bool = False, meta: bool = False
) -> tuple[WireClient, Negotiated]:
    """A well-behaved client in transmission on ``name``."""
    client = await connect(port)
    await client.greeting()
    if structured or meta:
        await client.structured_reply()
    if meta:
        replies = await client.set_meta_context(name, [BASE_ALLOCATION])
        assert replies[-1][0] == OptionReply.ACK, replies
        assert replies[0][0] == OptionReply.META_CONTEXT, replies
    return client, await client.go(name)


@asynccontextmanager
async def serving(
    table: ExportTable, config: ServerConfig | None = None
) -> AsyncIterator[tuple[NBDServer, int]]:
    """An in-process server on a free loopback port; shut down on exit."""
    server = NBDServer(table, config)
    async with trio.open_nursery() as nursery:
        listeners: list[trio.SocketListener] = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
        port = int(listeners[0].socket.getsockname()[1])
        try:
            yield server, port
        finally:
            server.shutdown()


async def nbdinfo_json(uri: str) -> str:
    """``nbdinfo --json URI`` output; fails the test if nbdinfo fails."""
    with trio.fail_after(30):
        result = await trio.run_process(
            ["nbdinfo", "--json", "--no-content", uri], capture_stdout=True
        )
    return result.stdout.decode()


async def nbdinfo_size(uri: str) -> int:
    """``nbdinfo --size URI``: libnbd's full handshake (GO), without the slow extras."""
    with trio.fail_after(30):
        result = await trio.run_process(["nbdinfo", "--size", uri], capture_stdout=True)
    return int(result.stdout)


async def assert_served(port: int, name: str, image: Path) -> None:
    """A well-behaved client can still open ``name`` and read the image correctly."""
    expected = image.read_bytes()
    client, neg = await open_export(port, name, structured=True)
    assert neg.size == len(expected)
    length = min(len(expected), 256 * 1024)
    assert await client.read(0, length) == expected[:length]
    await client.disconnect()
