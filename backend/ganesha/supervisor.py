"""Running nfs-ganesha: start it, watch it, restart it, reload it, stop it.

:class:`GaneshaSupervisor` is one long-lived trio task that owns a
``ganesha.nfsd -F`` child (and an ``rpcbind -f`` child when no rpcbind runs and
NFSv3 needs one).  Ganesha's log goes to its stdout, which is read line by line
into the ``moorage.ganesha`` logger.  Facts about ganesha 4.3 this relies on:

- It is ready when an RPC NULL call to the NFS program on its port is answered
  (the sockets are bound a while before the service threads answer, and a
  ganesha that cannot register with rpcbind binds, then exits).
- SIGHUP re-reads the EXPORT blocks; every reload ends with exactly one of
  "Reread exports complete", "Error while parsing EXPORT entries" or "Error
  while parsing new configuration file".  Reloads are sent one at a time so
  each marker belongs to a known SIGHUP.
- SIGTERM takes from a fraction of a second to seconds (more with clients
  holding state); what it exported must not be unmounted before it has exited,
  so stopping waits for it.
- With NFSv3 on and no rpcbind, it exits at start ("Cannot register NFS V3").
  A second ganesha with the same pid file exits at once ("Ganesha already
  started"): its pid file is locked while it runs.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio

from backend.api.errors import BackendError, FailedPrecondition, Unavailable
from backend.ganesha.children import (
    Child,
    describe_exit,
    spawn_child,
    stop_child,
    stop_recorded,
)
from backend.ganesha.config import CoreConfig
from backend.ganesha.probes import NFS_PROGRAM, RPCBIND_PORT, accepts_tcp, port_in_use, rpc_ping
from hostio.atomicfile import write_atomically

log = logging.getLogger("moorage.ganesha")

# ganesha tells filesystems apart by UUID, which it asks libblkid for, and
# libblkid trusts its cache file (/run/blkid/blkid.tab) for entries probed in
# the last two seconds.  A pool reuses loop devices within seconds, so a
# cached UUID can be a former filesystem's: two mounted filesystems then look
# alike to ganesha, which drops one, and the export on it fails with
# "resolve_posix_filesystem ... No such file or directory".  Without a cache
# file libblkid reads every device afresh.
GANESHA_ENV: Final = {"BLKID_FILE": "/dev/null"}


@contextmanager
def _single_error() -> Iterator[None]:
    """Re-raise a nursery's lone BackendError as itself, so callers can catch it."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1 and isinstance(leaves[0], BackendError):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


@dataclass
class RestartBackoff:
    """Delays between restarts: doubling from ``initial`` up to ``maximum``.

    Back to ``initial`` once a start stayed up ``stable_after`` seconds.
    """

    initial: float = 0.5
    maximum: float = 30.0
    stable_after: float = 60.0
    _next: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._next = self.initial

    def delay(self, uptime: float) -> float:
        """The wait before the next start, given how long the last one stayed up."""
        if uptime >= self.stable_after:
            self._next = self.initial
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay


class GaneshaSupervisor:
    """Runs ``ganesha.nfsd`` for one configuration file, for as long as :meth:`run` runs."""

    def __init__(
        self,
        config_file: Path,
        core: CoreConfig,
        *,
        pid_file: Path,
        ganesha_bin: str = "ganesha.nfsd",
        rpcbind_bin: str = "rpcbind",
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        reload_timeout: float = 30.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        stable_after: float = 60.0,
    ) -> None:
        self.config_file = config_file
        self.core = core
        self.pid_file = pid_file
        self.ganesha_bin = ganesha_bin
        self.rpcbind_bin = rpcbind_bin
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.reload_timeout = reload_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stable_after = stable_after

        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ganesha: Child | None = None
        self._rpcbind: Child | None = None
        self._ready = False
        self._restarts = 0
        self._changed = trio.Event()
        # Reload bookkeeping: requests are numbered; one SIGHUP covers every
        # request made before it was sent.
        self._requested = 0
        self._handled = 0
        self._failed_upto = 0

    # -------------------------------------------------------------- state

    @property
    def pid(self) -> int | None:
        """The running ganesha's pid, if one runs."""
        child = self._ganesha
        if child is None or child.process.returncode is not None:
            return None
        return child.pid

    @property
    def ready(self) -> bool:
        """Whether ganesha is up and answering on its NFS port."""
        return self._ready

    @property
    def restarts(self) -> int:
        """How many times ganesha was restarted after dying."""
        return self._restarts

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -------------------------------------------------------------- run

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start ganesha, report started once it answers, keep it running until cancelled.

        Raises :class:`Unavailable` if the NFS (or mount) port is taken or the
        first start fails; later deaths are restarted with exponential backoff.
        On cancellation ganesha gets SIGTERM and is waited for (SIGKILL after
        ``stop_timeout``), then the rpcbind this supervisor started, if any.
        """
        if self._nursery is not None:
            raise FailedPrecondition("this ganesha supervisor is already running")
        self._token = trio.lowlevel.current_trio_token()
        try:
            with _single_error():
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    try:
                        await self._supervise(nursery, task_status)
                    finally:
                        with trio.CancelScope(shield=True):
                            await stop_child(self._ganesha, self.stop_timeout)
                            self._ganesha = None
                            self._ready = False
                            await stop_child(self._rpcbind, 10.0)
                            if self._rpcbind is not None:
                                self._rpcbind_pid_file.unlink(missing_ok=True)
                            self._rpcbind = None
                            nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._token = None
            self._notify()

    async def _supervise(self, nursery: trio.Nursery, task_status: trio.TaskStatus[None]) -> None:
        await self._stop_stale()
        self._check_ports_free()
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        if self._needs_rpcbind:
            await self.ensure_rpcbind()
        await self._start_ganesha()
        nursery.start_soon(self._reload_worker)
        task_status.started()

        backoff = RestartBackoff(self.backoff_initial, self.backoff_max, self.stable_after)
        ready_at: float | None = trio.current_time()
        while True:
            child = self._ganesha
            uptime = 0.0
            if child is not None:
                await child.process.wait()
                self._ready = False
                self._ganesha = None
                self._notify()
                uptime = trio.current_time() - ready_at if ready_at is not None else 0.0
                log.error(
                    "ganesha.nfsd (pid %d) exited with %s after %.1fs",
                    child.pid,
                    describe_exit(child.process.returncode),
                    uptime,
                )
            delay = backoff.delay(uptime)
            log.info("restarting ganesha.nfsd in %.1fs", delay)
            await trio.sleep(delay)
            ready_at = None
            try:
                if self._needs_rpcbind:
                    await self.ensure_rpcbind()
                await self._start_ganesha()
            except Unavailable as e:
                log.error("ganesha.nfsd did not start: %s", e)
                continue
            ready_at = trio.current_time()
            self._restarts += 1
            log.info("ganesha.nfsd restarted (pid %s)", self.pid)

    @property
    def _needs_rpcbind(self) -> bool:
        return 3 in self.core.protocols

    @property
    def _rpcbind_pid_file(self) -> Path:
        return self.pid_file.with_name("rpcbind.pid")

    async def _stop_stale(self) -> None:
        """Stop the ganesha (and rpcbind) a killed daemon left running.

        A SIGKILLed daemon cannot stop its children; that ganesha still holds
        the ports and the pid file, and its rpcbind holds port 111 with stale
        registrations.  A ganesha is ours if its pid file names it and its
        command line names our configuration file; an rpcbind if the pid file
        we wrote when starting it names a process that is rpcbind.
        """
        await stop_recorded(self.pid_file, str(self.config_file).encode(), self.stop_timeout)
        await stop_recorded(self._rpcbind_pid_file, self.rpcbind_bin.encode(), self.stop_timeout)
        self._rpcbind_pid_file.unlink(missing_ok=True)

    def _check_ports_free(self) -> None:
        ports = [("NFS", self.core.nfs_port)]
        if self.core.mount_port is not None:
            ports.append(("mount", self.core.mount_port))
        for what, port in ports:
            if port_in_use(self.core.bind_addr, port):
                raise Unavailable(
                    f"the {what} port {self.core.bind_addr}:{port} is already in use "
                    f"(another NFS server, or a ganesha left over from an earlier run; "
                    f"its pid file would be {self.pid_file})"
                )

    async def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        assert self._nursery is not None
        return await spawn_child(self._nursery, name, argv, env, self._notify)

    async def _start_ganesha(self) -> None:
        argv = [
            self.ganesha_bin,
            "-F",
            "-L",
            "/dev/stdout",
            "-f",
            str(self.config_file),
            "-p",
            str(self.pid_file),
        ]
        # this process reads the files as they are now: it covers every reload asked so far
        covering = self._requested
        child = await self._spawn("ganesha.nfsd", argv, GANESHA_ENV)
        self._ganesha = child
        try:
            await self._wait_ready(child)
        except BaseException:
            with trio.CancelScope(shield=True):
                await stop_child(child, self.stop_timeout)
            self._ganesha = None
            raise
        self._ready = True
        self._handled = max(self._handled, covering)
        self._notify()

    async def _wait_ready(self, child: Child) -> None:
        host, port = self.core.probe_host, self.core.nfs_port
        version = min(self.core.protocols)
        with trio.move_on_after(self.start_timeout):
            while True:
                if child.process.poll() is not None:
                    with trio.move_on_after(2):
                        await child.drained.wait()
                    raise Unavailable(
                        f"ganesha.nfsd exited with {describe_exit(child.process.returncode)} "
                        f"before it answered on port {port}; its last lines:\n{child.tail_text()}"
                    )
                if await rpc_ping(host, port, NFS_PROGRAM, version):
                    log.info("ganesha.nfsd (pid %d) answers on %s:%d", child.pid, host, port)
                    return
                await trio.sleep(0.1)
        raise Unavailable(
            f"ganesha.nfsd did not answer on {host}:{port} within {self.start_timeout}s; "
            f"its last lines:\n{child.tail_text()}"
        )

    # -------------------------------------------------------------- reload

    def reload(self) -> int:
        """Ask ganesha to re-read its export files (SIGHUP); returns at once.

        Call from the trio thread.  The signal is sent by the supervisor as
        soon as ganesha is ready and no earlier reload is in flight; a ganesha
        being (re)started reads the files anyway.  Returns the request number.
        """
        self._requested += 1
        self._notify()
        return self._requested

    async def reload_and_wait(self, timeout: float = 90.0) -> bool:
        """Reload and wait until ganesha has re-read the files.

        Returns False when ganesha reported an error in the EXPORT entries (its
        log says which); raises :class:`Unavailable` when it is not running or
        did not finish within ``timeout``.
        """
        if self._nursery is None:
            raise FailedPrecondition("ganesha is not running")
        ticket = self.reload()
        with trio.move_on_after(timeout):
            while self._handled < ticket:
                if self._nursery is None:
                    raise Unavailable("the ganesha supervisor stopped before the reload")
                await self._changed.wait()
            return self._failed_upto < ticket
        raise Unavailable(f"ganesha.nfsd did not reload its exports within {timeout}s")

    def reload_from_thread(self, *, wait: bool = False, timeout: float = 90.0) -> bool:
        """:meth:`reload` (or, with ``wait``, :meth:`reload_and_wait`) from a worker thread."""
        token = self._token
        if token is None:
            raise FailedPrecondition("ganesha is not running")
        if wait:
            return trio.from_thread.run(self.reload_and_wait, timeout, trio_token=token)
        trio.from_thread.run_sync(self.reload, trio_token=token)
        return True

    async def _reload_worker(self) -> None:
        while True:
            child = self._ganesha
            if not self._ready or child is None or self._requested <= self._handled:
                await self._changed.wait()
                continue
            covering = self._requested
            before = child.reloads_logged
            child.process.send_signal(signal.SIGHUP)
            log.info("sent SIGHUP to ganesha.nfsd (pid %d) to reload its exports", child.pid)
            with trio.move_on_after(self.reload_timeout):
                while child.reloads_logged == before and child.process.returncode is None:
                    await self._changed.wait()
            if self._ganesha is not child or child.process.returncode is not None:
                continue  # it died; the next ganesha reads the files at start
            if child.reloads_logged == before:
                log.error(
                    "ganesha.nfsd (pid %d) did not finish reloading within %.0fs",
                    child.pid,
                    self.reload_timeout,
                )
                self._failed_upto = covering
            elif not child.last_reload_ok:
                self._failed_upto = covering
            self._handled = max(self._handled, covering)
            self._notify()

    # -------------------------------------------------------------- rpcbind

    async def ensure_rpcbind(self) -> bool:
        """Start ``rpcbind -f`` as a child unless an rpcbind already listens on port 111.

        NFSv3 needs rpcbind for ganesha's MOUNT and NFS registrations.  Returns
        whether this call started one; the supervisor stops only the rpcbind it
        started, when it stops.  Callable while :meth:`run` runs.
        """
        if self._nursery is None:
            raise FailedPrecondition("ensure_rpcbind needs the supervisor to be running")
        if self._rpcbind is not None and self._rpcbind.process.returncode is None:
            return False
        if await accepts_tcp("127.0.0.1", RPCBIND_PORT):
            return False
        child = await self._spawn("rpcbind", [self.rpcbind_bin, "-f"])
        with trio.move_on_after(10):
            while True:
                if child.process.poll() is not None:
                    with trio.move_on_after(2):
                        await child.drained.wait()
                    if await accepts_tcp("127.0.0.1", RPCBIND_PORT):
                        return False  # another one won the race to start; fine
                    raise Unavailable(
                        f"rpcbind exited with {describe_exit(child.process.returncode)}: "
                        f"{child.tail_text()}"
                    )
                if await accepts_tcp("127.0.0.1", RPCBIND_PORT):
                    self._rpcbind = child
                    # So a daemon restarted after a crash can stop this one.
                    write_atomically(self._rpcbind_pid_file, f"{child.pid}\n", mode=0o644)
                    return True
                await trio.sleep(0.05)
        with trio.CancelScope(shield=True):
            await stop_child(child, 5.0)
        raise Unavailable("rpcbind did not listen on port 111 within 10s")
