"""``csi.mounts.propagation``: mountinfo's propagation tags, and which setups refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from csi import mounts
from csi.mounts import table
from csi.mounts.propagation import FIX, propagation_problem
from tests.mountinfo_lines import mountinfo_line

# As mountinfo shows the kubelet directory: on the host, in a pod per
# mountPropagation (Bidirectional, HostToContainer, None), and odder cases.
SAMPLES = {
    "host": "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw",
    "bidirectional": "612 590 254:0 /var/lib/kubelet /var/lib/kubelet rw,relatime shared:1 "
    "- ext4 /dev/vda rw",
    "host-to-container": "613 590 254:0 /var/lib/kubelet /var/lib/kubelet rw,relatime master:1 "
    "- ext4 /dev/vda rw",
    "none": "614 590 254:0 /var/lib/kubelet /var/lib/kubelet rw,relatime - ext4 /dev/vda rw",
    "shared-and-slave": "615 590 0:52 / /var/lib/kubelet rw shared:7 master:1 - tmpfs tmpfs rw",
    "slave-from-a-hidden-peer": "616 590 0:52 / /k rw master:3 propagate_from:2 - tmpfs t rw",
    "unbindable": "617 590 0:52 / /k rw unbindable - tmpfs tmpfs rw",
}
EXPECTED = {  # (peer group, master, refused)
    "host": (1, None, False),
    "bidirectional": (1, None, False),
    "host-to-container": (None, 1, True),
    "none": (None, None, True),
    "shared-and-slave": (7, 1, False),
    "slave-from-a-hidden-peer": (None, 3, True),
    "unbindable": (None, None, True),
}


@pytest.mark.parametrize("case", list(SAMPLES))
def test_propagation_tags_are_read_and_decide_the_start(case: str) -> None:
    (entry,) = mounts.parse_mountinfo(SAMPLES[case].encode())
    peer_group, master, refused = EXPECTED[case]
    assert (entry.peer_group, entry.master) == (peer_group, master)
    problem = propagation_problem(entry, "/var/lib/kubelet")
    assert (problem is not None) == refused, problem
    if problem is not None:
        assert problem.startswith(FIX + ": /var/lib/kubelet lies on the mount at ")
        assert "mountPropagation: Bidirectional" in problem
        assert "\n" not in problem


def test_the_reason_names_a_private_and_a_slave_mount_apart() -> None:
    private, slave = (
        propagation_problem(mounts.parse_mountinfo(SAMPLES[c].encode())[0], "/k")
        for c in ("none", "host-to-container")
    )
    assert private is not None and "private" in private
    assert slave is not None and "slave (HostToContainer)" in slave


def test_the_tags_do_not_shift_the_other_fields() -> None:
    (entry,) = mounts.parse_mountinfo(SAMPLES["shared-and-slave"].encode())
    assert entry.optional_fields == ("shared:7", "master:1")
    assert (entry.mount_point, entry.fstype, entry.source) == ("/var/lib/kubelet", "tmpfs", "tmpfs")
    (bare,) = mounts.parse_mountinfo(SAMPLES["none"].encode())
    assert bare.optional_fields == ()
    assert bare.fstype == "ext4"


def test_a_missing_path_lies_on_its_nearest_existing_parents_mount(tmp_path: Path) -> None:
    parent = mounts.mount_containing(tmp_path)
    assert parent is not None
    assert str(tmp_path.resolve()).startswith(parent.mount_point)
    assert mounts.mount_containing(tmp_path / "not" / "yet") == parent


def fake_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A mountinfo read instead of the real one (the mount ids stay the kernel's)."""
    fake = tmp_path / "mountinfo"
    monkeypatch.setattr(table, "MOUNTINFO", fake)
    return fake


@pytest.mark.parametrize(
    ("optional", "refused"),
    [("shared:4", False), ("shared:4 master:1", False), ("", True), ("master:1", True)],
)
def test_check_propagation_reads_the_mount_the_directory_lies_on(
    optional: str, refused: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = mounts.mount_containing(tmp_path)  # from the real table
    assert real is not None
    mountinfo = fake_table(tmp_path, monkeypatch)
    mountinfo.write_text(
        mountinfo_line(real.mount_id + 1000, real.mount_point, "other", "tmpfs")
        + "\n"
        # the same mount, as this test's table tags it
        + mountinfo_line(real.mount_id, real.mount_point, "tmpfs", "tmpfs", optional=optional)
    )
    kubelet = tmp_path / "kubelet"
    if refused:
        with pytest.raises(mounts.PropagationError, match=FIX) as caught:
            mounts.check_propagation(kubelet)
        assert f"{kubelet} lies on the mount at {real.mount_point}" in str(caught.value)
    else:
        assert mounts.check_propagation(kubelet).mount_id == real.mount_id


def test_a_mount_outside_the_table_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = mounts.mount_containing(tmp_path)
    assert real is not None
    other = mountinfo_line(real.mount_id + 1000, "/", "/dev/vda", "ext4")
    fake_table(tmp_path, monkeypatch).write_text(other + "\n")
    with pytest.raises(mounts.PropagationError, match="outside this mount namespace"):
        mounts.check_propagation(tmp_path)
