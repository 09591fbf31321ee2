"""Bytes in and out of one NBD connection.

Wraps a trio stream with an input buffer.  Plain sockets get a zero-copy
path (``recv_into`` for payloads, ``sendmsg`` for header + data); TLS and
stdio streams go through the generic stream interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import trio

Buffer = bytes | bytearray | memoryview

_RECV_CHUNK = 256 * 1024


class PeerClosed(Exception):
    """The peer closed the connection (cleanly or in the middle of a message)."""


class Transport:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self._buf = b""
        self._pos = 0
        self.set_stream(stream)

    def set_stream(self, stream: trio.abc.Stream) -> None:
        """Switch to a new stream (after STARTTLS); buffered input is dropped."""
        self.stream = stream
        self._sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._buf = b""
        self._pos = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    async def _receive(self, max_bytes: int) -> bytes:
        try:
            data = await self.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise PeerClosed(str(e)) from e
        if not data:
            raise PeerClosed("end of stream")
        return bytes(data)

    async def recv_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes, for headers and small messages."""
        avail = len(self._buf) - self._pos
        if avail >= n:
            out = self._buf[self._pos : self._pos + n]
            self._pos += n
            return out
        parts = [self._buf[self._pos :]] if avail else []
        need = n - avail
        self._buf, self._pos = b"", 0
        while need:
            data = await self._receive(max(need, _RECV_CHUNK))
            if len(data) <= need:
                parts.append(data)
                need -= len(data)
            else:
                parts.append(data[:need])
                self._buf, self._pos = data, need
                need = 0
        return b"".join(parts)

    async def recv_payload(self, n: int) -> bytearray:
        """Exactly ``n`` bytes into a fresh buffer, for write payloads."""
        out = bytearray(n)
        await self.recv_into(memoryview(out))
        return out

    async def recv_into(self, view: memoryview) -> None:
        n = len(view)
        take = min(len(self._buf) - self._pos, n)
        if take:
            view[:take] = self._buf[self._pos : self._pos + take]
            self._pos += take
        got = take
        if self._sock is not None:
            while got < n:
                try:
                    k = await self._sock.recv_into(view[got:])
                except OSError as e:
                    raise PeerClosed(str(e)) from e
                if k == 0:
                    raise PeerClosed("end of stream in payload")
                got += k
        else:
            while got < n:
                data = await self._receive(n - got)
                view[got : got + len(data)] = data
                got += len(data)

    async def discard(self, n: int) -> None:
        """Consume and drop ``n`` bytes (an oversize payload we refuse)."""
        while n:
            take = min(n, _RECV_CHUNK)
            await self.recv_exact(take)
            n -= take

    async def send(self, parts: Sequence[Buffer]) -> None:
        try:
            if self._sock is None:
                await self.stream.send_all(b"".join(parts))
                return
            views = [memoryview(p).cast("B") for p in parts if len(p)]
            while views:
                sent = await self._sock.sendmsg(views)
                while views and sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                if sent:
                    views[0] = views[0][sent:]
        except OSError as e:
            raise PeerClosed(str(e)) from e
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise PeerClosed(str(e)) from e

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.aclose()
