"""Blocking I/O on the file (or block device) behind an export.

Everything here is a plain system call; the transmission phase decides which
calls run inline on the event loop (the ``*_nowait`` ones, which never block)
and which go to a worker thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time
from pathlib import Path

from hostio.extents import data_extents
from nbd.iov import consume

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int

_ZERO_CHUNK = bytes(1 << 20)
# An inline write that kept the event loop waiting this long pauses inline
# writes for the backoff.  Only waiting in the kernel counts (see
# ``ThreadClock``): time the loop's thread spent waiting for a CPU is not the
# disk's doing, and threads would not make it shorter.
SLOW_INLINE_WRITE = 0.002
# The same for a write made by a connection's reply thread.  Its time also
# holds the wait for the GIL after the system call, up to Python's switch
# interval (5 ms), so only a longer one means the kernel made it wait.
SLOW_THREAD_WRITE = 0.010
INLINE_WRITE_BACKOFF = 1.0
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class ThreadClock:
    """How long the calling thread slept in the kernel since ``mark()``.

    Sleeping is what is left of the wall time once the time the thread ran on
    a CPU (``CLOCK_THREAD_CPUTIME_ID``) and the time it waited in a run queue
    for one (``run_delay``, the second field of
    ``/proc/thread-self/schedstat``) are taken out.  On a busy machine a
    thread is often made to wait for a CPU in the middle of a system call;
    that wait says nothing about the disk.  The run time is not taken from
    schedstat's first field: for the running thread the kernel brings that one
    up to date only at a tick or a switch, up to 4 ms late, as long as the
    2 ms being judged; the thread CPU clock is exact, and ``run_delay`` is
    complete whenever the thread is running.  Where the file cannot be read,
    every moment off a CPU counts as sleeping (the wall time).

    Bound to the thread that first uses it (the event loop's).
    """

    _UNREADABLE = -2

    def __init__(self) -> None:
        self._fd = -1  # opened on first use, by the thread it measures
        self._wall = 0.0
        self._busy = 0  # ns on a CPU or waiting for one, at the mark

    def _busy_ns(self) -> int:
        if self._fd == -1:
            try:
                self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = self._UNREADABLE
        if self._fd < 0:
            return 0
        try:
            _, wait, _ = os.pread(self._fd, 128, 0).split()
            return time.thread_time_ns() + int(wait)
        except (OSError, ValueError):
            os.close(self._fd)
            self._fd = self._UNREADABLE
            return 0

    def mark(self) -> None:
        self._wall = time.monotonic()
        self._busy = self._busy_ns()

    def slept(self) -> float:
        """Seconds spent sleeping since the mark."""
        wall = time.monotonic() - self._wall
        if self._fd == self._UNREADABLE:
            return wall
        return wall - (self._busy_ns() - self._busy) / 1e9

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1


class Image:
    """An open image: size, reads, writes, holes and durability."""

    def __init__(self, path: Path, read_only: bool) -> None:
        flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC
        self.path = path
        self.read_only = read_only
        self.fd = os.open(path, flags)
        try:
            self.size = os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            os.close(self.fd)
            raise
        self._nowait_reads = bool(_RWF_NOWAIT)
        self._nowait_writes = bool(_RWF_NOWAIT)
        self._blocking_writes_after = 0.0
        self._clock = ThreadClock()
        self._marked = False
        self.can_punch = True
        self.can_zero_range = True

    def grown_size(self) -> int:
        """The image's size now, when it grew since it was opened (an expanded
        volume): a client told of the growth some other way (the kernel nbd
        driver is resized over netlink, its connection kept) may use it.  The
        size is never lowered: a volume never shrinks under its clients."""
        self.size = max(self.size, os.lseek(self.fd, 0, os.SEEK_END))
        return self.size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._clock.close()

    # -- reads

    def read_nowait(self, buf: memoryview, offset: int) -> int:
        """Read from the page cache without blocking; bytes read (0: go to a thread)."""
        if not self._nowait_reads:
            return 0
        try:
            return os.preadv(self.fd, [buf], offset, _RWF_NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait_reads = False
                return 0
            raise

    def read_into(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], offset + done)
            if n == 0:
                # The image shrank under us: what is past its end reads as zeroes.
                buf[done:] = bytes(len(buf) - done)
                return
            done += n

    def splice_to(self, pipe: int, offset: int, length: int) -> int:
        """Move up to ``length`` bytes at ``offset`` into ``pipe`` (page references, no
        copy); how many moved, 0 at the end of the file. ``BlockingIOError``: the pipe
        is full."""
        return os.splice(self.fd, pipe, length, offset_src=offset)

    # -- writes

    def write_nowait(self, data: memoryview, offset: int) -> int:
        """Write into the page cache without blocking; bytes written (may be short)."""
        if not self._nowait_writes:
            return 0
        try:
            return os.pwritev(self.fd, [data], offset, _RWF_NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait_writes = False
                return 0
            raise

    def begin_inline(self) -> None:
        """A run of inline writes starts: the loop waits for nothing else until it ends.

        ``write_inline`` measures how long the loop slept in the kernel from
        just before the run's first write (one look at the scheduler's
        figures per run, not per write).
        """
        self._marked = False

    def write_inline(self, data: memoryview, offset: int) -> bool:
        """Write into the page cache from the event loop; False: use a thread.

        With RWF_NOWAIT the kernel says when a write would block.  Where the
        filesystem does not support it for buffered writes (ext4), a plain
        write is made and timed: if it took long and the loop's thread slept
        for that long in the kernel since ``begin_inline`` (the kernel
        throttling dirty pages, a journal commit), the writes of the next
        second go to threads, so one busy disk cannot stall every other
        connection for long.  A write that took long only because the thread
        waited for a CPU keeps writes inline.
        """
        if self._nowait_writes:
            n = self.write_nowait(data, offset)
            if n == len(data):
                return True
            if self._nowait_writes or n:
                return False  # would block (or wrote part): a thread finishes it
        if not self.may_write_inline():
            return False
        if not self._marked:
            self._clock.mark()
            self._marked = True
        start = time.monotonic()
        fd = self.fd
        done = os.pwrite(fd, data, offset)
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
        if time.monotonic() - start > SLOW_INLINE_WRITE:
            if self._clock.slept() > SLOW_INLINE_WRITE:
                self._blocking_writes_after = time.monotonic() + INLINE_WRITE_BACKOFF
            self._marked = False  # measure the next write from its own start
        return True

    def may_write_inline(self) -> bool:
        """False for a while after a write into the page cache was slow."""
        return time.monotonic() >= self._blocking_writes_after

    def writev_timed(self, views: list[memoryview], offset: int) -> None:
        """Adjacent buffers in one system call, timed: a slow write pauses inline writes.

        For a connection's reply thread, whose time also holds the wait for
        the GIL (``SLOW_THREAD_WRITE``).
        """
        now = time.monotonic()
        views = list(views)
        while views:
            done = os.pwritev(self.fd, views, offset)
            offset += done
            consume(views, done)
        if time.monotonic() - now > SLOW_THREAD_WRITE:
            self._blocking_writes_after = time.monotonic() + INLINE_WRITE_BACKOFF

    def write(self, data: memoryview, offset: int, fua: bool = False) -> None:
        done = 0
        while done < len(data):
            done += os.pwritev(self.fd, [data[done:]], offset + done)
        if fua:
            os.fdatasync(self.fd)

    def flush(self) -> None:
        os.fdatasync(self.fd)

    # -- holes and zeroes

    def punch_hole(self, offset: int, length: int) -> None:
        fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)

    def zero(self, offset: int, length: int, may_trim: bool, fast: bool) -> bool:
        """Make the range read as zeroes.  False if ``fast`` and that is not possible."""
        if may_trim and self.can_punch:
            try:
                self.punch_hole(offset, length)
                return True
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                self.can_punch = False
        if self.can_zero_range:
            try:
                fallocate(self.fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, length)
                return True
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                self.can_zero_range = False
        if fast:
            return False
        end = offset + length
        while offset < end:
            n = min(len(_ZERO_CHUNK), end - offset)
            os.pwrite(self.fd, _ZERO_CHUNK[:n], offset)
            offset += n
        return True

    def advise_willneed(self, offset: int, length: int) -> None:
        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_WILLNEED)

    # -- allocation map

    def extents(self, offset: int, length: int, limit: int = 1 << 20) -> list[tuple[int, bool]]:
        """Data and hole runs covering [offset, offset+length): (length, is_hole) pairs.

        Stops after ``limit`` runs; the runs then cover a prefix of the range.
        """
        end = min(offset + length, self.size)
        runs: list[tuple[int, bool]] = []
        pos = offset
        for data, data_end in data_extents(self.fd, offset, end):
            if data > pos:
                runs.append((data - pos, True))
                pos = data
                if len(runs) >= limit:
                    return runs
            runs.append((data_end - data, False))
            pos = data_end
            if len(runs) >= limit:
                return runs
        if pos < end:
            runs.append((end - pos, True))
        return runs
