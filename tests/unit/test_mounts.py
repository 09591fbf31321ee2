"""``csi.mounts`` without root: mountinfo parsing, validation, tool errors, blank detection.

What mounts, formats and grows for real is in tests/integration/test_mounts.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from csi import mounts
from csi.mounts import FilesystemError, MountError, MountOptionError


def _escape(path: str) -> str:
    """As the kernel writes a path in mountinfo."""
    for char in "\\ \t\n":
        path = path.replace(char, f"\\{ord(char):03o}")
    return path


def _line(
    mount_id: int,
    mount_point: str,
    source: str,
    fstype: str,
    *,
    dev: str = "7:3",
    root: str = "/",
    options: str = "rw,relatime",
    optional: str = "shared:1",
    super_options: str = "rw",
) -> str:
    fields = [str(mount_id), "1", dev, _escape(root), _escape(mount_point), options]
    fields += [*optional.split(), "-", fstype, _escape(source), super_options]
    return " ".join(fields)


@pytest.fixture
def mountinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake /proc/self/mountinfo the module reads instead of the real one."""
    fake = tmp_path / "mountinfo"
    fake.write_text("")
    monkeypatch.setattr(mounts, "MOUNTINFO", fake)
    return fake


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every tool the module would run, recorded instead of run."""
    recorded: list[list[str]] = []

    def fake_run(argv: Sequence[str], timeout: float, ok: Sequence[int] = (0,)) -> object:
        recorded.append(list(argv))
        return None

    monkeypatch.setattr(mounts, "_run", fake_run)
    return recorded


# ------------------------------------------------------------------ mountinfo


def test_mountinfo_escapes_are_decoded() -> None:
    text = "\n".join(
        [
            _line(30, "/mnt/with space", "/dev/loop3", "ext4"),
            _line(31, "/mnt/tab\there", "srv:/export dir", "nfs4", optional=""),
            _line(32, "/mnt/back\\slash\nnewline", "tmpfs", "tmpfs", optional="master:2 shared:3"),
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
    text = "garbage\n" + _line(5, "/x", "/dev/sda1", "xfs") + "\n1 2 3\n"
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
        _line(30, str(mounted), "/dev/loop3", "ext4")
        + "\n"
        + _line(31, str(file_target), "devtmpfs", "devtmpfs", root="/loop3")
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
        _line(30, str(target), "/dev/loop3", "ext4", super_options="rw,data=ordered")
        + "\n"
        + _line(
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


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "option",
    [
        "rw,exec\n",
        "rw,exec",
        "ro\nrw",
        "a b",
        "",
        "-o",
        'context="x"',
        "x\\y",
        "uid=0\0",
        "é",
        "x" * 300,
    ],
)
def test_mount_options_outside_the_allowlist_are_refused(option: str) -> None:
    with pytest.raises(MountOptionError):
        mounts.validate_options([option])


def test_a_comma_joined_string_of_options_is_refused() -> None:
    with pytest.raises(MountOptionError, match="list of options"):
        mounts.validate_options("rw,noexec")


def test_ordinary_mount_options_pass() -> None:
    options = ["ro", "port=2049", "vers=4.1", "addr=fe80::1", "sec=sys", "uid=1000", "x-gvfs"]
    assert mounts.validate_options(options) == tuple(options)


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
    mountinfo.write_text(_line(30, str(target), "srv:/a", "nfs4") + "\n")
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
            mountinfo.write_text(_line(40, os.path.realpath(target), "/dev/vda", "ext4") + "\n")

    monkeypatch.setattr(mounts, "_run", fake_run)
    mounts.bind_mount(source, target, read_only=True)
    assert calls == [
        ["mount", "--bind", "--", str(source), str(target)],
        ["mount", "-o", "remount,bind,ro", "--", str(target)],
    ]


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
    monkeypatch.setattr(mounts, "_resolve_grow_target", lambda target: ("/dev/loop3", entry))

    def refused(argv: Sequence[str], timeout: float, ok: Sequence[int] = (0,)) -> None:
        raise MountError(argv, 1, "resize2fs 1.47.0\nresize2fs: Permission denied to resize")

    monkeypatch.setattr(mounts, "_run", refused)
    with pytest.raises(mounts.OnlineGrowUnsupported, match="must be unmounted") as caught:
        mounts.grow_filesystem(tmp_path, "ext4")
    assert isinstance(caught.value.__cause__, MountError)


# ------------------------------------------------------------------ tools and errors


def test_a_failing_tool_raises_with_its_argv_status_and_stderr() -> None:
    with pytest.raises(MountError) as caught:
        mounts._run(["sh", "-c", "echo 'it broke' >&2; exit 3"], timeout=10)
    error = caught.value
    assert (error.returncode, error.stderr) == (3, "it broke")
    assert error.argv[0] == "sh"
    assert "exited 3: it broke" in str(error)


def test_a_missing_tool_and_a_hung_tool_are_mount_errors() -> None:
    with pytest.raises(MountError, match="cannot run") as missing:
        mounts._run(["moorage-no-such-tool"], timeout=10)
    assert missing.value.returncode is None
    with pytest.raises(MountError, match=r"timed out after 0\.2s"):
        mounts._run(["sleep", "5"], timeout=0.2)


def test_the_tools_run_in_the_c_locale() -> None:
    result = mounts._run(["sh", "-c", 'echo "$LC_ALL"'], timeout=10)
    assert result.stdout.strip() == "C"


# ------------------------------------------------------------------ blank detection


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
