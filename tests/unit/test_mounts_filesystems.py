"""``csi.mounts.filesystems`` without root: checks before any tool runs, blank detection.

What formats and grows for real is in tests/integration/test_mounts_filesystems.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from csi import mounts
from csi.mounts import FilesystemError, MountError, MountOptionError, filesystems, tools


@pytest.mark.parametrize(
    ("label", "fstype"), [("a" * 17, "ext4"), ("a" * 13, "xfs"), ("bad label", "ext4")]
)
def test_format_refuses_bad_labels_before_probing(
    label: str, fstype: str, calls: list[list[str]]
) -> None:
    with pytest.raises(MountOptionError, match="label"):
        mounts.format_device("/dev/loop0", fstype, label=label)
    assert calls == []


def test_only_ext4_and_xfs_are_made(calls: list[list[str]]) -> None:
    with pytest.raises(MountOptionError, match="unsupported filesystem"):
        mounts.format_device("/dev/loop0", "btrfs")
    with pytest.raises(MountOptionError, match="absolute path"):
        mounts.format_device("loop0", "ext4")
    assert calls == []


def test_xfs_cannot_grow_offline() -> None:
    with pytest.raises(FilesystemError, match="xfs cannot grow offline"):
        mounts.grow_filesystem_offline("/dev/loop0", "xfs")


def test_a_refused_online_ext4_grow_says_to_unmount(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    entry = mounts.MountEntry(
        30, 1, 7, 3, "/", str(tmp_path), ("rw",), "ext4", "/dev/loop3", ("rw",)
    )
    monkeypatch.setattr(filesystems, "_resolve_grow_target", lambda target: ("/dev/loop3", entry))

    def refused(argv: Sequence[str], timeout: float, ok: Sequence[int] = (0,)) -> None:
        raise MountError(argv, 1, "resize2fs 1.47.0\nresize2fs: Permission denied to resize")

    monkeypatch.setattr(tools, "run", refused)
    with pytest.raises(mounts.OnlineGrowUnsupported, match="must be unmounted") as caught:
        mounts.grow_filesystem(tmp_path, "ext4")
    assert isinstance(caught.value.__cause__, MountError)


def test_a_zeroed_image_is_blank(tmp_path: Path) -> None:
    image = tmp_path / "blank.img"
    image.write_bytes(b"")
    os.truncate(image, 8 << 20)
    assert mounts.detect_filesystem(str(image)) is None


def test_data_without_a_signature_is_not_blank(tmp_path: Path) -> None:
    image = tmp_path / "data.img"
    image.write_bytes(b"")
    os.truncate(image, 8 << 20)
    with image.open("r+b") as f:
        f.seek(700 * 1024)
        f.write(os.urandom(4096))
    with pytest.raises(FilesystemError, match="without a filesystem signature"):
        mounts.detect_filesystem(str(image))


def test_a_partition_table_is_not_blank(tmp_path: Path) -> None:
    image = tmp_path / "mbr.img"
    image.write_bytes(b"")
    os.truncate(image, 8 << 20)
    mbr = bytearray(512)
    # one Linux partition from sector 2048, and the boot signature
    mbr[446:462] = (
        bytes([0, 0, 0, 0, 0x83, 0, 0, 0])
        + (2048).to_bytes(4, "little")
        + (8192).to_bytes(4, "little")
    )
    mbr[510:512] = b"\x55\xaa"
    with image.open("r+b") as f:
        f.write(mbr)
    with pytest.raises(FilesystemError, match=r"partition table \(dos\)"):
        mounts.detect_filesystem(str(image))
