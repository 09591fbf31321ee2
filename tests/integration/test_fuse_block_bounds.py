"""The FUSE block path when its server goes away: every wait ends within a bound.

A staged block volume is a filesystem on a loop device on the FUSE block
file (``fuse.blockfile``).  Before these bounds a lost export made every
request retry for ever: writes to the loop device blocked, ``umount`` of
the filesystem sat in D state holding its superblock, every ``sync()`` on
the host hung with it, and SIGTERM did not end the FUSE process.  Here,
against moorage's own NBD server:

- the export gone (the server answers "no such export": its volume was
  unpublished) fails I/O at once, long before the I/O timeout;
- a server gone for longer than the I/O timeout fails I/O after it;
- then ``sync`` and ``umount`` return, and other volumes keep working;
- SIGTERM ends the FUSE process within seconds when its server is gone, and
  within its stop bound when the server accepts but does not answer: the
  final flush is given its own bound then.

(A server back within the timeout is a pause, not an error:
``test_fuse_block.py::test_server_restart_is_a_pause_not_an_error``.)

Every wait in these tests is bounded, and the stack's teardown SIGKILLs a
FUSE process that does not go (which fails its requests), so a broken
bound fails a test instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse.blockdev import attach_fuse_block, detach_fuse_block
from fuse.blockfile import stop_bound
from fuse.loop import loop_status
from tests.conftest import NBDServerFactory, NBDServerProcess, free_port, sparse_image
from tests.fuse_block_stack import IMAGE_SIZE, BlockStack, MiB, Writer, mkfs, reads_again

# The I/O timeout of attachments that must fail long before it.
LONG_TIMEOUT = 300.0
# A generous upper bound for what must happen "at once" or "within the bound"
# on a loaded machine: far below LONG_TIMEOUT, so only the bound can explain it.
PROMPTLY = 60.0


class Server:
    """A moorage NBD server on a fixed port, that can come back with other exports."""

    def __init__(self, factory: NBDServerFactory, image: Path) -> None:
        self.factory = factory
        self.image = image
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.process: NBDServerProcess | None = None
        self.start()

    @property
    def uri(self) -> str:
        return f"nbd://127.0.0.1:{self.port}/disk"

    def start(self, export: str = "disk") -> None:
        self.process = self.factory.start({export: self.image}, port=self.port)
        self.proc = self.process.proc

    def signal_all(self, sig: int) -> None:
        """The listener and its worker processes: whichever serves the connection."""
        if self.process is not None and self.proc is not None and self.proc.poll() is None:
            self.process.signal_all(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal_all(signal.SIGCONT)  # in case a test stopped it
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def servers(nbd_servers: NBDServerFactory, tmp_path: Path) -> Iterator[list[Server]]:
    made: list[Server] = []
    try:
        yield made
    finally:
        for s in made:
            s.kill()


def _server(servers: list[Server], nbd_servers: NBDServerFactory, tmp_path: Path) -> Server:
    image = sparse_image(tmp_path / f"image-{len(servers)}.img", IMAGE_SIZE)
    server = Server(nbd_servers, image)
    servers.append(server)
    return server


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BlockStack]:
    s = BlockStack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def _attach(stack: BlockStack, uri: str, timeout: float) -> tuple[str, int, str]:
    """Attach with this I/O timeout; (device, FUSE pid, its log file)."""
    stack.attached.append(uri)
    a = attach_fuse_block(uri, stack.state_dir, connections=2, timeout=timeout)
    return a.device, a.pid, a.log_file


def _ends_with_an_error(writer: Writer, within: float) -> OSError:
    writer.join(within)
    assert not writer.is_alive(), f"the writer still waits after {within}s"
    error = writer.error
    assert isinstance(error, OSError), f"the writer ended with {error!r}"
    # the write or fsync fails (EIO); ext4 then aborts its journal (EROFS for what follows)
    assert error.errno in (errno.EIO, errno.EROFS), error
    return error


def _returns(argv: list[str], within: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=within)
    return done


def _still_works(directory: Path) -> None:
    data = os.urandom(MiB)
    with (directory / "other-volume.bin").open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert (directory / "other-volume.bin").read_bytes() == data


def _two_volumes_and_a_writer(
    stack: BlockStack, uri: str, timeout: float, other_uri: str
) -> tuple[Path, Path, str, Writer]:
    """The export at ``uri`` (with this I/O timeout) and another, each an ext4 mounted;
    a writer running on the first.  (target, other target, FUSE log, writer)."""
    device, _, log_file = _attach(stack, uri, timeout)
    other_device, _, _ = _attach(stack, other_uri, LONG_TIMEOUT)
    mkfs("ext4", device)
    mkfs("ext4", other_device)
    target = stack.mount(device, "ext4")
    other_target = stack.mount(other_device, "ext4")
    writer = Writer(target)
    writer.start()
    return target, other_target, log_file, writer


def _node_lets_go(stack: BlockStack, target: Path, other_target: Path) -> None:
    """sync and umount return; the other volume keeps working."""
    assert _returns(["sync"], PROMPTLY).returncode == 0
    assert _returns(["umount", str(target)], PROMPTLY).returncode == 0
    stack.mounts.remove(target)
    _still_works(other_target)


def test_an_export_that_goes_away_fails_io_at_once_and_unmounts(
    servers: list[Server], nbd_servers: NBDServerFactory, stack: BlockStack, tmp_path: Path
) -> None:
    lost = _server(servers, nbd_servers, tmp_path)
    other = _server(servers, nbd_servers, tmp_path)
    target, other_target, log_file, writer = _two_volumes_and_a_writer(
        stack, lost.uri, LONG_TIMEOUT, other.uri
    )
    try:
        writer.wait_for(5, timeout=PROMPTLY)
        # the volume is unpublished: its server answers "no export named 'disk'"
        lost.kill()
        lost.start(export="something-else")
        started = time.monotonic()
        _ends_with_an_error(writer, PROMPTLY)
        assert time.monotonic() - started < LONG_TIMEOUT
    finally:
        writer.stopping.set()
    _node_lets_go(stack, target, other_target)
    log = Path(log_file).read_text(errors="replace")
    assert "no export named" in log and "requests fail with EIO" in log, log


def test_a_server_gone_longer_than_the_bound_fails_io_then_unmounts(
    servers: list[Server], nbd_servers: NBDServerFactory, stack: BlockStack, tmp_path: Path
) -> None:
    server = _server(servers, nbd_servers, tmp_path)
    other = _server(servers, nbd_servers, tmp_path)
    bound = 4.0
    target, other_target, log_file, writer = _two_volumes_and_a_writer(
        stack, server.uri, bound, other.uri
    )
    try:
        writer.wait_for(5, timeout=PROMPTLY)
        server.kill()  # and it stays away
        _ends_with_an_error(writer, PROMPTLY)
    finally:
        writer.stopping.set()
    _node_lets_go(stack, target, other_target)
    log = Path(log_file).read_text(errors="replace")
    assert "no connection for" in log, log


def test_after_the_bound_later_requests_fail_at_once_until_the_server_is_back(
    servers: list[Server], nbd_servers: NBDServerFactory, stack: BlockStack, tmp_path: Path
) -> None:
    """The bound is the export's, like a kernel device's dead connection timeout: a
    request made after it has passed does not wait it again."""
    server = _server(servers, nbd_servers, tmp_path)
    bound = 16.0
    device, _, _ = _attach(stack, server.uri, bound)
    fd = os.open(_disk_file(device), os.O_RDWR)
    try:
        assert os.pwrite(fd, b"y" * 4096, 0) == 4096
        server.kill()
        started = time.monotonic()
        with pytest.raises(OSError) as first:
            os.pread(fd, 4096, 4 * MiB)
        assert first.value.errno == errno.EIO
        assert time.monotonic() - started >= bound - 1  # it waited for the server
        started = time.monotonic()
        with pytest.raises(OSError) as later:
            os.pread(fd, 4096, 8 * MiB)
        assert later.value.errno == errno.EIO
        assert time.monotonic() - started < bound / 2, "a later request waited the bound anew"
        server.start()
        reads_again(fd, b"y" * 4096, within=PROMPTLY)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


@pytest.mark.parametrize("server_state", ["stopped", "killed"])
def test_sigterm_ends_the_fuse_process_within_seconds(
    servers: list[Server],
    nbd_servers: NBDServerFactory,
    stack: BlockStack,
    tmp_path: Path,
    server_state: str,
) -> None:
    """stopped (SIGSTOP): requests in flight get no answer; killed: requests wait to
    reconnect.  Either way SIGTERM fails them.  A server that is gone fails the final
    flush at once too, and the process ends well within 10 s; a server that does not
    answer is given the final flush's bound, and the process ends within its stop
    bound (it flushed a write it had acknowledged, or tried to)."""
    server = _server(servers, nbd_servers, tmp_path)
    device, pid, log_file = _attach(stack, server.uri, LONG_TIMEOUT)
    disk = _disk_file(device)
    fd = os.open(disk, os.O_RDWR)
    results: list[BaseException | int] = []

    def read() -> None:
        try:
            results.append(len(os.pread(fd, 65536, 8 * MiB)))
        except OSError as e:
            results.append(e)

    reader = threading.Thread(target=read, daemon=True)
    try:
        assert os.pwrite(fd, b"x" * 4096, 0) == 4096
        assert server.proc is not None
        if server_state == "stopped":
            server.signal_all(signal.SIGSTOP)
        else:
            server.kill()
        reader.start()
        time.sleep(1.0)  # the read is in flight (or waiting for a connection)
        assert reader.is_alive() and not results
        os.kill(pid, signal.SIGTERM)
        started = time.monotonic()
        within = 10.0 if server_state == "killed" else stop_bound(1)
        while _alive(pid) and time.monotonic() - started < within:
            time.sleep(0.05)
        assert not _alive(pid), f"the FUSE process is still running {within:.0f} s after SIGTERM"
        reader.join(PROMPTLY)
        assert not reader.is_alive()
        assert isinstance(results[0], OSError), results
        log = Path(log_file).read_text(errors="replace")
        if server_state == "stopped":
            assert "the last flush was not answered" in log, log
        # its mount went with it; detaching still finds and frees the loop device
        assert detach_fuse_block(server.uri, stack.state_dir)
        stack.attached.remove(server.uri)
        assert loop_status(device) is None
    finally:
        server.signal_all(signal.SIGCONT)
        with contextlib.suppress(OSError):  # ENOTCONN: its FUSE process is gone
            os.close(fd)


def _disk_file(device: str) -> str:
    with open(f"/sys/block/{os.path.basename(device)}/loop/backing_file") as f:
        return f.read().strip()


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
