"""When a slow inline write sends the next second's writes to threads (nbd.image).

An inline write runs on the event loop; one that kept the loop's thread
sleeping in the kernel (dirty-page throttling, a journal commit) pauses inline
writes for ``INLINE_WRITE_BACKOFF``.  One that took as long only because the
thread waited for a CPU (a busy machine: other servers, the client, the
connection's other process) must not: threads would not make it faster, and
on the batch path every write of the next second would pay a thread hop.

The scheduler's figures and the clock are simulated around a real write to a
real file; the last test reads the real ``/proc/thread-self/schedstat``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import nbd.image
from nbd.image import SLOW_INLINE_WRITE, Image, ThreadClock

STALL = 10 * SLOW_INLINE_WRITE


class FakeTime:
    """``time`` for nbd.image: the clock moves only when a write stalls."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def image(tmp_path: Path) -> Image:
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(1 << 20))
    img = Image(path, read_only=False)
    img._nowait_writes = False  # the timed path, whatever this filesystem supports
    return img


def stall_writes(
    monkeypatch: pytest.MonkeyPatch, image: Image, clock: FakeTime, on_cpu: bool
) -> None:
    """Each write takes ``STALL``: spent running or waiting for a CPU, or asleep."""
    busy = [0]
    monkeypatch.setattr(image._clock, "_busy_ns", lambda: busy[0])
    real_pwrite = os.pwrite

    def slow_pwrite(fd: int, data: memoryview, offset: int) -> int:
        n = real_pwrite(fd, data, offset)
        clock.now += STALL
        if on_cpu:
            busy[0] += int(STALL * 1e9)
        return n

    monkeypatch.setattr(os, "pwrite", slow_pwrite)


def test_slow_write_that_waited_for_a_cpu_keeps_writes_inline(
    image: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeTime()
    monkeypatch.setattr(nbd.image, "time", clock)
    stall_writes(monkeypatch, image, clock, on_cpu=True)
    for i in range(3):
        image.begin_inline()
        assert image.write_inline(memoryview(b"x" * 4096), i * 4096)
        assert image.may_write_inline()
    with open(image.path, "rb") as f:
        assert f.read(3 * 4096) == b"x" * (3 * 4096)
    image.close()


def test_slow_write_that_slept_sends_writes_to_threads_for_a_while(
    image: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeTime()
    monkeypatch.setattr(nbd.image, "time", clock)
    stall_writes(monkeypatch, image, clock, on_cpu=False)
    image.begin_inline()
    assert image.write_inline(memoryview(b"y" * 4096), 0)  # made, then the pause starts
    assert not image.may_write_inline()
    image.begin_inline()
    assert not image.write_inline(memoryview(b"z" * 4096), 4096)  # left to a thread
    clock.now += nbd.image.INLINE_WRITE_BACKOFF
    assert image.may_write_inline()
    with open(image.path, "rb") as f:
        assert f.read(8192) == b"y" * 4096 + bytes(4096)
    image.close()


def _judged(work: str, seconds: float, trials: int) -> list[float]:
    """``ThreadClock.slept()`` around ``trials`` runs of ``work`` (sleep or spin on
    a CPU for ``seconds``), in a fresh thread, against the real scheduler figures."""
    got: list[float] = []

    def measure() -> None:
        clock = ThreadClock()
        for _ in range(trials):
            clock.mark()
            if work == "sleep":
                time.sleep(seconds)
            else:
                end = time.thread_time() + seconds
                while time.thread_time() < end:  # on a CPU, however long that takes
                    pass
            got.append(clock.slept())
        clock.close()

    t = threading.Thread(target=measure)
    t.start()
    t.join()
    return got


def test_sleep_since_mark_excludes_time_on_a_cpu_or_waiting_for_one() -> None:
    """At the scale of the threshold: a write that slept a little over
    SLOW_INLINE_WRITE is judged slow, one that ran as long on a CPU is not.

    With schedstat's run time (brought up to date only at a tick or a
    switch) a 3 ms spin was judged as up to 2 ms asleep and a 2.5 ms sleep
    as 1.3 ms.  The median of several trials, so one unlucky preemption of
    the measuring code itself does not decide.
    """
    if not os.path.exists("/proc/thread-self/schedstat"):
        # the fallback: without the scheduler's figures, all of the wall time
        asleep = _judged("sleep", 1.5 * SLOW_INLINE_WRITE, 5)
        assert min(asleep) >= 1.5 * SLOW_INLINE_WRITE
        return
    asleep = sorted(_judged("sleep", 1.25 * SLOW_INLINE_WRITE, 15))
    spinning = sorted(_judged("spin", 1.5 * SLOW_INLINE_WRITE, 15))
    assert asleep[len(asleep) // 2] > SLOW_INLINE_WRITE, asleep
    assert spinning[len(spinning) // 2] < SLOW_INLINE_WRITE / 4, spinning
