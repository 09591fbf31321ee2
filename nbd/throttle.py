"""Per-export I/O limits: a token bucket for requests and one for bytes.

Every connection of an export takes from the same two buckets before a
request is served, so the limits hold for the export as a whole however
many connections a client opens.  A limit of 0 is none.

The reader of a connection waits in :meth:`Throttle.admit`, so a throttled
client simply sees its requests answered more slowly, and stops being read
(TCP back-pressure) once it has its in-flight requests outstanding.  The
limits may change at any time (``configure``): a waiting reader re-reads
them at least every ``RECHECK`` seconds, so a raised or removed limit takes
effect on open connections at once.

A request larger than the bucket is let through when the bucket is not in
debt, and leaves it in debt: the long-run rate is exact whatever the
request sizes, and no request waits forever.

The buckets' state is six numbers (``CELLS``).  They live in the process's
own memory, or, when the connections of one export are served by several
worker processes (``nbd.workers``), in memory those processes share: then
every process takes from the same buckets, under a lock between processes,
and reads the time from the system-wide monotonic clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import trio

BURST_SECONDS = 0.1  # how much of a second's allowance may be spent at once
RECHECK = 0.1
# rate, tokens, stamp of the request bucket, then of the byte bucket (doubles)
CELLS = 6
CELLS_BYTES = CELLS * 8


class _Bucket:
    """One bucket's (rate, tokens, stamp), stored from ``base`` in ``cells``."""

    __slots__ = ("_b", "_c")

    def __init__(self, cells: memoryview[float], base: int) -> None:
        self._c = cells
        self._b = base

    @property
    def rate(self) -> float:  # tokens per second; 0: unlimited
        return float(self._c[self._b])

    @property
    def tokens(self) -> float:
        return float(self._c[self._b + 1])

    @tokens.setter
    def tokens(self, value: float) -> None:
        self._c[self._b + 1] = value

    def configure(self, rate: float, now: float) -> None:
        self.refill(now)
        self._c[self._b] = rate
        self.tokens = min(self.tokens, self.capacity) if rate else 0.0

    @property
    def capacity(self) -> float:
        return max(self.rate * BURST_SECONDS, 1.0)

    def refill(self, now: float) -> None:
        c, b = self._c, self._b
        rate = c[b]
        if rate:
            c[b + 1] = min(max(rate * BURST_SECONDS, 1.0), c[b + 1] + max(now - c[b + 2], 0) * rate)
        c[b + 2] = now

    def wait_for(self) -> float:
        """Seconds until the bucket is out of debt (0: now)."""
        rate = self.rate
        if not rate:
            return 0.0
        wait = -self.tokens / rate
        # Under a microsecond is rounding in the refill arithmetic, not debt.
        return wait if wait > 1e-6 else 0.0


def _trio_now() -> float:
    try:
        return trio.current_time()
    except RuntimeError:  # configured outside trio (before the server starts)
        return 0.0


class Throttle:
    """The IOPS and bandwidth limits of one export.

    ``cells`` (a memoryview of ``CELLS`` doubles), ``lock`` and ``clock`` are
    given for buckets shared between processes (``nbd.shared``); by default
    the buckets are this process's own, timed by trio's clock.
    """

    def __init__(
        self,
        iops: int = 0,
        bandwidth: int = 0,
        *,
        cells: memoryview[float] | None = None,
        lock: AbstractContextManager[object] | None = None,
        clock: Callable[[], float] | None = None,
        configure: bool = True,
    ) -> None:
        if cells is None:
            cells = memoryview(bytearray(CELLS_BYTES)).cast("d")
        if len(cells) != CELLS:
            raise ValueError(f"a throttle needs {CELLS} cells")
        self._cells = cells
        self._ops = _Bucket(cells, 0)
        self._bytes = _Bucket(cells, 3)
        self._lock: AbstractContextManager[object] = lock or contextlib.nullcontext()
        self._now = clock or _trio_now
        # Read for every request: a plain attribute, kept by configure() and
        # reload() (a worker's, when the listener changed the shared limits).
        self.unlimited = not cells[0] and not cells[3]
        if configure:
            self.configure(iops, bandwidth)

    @property
    def iops(self) -> int:
        return int(self._cells[0])

    @property
    def bandwidth(self) -> int:
        return int(self._cells[3])

    def configure(self, iops: int, bandwidth: int) -> None:
        if iops < 0 or bandwidth < 0:
            raise ValueError("I/O limits cannot be negative")
        with self._lock:
            now = self._now()
            self._ops.configure(float(iops), now)
            self._bytes.configure(float(bandwidth), now)
        self.reload()

    def reload(self) -> None:
        """Take up limits another process set in shared cells."""
        self.unlimited = not self._cells[0] and not self._cells[3]

    async def admit(self, nbytes: int) -> None:
        """Wait until one request of ``nbytes`` (0 for FLUSH and the like) may run."""
        if self.unlimited:
            return
        ops, byt = self._ops, self._bytes
        while True:
            if not ops.rate and not byt.rate:  # removed meanwhile (by another process)
                return
            with self._lock:
                now = self._now()
                ops.refill(now)
                byt.refill(now)
                delay = max(ops.wait_for(), byt.wait_for() if nbytes else 0.0)
                if delay <= 0:
                    if ops.rate:
                        ops.tokens -= 1
                    if byt.rate:
                        byt.tokens -= nbytes
                    return
            await trio.sleep(min(delay, RECHECK))
