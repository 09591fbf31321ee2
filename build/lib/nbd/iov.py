"""Vectored I/O bookkeeping shared by the socket and file paths."""

from __future__ import annotations


def consume(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (what a vectored write took), in place."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]
