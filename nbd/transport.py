"""Bytes in and out of one NBD connection.

Wraps a trio stream with an input buffer.  Plain sockets get a zero-copy
path (``recv_into`` a reusable buffer, ``sendmsg`` of many replies at once);
TLS and stdio streams go through the generic stream interface.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence

import trio

from nbd.iov import consume

Buffer = bytes | bytearray | memoryview
# A buffer for request data (``data_buffer``).
DataBuffer = bytearray | mmap.mmap

# Input is read in chunks of at least this size for headers (many small
# requests per system call); a write payload beyond what such a read brought
# in goes straight into its own buffer, so a small chunk means little copying.
# While the transmission serves small requests in batches from the buffer, it
# asks for reads that fill the buffer instead (``read_ahead``).
_RECV_CHUNK = 16 * 1024
# The input buffer holds a chunk and a small write's whole payload, so the
# transmission can write that payload from here (``wait_for``).
_RECV_BUFFER = 128 * 1024
# Buffers in one sendmsg call (the kernel's IOV_MAX is 1024).
_IOV_MAX = 512
# Request data buffers from this size on are page-aligned mappings.
ALIGNED_MIN = 16 * 1024


def data_buffer(size: int) -> DataBuffer:
    """A zeroed buffer for a read's data or a write's payload; large ones page-aligned.

    The kernel copies file and socket data into user memory with ``rep
    movsb``, which on this machine's AMD EPYC runs about 3.5 times slower
    when the destination is not 64-byte aligned (a ``preadv`` of 256 KiB from
    the page cache: 0.13 s per GiB page-aligned, 0.48 s 16 bytes off), and a
    large ``bytearray`` from glibc starts 16 bytes into its page.
    """
    if size < ALIGNED_MIN:
        return bytearray(size)
    return mmap.mmap(-1, size)


class PeerClosed(Exception):
    """The peer closed the connection (cleanly or in the middle of a message)."""


class Transport:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self._rbuf = bytearray(_RECV_BUFFER)
        self._rview = memoryview(self._rbuf)
        self._start = 0
        self._end = 0
        self._chunk = _RECV_CHUNK
        self.set_stream(stream)

    def set_stream(self, stream: trio.abc.Stream) -> None:
        """Switch to a new stream (after STARTTLS); buffered input is dropped."""
        self.stream = stream
        self._sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._fd = self._sock.fileno() if self._sock is not None else -1
        self._start = self._end = 0

    async def _recv_raw(self, view: memoryview) -> int:
        """``recv`` on the plain socket; waits through trio only when nothing is there.

        trio's own socket methods pass through its scheduler on every call;
        this does not, which halves the event loop's work per request on a
        busy connection.  The caller yields now and then (``Transmission``).
        """
        while True:
            try:
                return os.readv(self._fd, [view])
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                except trio.ClosedResourceError as e:
                    raise PeerClosed(str(e)) from e
            except OSError as e:
                raise PeerClosed(str(e)) from e

    @property
    def socket(self) -> trio.socket.SocketType | None:
        """The plain socket underneath, if there is one (not TLS, not stdio)."""
        return self._sock

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def read_ahead(self, fill: bool) -> None:
        """Make each read take all the room the buffer has (``fill``), or a chunk."""
        self._chunk = len(self._rbuf) if fill else _RECV_CHUNK

    async def _fill(self, want: int = _RECV_CHUNK) -> None:
        """Read more input into the buffer: at least one byte, at most ``want`` (or a chunk)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._rbuf):
            # Move the partial message to the front; it is small (a header).
            n = self._end - self._start
            self._rbuf[:n] = self._rbuf[self._start : self._end]
            self._start, self._end = 0, n
        stop = min(len(self._rbuf), self._end + max(want, self._chunk))
        try:
            if self._sock is not None:
                got = await self._recv_raw(self._rview[self._end : stop])
            else:
                data = await self.stream.receive_some(stop - self._end)
                got = len(data)
                self._rbuf[self._end : self._end + got] = data
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise PeerClosed(str(e)) from e
        if not got:
            raise PeerClosed("end of stream")
        self._end += got

    async def wait_for(self, n: int) -> None:
        """Have at least ``n`` bytes buffered (``n`` at most the buffer's size)."""
        while self._end - self._start < n:
            if len(self._rbuf) - self._start < n:  # not enough room after start
                m = self._end - self._start
                self._rbuf[:m] = self._rbuf[self._start : self._end]
                self._start, self._end = 0, m
            await self._fill(n - (self._end - self._start))

    def take(self, n: int) -> bytes:
        """``n`` bytes that ``wait_for`` has buffered."""
        out = bytes(self._rview[self._start : self._start + n])
        self._start += n
        return out

    async def recv_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes, for headers and small messages."""
        if n > len(self._rbuf):
            big = bytearray(n)
            await self.recv_into(memoryview(big))
            return bytes(big)
        await self.wait_for(n)
        return self.take(n)

    async def recv_payload(self, n: int) -> bytearray:
        """Exactly ``n`` bytes into a fresh buffer, for write payloads."""
        out = bytearray(n)
        await self.recv_into(memoryview(out))
        return out

    async def recv_into(self, view: memoryview) -> None:
        n = len(view)
        take = min(self._end - self._start, n)
        if take:
            view[:take] = self._rview[self._start : self._start + take]
            self._start += take
        got = take
        while got < n:
            if self._sock is not None:
                k = await self._recv_raw(view[got:])
                if k == 0:
                    raise PeerClosed("end of stream in payload")
                got += k
            else:
                try:
                    data = await self.stream.receive_some(n - got)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise PeerClosed(str(e)) from e
                if not data:
                    raise PeerClosed("end of stream in payload")
                view[got : got + len(data)] = data
                got += len(data)

    async def discard(self, n: int) -> None:
        """Consume and drop ``n`` bytes (an oversize payload we refuse)."""
        scratch = memoryview(bytearray(min(n, _RECV_CHUNK)))
        while n:
            take = min(n, len(scratch))
            await self.recv_into(scratch[:take])
            n -= take

    async def send(self, parts: Sequence[Buffer]) -> None:
        try:
            if self._sock is None:
                await self.stream.send_all(b"".join(parts))
                return
            views = [memoryview(p).cast("B") for p in parts if len(p)]
            while views:
                sent = await self._sock.sendmsg(views[:_IOV_MAX])
                consume(views, sent)
        except OSError as e:
            raise PeerClosed(str(e)) from e
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise PeerClosed(str(e)) from e

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.aclose()


class BufferPool:
    """Read buffers and write payloads, reused once done with.

    A fresh buffer of a few hundred KiB costs page faults on every request;
    sequential readers and writers ask for the same size over and over.
    Buffers come from ``data_buffer`` (aligned, for fast kernel copies).
    Each size keeps up to ``keep`` buffers and ``keep_bytes`` bytes: enough
    for the requests one connection has in flight.
    """

    def __init__(
        self, max_size: int = 1024 * 1024, keep: int = 16, keep_bytes: int = 4 * 1024 * 1024
    ) -> None:
        self.max_size = max_size
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[DataBuffer]] = {}

    def get(self, size: int) -> DataBuffer:
        # Safe to share with the reply thread: list.pop and append are atomic.
        free = self._free.get(size)
        if free:
            try:
                return free.pop()
            except IndexError:  # another thread took the last one
                pass
        return data_buffer(size)

    def put(self, buf: DataBuffer) -> None:
        size = len(buf)
        if size > self.max_size:
            return
        free = self._free.setdefault(size, [])
        if len(free) < self.keep and (len(free) + 1) * size <= self.keep_bytes:
            free.append(buf)


class ReplyQueue:
    """The single writer of one connection.

    Replies are queued whole (so one reply's pieces are never split by
    another's) and a writer task sends everything queued in one ``sendmsg``.
    Queuing waits only while more than ``limit`` bytes are unsent.
    """

    def __init__(self, transport: Transport, limit: int = 2 * 1024 * 1024) -> None:
        self.t = transport
        self.limit = limit
        self._parts: list[Buffer] = []
        self._sent: list[Callable[[], None]] = []
        self._bytes = 0
        self._queued = trio.Event()
        self._drained = trio.Event()
        self._closing = False
        self.dead = False

    async def put(self, parts: Sequence[Buffer], sent: Callable[[], None] | None = None) -> None:
        """Queue one reply; ``sent`` is called once its bytes are on the socket."""
        while self._bytes > self.limit and not self.dead:
            await self._drained.wait()
        if self.dead:
            return
        self._parts.extend(parts)
        self._bytes += sum(len(p) for p in parts)
        if sent is not None:
            self._sent.append(sent)
        self._queued.set()

    def close(self) -> None:
        """Send what is queued, then make ``run`` return."""
        self._closing = True
        self._queued.set()

    async def run(self) -> None:
        """Send queued replies until closed; raises PeerClosed if the peer goes."""
        try:
            while True:
                await self._queued.wait()
                self._queued = trio.Event()
                while self._parts:
                    parts, self._parts = self._parts, []
                    callbacks, self._sent = self._sent, []
                    self._bytes = 0
                    drained, self._drained = self._drained, trio.Event()
                    drained.set()
                    await self.t.send(parts)
                    for callback in callbacks:
                        callback()
                if self._closing:
                    return
        except PeerClosed:
            self.dead = True
            self._parts = []
            self._drained.set()
            raise
