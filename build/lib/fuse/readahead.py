"""Read-ahead for one open file of a FUSE filesystem whose reads are round trips.

The kernel sends a FUSE filesystem reads of at most 128 KiB, one or two at a
time, however far it has been asked to read ahead; over NFS each is a round
trip, so a sequential reader waits for the server at every step.  An
:class:`ReadAhead` notices a sequential reader and fetches whole chunks
ahead of it, several at once, and answers the kernel's reads from them.
Random reads go straight to the fetch function, as before.

What it holds belongs to one open file handle: a new open starts empty
(close-to-open consistency, as NFS clients keep it) and a write through the
handle drops it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final, cast

import trio

log = logging.getLogger("moorage.fuse.readahead")

CHUNK: Final = 2 * 1024 * 1024
AHEAD: Final = 3  # chunks fetched ahead of the reader, at once
KEEP: Final = AHEAD + 2  # chunks one file holds at most
# Bytes all the open files of one mount may hold in read-ahead chunks.
BUDGET: Final = 64 * 1024 * 1024


class Budget:
    """Memory the read-ahead of every open file of one mount may hold."""

    def __init__(self, limit: int = BUDGET) -> None:
        self.limit = limit
        self.used = 0


Fetch = Callable[[int, int], Awaitable[bytes]]


class _Chunk:
    __slots__ = ("data", "error", "ready")

    def __init__(self) -> None:
        self.ready = trio.Event()
        self.data = b""
        self.error: BaseException | None = None


class ReadAhead:
    """Sequential reads of one file handle answered from chunks fetched ahead."""

    def __init__(
        self, fetch: Fetch, budget: Budget, chunk: int = CHUNK, ahead: int = AHEAD
    ) -> None:
        self._fetch = fetch
        self._budget = budget
        self.chunk = chunk
        self.ahead = ahead
        self._chunks: dict[int, _Chunk] = {}
        self._next = -1  # where a sequential reader reads next
        self._loading: set[_Chunk] = set()
        self._last: int | None = None  # the file's last chunk, once a short one was seen
        self.fetched = 0  # chunks fetched (for tests and logs)

    def drop(self) -> None:
        """Forget everything fetched (the file was written through this handle, or closed)."""
        for index in list(self._chunks):
            self._forget(index)
        self._next = -1
        self._last = None

    async def aclose(self) -> None:
        """Drop everything and wait for fetches under way (before the file is closed)."""
        self.drop()
        while self._loading:
            await next(iter(self._loading)).ready.wait()

    def _forget(self, index: int) -> None:
        if self._chunks.pop(index, None) is not None:
            self._budget.used -= self.chunk

    def _hold(self, index: int) -> _Chunk:
        chunk = _Chunk()
        self._chunks[index] = chunk
        self._budget.used += self.chunk
        return chunk

    async def read(self, offset: int, size: int) -> bytes:
        sequential = offset == self._next or (offset // self.chunk) in self._chunks
        self._next = offset + size
        held = (offset // self.chunk) in self._chunks
        if not sequential or size > self.chunk:
            return await self._fetch(offset, size)
        if not held and self._budget.used + self.chunk > self._budget.limit:
            return await self._fetch(offset, size)  # other files hold all there is
        first = offset // self.chunk
        self._start(first, first + self.ahead)
        start = offset - first * self.chunk
        if start + size <= self.chunk:
            # The common case, all in one chunk: a view of it, no copy (pyfuse3
            # replies from any buffer).
            data = await self._get(first)
            self._forget_before(first)
            return cast(bytes, memoryview(data)[start : start + size])
        out = bytearray()
        index = first
        while len(out) < size:
            data = await self._get(index)
            start = offset + len(out) - index * self.chunk
            piece = data[start : start + size - len(out)]
            out += piece
            if len(data) < self.chunk or not piece:
                break  # end of file
            index += 1
        self._forget_before(first)
        return cast(bytes, out)

    def _forget_before(self, index: int) -> None:
        """Chunks behind the reader are done with."""
        for old in [i for i in self._chunks if i < index]:
            self._forget(old)

    def _start(self, first: int, last: int) -> None:
        """Fetch chunks ``first``..``last`` that are not held or on their way."""
        if self._last is not None:
            last = min(last, self._last)
        for index in range(first, last + 1):
            if index in self._chunks:
                continue
            if len(self._chunks) >= KEEP:
                # Too much held: drop what is furthest from the reader.
                far = max(self._chunks, key=lambda i: abs(i - first))
                if abs(far - first) <= abs(index - first):
                    break
                self._forget(far)
            if index != first and self._budget.used + self.chunk > self._budget.limit:
                break
            chunk = self._hold(index)
            trio.lowlevel.spawn_system_task(self._load, index, chunk, name="fuse-read-ahead")

    async def _get(self, index: int) -> bytes:
        chunk = self._chunks.get(index)
        if chunk is None:
            chunk = self._hold(index)
            await self._load(index, chunk)
        await chunk.ready.wait()
        if chunk.error is not None:
            if self._chunks.get(index) is chunk:
                self._forget(index)  # the next read tries again
            raise chunk.error
        return chunk.data

    async def _load(self, index: int, chunk: _Chunk) -> None:
        # A system task: whatever goes wrong is kept for the reader, never raised.
        self._loading.add(chunk)
        try:
            chunk.data = await self._fetch(index * self.chunk, self.chunk)
            self.fetched += 1
            if len(chunk.data) < self.chunk:
                self._last = index  # end of file: nothing to fetch beyond it
        except trio.Cancelled:
            chunk.error = OSError("read-ahead cancelled")
            raise
        except BaseException as e:
            chunk.error = e
        finally:
            self._loading.discard(chunk)
            chunk.ready.set()
