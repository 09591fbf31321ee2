"""How a FUSE mount process tells whoever started it that it is ready.

The process writes one line, ``ready`` or ``error: <reason>``, to a pipe (or
stdout) once its mount is in place or has failed; the starter reads that
line with a deadline.  EOF without a line means the process died.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import sys
import time
from typing import Final

READY: Final = b"ready\n"


class ReadySignal:
    """The mount process's side: answer once, then close the channel."""

    def __init__(self, ready_fd: int | None) -> None:
        self._fd = ready_fd
        self._out = ready_fd if ready_fd is not None else sys.stdout.fileno()
        self.answered = False

    def _answer(self, line: bytes) -> None:
        if self.answered:
            return
        self.answered = True
        with contextlib.suppress(OSError):  # nobody waits for it any more
            os.write(self._out, line)
        if self._fd is not None:
            os.close(self._fd)

    def ready(self) -> None:
        self._answer(READY)

    def failed(self, reason: object) -> None:
        self._answer(f"error: {reason}\n".encode(errors="replace"))


def configure_logging(debug: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def read_line(fd: int, timeout: float) -> bytes | None:
    """The starter's side: one line from ``fd`` within ``timeout`` seconds.

    Returns b'' (or a partial line) at EOF and None on timeout.
    """
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        end = time.monotonic() + timeout
        while not line.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return line
            line += chunk
    return line
