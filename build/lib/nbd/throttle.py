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
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

BURST_SECONDS = 0.1  # how much of a second's allowance may be spent at once
RECHECK = 0.1


@dataclass
class _Bucket:
    rate: float = 0.0  # tokens per second; 0: unlimited
    tokens: float = 0.0
    stamp: float = 0.0

    def configure(self, rate: float, now: float) -> None:
        self.refill(now)
        self.rate = rate
        self.tokens = min(self.tokens, self.capacity) if rate else 0.0

    @property
    def capacity(self) -> float:
        return max(self.rate * BURST_SECONDS, 1.0)

    def refill(self, now: float) -> None:
        if self.rate:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self) -> float:
        """Seconds until the bucket is out of debt (0: now)."""
        if not self.rate:
            return 0.0
        wait = -self.tokens / self.rate
        # Under a microsecond is rounding in the refill arithmetic, not debt.
        return wait if wait > 1e-6 else 0.0


class Throttle:
    """The IOPS and bandwidth limits of one export."""

    def __init__(self, iops: int = 0, bandwidth: int = 0) -> None:
        self._ops = _Bucket()
        self._bytes = _Bucket()
        self.iops = 0
        self.bandwidth = 0
        self.configure(iops, bandwidth)

    @staticmethod
    def _now() -> float:
        try:
            return trio.current_time()
        except RuntimeError:  # configured outside trio (before the server starts)
            return 0.0

    def configure(self, iops: int, bandwidth: int) -> None:
        if iops < 0 or bandwidth < 0:
            raise ValueError("I/O limits cannot be negative")
        now = self._now()
        self.iops, self.bandwidth = iops, bandwidth
        self._ops.configure(float(iops), now)
        self._bytes.configure(float(bandwidth), now)

    @property
    def unlimited(self) -> bool:
        return not self.iops and not self.bandwidth

    async def admit(self, nbytes: int) -> None:
        """Wait until one request of ``nbytes`` (0 for FLUSH and the like) may run."""
        if self.unlimited:
            return
        while True:
            now = trio.current_time()
            self._ops.refill(now)
            self._bytes.refill(now)
            delay = max(self._ops.wait_for(), self._bytes.wait_for() if nbytes else 0.0)
            if delay <= 0:
                break
            await trio.sleep(min(delay, RECHECK))
        if self._ops.rate:
            self._ops.tokens -= 1
        if self._bytes.rate:
            self._bytes.tokens -= nbytes
