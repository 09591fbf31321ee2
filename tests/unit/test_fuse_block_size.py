"""The FUSE block path's loop device gets the export's minimum block size.

The FUSE process learns the minimum from the server (either NBD client) and
says it in its ready line; the attach turns it into the loop device's logical
block size, as the kernel nbd path does (512, or the minimum where larger), and
refuses a minimum no loop device can have.  The loop device itself, mkfs and
direct I/O on it: tests/integration/test_fuse_block_io.py.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import trio

from fuse.blockdev import BlockAttachError, loop_block_size
from fuse.nbdconnections import ExportConnections, connect
from fuse.process import Answer, ReadySignal, await_ready
from nbd.client import BlockSize, Negotiated
from nbd.constants import TransmissionFlag
from nbd.exports import Export, ExportTable
from nbd.kernel import kernel_block_size
from nbd.server import NBDServer, ServerConfig, open_unix_listener


@pytest.mark.parametrize(("minimum", "size"), [(1, 512), (512, 512), (2048, 2048), (4096, 4096)])
def test_the_loop_device_takes_the_minimum_at_least_512(minimum: int, size: int) -> None:
    assert loop_block_size(minimum) == size


def test_a_minimum_above_what_a_loop_device_takes_is_refused() -> None:
    with pytest.raises(BlockAttachError, match="65536"):
        loop_block_size(65536)


@pytest.mark.parametrize("client", ["auto", "libnbd"])
async def test_the_process_learns_the_minimum_from_the_server(tmp_path: Path, client: str) -> None:
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(1 << 20))
    sock = tmp_path / "nbd.sock"
    table = ExportTable([Export("disk", image, min_block_size=4096)])
    server = NBDServer(table, ServerConfig(shutdown_grace=2.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, [await open_unix_listener(str(sock))])
        try:
            export = await trio.to_thread.run_sync(
                functools.partial(
                    ExportConnections.open,
                    f"nbd+unix:///disk?socket={sock}",
                    1,
                    connect=functools.partial(connect, client=client),
                )
            )
            export.close()
        finally:
            server.shutdown()
    assert export.minimum_block_size == 4096


def _said(line: bytes | None, argv: tuple[str, ...] = ("true",), **facts: int) -> Answer:
    """What the starter makes of a mount process's ready line (or of ``facts``), the
    process being ``argv``."""
    read_end, write_end = os.pipe()
    if line is None:
        ReadySignal(write_end).ready(**facts)  # writes, and closes write_end
    else:
        os.write(write_end, line)
        os.close(write_end)
    with subprocess.Popen(argv) as proc:
        try:
            return await_ready(proc, read_end, 5.0, lambda: None, lambda: "silent")
        finally:
            proc.kill()  # reaped by the with block; a no-op once it has been


def test_the_ready_line_carries_the_facts() -> None:
    assert _said(None, minimum_block_size=4096) == Answer(None, {"minimum_block_size": 4096})
    assert _said(None) == Answer(None, {})
    assert _said(b"ready\n") == Answer(None, {})


def test_a_ready_line_that_cannot_be_read_is_a_failure() -> None:
    answer = _said(b"ready minimum_block_size=big\n")
    assert answer.failure is not None and "minimum_block_size=big" in answer.failure
    assert _said(b"error: no such export\n").failure == "exited 0: error: no such export"


@pytest.mark.parametrize("value", ["\u00b2", "\u0664", "-1", "1_0", ""])
def test_a_fact_is_ascii_digits_only(value: str) -> None:
    """Superscript two and an Arabic-Indic four are digits to str.isdigit, and int()
    would take the second: neither is a number the process writes."""
    line = f"ready minimum_block_size={value}\n".encode()
    answer = _said(line)
    assert answer.failure is not None and "minimum_block_size" in answer.failure


def test_a_process_whose_ready_line_cannot_be_read_is_terminated() -> None:
    """It is alive and serving its mount: told to stop (SIGTERM, so it can unmount),
    not left to a wait and then SIGKILL."""
    answer = _said(b"ready minimum_block_size=big\n", argv=("sleep", "60"))
    assert answer.failure == f"exited {-signal.SIGTERM}: ready minimum_block_size=big"


def test_the_kernel_nbd_path_has_the_same_rule() -> None:
    """Both paths give one volume one sector size (a partition table made on one
    must read the same on the other)."""
    for minimum in (1, 512, 2048, 4096):
        sizes = BlockSize(minimum, 4096, 1 << 25)
        negotiated = Negotiated(socket.socket(), "disk", 1 << 20, TransmissionFlag(0), sizes, False)
        negotiated.sock.close()
        assert kernel_block_size(negotiated) == loop_block_size(minimum)
