"""The kernel's own mount table read through hostio by every layer, with awkward names.

Mount points whose names hold a space, a tab, a newline, a backslash, UTF-8
and bytes that are not UTF-8 are made for real; the storage node's mount
table, the CSI plugin's and the FUSE layer's loop device lookup all find
them under the names ``os`` gives them.  Runs as root, on the ``disks``
fixture (which unmounts whatever a test leaves).
"""

from __future__ import annotations

import os
from pathlib import Path

from backend.mounts import mount_table
from csi import mounts
from fuse.loop import loop_mountpoints
from hostio import tools
from hostio.mountinfo import read_mountinfo
from tests.disks import Disks

MiB = 1 << 20
AWKWARD = [
    "with space",
    "tab\there",
    "new\nline",
    "back\\slash",
    "café",
    os.fsdecode(b"not-utf8-\xff\xfe"),
    "octal-looking \\040 text",
]


def test_awkward_mount_points_are_found_by_every_layer(disks: Disks) -> None:
    points = [disks.dir(name) for name in AWKWARD]
    for point in points:
        tools.run(["mount", "-t", "tmpfs", "-o", "size=1m", "moorage test", str(point)], timeout=60)
    entries = {e.mount_point: e for e in read_mountinfo()}
    backend_view = mount_table()
    for point in points:
        assert os.listdir(point.parent).count(point.name) == 1
        entry = entries[str(point)]
        assert (entry.fstype, entry.source) == ("tmpfs", "moorage test")
        assert backend_view[point] == "moorage test"
        assert mounts.mount_entry(point) is not None


def test_a_loop_device_mounted_on_an_awkward_name_is_found_by_its_number(disks: Disks) -> None:
    device = disks.loop(64 * MiB)
    mounts.format_device(device, "ext4")
    target = disks.dir(os.fsdecode(b"loop \t\\ caf\xc3\xa9 \xff"))
    mounts.mount(device, target, "ext4")
    assert loop_mountpoints(device) == [str(target)]
    assert [Path(e.mount_point) for e in mounts.mounts_of_device(device)] == [target]
