"""Files held open on FUSE NFS mounts across a restart of their storage node.

A real storage node (``moorage backend serve`` on a loop pool, nfs-ganesha)
exports an NFS volume and a clone of it (two filesystems that began as one)
to 127.0.0.1; ``fuse.nfsmount`` mounts each and the test opens a file on
each for reading and writing.  The storage node is then stopped (ganesha
ends, the volumes are unmounted and their loop devices detached) and started
again, with the loop device the volume had held by another image so that it
comes back on a different device number.  The same file descriptors must
then write, read and stat with no ESTALE, and the data must be intact: NFS
file handles are stable across restarts and pool re-attaches (docs/backend.md).

Every FUSE mount is torn down in a ``finally`` that, when the test failed,
aborts its connection (``/sys/fs/fuse/connections/N/abort``) before anything
else touches the mount (a close of a held file either), so a stuck mount
cannot hang the run; each NFS call of the mount is bounded by its timeout.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from backend.api.proto import backend_pb2 as pb
from fuse.nfsmount import FSTYPE, MountError, is_mounted, mount_nfs, unmount
from fuse.process import fusectl
from tests.backend_node import BackendNode, make_node

MiB = 1 << 20
SIZE = 320 * MiB  # xfs needs 300 MiB
# Each NFS call of the FUSE mount gives up after this: nothing here waits unbounded.
NFS_TIMEOUT = 30.0
NODE_ID, NODE_ADDRESS = "node-a", "127.0.0.1"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[BackendNode]:
    storage = make_node(tmp_path / "node", pool_size=2 << 30)
    try:
        storage.start()
        yield storage
    finally:
        storage.teardown()


def loop_device_of(image: Path) -> str | None:
    out = subprocess.run(
        ["losetup", "--noheadings", "--output", "NAME", "--associated", str(image)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    return out[0] if out else None


@contextlib.contextmanager
def holding(device: str, filler: Path) -> Iterator[None]:
    """Attach ``filler`` to ``device`` so that nobody else gets that device meanwhile."""
    with filler.open("wb") as f:
        f.truncate(MiB)
    subprocess.run(["losetup", device, str(filler)], timeout=30, check=True)
    try:
        yield
    finally:
        subprocess.run(["losetup", "--detach", device], timeout=30, check=False)


def fuse_connection(mountpoint: Path) -> int | None:
    """The FUSE connection number of the mount on ``mountpoint``, from mountinfo
    (never a stat of the mount point, which a stuck daemon would block)."""
    target = os.fsencode(mountpoint)
    with open("/proc/self/mountinfo", "rb") as info:
        for line in info:
            fields = line.split()
            if fields[4] == target and b"fuse." + FSTYPE.encode() in line:
                return int(fields[2].split(b":")[1])
    return None


def end_process(pid: int) -> None:
    """SIGTERM, then SIGKILL, and reap: the mount process is our child."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            time.sleep(0.05)


@dataclass
class HeldMount:
    """A FUSE NFS mount and the files the test holds open on it."""

    mountpoint: Path
    fds: list[int] = field(default_factory=list)

    def open(self, name: str) -> int:
        fd = os.open(self.mountpoint / name, os.O_RDWR | os.O_CREAT, 0o644)
        self.fds.append(fd)
        return fd

    def close(self, fd: int) -> None:
        self.fds.remove(fd)
        os.close(fd)


@contextlib.contextmanager
def fuse_nfs_mount(target: pb.NfsTarget, mountpoint: Path, log: Path) -> Iterator[HeldMount]:
    mountpoint.mkdir(parents=True)
    pid = mount_nfs(
        target.server,
        target.port,
        target.mount_port,
        target.export_path,
        mountpoint,
        foreground=False,
        cache_timeout=0,
        timeout=NFS_TIMEOUT,
        log_file=log,
    )
    held = HeldMount(mountpoint)
    clean = False
    try:
        yield held
        clean = True
    finally:
        if not clean:
            # a failed test may have left the daemon stuck: cut it off first, so
            # that nothing below (a close of a held file either) can wait on it
            minor = fuse_connection(mountpoint)
            if minor is not None:
                fusectl(minor, {"abort": 1})
        for fd in held.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            if is_mounted(mountpoint):
                unmount(mountpoint, lazy=not clean, timeout=30)
        except MountError:
            unmount(mountpoint, lazy=True, timeout=30)
        finally:
            end_process(pid)


@pytest.fixture(params=["xfs", "ext4"])
def fs_type(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


BEFORE = b"written before the restart\n"
AFTER = b"written after the restart\n"


def test_open_files_keep_working_across_a_storage_node_restart(
    node: BackendNode, tmp_path: Path, fs_type: str
) -> None:
    # a volume and a clone of it: two filesystems that began as one
    params = {"fs_type": fs_type, "squash": "no_root_squash"}
    with node.client() as c:
        source = c.create_volume(
            pb.CreateVolumeRequest(name="source", type=pb.NFS, size_bytes=SIZE, parameters=params)
        )
        clone = c.create_volume(
            pb.CreateVolumeRequest(
                name="clone", type=pb.NFS, size_bytes=SIZE, parameters=params, volume_id=source.id
            )
        )
        volumes = {v.name: (v, c.publish(v.id, NODE_ID, NODE_ADDRESS).nfs) for v in (source, clone)}
    images = {name: node.pool_dir / "volumes" / f"{v.id}.img" for name, (v, _) in volumes.items()}
    devices_before = {name: loop_device_of(image) for name, image in images.items()}
    assert None not in devices_before.values()

    with contextlib.ExitStack() as stack:
        fds: dict[str, int] = {}
        mounts: dict[str, HeldMount] = {}
        for name, (_, target) in volumes.items():
            mount = stack.enter_context(
                fuse_nfs_mount(target, tmp_path / f"mnt-{name}", tmp_path / f"fuse-{name}.log")
            )
            mounts[name], fds[name] = mount, mount.open("held")
            os.pwrite(fds[name], name.encode() + b" " + BEFORE, 0)
            os.fsync(fds[name])

        node.stop()
        assert all(loop_device_of(image) is None for image in images.values())
        # the pool comes back on other loop devices: the source's is taken meanwhile
        with holding(str(devices_before["source"]), tmp_path / "filler.img"):
            node.start()
        assert loop_device_of(images["source"]) not in (None, devices_before["source"])

        for name, fd in fds.items():
            start = len(name) + 1 + len(BEFORE)
            try:
                os.pwrite(fd, AFTER, start)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the server
                data = os.pread(fd, 4096, 0)
                size = os.fstat(fd).st_size
            except OSError as e:
                if e.errno == errno.ESTALE:
                    pytest.fail(f"{name}: the open file went stale across the restart: {e}")
                raise
            mounts[name].close(fd)
            expected = name.encode() + b" " + BEFORE + AFTER
            assert (data, size) == (expected, len(expected)), name
            # by name too (from the export's root handle), and on the storage node itself
            assert (mounts[name].mountpoint / "held").read_bytes() == expected
            backing = node.pool_dir / "mnt" / volumes[name][0].id / "export" / "held"
            assert backing.read_bytes() == expected
    for name in volumes:
        log = (tmp_path / f"fuse-{name}.log").read_text(errors="replace")
        assert not re.search(r"stale", log, re.IGNORECASE), log
