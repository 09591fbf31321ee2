"""Runs of large plain reads and writes served by one thread, start to end.

A sequential copy (``nbdcopy``, ``qemu-img convert``) sends one large
request after the other.  Served the usual way, each one passes through the
event loop (parse, wait for the payload through trio's scheduler, queue) and
then through the connection's reply thread (write or send): two Python
threads that both want the GIL for every request, so most of their time
went into handing it back and forth (11 futex calls per 256 KiB write).

Here one thread takes the socket for as long as such requests keep coming,
the way a C server's connection thread does: it reads a request, receives
its payload straight into an aligned buffer, writes it into the page cache
(or reads the data and sends it), answers, and reads the next one, waiting
in ``poll`` when the socket has nothing yet.  The event loop meanwhile waits
for the thread as one task, so the GIL has nobody else to go to.

The run ends, and the event loop reads the next request itself, at the
first request that is anything else (a flag, another command, a small one,
an unaligned or out-of-range one, a read that meets a hole), when the socket
has been idle for ``IDLE`` seconds, and when the transmission stops reading.
The request that ended the run stays in the input buffer, unanswered and
unread.

A slow write into the page cache (the kernel throttling dirty pages) does
not end the run, though it makes the event loop send its own writes to
worker threads (``Image.may_write_inline``): the run is not the event loop,
so its wait holds up nobody else.  Ending the run there cost memory and
bought nothing: the event loop then found the client's whole queue waiting
(fio keeps 32 requests of 256 KiB in flight) and took a payload buffer for
each request up to its budget (``MAX_BUFFERED``, 16 of 256 KiB), and the pool
keeps them; the run holds one write's buffer at a time.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic_ns

from nbd import codec
from nbd.constants import MAX_PAYLOAD, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, Command
from nbd.image import Image
from nbd.iov import consume
from nbd.transport import BufferPool, DataBuffer, PeerClosed, Transport

# Requests larger than this go through a run (smaller ones are the batch
# path's; ``nbd.sender.DIRECT_MAX``).
BULK_MIN = 64 * 1024 + 1
# A run ends after this long without a request (the event loop waits then).
IDLE = 0.02
# poll() waits at most this long before looking whether it must give up.
_POLL_MS = 20
# Input read along with the end of a payload: the next request's header, and
# the start of its payload.
_NEXT_CHUNK = 16 * 1024
_IOV_MAX = 512
# Read replies are sent together up to this much data.
_GATHER = 1024 * 1024
# Write replies are gathered and sent together once this many wait, or
# before the thread would wait for input.
_REPLIES_MAX = 64
# The pipe a read's data passes through on its way from the page cache to the
# socket (``splice``): reads up to this size are not copied by the server.
PIPE_SIZE = 1024 * 1024
# splice() errors that say the file or the socket cannot splice at all.
_NO_SPLICE = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS)

_REQUEST = codec.REQUEST
_HEADER = _REQUEST.size
_READ = int(Command.READ)
_WRITE = int(Command.WRITE)


@dataclass(slots=True)
class RunResult:
    """What a run did, for the event loop to count; ``error``: the connection is gone."""

    requests: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    errors: int = 0
    # Each request's time from its header to its reply queued (``moorage_nbd_request_seconds``).
    service_ns: int = 0
    # The first request after the run is not for a run (the loop serves it).
    declined: bool = False
    error: OSError | None = None


def wants_run(header: bytes | bytearray | memoryview, pos: int) -> bool:
    """Whether the request at ``pos`` looks like one a run serves (a cheap first look)."""
    magic, flags, type_, _, _, length = _REQUEST.unpack_from(header, pos)
    return (
        magic == REQUEST_MAGIC
        and not flags
        and type_ in (_READ, _WRITE)
        and BULK_MIN <= length <= MAX_PAYLOAD
    )


class BulkRun:
    """One connection's runs; ``serve`` is called in a thread, one run at a time.

    ``sending`` is the lock every writer of the connection's socket holds
    while it writes (``ThreadedReplies``), so a reply never lands in the
    middle of another.  ``cancelled`` says the connection is being closed
    (checked at least every ``_POLL_MS``); ``stopping`` says no further
    request should be read (checked between requests).
    """

    def __init__(
        self,
        transport: Transport,
        image: Image,
        pool: BufferPool,
        sending: threading.Lock,
        structured: bool,
        min_block_size: int,
        read_only: bool,
        stopping: Callable[[], bool],
        hole_check_min: int,
        wire_errno: Callable[[OSError, int, int], int],
    ) -> None:
        self.t = transport
        self.image = image
        self.pool = pool
        self.sending = sending
        self.structured = structured
        self.mask = min_block_size - 1
        self.read_only = read_only
        self.stopping = stopping
        self.hole_check_min = hole_check_min
        self.wire_errno = wire_errno
        self.cancelled = False
        self.unlimited: Callable[[], bool] = lambda: True
        self._fd = transport._fd
        self._replies = bytearray()
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._out_poll: select.poll | None = None
        # Opened by the first read (``_open_pipe``); -1: reads are copied.
        self._pipe: tuple[int, int] | None = None
        self._pipe_size = 0
        self._sock: socket.socket | None = None

    def close(self) -> None:
        """Close the pipe and the socket's duplicate (the connection's own fd stays)."""
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._pipe_size = -1

    # ---------------------------------------------------------------- run

    def serve(self) -> RunResult:
        """Serve requests until one is not for a run, or the socket goes quiet."""
        result = RunResult()
        try:
            self._serve(result)
            self._send_replies()
        except PeerClosed as e:
            result.error = OSError(errno.EPIPE, str(e))
        except OSError as e:
            result.error = e
        return result

    def _serve(self, result: RunResult) -> None:
        t = self.t
        while not self.cancelled and not self.stopping():
            if t._end - t._start < _HEADER and not self._fill_header():
                return
            req = self._next()
            if req is None:
                result.declined = True
                return
            type_, cookie, offset, length = req
            if type_ == _WRITE:
                started = monotonic_ns()
                t._start += _HEADER
                result.requests += 1
                self._write(cookie, offset, length, result)
                result.service_ns += monotonic_ns() - started
            else:
                self._reads(req, result)
            if len(self._replies) >= _REPLIES_MAX * 16:
                self._send_replies()

    def _next(self) -> tuple[int, int, int, int] | None:
        """The buffered request (type, cookie, offset, length) if a run serves it."""
        t = self.t
        image = self.image
        magic, flags, type_, cookie, offset, length = _REQUEST.unpack_from(t._rbuf, t._start)
        if (
            magic != REQUEST_MAGIC
            or flags
            or not BULK_MIN <= length <= MAX_PAYLOAD
            or (offset | length) & self.mask
            or offset + length > image.size
            or not self.unlimited()
        ):
            return None
        if type_ == _WRITE:
            if self.read_only:
                return None
        elif type_ == _READ:
            if self.structured and length >= self.hole_check_min:
                runs = image.extents(offset, length, limit=2)
                if len(runs) != 1 or runs[0][1]:
                    return None  # holes: the event loop's reply has hole chunks
        else:
            return None
        return type_, cookie, offset, length

    # ------------------------------------------------------------- writes

    def _write(self, cookie: int, offset: int, length: int, result: RunResult) -> None:
        buf = self.pool.get(length)
        try:
            view = memoryview(buf)
            self._receive(view)
            try:
                self.image.writev_timed([view], offset)
            except OSError as e:
                result.errors += 1
                code = self.wire_errno(e, _WRITE, 0)
            else:
                code = 0
                result.written_bytes += length
            self._replies += codec.SIMPLE_REPLY.pack(SIMPLE_REPLY_MAGIC, code, cookie)
        finally:
            self.pool.put(buf)

    def _receive(self, view: memoryview) -> None:
        """The payload: what is buffered, then the rest straight from the socket.

        Each read past the buffered part also offers the input buffer, so
        the next request's header comes in with the end of this payload.
        """
        t = self.t
        n = len(view)
        got = min(t._end - t._start, n)
        view[:got] = t._rview[t._start : t._start + got]
        t._start += got
        if got == n:
            return
        t._start = t._end = 0  # the buffer is empty now
        ahead = t._rview[:_NEXT_CHUNK]
        while got < n:
            try:
                k = os.readv(self._fd, [view[got:], ahead])
            except BlockingIOError:
                self._send_replies()
                self._wait_readable(idle_ends=False)
                continue
            if k == 0:
                raise PeerClosed("end of stream in payload")
            if k > n - got:
                t._end = k - (n - got)
                return
            got += k

    # -------------------------------------------------------------- reads

    def _reads(self, req: tuple[int, int, int, int], result: RunResult) -> None:
        """Serve the read ``req`` and the reads buffered after it.

        A read that fits the pipe goes from the page cache to the socket
        without a copy in this process (``splice``), right behind its reply
        header.  Other reads are copied into buffers and sent together, up
        to ``_GATHER`` bytes in one ``writev`` (with any write replies still
        waiting), as the reply thread sends them.
        """
        t = self.t
        parts = [memoryview(self._replies)]
        self._replies = bytearray()
        bufs: list[DataBuffer] = []
        gathered = 0
        try:
            while True:
                _, cookie, offset, length = req
                started = monotonic_ns()
                t._start += _HEADER
                result.requests += 1
                if self._read_one(cookie, offset, length, parts, bufs, result):
                    gathered += length
                result.service_ns += monotonic_ns() - started
                if (
                    gathered >= _GATHER
                    or t._end - t._start < _HEADER
                    or self.cancelled
                    or self.stopping()
                ):
                    break
                following = self._next()
                if following is None or following[0] != _READ:
                    break
                req = following
            self._send(parts)
        finally:
            for buf in bufs:
                self.pool.put(buf)

    def _read_one(
        self,
        cookie: int,
        offset: int,
        length: int,
        parts: list[memoryview],
        bufs: list[DataBuffer],
        result: RunResult,
    ) -> bool:
        """Answer one read: spliced and sent now, or added to ``parts``; True: data in ``parts``."""
        spliced = 0
        if length <= self._pipe_size or (self._pipe_size == 0 and self._open_pipe(length)):
            spliced, error = self._splice_in(offset, length)
            if error is not None and error.errno in _NO_SPLICE:
                self._pipe_size = -1  # copied from now on
            if spliced == length:
                parts.append(memoryview(self._data_head(cookie, offset, length)))
                self._send_spliced(parts, length)
                parts.clear()
                result.read_bytes += length
                return False
        # Copied: what the pipe took comes out of it first (an error or the
        # end of the file stopped it), the rest is read as usual.
        buf = self.pool.get(length)
        bufs.append(buf)
        view = memoryview(buf)
        try:
            if spliced:
                self._drain_pipe(view[:spliced])
            self.image.read_into(view[spliced:], offset + spliced)
        except OSError as e:
            result.errors += 1
            code = self.wire_errno(e, _READ, 0)
            if self.structured:
                head = codec.encode_error_chunk(cookie, code, e.strerror or str(e))
            else:
                head = codec.encode_simple_reply(cookie, code)
            parts.append(memoryview(head))
            return False
        parts += (memoryview(self._data_head(cookie, offset, length)), view)
        result.read_bytes += length
        return True

    def _data_head(self, cookie: int, offset: int, length: int) -> bytes:
        if self.structured:
            return codec.encode_offset_data_header(cookie, offset, length, True)
        return codec.encode_simple_reply(cookie)

    # ------------------------------------------------------------ splice

    def _open_pipe(self, length: int) -> bool:
        """The pipe for spliced reads; False: ``length`` does not fit, or no pipe."""
        try:
            r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            self._pipe_size = -1
            return False
        self._pipe = (r, w)
        try:
            self._pipe_size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:  # over the user's pipe allowance: the size it has
            self._pipe_size = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
        # For MSG_MORE (the reply header waits for its data); shares the
        # connection's open file, so it stays non-blocking.
        self._sock = socket.socket(fileno=os.dup(self._fd))
        return length <= self._pipe_size

    def _splice_in(self, offset: int, length: int) -> tuple[int, OSError | None]:
        """Move up to ``length`` bytes of the image at ``offset`` into the empty pipe.

        Returns how many it holds, fewer than ``length`` at the end of the
        file, when the pipe is full (pages not aligned to its slots) or at
        an error (returned, for the copied read to meet again or not).
        """
        assert self._pipe is not None
        w = self._pipe[1]
        image = self.image
        got = 0
        while got < length:
            try:
                n = image.splice_to(w, offset + got, length - got)
            except BlockingIOError:
                break
            except OSError as e:
                return got, e
            if n == 0:
                break
            got += n
        return got, None

    def _drain_pipe(self, view: memoryview) -> None:
        """Read back the ``len(view)`` bytes the pipe holds (a read that is copied after all)."""
        assert self._pipe is not None
        got = 0
        while got < len(view):
            got += os.readv(self._pipe[0], [view[got:]])

    def _send_spliced(self, parts: list[memoryview], length: int) -> None:
        """Send ``parts`` (ending in a reply header) then the ``length`` bytes in the pipe."""
        assert self._pipe is not None and self._sock is not None
        views = [v for v in parts if len(v)]
        r = self._pipe[0]
        self._lock_sending()
        try:
            while views:
                try:
                    sent = self._sock.sendmsg(views[:_IOV_MAX], (), socket.MSG_MORE)
                except BlockingIOError:
                    self._wait_writable()
                    continue
                consume(views, sent)
            while length:
                try:
                    n = os.splice(r, self._fd, length)
                except BlockingIOError:
                    self._wait_writable()
                    continue
                if n == 0:
                    raise OSError(errno.EIO, "the pipe ran dry in a spliced read")
                length -= n
        finally:
            self.sending.release()

    # ------------------------------------------------------------- socket

    def _fill_header(self) -> bool:
        """Read until a request header is buffered; False: the socket went quiet."""
        t = self.t
        if t._start and len(t._rbuf) - t._start < _NEXT_CHUNK:
            m = t._end - t._start
            t._rbuf[:m] = t._rbuf[t._start : t._end]
            t._start, t._end = 0, m
        while t._end - t._start < _HEADER:
            try:
                k = os.readv(self._fd, [t._rview[t._end : t._start + _NEXT_CHUNK]])
            except BlockingIOError:
                self._send_replies()
                if not self._wait_readable(idle_ends=True):
                    return False
                continue
            if k == 0:
                return False  # the event loop's own read sees the end
            t._end += k
        return True

    def _wait_readable(self, idle_ends: bool) -> bool:
        """Wait for input; False once idle for ``IDLE`` s (only if ``idle_ends``)."""
        waited = 0
        while not self._poll.poll(_POLL_MS):
            if self.cancelled:
                raise PeerClosed("connection closed while a run waited for input")
            waited += _POLL_MS
            if idle_ends and (waited >= IDLE * 1000 or self.stopping()):
                return False
        return True

    def _send_replies(self) -> None:
        if self._replies:
            self._send([memoryview(self._replies)])
            self._replies = bytearray()

    def _lock_sending(self) -> None:
        while not self.sending.acquire(timeout=_POLL_MS / 1000):
            if self.cancelled:
                raise PeerClosed("connection closed while a run waited to send")

    def _send(self, views: list[memoryview]) -> None:
        views = [v for v in views if len(v)]
        if not views:
            return
        self._lock_sending()
        try:
            while views:
                try:
                    sent = os.writev(self._fd, views[:_IOV_MAX])
                except BlockingIOError:
                    self._wait_writable()
                    continue
                consume(views, sent)
        finally:
            self.sending.release()

    def _wait_writable(self) -> None:
        if self._out_poll is None:
            self._out_poll = select.poll()
            self._out_poll.register(self._fd, select.POLLOUT)
        while not self._out_poll.poll(_POLL_MS):
            if self.cancelled:
                raise PeerClosed("connection closed while a run waited to send")
