"""The FUSE NFS mount's outage clock (fuse.nfscontexts.ContextPool), with stand-in
contexts: which bound a call gets after an earlier one found no server."""

from __future__ import annotations

import errno
import threading
from typing import cast

import pytest
import trio

from fuse import nfscontexts
from fuse.libnfs import NFSContext
from fuse.nfscontexts import ContextPool

BOUND = 1.0
AFTER = 0.2


@pytest.fixture(autouse=True)
def _short_after_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nfscontexts, "AFTER_TIMEOUT", AFTER)


def _pool() -> ContextPool:
    return ContextPool([cast(NFSContext, object())], timeout=BOUND)


def _raises(code: int) -> object:
    def fn(_: NFSContext) -> None:
        raise OSError(code, "from libnfs")

    return fn


def _hangs(release: threading.Event) -> object:
    def fn(_: NFSContext) -> None:
        release.wait(10)

    return fn


async def _bound_of_a_hanging_call(pool: ContextPool) -> str:
    """The message of a call the server never answers: it names the bound it got."""
    release = threading.Event()
    try:
        with pytest.raises(OSError) as caught:
            await pool.run(_hangs(release))  # type: ignore[arg-type]
    finally:
        release.set()
    assert caught.value.errno == errno.EIO
    return str(caught.value)


@pytest.mark.parametrize(
    "code",
    [
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ENOTCONN,
        errno.EFAULT,
        errno.EINTR,
    ],
)
def test_libnfs_giving_up_for_want_of_a_server_is_a_timeout_not_an_answer(code: int) -> None:
    async def main() -> None:
        pool = _pool()
        with pytest.raises(OSError) as caught:
            await pool.run(_raises(code))  # type: ignore[arg-type]
        assert caught.value.errno == errno.EIO
        # the outage clock runs: the next call waits the short bound, not the whole one
        assert f"within {AFTER}s" in await _bound_of_a_hanging_call(pool)

    trio.run(main)


def test_an_error_from_the_server_is_an_answer() -> None:
    async def main() -> None:
        pool = _pool()
        assert f"within {BOUND}s" in await _bound_of_a_hanging_call(pool)
        assert f"within {AFTER}s" in await _bound_of_a_hanging_call(pool)
        with pytest.raises(OSError) as caught:
            await pool.run(_raises(errno.ENOENT))  # type: ignore[arg-type]
        assert caught.value.errno == errno.ENOENT  # passed on as the server said it
        # answered: the next call gets the whole bound again
        assert f"within {BOUND}s" in await _bound_of_a_hanging_call(pool)

    trio.run(main)


def test_libnfs_times_out_after_the_bound() -> None:
    assert nfscontexts.libnfs_timeout_ms(None) is None
    assert nfscontexts.libnfs_timeout_ms(10) == (10 + nfscontexts.LIBNFS_MARGIN) * 1000
