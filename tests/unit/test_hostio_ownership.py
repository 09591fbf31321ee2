"""hostio.ownership: a tree given to a pod's group, links never followed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hostio.ownership import give_to_group

GID = 4321  # no group needs to exist for a number

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's group needs root")


def test_every_file_gets_the_group_and_its_rights_and_links_lead_nowhere(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("not the volume's")
    os.chmod(outside, 0o600)
    root = tmp_path / "volume"
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "file").write_text("data")
    os.chmod(root / "dir" / "file", 0o4700)  # set-user-ID: dropped
    os.mkfifo(root / "fifo", 0o600)
    (root / "dir" / "link").symlink_to(outside)

    assert give_to_group(root, GID) is True

    for path in (root, root / "dir", root / "dir" / "sub"):
        st = path.stat()
        assert st.st_gid == GID
        assert stat.S_IMODE(st.st_mode) & 0o2070 == 0o2070, path  # rwx for the group, setgid
    file = (root / "dir" / "file").stat()
    assert (file.st_gid, stat.S_IMODE(file.st_mode)) == (GID, 0o760)
    fifo = (root / "fifo").stat()
    assert (fifo.st_gid, stat.S_IMODE(fifo.st_mode)) == (GID, 0o600)  # group only
    assert (root / "dir" / "link").lstat().st_gid == GID
    assert (outside.stat().st_gid, stat.S_IMODE(outside.stat().st_mode)) == (0, 0o600)


def test_a_root_that_has_the_group_already_is_left_as_it_is(tmp_path: Path) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    (root / "file").write_text("x")
    os.chown(root, -1, GID)
    assert give_to_group(root, GID) is False
    assert (root / "file").stat().st_gid == 0  # OnRootMismatch: nothing walked


def test_a_root_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        give_to_group(tmp_path / "link", GID)
    assert (tmp_path / "real").stat().st_gid == 0
