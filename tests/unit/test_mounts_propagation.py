"""Whether the node plugin's mounts would reach the host: mountinfo's propagation
tags, and which setups ``csi.mounts.check_propagation`` refuses.

Each test writes the table the module reads in place of
``/proc/self/mountinfo`` (the ``mountinfo`` fixture); the mount a path lies
on is still the kernel's (its mount id), tagged as the test's table says.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from csi import mounts
from tests.mountinfo_lines import mountinfo_line

FIX = "mount propagation of the kubelet dir must be Bidirectional/shared"
PRIVATE = "which is private: mounts made on it never leave this mount namespace"
SLAVE = "which is a slave (HostToContainer)"

# The optional fields mountinfo shows for the kubelet directory: on the host
# or in a pod with mountPropagation Bidirectional, in a pod with
# HostToContainer or None, and odder cases; then (peer group, master, why it
# is refused or None).
CASES = {
    "host-or-bidirectional": ("shared:1", 1, None, None),
    "host-to-container": ("master:1", None, 1, SLAVE),
    "none": ("", None, None, PRIVATE),
    "shared-and-slave": ("shared:7 master:1", 7, 1, None),
    "slave-from-a-hidden-peer": ("master:3 propagate_from:2", None, 3, SLAVE),
    "unbindable": ("unbindable", None, None, PRIVATE),
}


def mount_id(path: Path) -> int:
    """The kernel's id of the mount ``path`` lies on."""
    fd = os.open(path, os.O_PATH)
    try:
        fdinfo = Path(f"/proc/self/fdinfo/{fd}").read_text()
    finally:
        os.close(fd)
    return int(next(line for line in fdinfo.splitlines() if line.startswith("mnt_id:")).split()[1])


@pytest.mark.parametrize("case", list(CASES))
def test_propagation_tags_are_read_and_decide_the_start(
    case: str, tmp_path: Path, mountinfo: Path
) -> None:
    optional, peer_group, master, refusal = CASES[case]
    real = mount_id(tmp_path)
    mountinfo.write_text(
        mountinfo_line(real, "/var/lib/kubelet", "/dev/vda", "ext4", optional=optional) + "\n"
    )
    (entry,) = mounts.mount_entries()
    assert (entry.peer_group, entry.master) == (peer_group, master)
    kubelet = tmp_path / "kubelet"
    if refusal is None:
        assert mounts.check_propagation(kubelet).mount_id == real
        return
    with pytest.raises(mounts.PropagationError) as caught:
        mounts.check_propagation(kubelet)
    problem = str(caught.value)
    assert problem.startswith(f"{FIX}: {kubelet} lies on the mount at /var/lib/kubelet, {refusal}")
    assert "mountPropagation: Bidirectional" in problem
    assert "\n" not in problem


def test_the_tags_do_not_shift_the_other_fields(mountinfo: Path) -> None:
    mountinfo.write_text(
        "615 590 0:52 / /var/lib/kubelet rw shared:7 master:1 - tmpfs tmpfs rw\n"
        "614 590 254:0 /var/lib/kubelet /var/lib/kubelet rw,relatime - ext4 /dev/vda rw\n"
    )
    tagged, bare = mounts.mount_entries()
    assert tagged.optional_fields == ("shared:7", "master:1")
    assert (tagged.mount_point, tagged.fstype, tagged.source) == (
        "/var/lib/kubelet",
        "tmpfs",
        "tmpfs",
    )
    assert bare.optional_fields == ()
    assert (bare.fstype, bare.source, bare.root) == ("ext4", "/dev/vda", "/var/lib/kubelet")


def test_a_missing_path_lies_on_its_nearest_existing_parents_mount(
    tmp_path: Path, mountinfo: Path
) -> None:
    real = mount_id(tmp_path)
    mountinfo.write_text(mountinfo_line(real, "/the-mount", "tmpfs", "tmpfs") + "\n")
    assert mounts.check_propagation(tmp_path / "not" / "yet").mount_id == real


@pytest.mark.parametrize(
    ("optional", "refused"),
    [("shared:4", False), ("shared:4 master:1", False), ("", True), ("master:1", True)],
)
def test_check_propagation_reads_the_mount_the_directory_lies_on(
    optional: str, refused: bool, tmp_path: Path, mountinfo: Path
) -> None:
    real = mount_id(tmp_path)
    mountinfo.write_text(
        mountinfo_line(real + 1000, "/the-mount", "other", "tmpfs")
        + "\n"
        # the same mount point, mounted over: the kernel's id tells them apart
        + mountinfo_line(real, "/the-mount", "tmpfs", "tmpfs", optional=optional)
    )
    kubelet = tmp_path / "kubelet"
    if refused:
        with pytest.raises(mounts.PropagationError, match=FIX) as caught:
            mounts.check_propagation(kubelet)
        assert f"{kubelet} lies on the mount at /the-mount" in str(caught.value)
    else:
        assert mounts.check_propagation(kubelet).mount_id == real


def test_a_mount_outside_the_table_is_refused(tmp_path: Path, mountinfo: Path) -> None:
    other = mountinfo_line(mount_id(tmp_path) + 1000, "/", "/dev/vda", "ext4")
    mountinfo.write_text(other + "\n")
    with pytest.raises(mounts.PropagationError, match="outside this mount namespace"):
        mounts.check_propagation(tmp_path)
