"""Worker processes: the NBD server past one core.

One Python process, bound by the GIL, serves its connections on one core.
With ``ServerConfig.workers`` = N the listening process starts N-1 worker
processes (``python -m nbd.worker``, spawned fresh: they import nbd and trio
only) and serves connections itself too:

- **Hand-off.**  The listener accepts every connection and gives it to the
  serving process with the fewest connections (itself included; on a tie a
  worker, which keeps the listener's loop free for accepting and for the
  storage node's work).  A worker gets the client's socket over its control
  channel (``nbd.control``, ``SCM_RIGHTS``) and does the whole handshake,
  TLS included, and the transmission.  It says when a connection ends.
- **The export table.**  The listener's ``ExportTable`` is the master; each
  worker has a copy.  A change is sent to every worker at once, in order
  with the hand-offs, so a connection handed over after a change sees it;
  ``synced()`` waits until every worker has acknowledged it (the storage
  node's publish/unpublish/modify return only then).  A removed export's
  connections are closed in every process (each closes its own).
- **Shared state** (``nbd.shared``): per-export throttle buckets and
  counters in a memfd every process maps, so limits hold for the export as
  a whole and ``ExportTable.stats()`` in the listener is the sum over all.
- **Durability.**  A FLUSH is an ``fdatasync`` of the image, which writes
  back the file's dirty pages whichever process wrote them: a FLUSH on one
  connection covers the acknowledged writes of every connection.
- **Failure.**  A worker that dies is logged with its status and replaced
  (after ``RESPAWN_DELAY``); its connections are gone (clients reconnect)
  and its shared counts of them go to 0.  A worker that takes no message for
  ``HANDOFF_TIMEOUT`` or sends one that makes no sense is killed.
  Workers die with the listener: ``PR_SET_PDEATHSIG`` (set by the worker),
  and the end of their control channel.
- **Holds** (``nbd.holds``).  A hold is sent to every worker, which holds
  the images' I/O on its own connections and says when it has (or that it
  could not); the listener waits for every ready worker, bounded.  A worker
  started while a hold lasts gets it first, with the lease that is left.
- **Shutdown.**  Workers are told to drain like the listener (the same
  grace); whatever is left after the grace and ``STOP_MARGIN`` is killed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import trio

from nbd import control
from nbd.exports import Export, ExportError, ExportRuntime, ExportStats, ExportTable
from nbd.holds import HoldNotReached
from nbd.shared import SharedExport, SharedRegion

if TYPE_CHECKING:
    from nbd.server import ServerConfig

log = logging.getLogger("moorage.nbd")

# A worker that died is replaced after this long (a crash loop stays slow).
RESPAWN_DELAY = 1.0
# How long a new worker has to take its copy of the table before it is killed.
START_TIMEOUT = 30.0
# How long synced() waits for a worker's acknowledgement before replacing it.
SYNC_TIMEOUT = 10.0
# How long one message may wait for room in a worker's control channel before
# the worker is killed (its queued hand-offs are then served by the listener).
HANDOFF_TIMEOUT = 5.0
# Past the drain's grace, how long workers have to exit before they are killed.
STOP_MARGIN = 5.0


@dataclass
class _Handoff:
    """A client socket on its way to a worker.

    ``fd`` is the hand-off's own duplicate of the socket, so what is sent is
    the client's socket whatever the listener's task does with its stream
    meanwhile; the sender closes it once the hand-off is over.  ``done`` is
    set exactly once, when the socket was sent (``sent``) or never will be.
    """

    fd: int
    done: trio.Event = field(default_factory=trio.Event)
    sent: bool = False

    def finish(self) -> None:
        if not self.done.is_set():
            os.close(self.fd)
            self.done.set()


_Queued = tuple[control.Message, "_Handoff | None"]


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    sock: trio.socket.SocketType
    outbox: trio.MemorySendChannel[_Queued]
    inbox: trio.MemoryReceiveChannel[_Queued]
    connections: int = 0
    acked: int = 0
    ready: bool = False
    gone: bool = False
    acked_event: trio.Event = field(default_factory=trio.Event)
    # Holds this worker answered: id -> None (reached) or why not.
    held: dict[str, str | None] = field(default_factory=dict)

    def queue(self, msg: control.Message, handoff: _Handoff | None = None) -> bool:
        if self.gone:
            return False
        try:
            self.outbox.send_nowait((msg, handoff))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True


class WorkerPool:
    """The worker processes of one ``NBDServer`` (see the module's text)."""

    def __init__(
        self,
        table: ExportTable,
        config: ServerConfig,
        serve_here: Callable[[trio.abc.Stream], Awaitable[None]],
        local_connections: Callable[[], int] | None = None,
    ) -> None:
        self.table = table
        self.config = config
        self._serve_here = serve_here
        self._local = local_connections or (lambda: 0)
        self.region = SharedRegion.create(config.workers)
        self._workers: dict[int, _Worker] = {}
        self._seq = 0
        self._next_slot = 0
        self._free: deque[tuple[int, int]] = deque()  # (slot, seq of its removal)
        self._stopping = False
        self.respawns = 0
        # Holds in force: id -> (paths, trio time its lease ends).
        self._holds: dict[str, tuple[list[str], float]] = {}
        self._held_event = trio.Event()

    # ------------------------------------------------------------ state

    @property
    def connections(self) -> int:
        return sum(w.connections for w in self._workers.values())

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers.values() if not w.gone]

    def _allocate(self) -> int:
        # The first removed slot every worker has let go of: each has taken
        # its removal and none of its connections is left.
        acked = min((w.acked for w in self._live()), default=self._seq)
        for i, (slot, seq) in enumerate(self._free):
            if acked >= seq and self.region.connections(slot) == 0:
                del self._free[i]
                return slot
        if self._next_slot < self.region.slots:
            self._next_slot += 1
            return self._next_slot - 1
        raise ExportError(f"more than {self.region.slots} exports")

    def _runtime(self, export: Export) -> ExportRuntime:
        # An export every worker could not be told of is refused here, before
        # the table records anything.
        try:
            control.encode(_export_message(2**63, export, self.region.slots - 1))
        except control.ControlError as e:
            raise ExportError(f"export {export.name!r}: {e}") from None
        slot = self._allocate()
        self.region.clear(slot)
        throttle = self.region.throttle(slot)
        throttle.configure(export.iops_limit, export.bandwidth_limit)
        row = self.region.row(slot, 0)
        # The row has ExportStats' counters, in shared memory.
        return ExportRuntime(throttle, cast(ExportStats, row), SharedExport(self.region, slot, row))

    def _changed(self, export: Export, runtime: ExportRuntime, present: bool) -> None:
        self._seq += 1
        assert runtime.shared is not None
        if present:
            msg = _export_message(self._seq, export, runtime.shared.slot)
        else:
            msg = {"op": "remove", "seq": self._seq, "name": export.name}
            self._free.append((runtime.shared.slot, self._seq))
        for w in self._live():
            w.queue(msg)

    async def synced(self) -> None:
        """Wait until every worker has acknowledged every change made so far.

        A worker still starting is not waited for: the change is queued for it
        ahead of any connection it will get.  A ready worker that has not
        acknowledged within ``SYNC_TIMEOUT`` (one deadline for all of them) is
        killed (it is replaced, and a new worker starts from the table as it is).
        """
        seq = self._seq
        with trio.move_on_after(SYNC_TIMEOUT):
            for w in self._live():
                while w.ready and w.acked < seq and not w.gone:
                    await w.acked_event.wait()
            return
        for w in self._live():
            if w.ready and w.acked < seq:
                log.error(
                    "NBD worker %d did not take an export change in time; replacing it", w.index
                )
                _kill(w.proc)

    # ------------------------------------------------------------ holds

    def place_hold(self, hold_id: str, paths: Sequence[Path], lease: float, timeout: float) -> None:
        """Send a hold to every worker (``hold_reached`` waits for their answers)."""
        names = [str(p) for p in paths]
        self._holds[hold_id] = (names, trio.current_time() + lease)
        msg = {"op": "hold", "id": hold_id, "paths": names, "lease": lease, "timeout": timeout}
        for w in self._live():
            w.held.pop(hold_id, None)
            w.queue(msg)

    async def hold_reached(self, hold_id: str, timeout: float) -> None:
        """Wait until every ready worker has reached the hold; HoldNotReached if
        one could not, or after ``timeout`` seconds.  A worker still starting
        has no connections: the hold reaches it before any."""
        waiting: list[_Worker] = []
        with trio.move_on_after(timeout):
            while True:
                live = self._live()
                for w in live:
                    error = w.held.get(hold_id)
                    if error is not None:
                        raise HoldNotReached(f"NBD worker {w.index}: {error}")
                waiting = [w for w in live if w.ready and hold_id not in w.held]
                if not waiting:
                    return
                await self._held_event.wait()
        shown = ", ".join(str(w.index) for w in waiting)
        raise HoldNotReached(f"NBD workers {shown} did not reach the hold within {timeout:g}s")

    def release_hold(self, hold_id: str) -> None:
        if self._holds.pop(hold_id, None) is None:
            return
        for w in self._live():
            w.held.pop(hold_id, None)
            w.queue({"op": "release", "id": hold_id})

    def _held(self, worker: _Worker, msg: control.Message) -> None:
        hold_id, error = msg.get("id"), msg.get("error")
        if not isinstance(hold_id, str) or not (error is None or isinstance(error, str)):
            raise control.ControlError(f"bad held {str(msg)[:80]!r}")
        if hold_id in self._holds:
            worker.held[hold_id] = error
        event, self._held_event = self._held_event, trio.Event()
        event.set()

    # ---------------------------------------------------------- routing

    def _pick(self) -> _Worker | None:
        best: _Worker | None = None
        for w in self._workers.values():
            if w.ready and not w.gone and (best is None or w.connections < best.connections):
                best = w
        if best is None or best.connections > self._local():
            return None
        return best

    async def route(self, stream: trio.abc.Stream) -> None:
        """Serve an accepted connection here or in the least busy worker.

        The wait for a hand-off is bounded by the sender: each send has
        ``HANDOFF_TIMEOUT``, and a worker that takes no more is killed, which
        fails what is still queued for it.  Only a socket not sent is served
        here, so no client is ever served by two processes.
        """
        worker = None if self._stopping else self._pick()
        if worker is not None and isinstance(stream, trio.SocketStream):
            handoff = _Handoff(os.dup(stream.socket.fileno()))
            worker.connections += 1
            if worker.queue({"op": "conn"}, handoff):
                await handoff.done.wait()
            else:
                handoff.finish()
            if handoff.sent:
                stream.socket.close()  # the worker has its own descriptor now
                return
            worker.connections -= 1
            log.warning("NBD worker %d did not take a connection; serving it here", worker.index)
        await self._serve_here(stream)

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the workers, serve until stopped, then see them gone."""
        self.table.share(self._runtime, self._changed)
        try:
            async with trio.open_nursery() as nursery:
                starts = []
                for index in range(1, self.config.workers):
                    started = trio.Event()
                    starts.append(started)
                    nursery.start_soon(self._supervise, index, started)
                # Serving begins once every worker has its table (or failed to).
                with trio.move_on_after(START_TIMEOUT + 1):
                    for started in starts:
                        await started.wait()
                task_status.started()
        finally:
            for w in self._workers.values():
                _kill(w.proc)
                with contextlib.suppress(ChildProcessError, OSError):
                    w.proc.wait(1)
            self.table.unshare(self._changed)
            self.region.close()

    def shutdown(self) -> None:
        """Tell every worker to drain and exit; hand over no more connections."""
        self._stopping = True
        for w in self._live():
            w.queue({"op": "shutdown"})

    async def wait_stopped(self) -> None:
        """Wait for the workers to exit (bounded: the grace, then ``STOP_MARGIN``)."""
        with trio.move_on_after(self.config.shutdown_grace + STOP_MARGIN):
            while self._live():
                await trio.sleep(0.05)
        for w in self._live():
            log.warning("NBD worker %d still running after shutdown; killing it", w.index)
            _kill(w.proc)

    async def _supervise(self, index: int, started: trio.Event) -> None:
        while not self._stopping:
            try:
                worker = self._spawn(index)
            except OSError as e:
                log.error("cannot start NBD worker %d: %s", index, e)
                started.set()
                await trio.sleep(RESPAWN_DELAY)
                continue
            try:
                await self._run_worker(worker, started)
            except BaseException:
                _kill(worker.proc)  # cancelled: the server is going away
                raise
            finally:
                worker.gone = True
                worker.acked_event.set()
                event, self._held_event = self._held_event, trio.Event()
                event.set()
                with trio.CancelScope(shield=True):
                    status = await _reap(worker.proc)
                worker.sock.close()
                worker.outbox.close()
                _fail_pending(worker)
                self._forget_connections(index)
            started.set()
            if self._stopping and status == 0:
                log.debug("NBD worker %d (pid %d) stopped", index, worker.proc.pid)
                return
            log.warning(
                "NBD worker %d (pid %d) ended (%s) with %d connections; %s",
                index,
                worker.proc.pid,
                _status_text(status),
                worker.connections,
                "not replaced: shutting down" if self._stopping else "replacing it",
            )
            if self._stopping:
                return
            self.respawns += 1
            await trio.sleep(RESPAWN_DELAY)

    def _forget_connections(self, index: int) -> None:
        """A worker process is gone, and so are its connections: its shared
        counts of open connections go to 0 (its other counters stay in the
        totals), so ``stats()`` is right and its exports' slots can be reused."""
        for slot in range(self._next_slot):
            self.region.row(slot, index).connections = 0

    def _spawn(self, index: int) -> _Worker:
        """Start worker ``index`` and queue its settings and the table as it is now."""
        ours, theirs = control.socketpair()
        try:
            # From the trio thread, which lives as long as the process: the
            # worker's PR_SET_PDEATHSIG follows the thread that made it.
            proc = subprocess.Popen(
                [sys.executable, "-m", "nbd.worker", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        send, receive = trio.open_memory_channel[_Queued](math.inf)
        worker = _Worker(index, proc, trio.socket.from_stdlib_socket(ours), send, receive)
        self._workers[index] = worker
        worker.queue(self._config_message(index), None)
        for export in self.table:
            runtime = self.table.runtime(export.name)
            assert runtime is not None and runtime.shared is not None
            worker.queue(_export_message(self._seq, export, runtime.shared.slot))
        worker.queue({"op": "sync", "seq": self._seq})
        now = trio.current_time()
        for hold_id, (names, deadline) in self._holds.items():
            if deadline > now:
                lease = deadline - now
                msg = {"op": "hold", "id": hold_id, "paths": names, "lease": lease, "timeout": 1.0}
                worker.queue(msg)
        log.debug("NBD worker %d started (pid %d)", index, proc.pid)
        return worker

    def _config_message(self, index: int) -> control.Message:
        c = self.config
        tls = c.tls_files
        return {
            "op": "config",
            "index": index,
            "slots": self.region.slots,
            "processes": self.region.processes,
            "handshake_timeout": c.handshake_timeout,
            "shutdown_grace": c.shutdown_grace,
            "io_threads": c.io_threads,
            "tls": None
            if tls is None
            else {
                "cert": str(tls.cert),
                "key": str(tls.key),
                "client_ca": None if tls.client_ca is None else str(tls.client_ca),
            },
            "tls_required": c.tls_required,
            "log_level": logging.getLogger("moorage").getEffectiveLevel(),
        }

    async def _run_worker(self, worker: _Worker, started: trio.Event) -> None:
        seq = self._seq
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_loop, worker, nursery.cancel_scope)

            async def start_timeout() -> None:
                with trio.move_on_after(START_TIMEOUT):
                    while worker.acked < seq and not worker.gone:
                        await worker.acked_event.wait()
                    return
                log.error("NBD worker %d did not start in time; killing it", worker.index)
                _kill(worker.proc)

            nursery.start_soon(start_timeout)
            try:
                while True:
                    got = await control.receive(worker.sock, control.OPS_TO_LISTENER)
                    if got is None:
                        break
                    msg, fds = got
                    for fd in fds:
                        os.close(fd)
                    if msg["op"] == "ack":
                        try:
                            seq_acked = int(msg["seq"])
                        except (KeyError, TypeError, ValueError):
                            raise control.ControlError(f"bad ack {str(msg)[:80]!r}") from None
                        worker.acked = max(worker.acked, seq_acked)
                        if not worker.ready and worker.acked >= seq:
                            worker.ready = True
                            started.set()
                            log.debug("NBD worker %d (pid %d) ready", worker.index, worker.proc.pid)
                        event, worker.acked_event = worker.acked_event, trio.Event()
                        event.set()
                    elif msg["op"] == "closed":
                        worker.connections = max(0, worker.connections - 1)
                    elif msg["op"] == "held":
                        self._held(worker, msg)
            except (OSError, control.ControlError) as e:
                log.error("NBD worker %d: control channel failed: %s", worker.index, e)
                _kill(worker.proc)
            nursery.cancel_scope.cancel()

    async def _send_loop(self, worker: _Worker, scope: trio.CancelScope) -> None:
        """Send the worker its messages in order.  A worker that takes none for
        ``HANDOFF_TIMEOUT`` is killed (it is replaced).  A send is all or
        nothing (a cancelled ``sendmsg`` sent nothing), so a hand-off's
        ``sent`` is exact."""
        try:
            async for msg, handoff in worker.inbox:
                try:
                    fds = [handoff.fd] if handoff is not None else None
                    if msg["op"] == "config":
                        fds = [self.region.fd]
                    with trio.move_on_after(HANDOFF_TIMEOUT) as timeout:
                        await control.send(worker.sock, msg, fds)
                        if handoff is not None:
                            handoff.sent = True
                finally:
                    if handoff is not None:
                        handoff.finish()
                if timeout.cancelled_caught:
                    log.error(
                        "NBD worker %d took no message for %.0f s; killing it",
                        worker.index,
                        HANDOFF_TIMEOUT,
                    )
                    _kill(worker.proc)
                    return
        except (OSError, control.ControlError) as e:
            log.error("NBD worker %d: cannot send to it: %s", worker.index, e)
            _kill(worker.proc)


def _export_message(seq: int, export: Export, slot: int) -> control.Message:
    return {"op": "export", "seq": seq, "slot": slot, "export": control.export_to_wire(export)}


def _fail_pending(worker: _Worker) -> None:
    """Hand-offs still queued for a worker that is gone: their listeners serve them."""
    while True:
        try:
            _, handoff = worker.inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        if handoff is not None:
            handoff.finish()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)


async def _reap(proc: subprocess.Popen[bytes]) -> int:
    """The worker's exit status, waited for without blocking the loop.

    Bounded: the worker has ``STOP_MARGIN`` to exit, is then killed, and is
    waited for ``STOP_MARGIN`` more; one that is still there (stuck in the
    kernel) is logged and left to the kernel (-SIGKILL is returned).
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:
        pidfd = -1
    try:
        for last in (False, True):
            with trio.move_on_after(STOP_MARGIN):
                if pidfd >= 0:
                    await trio.lowlevel.wait_readable(pidfd)
                else:
                    await trio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
            if proc.poll() is not None or last:
                break
            _kill(proc)
    finally:
        if pidfd >= 0:
            os.close(pidfd)
    status = proc.poll()
    if status is None:
        log.error("NBD worker pid %d does not exit even when killed; not waiting for it", proc.pid)
        return -signal.SIGKILL
    return status


def _status_text(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exit status {status}"
