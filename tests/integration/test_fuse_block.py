"""The FUSE block file + loop device path (``fuse.blockdev``) against real NBD servers.

Every test runs against moorage's own server (``moorage nbd serve``) or
``qemu-nbd`` (the peer), or both, on a sparse image in the test's tmp dir.
An export is attached with :func:`attach_fuse_block` (a ``python -m
fuse.blockfile`` process and a loop device), formatted with mkfs.ext4 /
mkfs.xfs and mounted with the kernel's own filesystems.  A :class:`BlockStack`
(``tests/fuse_block_stack.py``) remembers what a test attached and mounted and
takes it down in reverse whatever happened, then checks that no mount, loop
device or FUSE process of the test is left (``/proc/mounts``, ``losetup -a``,
``pgrep -f fuse.blockfile``).

ext4 grows offline here: online resize2fs needs CAP_SYS_RESOURCE, which
this environment drops ("Permission denied to resize filesystem").
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fuse.blockdev import (
    attach_fuse_block,
    detach_fuse_block,
    list_attachments,
    reconcile_attachments,
    refresh_size,
)
from fuse.blockfile import (
    BACKGROUND_LIMIT,
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    FALLOC_FL_ZERO_RANGE,
)
from fuse.loop import LoopBusy, loop_status
from fuse.process import fusectl
from nbd.libnbd import NBDClient
from tests.conftest import NBDServerFactory, free_port, run, sparse_image, wait_for_port
from tests.fuse_block_stack import (
    IMAGE_SIZE,
    IO_TIMEOUT,
    BlockStack,
    MiB,
    Writer,
    leftovers,
    mkfs,
    reads_again,
)

PAYLOAD_FILES = 8
PAYLOAD_FILE_SIZE = 25 * MiB  # 200 MiB in all


# ------------------------------------------------------------------ servers


class NBDServer:
    """One image behind one NBD server on a fixed port, killable and restartable."""

    kind: str
    image: Path
    port: int

    @property
    def uri(self) -> str:
        return f"nbd://127.0.0.1:{self.port}/disk"

    def start(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class MoorageServer(NBDServer):
    kind = "moorage"

    def __init__(self, factory: NBDServerFactory, image: Path) -> None:
        self.factory = factory
        self.image = image
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = self.factory.start({"disk": self.image}, port=self.port).proc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        self.factory.stop_all()


class QemuNBDServer(NBDServer):
    kind = "qemu-nbd"

    def __init__(self, image: Path, log: Path) -> None:
        self.image = image
        self.log = log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["qemu-nbd", "--format=raw", "--export-name=disk", "--bind=127.0.0.1"]
        argv += [f"--port={self.port}", "--persistent", "--shared=16", "--discard=unmap"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([*argv, str(self.image)], stdout=out, stderr=out)
        wait_for_port(self.port, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def nbd_server(
    kind: str, nbd_servers: NBDServerFactory, tmp_path: Path, size: int = IMAGE_SIZE
) -> Iterator[NBDServer]:
    image = sparse_image(tmp_path / f"{kind}.img", size)
    server: NBDServer
    if kind == "moorage":
        server = MoorageServer(nbd_servers, image)
    else:
        server = QemuNBDServer(image, tmp_path / "qemu-nbd.log")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["moorage", "qemu-nbd"])
def server(
    request: pytest.FixtureRequest, nbd_servers: NBDServerFactory, tmp_path: Path
) -> Iterator[NBDServer]:
    with nbd_server(request.param, nbd_servers, tmp_path) as s:
        yield s


@pytest.fixture
def moorage_server(nbd_servers: NBDServerFactory, tmp_path: Path) -> Iterator[NBDServer]:
    with nbd_server("moorage", nbd_servers, tmp_path) as s:
        yield s


# ------------------------------------------------------------------ the stack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[BlockStack]:
    s = BlockStack(tmp_path)
    try:
        yield s
    finally:
        s.close()


# ------------------------------------------------------------------ file systems


def fsck_clean(fstype: str, device: str) -> None:
    """A read-only check that finds nothing to repair (it exits non-zero otherwise)."""
    if fstype == "ext4":
        run(["fsck.ext4", "-fn", device])
    else:
        run(["xfs_repair", "-n", device])


def write_random_files(directory: Path, count: int, size: int) -> dict[str, str]:
    """``count`` files of random bytes, fsynced; their sha256 by name."""
    sums = {}
    for i in range(count):
        data = os.urandom(size)
        path = directory / f"random-{i:02d}.bin"
        with path.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        sums[path.name] = hashlib.sha256(data).hexdigest()
    return sums


def checksums(directory: Path, names: Iterator[str] | list[str]) -> dict[str, str]:
    sums = {}
    for name in names:
        digest = hashlib.sha256()
        with (directory / name).open("rb") as f:
            while chunk := f.read(4 * MiB):
                digest.update(chunk)
        sums[name] = digest.hexdigest()
    return sums


def capacity(target: Path) -> int:
    st = os.statvfs(target)
    return st.f_blocks * st.f_frsize


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_filesystem_survives_detach_and_reattach(
    server: NBDServer, stack: BlockStack, fstype: str
) -> None:
    attachment = stack.attach(server.uri)
    assert os.stat(attachment.file).st_size == IMAGE_SIZE
    assert list_attachments(stack.state_dir) == [attachment]
    mkfs(fstype, attachment.device)
    target = stack.mount(attachment.device, fstype)
    written = write_random_files(target, PAYLOAD_FILES, PAYLOAD_FILE_SIZE)
    stack.umount(target)
    stack.detach(attachment)
    assert list_attachments(stack.state_dir) == []

    again = stack.attach(server.uri)
    fsck_clean(fstype, again.device)
    target = stack.mount(again.device, fstype)
    assert checksums(target, list(written)) == written


def test_attach_is_idempotent_and_detach_refuses_a_mounted_device(
    moorage_server: NBDServer, stack: BlockStack
) -> None:
    attachment = stack.attach(moorage_server.uri)
    assert attach_fuse_block(moorage_server.uri, stack.state_dir) == attachment
    assert reconcile_attachments(stack.state_dir) == []
    mkfs("ext4", attachment.device)
    target = stack.mount(attachment.device, "ext4")
    with pytest.raises(LoopBusy):
        detach_fuse_block(attachment.device, stack.state_dir)
    assert list_attachments(stack.state_dir) == [attachment]  # nothing was changed
    (target / "still-here").write_bytes(b"yes")
    stack.umount(target)
    stack.detach(attachment)
    assert not detach_fuse_block(attachment.device, stack.state_dir)  # twice: nothing to do
    assert not detach_fuse_block(attachment.uri, stack.state_dir)


def grow_image(server: NBDServer, size: int) -> None:
    """Grow the image; qemu-nbd reads the size only at start, so it is restarted."""
    os.truncate(server.image, size)
    if server.kind == "qemu-nbd":
        server.kill()
        server.start()


def test_xfs_grows_online(server: NBDServer, stack: BlockStack) -> None:
    attachment = stack.attach(server.uri)
    mkfs("xfs", attachment.device)
    target = stack.mount(attachment.device, "xfs")
    written = write_random_files(target, 2, 4 * MiB)
    before = capacity(target)

    grow_image(server, IMAGE_SIZE + 256 * MiB)
    assert refresh_size(attachment) == IMAGE_SIZE + 256 * MiB
    status = loop_status(attachment.device)
    assert status is not None and status.size == IMAGE_SIZE + 256 * MiB
    run(["xfs_growfs", str(target)])
    assert capacity(target) - before >= 250 * MiB
    assert checksums(target, list(written)) == written
    stack.umount(target)
    fsck_clean("xfs", attachment.device)


def test_ext4_grows_offline(moorage_server: NBDServer, stack: BlockStack) -> None:
    attachment = stack.attach(moorage_server.uri)
    mkfs("ext4", attachment.device)
    target = stack.mount(attachment.device, "ext4")
    written = write_random_files(target, 2, 4 * MiB)
    before = capacity(target)
    stack.umount(target)

    grow_image(moorage_server, IMAGE_SIZE + 256 * MiB)
    assert refresh_size(attachment) == IMAGE_SIZE + 256 * MiB
    run(["e2fsck", "-f", "-p", attachment.device])  # resize2fs wants a fresh check
    run(["resize2fs", attachment.device])
    target = stack.mount(attachment.device, "ext4")
    assert capacity(target) - before >= 250 * MiB
    assert checksums(target, list(written)) == written


def test_server_restart_is_a_pause_not_an_error(server: NBDServer, stack: BlockStack) -> None:
    attachment = stack.attach(server.uri)
    mkfs("ext4", attachment.device)
    target = stack.mount(attachment.device, "ext4")
    writer = Writer(target)
    writer.start()
    restarted = False
    try:
        writer.wait_for(10, timeout=30)
        server.kill()
        time.sleep(1.5)  # writes and fsyncs under way wait for the server
        during = len(writer.done)
        server.start()
        restarted = True
        writer.wait_for(during + 10, timeout=60)  # I/O resumed
    finally:
        if not restarted:
            server.start()  # what was written must reach it before teardown
        writer.stopping.set()
        writer.join(IO_TIMEOUT * 2)
    assert not writer.is_alive()
    assert writer.error is None, writer.error
    log = Path(attachment.log_file).read_text()
    assert "connection lost" in log and "connected again" in log, log
    stack.umount(target)
    stack.detach(attachment)

    again = stack.attach(server.uri)
    fsck_clean("ext4", again.device)
    target = stack.mount(again.device, "ext4")
    assert checksums(target, list(writer.done)) == writer.done


def test_requests_fail_after_the_timeout_and_work_again_later(
    moorage_server: NBDServer, stack: BlockStack
) -> None:
    attachment = attach_fuse_block(moorage_server.uri, stack.state_dir, timeout=2.0)
    stack.attached.append(attachment.uri)
    fd = os.open(attachment.file, os.O_RDWR)
    try:
        os.pwrite(fd, b"x" * 4096, 0)
        moorage_server.kill()
        started = time.monotonic()
        with pytest.raises(OSError) as failed:
            os.pread(fd, 4096, 8192)
        assert failed.value.errno == errno.EIO
        assert 1.5 < time.monotonic() - started < 10
        moorage_server.start()
        reads_again(fd, b"x" * 4096, within=30)
    finally:
        os.close(fd)


def test_teardown_after_a_failure_leaves_nothing(moorage_server: NBDServer, tmp_path: Path) -> None:
    s = BlockStack(tmp_path)
    with pytest.raises(RuntimeError, match="the test failed here"):
        try:
            attachment = s.attach(moorage_server.uri)
            mkfs("ext4", attachment.device)
            target = s.mount(attachment.device, "ext4")
            (target / "file").write_bytes(os.urandom(MiB))
            fd = os.open(target / "file", os.O_RDONLY)  # a busy mount, an open file
            try:
                assert leftovers(tmp_path)  # all three are there
                raise RuntimeError("the test failed here")
            finally:
                os.close(fd)
        finally:
            s.close()  # asserts that nothing is left
    assert leftovers(tmp_path) == []


def fallocate(path: str, mode: int, offset: int, length: int) -> None:
    """fallocate(2) on the file (what a loop device does for discard and write-zeroes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, mode, offset, length) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
    finally:
        os.close(fd)


def test_fallocate_zeroes_ranges(moorage_server: NBDServer, stack: BlockStack) -> None:
    """FUSE_FALLOCATE through the mount: punching a hole and zeroing a range read back as
    zeroes from the export; a plain allocation keeps the data; what would change the
    size is refused."""
    with NBDClient.open(moorage_server.uri, meta_contexts=()) as client:
        client.pwrite(b"\xaa" * (3 * MiB), 0)
        client.flush()
    attachment = stack.attach(moorage_server.uri)
    fallocate(attachment.file, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, MiB)
    fallocate(attachment.file, FALLOC_FL_ZERO_RANGE, 2 * MiB, MiB)
    fallocate(attachment.file, 0, MiB, MiB)  # plain allocation: the data stays
    with pytest.raises(OSError) as refused:
        fallocate(attachment.file, FALLOC_FL_PUNCH_HOLE, 0, MiB)  # would change the size
    assert refused.value.errno == errno.EOPNOTSUPP
    with pytest.raises(OSError) as beyond:
        fallocate(attachment.file, 0, IMAGE_SIZE, MiB)  # would grow it
    assert beyond.value.errno == errno.EOPNOTSUPP
    with NBDClient.open(moorage_server.uri, meta_contexts=()) as client:
        assert client.pread(MiB, 0) == bytes(MiB)
        assert client.pread(MiB, MiB) == b"\xaa" * MiB
        assert client.pread(MiB, 2 * MiB) == bytes(MiB)
    # and through the loop device: discard (BLKDISCARD) becomes a punched hole
    with NBDClient.open(moorage_server.uri, meta_contexts=()) as client:
        client.pwrite(b"\xbb" * MiB, 4 * MiB)
        client.flush()
    run(["blkdiscard", "--offset", str(4 * MiB), "--length", str(MiB), attachment.device])
    with NBDClient.open(moorage_server.uri, meta_contexts=()) as client:
        assert client.pread(MiB, 4 * MiB) == bytes(MiB)


def timed(fn: Callable[[], object]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def test_throughput_is_reported(
    nbd_servers: NBDServerFactory,
    stack: BlockStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """dd of 256 MiB to and from the loop device, and nbdcopy of the same (printed only)."""
    size = 256 * MiB
    source = tmp_path / "random.bin"
    source.write_bytes(os.urandom(size))
    with nbd_server("moorage", nbd_servers, tmp_path, size) as server:
        copy_in = timed(lambda: run(["nbdcopy", str(source), server.uri]))
        copy_out = timed(lambda: run(["nbdcopy", server.uri, "null:"]))
        attachment = stack.attach(server.uri)
        try:  # detached while the server still runs
            dev = attachment.device
            dd = ["dd", "bs=1M", "count=256", "status=none"]
            write = timed(
                lambda: run([*dd, f"if={source}", f"of={dev}", "oflag=direct", "conv=fsync"])
            )
            read = timed(lambda: run([*dd, f"if={dev}", "of=/dev/null", "iflag=direct"]))
            run([*dd, f"if={dev}", f"of={tmp_path / 'back.bin'}", "iflag=direct"])
            back = checksums(tmp_path, ["back.bin", "random.bin"])
            assert back["back.bin"] == back["random.bin"]
            status = loop_status(dev)
        finally:
            stack.detach(attachment)
    rate = {
        name: size / MiB / seconds
        for name, seconds in [("w", write), ("r", read), ("ci", copy_in), ("co", copy_out)]
    }
    with capsys.disabled():
        print(
            f"\n256 MiB, moorage nbd server on loopback, loop dio={status and status.direct_io}:"
            f"\n  dd -> loop device (O_DIRECT, fsync): {rate['w']:7.1f} MiB/s"
            f"\n  dd <- loop device (O_DIRECT):        {rate['r']:7.1f} MiB/s"
            f"\n  nbdcopy file -> export:              {rate['ci']:7.1f} MiB/s"
            f"\n  nbdcopy export -> null:              {rate['co']:7.1f} MiB/s"
        )


def test_block_file_mount_keeps_more_requests_in_flight(
    moorage_server: NBDServer, stack: BlockStack
) -> None:
    """The kernel's default of 12 background FUSE requests is raised (our FUSE_INIT
    answer; read back through fusectl)."""
    attachment = stack.attach(moorage_server.uri)
    minor = os.minor(os.stat(attachment.file).st_dev)
    background, congestion = fusectl(minor, {"max_background": None, "congestion_threshold": None})
    assert int(background) == BACKGROUND_LIMIT
    assert int(congestion) == BACKGROUND_LIMIT * 3 // 4
