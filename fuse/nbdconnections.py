"""Connections to one NBD export that come back when the server does.

:class:`ExportConnections` is what the FUSE block file (:mod:`fuse.blockfile`)
reads, writes and flushes through.

Choices, and why:

- **Multi-conn.** A libnbd handle serialises its users, so parallel I/O
  needs several connections.  Those are opened only when the server
  advertises ``CAN_MULTI_CONN``: then a FLUSH on any one connection makes
  every write *completed* on any connection durable, and the kernel only
  asks for a flush (fsync, a loop device's ``REQ_PREFLUSH``) after the
  writes it covers have completed, so one FLUSH suffices.  Without
  multi-conn a flush goes to every connection (normally there is one).
- **No threads per request.** Requests go out through libnbd's
  asynchronous API, driven by the FUSE process's trio loop
  (:mod:`nbd.aio`): many requests are in flight on each connection and
  each goes to the least busy one.  A worker thread was a hand-off each
  way per request, which cost more CPU than the request itself; only
  connecting (rare) still runs in a thread.
- **Pipelined on plain sockets.** On ``nbd://`` and ``nbd+unix://`` the
  connection is moorage's own client (:mod:`nbd.pipeline`): the requests of
  one ``/dev/fuse`` batch leave in one ``sendmsg`` and replies are read many
  at a time, so the server can serve them as a batch.  TLS (``nbds``) stays
  with libnbd (:mod:`nbd.aio`).  The block file's ``--nbd-client libnbd``
  (``connect``'s ``client``) makes every connection libnbd's, to compare the
  two (``auto``, the default, is the above).
- **Hard mount.** A connection error (the server died, restarted, or shut
  down) drops that connection; the request waits with exponential backoff
  and is sent again on a new connection, so a server restart reaches the
  filesystem on the loop device as a pause, never as an error.  Reads and
  writes are idempotent, and a FLUSH re-sent to a new connection covers
  every completed write (kill -9 of a server loses nothing it
  acknowledged).
- **Bounded.** ``timeout`` bounds every wait, like kernel nbd's dead
  connection timeout: once the export has been unreachable that long
  (no connection, or no reply on one: a server that stops answering is a
  lost connection), requests fail with EIO.  The clock is the export's, not
  each request's: a request made after the bound has passed fails at once
  instead of waiting anew.  Every connection attempt is bounded too
  (:data:`CONNECT_TIMEOUT`).  A *definitive* answer fails requests at once:
  the server says the export does not exist (its volume was unpublished or
  deleted) or is not for us, or the export's size became 0.  Nobody
  listening is not an answer: a refused TCP connect, and on ``nbd+unix`` a
  socket file that is missing (a server restarting removes and binds it
  again), are waited for like any lost connection.  After either,
  a connection is tried again at most every :data:`RETRY_MAX` seconds, so
  a server or an export that comes back is used again.
- **Stopping.** :meth:`ExportConnections.stop` (the process got SIGTERM)
  fails every request waiting for a connection at once and, after
  :data:`STOP_GRACE` seconds, closes the connections that still have
  requests in flight, failing those: a process told to stop does not wait
  for a server that is gone.  Once stopping, a request whose connection is
  lost fails (EIO) rather than being sent again on another, so the grace
  holds with several connections and every request is answered (or failed)
  before the last FLUSH is sent.  Its last FLUSH (:meth:`ExportConnections.flush`
  once stopped) still goes out, on a connection that is alive or on one made
  for it (one attempt), so what the process acknowledged is made durable;
  its caller bounds it (``fuse.blockfile.FINAL_FLUSH_TIMEOUT``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

import trio

from nbd.aio import AioConnection
from nbd.libnbd import BlockSize, CmdFlag, NBDClient, NBDError
from nbd.pipeline import PipelinedConnection, PlainClient, is_plain
from nbd.uri import parse_nbd_uri

log = logging.getLogger("moorage.fuse.blockfile")

DEFAULT_CONNECTIONS: Final = 4
RETRY_FIRST: Final = 0.05  # seconds before the first reconnect
RETRY_MAX: Final = 2.0
# How long a request waits for a server that went away, unless told otherwise
# (the CSI plugin's --io-timeout and a StorageClass's ioTimeout).
DEFAULT_IO_TIMEOUT: Final = 120.0
MAX_IO_TIMEOUT: Final = 86400.0
CONNECT_TIMEOUT: Final = 10.0  # seconds one connection attempt (TCP, TLS, handshake) may take
STOP_GRACE: Final = 3.0  # seconds requests in flight get once the process is told to stop
WATCH_PERIOD_MAX: Final = 1.0  # seconds between two looks for requests past the timeout
# errors a connected handle reports when the server is going away
_GONE: Final = frozenset({errno.ESHUTDOWN, errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN})
# a server's answer that retrying will not change: no such export (the handshake's
# NBD_REP_ERR_UNKNOWN, as libnbd reports it: ENOENT; see connect() for a missing unix
# socket file, which is not that), not for this client (EACCES, EPERM)
DEFINITIVE: Final = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM})

T = TypeVar("T")
# a negotiated export, and the connection that drives it from trio
Client = NBDClient | PlainClient
Connection = AioConnection | PipelinedConnection
# which NBD client the block file uses (its --nbd-client): "auto" is moorage's pipelined
# client on a plain socket and libnbd for TLS; "libnbd" is libnbd always (to compare)
NBD_CLIENTS: Final = ("auto", "libnbd")


def watch_period(timeout: float) -> float:
    """How often requests are checked against ``timeout``: a quarter of it, at most
    :data:`WATCH_PERIOD_MAX` seconds."""
    return min(timeout / 4, WATCH_PERIOD_MAX)


class ExportUnavailable(OSError):
    """No connection within the timeout, a definitive answer, or stopping: EIO."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class _Disconnected(Exception):
    """The connection is gone (or could not be made): retry on a new one, unless
    the server's answer was definitive."""

    def __init__(
        self,
        message: str,
        *,
        definitive: bool = False,
        since: float | None = None,
        known: bool = False,
    ) -> None:
        super().__init__(message)
        self.definitive = definitive
        self.known = known  # an answer already had (or stopping): nothing new learnt
        self.since = since  # when the server was last heard of, if earlier than now


class _Attempt:
    """One connection attempt in a worker thread, which its waiter may give up on."""

    def __init__(self, connect: Callable[[str], Client], uri: str) -> None:
        self._connect = connect
        self._uri = uri
        self._lock = threading.Lock()
        self._abandoned = False

    def run(self) -> Client | None:
        client = self._connect(self._uri)
        with self._lock:
            if not self._abandoned:
                return client
        client.close()  # nobody waits for it any more
        return None

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True


@dataclass
class _Slot:
    conn: Connection | None
    size: int | None = None  # the export size this connection was told
    multi_conn: bool = True
    connecting: trio.Lock = field(default_factory=trio.Lock)


def connect(uri: str, client: str = "auto") -> Client:
    """A connection to ``uri``: moorage's own on a plain socket, libnbd's for TLS or
    when ``client`` is "libnbd" (no meta contexts: only plain I/O here).  Bounded by
    :data:`CONNECT_TIMEOUT` on a plain socket, by libnbd's own timeouts otherwise.

    A unix socket file that is not there is ECONNREFUSED (nobody listens, a server
    may be restarting), never ENOENT, which is the server's "no such export"."""
    if client not in NBD_CLIENTS:
        raise ValueError(f"NBD client {client!r}: not one of {', '.join(NBD_CLIENTS)}")
    if client == "auto" and is_plain(uri):
        return PlainClient.open(uri, CONNECT_TIMEOUT)  # maps a missing socket file itself
    try:
        return NBDClient.open(uri, meta_contexts=())
    except NBDError as e:
        if e.errno == errno.ENOENT and _nobody_listening(uri, e.message):
            raise NBDError(f"{e.message} (no server listening)", errno.ECONNREFUSED) from e
        raise


def _nobody_listening(uri: str, message: str) -> bool:
    """Whether libnbd's ENOENT is connect(2)'s (no socket file: nobody listens) rather
    than the handshake's NBD_REP_ERR_UNKNOWN ("no such export").  libnbd gives both
    the same errno, but its message names the step that failed: ``nbd_connect_uri:
    connect: ...`` or ``nbd_connect_uri: handshake: ...`` (1.14).  That decides, not
    a look at the socket file afterwards, which a server restarting (unlink, then
    bind) may have created or removed in between.  A message naming neither step
    falls back to that look."""
    parts = message.split(": ", 2)
    step = parts[1] if len(parts) == 3 and parts[0].startswith("nbd_") else None
    if step == "connect":
        return True
    if step == "handshake":
        return False
    return _socket_missing(uri)


def _socket_missing(uri: str) -> bool:
    """Whether ``uri`` names a unix socket file that does not exist (or is no socket)."""
    try:
        path = parse_nbd_uri(uri).socket_path
    except ValueError:
        return False
    if path is None:
        return False
    try:
        return not stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return True


def minimum_block_size(client: Client) -> int:
    """The export's minimum block size as the server told ``client`` (1: none told)."""
    if isinstance(client, PlainClient):
        return client.minimum
    return max(1, client.get_block_size(BlockSize.MINIMUM))


def driven(client: Client) -> Connection:
    """The trio-driven connection for a negotiated ``client``."""
    if isinstance(client, PlainClient):
        return PipelinedConnection(client)
    return AioConnection(client)


class ExportConnections:
    """Connections to one export, many requests in flight on each, that come back
    when the server does.  Used from the trio thread of one run (``close`` may also
    be called after the run)."""

    def __init__(
        self,
        uri: str,
        clients: Sequence[Client],
        *,
        timeout: float | None = None,
        connect: Callable[[str], Client] = connect,
    ) -> None:
        if not clients:
            raise ValueError("at least one connection is needed")
        first = clients[0]
        self.uri = uri
        self.timeout = timeout
        self.size = first.get_size()
        self.read_only = first.is_read_only()
        self.multi_conn = first.can_multi_conn()
        self.can_flush = first.can_flush()
        self.can_zero = first.can_zero()
        self.minimum_block_size = minimum_block_size(first)
        self._connect = connect
        self._slots = [_Slot(driven(c), c.get_size(), c.can_multi_conn()) for c in clients]
        # since when (trio time) no request has been answered: one clock for the
        # export, like a kernel device's, so requests made later do not wait anew
        self._down_since: float | None = None
        # the last definitive answer (or the bound passed), and when (trio time)
        self._refused: tuple[str, float] | None = None
        self._stopping: str | None = None
        self._last_flush = False  # the stopping process's last FLUSH has begun
        self._changed = trio.Event()  # wakes requests waiting to retry
        self._watching = False  # the watchdog task runs (started with the first request)
        self._retired: set[Connection] = set()  # replaced by refresh, still draining
        self._remaking: set[int] = set()  # slots a refresh could not remake, tried again
        self._closed = False
        # called once a new connection no longer advertises multi-conn
        self.on_multi_conn_withdrawn: Callable[[], None] | None = None

    @classmethod
    def open(
        cls,
        uri: str,
        connections: int = DEFAULT_CONNECTIONS,
        *,
        timeout: float | None = None,
        connect: Callable[[str], Client] = connect,
    ) -> ExportConnections:
        """Connect (blocking; before the trio loop).  An unreachable server raises."""
        if connections < 1:
            raise ValueError(f"connections must be at least 1, not {connections}")
        clients = [connect(uri)]
        try:
            if connections > 1 and clients[0].can_multi_conn():
                clients += [connect(uri) for _ in range(connections - 1)]
            elif connections > 1:
                log.info("%s does not advertise multi-conn: one connection", uri)
        except BaseException:
            for client in clients:
                client.close()
            raise
        kind = "pipelined" if isinstance(clients[0], PlainClient) else "libnbd"
        log.info("%s: %d connection(s), %s client", uri, len(clients), kind)
        return cls(uri, clients, timeout=timeout, connect=connect)

    def __len__(self) -> int:
        return len(self._slots)

    # -------------------------------------------------------------- connections

    async def _connected(self, slot: _Slot, bound: float, *, last: bool = False) -> Connection:
        """The slot's connection, made again first if it was lost (within ``bound`` s);
        once stopping, only for the last FLUSH (``last``)."""
        conn = slot.conn
        if conn is not None and conn.alive:
            return conn
        async with slot.connecting:
            conn = slot.conn
            if conn is not None and conn.alive:
                return conn
            if conn is not None:
                conn.close()
                slot.conn = None
            if self._stopping is not None and not last:
                raise _Disconnected(self._stopping, definitive=True, known=True)
            refused = self._refused
            if refused is not None and trio.current_time() - refused[1] < RETRY_MAX:
                raise _Disconnected(refused[0], definitive=True, known=True)
            client = await self._attempt(min(bound, CONNECT_TIMEOUT))
            size = client.get_size()
            if size == 0 and self.size != 0:
                client.close()
                raise _Disconnected("the export's size is now 0", definitive=True)
            slot.size, slot.multi_conn = size, client.can_multi_conn()
            slot.conn = driven(client)
            self._refused = None
            self._note(slot)
            return slot.conn

    async def _attempt(self, bound: float) -> Client:
        """A new connection in a worker thread, given up on after ``bound`` seconds."""
        attempt = _Attempt(self._connect, self.uri)
        client: Client | None = None
        with trio.move_on_after(max(bound, 0.0)):
            try:
                client = await trio.to_thread.run_sync(attempt.run, abandon_on_cancel=True)
            except NBDError as e:
                definitive = e.errno in DEFINITIVE
                raise _Disconnected(str(e), definitive=definitive) from e
        if client is None:
            attempt.abandon()
            raise _Disconnected(f"no connection within {bound:.1f}s")
        return client

    def _least_busy(self) -> _Slot:
        def load(slot: _Slot) -> int:
            conn = slot.conn
            return conn.in_flight if conn is not None and conn.alive else 1 << 30

        return min(self._slots, key=load)

    async def _run_on(
        self,
        slot: _Slot | None,
        fn: Callable[[Connection], Awaitable[T]],
        failed: _Disconnected | None = None,
    ) -> T:
        """``fn`` on ``slot`` (None: the least busy), reconnecting with backoff until it
        is answered, the export has been unreachable for the timeout, or the answer is
        definitive.  ``failed``: its first attempt already failed so."""
        delay = RETRY_FIRST
        while True:
            target = slot if slot is not None else self._least_busy()
            try:
                if failed is not None:
                    first, failed = failed, None
                    raise first
                conn = target.conn
                if conn is None or not conn.alive:
                    conn = await self._connected(target, CONNECT_TIMEOUT)
                    if self._stopping is not None:
                        # made by an attempt begun before the stop: kept for the last
                        # FLUSH, but the request waited for a connection, so it fails
                        raise _Disconnected(self._stopping, definitive=True, known=True)
                try:
                    result = await self._answered(conn, fn)
                except NBDError as e:
                    if conn.alive and e.errno not in _GONE:
                        raise  # the server's answer to this request
                    conn.close()
                    raise _Disconnected(str(e)) from e
            except _Disconnected as e:
                if e.definitive:
                    if not e.known:
                        self._refuse(str(e))
                    raise ExportUnavailable(f"{self.uri}: {e}") from None
                self._fail_if_stopping(e)
                now = trio.current_time()
                if self._down_since is None:
                    self._down_since = now if e.since is None else e.since
                    log.warning("%s: connection lost (%s); requests wait for it", self.uri, e)
                elif e.since is not None:
                    self._down_since = min(self._down_since, e.since)
                waited = now - self._down_since
                if self.timeout is not None and waited >= self.timeout:
                    # past the bound: later requests fail at once too, while a
                    # connection is tried again every RETRY_MAX seconds
                    self._refuse(f"no connection for {waited:.1f}s: {e}")
                    raise ExportUnavailable(
                        f"{self.uri}: no connection for {waited:.1f}s: {e}"
                    ) from None
                pause = delay if self.timeout is None else min(delay, self.timeout - waited)
                changed = self._changed
                with trio.move_on_after(pause):
                    await changed.wait()  # a definitive answer or stop: fail now
                self._fail_if_stopping(e)
                delay = min(delay * 2, RETRY_MAX)
                continue
            if self._down_since is not None:
                self._down_since = None
                log.warning("%s: connected again", self.uri)
            return result

    def _fail_if_stopping(self, lost: _Disconnected) -> None:
        """Once stopping, a request whose connection was lost (or closed by
        :meth:`_close_after`) fails instead of going again on another connection: the
        grace bounds it, and nothing is answered after the last FLUSH was sent."""
        if self._stopping is not None:
            raise ExportUnavailable(f"{self.uri}: {self._stopping}: {lost}") from None

    async def _answered(self, conn: Connection, fn: Callable[[Connection], Awaitable[T]]) -> T:
        """``fn(conn)``; a server that does not answer within the timeout has lost the
        connection: :meth:`_watchdog` fails what is in flight on it (sent again on
        another connection), without a cancel scope per request."""
        if self.timeout is None:
            return await fn(conn)
        self._watch()
        try:
            return await fn(conn)
        except NBDError as e:
            since = conn.stalled_since
            if since is None:
                raise
            conn.close()
            raise _Disconnected(f"no reply within {self.timeout:.1f}s", since=since) from e

    def _watch(self) -> None:
        if not self._watching and self.timeout is not None:
            self._watching = True
            trio.lowlevel.spawn_system_task(self._watchdog, self.timeout, name="nbd-watchdog")

    async def _watchdog(self, timeout: float) -> None:
        """Every :func:`watch_period` seconds, a connection whose oldest request has
        waited ``timeout`` seconds is declared lost.  A request therefore fails over
        after ``timeout`` to ``timeout + watch_period(timeout)`` seconds."""
        period = watch_period(timeout)
        while not self._closed:
            await trio.sleep(period)
            now = trio.current_time()
            for conn in [slot.conn for slot in self._slots] + list(self._retired):
                if conn is not None and conn.expire(timeout, now):
                    log.warning("%s: no reply within %.1fs: connection dropped", self.uri, timeout)

    def _refuse(self, reason: str) -> None:
        """A definitive answer, or the bound passed: requests waiting for a connection
        fail now, and so do new ones until a connection is made again."""
        if self._refused is None:
            log.error("%s: %s; requests fail with EIO", self.uri, reason)
        self._refused = (reason, trio.current_time())
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def stop(self, reason: str = "stopping") -> None:
        """Fail requests waiting for a connection now, and those in flight after
        :data:`STOP_GRACE` seconds; no new connection is made but one for the last
        FLUSH (:meth:`flush` from now on).  From the trio thread."""
        if self._stopping is not None:
            return
        self._stopping = reason
        self._wake()
        trio.lowlevel.spawn_system_task(self._close_after, STOP_GRACE)

    async def _close_after(self, grace: float) -> None:
        """Close the connections that still have requests in flight: those requests
        fail (stopping, a lost connection is not failed over: :meth:`_fail_if_stopping`);
        the idle connections stay for the last FLUSH.  Once that has begun, every
        request before it was answered or failed, and it has a bound of its own:
        nothing is closed."""
        await trio.sleep(grace)
        if self._last_flush:
            return
        busy = [s for s in self._slots if s.conn is not None and s.conn.in_flight]
        if busy:
            log.warning(
                "%s: requests still in flight after %.0fs on %d connection(s): failing them",
                self.uri,
                grace,
                len(busy),
            )
        for slot in busy:
            conn, slot.conn = slot.conn, None
            if conn is not None:
                conn.close()

    def _note(self, slot: _Slot) -> None:
        """What a new connection was told: a new size, multi-conn withdrawn."""
        if slot.size is not None and slot.size != self.size:
            log.info("%s: export size %d -> %d", self.uri, self.size, slot.size)
            self.size = slot.size
        if self.multi_conn and not slot.multi_conn:
            log.warning("%s: multi-conn withdrawn: flushes go to every connection", self.uri)
            self.multi_conn = False
            if self.on_multi_conn_withdrawn is not None:
                self.on_multi_conn_withdrawn()

    # -------------------------------------------------------------- without a task

    def ready_connection(self) -> Connection | None:
        """The least busy connection, if the export is in its normal state (connected,
        not refused, not stopping): a request may then be sent on it at once with
        :meth:`AioConnection.submit_pread` / ``submit_pwrite``, and if that fails with
        ``error``, go on through :meth:`resubmit`.  None: use the awaitable methods."""
        if self._down_since is not None or self._refused is not None or self._stopping:
            return None
        best: Connection | None = None
        load = 1 << 30
        for slot in self._slots:
            conn = slot.conn
            if conn is not None and conn.alive and conn.in_flight < load:
                best, load = conn, conn.in_flight
        if best is not None and self.timeout is not None and not self._watching:
            self._watch()
        return best

    def answer_of(self, conn: Connection, error: int) -> bool:
        """Whether ``error`` from a request sent on ``conn`` is the server's answer to
        it (to be passed on) rather than the connection lost (to be sent again)."""
        return conn.alive and error not in _GONE

    async def resubmit(
        self, conn: Connection, error: int, fn: Callable[[Connection], Awaitable[T]]
    ) -> T:
        """``fn`` after a request sent on ``conn`` without a task failed with ``error``
        because the connection was lost: from there on as if it had been sent by
        :meth:`_run_on` (the same bound, reconnects, failover and log)."""
        since = conn.stalled_since
        if since is not None and self.timeout is not None:
            message = f"no reply within {self.timeout:.1f}s"
        else:
            message = os.strerror(error) if error else "connection lost"
        conn.close()
        return await self._run_on(None, fn, _Disconnected(message, since=since))

    # -------------------------------------------------------------- requests

    async def pread_into(self, buffer: bytearray | memoryview, offset: int) -> None:
        await self._run_on(None, lambda c: c.pread_into(buffer, offset))

    async def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        await self._run_on(None, lambda c: c.pwrite(data, offset))

    async def zero(self, count: int, offset: int, flags: CmdFlag | int) -> None:
        await self._run_on(None, lambda c: c.zero(count, offset, flags))

    async def flush(self) -> None:
        """NBD FLUSH: every write completed so far is on stable storage when this returns.
        Once stopping, see :meth:`_flush_last`."""
        if not self.can_flush:
            return  # the server has no write cache to flush
        if self._stopping is not None:
            await self._flush_last()
            return
        if self.multi_conn:
            await self._run_on(None, lambda c: c.flush())
            return
        for slot in self._slots:
            await self._run_on(slot, lambda c: c.flush())

    async def _flush_last(self) -> None:
        """The FLUSH of a process that is stopping, so that what it acknowledged is
        durable: on a connection that is alive, or else on one made for it (one
        attempt: a server that is gone is not waited for, its failure is EIO).  The
        caller bounds it: a server that does not answer is waited for that long."""
        self._last_flush = True
        for slot in self._slots if not self.multi_conn else [self._least_busy()]:
            try:
                conn = slot.conn
                if conn is None or not conn.alive:
                    conn = await self._connected(slot, CONNECT_TIMEOUT, last=True)
                try:
                    await self._answered(conn, lambda c: c.flush())
                except NBDError as e:
                    if conn.alive and e.errno not in _GONE:
                        raise  # the server's answer
                    conn.close()
                    raise _Disconnected(str(e)) from e
            except _Disconnected as e:
                raise ExportUnavailable(f"{self.uri}: the last flush: {e}") from None

    async def refresh(self) -> int:
        """Reconnect every connection (servers read the size at connect); the new size.

        Requests go on meanwhile: each connection is replaced by a new one,
        and the old one closed once its requests are answered.  A connection
        that cannot be made again now is retired too (it would keep the old
        size: requests past it would fail) and tried again in the background
        (:meth:`_remake`), so the export does not go on with fewer connections.
        """
        for slot in self._slots:
            async with slot.connecting:
                old = slot.conn
                try:
                    client = await self._attempt(CONNECT_TIMEOUT)
                except _Disconnected as e:
                    # the old connection may have the old size, and others the new one:
                    # it is retired all the same, and made again in the background
                    log.warning("%s: refresh: %s; the connection is tried again", self.uri, e)
                    slot.conn = None
                    self._remake_later(slot)
                else:
                    slot.size, slot.multi_conn = client.get_size(), client.can_multi_conn()
                    slot.conn = driven(client)
                    self._note(slot)
            if old is not None:
                self._retired.add(old)  # still watched: its requests fail over if stalled
                try:
                    await old.drain()
                finally:
                    self._retired.discard(old)
                old.close()
        if not any(slot.conn is not None and slot.conn.alive for slot in self._slots):
            await self._run_on(None, lambda c: trio.lowlevel.checkpoint())
        return self.size

    def _remake_later(self, slot: _Slot) -> None:
        index = self._slots.index(slot)
        if index not in self._remaking:
            self._remaking.add(index)
            trio.lowlevel.spawn_system_task(self._remake, index, name="nbd-remake")

    async def _remake(self, index: int) -> None:
        """Make slot ``index``'s connection again, with the backoff of a request
        (:data:`RETRY_FIRST` doubling to :data:`RETRY_MAX`), until it is made (or
        was, by a request or a refresh), the answer is definitive, the export stops,
        or the export's timeout (:data:`DEFAULT_IO_TIMEOUT` if none) has passed."""
        slot = self._slots[index]
        bound = self.timeout if self.timeout is not None else DEFAULT_IO_TIMEOUT
        deadline = trio.current_time() + bound
        delay = RETRY_FIRST
        try:
            while True:
                await trio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                if self._closed or self._stopping is not None:
                    return
                if slot.conn is not None and slot.conn.alive:
                    return  # made meanwhile
                left = deadline - trio.current_time()
                try:
                    await self._connected(slot, max(left, 0.0))
                except _Disconnected as e:
                    if e.definitive or trio.current_time() >= deadline:
                        alive = sum(1 for s in self._slots if s.conn is not None and s.conn.alive)
                        log.warning(
                            "%s: a connection could not be made again (%s): %d of %d in use",
                            self.uri,
                            e,
                            alive,
                            len(self._slots),
                        )
                        return
                    continue
                log.info("%s: connection %d made again", self.uri, index)
                return
        except Exception:  # a system task's failure would end the whole run
            log.exception("%s: making connection %d again failed", self.uri, index)
        finally:
            self._remaking.discard(index)

    def close(self) -> None:
        """Disconnect every connection (requests still in flight fail)."""
        self._closed = True
        for slot in self._slots:
            conn, slot.conn = slot.conn, None
            if conn is not None:
                conn.close()
