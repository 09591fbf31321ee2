"""``csi.mounts`` for real: loop devices on sparse files, real mkfs, mount, grow, fsck.

Runs as root.  Every loop device and mount a test makes is recorded by the
``disks`` fixture, whose teardown unmounts (lazily if busy) everything mounted
under the test's directory and detaches its loop devices, whether the test
passed or not.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from csi import mounts
from csi.mounts import FilesystemError, MountError, MountOptionError
from tests.conftest import run

MiB = 1 << 20
XFS_MIN = 512 * MiB  # mkfs.xfs wants more than 300 MB
CAP_SYS_RESOURCE = 24


class Disks:
    """Loop devices over sparse images, and directories, under one test's tmp_path."""

    def __init__(self, base: Path) -> None:
        self.base = Path(os.path.realpath(base))
        self.loops: list[str] = []

    def image(self, name: str, size: int) -> Path:
        path = self.base / f"{name}.img"
        with path.open("wb") as f:
            f.truncate(size)
        return path

    def loop(self, size: int, name: str = "disk") -> str:
        image = self.image(f"{name}-{len(self.loops)}", size)
        device = run(["losetup", "--find", "--show", str(image)]).stdout.strip()
        self.loops.append(device)
        return device

    def backing(self, device: str) -> Path:
        return Path(run(["losetup", "--noheadings", "-O", "BACK-FILE", device]).stdout.strip())

    def grow(self, device: str, size: int) -> None:
        """Grow the image and tell the loop device (losetup -c)."""
        os.truncate(self.backing(device), size)
        run(["losetup", "-c", device])

    def dir(self, name: str) -> Path:
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def cleanup(self) -> None:
        # deepest first, so nested mounts come off before their parents
        ours = [
            e.mount_point
            for e in mounts.mount_entries()
            if e.mount_point.startswith(str(self.base) + "/")
        ]
        for target in sorted(ours, key=len, reverse=True):
            done = subprocess.run(["umount", "--", target], capture_output=True, timeout=60)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", "--", target], capture_output=True, timeout=60)
        for device in self.loops:
            subprocess.run(["losetup", "-d", device], capture_output=True, timeout=60)


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[Disks]:
    d = Disks(tmp_path)
    try:
        yield d
    finally:
        d.cleanup()
        leftover = [e.mount_point for e in mounts.mount_entries() if str(d.base) in e.mount_point]
        assert leftover == [], f"teardown left mounts: {leftover}"


def blkid_uuid(device: str) -> str:
    return run(["blkid", "-p", "-o", "value", "-s", "UUID", device]).stdout.strip()


def has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << CAP_SYS_RESOURCE))
    return False


def fs_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


# ------------------------------------------------------------------ formatting


@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_a_blank_device_is_formatted_once(disks: Disks, fstype: str) -> None:
    device = disks.loop(XFS_MIN)
    assert mounts.detect_filesystem(device) is None
    assert mounts.format_device(device, fstype, label="vol1") is True
    assert mounts.detect_filesystem(device) == fstype
    uuid = blkid_uuid(device)
    assert run(["blkid", "-p", "-o", "value", "-s", "LABEL", device]).stdout.strip() == "vol1"
    # formatting again is a no-op: same filesystem, same UUID
    assert mounts.format_device(device, fstype) is False
    assert blkid_uuid(device) == uuid


def test_another_filesystem_is_refused_and_left_untouched(disks: Disks) -> None:
    device = disks.loop(XFS_MIN)
    mnt = disks.dir("mnt")
    mounts.format_device(device, "xfs")
    mounts.mount(device, mnt, "xfs")
    (mnt / "keep.txt").write_text("precious\n")
    mounts.unmount(mnt)
    uuid = blkid_uuid(device)
    with pytest.raises(FilesystemError, match="already holds a xfs filesystem, not ext4"):
        mounts.format_device(device, "ext4")
    assert mounts.detect_filesystem(device) == "xfs"
    assert blkid_uuid(device) == uuid
    mounts.mount(device, mnt, "xfs", ["ro"])
    assert (mnt / "keep.txt").read_text() == "precious\n"


def test_a_device_with_unknown_data_is_never_taken_for_blank(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    garbage = os.urandom(8192)
    with open(device, "r+b") as f:
        f.seek(300 * 1024)
        f.write(garbage)
        os.fsync(f.fileno())
    for fstype in ("ext4", "xfs"):
        with pytest.raises(FilesystemError, match="refusing to treat it as blank"):
            mounts.format_device(device, fstype)
    with open(device, "rb") as f:
        f.seek(300 * 1024)
        assert f.read(8192) == garbage


def test_formatting_a_mounted_device_is_refused(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    mounts.format_device(device, "ext4")
    mnt = disks.dir("mnt")
    mounts.mount(device, mnt, "ext4")
    with pytest.raises(FilesystemError, match="is mounted on"):
        mounts.fsck(device, "ext4")
    with pytest.raises(FilesystemError, match="is mounted on"):
        mounts.grow_filesystem_offline(device, "ext4")


# ------------------------------------------------------------------ mounting


def test_mount_and_unmount_are_idempotent(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    other = disks.loop(64 * MiB, name="other")
    mounts.format_device(device, "ext4")
    mounts.format_device(other, "ext4")
    mnt = disks.dir("a mount point")
    assert not mounts.is_mount_point(mnt)
    mounts.mount(device, mnt, "ext4", ["noatime"])
    mounts.mount(device, mnt, "ext4", ["noatime"])  # already there: no-op
    assert len([e for e in mounts.mount_entries() if e.mount_point == str(mnt)]) == 1
    info = mounts.mount_info(mnt)
    assert info is not None
    assert (info.source, info.fstype) == (device, "ext4")
    assert "noatime" in info.options and "rw" in info.options
    with pytest.raises(FilesystemError, match="already has"):
        mounts.mount(other, mnt, "ext4")
    mounts.unmount(mnt)
    assert not mounts.is_mount_point(mnt)
    mounts.unmount(mnt)  # not mounted: no-op
    mounts.unmount(disks.base / "never-existed")


def test_a_failed_mount_carries_the_tools_stderr(disks: Disks) -> None:
    device = disks.loop(64 * MiB)  # blank: nothing to mount
    mnt = disks.dir("mnt")
    with pytest.raises(MountError) as caught:
        mounts.mount(device, mnt, "ext4")
    assert caught.value.returncode not in (None, 0)
    assert caught.value.argv[:3] == ("mount", "-t", "ext4")
    assert caught.value.stderr  # mount's own words ("wrong fs type, bad option, ...")
    assert not mounts.is_mount_point(mnt)


def test_options_are_validated_before_mount_runs(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    mounts.format_device(device, "ext4")
    mnt = disks.dir("mnt")
    for bad in (["rw,exec\n"], ["rw,exec"], ["ro\nrw"], ["nosuid", "a b"]):
        with pytest.raises(MountOptionError):
            mounts.mount(device, mnt, "ext4", bad)
    assert not mounts.is_mount_point(mnt)


def test_is_mount_point_sees_bind_mounts_of_directories_and_files(disks: Disks) -> None:
    source = disks.dir("source dir")
    (source / "sub").mkdir()
    target = disks.dir("bound\there with spaces")
    assert not mounts.is_mount_point(target)
    mounts.bind_mount(source, target)
    assert mounts.is_mount_point(target)
    assert not mounts.is_mount_point(target / "sub")
    assert not mounts.is_mount_point(source)

    file_source = source / "a file"
    file_source.write_text("content\n")
    file_target = disks.base / "target file"
    file_target.touch()
    mounts.bind_mount(file_source, file_target)
    assert mounts.is_mount_point(file_target)
    assert file_target.read_text() == "content\n"
    mounts.bind_mount(file_source, file_target)  # again: no-op
    with pytest.raises(FilesystemError, match="another mount"):
        mounts.bind_mount(source / "sub", target)
    mounts.unmount(file_target)
    mounts.unmount(target)
    assert not mounts.is_mount_point(file_target)
    assert not mounts.is_mount_point(target)


def test_a_read_only_bind_mount_refuses_writes(disks: Disks) -> None:
    source = disks.dir("src")
    target = disks.dir("ro target")
    mounts.bind_mount(source, target, read_only=True)
    info = mounts.mount_info(target)
    assert info is not None and "ro" in info.options
    with pytest.raises(OSError) as caught:
        (target / "new").write_text("x")
    assert caught.value.errno == errno.EROFS
    (source / "through-source").write_text("y")  # the source itself stays writable
    assert (target / "through-source").read_text() == "y"
    mounts.bind_mount(source, target, read_only=True)  # again: no-op
    # a read-only bind of a file
    (source / "f").write_text("data")
    file_target = disks.base / "ro-file"
    file_target.touch()
    mounts.bind_mount(source / "f", file_target, read_only=True)
    with pytest.raises(OSError) as caught:
        file_target.open("a").close()
    assert caught.value.errno == errno.EROFS
    # asking for read-write brings an existing bind to read-write
    mounts.bind_mount(source, target, read_only=False)
    (target / "now-writable").write_text("z")


# ------------------------------------------------------------------ growing and checking


def test_xfs_grows_online_after_the_device_grows(disks: Disks) -> None:
    device = disks.loop(XFS_MIN)
    mnt = disks.dir("mnt")
    mounts.format_device(device, "xfs")
    mounts.mount(device, mnt, "xfs")
    (mnt / "data").write_bytes(b"x" * MiB)
    before = fs_bytes(mnt)
    disks.grow(device, 2 * XFS_MIN)
    mounts.grow_filesystem(mnt, "xfs")
    grown = fs_bytes(mnt)
    assert grown > before + XFS_MIN * 9 // 10
    mounts.grow_filesystem(device, "xfs")  # by device, and at full size already: no change
    assert fs_bytes(mnt) == grown
    assert (mnt / "data").read_bytes() == b"x" * MiB


def test_xfs_does_not_grow_unmounted(disks: Disks) -> None:
    device = disks.loop(XFS_MIN)
    mounts.format_device(device, "xfs")
    with pytest.raises(FilesystemError, match="only while mounted"):
        mounts.grow_filesystem(device, "xfs")


def test_ext4_grows_offline_and_online_only_where_the_kernel_allows(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    mnt = disks.dir("mnt")
    mounts.format_device(device, "ext4")
    mounts.mount(device, mnt, "ext4")
    (mnt / "data").write_bytes(b"y" * MiB)
    before = fs_bytes(mnt)
    disks.grow(device, 128 * MiB)
    if has_cap_sys_resource():
        mounts.grow_filesystem(mnt, "ext4")
        assert fs_bytes(mnt) > before + 50 * MiB
        return
    with pytest.raises(mounts.OnlineGrowUnsupported, match="must be unmounted"):
        mounts.grow_filesystem(mnt, "ext4")
    assert fs_bytes(mnt) == before
    mounts.unmount(mnt)
    mounts.grow_filesystem_offline(device, "ext4")
    mounts.grow_filesystem_offline(device, "ext4")  # already full size: nothing to do
    assert mounts.fsck(device, "ext4").clean
    mounts.mount(device, mnt, "ext4")
    assert fs_bytes(mnt) > before + 50 * MiB
    assert (mnt / "data").read_bytes() == b"y" * MiB
    # unmounted, grow_filesystem takes the offline path itself
    mounts.unmount(mnt)
    disks.grow(device, 160 * MiB)
    mounts.grow_filesystem(device, "ext4")
    mounts.mount(device, mnt, "ext4")
    assert fs_bytes(mnt) > before + 80 * MiB


@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_fsck_checks_without_changing(disks: Disks, fstype: str) -> None:
    device = disks.loop(XFS_MIN)
    mounts.format_device(device, fstype)
    result = mounts.fsck(device, fstype)
    assert result.clean, result.output


def test_fsck_reports_an_inconsistent_ext4_and_repairs_nothing(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    mounts.format_device(device, "ext4")
    # a wrong link count on the root directory: what e2fsck -n finds and may not fix
    run(["debugfs", "-w", "-R", "sif <2> links_count 7", device])
    result = mounts.fsck(device, "ext4")
    assert not result.clean
    assert "Inode 2 ref count is 7" in result.output
    assert not mounts.fsck(device, "ext4").clean  # still there: nothing was repaired
