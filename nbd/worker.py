"""An NBD worker process: ``python -m nbd.worker CONTROL_FD PARENT_PID``.

Started by ``nbd.workers.WorkerPool`` in the listening process; imports only
nbd and trio.  It serves the connections handed to it over its control
channel with an ``NBDServer`` of its own, whose export table follows the
listener's (every change acknowledged), and whose per-export buckets and
counters are in the memory the processes share.  It exits when told to
(after draining like the listener), when its control channel ends, or, at
once, when the listener dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
from pathlib import Path
from typing import cast

import trio

from nbd import control
from nbd.exports import ExportRuntime, ExportStats, ExportTable
from nbd.holds import Hold, HoldNotReached
from nbd.server import NBDServer, ServerConfig, tune_malloc
from nbd.shared import SharedExport, SharedRegion
from nbd.tls import TLSFiles

log = logging.getLogger("moorage.nbd")

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent goes; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(1)


def raise_fd_limit() -> None:
    """Let the worker have as many descriptors as it may (one per connection,
    and the images it opens): the soft RLIMIT_NOFILE up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m nbd.worker CONTROL_FD PARENT_PID", file=sys.stderr)
        return 2
    control_fd, parent = int(args[0]), int(args[1])
    die_with_parent(parent)
    # A terminal's ^C reaches the whole process group: the listener decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # So does a SIGTERM to the group (a service manager stopping the node):
    # the listener tells its workers to drain, and they must live to do it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tune_malloc()
    raise_fd_limit()
    trio.run(_serve, control_fd)
    return 0


async def _serve(control_fd: int) -> None:
    sock = trio.socket.from_stdlib_socket(socket.socket(fileno=control_fd))
    got = await control.receive(sock, control.OPS_TO_WORKER)
    if got is None:
        return
    config, fds = got
    if config["op"] != "config" or len(fds) != 1:
        raise control.ControlError("a worker's first message must be its config")
    index = int(config["index"])
    logging.basicConfig(
        level=int(config["log_level"]),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {index}]: %(message)s",
    )
    region = SharedRegion(fds[0], int(config["slots"]), int(config["processes"]))
    tls = config["tls"]
    server = NBDServer(
        ExportTable(),
        ServerConfig(
            tls_files=None
            if tls is None
            else TLSFiles(
                Path(tls["cert"]),
                Path(tls["key"]),
                None if tls["client_ca"] is None else Path(tls["client_ca"]),
            ),
            tls_required=bool(config["tls_required"]),
            handshake_timeout=float(config["handshake_timeout"]),
            shutdown_grace=float(config["shutdown_grace"]),
            io_threads=int(config["io_threads"]),
        ),
    )
    worker = _Worker(sock, server, region, index)
    async with trio.open_nursery() as nursery:
        drained = trio.Event()

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            await server.serve([], task_status=task_status)
            drained.set()  # told to shut down, and the drain is over

        async def take_messages() -> None:
            await worker.run(nursery)
            drained.set()  # the listener is gone: stop at once

        await nursery.start(serve)
        nursery.start_soon(take_messages)
        await drained.wait()
        nursery.cancel_scope.cancel()


class _Worker:
    def __init__(
        self, sock: trio.socket.SocketType, server: NBDServer, region: SharedRegion, index: int
    ) -> None:
        self.sock = sock
        self.server = server
        self.region = region
        self.index = index
        self._send_lock = trio.Lock()
        self._closed = False

    async def _send(self, msg: control.Message) -> None:
        if self._closed:
            return
        async with self._send_lock:
            try:
                await control.send(self.sock, msg)
            except OSError:
                self._closed = True  # the listener is gone; so shall we be

    async def run(self, nursery: trio.Nursery) -> None:
        """Take messages until the listener closes the channel or says shut down."""
        table = self.server.exports
        while True:
            got = await control.receive(self.sock, control.OPS_TO_WORKER)
            if got is None:
                log.info("the listening process is gone; stopping")
                self._closed = True
                return
            msg, fds = got
            op = msg["op"]
            if op == "conn":
                for fd in fds[1:]:
                    os.close(fd)
                if fds:
                    nursery.start_soon(self._serve_connection, fds[0])
                else:
                    log.warning("a handed-over connection did not arrive (out of descriptors?)")
                    await self._send({"op": "closed"})
                continue
            for fd in fds:
                os.close(fd)
            if op == "export":
                slot = int(msg["slot"])
                export = control.export_from_wire(msg["export"])
                row = self.region.row(slot, self.index)
                runtime = ExportRuntime(
                    self.region.throttle(slot),
                    cast(ExportStats, row),
                    SharedExport(self.region, slot, row),
                )
                table.add(export, runtime)
            elif op == "remove":
                table.remove(str(msg["name"]))
            elif op == "shutdown":
                self.server.shutdown()  # serve() drains, then the worker exits
                continue
            elif op == "hold":
                # Placed here, before the next message is read: a release that
                # follows it on the channel always finds it.  Only the wait
                # for the connections to get quiet runs on its own.
                try:
                    hold_id = str(msg["id"])
                    timeout = float(msg["timeout"])
                    paths = [Path(str(p)) for p in msg["paths"]]
                    hold = self.server.holds.place(hold_id, paths, float(msg["lease"]))
                except (KeyError, TypeError, ValueError) as e:
                    error = f"bad hold message: {e}"
                    nursery.start_soon(
                        self._send, {"op": "held", "id": str(msg.get("id")), "error": error}
                    )
                    continue
                nursery.start_soon(self._reach, hold, timeout)
                continue
            elif op == "release":
                self.server.release_io(str(msg["id"]))
                continue
            if "seq" in msg:
                await self._send({"op": "ack", "seq": int(msg["seq"])})

    async def _reach(self, hold: Hold, timeout: float) -> None:
        """Say when the hold placed in this worker is reached (or why not)."""
        error = None
        try:
            await self.server.reach_hold(hold, timeout)
        except HoldNotReached as e:
            error = str(e)
        await self._send({"op": "held", "id": hold.hold_id, "error": error})

    async def _serve_connection(self, fd: int) -> None:
        try:
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
        except OSError as e:
            log.warning("a handed-over connection is unusable: %s", e)
            os.close(fd)
            await self._send({"op": "closed"})
            return
        try:
            await self.server.handle_stream(stream)
        finally:
            with trio.CancelScope(shield=True):
                await self._send({"op": "closed"})


if __name__ == "__main__":
    sys.exit(main())
