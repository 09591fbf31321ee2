"""Several libnbd clients of one export, for parallel I/O from threads (multi-conn)."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Self

from nbd.libnbd import NBDClient


class ConnectionPool:
    """Up to ``connections`` clients of one export: all of them only if the server
    advertises multi-conn (else one).  Threads check a client out with :meth:`client`.

    With multi-conn a flush on any connection covers writes completed on all of them.
    """

    def __init__(
        self,
        uri: str,
        connections: int = 4,
        *,
        configure: Callable[[NBDClient], None] | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be at least 1, not {connections}")
        clients = [NBDClient.open(uri, configure=configure)]
        try:
            if connections > 1 and clients[0].can_multi_conn():
                for _ in range(connections - 1):
                    clients.append(NBDClient.open(uri, configure=configure))
        except BaseException:
            for c in clients:
                c.close()
            raise
        self.clients: tuple[NBDClient, ...] = tuple(clients)
        self._idle: queue.SimpleQueue[NBDClient] = queue.SimpleQueue()
        for c in clients:
            self._idle.put(c)

    def __len__(self) -> int:
        return len(self.clients)

    @contextmanager
    def client(self) -> Iterator[NBDClient]:
        """A client for this thread alone until the block ends (waits for a free one)."""
        c = self._idle.get()
        try:
            yield c
        finally:
            self._idle.put(c)

    def flush(self) -> None:
        with self.client() as c:
            c.flush()

    def close(self) -> None:
        for c in self.clients:
            c.disconnect()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
