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


def test_sleep_since_mark_excludes_time_on_a_cpu_or_waiting_for_one() -> None:
    """Against the real scheduler figures of this thread (a fresh one)."""
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no /proc/thread-self/schedstat (kernel without sched_info)")
    got: dict[str, float] = {}

    def measure() -> None:
        clock = ThreadClock()
        clock.mark()
        time.sleep(0.05)
        got["asleep"] = clock.slept()
        clock.mark()
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # 50 ms on a CPU, however long that takes
            pass
        got["spinning"] = clock.slept()
        clock.close()

    t = threading.Thread(target=measure)
    t.start()
    t.join()
    assert got["asleep"] >= 0.04
    # Spinning never sleeps; what is left is the gap between the two clocks
    # and the few moments the loop's own system calls block.
    assert got["spinning"] < 0.025
