"""A pool of libnfs contexts mounted on one NFS export, lent to worker threads.

Choices, and why:

- **A pool of contexts.** A libnfs context is not thread-safe.  The
  filesystem owns a few mounted contexts; a request borrows one, runs its
  blocking calls in a worker thread, and gives it back, so at most that many
  calls are in flight and the FUSE loop never blocks.  Open files are NFSv3
  file handles, valid on every context.
- **Bounded.** libnfs reconnects for ever, and its own call timeout does
  not end a call to a server that accepted it and stopped answering.  So
  with ``timeout`` every call (waiting for a free context included) is
  bounded here: past it the call fails with EIO and its thread is
  abandoned; it gives its context back to the pool once libnfs returns (the
  server answered again), so a mount whose server comes back has all its
  connections again.  Once a call has timed out, later calls wait only
  :data:`AFTER_TIMEOUT` seconds until one is answered again: the bound is
  the mount's, not each call's (a process stat-ing its way through a dead
  mount would otherwise wait the whole bound at every step).  A call that
  libnfs itself ends for want of a server (its own timeout, a refused or
  reset connection) is no answer either: libnfs's timeout is set
  :data:`LIBNFS_MARGIN` past the bound, so the bound normally ends a call
  first, and such an error counts as a timeout when it does not.
"""

from __future__ import annotations

import contextlib
import errno
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import trio

from fuse.libnfs import NFSContext

if TYPE_CHECKING:
    # only for the annotation: fuse.nfsmount, which owns the export's address, imports this
    from fuse.nfsmount import NFSExport

T = TypeVar("T")

# What a call waits once an earlier one timed out, until one is answered again.
AFTER_TIMEOUT = 2.0
# libnfs's own call timeout is the bound plus this: ours ends a call first.
LIBNFS_MARGIN = 5.0
# What libnfs answers when no server did: not an answer from the server.  Its
# NFSv3 calls end in EFAULT when the RPC layer failed and EINTR when a call was
# cancelled or timed out; no NFS status maps to either.
NO_SERVER = frozenset(
    {
        errno.EFAULT,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ENOTCONN,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)


def libnfs_timeout_ms(timeout: float | None) -> int | None:
    """libnfs's call timeout for a mount bounded by ``timeout`` seconds."""
    return None if timeout is None else int((timeout + LIBNFS_MARGIN) * 1000)


class ContextPool:
    """Mounted libnfs contexts, each lent to one worker thread at a time."""

    def __init__(self, contexts: Sequence[NFSContext], timeout: float | None = None) -> None:
        if not contexts:
            raise ValueError("a context pool needs at least one context")
        self.size = len(contexts)
        self.timeout = timeout
        self._timed_out = False  # a call timed out and none was answered since
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
                    timeout_ms=libnfs_timeout_ms(timeout),
                )
        except BaseException:
            for context in contexts:
                context.destroy()
            raise
        return cls(contexts, timeout)

    async def run(self, fn: Callable[[NFSContext], T]) -> T:
        """``fn(context)`` in a worker thread; what it raises is raised here.  Past the
        timeout: OSError(EIO)."""
        bound = self.timeout
        if bound is not None and self._timed_out:
            bound = min(bound, AFTER_TIMEOUT)
        deadline = math.inf if bound is None else trio.current_time() + bound
        context: NFSContext | None = None
        with trio.move_on_at(deadline):
            context = await self._idle.receive()
        if context is None:
            raise OSError(errno.EIO, f"no NFS connection free for {bound}s")
        lent = context
        results: list[T] = []
        lock = threading.Lock()
        state = {"abandoned": False, "done": False}
        token = trio.lowlevel.current_trio_token()

        def give_back() -> None:
            # (the mount going away: nobody needs it)
            with contextlib.suppress(
                trio.RunFinishedError, trio.ClosedResourceError, trio.WouldBlock
            ):
                trio.from_thread.run_sync(self._send.send_nowait, lent, trio_token=token)

        def call() -> Exception | None:
            try:
                results.append(fn(lent))
            except Exception as e:  # raised below, once the context is back in the pool
                return e
            finally:
                with lock:
                    state["done"] = True
                    late = state["abandoned"]
                if late:
                    give_back()  # the server answered after all: the context is usable
            return None

        # Abandoned on cancellation (shutdown) or timeout: the thread may still be
        # using the context, so it is lent again only once that thread is done.
        # Its own limiter keeps these threads out of trio's default one.
        with trio.move_on_at(deadline):
            error = await trio.to_thread.run_sync(
                call, abandon_on_cancel=True, limiter=self._threads
            )
            self._send.send_nowait(lent)
            if isinstance(error, OSError) and error.errno in NO_SERVER:
                self._timed_out = True
                raise OSError(errno.EIO, f"no answer from the NFS server: {error}") from error
            self._timed_out = False  # answered (an error from the server is an answer)
            if error is not None:
                raise error
            return results[0]
        with lock:
            state["abandoned"] = True
            finished = state["done"]
        if finished:  # done between the timeout and now, without giving it back
            self._send.send_nowait(lent)
        self._timed_out = True
        raise OSError(errno.EIO, f"the NFS server did not answer within {bound}s")

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
