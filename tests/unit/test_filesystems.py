"""Image sizes for volume filesystems: what ``fs_image_size`` promises without mkfs.

The sizes are checked against real filesystems in tests/integration/test_pool.py
(usable space of fresh xfs and ext4 volumes).
"""

from __future__ import annotations

from backend.filesystems import XFS_MIN_IMAGE, fs_image_size

MiB = 1 << 20
GiB = 1 << 30


def test_fs_image_size_is_monotonic_and_respects_the_xfs_minimum() -> None:
    for fs_type in ("xfs", "ext4"):
        sizes = [1, MiB, 64 * MiB, 299 * MiB, 300 * MiB, GiB, 5 * GiB, 1 << 40]
        images = [fs_image_size(s, fs_type) for s in sizes]
        assert images == sorted(images)
        assert all(
            image > size and image % MiB == 0 for image, size in zip(images, sizes, strict=True)
        )
    assert fs_image_size(1, "xfs") == XFS_MIN_IMAGE
