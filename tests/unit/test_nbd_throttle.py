"""nbd.throttle: the per-export token buckets, on trio's virtual clock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from nbd.throttle import BURST_SECONDS, Throttle


def run(fn: object) -> object:
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(fn, clock=clock)  # type: ignore[arg-type]


def test_iops_limit_spaces_requests_at_the_rate() -> None:
    async def main() -> float:
        t = Throttle(iops=100)
        start = trio.current_time()
        for _ in range(200):
            await t.admit(4096)
        return trio.current_time() - start

    elapsed = run(main)
    # 200 requests at 100/s: 2 s, less the burst the bucket starts with.
    assert 2.0 - BURST_SECONDS - 0.02 <= elapsed <= 2.0 + 0.02, elapsed  # type: ignore[operator]


def test_bandwidth_limit_counts_bytes_and_lets_big_requests_through() -> None:
    async def main() -> float:
        t = Throttle(bandwidth=1 << 20)
        start = trio.current_time()
        for _ in range(8):  # 8 x 1 MiB, each larger than the 100 ms bucket
            await t.admit(1 << 20)
        return trio.current_time() - start

    elapsed = run(main)
    # The first request goes at once (bucket not in debt); 7 more seconds of debt.
    assert 7.0 - BURST_SECONDS - 0.02 <= elapsed <= 7.0 + 0.02, elapsed  # type: ignore[operator]


def test_flush_costs_no_bandwidth() -> None:
    async def main() -> float:
        t = Throttle(bandwidth=1000)
        await t.admit(10_000)  # 10 s of debt
        start = trio.current_time()
        await t.admit(0)
        return trio.current_time() - start

    assert run(main) == 0


def test_no_limit_never_waits() -> None:
    async def main() -> float:
        t = Throttle()
        start = trio.current_time()
        for _ in range(10_000):
            await t.admit(1 << 20)
        return trio.current_time() - start

    assert run(main) == 0


def test_raising_the_limit_releases_a_waiting_request_at_once() -> None:
    async def main() -> tuple[float, float]:
        t = Throttle(iops=1)
        await t.admit(0)
        await t.admit(0)  # now a second in debt
        done_at = 0.0

        async def waiter() -> None:
            nonlocal done_at
            await t.admit(0)
            done_at = trio.current_time()

        start = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            await trio.sleep(0.05)
            t.configure(0, 0)  # limit removed while it waits
        return start, done_at

    start: float
    done_at: float
    start, done_at = run(main)  # type: ignore[misc]
    assert done_at - start <= 0.05 + 0.1 + 0.001, (start, done_at)


def test_negative_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        Throttle(iops=-1)
