"""A pool of libnfs contexts mounted on one NFS export, lent to worker threads.

Choices, and why:

- **A pool of contexts.** A libnfs context is not thread-safe.  The
  filesystem owns a few mounted contexts; a request borrows one, runs its
  blocking calls in a worker thread, and gives it back, so at most that many
  calls are in flight and the FUSE loop never blocks.  Open files are NFSv3
  file handles, valid on every context.
- **Hard mount.** libnfs reconnects forever unless ``timeout`` is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import trio

from fuse.libnfs import NFSContext

if TYPE_CHECKING:
    # only for the annotation: fuse.nfsmount, which owns the export's address, imports this
    from fuse.nfsmount import NFSExport

T = TypeVar("T")


class ContextPool:
    """Mounted libnfs contexts, each lent to one worker thread at a time."""

    def __init__(self, contexts: Sequence[NFSContext]) -> None:
        if not contexts:
            raise ValueError("a context pool needs at least one context")
        self.size = len(contexts)
        self._send, self._idle = trio.open_memory_channel[NFSContext](self.size)
        for context in contexts:
            self._send.send_nowait(context)
        self._threads = trio.CapacityLimiter(self.size)

    @classmethod
    def mount(cls, export: NFSExport, size: int, timeout: float | None = None) -> ContextPool:
        """Open ``size`` connections to the export (blocking; before the FUSE loop)."""
        contexts: list[NFSContext] = []
        try:
            for _ in range(size):
                context = NFSContext()
                contexts.append(context)
                context.mount(
                    export.host,
                    export.path,
                    nfs_port=export.port,
                    mount_port=export.mount_port,
                    timeout_ms=None if timeout is None else int(timeout * 1000),
                )
        except BaseException:
            for context in contexts:
                context.destroy()
            raise
        return cls(contexts)

    async def run(self, fn: Callable[[NFSContext], T]) -> T:
        """``fn(context)`` in a worker thread; what it raises is raised here."""
        context = await self._idle.receive()

        results: list[T] = []

        def call() -> Exception | None:
            try:
                results.append(fn(context))
            except Exception as e:  # raised below, once the context is back in the pool
                return e
            return None

        # Abandoned on cancellation (shutdown): the thread may still be using
        # the context, so it is never lent again, nor destroyed.  Its own
        # limiter keeps these threads out of trio's default one.
        error = await trio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self._threads)
        self._send.send_nowait(context)
        if error is not None:
            raise error
        return results[0]

    def run_now(self, fn: Callable[[NFSContext], T]) -> T:
        """``fn(context)`` in this thread: only before the FUSE loop runs."""
        context = self._idle.receive_nowait()
        try:
            return fn(context)
        finally:
            self._send.send_nowait(context)

    def close(self) -> None:
        """Destroy every idle context (those in use by an abandoned thread are left)."""
        while True:
            try:
                self._idle.receive_nowait().destroy()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
