"""``csi.mounts.mounting`` for real: mount, bind mounts of directories and files, unmount.

Runs as root, on the ``disks`` fixture (tests/integration/conftest.py), which
unmounts and detaches whatever a test leaves behind.
"""

from __future__ import annotations

import errno

import pytest

from csi import mounts
from csi.mounts import FilesystemError, MountError, MountOptionError
from tests.disks import Disks

MiB = 1 << 20


def test_mount_and_unmount_are_idempotent(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    other = disks.loop(64 * MiB, name="other")
    mounts.format_device(device, "ext4")
    mounts.format_device(other, "ext4")
    mnt = disks.dir("a mount point")
    assert mounts.mount_entry(mnt) is None
    mounts.mount(device, mnt, "ext4", ["noatime"])
    mounts.mount(device, mnt, "ext4", ["noatime"])  # already there: no-op
    assert len([e for e in mounts.mount_entries() if e.mount_point == str(mnt)]) == 1
    entry = mounts.mount_entry(mnt)
    assert entry is not None
    assert (entry.source, entry.fstype) == (device, "ext4")
    assert "noatime" in entry.mount_options and not entry.read_only
    with pytest.raises(FilesystemError, match="already has"):
        mounts.mount(other, mnt, "ext4")
    mounts.unmount(mnt)
    assert mounts.mount_entry(mnt) is None
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
    assert mounts.mount_entry(mnt) is None


def test_options_are_validated_before_mount_runs(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    mounts.format_device(device, "ext4")
    mnt = disks.dir("mnt")
    for bad in (["rw,exec\n"], ["rw,exec"], ["ro\nrw"], ["nosuid", "a b"]):
        with pytest.raises(MountOptionError):
            mounts.mount(device, mnt, "ext4", bad)
    assert mounts.mount_entry(mnt) is None


def test_bind_mounts_of_directories_and_files_are_in_the_mount_table(disks: Disks) -> None:
    source = disks.dir("source dir")
    (source / "sub").mkdir()
    target = disks.dir("bound\there with spaces")
    assert mounts.mount_entry(target) is None
    mounts.bind_mount(source, target)
    assert mounts.mount_entry(target) is not None
    assert mounts.mount_entry(target / "sub") is None
    assert mounts.mount_entry(source) is None

    file_source = source / "a file"
    file_source.write_text("content\n")
    file_target = disks.base / "target file"
    file_target.touch()
    mounts.bind_mount(file_source, file_target)
    assert mounts.mount_entry(file_target) is not None
    assert file_target.read_text() == "content\n"
    mounts.bind_mount(file_source, file_target)  # again: no-op
    with pytest.raises(FilesystemError, match="another mount"):
        mounts.bind_mount(source / "sub", target)
    mounts.unmount(file_target)
    mounts.unmount(target)
    assert mounts.mount_entry(file_target) is None
    assert mounts.mount_entry(target) is None


def test_a_read_only_bind_mount_refuses_writes(disks: Disks) -> None:
    source = disks.dir("src")
    target = disks.dir("ro target")
    mounts.bind_mount(source, target, read_only=True)
    entry = mounts.mount_entry(target)
    assert entry is not None and entry.read_only
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
