"""``csi.mounts.table``: mountinfo parsing, escapes, the mount on a path."""

from __future__ import annotations

import os
from pathlib import Path

from csi import mounts
from tests.mountinfo_lines import mountinfo_line


def test_mountinfo_escapes_are_decoded() -> None:
    text = "\n".join(
        [
            mountinfo_line(30, "/mnt/with space", "/dev/loop3", "ext4"),
            mountinfo_line(31, "/mnt/tab\there", "srv:/export dir", "nfs4", optional=""),
            mountinfo_line(
                32, "/mnt/back\\slash\nnewline", "tmpfs", "tmpfs", optional="master:2 shared:3"
            ),
        ]
    )
    entries = mounts.parse_mountinfo(text.encode())
    assert [e.mount_point for e in entries] == [
        "/mnt/with space",
        "/mnt/tab\there",
        "/mnt/back\\slash\nnewline",
    ]
    assert entries[1].source == "srv:/export dir"
    assert entries[1].fstype == "nfs4"
    assert (entries[0].major, entries[0].minor) == (7, 3)
    assert entries[2].fstype == "tmpfs"


def test_mountinfo_non_utf8_path_round_trips_through_fsdecode() -> None:
    raw = b"40 1 0:5 / /mnt/caf\xe9 rw - tmpfs tmpfs rw\n"
    (entry,) = mounts.parse_mountinfo(raw)
    assert os.fsencode(entry.mount_point) == b"/mnt/caf\xe9"


def test_malformed_mountinfo_lines_are_skipped() -> None:
    text = "garbage\n" + mountinfo_line(5, "/x", "/dev/sda1", "xfs") + "\n1 2 3\n"
    assert [e.mount_point for e in mounts.parse_mountinfo(text.encode())] == ["/x"]


def test_is_mount_point_matches_the_exact_path_and_follows_symlinks(
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
    assert mounts.is_mount_point(mounted)
    assert mounts.is_mount_point(str(mounted) + "/")
    assert mounts.is_mount_point(base / "link")
    assert mounts.is_mount_point(file_target)  # a bind mount of a file
    assert not mounts.is_mount_point(mounted / "sub")
    assert not mounts.is_mount_point(plain)
    assert not mounts.is_mount_point(base / "missing")


def test_mount_info_reports_the_topmost_mount_and_effective_read_only(
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
    info = mounts.mount_info(target)
    assert info is not None
    source, fstype, options = info
    assert (source, fstype) == ("/dev/loop4", "xfs")
    assert options[0] == "ro" and "rw" not in options
    assert "noatime" in options and "inode64" in options
    assert mounts.mount_info(target / "nothing") is None
