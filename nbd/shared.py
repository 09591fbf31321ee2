"""Memory the NBD server's processes share: per-export throttle buckets and counters.

When several processes serve the connections of one export (``nbd.workers``),
what must hold for the export as a whole lives in one memfd that every
process maps:

- a *slot* per export (the listening process hands them out): the export's
  two token buckets (``nbd.throttle``, ``CELLS`` doubles), taken from under
  an ``fcntl`` record lock on the slot's bytes, so a limit holds over all the
  export's connections whichever process serves them;
- a *row* per slot and process: that process's counters of the export
  (requests, bytes, errors, open connections).  Only its own process writes
  a row, so rows need no lock; the totals are the sum of the rows.

Rows and slots are 64 bytes apart, so no two processes write one cache line.
Pages are touched only when used: a large capacity costs address space only.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import time
from dataclasses import dataclass

from nbd.throttle import CELLS, CELLS_BYTES, Throttle

STRIDE = 64
# Exports a server with workers may have at once (a storage node has one per
# publication); the memfd is sparse, so only slots in use take memory.
MAX_SLOTS = 16384
COUNTERS = ("requests", "read_bytes", "written_bytes", "errors", "service_ns")


class Counters(ctypes.Structure):
    """One process's counters of one export, in shared memory.

    It has the attributes of ``nbd.exports.ExportStats``, so a connection
    counts into it exactly as it counts into a private ``ExportStats``.
    """

    _fields_ = [
        ("requests", ctypes.c_uint64),
        ("read_bytes", ctypes.c_uint64),
        ("written_bytes", ctypes.c_uint64),
        ("errors", ctypes.c_uint64),
        ("connections", ctypes.c_int64),
        ("service_ns", ctypes.c_uint64),
    ]
    requests: int
    read_bytes: int
    written_bytes: int
    errors: int
    connections: int
    service_ns: int


class _SlotLock:
    """An exclusive ``fcntl`` record lock on one slot's bytes of the memfd.

    Held only around arithmetic (never across an await); released by the
    kernel if its holder dies.  Record locks belong to the process, so they
    order processes, not the tasks of one trio thread (which never overlap
    inside it anyway).
    """

    __slots__ = ("_fd", "_offset")

    def __init__(self, fd: int, offset: int) -> None:
        self._fd = fd
        self._offset = offset

    def __enter__(self) -> _SlotLock:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, CELLS_BYTES, self._offset, os.SEEK_SET)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, CELLS_BYTES, self._offset, os.SEEK_SET)


@dataclass
class SharedExport:
    """An export's place in the shared memory, as one process sees it."""

    region: SharedRegion
    slot: int
    row: Counters  # this process's counters of the export


class SharedRegion:
    """The mapped memfd: ``slots`` throttle slots, then ``processes`` rows per slot."""

    def __init__(self, fd: int, slots: int, processes: int) -> None:
        self.fd = fd
        self.slots = slots
        self.processes = processes
        self._rows_at = slots * STRIDE
        self.size = self._rows_at + slots * processes * STRIDE
        if os.fstat(fd).st_size < self.size:
            raise ValueError("shared memory smaller than its layout")
        self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, processes: int, slots: int = MAX_SLOTS) -> SharedRegion:
        fd = os.memfd_create("moorage-nbd-shared", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, slots * STRIDE * (1 + processes))
            return cls(fd, slots, processes)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        # Views into the map (throttles, counters) may outlive it; they keep
        # the mapping alive until they go, so only the descriptor is closed.
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _check(self, slot: int, process: int = 0) -> None:
        if not 0 <= slot < self.slots or not 0 <= process < self.processes:
            raise IndexError(f"no slot {slot} for process {process}")

    def throttle(self, slot: int) -> Throttle:
        """The slot's buckets, as they are (``clear`` and ``configure`` set them)."""
        self._check(slot)
        offset = slot * STRIDE
        cells = memoryview(self._map)[offset : offset + CELLS_BYTES].cast("d")
        return Throttle(
            cells=cells,
            lock=_SlotLock(self.fd, offset),
            clock=time.monotonic,
            configure=False,
        )

    def row(self, slot: int, process: int) -> Counters:
        self._check(slot, process)
        return Counters.from_buffer(self._map, self._row_offset(slot, process))

    def _row_offset(self, slot: int, process: int) -> int:
        return self._rows_at + (slot * self.processes + process) * STRIDE

    def clear(self, slot: int) -> None:
        """Zero a slot's buckets and every process's counters of it (for a new export)."""
        self._check(slot)
        self._map[slot * STRIDE : slot * STRIDE + STRIDE] = bytes(STRIDE)
        start = self._row_offset(slot, 0)
        end = self._row_offset(slot, self.processes - 1) + STRIDE
        self._map[start:end] = bytes(end - start)

    def totals(self, slot: int) -> tuple[dict[str, int], int]:
        """The slot's counters summed over every process, and its open connections."""
        sums = dict.fromkeys(COUNTERS, 0)
        connections = 0
        for process in range(self.processes):
            row = self.row(slot, process)
            for name in COUNTERS:
                sums[name] += getattr(row, name)
            connections += row.connections
        return sums, connections

    def connections(self, slot: int) -> int:
        return sum(self.row(slot, p).connections for p in range(self.processes))


assert ctypes.sizeof(Counters) <= STRIDE and CELLS * 8 <= STRIDE
