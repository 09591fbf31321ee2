"""Connections: accept, handshake, transmission, shutdown.

One ``NBDServer`` serves an ``ExportTable`` on any number of listeners (TCP,
unix sockets, sockets inherited through systemd socket activation) or on a
single already-connected stream (stdin/stdout mode).

With ``ServerConfig.workers`` above 1 it serves from that many processes:
this one accepts every connection and keeps it or hands it to the
least-busy worker process (``nbd.workers``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from nbd.codec import ProtocolError
from nbd.exports import ExportTable, IPAddress
from nbd.handshake import ClientGone, Handshake, HandshakePolicy
from nbd.holds import Hold, Holds
from nbd.tls import TLSFiles
from nbd.transmission import Transmission
from nbd.transport import PeerClosed, Transport

if TYPE_CHECKING:
    from nbd.workers import WorkerPool

log = logging.getLogger("moorage.nbd")

SD_LISTEN_FDS_START = 3
SEND_BUFFER = 4 * 1024 * 1024


@dataclass
class ServerConfig:
    tls_context: ssl.SSLContext | None = None
    tls_required: bool = False
    # A client that has not finished the handshake by then is dropped.
    handshake_timeout: float = 30.0
    # How long a graceful shutdown waits for in-flight requests.
    shutdown_grace: float = 10.0
    # Worker threads for blocking I/O, shared by all connections (of a process).
    io_threads: int = 16
    # Processes serving connections, this one included (1: this one alone).
    workers: int = 1
    # Where the TLS context comes from: worker processes make theirs from it.
    tls_files: TLSFiles | None = None


def default_workers() -> int:
    """One serving process per CPU this process may run on, at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def peer_address(stream: trio.abc.Stream) -> tuple[IPAddress | None, str]:
    """The client's IP address (None for unix sockets and pipes) and a label for logs."""
    if isinstance(stream, trio.SocketStream):
        sock = stream.socket
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                host, port = sock.getpeername()[:2]
            except OSError:
                return None, "tcp:?"
            return ipaddress.ip_address(host), f"{host}:{port}"
        if sock.family == socket.AF_UNIX:
            return None, "unix"
    return None, "stdio"


class NBDServer:
    def __init__(self, exports: ExportTable, config: ServerConfig | None = None) -> None:
        self.exports = exports
        self.config = config or ServerConfig()
        if self.config.tls_context is None and self.config.tls_files is not None:
            self.config.tls_context = self.config.tls_files.context()
        if self.config.tls_required and self.config.tls_context is None:
            raise ValueError("TLS required but no TLS context configured")
        if self.config.workers < 1:
            raise ValueError("an NBD server needs at least one serving process")
        if (
            self.config.workers > 1
            and self.config.tls_context is not None
            and self.config.tls_files is None
        ):
            raise ValueError("worker processes need the TLS files, not only a context")
        # The worker processes, while serve() runs with workers > 1.
        self.pool: WorkerPool | None = None
        self.io_limiter = trio.CapacityLimiter(self.config.io_threads)
        self.shutting_down = False
        self._stop = trio.Event()
        self._policy = HandshakePolicy(
            tls_context=self.config.tls_context, tls_required=self.config.tls_required
        )
        self._handshaking: set[trio.CancelScope] = set()
        self._transmitting: set[Transmission] = set()
        # Images whose I/O is held at a barrier (``nbd.holds``), in this process.
        self.holds = Holds()
        self._connections = 0
        self._idle = trio.Event()
        self._idle.set()
        self.connections_served = 0

    @property
    def active_connections(self) -> int:
        """Connections open in this process and its workers."""
        return self._connections + (self.pool.connections if self.pool else 0)

    async def sync_exports(self) -> None:
        """Wait until every worker process has the export table as it is now
        (bounded: a worker that does not answer is replaced)."""
        if self.pool is not None:
            await self.pool.synced()

    async def hold_io(
        self, hold_id: str, paths: Sequence[Path], lease: float, timeout: float
    ) -> None:
        """Hold the I/O of the images ``paths`` in this process and every worker,
        and return once each connection on them is quiet (``nbd.holds``): what was
        written before is in the images.  The hold lasts until ``release_io`` or
        ``lease`` seconds.  HoldNotReached after ``timeout`` seconds, with the hold
        released everywhere."""
        deadline = trio.current_time() + timeout
        hold = self.holds.place(hold_id, paths, lease)
        try:
            if self.pool is not None:
                self.pool.place_hold(hold_id, paths, lease, timeout)
            await self.holds.reach(hold, self._transmitting, timeout)
            if self.pool is not None:
                await self.pool.hold_reached(hold_id, max(0.0, deadline - trio.current_time()))
        except BaseException:
            self.release_io(hold_id)
            raise

    async def reach_hold(self, hold: Hold, timeout: float) -> None:
        """Wait until the connections of this process alone are quiet at ``hold``,
        placed here with ``holds.place`` (a worker's part of a hold: the listener
        waits for the others).  HoldNotReached after ``timeout`` seconds, or once
        the hold is released; the hold is then over here."""
        try:
            await self.holds.reach(hold, self._transmitting, timeout)
        except BaseException:
            if not hold.released.is_set():  # else released, or replaced by a newer one
                self.holds.release(hold.hold_id)
            raise

    def release_io(self, hold_id: str) -> None:
        """End a hold in this process and every worker (nothing if it is over)."""
        self.holds.release(hold_id)
        if self.pool is not None:
            self.pool.release_hold(hold_id)

    # ---------------------------------------------------------- listening

    async def serve(
        self,
        listeners: Sequence[trio.abc.Listener[trio.abc.Stream]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on ``listeners`` until ``shutdown()``; then drain and return."""
        async with trio.open_nursery() as nursery:
            accept_scope = trio.CancelScope()
            handler = self.handle_stream
            pool = None
            if self.config.workers > 1:
                from nbd.workers import WorkerPool

                pool = WorkerPool(
                    self.exports, self.config, self.handle_stream, lambda: self._connections
                )
                # Before it starts: sync_exports() meanwhile waits for the workers.
                self.pool = pool
                await nursery.start(pool.run)
                handler = pool.route

            async def accept_all() -> None:
                with accept_scope:
                    await trio.serve_listeners(handler, list(listeners), handler_nursery=nursery)

            if listeners:
                nursery.start_soon(accept_all)
            task_status.started()
            await self._stop.wait()
            accept_scope.cancel()
            for listener in listeners:
                with contextlib.suppress(trio.ClosedResourceError, OSError):
                    await listener.aclose()
            if pool is not None:
                pool.shutdown()
            await self._drain()
            if pool is not None:
                await pool.wait_stopped()
            # Past the grace period: close whatever is still busy (e.g. a
            # client that stopped reading its replies) instead of waiting on it.
            nursery.cancel_scope.cancel()

    async def serve_tcp(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await open_tcp_listeners(host, port)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.serve, listeners)
            task_status.started(listeners)

    async def _drain(self) -> None:
        for scope in list(self._handshaking):
            scope.cancel()
        for tx in list(self._transmitting):
            tx.stop_reading()
        with trio.move_on_after(self.config.shutdown_grace) as waited:
            await self._idle.wait()
        if waited.cancelled_caught:
            log.warning("shutdown: %d connections still busy; closing them", self._connections)

    def shutdown(self) -> None:
        """Graceful stop: refuse new work, finish in-flight requests, close."""
        if not self.shutting_down:
            log.info("NBD server shutting down")
        self.shutting_down = True
        self._policy.shutting_down = True
        self._stop.set()

    # --------------------------------------------------------- connection

    async def handle_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one client connection from greeting to close."""
        peer, label = peer_address(stream)
        if isinstance(stream, trio.SocketStream):
            # Room for a full window of 256 KiB read replies: fewer wake-ups.
            with contextlib.suppress(OSError):
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        transport = Transport(stream)
        self._connections += 1
        self._idle = trio.Event() if self._connections == 1 else self._idle
        self.connections_served += 1
        try:
            await self._serve_connection(transport, peer, label)
        except Exception:
            # A bug met by one connection ends that connection, not the server.
            log.exception("%s: connection failed unexpectedly; closing it", label)
        finally:
            await transport.aclose()
            self._connections -= 1
            if self._connections == 0:
                self._idle.set()

    async def _serve_connection(
        self, transport: Transport, peer: IPAddress | None, label: str
    ) -> None:
        if self.shutting_down:
            return
        handshake = Handshake(transport, self.exports, self._policy, peer, label)
        hs_scope = trio.CancelScope(deadline=trio.current_time() + self.config.handshake_timeout)
        self._handshaking.add(hs_scope)
        session = None
        try:
            with hs_scope:
                session = await handshake.run()
        except ClientGone as e:
            log.info("%s: handshake ended: %s", label, e)
        except ProtocolError as e:
            log.warning("%s: protocol violation in handshake: %s", label, e)
        except PeerClosed:
            log.debug("%s: client went away during handshake", label)
        finally:
            self._handshaking.discard(hs_scope)
        if session is None:
            if hs_scope.cancelled_caught and not self.shutting_down:
                log.warning("%s: handshake timed out", label)
            return
        export = session.export
        tx = Transmission(transport, session, self.io_limiter, label)
        conn_scope = trio.CancelScope()
        runtime = self.exports.open_connection(export, conn_scope)
        if runtime is None:
            session.image.close()
            log.info("%s: export %s went away during the handshake", label, export.name)
            return
        tx.throttle = runtime.throttle
        tx.stats = runtime.stats
        tx.holds = self.holds
        self._transmitting.add(tx)
        log.info(
            "%s: serving export %s (%d bytes%s%s)",
            label,
            export.name,
            session.image.size,
            ", read-only" if export.read_only else "",
            ", TLS" if session.tls else "",
        )
        try:
            with conn_scope:
                if self.shutting_down:
                    tx.stop_reading()
                await tx.run()
            if conn_scope.cancelled_caught:
                log.info("%s: export %s removed; connection closed", label, export.name)
        finally:
            self._transmitting.discard(tx)
            self.exports.close_connection(export, conn_scope, runtime)
            log.info(
                "%s: connection closed after %d requests (%d in worker threads)",
                label,
                tx.requests,
                tx.threaded,
            )


# ---------------------------------------------------------------- process


_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_malloc(arenas: int = 2, mmap_threshold: int = 256 * 1024) -> None:
    """Keep a long-running server's heap from holding freed request buffers.

    glibc gives threads that allocate their own arenas and raises its mmap
    threshold after large frees, so buffers of a few hundred KiB freed by
    worker threads stay in the process.  A fixed threshold returns them to
    the kernel at once; few arenas keep the rest compact.  Call before
    threads start.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_ARENA_MAX, arenas)
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    except (OSError, AttributeError):  # not glibc
        log.debug("mallopt not available; heap left at its defaults")


# ---------------------------------------------------------------- sources


def systemd_listen_fds() -> list[socket.socket]:
    """Sockets passed by systemd socket activation (LISTEN_FDS), if meant for us."""
    pid = os.environ.get("LISTEN_PID")
    count = os.environ.get("LISTEN_FDS")
    if not count or (pid and pid != str(os.getpid())):
        return []
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    return socks


def listeners_from_sockets(socks: Sequence[socket.socket]) -> list[trio.SocketListener]:
    return [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in socks]


async def open_tcp_listeners(host: str, port: int) -> list[trio.SocketListener]:
    """trio's listeners on HOST:PORT (every address when ``host`` is empty); when
    that fails (the port taken, the address not this host's) the error names it."""
    try:
        return await trio.open_tcp_listeners(port, host=host or None)
    except OSError as e:
        where = f"[{host}]" if ":" in host else (host or "*")
        raise OSError(e.errno, f"cannot listen on {where}:{port}: {e.strerror or e}") from e


async def open_unix_listener(path: str, mode: int = 0o600) -> trio.SocketListener:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # born with its mode: a chmod after bind leaves a moment with the default one
    old = os.umask(0o777 & ~mode)
    try:
        await sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(128)
    return trio.SocketListener(sock)


def stdio_stream() -> trio.abc.Stream:
    """A stream over stdin/stdout, for clients that spawn the server (nbdkit -s style)."""
    try:
        sock = socket.socket(fileno=os.dup(0))
        if sock.type == socket.SOCK_STREAM:
            return trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        sock.detach()
    except OSError:
        pass
    return trio.StapledStream(trio.lowlevel.FdStream(os.dup(1)), trio.lowlevel.FdStream(os.dup(0)))
