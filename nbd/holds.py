"""Holds: the I/O of some images stopped at one barrier, for a point-in-time copy.

A hold names image paths.  While it lasts, every connection serving an
export of one of them reads no new request (reads stop too: a request is
only known to be a write once read, and a block device's freeze holds both).
A hold is *reached* once each such connection is quiet: its reader waits
at the hold or for a request, and nothing it read is still being served (a
write in a worker thread or in the reply thread included).  What was
written before is then in the image, in the page cache at least; the
holder flushes and copies the images, then releases the hold.

Every wait is bounded.  Reaching a hold waits at most the caller's timeout
(a connection whose client stalls in the middle of a request never gets
quiet; the hold then fails, and the caller releases it).  A hold ends on
release or when its lease runs out, whichever comes first, so a holder that
dies (or a release lost with a worker's control channel) stops the
images' I/O for at most the lease.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio

log = logging.getLogger("moorage.nbd")

# How often reaching a hold looks at its connections again: writes in the
# reply thread end without telling the event loop.
POLL_INTERVAL = 0.002


class HoldNotReached(Exception):
    """A hold's connections did not all get quiet within the timeout."""


class Quiescent(Protocol):
    """A connection as a hold sees it (``nbd.transmission.Transmission``)."""

    @property
    def image_path(self) -> Path: ...

    def quiet(self) -> bool: ...


@dataclass
class Hold:
    hold_id: str
    paths: frozenset[Path]
    deadline: float  # trio's clock: the lease's end
    released: trio.Event = field(default_factory=trio.Event)


class Holds:
    """The holds of one serving process, by id."""

    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}

    def __bool__(self) -> bool:
        return bool(self._holds)

    def place(self, hold_id: str, paths: Iterable[Path], lease: float) -> Hold:
        """Hold the I/O of ``paths`` from now on, for ``lease`` seconds at most."""
        if lease <= 0:
            raise ValueError("a hold's lease must be positive")
        old = self._holds.pop(hold_id, None)
        if old is not None:
            old.released.set()
        hold = Hold(hold_id, frozenset(Path(p) for p in paths), trio.current_time() + lease)
        self._holds[hold_id] = hold
        log.info("I/O held on %d images (hold %s, lease %.0fs)", len(hold.paths), hold_id, lease)
        return hold

    def release(self, hold_id: str) -> bool:
        """End a hold; False if there was none by that id (released, or expired)."""
        hold = self._holds.pop(hold_id, None)
        if hold is None:
            return False
        hold.released.set()
        log.info("I/O released (hold %s)", hold_id)
        return True

    def names(self, path: Path) -> bool:
        """Whether a hold names ``path``, leases aside: safe from any thread
        (a run of requests served in a thread asks it between requests)."""
        return any(path in hold.paths for hold in list(self._holds.values()))

    def holding(self, path: Path) -> Hold | None:
        """The hold in force on ``path``, if any; holds past their lease end here."""
        now = trio.current_time()
        for hold in list(self._holds.values()):
            if hold.deadline <= now:
                log.warning("hold %s ran out of its lease unreleased; I/O resumes", hold.hold_id)
                self.release(hold.hold_id)
            elif path in hold.paths:
                return hold
        return None

    async def wait_released(self, path: Path) -> None:
        """Return once no hold is in force on ``path`` (bounded by the leases)."""
        while (hold := self.holding(path)) is not None:
            with trio.move_on_at(hold.deadline):
                await hold.released.wait()

    async def reach(self, hold: Hold, connections: Iterable[Quiescent], timeout: float) -> None:
        """Wait until every connection on the hold's images is quiet (``connections``
        is looked at again and again: a live set); HoldNotReached after ``timeout``
        seconds (the hold stays placed: the caller releases it), or at once when the
        hold is released (or replaced) meanwhile: nobody waits for it any more."""
        busy: list[Quiescent] = []
        with trio.move_on_after(timeout):
            while True:
                if hold.released.is_set():
                    raise HoldNotReached(f"hold {hold.hold_id} was released before it was reached")
                busy = [
                    c for c in list(connections) if c.image_path in hold.paths and not c.quiet()
                ]
                if not busy:
                    return
                await trio.sleep(POLL_INTERVAL)
        raise HoldNotReached(
            f"{len(busy)} connections still busy {timeout:g}s after the hold (a client stalled "
            "in the middle of a request?)"
        )
