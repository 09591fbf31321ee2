"""Where an open file holds data: its data runs, found with SEEK_DATA and
SEEK_HOLE, so a copy, a usage figure or an NBD block-status reply skips the
holes (what lies between the runs reads as zeros).  A filesystem without
hole support reports the whole range as data, which is always safe."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator


def data_extents(fd: int, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
    """The data runs of ``fd`` within [start, end) (``end``: the file's size
    when None), in order, as (offset, end) pairs clipped to the range."""
    if end is None:
        end = os.fstat(fd).st_size
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here to the end of the file
                return
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no hole support: all data
                yield pos, end
                return
            raise
        if data >= end:
            return
        try:
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError as e:
            if e.errno != errno.ENXIO:  # the file shrank under us: data to the end
                raise
            hole = end
        hole = min(hole, end)
        yield data, hole
        pos = hole
