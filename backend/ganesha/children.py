"""The processes the ganesha supervisor runs (``ganesha.nfsd``, ``rpcbind``).

Starting one with its output drained line by line into the
``moorage.ganesha`` logger (ganesha's own log format translated to our
levels, its reload markers counted on the child), stopping one (SIGTERM,
then SIGKILL), stopping one an earlier daemon left running, and saying how
one exited.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio

from backend.api.errors import Unavailable

log = logging.getLogger("moorage.ganesha")

_LINE = re.compile(
    r"\[(?P<thread>[^\]]*)\] (?P<function>\S+) :(?P<component>[^:]*) :"
    r"(?P<level>[A-Z_]+) :(?P<message>.*)"
)
_LEVELS: Final = {
    "FATAL": logging.ERROR,
    "MAJ": logging.ERROR,
    "CRIT": logging.ERROR,
    "WARN": logging.WARNING,
    "EVENT": logging.INFO,
    "INFO": logging.INFO,
    "NULL": logging.INFO,
}
# Complaints a storage node without dbus, kerberos or rados always gets.
_EXPECTED_COMPONENTS: Final = frozenset({"DBUS"})
_EXPECTED_MESSAGES: Final = ("krb5", "keytab", "default realm", "RADOS URLs")

_RELOAD_DONE: Final = "Reread exports complete"
_RELOAD_FAILED: Final = (
    "Error while parsing EXPORT entries",
    "Error while parsing new configuration file",
)


@dataclass(eq=False)
class Child:
    """A supervised process and the task draining its output."""

    name: str
    process: trio.Process
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    drained: trio.Event = field(default_factory=trio.Event)
    drain_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    reloads_logged: int = 0
    last_reload_ok: bool = True

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail_text(self) -> str:
        return "\n".join(self.tail) or "(no output)"


def _alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def describe_exit(returncode: int | None) -> str:
    """How a process ended, for the log: its exit status or the signal that killed it."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


async def spawn_child(
    nursery: trio.Nursery,
    name: str,
    argv: list[str],
    env: dict[str, str] | None,
    on_reload: Callable[[], None],
) -> Child:
    """Start ``argv`` in its own session, its output drained into the log by a task in ``nursery``.

    ``on_reload`` is called each time ganesha logs the end of a reload.
    """
    try:
        process = await trio.lowlevel.open_process(
            argv,
            env={**os.environ, **env} if env else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # its own session: a Ctrl-C meant for the daemon must not reach it
            start_new_session=True,
        )
    except OSError as e:
        raise Unavailable(f"cannot run {argv[0]}: {e}") from e
    child = Child(name, process)
    await nursery.start(drain_output, child, on_reload)
    log.info("started %s (pid %d): %s", name, child.pid, " ".join(argv))
    return child


async def stop_child(child: Child | None, timeout: float) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; call shielded."""
    if child is None:
        return
    process = child.process
    if process.returncode is None:
        started = trio.current_time()
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout):
            await process.wait()
        if process.returncode is None:
            log.error(
                "%s (pid %d) still running %.0fs after SIGTERM; killing it",
                child.name,
                child.pid,
                timeout,
            )
            process.kill()
            await process.wait()
        log.info(
            "%s (pid %d) stopped after %.1fs (%s)",
            child.name,
            child.pid,
            trio.current_time() - started,
            describe_exit(process.returncode),
        )
    with trio.move_on_after(5):
        await child.drained.wait()
    child.drain_scope.cancel()


async def stop_recorded(pid_file: Path, marker: bytes, timeout: float) -> None:
    """Stop the process ``pid_file`` names if its command line holds ``marker``.

    SIGTERM, up to ``timeout`` seconds, then SIGKILL; it is not our child, so
    it is watched in /proc until it has gone.
    """
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return
    if not any(marker == arg or arg.endswith(b"/" + marker) for arg in cmdline):
        return
    log.warning("stopping %s (pid %d) left running by an earlier daemon", cmdline[0], pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    with trio.move_on_after(timeout):
        while _alive(pid):
            await trio.sleep(0.1)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        await trio.sleep(0.1)


async def drain_output(
    child: Child,
    on_reload: Callable[[], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Read the child's output into the log until EOF.

    Shielded: cancellation of the supervisor must not stop the reading,
    or a ganesha logging its shutdown could block on a full pipe.
    """
    stream = child.process.stdout
    assert stream is not None
    with child.drain_scope:
        child.drain_scope.shield = True
        task_status.started()
        pending = b""
        try:
            while chunk := await stream.receive_some(65536):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    _log_line(child, line.decode(errors="replace"), on_reload)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if pending:
                _log_line(child, pending.decode(errors="replace"), on_reload)
            child.drained.set()
            await stream.aclose()


def _log_line(child: Child, line: str, on_reload: Callable[[], None]) -> None:
    line = line.rstrip()
    if not line:
        return
    child.tail.append(line)
    match = _LINE.search(line)
    if child.name != "ganesha.nfsd" or match is None:
        log.warning("%s[%d]: %s", child.name, child.pid, line)
        return
    component = match["component"].strip()
    message = match["message"]
    level = _LEVELS.get(match["level"], logging.DEBUG)
    if component in _EXPECTED_COMPONENTS or any(m in message for m in _EXPECTED_MESSAGES):
        level = logging.DEBUG
    log.log(
        level,
        "ganesha.nfsd[%d] %s %s: %s",
        child.pid,
        match["function"],
        component,
        message,
    )
    if _RELOAD_DONE in message or any(m in message for m in _RELOAD_FAILED):
        child.reloads_logged += 1
        child.last_reload_ok = _RELOAD_DONE in message
        on_reload()
