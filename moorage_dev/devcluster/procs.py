"""The cluster's daemons: started detached in a network namespace, found again by pid file.

Each daemon is started through ``nsenter --net`` (only the network namespace
changes: the first node's mounts must land in the host's mount table; a
second node's kubelet also enters a mount namespace of its own, where its
/var/lib/kubelet is its own), in a
session of its own so it outlives ``moorage dev cluster up``, with its
output in ``logs/NAME.log`` and its pid in ``pids/NAME.pid``.  The pid file
also holds the process's start time, so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hostio.atomicfile import write_atomically
from hostio.tools import ToolError
from moorage_dev.devcluster.layout import Layout


class ClusterError(RuntimeError):
    """Something of the cluster did not come up; the message says what and where to look."""


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: fields follow the last ")"
    return stat.rsplit(")", 1)[1].split()[19]


def start(
    layout: Layout,
    name: str,
    argv: Sequence[str],
    *,
    netns: str,
    mountns: Path | None = None,
    inside: int | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Start ``argv`` in ``netns``; returns its pid (already running ones are left alone).

    ``inside``: the pid of a node's process 1 (moorage_dev.devcluster.nodeinit),
    whose mount and PID namespaces the daemon joins; nsenter then forks it,
    and the daemon's own pid is the one recorded.
    """
    if running(layout, name):
        return pid_of(layout, name) or 0
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.pids.mkdir(parents=True, exist_ok=True)
    log = (layout.logs / f"{name}.log").open("ab")
    enter = [f"--mount={mountns}"] if mountns else []
    if inside is not None:
        enter = [f"--target={inside}", "--mount", "--pid"]
    try:
        process = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{netns}", *enter, "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    finally:
        log.close()
    # nsenter execs the daemon, unless it enters a PID namespace: then it forks
    # the daemon and waits for it
    pid = process.pid if inside is None else forked_child(process.pid, name)
    deadline = time.monotonic() + 5
    started = _start_time(pid)
    while started is None and time.monotonic() < deadline:
        time.sleep(0.01)
        started = _start_time(pid)
    write_atomically(layout.pids / f"{name}.pid", f"{pid} {started}\n", mode=0o644)
    return pid


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (as this process's PID namespace numbers them)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def forked_child(pid: int, what: str, timeout: float = 10) -> int:
    """The one child ``pid`` forks (nsenter's or unshare's), once it has."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = children(pid)
        if found:
            return found[0]
        if _start_time(pid) is None:
            break
        time.sleep(0.01)
    raise ClusterError(f"{what}: no process forked by {pid} after {timeout:.0f} s")


def pid_of(layout: Layout, name: str) -> int | None:
    """The daemon's pid if it is still the process that was started."""
    try:
        pid_text, started = (layout.pids / f"{name}.pid").read_text().split()
    except (OSError, ValueError):
        return None
    pid = int(pid_text)
    return pid if _start_time(pid) == started else None


def running(layout: Layout, name: str) -> bool:
    pid = pid_of(layout, name)
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop(layout: Layout, name: str, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; forgets the pid file."""
    pid = pid_of(layout, name)
    if pid is not None:
        _signal_and_wait(pid, timeout)
    (layout.pids / f"{name}.pid").unlink(missing_ok=True)


def _signal_and_wait(pid: int, timeout: float) -> None:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                # our child only while `up` runs; afterwards a stranger: poll /proc
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    return
            except ChildProcessError:
                pass
            if _start_time(pid) is None:
                return
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                return
            time.sleep(0.1)


def known(layout: Layout) -> list[str]:
    """Names of the daemons with a pid file."""
    if not layout.pids.is_dir():
        return []
    return sorted(p.stem for p in layout.pids.glob("*.pid"))


def wait_for(
    what: str,
    check: Callable[[], bool],
    *,
    timeout: float,
    log: Path | None = None,
    alive: Callable[[], bool] | None = None,
) -> None:
    """Poll ``check`` until true; a dead daemon or the timeout is a ClusterError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (OSError, subprocess.SubprocessError, ToolError):
            pass
        if alive is not None and not alive():
            raise ClusterError(f"{what}: the process exited{_tail(log)}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: not ready after {timeout:.0f} s{_tail(log)}")
        time.sleep(0.25)


def _tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.exists():
        return ""
    text = log.read_text(errors="replace").splitlines()[-lines:]
    return f" ({log}):\n" + "\n".join(text)
