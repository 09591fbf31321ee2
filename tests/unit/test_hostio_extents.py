"""``hostio.extents``: the data runs of a sparse file, its holes skipped."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostio.extents import data_extents

KiB = 1024
MiB = 1 << 20


@pytest.fixture
def sparse(tmp_path: Path) -> Iterator[int]:
    """8 MiB: data at [0, 64 KiB) and [4 MiB, 4 MiB + 64 KiB), holes elsewhere."""
    path = tmp_path / "image"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 8 * MiB)
        os.pwrite(fd, b"\xaa" * 64 * KiB, 0)
        os.pwrite(fd, b"\xbb" * 64 * KiB, 4 * MiB)
        yield fd
    finally:
        os.close(fd)


def test_the_data_runs_of_a_sparse_file_leave_its_holes_out(sparse: int) -> None:
    runs = list(data_extents(sparse))
    assert runs == [(0, 64 * KiB), (4 * MiB, 4 * MiB + 64 * KiB)]


def test_a_window_clips_the_runs_and_skips_what_lies_outside(sparse: int) -> None:
    assert list(data_extents(sparse, 32 * KiB, 4 * MiB + 16 * KiB)) == [
        (32 * KiB, 64 * KiB),
        (4 * MiB, 4 * MiB + 16 * KiB),
    ]
    assert list(data_extents(sparse, 1 * MiB, 2 * MiB)) == []  # all hole
    assert list(data_extents(sparse, 5 * MiB)) == []  # a hole to the end of the file


def test_every_byte_outside_the_runs_reads_as_zero(sparse: int) -> None:
    size = os.fstat(sparse).st_size
    pos = 0
    for data, end in data_extents(sparse):
        assert os.pread(sparse, data - pos, pos).count(0) == data - pos
        pos = end
    assert os.pread(sparse, size - pos, pos).count(0) == size - pos


def test_a_filesystem_without_hole_support_reports_all_of_the_range_as_data(
    sparse: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lseek(fd: int, pos: int, how: int) -> int:
        raise OSError(errno.EINVAL, "SEEK_DATA not supported")

    monkeypatch.setattr(os, "lseek", lseek)
    assert list(data_extents(sparse, 0, 8 * MiB)) == [(0, 8 * MiB)]


def test_other_errors_are_raised(sparse: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def lseek(fd: int, pos: int, how: int) -> int:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "lseek", lseek)
    with pytest.raises(OSError, match="I/O error"):
        list(data_extents(sparse))
