"""libnbd's asynchronous API driven by trio: many requests in flight on one connection.

The synchronous calls of :mod:`nbd.libnbd` block a thread for a whole round
trip, so a trio program needs a worker thread per request in flight, and
every request then pays for two hand-offs between threads.  Here a request
is issued with ``nbd_aio_*`` from the event loop itself (libnbd sends what
the socket takes at once), and two small tasks per connection move the
rest: one waits for the socket to be readable and lets libnbd read replies
(``nbd_aio_notify_read``), the other waits for room to send when libnbd
has more to send (``nbd_aio_notify_write``).  libnbd calls a completion
callback for each reply, on the event loop's thread, which wakes the
request's task.  No thread is involved.

The driver tasks are trio system tasks, started with the first request, so
a connection can be used from any task of the run without a nursery.  All
calls must come from the trio thread of one run.

When the connection dies every request in flight fails with an
:class:`~nbd.libnbd.NBDError` (``ENOTCONN`` unless libnbd said otherwise);
reconnecting is the caller's business.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from nbd.libnbd import CmdFlag, NBDClient, NBDError
from nbd.libnbd_ctypes import _CompletionCallback, _CompletionFn, _FreeFn, _lib
from nbd.libnbd_errors import error_for, lost, stalled

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

log = logging.getLogger("moorage.nbd.aio")

AIO_DIRECTION_READ = 1
AIO_DIRECTION_WRITE = 2


class _Pending:
    """One request in flight: woken by the completion callback."""

    __slots__ = ("done", "error", "keep", "owner")

    def __init__(self, owner: AioConnection, keep: object) -> None:
        self.done = trio.Event()
        self.error = 0
        self.keep = keep  # the buffer libnbd reads from or writes into, kept alive
        self.owner = owner

    def complete(self, error: int) -> None:
        self.error = error
        self.done.set()


class _Callback:
    """One request in flight whose completion calls a function (no task waits)."""

    __slots__ = ("done", "keep", "owner")

    def __init__(self, owner: AioConnection, keep: object, done: Callable[[int], None]) -> None:
        self.done = done
        self.keep = keep
        self.owner = owner

    def complete(self, error: int) -> None:
        self.done(error)


# Requests in flight, by the id passed to libnbd as the callback's user_data.
_PENDING: dict[int, _Pending | _Callback] = {}
_ids = itertools.count(1)


def _completed(user_data: int | None, error: Any) -> int:
    """libnbd's completion callback (on the thread that called into libnbd)."""
    try:
        ident = user_data or 0
        pending = _PENDING.pop(ident, None)
        if pending is not None:
            owner = pending.owner
            owner._in_flight -= 1
            owner._ids.pop(ident, None)
            pending.complete(int(error[0]) if error else 0)
    except BaseException:  # never unwind into C
        log.exception("completion callback failed")
    return 1  # retire the command: nobody calls nbd_aio_command_completed


_ON_COMPLETE = _CompletionFn(_completed)
_NO_FREE = _FreeFn()


class AioConnection:
    """One connected libnbd handle, driven from trio (see the module docstring)."""

    def __init__(self, client: NBDClient) -> None:
        self.client = client
        self._h = client.handle
        self._lib = _lib()
        self._fd = int(self._lib.nbd_aio_get_fd(self._h))
        self._in_flight = 0
        # requests in flight: id -> when it was sent (trio time), oldest first
        self._ids: dict[int, float] = {}
        self.stalled_since: float | None = None  # see expire()
        self._write_wanted = trio.Event()
        self._started = False
        self._closed = False
        self.error: NBDError | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed

    # ---------------------------------------------------------------- requests

    async def pread_into(self, buffer: WriteableBuffer, offset: int, flags: int = 0) -> None:
        view = memoryview(buffer)
        if view.readonly:
            raise TypeError("pread_into needs a writable buffer")
        target = (ctypes.c_char * view.nbytes).from_buffer(view)
        await self._request(
            target,
            lambda cb: self._lib.nbd_aio_pread(
                self._h, target, view.nbytes, offset, cb, int(flags)
            ),
        )

    async def pwrite(self, data: ReadableBuffer, offset: int, flags: int = 0) -> None:
        source: Any = data if isinstance(data, bytes) else bytes(data)
        await self._request(
            source,
            lambda cb: self._lib.nbd_aio_pwrite(
                self._h, source, len(source), offset, cb, int(flags)
            ),
        )

    async def flush(self) -> None:
        await self._request(None, lambda cb: self._lib.nbd_aio_flush(self._h, cb, 0))

    async def zero(self, count: int, offset: int, flags: CmdFlag | int = 0) -> None:
        await self._request(
            None, lambda cb: self._lib.nbd_aio_zero(self._h, count, offset, cb, int(flags))
        )

    def submit_pread(
        self, target: Any, length: int, offset: int, done: Callable[[int], None]
    ) -> None:
        """Send a read into ``target`` (a ctypes array, kept alive until answered) and
        return at once; ``done(errno)`` is called when it is answered (0: the data is
        there) or fails, from the trio thread.  Raises :class:`NBDError` if it cannot be
        sent (then ``done`` is never called)."""
        self._submit(
            target,
            lambda cb: self._lib.nbd_aio_pread(self._h, target, length, offset, cb, 0),
            done,
        )

    def submit_pwrite(self, data: bytes, offset: int, done: Callable[[int], None]) -> None:
        """Like :meth:`submit_pread`, for a write of ``data``."""
        self._submit(
            data,
            lambda cb: self._lib.nbd_aio_pwrite(self._h, data, len(data), offset, cb, 0),
            done,
        )

    def _submit(self, keep: object, issue: Any, done: Callable[[int], None]) -> None:
        self._enlist(_Callback(self, keep, done), issue)
        if self._lib.nbd_aio_get_direction(self._h) & AIO_DIRECTION_WRITE:
            self._write_wanted.set()

    def _enlist(self, entry: _Pending | _Callback, issue: Any) -> int:
        """Record ``entry`` under a new id and issue the request; the id.  A
        request libnbd refuses leaves no trace and raises."""
        if not self.alive:
            raise lost(self.error)
        self._start()
        ident = next(_ids)
        _PENDING[ident] = entry
        self._ids[ident] = trio.current_time()
        self._in_flight += 1
        try:
            issue(_CompletionCallback(_ON_COMPLETE, ident, _NO_FREE))
        except NBDError:
            if _PENDING.pop(ident, None) is not None:
                self._in_flight -= 1
            self._ids.pop(ident, None)
            self._check_dead()
            raise
        return ident

    async def _request(self, keep: object, issue: Any) -> None:
        pending = _Pending(self, keep)
        ident = self._enlist(pending, issue)
        self._check_dead()  # sending it may have found the connection gone
        if self._lib.nbd_aio_get_direction(self._h) & AIO_DIRECTION_WRITE:
            self._write_wanted.set()
        try:
            # A cancelled wait leaves the request to finish on the wire; the
            # buffer stays referenced (by _PENDING) until it has.
            await pending.done.wait()
        finally:
            self._ids.pop(ident, None)
        if pending.error:
            raise error_for(os.strerror(pending.error), pending.error)

    # ------------------------------------------------------------------ driving

    def _start(self) -> None:
        if not self._started:
            self._started = True
            trio.lowlevel.spawn_system_task(self._read_replies, name=f"nbd-aio-read-{self._fd}")
            trio.lowlevel.spawn_system_task(self._send_requests, name=f"nbd-aio-send-{self._fd}")

    async def _read_replies(self) -> None:
        async def loop() -> None:
            while self.alive:
                await trio.lowlevel.wait_readable(self._fd)
                self._check_dead()  # libnbd refuses notify on a dead handle (EINVAL)
                if not self.alive:
                    return
                self._lib.nbd_aio_notify_read(self._h)
                if self._lib.nbd_aio_get_direction(self._h) & AIO_DIRECTION_WRITE:
                    self._write_wanted.set()
                self._check_dead()

        await self._driver("reply reader", loop)

    async def _send_requests(self) -> None:
        async def loop() -> None:
            while self.alive:
                await self._write_wanted.wait()
                self._write_wanted = trio.Event()
                while self.alive and (
                    self._lib.nbd_aio_get_direction(self._h) & AIO_DIRECTION_WRITE
                ):
                    await trio.lowlevel.wait_writable(self._fd)
                    self._check_dead()
                    if not self.alive:
                        return
                    self._lib.nbd_aio_notify_write(self._h)
                    self._check_dead()

        await self._driver("request sender", loop)

    async def _driver(self, what: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a driver task's loop; a system task must not raise (it would end the run)."""
        try:
            await loop()
        except trio.ClosedResourceError:
            pass  # closed: the connection is being let go
        except NBDError as e:
            self._die(e)
        except trio.Cancelled:
            raise
        except BaseException:
            log.exception("NBD %s failed", what)
            self._die(NBDError(f"{what} failed", errno.EIO))

    def _check_dead(self) -> None:
        if self._lib.nbd_aio_is_dead(self._h) == 1 or self._lib.nbd_aio_is_closed(self._h) == 1:
            self._die(NBDError("connection to the NBD server lost", errno.ENOTCONN))

    def _die(self, error: NBDError) -> None:
        """The connection is gone: every request still in flight fails."""
        if self.error is None:
            self.error = error
        self._write_wanted.set()
        for ident in list(self._ids):
            pending = _PENDING.pop(ident, None)
            if pending is not None:
                self._in_flight -= 1
                self._ids.pop(ident, None)
                try:
                    pending.complete(error.errno or errno.ENOTCONN)
                except Exception:  # one callback's failure must not strand the others
                    log.exception("completion callback failed")

    def expire(self, timeout: float, now: float) -> bool:
        """Declare the connection lost if its oldest request in flight was sent
        ``timeout`` seconds or more before ``now`` (trio time): every request in
        flight then fails with ``ETIMEDOUT`` and :attr:`stalled_since` says when
        that request was sent.  One check per connection instead of a cancel
        scope per request."""
        if not self.alive or not self._ids:
            return False
        sent = next(iter(self._ids.values()))
        if now - sent < timeout:
            return False
        self.stalled_since = sent
        self._die(stalled(timeout))
        return True

    def close(self) -> None:
        """Drop the connection now (requests in flight fail) and free the handle.

        From the trio thread while the run is alive, or after it has ended.
        """
        if self._closed:
            return
        self._closed = True
        if self._started:
            # RuntimeError: the run has ended, so nobody waits on the descriptor.
            with contextlib.suppress(RuntimeError):
                trio.lowlevel.notify_closing(self._fd)
        self._die(NBDError("connection closed", errno.ENOTCONN))
        self.client.close()

    async def drain(self) -> None:
        """Wait until no request is in flight on this connection."""
        while self._in_flight and self.alive:
            await trio.sleep(0.005)
