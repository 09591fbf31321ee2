"""Process 1 of a dev-cluster node's PID namespace: waits, and reaps what ends.

A real node's process 1 is its init, and Kubernetes' tools rely on it: the
storage suite's host-exec pods enter the node's mount namespace through
``/proc/1/ns/mnt`` of the node's root.  This machine's own process 1 refuses
that even to root, so each dev node gets a PID namespace (and a mount
namespace with its own /proc) whose process 1 is this: it holds the
namespaces, adopts the orphans of the node's daemons and reaps them.  When it
dies the kernel ends every process of the node.
"""

from __future__ import annotations

import os
import signal


def main() -> None:
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
    main()
