"""The life of a FUSE mount process, shared by the block file and the NFS mount
(:func:`run_fuse_loop` is the NFS mount's pyfuse3 loop; the block file runs its own).

Readiness: the process writes one line, ``ready`` or ``error: <reason>``, to
a pipe (or stdout) once its mount is in place or has failed; the starter
reads that line with a deadline (EOF without a line: the process died).
``ready`` may carry facts the starter needs, ``name=number`` words after it
(the block file's ``minimum_block_size``, for its loop device).
Signals: SIGTERM/SIGINT unmount gracefully, a second one (or
:data:`ABANDON_AFTER` seconds without the requests under way finishing)
abandons them: a process told to stop ends within a bound, whatever its
server does (the block file's also covers its final flush:
``fuse.blockfile.stop_bound``).  One that arrives before the FUSE loop runs
is remembered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

import pyfuse3
import trio

from hostio import tools
from hostio.mountinfo import read_mountinfo, topmost

READY: Final = b"ready\n"
# Seconds the requests under way get after SIGTERM before they are abandoned.
ABANDON_AFTER: Final = 6.0
# pyfuse3's default bound on request tasks (requests handled at once).
MAX_TASKS: Final = 99

log = logging.getLogger("moorage.fuse")


class ReadySignal:
    """The mount process's side: answer once, then close the channel."""

    def __init__(self, ready_fd: int | None) -> None:
        self._fd = ready_fd
        self._out = ready_fd if ready_fd is not None else sys.stdout.fileno()
        self.answered = False

    def _answer(self, line: bytes) -> None:
        if self.answered:
            return
        self.answered = True
        with contextlib.suppress(OSError):  # nobody waits for it any more
            os.write(self._out, line)
        if self._fd is not None:
            os.close(self._fd)

    def ready(self, **facts: int) -> None:
        """Ready; ``facts`` go with it to the starter (:attr:`Answer.facts`)."""
        words = "".join(f" {name}={value}" for name, value in facts.items())
        self._answer(READY[:-1] + words.encode() + b"\n")

    def failed(self, reason: object) -> None:
        self._answer(f"error: {reason}\n".encode(errors="replace"))


def configure_logging(debug: bool, who: str = "") -> None:
    """Log lines to stderr; ``who`` (a worker process) is said in each."""
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format=f"%(asctime)s %(name)s {who + ' ' if who else ''}%(levelname)s %(message)s",
    )


def read_line(fd: int, timeout: float) -> bytes | None:
    """The starter's side: one line from ``fd`` within ``timeout`` seconds.

    Returns b'' (or a partial line) at EOF and None on timeout.
    """
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        end = time.monotonic() + timeout
        while not line.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return line
            line += chunk
    return line


class EarlyStop:
    """SIGTERM/SIGINT seen before the FUSE loop watched for them itself.

    Install with :meth:`install` while setting up; ``signal`` is then the name
    of the first such signal, or None.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, object] = {}

    def handle(self, signum: int, frame: object) -> None:
        self.signal = signal.Signals(signum).name

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self.handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


async def run_fuse_loop(
    ready: Callable[[], None] | None,
    early: EarlyStop,
    *,
    on_terminate: Callable[[], None] | None = None,
    after_unmount: Callable[[], Awaitable[None]] | None = None,
    abandon_after: float = ABANDON_AFTER,
    min_tasks: int = 1,
) -> None:
    """``pyfuse3.main()`` until the mount goes away, watching for stop signals.

    ``min_tasks``: request tasks kept waiting for the next request.  pyfuse3
    starts a task for each request that finds none waiting and ends those
    beyond this number once they are done; a mount that keeps many requests
    in flight saves that churn by keeping as many.
    """
    terminating = trio.Event()

    async def abandon_later() -> None:
        await trio.sleep(abandon_after)
        log.warning("requests still under way %.0fs after the signal: abandoned", abandon_after)
        nursery.cancel_scope.cancel()

    async def stop_on_signal(task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                if not terminating.is_set():
                    if on_terminate is not None:
                        on_terminate()
                    log.info("%s: unmounting", signal.Signals(signum).name)
                    terminating.set()
                    pyfuse3.terminate()  # graceful: requests under way are answered
                    nursery.start_soon(abandon_later)
                else:
                    log.warning("%s again: abandoning requests under way", signum)
                    nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        await nursery.start(stop_on_signal)
        if early.signal is not None:
            log.info("%s before the FUSE loop started: unmounting", early.signal)
            nursery.cancel_scope.cancel()
            return
        if ready is not None:
            ready()
        await pyfuse3.main(min_tasks=min_tasks, max_tasks=max(min_tasks, MAX_TASKS))
        if after_unmount is not None:
            await after_unmount()
        nursery.cancel_scope.cancel()  # unmounted from outside: stop watching signals


@dataclass(frozen=True)
class Answer:
    """What a mount process said: ``failure`` None once it is ready, with the
    ``facts`` its ready line carried; else why it is not, with its exit code."""

    failure: str | None
    facts: dict[str, int] = field(default_factory=dict)


_FACT: Final = re.compile(rb"([A-Za-z_][A-Za-z0-9_]*)=([0-9]+)")  # ASCII only


def _says_ready(line: bytes) -> bool:
    """Whether ``line`` is a ready line, readable or not."""
    return line.split()[:1] == [READY.strip()]


def _ready_facts(line: bytes) -> dict[str, int] | None:
    """The facts of a ready line (``ready name=number ...``); None if it is none or
    cannot be read."""
    if not line.endswith(b"\n") or not _says_ready(line):
        return None
    facts = {}
    for word in line.split()[1:]:
        fact = _FACT.fullmatch(word)
        if fact is None:
            return None
        facts[fact[1].decode()] = int(fact[2])
    return facts


def await_ready(
    proc: subprocess.Popen[bytes],
    read_end: int,
    timeout: float,
    after_failure: Callable[[], None],
    silent: Callable[[], str],
) -> Answer:
    """The starter's side: no failure once ``proc`` said ``ready`` on ``read_end``.

    Otherwise the process is reaped (terminated first if it did not answer, or
    said ready in a line that cannot be read: it is serving its mount; one that
    answered with an error is exiting by itself), ``after_failure``
    cleans up what it may have left (a mount), and the reason is the
    failure, with its exit code: its error line, ``silent()`` if it exited
    without one, or that it did not answer in time.
    """
    with os.fdopen(read_end, "rb") as pipe:
        # one line: "ready [facts]" or "error: <reason>"; EOF means it died
        answer = read_line(pipe.fileno(), timeout)
    facts = _ready_facts(answer) if answer is not None else None
    if facts is not None:
        return Answer(None, facts)
    if answer is None or _says_ready(answer):
        proc.terminate()
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    after_failure()
    if answer is None:
        reason = f"no answer in {timeout}s"
    else:
        reason = answer.decode(errors="replace").strip() or silent()
    return Answer(f"exited {code}: {reason}")


FUSECTL: Final = "/sys/fs/fuse/connections"


def raise_background_limit(mountpoint: str | os.PathLike[str], limit: int) -> bool:
    """Let the kernel keep up to ``limit`` asynchronous requests in flight on this mount.

    The kernel's default is 12 (``max_background``), fewer than a loop device
    or read-ahead issue at once, and pyfuse3 has no way to answer FUSE_INIT
    with another value.  The mount's directory in the fusectl filesystem
    takes it instead (see :func:`fusectl`).  Best effort: without the
    privilege the default stays, and this says so.
    """
    try:
        minor = _mount_device(mountpoint)[1]
        # congestion_threshold may not exceed max_background: raise that first.
        fusectl(minor, {"max_background": limit, "congestion_threshold": limit * 3 // 4})
    except (OSError, tools.ToolError) as e:
        log.warning("could not raise the FUSE background limit to %d: %s", limit, e)
        return False
    log.debug("FUSE background limit of %s raised to %d", mountpoint, limit)
    return True


# Reads (no value) or writes the named files of one connection's directory,
# on a fusectl mounted in this shell's own mount namespace.
_FUSECTL_SCRIPT = """
set -e
mount -t fusectl fusectl "$1"
dir="$1/$2"; shift 2
while [ $# -gt 0 ]; do
    if [ -n "$2" ]; then printf %s "$2" > "$dir/$1"; else cat "$dir/$1"; fi
    shift 2
done
"""


def fusectl(minor: int, values: dict[str, int | None]) -> list[str]:
    """Write (an int) or read (None) files of FUSE connection ``minor`` in fusectl.

    fusectl is one filesystem for the whole kernel.  Where the host mounts it
    (systemd does, at boot) it is used in place; otherwise it is mounted in a
    private mount namespace of a short-lived ``unshare``, so nothing is left
    mounted on the host, whatever happens to this process.  What was read, in
    order.
    """
    directory = os.path.join(FUSECTL, str(minor))
    if os.path.isdir(directory):
        out = []
        for name, value in values.items():
            path = os.path.join(directory, name)
            if value is None:
                with open(path) as f:
                    out.append(f.read().strip())
            else:
                with open(path, "w") as f:
                    f.write(str(value))
        return out
    args = [
        item
        for name, value in values.items()
        for item in (name, "" if value is None else str(value))
    ]
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _FUSECTL_SCRIPT]
    done = tools.run([*argv, "sh", FUSECTL, str(minor), *args], timeout=10)
    return done.stdout.split()


def set_read_ahead(mountpoint: str | os.PathLike[str], kib: int) -> bool:
    """Let the kernel read ``kib`` KiB ahead on this mount (its default: 128 KiB).

    Reads of a FUSE file are as large as the read-ahead window, so this also
    makes them fewer and larger.  It must be set once FUSE_INIT has been
    answered: the kernel then lowers the window to what the answer said
    (pyfuse3 answers 128 KiB).  Set through the mount's backing device in
    sysfs; best effort.
    """
    try:
        major, minor = _mount_device(mountpoint)
        with open(f"/sys/class/bdi/{major}:{minor}/read_ahead_kb", "w") as f:
            f.write(str(kib))
    except OSError as e:
        log.warning("could not set the read-ahead of %s to %d KiB: %s", mountpoint, kib, e)
        return False
    log.debug("read-ahead of %s set to %d KiB", mountpoint, kib)
    return True


def _mount_device(mountpoint: str | os.PathLike[str]) -> tuple[int, int]:
    """Major and minor device numbers of the newest mount on ``mountpoint``.

    Read from /proc/self/mountinfo, not with os.stat: that would ask this very
    process, whose FUSE loop is not running yet (and so would resolving the
    mount point itself: only its parent is resolved).
    """
    path = os.path.abspath(mountpoint)
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    entry = topmost(read_mountinfo(), path)
    if entry is None:
        raise FileNotFoundError(f"{path} is not in /proc/self/mountinfo")
    return entry.major, entry.minor
