"""Named crash points, for the crash-safety tests.

With ``MOORAGE_FAILPOINTS=name[,name...]`` in its environment the daemon
kills itself with SIGKILL when it reaches one of those points: the same as a
crash or an OOM kill right there.  Unset (always, in production) a point
costs one set lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("moorage.backend")

_ARMED = frozenset(p for p in os.environ.get("MOORAGE_FAILPOINTS", "").split(",") if p)


def failpoint(name: str) -> None:
    if name in _ARMED:
        log.critical("failpoint %s reached: killing the daemon", name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
