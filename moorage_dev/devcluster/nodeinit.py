"""Process 1 of a dev-cluster node's PID namespace: waits, and reaps what ends.

A real node's process 1 is its init, and Kubernetes' tools rely on it: the
storage suite's host-exec pods enter the node's mount namespace through
``/proc/1/ns/mnt`` of the node's root.  This machine's own process 1 refuses
that even to root, so each dev node gets a PID namespace (and a mount
namespace with its own /proc) whose process 1 is this: it holds the
namespaces, adopts the orphans of the node's daemons and reaps them.  When it
dies the kernel ends every process of the node.

A new mount namespace starts as a copy of the one it came from, mounts other
programs had there included: a test's pool mounted under /tmp would then
stay mounted in the node's copy and keep its loop device busy.  So first the
copies of what lies under :data:`FOREIGN` are made private (an unmount must
not reach the host through a shared peer) and detached: ``--drop-mounts``,
run in the node's namespace before process 1 takes over (and in a later
node's pinned mount namespace).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from hostio import tools as hosttools
from hostio.mountinfo import read_mountinfo

# where other programs (tests, the kernel lane) mount their own things
FOREIGN = ("/tmp",)
MOUNT_TIMEOUT = 30.0


def _mount_points() -> list[str]:
    return [e.mount_point for e in read_mountinfo()]


def drop_foreign_mounts(prefixes: tuple[str, ...] = FOREIGN) -> list[str]:
    """Detach this mount namespace's mounts under ``prefixes``; the ones dropped."""
    points = [p for p in _mount_points() if any(p == x or p.startswith(x + "/") for x in prefixes)]
    for point in points:
        with contextlib.suppress(hosttools.ToolError):
            hosttools.run(["mount", "--make-private", point], timeout=MOUNT_TIMEOUT)
    dropped = []
    for point in sorted(set(points), key=lambda p: -p.count("/")):
        try:
            hosttools.run(["umount", "-l", point], timeout=MOUNT_TIMEOUT)
        except hosttools.ToolError:
            continue
        dropped.append(point)
    return dropped


def main(argv: list[str]) -> None:
    if argv == ["--drop-mounts"]:
        drop_foreign_mounts()
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT})
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        got = signal.sigtimedwait({signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}, 5.0)
        if got is not None and got.si_signo != signal.SIGCHLD:
            return


if __name__ == "__main__":
    main(sys.argv[1:])
