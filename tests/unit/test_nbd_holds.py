"""nbd.holds: placing, replacing, releasing and expiring holds, and reaching them.

Connections are stand-ins with a path and a quiet flag; the clock is trio's
mock clock, which jumps ahead whenever every task waits, so leases and
timeouts run out without the test waiting for them.  Holds on real NBD
connections are in tests/integration/test_nbd_holds.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing

from nbd.holds import HoldNotReached, Holds

A, B = Path("/pool/a.img"), Path("/pool/b.img")


@dataclass
class Conn:
    image_path: Path
    is_quiet: bool = False

    def quiet(self) -> bool:
        return self.is_quiet


async def test_a_hold_covers_its_paths_until_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    holds = Holds()
    hold = holds.place("h", [A], lease=60)
    assert holds and holds.holding(A) is hold and holds.holding(B) is None
    assert holds.release("h") and hold.released.is_set()
    assert not holds and holds.holding(A) is None
    assert not holds.release("h")  # once only


async def test_placing_an_id_again_replaces_the_hold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    holds = Holds()
    old = holds.place("h", [A], lease=60)
    new = holds.place("h", [B], lease=60)
    assert old.released.is_set() and not new.released.is_set()
    assert holds.holding(A) is None and holds.holding(B) is new


async def test_a_hold_ends_with_its_lease(autojump_clock: trio.testing.MockClock) -> None:
    holds = Holds()
    hold = holds.place("h", [A], lease=60)
    start = trio.current_time()
    await holds.wait_released(A)  # nobody releases it
    assert trio.current_time() - start == pytest.approx(60)
    assert hold.released.is_set() and not holds


async def test_reaching_waits_for_every_connection_on_the_paths(
    autojump_clock: trio.testing.MockClock,
) -> None:
    holds = Holds()
    hold = holds.place("h", [A], lease=60)
    on_a, on_b = Conn(A), Conn(B)  # B's connection is never quiet, and not held
    async with trio.open_nursery() as nursery:
        nursery.start_soon(holds.reach, hold, [on_a, on_b], 10.0)
        await trio.sleep(1)
        assert nursery.child_tasks  # still waiting for on_a
        on_a.is_quiet = True
    with pytest.raises(HoldNotReached, match="1 connections still busy"):
        await holds.reach(hold, [Conn(A)], 10.0)


async def test_reaching_stops_once_the_hold_is_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The listener gave up and released: the worker stops looking at its
    connections then, not when its own timeout runs out."""
    holds = Holds()
    hold = holds.place("h", [A], lease=60)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def release_later() -> None:
            await trio.sleep(1)
            holds.release("h")

        nursery.start_soon(release_later)
        with pytest.raises(HoldNotReached, match="released before it was reached"):
            await holds.reach(hold, [Conn(A)], 10.0)
    assert trio.current_time() - start < 10
