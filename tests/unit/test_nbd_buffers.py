"""Request data buffers (nbd.transport.BufferPool, data_buffer).

The kernel's copy into user memory runs several times slower on this
machine's CPUs when the destination is not 64-byte aligned, so large
buffers must be aligned; a buffer given back is handed out again.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from nbd.transport import ALIGNED_MIN, BufferPool, data_buffer


def _address(buf: bytearray | object) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [ALIGNED_MIN, 64 * 1024, 256 * 1024 + 512, 1 << 20, 32 << 20])
def test_large_buffers_are_aligned_zeroed_and_of_their_size(size: int) -> None:
    pool = BufferPool()
    first = pool.get(size)
    assert len(first) == size
    assert _address(first) % 64 == 0
    assert bytes(memoryview(first)[:4096]) == bytes(4096)
    pool.put(first)
    second = pool.get(size)
    if size <= pool.max_size:
        assert second is first  # reused, not allocated again
    assert _address(second) % 64 == 0


def test_small_buffers_are_plain_bytearrays() -> None:
    assert isinstance(data_buffer(4096), bytearray)
    assert len(data_buffer(ALIGNED_MIN - 1)) == ALIGNED_MIN - 1


def test_file_and_socket_data_land_in_an_aligned_buffer_whole(tmp_path: Path) -> None:
    data = os.urandom(256 * 1024)
    path = tmp_path / "f"
    path.write_bytes(data)
    buf = data_buffer(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [memoryview(buf)], 0) == len(data)
    finally:
        os.close(fd)
    assert bytes(memoryview(buf)) == data
