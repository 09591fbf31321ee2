"""fuse.readahead: what a sequential reader is served, and what is fetched for it."""

from __future__ import annotations

import os

import pytest
import trio

from fuse.readahead import Budget, ReadAhead

CHUNK = 64 * 1024
DATA = os.urandom(10 * CHUNK + 1234)  # the "file": ends in the middle of a chunk


class Source:
    """A file behind round trips: records every fetch, can be told to fail or stall."""

    def __init__(self) -> None:
        self.fetches: list[tuple[int, int]] = []
        self.fail: OSError | None = None
        self.release = trio.Event()
        self.release.set()
        self.in_flight = 0

    async def fetch(self, offset: int, size: int) -> bytes:
        self.fetches.append((offset, size))
        self.in_flight += 1
        try:
            await self.release.wait()
            await trio.sleep(0)
            if self.fail is not None:
                raise self.fail
            return DATA[offset : offset + size]
        finally:
            self.in_flight -= 1


def reader(source: Source, budget: Budget | None = None) -> ReadAhead:
    return ReadAhead(source.fetch, budget or Budget(), chunk=CHUNK, ahead=2)


async def read_all(ahead: ReadAhead, step: int) -> bytes:
    out = bytearray()
    offset = 0
    while True:
        piece = bytes(await ahead.read(offset, step))
        if not piece:
            return bytes(out)
        out += piece
        offset += len(piece)


@pytest.mark.parametrize("step", [4096, 16 * 1024, 48 * 1024, CHUNK])
async def test_sequential_reader_gets_the_file_from_whole_chunks(step: int) -> None:
    source = Source()
    ahead = reader(source)
    assert await read_all(ahead, step) == DATA
    # Whole, aligned chunks, each fetched once, after the first (direct) read.
    chunked = source.fetches[1:]
    assert all(size == CHUNK and offset % CHUNK == 0 for offset, size in chunked)
    assert len({offset for offset, _ in chunked}) == len(chunked)
    # Past the end of the file, only what was already on its way when a short
    # chunk showed where the end is (at most ``ahead`` = 2 chunks).
    assert len([o for o, _ in chunked if o >= len(DATA)]) <= 2


async def test_chunks_are_fetched_ahead_of_the_reader_at_once() -> None:
    source = Source()
    ahead = reader(source)
    await ahead.read(0, 4096)  # a first read: direct
    source.release = trio.Event()  # fetches now wait
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ahead.read, 4096, 4096)
        await trio.testing.wait_all_tasks_blocked()
        assert source.in_flight == 3  # the chunk being read and two ahead
        source.release.set()


async def test_random_reads_go_straight_to_the_source() -> None:
    source = Source()
    ahead = reader(source)
    for offset in (5 * CHUNK + 100, 100, 8 * CHUNK, 2 * CHUNK + 7):
        assert bytes(await ahead.read(offset, 1000)) == DATA[offset : offset + 1000]
    assert source.fetches == [
        (5 * CHUNK + 100, 1000),
        (100, 1000),
        (8 * CHUNK, 1000),
        (2 * CHUNK + 7, 1000),
    ]


async def test_drop_forgets_what_was_fetched() -> None:
    source = Source()
    budget = Budget()
    ahead = reader(source, budget)
    await ahead.read(0, 4096)
    await ahead.read(4096, 4096)
    assert budget.used > 0
    before = len(source.fetches)
    ahead.drop()  # e.g. the file was written through this handle
    assert budget.used == 0
    await ahead.read(8192, 4096)
    assert source.fetches[before] == (8192, 4096)  # fetched again, not served from memory


async def test_budget_shared_by_files_caps_what_is_held() -> None:
    source = Source()
    budget = Budget(limit=4 * CHUNK)
    files = [reader(source, budget) for _ in range(4)]
    for ahead in files:
        await ahead.read(0, 4096)
        await ahead.read(4096, 4096)
        assert budget.used <= budget.limit
    # Every file still reads the right bytes, held or not.
    for ahead in files:
        assert bytes(await ahead.read(8192, 4096)) == DATA[8192 : 8192 + 4096]
    for ahead in files:
        await ahead.aclose()
    assert budget.used == 0


async def test_a_failed_fetch_is_the_reader_s_error_and_is_tried_again() -> None:
    source = Source()
    ahead = reader(source)
    await ahead.read(0, 4096)
    ahead.drop()
    await ahead.read(0, 4096)
    source.fail = OSError(5, "server said no")
    ahead.drop()
    ahead._next = 4096  # a sequential reader, whose chunk fetch fails
    with pytest.raises(OSError, match="server said no"):
        await ahead.read(4096, 4096)
    source.fail = None
    assert bytes(await ahead.read(4096 * 2, 4096)) == DATA[8192 : 8192 + 4096]


async def test_aclose_waits_for_fetches_under_way() -> None:
    source = Source()
    ahead = reader(source)
    await ahead.read(0, 4096)
    source.release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ahead.read, 4096, 4096)
        await trio.testing.wait_all_tasks_blocked()
        assert source.in_flight > 0
        closed = False

        async def close() -> None:
            nonlocal closed
            await ahead.aclose()
            closed = True

        nursery.start_soon(close)
        await trio.testing.wait_all_tasks_blocked()
        assert not closed, "aclose returned while a fetch still used the file"
        source.release.set()
    assert closed
    assert source.in_flight == 0
