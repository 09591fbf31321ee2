"""A connection's replies sent from a thread of its own.

The event loop is the one place where Python code runs for every request
of every connection, and copying a read's data into the socket is the
largest single cost it had.  Here a thread per plain-socket connection does
the sending: the loop queues a reply and goes on parsing the next request
while the kernel copies the previous reply's bytes.  The send system call
releases the GIL, so on a machine with a spare core both run at once.

Writes that the page cache takes without waiting are done here too, just
before their reply is sent: the loop then only receives the payload, and
copying it into the page cache (with the filesystem's bookkeeping, the
largest cost of a write) overlaps with receiving the next one.

Small replies gain nothing from the hand-off (waking a thread costs more
than copying a few KiB), so the loop batches and sends those itself, as a
connection without the thread does, unless the thread is sending at that
moment (then the thread takes the batch after its own).  A lock held for the whole of each
send keeps every reply's bytes together on the wire, as the protocol
requires; the thread sends queued replies in order, many in one ``writev``.  It writes with
plain non-blocking system calls on the socket's descriptor and waits with
``poll`` when the socket buffer is full, so the event loop keeps the
descriptor for reading as before.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import select
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from nbd.iov import consume
from nbd.transport import Buffer, PeerClosed

log = logging.getLogger("moorage.nbd")

_IOV_MAX = 512
# How long the thread waits for room in the socket buffer before it looks
# again whether it has been told to give up.
_POLL_MS = 200

# Replies up to this size are sent by the event loop itself when it can.
DIRECT_MAX = 64 * 1024
# Bytes of ready replies the thread gathers before it sends them, so a run
# of jobs does not hold finished replies back for long.
_GATHER_MAX = 1024 * 1024


@dataclass(slots=True)
class WriteJob:
    """A write the thread makes before sending its reply.

    Writes queued one after the other to adjacent ranges of the same file
    (a sequential writer's) are made in one ``pwritev``.
    """

    write: Callable[[list[memoryview], int], None]
    offset: int
    data: memoryview
    ok: bytes
    fail: Callable[[OSError], bytes]


_Item = tuple[list[memoryview] | WriteJob, int, Callable[[], None] | None]


def _adjacent_writes(items: list[_Item], start: int) -> list[WriteJob]:
    """The writes from ``items[start]`` on that continue each other in one file."""
    first = items[start][0]
    assert isinstance(first, WriteJob)
    run = [first]
    end = first.offset + len(first.data)
    for what, _, _ in items[start + 1 : start + _IOV_MAX]:
        if not isinstance(what, WriteJob) or what.write != first.write or what.offset != end:
            break
        run.append(what)
        end += len(what.data)
    return run


def _write(run: list[WriteJob]) -> list[memoryview]:
    """Make the writes (together if there are several); their replies."""
    try:
        run[0].write([job.data for job in run], run[0].offset)
    except OSError as e:
        if len(run) == 1:
            return [memoryview(run[0].fail(e))]
        # Each on its own, so each gets its own answer (none was acknowledged,
        # so writing one again is harmless).
        return [part for job in run for part in _write([job])]
    return [memoryview(job.ok) for job in run]


def _calling_all(callbacks: list[Callable[[], None]]) -> Callable[[], None] | None:
    if not callbacks:
        return None

    def call() -> None:
        for callback in callbacks:
            callback()

    return call


class ThreadedReplies:
    """Same interface as ``ReplyQueue``; the sending happens in a thread.

    ``sent`` callbacks may run in the sending thread, so they must be safe
    to call from another thread (returning a buffer to a ``BufferPool`` is).
    ``put_write`` queues a write that the thread makes before it sends the
    write's reply.
    """

    def __init__(self, sock: trio.socket.SocketType, limit: int = 2 * 1024 * 1024) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self.limit = limit
        # None: send what is queued before, then stop.
        self._q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # Held by whoever is writing to the socket (the loop or the thread).
        self._sending = threading.Lock()
        self._unsent = 0
        self._waiting = False
        self._drained = trio.Event()
        self._finished = trio.Event()
        self._abort = False
        self._error: OSError | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._closing = False
        self.dead = False
        # The loop's own batch of small replies.
        self._small: list[memoryview] = []
        self._small_sent: list[Callable[[], None]] = []
        self._small_bytes = 0
        self._small_ready = trio.Event()
        self._small_drained = trio.Event()
        # The rest of a batch ``send_now`` could not send at once; the loop's
        # writer sends it first, still holding ``_sending`` for it.
        self._tail: list[memoryview] | None = None
        # Writes queued (counted by the loop) and made (counted by the thread,
        # done or failed): each counter has one writer, so no lock.
        self.writes_queued = 0
        self.writes_made = 0

    @property
    def sending_lock(self) -> threading.Lock:
        """Held by whoever writes to the socket; another thread that writes takes it too."""
        return self._sending

    def send_now(self, data: memoryview) -> bool:
        """Send whole replies from the loop at once, if nobody else is writing.

        False when the socket is in use (the caller queues the replies
        instead).  What the socket does not take at once is copied and sent
        by the loop's writer before anything else, so ``data`` may be
        reused as soon as this returns.
        """
        if self.dead or not self._sending.acquire(blocking=False):
            return False
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self._sending.release()
            self._die(e)
            return True  # lost with the connection
        if sent == len(data):
            self._sending.release()
        else:
            self._tail = [memoryview(bytes(data[sent:]))]
            self._small_ready.set()
        return True

    async def put(self, parts: Sequence[Buffer], sent: Callable[[], None] | None = None) -> None:
        """Queue one reply; ``sent`` is called once it is on the socket.

        A small reply joins the loop's own batch (sent by ``run``, many in
        one system call); a large one goes to the thread.
        """
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        n = sum(len(v) for v in views)
        if n > DIRECT_MAX:
            await self._queue(views, n, sent)
            return
        while self._small_bytes > self.limit and not self.dead:
            await self._small_drained.wait()
        if self.dead:
            return
        self._small.extend(views)
        self._small_bytes += n
        if sent is not None:
            self._small_sent.append(sent)
        self._small_ready.set()

    async def put_write(self, job: WriteJob, sent: Callable[[], None] | None = None) -> None:
        """Queue a write; the thread makes it, then sends its reply.

        Its payload counts against the same limit as unsent replies.
        """
        if await self._queue(job, len(job.data), sent):
            self.writes_queued += 1

    def writes_pending(self) -> bool:
        """Whether a write queued for the thread may not have been made yet."""
        return self.writes_made < self.writes_queued and not self._finished.is_set()

    async def _queue(
        self, what: list[memoryview] | WriteJob, n: int, sent: Callable[[], None] | None
    ) -> bool:
        """Queue for the thread; False if the connection is dead (nothing queued)."""
        while not self.dead:
            with self._lock:
                if self._unsent <= self.limit:
                    self._unsent += n
                    break
                self._waiting = True
                drained = self._drained
            await drained.wait()
        if self.dead:
            return False
        self._q.put((what, n, sent))
        return True

    def close(self) -> None:
        """Send what is queued, then make ``run`` return."""
        self._closing = True
        self._small_ready.set()

    async def run(self) -> None:
        """Send small replies, run the thread for the rest; raises PeerClosed if the peer goes."""
        self._token = trio.lowlevel.current_trio_token()
        thread = threading.Thread(target=self._main, name="nbd-send", daemon=True)
        thread.start()
        try:
            await self._send_small()
            self._q.put(None)  # the thread sends what it has, then ends
            await self._finished.wait()
        finally:
            if not self._finished.is_set():
                # Cancelled: the thread must let go of the descriptor before
                # the connection is closed under it.
                self._abort = True
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)
                self._q.put(None)
                with trio.CancelScope(shield=True):
                    await self._finished.wait()
            thread.join()  # it has finished: this waits only for its last lines
        if self._error is not None:
            raise PeerClosed(str(self._error)) from self._error

    async def _send_small(self) -> None:
        """The loop's writer: batches of small replies, until closed."""
        try:
            await self._send_small_batches()
        finally:
            if self._tail is not None:  # never sent: the connection is dead
                self._tail = None
                self._sending.release()

    async def _send_small_batches(self) -> None:
        while not self.dead:
            await self._small_ready.wait()
            self._small_ready = trio.Event()
            if self._tail is not None:
                try:
                    await self._send_direct(self._tail, started=True)
                finally:
                    self._tail = None
                    self._sending.release()
            while self._small and not self.dead:
                views, self._small = self._small, []
                callbacks, self._small_sent = self._small_sent, []
                n, self._small_bytes = self._small_bytes, 0
                drained, self._small_drained = self._small_drained, trio.Event()
                drained.set()
                if self._sending.acquire(blocking=False):
                    try:
                        await self._send_direct(views)
                    finally:
                        self._sending.release()
                    for callback in callbacks:
                        callback()
                else:
                    # The thread is sending: it takes this batch after its own.
                    with self._lock:
                        self._unsent += n
                    self._q.put((views, n, _calling_all(callbacks)))
            if self._closing:
                return

    async def _send_direct(self, views: list[memoryview], started: bool = False) -> None:
        """Write replies from the loop; waits through trio if the socket is full.

        ``started``: the first of them is already partly on the wire.
        """
        try:
            while views:
                try:
                    sent = os.writev(self._fd, views[:_IOV_MAX])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self._fd)
                    continue
                started = True
                consume(views, sent)
        except OSError as e:
            self._die(e)
        except trio.ClosedResourceError as e:
            self._die(OSError(errno.EPIPE, str(e)))
        except BaseException:
            if started:
                # Half a reply may be on the wire: nothing more can follow it.
                self._die(OSError(errno.ECANCELED, "cancelled in the middle of a reply"))
            raise

    def _die(self, error: OSError) -> None:
        """The connection cannot take more replies: stop the thread, report ``error``."""
        if self._error is None:
            self._error = error
        self.dead = True
        self._abort = True
        self._drained.set()
        self._small_drained.set()
        self._q.put(None)

    # ------------------------------------------------------------ the thread

    def _main(self) -> None:
        try:
            self._loop()
        except OSError as e:
            self._error = e
            self.dead = True
        except BaseException:  # pragma: no cover - a bug; the connection ends
            log.exception("reply thread failed")
            self._error = OSError(errno.EIO, "reply thread failed")
            self.dead = True
        finally:
            assert self._token is not None
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._on_finished)

    def _on_finished(self) -> None:
        self.dead = self.dead or self._error is not None
        self._finished.set()
        self._drained.set()
        self._small_ready.set()
        self._small_drained.set()

    def _loop(self) -> None:
        q = self._q
        while True:
            batch = [q.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 256:
                    batch.append(q.get_nowait())
            closing = None in batch
            items = [item for item in batch if item is not None]
            views: list[memoryview] = []
            ready = 0
            callbacks: list[Callable[[], None]] = []
            nbytes = 0
            i = 0
            while i < len(items):
                what, n, sent = items[i]
                if isinstance(what, WriteJob):
                    if ready > _GATHER_MAX:
                        self._flush(views, callbacks, nbytes)
                        views, callbacks, ready, nbytes = [], [], 0, 0
                    if self._abort:
                        return
                    run = _adjacent_writes(items, i)
                    parts = _write(run)
                    self.writes_made += len(run)
                    for _, n, sent in items[i : i + len(run)]:
                        nbytes += n
                        if sent is not None:
                            callbacks.append(sent)
                    i += len(run)
                else:
                    parts = what
                    nbytes += n
                    if sent is not None:
                        callbacks.append(sent)
                    i += 1
                for part in parts:
                    views.append(part)
                    ready += len(part)
            self._flush(views, callbacks, nbytes)
            if closing or self._abort:
                return

    def _flush(
        self, views: list[memoryview], callbacks: list[Callable[[], None]], nbytes: int
    ) -> None:
        if views and not self._abort:
            with self._sending:
                if not self._abort:
                    self._send(views)
        for callback in callbacks:
            callback()
        self._account(nbytes)

    def _account(self, nbytes: int) -> None:
        with self._lock:
            self._unsent -= nbytes
            wake = self._waiting and self._unsent <= self.limit
            if wake:
                self._waiting = False
                drained, self._drained = self._drained, trio.Event()
        if wake:
            assert self._token is not None
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(drained.set)

    def _send(self, views: list[memoryview]) -> None:
        poller: select.poll | None = None
        while views:
            try:
                sent = os.writev(self._fd, views[:_IOV_MAX])
            except BlockingIOError:
                if poller is None:
                    poller = select.poll()
                    poller.register(self._fd, select.POLLOUT)
                while not poller.poll(_POLL_MS):
                    if self._abort:
                        return
                if self._abort:
                    return
                continue
            consume(views, sent)
