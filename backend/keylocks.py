"""One lock per key (a volume id, a name), so unrelated operations run in parallel."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class KeyLocks:
    """Locks made on first use and dropped when the last holder or waiter leaves."""

    guard: threading.Lock = field(default_factory=threading.Lock)
    held: dict[str, tuple[threading.Lock, int]] = field(default_factory=dict)

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self.guard:
            lock, users = self.held.get(key, (threading.Lock(), 0))
            self.held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self.guard:
                lock, users = self.held[key]
                if users == 1:
                    del self.held[key]
                else:
                    self.held[key] = (lock, users - 1)
