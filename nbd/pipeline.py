"""A pipelined NBD transmission client on a plain socket, driven by trio.

What :mod:`nbd.aio` does with libnbd, for plain TCP and unix sockets: many
requests in flight on one connection, completion callbacks on the trio
thread.  The difference is the number of system calls.  libnbd sends each
request with its own ``send`` and reads each reply in several ``recv``
calls; a server that receives requests one at a time cannot batch them.
Here requests queued while the event loop is busy (one batch of
``/dev/fuse`` requests, say) leave in one ``sendmsg`` when the loop next
waits, and replies are read with one ``recv_into`` into a large buffer in
which every whole reply is parsed.  The data of a read that does not fit in
what was received is read straight into the request's buffer.

The export is negotiated by the blocking handshake of :mod:`nbd.client`,
which negotiates neither structured replies nor extended headers: every
reply is a 16-byte simple reply, followed for a successful READ by its
data.  TLS stays with libnbd (:mod:`nbd.aio`).

Block sizes: the handshake asks for ``NBD_INFO_BLOCK_SIZE``, so the spec
binds the client to what the server advertises.  A request whose offset or
length is not a multiple of the minimum block size is refused with EINVAL
before anything is recorded or sent (libnbd's strict mode answers so too).
A READ or WRITE longer than the maximum payload is not refused: it leaves as
several requests of at most the maximum (rounded down to the minimum), whose
caller sees one request completed once every part is answered.  Without an
advertised maximum the spec's interoperable 32 MiB is used.  WRITE_ZEROES
and TRIM carry no payload, and the spec lets their length exceed the
maximum: they are sent whole.

When the connection dies (end of stream, a socket error, a reply that is
not a simple reply or names no request in flight, the watchdog's
:meth:`PipelinedConnection.expire`, :meth:`PipelinedConnection.close`)
every request in flight fails exactly once with an
:class:`~nbd.libnbd.NBDError`; reconnecting is the caller's business.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import trio

from nbd import client as handshake_client
from nbd.codec import REQUEST, SIMPLE_REPLY
from nbd.constants import (
    MAX_PAYLOAD,
    REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC,
    Command,
    OptionReply,
    TransmissionFlag,
)
from nbd.libnbd import CmdFlag, NBDError
from nbd.libnbd_errors import error_for, lost, stalled
from nbd.uri import parse_nbd_uri

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

log = logging.getLogger("moorage.nbd.pipeline")

RECEIVE_BUFFER: Final = 1 << 20  # bytes read at most per recv_into (but see _space)
SEND_BATCH: Final = 512  # buffers per sendmsg (IOV_MAX is 1024 on Linux)
_HEADER: Final = SIMPLE_REPLY.size
# the errors NBD defines (their values are Linux's); anything else is EIO
_NBD_ERRORS: Final = frozenset(
    {
        errno.EPERM,
        errno.EIO,
        errno.ENOMEM,
        errno.EINVAL,
        errno.ENOSPC,
        errno.EOVERFLOW,
        errno.ENOTSUP,
        errno.ESHUTDOWN,
    }
)
# a refused handshake as the errno libnbd reports for it (callers retry or not by it)
_REFUSALS: Final = {
    OptionReply.ERR_UNKNOWN: errno.ENOENT,
    OptionReply.ERR_POLICY: errno.EPERM,
    OptionReply.ERR_SHUTDOWN: errno.ESHUTDOWN,
    OptionReply.ERR_TLS_REQD: errno.ENOTSUP,
}


def is_plain(uri: str) -> bool:
    """Whether ``uri`` names an export this client can reach: nbd:// or nbd+unix://
    without TLS (anything else, TLS included, is libnbd's)."""
    try:
        return not parse_nbd_uri(uri).tls
    except ValueError:
        return False


class PlainClient:
    """An export negotiated on a plain socket, in transmission phase: what
    :class:`~nbd.libnbd.NBDClient` tells of an export, for one connection.

    ``minimum``: the alignment every request's offset and length must have (1
    when the server advertised none).  ``max_payload``: the longest READ or
    WRITE sent as one request: the advertised maximum (32 MiB when none was)
    rounded down to a multiple of ``minimum``, at least ``minimum``."""

    def __init__(self, negotiated: handshake_client.Negotiated) -> None:
        if isinstance(negotiated.sock, ssl.SSLSocket):
            raise ValueError("a TLS connection is libnbd's (nbd.aio)")
        self.negotiated = negotiated
        self.sock = negotiated.sock
        self._flags = negotiated.transmission_flags
        self._closed = False
        sizes = negotiated.block_size
        self.minimum: int = sizes.minimum if sizes is not None else 1
        maximum = min(sizes.maximum if sizes is not None else MAX_PAYLOAD, (1 << 32) - 1)
        self.max_payload: int = max(self.minimum, maximum - maximum % self.minimum)

    @classmethod
    def open(cls, uri: str, timeout: float = 30.0) -> PlainClient:
        """Connect to a plain ``uri`` and negotiate (blocking; ``timeout`` bounds both).
        Failures are :class:`NBDError` with the errno libnbd would give."""
        if not is_plain(uri):
            raise ValueError(f"not a plain NBD URI: {uri!r}")
        try:
            negotiated = handshake_client.connect_uri(uri, timeout)
        except handshake_client.HandshakeError as e:
            code = _REFUSALS.get(e.reply, errno.ECONNRESET) if e.reply else errno.ECONNRESET
            raise NBDError(f"{uri}: {e}", code) from e
        except TimeoutError as e:
            raise NBDError(f"{uri}: no handshake within {timeout:.1f}s", errno.ETIMEDOUT) from e
        except OSError as e:
            code = e.errno or errno.ECONNREFUSED
            if code == errno.ENOENT:
                # connect(2) to a unix socket file that is not there (yet, or any more:
                # a server restarting): nobody listens.  Only the handshake's
                # ERR_UNKNOWN says "no such export" (ENOENT, as libnbd says it).
                code = errno.ECONNREFUSED
            raise NBDError(f"{uri}: {e.strerror or e}", code) from e
        return cls(negotiated)

    def get_size(self) -> int:
        return self.negotiated.size

    def _has(self, flag: TransmissionFlag) -> bool:
        return bool(self._flags & TransmissionFlag.HAS_FLAGS and self._flags & flag)

    def is_read_only(self) -> bool:
        return self._has(TransmissionFlag.READ_ONLY)

    def can_flush(self) -> bool:
        return self._has(TransmissionFlag.SEND_FLUSH)

    def can_zero(self) -> bool:
        return self._has(TransmissionFlag.SEND_WRITE_ZEROES)

    def can_trim(self) -> bool:
        return self._has(TransmissionFlag.SEND_TRIM)

    def can_multi_conn(self) -> bool:
        return self._has(TransmissionFlag.CAN_MULTI_CONN)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()


class _Request:
    """One request in flight: where a read's data goes, and who is told."""

    __slots__ = ("done", "into", "sent")

    def __init__(self, into: memoryview | None, done: Callable[[int], None], sent: float) -> None:
        self.into = into  # a READ's destination (bytes), else None
        self.done = done
        self.sent = sent  # trio time it was queued


class _Waiter:
    """The completion of an awaited request."""

    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.error = 0

    def __call__(self, error: int) -> None:
        self.error = error
        self.event.set()


class _Joined:
    """The completion of a request sent in parts: ``done`` once every part is
    answered, with the first error any part had (0: all succeeded)."""

    __slots__ = ("done", "error", "left")

    def __init__(self, parts: int, done: Callable[[int], None]) -> None:
        self.done = done
        self.error = 0
        self.left = parts

    def __call__(self, error: int) -> None:
        if error and not self.error:
            self.error = error
        self.left -= 1
        if self.left == 0:
            self.done(self.error)


def _bytes_view(target: Any) -> memoryview:
    view = memoryview(target)
    if view.readonly:
        raise TypeError("a read needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class PipelinedConnection:
    """One negotiated plain connection, many requests in flight, driven from trio.

    The interface of :class:`nbd.aio.AioConnection`: the awaitable
    ``pread_into``/``pwrite``/``flush``/``zero``, ``submit_pread``/``submit_pwrite``
    with callbacks, ``alive``/``in_flight``, ``expire``/``stalled_since`` for a
    watchdog, ``close``/``drain``.  All calls from the trio thread of one run
    (``close`` also after it).
    """

    def __init__(self, client: PlainClient) -> None:
        self.client = client
        self._sock = client.sock
        self._sock.setblocking(False)
        self._fd = self._sock.fileno()
        self._cookies = 0
        # requests in flight by cookie, oldest first (the watchdog reads the first)
        self._pending: dict[int, _Request] = {}
        self._out: list[ReadableBuffer] = []  # queued, not yet sent
        self._send_wanted = trio.Event()
        self._started = False
        self._closed = False
        self.stalled_since: float | None = None
        self.error: NBDError | None = None
        # the receive buffer: [_start, _end) received and not yet parsed
        self._buffer = bytearray(RECEIVE_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        # a read whose data is being received straight into its buffer
        self._into: _Request | None = None
        self._into_got = 0

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered (a read whose data is arriving included)."""
        return len(self._pending) + (self._into is not None)

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed

    # ---------------------------------------------------------------- requests

    def _check(self, command: Command, offset: int, length: int, flags: int) -> None:
        """Refuse (EINVAL) a request the server must not be sent: outside the export,
        longer than a header can say, or not aligned to the minimum block size.  Before
        anything is recorded: a refused request leaves no trace."""
        if not self.alive:
            raise lost(self.error)
        size = self.client.get_size()
        if offset < 0 or length < 0 or length >= 1 << 32 or offset + length > size:
            raise error_for(
                f"{command.name} of {length} bytes at {offset}: outside the export's {size} bytes",
                errno.EINVAL,
            )
        if not 0 <= flags < 1 << 16:
            raise error_for(f"{command.name} flags {flags:#x}", errno.EINVAL)
        minimum = self.client.minimum
        if offset % minimum or length % minimum:
            raise error_for(
                f"{command.name} of {length} bytes at {offset}: not aligned to the export's "
                f"minimum block size {minimum}",
                errno.EINVAL,
            )

    def _queue(
        self,
        command: Command,
        offset: int,
        length: int,
        flags: int,
        done: Callable[[int], None],
        into: memoryview | None = None,
        payload: ReadableBuffer | None = None,
    ) -> None:
        self._check(command, offset, length, flags)
        self._send(command, offset, length, flags, done, into, payload)

    def _queue_data(
        self,
        command: Command,
        offset: int,
        length: int,
        flags: int,
        done: Callable[[int], None],
        data: memoryview,
    ) -> None:
        """A READ into ``data`` or a WRITE of it, in parts of at most the maximum
        payload if it is longer (``done`` then once, when every part is answered)."""
        self._check(command, offset, length, flags)
        reading = command == Command.READ
        if reading and data.nbytes < length:
            raise error_for(
                f"a read of {length} bytes into a buffer of {data.nbytes}", errno.EINVAL
            )
        step = self.client.max_payload
        starts = range(0, length, step) if length else range(1)
        if len(starts) > 1:
            done = _Joined(len(starts), done)
        for start in starts:
            part = data[start : start + min(step, length - start)]
            if reading:
                self._send(command, offset + start, part.nbytes, flags, done, part, None)
            else:
                self._send(command, offset + start, part.nbytes, flags, done, None, part)

    def _send(
        self,
        command: Command,
        offset: int,
        length: int,
        flags: int,
        done: Callable[[int], None],
        into: memoryview | None,
        payload: ReadableBuffer | None,
    ) -> None:
        """Record and queue a request already checked (:meth:`_check`)."""
        assert command not in (Command.READ, Command.WRITE) or length <= self.client.max_payload
        cookie = self._cookies + 1
        header = REQUEST.pack(REQUEST_MAGIC, int(flags), int(command), cookie, offset, length)
        self._start_tasks()
        self._cookies = cookie
        self._pending[cookie] = _Request(into, done, trio.current_time())
        self._out.append(header)
        if payload is not None and length:
            self._out.append(payload)
        self._send_wanted.set()

    def submit_pread(
        self, target: Any, length: int, offset: int, done: Callable[[int], None]
    ) -> None:
        """Queue a read of ``length`` bytes into ``target`` (any writable buffer, a
        ctypes array included, kept alive until answered) and return at once;
        ``done(errno)`` is called from the trio thread when it is answered (0: the
        data is there) or fails.  Raises :class:`NBDError` if the connection is gone
        (then ``done`` is never called)."""
        self._queue_data(Command.READ, offset, length, 0, done, _bytes_view(target))

    def submit_pwrite(self, data: bytes, offset: int, done: Callable[[int], None]) -> None:
        """Like :meth:`submit_pread`, for a write of ``data`` (not to change until done)."""
        view = memoryview(data).cast("B")
        self._queue_data(Command.WRITE, offset, view.nbytes, 0, done, view)

    async def _wait(self, waiter: _Waiter) -> None:
        # A cancelled wait leaves the request to finish on the wire: its buffer stays
        # referenced by the request until then.
        await waiter.event.wait()
        if waiter.error:
            raise error_for(os.strerror(waiter.error), waiter.error)

    async def pread_into(self, buffer: WriteableBuffer, offset: int, flags: int = 0) -> None:
        view = _bytes_view(buffer)
        waiter = _Waiter()
        self._queue_data(Command.READ, offset, view.nbytes, flags, waiter, view)
        await self._wait(waiter)

    async def pwrite(self, data: ReadableBuffer, offset: int, flags: int = 0) -> None:
        payload = memoryview(bytes(data))
        waiter = _Waiter()
        self._queue_data(Command.WRITE, offset, payload.nbytes, flags, waiter, payload)
        await self._wait(waiter)

    async def flush(self) -> None:
        waiter = _Waiter()
        self._queue(Command.FLUSH, 0, 0, 0, waiter)
        await self._wait(waiter)

    async def zero(self, count: int, offset: int, flags: CmdFlag | int = 0) -> None:
        waiter = _Waiter()
        self._queue(Command.WRITE_ZEROES, offset, count, int(flags), waiter)
        await self._wait(waiter)

    async def trim(self, count: int, offset: int) -> None:
        waiter = _Waiter()
        self._queue(Command.TRIM, offset, count, 0, waiter)
        await self._wait(waiter)

    # ------------------------------------------------------------------ replies

    def _space(self) -> memoryview:
        """Where the next bytes received go."""
        into = self._into
        if into is not None:
            assert into.into is not None
            return into.into[self._into_got :]
        return self._view[self._end :]

    def _received(self, count: int) -> None:
        """``count`` bytes were written to :meth:`_space`: complete every request whose
        reply is now whole.  A reply that is not a simple reply, or names no request
        in flight, kills the connection."""
        into = self._into
        if into is not None:
            self._into_got += count
            assert into.into is not None
            if self._into_got < into.into.nbytes:
                return
            self._into = None
            self._complete(into, 0)
            return
        self._end += count
        buffer, view, start, end = self._buffer, self._view, self._start, self._end
        pending = self._pending
        unpack = SIMPLE_REPLY.unpack_from
        while end - start >= _HEADER:
            magic, error, cookie = unpack(buffer, start)
            if magic != SIMPLE_REPLY_MAGIC:
                self._die(NBDError(f"not an NBD simple reply (magic {magic:#x})", errno.EPROTO))
                return
            request = pending.pop(cookie, None)
            if request is None:
                self._die(NBDError(f"a reply to no request (cookie {cookie})", errno.EPROTO))
                return
            start += _HEADER
            target = request.into
            if target is not None and error == 0:
                length = target.nbytes
                have = end - start
                if have < length:
                    # the rest of its data goes straight into its buffer
                    target[:have] = view[start:end]
                    self._into, self._into_got = request, have
                    start = end
                    break
                target[:] = view[start : start + length]
                start += length
                self._complete(request, 0)
            else:
                self._complete(request, error if error in _NBD_ERRORS or not error else errno.EIO)
            if not self.alive:
                return
        # keep what is left (part of a header) at the front
        left = end - start
        if left:
            view[:left] = view[start:end]
        self._start, self._end = 0, left

    def _complete(self, request: _Request, error: int) -> None:
        try:
            request.done(error)
        except Exception:  # one callback's failure must not stop the others
            log.exception("completion callback failed")

    # ------------------------------------------------------------------ driving

    def _start_tasks(self) -> None:
        if not self._started:
            self._started = True
            trio.lowlevel.spawn_system_task(self._read_replies, name=f"nbd-pipe-read-{self._fd}")
            trio.lowlevel.spawn_system_task(self._send_requests, name=f"nbd-pipe-send-{self._fd}")

    async def _read_replies(self) -> None:
        async def loop() -> None:
            recv_into = self._sock.recv_into
            while self.alive:
                await trio.lowlevel.wait_readable(self._fd)
                if not self.alive:
                    return
                try:
                    count = recv_into(self._space())
                except BlockingIOError:
                    continue
                if count == 0:
                    raise NBDError("the server closed the connection", errno.ECONNRESET)
                self._received(count)

        await self._driver("reply reader", loop)

    async def _send_requests(self) -> None:
        async def loop() -> None:
            sendmsg = self._sock.sendmsg
            while self.alive:
                if not self._out:
                    await self._send_wanted.wait()
                    self._send_wanted = trio.Event()
                    continue
                out = self._out
                batch = out[:SEND_BATCH]
                try:
                    sent = sendmsg(batch)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self._fd)
                    continue
                # drop what was sent; a buffer sent in part stays as its rest
                done = 0
                for item in batch:
                    size = memoryview(item).nbytes
                    if sent < size:
                        break
                    sent -= size
                    done += 1
                del out[:done]
                if sent:
                    out[0] = memoryview(out[0])[sent:]
                if out and done < len(batch):
                    await trio.lowlevel.wait_writable(self._fd)  # the socket is full

        await self._driver("request sender", loop)

    async def _driver(self, what: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a driver task's loop; a system task must not raise (it would end the run)."""
        try:
            await loop()
        except trio.ClosedResourceError:
            pass  # closed: the connection is being let go
        except NBDError as e:
            self._die(e)
        except OSError as e:
            self._die(NBDError(f"NBD {what}: {e.strerror or e}", e.errno or errno.EIO))
        except trio.Cancelled:
            raise
        except BaseException:
            log.exception("NBD %s failed", what)
            self._die(NBDError(f"{what} failed", errno.EIO))

    def _die(self, error: NBDError) -> None:
        """The connection is gone: every request still in flight fails, once."""
        if self.error is None:
            self.error = error
            if self._started:
                # wake both drivers (they see the connection dead); RuntimeError: the
                # run has ended
                with contextlib.suppress(RuntimeError):
                    trio.lowlevel.notify_closing(self._fd)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        self._send_wanted.set()
        self._out.clear()
        code = error.errno or errno.ENOTCONN
        into, self._into = self._into, None
        if into is not None:  # its reply had begun: no longer in _pending
            self._complete(into, code)
        while self._pending:
            cookie = next(iter(self._pending))
            self._complete(self._pending.pop(cookie), code)

    def expire(self, timeout: float, now: float) -> bool:
        """Declare the connection lost if its oldest request in flight was sent
        ``timeout`` seconds or more before ``now`` (trio time): every request in
        flight then fails with ``ETIMEDOUT`` and :attr:`stalled_since` says when
        that request was sent."""
        if not self.alive or not self.in_flight:
            return False
        # the oldest: a read whose data stopped coming, or the first still unanswered
        oldest = [self._into] if self._into is not None else []
        oldest += [next(iter(self._pending.values()))] if self._pending else []
        sent = min(request.sent for request in oldest)
        if now - sent < timeout:
            return False
        self.stalled_since = sent
        self._die(stalled(timeout))
        return True

    def close(self) -> None:
        """Drop the connection now (requests in flight fail) and close the socket.

        From the trio thread while the run is alive, or after it has ended.
        """
        if self._closed:
            return
        if self.error is None and not self._out and not self._pending:
            # a soft disconnect when nothing is under way (best effort)
            with contextlib.suppress(OSError):
                self._sock.send(REQUEST.pack(REQUEST_MAGIC, 0, Command.DISC, 0, 0, 0))
        self._die(NBDError("connection closed", errno.ENOTCONN))
        self._closed = True
        self.client.close()

    async def drain(self) -> None:
        """Wait until no request is in flight on this connection."""
        while self.in_flight and self.alive:
            await trio.sleep(0.005)


__all__ = ["PipelinedConnection", "PlainClient", "is_plain"]
