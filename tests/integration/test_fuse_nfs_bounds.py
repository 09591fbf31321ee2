"""The FUSE NFS mount when its server stops answering: every wait ends within a bound.

ganesha is stopped with SIGSTOP (its connections stay open and nothing
answers: the hardest case for a client, which cannot tell a slow server
from a gone one).  A call through the mount then fails with an error
within the mount's ``--timeout``, and SIGTERM ends the mount process within
seconds even with a call in flight.  Every test resumes ganesha (SIGCONT)
and takes its mount down whatever happened, so a broken bound fails the
test instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.fuse_nfs_mount import Ganesha, fuse_mount, running_ganesha
from tests.ganesha_env import ganesha_pids

PROMPTLY = 60.0  # a generous bound for what the timeout must end, on a loaded machine
BOUND = 16.0  # the mount's --timeout where a test tells "after the bound" from "at once"


@pytest.fixture
def ganesha() -> Iterator[Ganesha]:
    with running_ganesha("64m") as g:
        yield g


@contextlib.contextmanager
def stopped(ganesha: Ganesha) -> Iterator[None]:
    pids = ganesha_pids(ganesha.files.main_file)
    assert pids, "ganesha is not running"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _in_thread(fn: object) -> tuple[threading.Thread, list[BaseException | object]]:
    results: list[BaseException | object] = []

    def run() -> None:
        try:
            results.append(fn())  # type: ignore[operator]
        except BaseException as e:  # the error is what the test looks at
            results.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, results


def test_a_server_that_stops_answering_fails_calls_after_the_timeout(ganesha: Ganesha) -> None:
    """The first call waits the bound, then fails; later ones fail at once (the bound is
    the mount's, not each call's); once the server answers again, so does the mount."""
    name = f"bound-{uuid.uuid4().hex[:6]}"
    with fuse_mount(ganesha, name, "--timeout", str(BOUND)) as m:
        (m.mountpoint / "before.txt").write_text("written before\n")
        with stopped(ganesha):
            started = time.monotonic()
            thread, results = _in_thread(lambda: (m.mountpoint / "after.txt").write_text("x"))
            thread.join(PROMPTLY)
            assert not thread.is_alive(), f"the call still waits after {PROMPTLY}s"
            assert isinstance(results[0], OSError), results
            assert time.monotonic() - started >= BOUND - 1  # it did wait for the server
            started = time.monotonic()
            thread, results = _in_thread(lambda: (m.mountpoint / "other.txt").write_text("x"))
            thread.join(PROMPTLY)
            assert not thread.is_alive() and isinstance(results[0], OSError), results
            assert time.monotonic() - started < BOUND / 2, "a later call waited the bound anew"
        # the server answers again: so does the mount
        deadline = time.monotonic() + PROMPTLY
        while True:
            try:
                assert (m.mountpoint / "before.txt").read_text() == "written before\n"
                break
            except OSError:
                assert time.monotonic() < deadline, "the mount did not come back"
                time.sleep(0.5)


def test_sigterm_ends_the_mount_process_within_seconds_with_a_call_in_flight(
    ganesha: Ganesha,
) -> None:
    name = f"term-{uuid.uuid4().hex[:6]}"
    with fuse_mount(ganesha, name) as m:  # the default timeout: 120 s
        (m.mountpoint / "file.txt").write_text("x")
        with stopped(ganesha):
            thread, results = _in_thread(lambda: (m.mountpoint / "new.txt").write_text("y"))
            time.sleep(1.0)
            assert thread.is_alive() and not results  # the call waits for the server
            m.proc.send_signal(signal.SIGTERM)
            try:
                code = m.proc.wait(10)
            except Exception:
                pytest.fail("the mount process is still running 10 s after SIGTERM")
            assert code is not None
            thread.join(PROMPTLY)
            assert not thread.is_alive()
            assert isinstance(results[0], OSError), results
