"""``csi.mounts`` filesystems for real: loop devices on sparse files, real mkfs, grow.

Runs as root, on the ``disks`` fixture (tests/integration/conftest.py), which
unmounts and detaches whatever a test leaves behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from csi import mounts
from csi.mounts import FilesystemError
from tests.conftest import run
from tests.disks import Disks

MiB = 1 << 20
XFS_MIN = 512 * MiB  # mkfs.xfs wants more than 300 MB
CAP_SYS_RESOURCE = 24


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


def test_growing_a_mounted_device_offline_is_refused(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    mounts.format_device(device, "ext4")
    mnt = disks.dir("mnt")
    mounts.mount(device, mnt, "ext4")
    with pytest.raises(FilesystemError, match="is mounted on"):
        mounts.grow_filesystem_offline(device, "ext4")


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
    run(["e2fsck", "-f", "-n", device])  # clean: exit status 0
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
def test_the_span_of_a_filesystem_against_its_device(disks: Disks, fstype: str) -> None:
    device = disks.loop(XFS_MIN)
    mnt = disks.dir("mnt")
    mounts.format_device(device, fstype)
    mounts.mount(device, mnt, fstype)
    assert mounts.device_bytes(device) == XFS_MIN
    assert mounts.filesystem_bytes(device, fstype, mnt) == XFS_MIN
    disks.grow(device, 2 * XFS_MIN)
    assert mounts.device_bytes(device) == 2 * XFS_MIN
    assert mounts.filesystem_bytes(device, fstype, mnt) == XFS_MIN  # until it is grown
    if fstype == "xfs":
        with pytest.raises(mounts.FilesystemError, match="read while it is mounted"):
            mounts.filesystem_bytes(device, fstype)
