"""The FUSE block path's I/O set-up, against moorage's own NBD server.

- The loop device runs in direct-I/O mode over the FUSE file (no second page
  cache), and what is written through it with O_DIRECT is what an NBD client
  reads from the export, byte for byte, and the other way round.
- The FUSE process keeps its request tasks ready instead of starting one per
  request (``fuse.process.run_fuse_loop``'s ``min_tasks``).
- A server that stops answering (SIGSTOP: its connections stay open, nothing
  comes back) fails a request with EIO after the I/O timeout: the export's
  watchdog, not a timer per request, declares the connection lost.  Once the
  server runs again, I/O works again.

Every wait is bounded (threads joined with a timeout, reads retried until a
deadline); the stack's teardown leaves no mount, loop device or process.
"""

from __future__ import annotations

import errno
import mmap
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest

from fuse.blockdev import attach_fuse_block
from fuse.blockfile import REQUEST_TASKS, BlockFile, _serve
from fuse.loop import loop_status
from fuse.nbdconnections import watch_period
from fuse.process import EarlyStop
from nbd.libnbd import NBDClient
from tests.conftest import NBDServerFactory, NBDServerProcess, sparse_image
from tests.fuse_block_stack import IMAGE_SIZE, BlockStack, MiB, reads_again

TIMEOUT = 2.0  # the I/O timeout of the stalled-server test
PROMPTLY = 60.0  # far above TIMEOUT + the watchdog period + a reconnect attempt


@pytest.fixture
def server(nbd_servers: NBDServerFactory, tmp_path: Path) -> NBDServerProcess:
    return nbd_servers.start({"disk": sparse_image(tmp_path / "disk.img", IMAGE_SIZE)})


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BlockStack]:
    s = BlockStack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def aligned(data: bytes) -> mmap.mmap:
    """``data`` in page-aligned memory, as O_DIRECT wants it."""
    buf = mmap.mmap(-1, len(data))
    buf.write(data)
    return buf


def test_loop_device_is_direct_io_and_its_bytes_are_the_exports(
    server: NBDServerProcess, stack: BlockStack
) -> None:
    attachment = stack.attach(server.uri("disk"))
    status = loop_status(attachment.device)
    assert status is not None and status.direct_io, status
    name = os.path.basename(attachment.device)
    assert Path(f"/sys/block/{name}/loop/dio").read_text().strip() == "1"

    # through the loop device (O_DIRECT, scattered 4 KiB and 1 MiB writes) -> the export
    pieces = {offset: os.urandom(4096) for offset in range(0, 64 * 4096, 2 * 4096)}
    pieces[8 * MiB] = os.urandom(MiB)
    fd = os.open(attachment.device, os.O_RDWR | os.O_DIRECT)
    try:
        for offset, data in pieces.items():
            with aligned(data) as buf:
                assert os.pwritev(fd, [buf], offset) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    with NBDClient.open(server.uri("disk"), meta_contexts=()) as client:
        for offset, data in pieces.items():
            assert client.pread(len(data), offset) == data, f"offset {offset}"
        # the export -> through the loop device
        back = os.urandom(2 * MiB)
        client.pwrite(back, 32 * MiB)
        client.flush()
    fd = os.open(attachment.device, os.O_RDONLY | os.O_DIRECT)
    try:
        with mmap.mmap(-1, len(back)) as buf:
            assert os.preadv(fd, [buf], 32 * MiB) == len(back)
            assert buf[:] == back
    finally:
        os.close(fd)


async def test_the_block_file_keeps_its_request_tasks_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pyfuse3.main is told to keep REQUEST_TASKS tasks (its default is 1)."""
    seen: dict[str, Any] = {}

    async def main(**kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(pyfuse3, "main", main)

    class Export:
        def stop(self, reason: str) -> None:
            pass

    await _serve(BlockFile(Export()), None, EarlyStop())  # type: ignore[arg-type]
    assert seen["min_tasks"] == REQUEST_TASKS > 1
    assert seen["max_tasks"] >= REQUEST_TASKS


def test_a_server_that_stops_answering_fails_io_after_the_timeout(
    server: NBDServerProcess, stack: BlockStack
) -> None:
    uri = server.uri("disk")
    stack.attached.append(uri)
    attachment = attach_fuse_block(uri, stack.state_dir, timeout=TIMEOUT)
    data = os.urandom(4096)
    fd = os.open(attachment.file, os.O_RDWR)
    try:
        os.pwrite(fd, data, 0)
        outcome: dict[str, Any] = {}

        def read() -> None:
            started = time.monotonic()
            try:
                outcome["data"] = os.pread(fd, 4096, 0)
            except OSError as e:
                outcome["errno"] = e.errno
            outcome["seconds"] = time.monotonic() - started

        server.signal_all(signal.SIGSTOP)
        try:
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(PROMPTLY)
            assert not reader.is_alive(), "a read from a server that stopped answering hung"
        finally:
            server.signal_all(signal.SIGCONT)
        assert outcome.get("errno") == errno.EIO, outcome
        # not before the timeout, and not long after it (plus a reconnect attempt)
        assert TIMEOUT * 0.9 <= outcome["seconds"] <= TIMEOUT + watch_period(TIMEOUT) + 15
        reads_again(fd, data, within=30)
    finally:
        os.close(fd)
    assert "no reply within" in Path(attachment.log_file).read_text()
