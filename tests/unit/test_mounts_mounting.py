"""``csi.mounts.mounting`` without root: the argv run, idempotence, nothing run on bad input.

What mounts for real is in tests/integration/test_mounts_mounting.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from csi import mounts
from csi.mounts import FilesystemError, MountOptionError, tools
from tests.mountinfo_lines import mountinfo_line


def test_mount_refuses_bad_options_before_running_anything(
    tmp_path: Path, mountinfo: Path, calls: list[list[str]]
) -> None:
    with pytest.raises(MountOptionError):
        mounts.mount("/dev/loop0", tmp_path, "ext4", ["rw,exec\n"])
    with pytest.raises(MountOptionError):
        mounts.mount("/dev/loop0", tmp_path, "ext4 -o exec")
    with pytest.raises(MountOptionError):
        mounts.mount("--bind", tmp_path)
    assert calls == []


def test_mount_runs_one_argv_with_options_joined(
    tmp_path: Path, mountinfo: Path, calls: list[list[str]]
) -> None:
    target = tmp_path / "with space"
    target.mkdir()
    mounts.mount("srv:/volumes/x", target, "nfs4", ["port=2049", "vers=4.1"])
    assert calls == [
        ["mount", "-t", "nfs4", "-o", "port=2049,vers=4.1", "--", "srv:/volumes/x", str(target)]
    ]


def test_mount_of_the_same_source_again_is_a_no_op_and_another_is_refused(
    tmp_path: Path, mountinfo: Path, calls: list[list[str]]
) -> None:
    target = Path(os.path.realpath(tmp_path))
    mountinfo.write_text(mountinfo_line(30, str(target), "srv:/a", "nfs4") + "\n")
    mounts.mount("srv:/a", target, "nfs4", ["vers=4.1"])
    with pytest.raises(FilesystemError, match="already has srv:/a"):
        mounts.mount("srv:/b", target, "nfs4")
    with pytest.raises(FilesystemError, match="already mounted read-write"):
        mounts.mount("srv:/a", target, "nfs4", ["ro"])
    assert calls == []


def test_unmount_of_what_is_not_mounted_runs_nothing(
    tmp_path: Path, mountinfo: Path, calls: list[list[str]]
) -> None:
    mounts.unmount(tmp_path)
    mounts.unmount(tmp_path / "missing", lazy=True)
    assert calls == []


def test_a_read_only_bind_is_a_bind_then_a_remount(
    tmp_path: Path, mountinfo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    calls: list[list[str]] = []

    def fake_run(argv: Sequence[str], timeout: float, ok: Sequence[int] = (0,)) -> None:
        calls.append(list(argv))
        if "--bind" in argv:  # the remount looks for the bind in the mount table
            mountinfo.write_text(
                mountinfo_line(40, os.path.realpath(target), "/dev/vda", "ext4") + "\n"
            )

    monkeypatch.setattr(tools, "run", fake_run)
    mounts.bind_mount(source, target, read_only=True)
    assert calls == [
        ["mount", "--bind", "--", str(source), str(target)],
        ["mount", "-o", "remount,bind,ro", "--", str(target)],
    ]
