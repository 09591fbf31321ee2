"""One call at a time per volume, snapshot or name, as the CSI spec recommends.

A second call for a key whose call is still running is not queued behind it:
it gets ABORTED at once, and the CO retries later (the spec's "operation
pending for volume").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from csi.errors import Aborted


class OperationLocks:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._busy: set[str] = set()

    @contextmanager
    def hold(self, *keys: str) -> Iterator[None]:
        wanted = [k for k in dict.fromkeys(keys) if k]
        with self._guard:
            busy = [k for k in wanted if k in self._busy]
            if busy:
                raise Aborted(f"an operation on {busy[0]} is already in progress")
            self._busy.update(wanted)
        try:
            yield
        finally:
            with self._guard:
                self._busy.difference_update(wanted)
