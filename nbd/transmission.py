"""The transmission phase: requests in, replies out, many in flight.

One reader task parses requests.  A request that the page cache can answer
without blocking (RWF_NOWAIT) is answered inline; anything that may block
(a cold read, FUA, FLUSH, TRIM, ...) runs in a worker thread from a task of
its own, so replies go out in whatever order they finish.  On a plain
socket, large replies and large plain writes go to the connection's reply
thread (``nbd.sender``), so copying their bytes overlaps with parsing the
next request.  Either way there is a single writer on the socket.
"""

from __future__ import annotations

import errno
import functools
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from time import monotonic_ns
from typing import TYPE_CHECKING, TypeVar

import trio

from nbd import codec
from nbd.bulk import BulkRun, RunResult, wants_run
from nbd.codec import ProtocolError, Request
from nbd.constants import (
    MAX_PAYLOAD,
    REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
    Command,
    CommandFlag,
    Errno,
    ReplyFlag,
    ReplyType,
)
from nbd.exports import ExportStats
from nbd.handshake import BASE_ALLOCATION_ID, Session
from nbd.holds import Holds
from nbd.sender import DIRECT_MAX, ThreadedReplies, WriteJob
from nbd.throttle import Throttle
from nbd.transport import (
    Buffer,
    BufferPool,
    DataBuffer,
    PeerClosed,
    ReplyQueue,
    Transport,
    data_buffer,
)

if TYPE_CHECKING:
    from outcome import Outcome

log = logging.getLogger("moorage.nbd")

T = TypeVar("T")

# Reads at least this long are checked for holes (structured replies only).
HOLE_CHECK_MIN = 64 * 1024
# Requests up to this size are tried inline on the event loop first.
INLINE_MAX = 1024 * 1024
# Most requests one connection may have in flight before we stop reading.
MAX_IN_FLIGHT = 128
# Most request data (read buffers, write payloads) one connection holds at once.
MAX_BUFFERED = 4 * 1024 * 1024
# The reader yields to other tasks at least once per this many requests (its
# socket reads do not pass through trio's scheduler when data is waiting).
YIELD_EVERY = 8
# Most extents in one BLOCK_STATUS reply.
MAX_EXTENTS = 4096
# Plain reads and writes up to this size, with their payload in the input
# buffer, are served in batches (``_serve_batch``).
BATCH_MAX = DIRECT_MAX
# Room for one batch's replies, read data included.
BATCH_BYTES = 256 * 1024
# After a run of large requests (``nbd.bulk``) that served nothing, this many
# requests are served by the event loop before a run is tried again.
BULK_BACKOFF = 64

_REQUEST_MAGIC = REQUEST_MAGIC
_SIMPLE_REPLY_MAGIC = SIMPLE_REPLY_MAGIC
_OFFSET_DATA_HEADER = struct.Struct(">IHHQIQ")  # chunk header, then the data's offset
_OFFSET_DATA_DONE = (STRUCTURED_REPLY_MAGIC, int(ReplyFlag.DONE), int(ReplyType.OFFSET_DATA))
_READ = int(Command.READ)
_WRITE = int(Command.WRITE)

_ALLOWED_FLAGS: dict[int, int] = {
    Command.READ: CommandFlag.DF,
    Command.WRITE: CommandFlag.FUA,
    Command.DISC: 0,
    Command.FLUSH: 0,
    Command.TRIM: CommandFlag.FUA,
    Command.CACHE: 0,
    Command.WRITE_ZEROES: CommandFlag.FUA | CommandFlag.NO_HOLE | CommandFlag.FAST_ZERO,
    Command.BLOCK_STATUS: CommandFlag.REQ_ONE,
}

# Host errors with an obvious counterpart among the wire's error values.
_ERRNO_MAP = {
    errno.EPERM: Errno.EPERM,
    errno.EACCES: Errno.EPERM,
    errno.EROFS: Errno.EPERM,
    errno.ENOSPC: Errno.ENOSPC,
    errno.EDQUOT: Errno.ENOSPC,
    errno.EFBIG: Errno.ENOSPC,
    errno.ENOMEM: Errno.ENOMEM,
    errno.EINVAL: Errno.EINVAL,
    errno.ESHUTDOWN: Errno.ESHUTDOWN,
}


def wire_errno(e: OSError, command: int, flags: int) -> Errno:
    """The error value a reply to ``command`` (with ``flags``) carries for host error ``e``.

    The spec keeps two values for one case each: ENOTSUP answers only a
    WRITE_ZEROES sent with FAST_ZERO (the zeroing would not be fast), and
    EOVERFLOW only a READ sent with DF (the reply would need fragments).
    Everywhere else those host errors become EINVAL, the value a client is
    told to assume for an error it does not expect; anything without a
    counterpart is EIO.
    """
    code = e.errno or 0
    if code in (errno.EOPNOTSUPP, errno.ENOTSUP):
        fast_zero = command == Command.WRITE_ZEROES and flags & CommandFlag.FAST_ZERO
        return Errno.ENOTSUP if fast_zero else Errno.EINVAL
    if code == errno.EOVERFLOW:
        unfragmented = command == Command.READ and flags & CommandFlag.DF
        return Errno.EOVERFLOW if unfragmented else Errno.EINVAL
    return _ERRNO_MAP.get(code, Errno.EIO)


class ByteBudget:
    """A weighted semaphore: bytes one connection may hold for requests in flight."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._freed = trio.Event()

    async def take(self, n: int) -> int:
        """Wait for ``n`` bytes (a request larger than the budget takes all of it)."""
        n = min(n, self.total)
        while self.used + n > self.total:
            await self._freed.wait()
        self.used += n
        return n

    def give(self, n: int) -> None:
        if n:
            self.used -= n
            freed, self._freed = self._freed, trio.Event()
            freed.set()


class RequestError(Exception):
    def __init__(self, error: Errno, message: str) -> None:
        super().__init__(message)
        self.error = error


class Transmission:
    def __init__(
        self,
        transport: Transport,
        session: Session,
        io_limiter: trio.CapacityLimiter,
        label: str,
    ) -> None:
        self.t = transport
        self.s = session
        self.image = session.image
        self.limiter = io_limiter
        self.label = label
        self.reader_scope = trio.CancelScope()
        sock = transport.socket
        # A plain socket gets a reply thread; TLS and stdio streams are
        # written through trio (their writes need the event loop).
        self.replies: ReplyQueue | ThreadedReplies = (
            ThreadedReplies(sock) if sock is not None else ReplyQueue(transport)
        )
        self._buffers = BufferPool()
        self._batch = bytearray(BATCH_BYTES)
        self._batch_view = memoryview(self._batch)
        self._in_flight = trio.Semaphore(MAX_IN_FLIGHT)
        self._budget = ByteBudget(MAX_BUFFERED)
        self._stopping = False
        self._awaiting_request = False
        # Waiting at a hold on the image (``nbd.holds``), or done reading.
        self._at_hold = False
        self._reading_done = False
        # The server's holds, set by the server once the connection is registered.
        self.holds: Holds | None = None
        self._bulk: BulkRun | None = None
        self._bulk_after = 0  # no run before this many requests
        self.requests = 0
        self.threaded = 0
        # The export's I/O limits, shared with its other connections (set by
        # the server once the connection is registered on the export).
        self.throttle: Throttle | None = None
        self.stats = ExportStats()  # the export's shared counters, once registered

    def stop_reading(self) -> None:
        """Read no more requests; those already read still get their replies.

        Only a wait for the next request (or at a hold) is interrupted: cancelling the reader
        while it writes an inline reply would leave half a reply on the wire,
        with the replies of other requests following it.
        """
        self._stopping = True
        if self._awaiting_request or self._at_hold:
            self.reader_scope.cancel()

    @property
    def image_path(self) -> Path:
        return self.s.export.path

    def quiet(self) -> bool:
        """Whether nothing this connection read is being served, and its reader
        waits (for a request, or at a hold) or has stopped: a hold's test."""
        parked = self._awaiting_request or self._at_hold or self._reading_done
        if not parked or self._in_flight.value != MAX_IN_FLIGHT:
            return False
        return not (isinstance(self.replies, ThreadedReplies) and self.replies.writes_pending())

    # ------------------------------------------------------------ replies

    async def _send(self, parts: list[Buffer]) -> None:
        await self.replies.put(parts)

    async def _ok(self, req: Request) -> None:
        await self._send([codec.encode_simple_reply(req.cookie)])

    async def _fail(self, req: Request, error: Errno, message: str) -> None:
        self.stats.errors += 1
        log.debug("%s: request %s failed: %s %s", self.label, req, error.name, message)
        if self.s.structured and req.type in (Command.READ, Command.BLOCK_STATUS):
            await self._send([codec.encode_error_chunk(req.cookie, error, message)])
        else:
            await self._send([codec.encode_simple_reply(req.cookie, error)])

    async def _thread(self, fn: Callable[..., T], *args: object) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    # ------------------------------------------------------------- reader

    async def run(self) -> None:
        """Serve until the client disconnects, errs, or the server shuts down."""
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(self._write_replies)
                async with trio.open_nursery() as nursery:
                    try:
                        with self.reader_scope:
                            await self._read_loop(nursery)
                    finally:
                        self._reading_done = True
                    # The nursery now waits for every request already read.
                self.replies.close()  # the writer sends what is queued, then ends
        finally:
            self.image.close()
            # The run refers back to this transmission: without this the pair
            # (and the run's pooled buffers) would wait for the cycle collector.
            # No thread serves it any more (``_in_thread`` waits for the thread).
            if self._bulk is not None:
                self._bulk.close()
                self._bulk = None

    async def _write_replies(self) -> None:
        try:
            await self.replies.run()
        except PeerClosed:
            log.debug("%s: client stopped taking replies", self.label)
            self.reader_scope.cancel()

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        t = self.t
        header_size = codec.REQUEST.size
        batches = isinstance(self.replies, ThreadedReplies)
        last_yield = 0
        while not self._stopping:
            if t.buffered < header_size:
                self._awaiting_request = True
                try:
                    await t.wait_for(header_size)
                except PeerClosed:
                    log.debug("%s: client went away", self.label)
                    return
                finally:
                    self._awaiting_request = False
            holds = self.holds
            if holds and holds.holding(self.s.export.path) is not None:
                self._at_hold = True
                try:
                    await holds.wait_released(self.s.export.path)
                finally:
                    self._at_hold = False
                continue  # the connection may have been told to stop meanwhile
            if batches:
                served, need = await self._serve_batch()
                # While requests come in batches, read as much as there is
                # room for: each read (and each batch's reply) then covers
                # many small writes, not the 3 or 4 that a chunk holds.
                t.read_ahead(served > 0 or need > 0)
                if served and self.requests - last_yield >= YIELD_EVERY:
                    last_yield = self.requests
                    await trio.lowlevel.checkpoint()
                if need:
                    # A small write whose payload has not all come in yet.
                    try:
                        await t.wait_for(need)
                    except PeerClosed:
                        log.warning("%s: client went away in the middle of a write", self.label)
                        return
                    continue
                if served:
                    continue
                if self.requests >= self._bulk_after and wants_run(t._rbuf, t._start):
                    if not await self._serve_run():
                        return
                    continue
            header = t.take(header_size)
            try:
                req = codec.decode_request(header)
            except ProtocolError as e:
                log.warning("%s: %s; closing connection", self.label, e)
                return
            self.requests += 1
            if req.type == Command.DISC:
                log.debug("%s: soft disconnect", self.label)
                return
            # its time counts from here, its header parsed, as a batch's does
            # (_serve_batch): the yield below and a limited export's wait for
            # its IOPS or bandwidth limit are part of what its client sees
            started = monotonic_ns()
            if self.requests - last_yield >= YIELD_EVERY:
                last_yield = self.requests
                await trio.lowlevel.checkpoint()
            stats = self.stats
            stats.requests += 1
            if req.type == Command.READ:
                stats.read_bytes += req.length
            elif req.type == Command.WRITE:
                stats.written_bytes += req.length
            if self.throttle is not None and not self.throttle.unlimited:
                moved = req.length if req.type in (Command.READ, Command.WRITE) else 0
                await self.throttle.admit(moved)
            # Bound the request data one connection holds in memory at once.
            cost = 0
            if req.type in (Command.READ, Command.WRITE) and req.length <= MAX_PAYLOAD:
                cost = await self._budget.take(req.length)
            if not await self._serve_one(req, cost, nursery, started):
                return

    async def _serve_one(
        self, req: Request, cost: int, nursery: trio.Nursery, started: int
    ) -> bool:
        """Take a request's payload and serve it, inline or in a task; False: stop
        reading.  ``started``: when its header was read (monotonic_ns)."""
        handed_off = False
        payload: DataBuffer | None = None
        try:
            if req.type == Command.WRITE:
                if req.length > MAX_PAYLOAD:
                    try:
                        await self.t.discard(req.length)
                    except PeerClosed:
                        return False
                    await self._fail(req, Errno.EINVAL, "write payload exceeds maximum")
                    return True
                payload = self._buffers.get(req.length)
                try:
                    await self.t.recv_into(memoryview(payload))
                except PeerClosed:
                    log.warning("%s: client went away in the middle of a write", self.label)
                    return False
            error = self._validate(req)
            if error is not None:
                await self._fail(req, *error)
                return True
            if payload is not None and await self._try_write_in_sender(req, payload):
                payload = None  # the reply thread puts it back in the pool
                return True
            if await self._try_inline(req, payload):
                return True
            await self._in_flight.acquire()
            self.threaded += 1
            nursery.start_soon(self._handle, req, payload, cost, started)
            handed_off = True
            return True
        finally:
            if not handed_off:
                self.stats.service_ns += monotonic_ns() - started
                self._budget.give(cost)
                if payload is not None:
                    self._buffers.put(payload)

    async def _serve_batch(self) -> tuple[int, int]:
        """Serve the plain small reads and writes waiting in the input buffer.

        The common case, done without a task switch, an object or an
        allocation per request: each request is parsed in place, a read is
        made into the batch's reply buffer right after its reply header (from
        the page cache, RWF_NOWAIT), a write from the input buffer itself,
        and every reply goes out in one system call.  It stops at the first
        request that needs more (any flag, a thread, an error, anything else
        ``_validate`` might refuse); the request-by-request path serves that
        one.  Returns (requests served, bytes that must be buffered first to
        go on: a write whose payload has not all come in, else 0).
        """
        t = self.t
        rbuf, rview = t._rbuf, t._rview
        pos, end = t._start, t._end
        out, oview = self._batch, self._batch_view
        room = len(out)
        image = self.image
        size = image.size
        mask = self.s.export.min_block_size - 1
        structured = self.s.structured
        may_write = not self.s.export.read_only
        if self.throttle is not None and not self.throttle.unlimited:
            return 0, 0
        started = 0  # read once the first request is parsed and qualifies
        unpack = codec.REQUEST.unpack_from
        image.begin_inline()
        used = served = read = written = need = 0
        while end - pos >= 28:
            magic, flags, type_, cookie, offset, length = unpack(rbuf, pos)
            if (
                magic != _REQUEST_MAGIC
                or flags
                or not 0 < length <= BATCH_MAX
                or (offset | length) & mask
                or offset + length > size
            ):
                break
            # The batch's time counts from its first request's header parsed and
            # found servable here, as a request served alone counts from its
            # header parsed; every request of the batch was in the buffer by
            # then, and its reply is queued with the others' at the end.  A
            # batch that serves nothing (the usual case before a request served
            # alone) reads no clock.
            if type_ == _READ:
                head = 28 if structured else 16
                if used + head + length > room:
                    break
                if not served:
                    started = monotonic_ns()
                try:
                    got = image.read_nowait(oview[used + head : used + head + length], offset)
                except OSError:
                    break  # answered by the request-by-request path
                if got != length:
                    break
                if structured:
                    _OFFSET_DATA_HEADER.pack_into(
                        out, used, *_OFFSET_DATA_DONE, cookie, length + 8, offset
                    )
                else:
                    codec.SIMPLE_REPLY.pack_into(out, used, _SIMPLE_REPLY_MAGIC, 0, cookie)
                used += head + length
                pos += 28
                read += length
            elif type_ == _WRITE and may_write:
                if end - pos - 28 < length:
                    if 28 + length <= len(rbuf):
                        need = 28 + length
                    break
                if used + 16 > room:
                    break
                if not served:
                    started = monotonic_ns()
                try:
                    if not image.write_inline(rview[pos + 28 : pos + 28 + length], offset):
                        break
                except OSError:
                    break  # done again, and answered, by the request-by-request path
                codec.SIMPLE_REPLY.pack_into(out, used, _SIMPLE_REPLY_MAGIC, 0, cookie)
                used += 16
                pos += 28 + length
                written += length
            else:
                break
            served += 1
        t._start = pos
        if served:
            self.requests += served
            stats = self.stats
            stats.requests += served
            stats.read_bytes += read
            stats.written_bytes += written
            stats.service_ns += served * (monotonic_ns() - started)
            replies = self.replies
            assert isinstance(replies, ThreadedReplies)
            if not replies.send_now(oview[:used]):
                await replies.put([bytes(oview[:used])])
        return served, need

    async def _serve_run(self) -> bool:
        """Serve a run of large plain requests in one thread (``nbd.bulk``); False: stop.

        The event loop waits for the thread as one task: no request of the
        run passes through it.  Cancelled (the export went away), the
        thread is told and waited for (at most ``nbd.bulk._POLL_MS`` or the
        request it is serving).
        """
        if self.throttle is not None and not self.throttle.unlimited:
            self._bulk_after = self.requests + BULK_BACKOFF
            return True
        run = self._bulk
        if run is None:
            replies = self.replies
            assert isinstance(replies, ThreadedReplies)
            throttle = self.throttle
            run = self._bulk = BulkRun(
                self.t,
                self.image,
                self._buffers,
                replies.sending_lock,
                self.s.structured,
                self.s.export.min_block_size,
                self.s.export.read_only,
                self._run_must_end,
                HOLE_CHECK_MIN,
                lambda e, command, flags: int(wire_errno(e, command, flags)),
            )
            if throttle is not None:
                run.unlimited = lambda: throttle.unlimited
        run.cancelled = False
        result = await _in_thread(run.serve, run)
        self.requests += result.requests
        stats = self.stats
        stats.requests += result.requests
        stats.read_bytes += result.read_bytes
        stats.written_bytes += result.written_bytes
        stats.errors += result.errors
        stats.service_ns += result.service_ns
        if result.error is not None:
            log.debug("%s: connection lost during a run: %s", self.label, result.error)
            return False
        if result.declined:
            self._bulk_after = self.requests + (1 if result.requests else BULK_BACKOFF)
        return True

    def _run_must_end(self) -> bool:
        """Asked by a run between requests: stop reading, or a hold on the image
        (the event loop then waits at the hold, where the run could not)."""
        holds = self.holds
        return self._stopping or bool(holds and holds.names(self.s.export.path))

    def _validate(self, req: Request) -> tuple[Errno, str] | None:
        # A request read while the server shuts down is served like any other,
        # never answered ESHUTDOWN: the kernel's nbd client takes an error reply
        # as EIO for good, where a request left unread is sent again on its next
        # connection (the server stops reading, then drains what it read).
        allowed = _ALLOWED_FLAGS.get(req.type)
        if allowed is None:
            return Errno.EINVAL, f"unknown command {req.type}"
        if req.flags & ~int(allowed):
            return Errno.EINVAL, f"flags {req.flags:#x} not valid for command {req.type}"
        if req.flags & CommandFlag.DF and not self.s.structured:
            return Errno.EINVAL, "DF without structured replies"
        if req.type == Command.BLOCK_STATUS and not self.s.base_allocation:
            return Errno.EINVAL, "no meta context negotiated"
        if req.type == Command.FLUSH:
            if req.offset or req.length:
                return Errno.EINVAL, "FLUSH with offset or length"
            return None
        ro = self.s.export.read_only
        if ro and req.type in (Command.WRITE, Command.TRIM, Command.WRITE_ZEROES):
            return Errno.EPERM, "export is read-only"
        if req.length == 0:
            return Errno.EINVAL, "zero-length request"
        if req.type == Command.READ and req.length > MAX_PAYLOAD:
            return Errno.EINVAL, "read longer than maximum payload"
        size = self.image.size
        if req.offset > size or req.length > size - req.offset:
            size = self.image.grown_size()  # beyond the handshake's size: did it grow?
        if req.offset > size or req.length > size - req.offset:
            if req.type in (Command.WRITE, Command.WRITE_ZEROES):
                return Errno.ENOSPC, "beyond end of export"
            return Errno.EINVAL, "beyond end of export"
        mbs = self.s.export.min_block_size
        aligned = not (req.offset % mbs or req.length % mbs)
        # TRIM is advisory: an unaligned one is shrunk to aligned blocks instead.
        if not aligned and req.type in (Command.READ, Command.WRITE):
            return Errno.EINVAL, f"not aligned to {mbs} bytes"
        return None

    # ------------------------------------------------------ inline fast path

    async def _try_write_in_sender(self, req: Request, payload: DataBuffer) -> bool:
        """Leave a plain write to the reply thread, which writes, then answers.

        Only while writes into the page cache are quick (a slow one sends the
        writes of the next second to worker threads instead), so a reply
        queued behind a write does not wait for a disk.
        """
        replies = self.replies
        if (
            not isinstance(replies, ThreadedReplies)
            or req.type != Command.WRITE
            or len(payload) <= DIRECT_MAX  # cheaper inline than handed over
            or req.flags
            or not self.image.may_write_inline()
        ):
            return False
        label, pool = self.label, self._buffers

        def fail(e: OSError) -> bytes:
            log.warning("%s: I/O error on %s: %s", label, req, e)
            return codec.encode_simple_reply(req.cookie, wire_errno(e, req.type, req.flags))

        job = WriteJob(
            self.image.writev_timed,
            req.offset,
            memoryview(payload),
            codec.encode_simple_reply(req.cookie),
            fail,
        )
        await replies.put_write(job, functools.partial(pool.put, payload))
        return True

    async def _try_inline(self, req: Request, payload: DataBuffer | None) -> bool:
        """Answer without blocking if the page cache allows; False if a thread is needed.

        A read or write that completes only in part is redone whole in a
        thread: it has not been acknowledged, so doing it again is harmless.
        """
        if req.length > INLINE_MAX:
            return False
        try:
            if req.type == Command.READ:
                extents = None
                if self.s.structured and req.length >= HOLE_CHECK_MIN and not req.flags:
                    # SEEK_DATA/SEEK_HOLE only walk the extent map: cheap enough inline.
                    extents = self.image.extents(req.offset, req.length, limit=64)
                all_hole = extents is not None and len(extents) == 1 and extents[0][1]
                if all_hole:
                    await self._send_read(req, bytearray(req.length), extents)
                    return True
                buf = self._buffers.get(req.length)
                if self.image.read_nowait(memoryview(buf), req.offset) != req.length:
                    self._buffers.put(buf)
                    return False
                await self._send_read(req, buf, extents, lambda: self._buffers.put(buf))
                return True
            if req.type == Command.WRITE and payload is not None and not req.flags:
                self.image.begin_inline()
                if not self.image.write_inline(memoryview(payload), req.offset):
                    return False
                await self._ok(req)
                return True
        except OSError as e:
            await self._fail(req, wire_errno(e, req.type, req.flags), e.strerror or str(e))
            return True
        return False

    # ------------------------------------------------------ threaded path

    async def _handle(
        self, req: Request, payload: DataBuffer | None, cost: int, started: int
    ) -> None:
        try:
            await self._dispatch(req, payload)
        except RequestError as refused:
            await self._fail(req, refused.error, str(refused))
        except OSError as e:
            log.warning("%s: I/O error on %s: %s", self.label, req, e)
            await self._fail(req, wire_errno(e, req.type, req.flags), e.strerror or str(e))
        finally:
            self.stats.service_ns += monotonic_ns() - started
            self._in_flight.release()
            self._budget.give(cost)
            if payload is not None:
                self._buffers.put(payload)

    async def _dispatch(self, req: Request, payload: DataBuffer | None) -> None:
        image = self.image
        fua = bool(req.flags & CommandFlag.FUA)
        match req.type:
            case Command.READ:
                await self._read(req)
            case Command.WRITE:
                assert payload is not None
                await self._thread(image.write, memoryview(payload), req.offset, fua)
                await self._ok(req)
            case Command.FLUSH:
                await self._thread(image.flush)
                await self._ok(req)
            case Command.TRIM:
                await self._thread(self._trim, req.offset, req.length, fua)
                await self._ok(req)
            case Command.WRITE_ZEROES:
                done = await self._thread(
                    self._zero,
                    req.offset,
                    req.length,
                    not req.flags & CommandFlag.NO_HOLE,
                    bool(req.flags & CommandFlag.FAST_ZERO),
                    fua,
                )
                if not done:
                    raise RequestError(Errno.ENOTSUP, "cannot zero this range fast")
                await self._ok(req)
            case Command.CACHE:
                await self._thread(image.advise_willneed, req.offset, req.length)
                await self._ok(req)
            case Command.BLOCK_STATUS:
                await self._block_status(req)
            case _:  # pragma: no cover - _validate refuses unknown commands
                raise RequestError(Errno.EINVAL, f"unknown command {req.type}")

    def _trim(self, offset: int, length: int, fua: bool) -> None:
        mbs = self.s.export.min_block_size
        start = -(-offset // mbs) * mbs
        end = (offset + length) // mbs * mbs
        try:
            if end > start:
                self.image.punch_hole(start, end - start)
        except OSError as e:
            # TRIM is advisory: a backing store without holes simply keeps the data.
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        if fua:
            self.image.flush()

    def _zero(self, offset: int, length: int, may_trim: bool, fast: bool, fua: bool) -> bool:
        if not self.image.zero(offset, length, may_trim, fast):
            return False
        if fua:
            self.image.flush()
        return True

    async def _read(self, req: Request) -> None:
        image = self.image
        extents: list[tuple[int, bool]] | None = None
        want_holes = self.s.structured and req.length >= HOLE_CHECK_MIN and not req.flags

        def work() -> tuple[DataBuffer, list[tuple[int, bool]] | None]:
            runs = image.extents(req.offset, req.length) if want_holes else None
            buf = data_buffer(req.length)
            if runs is not None and len(runs) == 1 and runs[0][1]:
                return buf, runs  # all hole: nothing to read
            image.read_into(memoryview(buf), req.offset)
            return buf, runs

        buf, extents = await self._thread(work)
        await self._send_read(req, buf, extents)

    async def _send_read(
        self,
        req: Request,
        buf: DataBuffer,
        extents: list[tuple[int, bool]] | None,
        sent: Callable[[], None] | None = None,
    ) -> None:
        cookie = req.cookie
        if not self.s.structured:
            await self.replies.put([codec.encode_simple_reply(cookie), memoryview(buf)], sent)
            return
        if (
            extents is None
            or not any(hole for _, hole in extents)
            or sum(n for n, _ in extents) != len(buf)
        ):
            header = codec.encode_offset_data_header(cookie, req.offset, len(buf), True)
            await self.replies.put([header, memoryview(buf)], sent)
            return
        parts: list[Buffer] = []
        view = memoryview(buf)
        pos = 0
        for i, (length, hole) in enumerate(extents):
            last = i == len(extents) - 1
            offset = req.offset + pos
            if hole:
                parts.append(codec.encode_offset_hole(cookie, offset, length, last))
            else:
                parts.append(codec.encode_offset_data_header(cookie, offset, length, last))
                parts.append(view[pos : pos + length])
            pos += length
        await self.replies.put(parts, sent)

    async def _block_status(self, req: Request) -> None:
        limit = 1 if req.flags & CommandFlag.REQ_ONE else MAX_EXTENTS
        runs = await self._thread(self.image.extents, req.offset, req.length, limit)
        extents = [(length, 0 if not hole else int(_HOLE_ZERO)) for length, hole in runs]
        await self._send([codec.encode_block_status(req.cookie, BASE_ALLOCATION_ID, extents)])


_HOLE_ZERO = 0b11  # NBD_STATE_HOLE | NBD_STATE_ZERO


async def _in_thread(fn: Callable[[], RunResult], run: BulkRun) -> RunResult:
    """``fn()`` in one of trio's cached threads; a cancellation sets ``run.cancelled``
    and still waits for ``fn`` to return (it looks at least every 20 ms)."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(outcome: Outcome[RunResult]) -> None:
        token.run_sync_soon(trio.lowlevel.reschedule, task, outcome)

    def abort(_: object) -> trio.lowlevel.Abort:
        run.cancelled = True
        return trio.lowlevel.Abort.FAILED

    trio.lowlevel.start_thread_soon(fn, deliver)
    result: RunResult = await trio.lowlevel.wait_task_rescheduled(abort)
    return result
