"""``csi.mounts`` reading the mount table: escapes, odd lines, the mount on a path.

Each test writes the table the module reads in place of
``/proc/self/mountinfo`` (the ``mountinfo`` fixture).
"""

from __future__ import annotations

import os
from pathlib import Path

from csi import mounts
from tests.mountinfo_lines import mountinfo_line


def test_mountinfo_escapes_are_decoded(mountinfo: Path) -> None:
    mountinfo.write_text(
        "\n".join(
            [
                mountinfo_line(30, "/mnt/with space", "/dev/loop3", "ext4"),
                mountinfo_line(31, "/mnt/tab\there", "srv:/export dir", "nfs4", optional=""),
                mountinfo_line(
                    32, "/mnt/back\\slash\nnewline", "tmpfs", "tmpfs", optional="master:2 shared:3"
                ),
            ]
        )
    )
    entries = mounts.mount_entries()
    assert [e.mount_point for e in entries] == [
        "/mnt/with space",
        "/mnt/tab\there",
        "/mnt/back\\slash\nnewline",
    ]
    assert entries[1].source == "srv:/export dir"
    assert entries[1].fstype == "nfs4"
    assert (entries[0].major, entries[0].minor) == (7, 3)
    assert entries[2].fstype == "tmpfs"


def test_mountinfo_non_utf8_path_round_trips_through_fsdecode(mountinfo: Path) -> None:
    mountinfo.write_bytes(b"40 1 0:5 / /mnt/caf\xe9 rw - tmpfs tmpfs rw\n")
    (entry,) = mounts.mount_entries()
    assert os.fsencode(entry.mount_point) == b"/mnt/caf\xe9"


def test_malformed_mountinfo_lines_are_skipped(mountinfo: Path) -> None:
    mountinfo.write_text("garbage\n" + mountinfo_line(5, "/x", "/dev/sda1", "xfs") + "\n1 2 3\n")
    assert [e.mount_point for e in mounts.mount_entries()] == ["/x"]


def test_the_mount_on_a_path_is_found_exactly_and_through_symlinks(
    tmp_path: Path, mountinfo: Path
) -> None:
    base = Path(os.path.realpath(tmp_path))
    mounted = base / "with space"
    mounted.mkdir()
    (mounted / "sub").mkdir()
    plain = base / "plain"
    plain.mkdir()
    file_target = base / "device-file"
    file_target.touch()
    (base / "link").symlink_to(mounted)
    mountinfo.write_text(
        mountinfo_line(30, str(mounted), "/dev/loop3", "ext4")
        + "\n"
        + mountinfo_line(31, str(file_target), "devtmpfs", "devtmpfs", root="/loop3")
        + "\n"
    )
    for path in (mounted, str(mounted) + "/", base / "link"):
        entry = mounts.mount_entry(path)
        assert entry is not None and entry.mount_id == 30, path
    entry = mounts.mount_entry(file_target)  # a bind mount of a file
    assert entry is not None and entry.mount_id == 31
    assert mounts.mount_entry(mounted / "sub") is None
    assert mounts.mount_entry(plain) is None
    assert mounts.mount_entry(base / "missing") is None


def test_the_topmost_mount_is_the_one_on_a_path_and_read_only_counts_either_flag(
    tmp_path: Path, mountinfo: Path
) -> None:
    target = Path(os.path.realpath(tmp_path))
    mountinfo.write_text(
        mountinfo_line(30, str(target), "/dev/loop3", "ext4", super_options="rw,data=ordered")
        + "\n"
        + mountinfo_line(
            31,
            str(target),
            "/dev/loop4",
            "xfs",
            dev="7:4",
            options="rw,noatime",
            super_options="ro,attr2,inode64",
        )
        + "\n"
    )
    entry = mounts.mount_entry(target)
    assert entry is not None
    assert (entry.source, entry.fstype) == ("/dev/loop4", "xfs")
    assert entry.read_only  # the superblock is, though the mount says rw
    assert "noatime" in entry.mount_options and "inode64" in entry.super_options
    assert mounts.mount_entry(target / "nothing") is None
