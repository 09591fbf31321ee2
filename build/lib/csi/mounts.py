"""Mounts, bind mounts and filesystems on a node: the tools, run safely.

Every tool runs from an argv list (never a shell), with a timeout, in the C
locale, and a failure raises :class:`MountError` carrying the argv, the exit
status and the tool's stderr.  A device or mount found in a state an
operation must not touch raises :class:`FilesystemError` before anything is
changed; mount options that could smuggle in others raise
:class:`MountOptionError`.

What is mounted where comes from ``/proc/self/mountinfo`` (octal escapes such
as ``\\040`` decoded), so bind mounts of single files are seen too, and a
FUSE mount whose daemon died is still found.

Choices:

- **Blank means blank.** :func:`format_device` formats only a device on which
  ``blkid -p`` finds no signature at all *and* whose first MiB is zeros: a
  device holding data nobody recognises is never taken for a new one.
  ``mkfs.ext4`` does not ask before overwriting when stdin is not a terminal,
  so this check is the only guard, and it runs on every call.
- **mkfs discards nothing** (``-E nodiscard``, ``-K``): volumes start as sparse
  images, so a discard pass would only send a TRIM of the whole device across
  NBD or FUSE.  ext4 reserves no blocks for root (``-m 0``): a volume belongs
  to its pod, which usually does not run as root.
- **Growing ext4.** ``resize2fs`` grows a mounted ext4 online only with
  CAP_SYS_RESOURCE; without it :class:`OnlineGrowUnsupported` says the
  filesystem must be unmounted and grown with :func:`grow_filesystem_offline`
  (``e2fsck -f -p``, then ``resize2fs``).  XFS grows only while mounted.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, NamedTuple, get_args

Fstype = Literal["ext4", "xfs"]
FSTYPES: Final[tuple[str, ...]] = get_args(Fstype)

MOUNTINFO = Path("/proc/self/mountinfo")  # module level so tests can point elsewhere

TIMEOUT: Final = 60.0  # mount, umount, blkid
MKFS_TIMEOUT: Final = 600.0
GROW_TIMEOUT: Final = 600.0
FSCK_TIMEOUT: Final = 3600.0

BLANK_PROBE_BYTES: Final = 1 << 20  # what must be zeros for a device without signature
_SBIN_DIRS: Final = ("/usr/local/sbin", "/usr/sbin", "/sbin")

# One mount option: no comma (it would add options), no whitespace, quotes or
# backslashes (mount(8) and the kernel parse those), nothing to start a flag.
_OPTION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/=+@-]*")
_MAX_OPTION = 256
_FSTYPE = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
_LABEL = re.compile(r"[A-Za-z0-9_.-]+")
_LABEL_MAX = {"ext4": 16, "xfs": 12}
# resize2fs's words when the kernel refuses an online resize it could do offline
_ONLINE_REFUSED = ("Permission denied", "Operation not permitted", "not supported")


class MountError(Exception):
    """A tool failed: its argv, its exit status (None: it did not finish) and its stderr."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        status = "did not finish" if returncode is None else f"exited {returncode}"
        super().__init__(f"{shlex.join(self.argv)} {status}: {self.stderr or '(no output)'}")


class FilesystemError(Exception):
    """A device or mount is not in a state the operation may touch; nothing was changed."""


class OnlineGrowUnsupported(FilesystemError):
    """The kernel refused to grow the mounted filesystem: unmount it and grow it offline."""


class MountOptionError(ValueError):
    """A mount option, filesystem type, label or path that is not allowed."""


# ------------------------------------------------------------------ running tools


def _tool(name: str) -> str:
    """The tool's path; sbin directories searched too (a non-root PATH often lacks them)."""
    path = os.environ.get("PATH", os.defpath)
    found = shutil.which(name, path=os.pathsep.join([path, *_SBIN_DIRS]))
    return found or name


def _run(
    argv: Sequence[str], timeout: float, ok: Iterable[int] = (0,)
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; an exit status outside ``ok``, a timeout or a missing tool → MountError."""
    argv = list(argv)
    env = {**os.environ, "LC_ALL": "C"}
    try:
        result = subprocess.run(
            [_tool(argv[0]), *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        raise MountError(argv, None, f"timed out after {timeout:g}s") from e
    except OSError as e:  # not installed, not executable
        raise MountError(argv, None, f"cannot run {argv[0]}: {e.strerror or e}") from e
    if result.returncode not in set(ok):
        raise MountError(argv, result.returncode, result.stderr or result.stdout)
    return result


# ------------------------------------------------------------------ validation


def validate_options(options: Iterable[str]) -> tuple[str, ...]:
    """Each option alone, from an allowlist of characters; a comma-joined string is refused."""
    if isinstance(options, str):
        raise MountOptionError(
            f"mount options must be a list of options, not a string: {options!r}"
        )
    checked: list[str] = []
    for option in options:
        if (
            not isinstance(option, str)
            or len(option) > _MAX_OPTION
            or not _OPTION.fullmatch(option)
        ):
            raise MountOptionError(f"mount option not allowed: {option!r}")
        checked.append(option)
    return tuple(checked)


def _validate_fstype(fstype: str) -> str:
    if not _FSTYPE.fullmatch(fstype):
        raise MountOptionError(f"filesystem type not allowed: {fstype!r}")
    return fstype


def _validate_path(path: str | os.PathLike[str], what: str) -> str:
    text = os.fspath(path)
    if not text or "\0" in text or "\n" in text:
        raise MountOptionError(f"{what} not allowed: {text!r}")
    return os.path.abspath(text)


def _validate_device(device: str | os.PathLike[str]) -> str:
    text = os.fspath(device)
    # absolute, so a tool never takes it for an option
    if not os.path.isabs(text) or "\0" in text or "\n" in text:
        raise MountOptionError(f"a device must be an absolute path: {text!r}")
    return text


def _validate_source(source: str) -> str:
    if not source or source.startswith("-") or any(c in source for c in "\0\n"):
        raise MountOptionError(f"mount source not allowed: {source!r}")
    return source


def _validate_fs(fstype: str) -> Fstype:
    if fstype == "ext4":
        return "ext4"
    if fstype == "xfs":
        return "xfs"
    raise MountOptionError(f"unsupported filesystem {fstype!r}: expected one of {FSTYPES}")


# ------------------------------------------------------------------ mountinfo


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of /proc/self/mountinfo, unescaped."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    mount_options: tuple[str, ...]
    fstype: str
    source: str
    super_options: tuple[str, ...]

    @property
    def read_only(self) -> bool:
        return "ro" in self.mount_options or "ro" in self.super_options


class MountInfo(NamedTuple):
    """What is mounted on a path: source, filesystem type, effective options."""

    source: str
    fstype: str
    options: tuple[str, ...]


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> str:
    """The kernel escapes space, tab, newline and backslash as ``\\ooo``."""
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), field))


def parse_mountinfo(data: bytes) -> list[MountEntry]:
    """Parse mountinfo(5); malformed lines are skipped."""
    entries: list[MountEntry] = []
    for line in data.splitlines():
        fields = line.split(b" ")
        try:
            sep = fields.index(b"-", 6)
            major, minor = fields[2].split(b":")
            entries.append(
                MountEntry(
                    mount_id=int(fields[0]),
                    parent_id=int(fields[1]),
                    major=int(major),
                    minor=int(minor),
                    root=_unescape(fields[3]),
                    mount_point=_unescape(fields[4]),
                    mount_options=tuple(_unescape(fields[5]).split(",")),
                    fstype=_unescape(fields[sep + 1]),
                    source=_unescape(fields[sep + 2]),
                    super_options=tuple(_unescape(fields[sep + 3]).split(","))
                    if len(fields) > sep + 3
                    else (),
                )
            )
        except (ValueError, IndexError):
            continue
    return entries


def mount_entries() -> list[MountEntry]:
    """Every mount this process sees, in mount order."""
    return parse_mountinfo(MOUNTINFO.read_bytes())


def mount_entry(path: str | os.PathLike[str]) -> MountEntry | None:
    """The topmost mount on ``path`` exactly (not on a parent of it), or None."""
    # realpath does not fail on a dead FUSE mount (ENOTCONN): it stops resolving there
    target = os.path.realpath(os.fspath(path))
    found = None
    for entry in mount_entries():
        if entry.mount_point == target:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def is_mount_point(path: str | os.PathLike[str]) -> bool:
    """Whether something (a filesystem, a bind mount of a directory or file) is mounted on path."""
    return mount_entry(path) is not None


def mount_info(path: str | os.PathLike[str]) -> MountInfo | None:
    """(source, fstype, options) of the mount on ``path``; None if nothing is mounted there.

    Options are the mount's own followed by the superblock's; "ro" if either is read-only.
    """
    entry = mount_entry(path)
    if entry is None:
        return None
    options = list(entry.mount_options)
    for option in entry.super_options:
        if option in ("ro", "rw"):
            continue
        if option not in options:
            options.append(option)
    if entry.read_only:
        options = ["ro" if o == "rw" else o for o in options]
        if "ro" not in options:
            options.insert(0, "ro")
    return MountInfo(entry.source, entry.fstype, tuple(options))


def _device_number(device: str) -> int:
    try:
        st = os.stat(device)
    except OSError as e:
        raise FilesystemError(f"{device}: {e.strerror}") from e
    if not stat.S_ISBLK(st.st_mode):
        raise FilesystemError(f"{device} is not a block device")
    return st.st_rdev


def mounts_of_device(device: str | os.PathLike[str]) -> list[MountEntry]:
    """Every mount of the filesystem on block device ``device``."""
    rdev = _device_number(os.fspath(device))
    return [e for e in mount_entries() if (e.major, e.minor) == (os.major(rdev), os.minor(rdev))]


def _refuse_if_mounted(device: str, doing: str) -> None:
    mounts = mounts_of_device(device)
    if mounts:
        where = ", ".join(m.mount_point for m in mounts)
        raise FilesystemError(f"{device} is mounted on {where}: unmount it before {doing}")


# ------------------------------------------------------------------ mounting


def _same_source(entry: MountEntry, source: str, fstype: str | None) -> bool:
    if fstype is not None and entry.fstype != fstype:
        return False
    try:
        st = os.stat(source)
    except OSError:
        return entry.source == source
    if stat.S_ISBLK(st.st_mode):
        return (entry.major, entry.minor) == (os.major(st.st_rdev), os.minor(st.st_rdev))
    return entry.source == source


def mount(
    source: str,
    target: str | os.PathLike[str],
    fstype: str | None = None,
    options: Sequence[str] = (),
    *,
    timeout: float = TIMEOUT,
) -> None:
    """``mount -t FSTYPE -o OPTIONS -- SOURCE TARGET``.

    Idempotent: the same source already mounted on ``target`` (with the same
    read-only-ness) is success; anything else mounted there is a FilesystemError.
    """
    source = _validate_source(source)
    target_path = _validate_path(target, "mount target")
    opts = validate_options(options)
    if fstype is not None:
        _validate_fstype(fstype)
    existing = mount_entry(target_path)
    if existing is not None:
        if not _same_source(existing, source, fstype):
            raise FilesystemError(
                f"{target_path} already has {existing.source} ({existing.fstype}) mounted"
            )
        if ("ro" in opts) != existing.read_only:
            mode = "read-only" if existing.read_only else "read-write"
            raise FilesystemError(f"{source} is already mounted {mode} on {target_path}")
        return
    argv = ["mount"]
    if fstype is not None:
        argv += ["-t", fstype]
    if opts:
        argv += ["-o", ",".join(opts)]
    _run([*argv, "--", source, target_path], timeout)


def set_read_only(target: str | os.PathLike[str], read_only: bool = True) -> None:
    """Make the mount on ``target`` read-only (or writable) for this mount only.

    ``mount -o remount,bind,ro`` changes the per-mount flag, so it works on any
    mount (a bind, a FUSE mount), leaving the filesystem itself as it is.
    """
    target_path = _validate_path(target, "mount target")
    if mount_entry(target_path) is None:
        raise FilesystemError(f"nothing is mounted on {target_path}")
    mode = "ro" if read_only else "rw"
    _run(["mount", "-o", f"remount,bind,{mode}", "--", target_path], TIMEOUT)


def bind_mount(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    read_only: bool = False,
    *,
    timeout: float = TIMEOUT,
) -> None:
    """Bind ``source`` (a directory, or a file onto a file) on ``target``.

    A read-only bind is ``mount --bind`` then ``mount -o remount,bind,ro``
    (the first ignores "ro"); if the remount fails the bind is undone.
    Idempotent: ``source`` already bound there is success, its read-only-ness
    brought to what is asked; another mount there is a FilesystemError.
    """
    source_path = _validate_path(source, "bind source")
    target_path = _validate_path(target, "bind target")
    existing = mount_entry(target_path)
    if existing is not None:
        try:
            same = os.path.samefile(source_path, target_path)
        except OSError:
            same = False
        if not same:
            raise FilesystemError(
                f"{target_path} already has another mount ({existing.source}, {existing.fstype})"
            )
        if existing.read_only != read_only:
            set_read_only(target_path, read_only)
        return
    _run(["mount", "--bind", "--", source_path, target_path], timeout)
    if read_only:
        try:
            set_read_only(target_path, True)
        except BaseException:
            # never leave a writable bind where a read-only one was asked for
            unmount(target_path)
            raise


def unmount(
    target: str | os.PathLike[str], lazy: bool = False, *, timeout: float = TIMEOUT
) -> None:
    """``umount [-l] -- TARGET``; nothing mounted there is success (one mount is removed)."""
    target_path = _validate_path(target, "unmount target")
    if mount_entry(target_path) is None:
        return
    try:
        _run(["umount", *(["-l"] if lazy else []), "--", target_path], timeout)
    except MountError:
        if mount_entry(target_path) is None:  # someone else unmounted it meanwhile
            return
        raise


# ------------------------------------------------------------------ filesystems


def _blkid(device: str) -> tuple[int, dict[str, str], str]:
    argv = ["blkid", "-p", "-o", "export", "--", device]
    # 0: found, 2: nothing found, 8: ambivalent (several signatures)
    result = _run(argv, TIMEOUT, ok=(0, 2, 8))
    values: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    return result.returncode, values, result.stderr.strip()


def _first_bytes_are_zero(device: str, size: int = BLANK_PROBE_BYTES) -> bool:
    with open(device, "rb", buffering=0) as f:
        left = size
        while left > 0:
            chunk = f.read(min(left, 1 << 16))
            if not chunk:
                break
            if chunk.count(0) != len(chunk):
                return False
            left -= len(chunk)
    return True


def detect_filesystem(device: str | os.PathLike[str]) -> str | None:
    """The filesystem type on ``device`` (``blkid -p``), or None for a blank device.

    Blank: no signature of any kind and the first MiB all zeros.  A partition
    table, several signatures, or data without a signature raise
    FilesystemError: such a device must not be taken for a new one.
    """
    dev = _validate_device(device)
    code, values, stderr = _blkid(dev)
    if code == 8:
        raise FilesystemError(f"{dev} holds several signatures, refusing to guess: {stderr}")
    if code == 0:
        if "TYPE" in values:
            return values["TYPE"]
        if "PTTYPE" in values:
            raise FilesystemError(
                f"{dev} has a partition table ({values['PTTYPE']}), not a filesystem"
            )
        found = ", ".join(f"{k}={v}" for k, v in values.items() if k != "DEVNAME")
        raise FilesystemError(f"{dev} has a signature blkid cannot name: {found}")
    try:
        zero = _first_bytes_are_zero(dev)
    except OSError as e:
        raise FilesystemError(f"cannot read {dev}: {e.strerror}") from e
    if not zero:
        raise FilesystemError(
            f"{dev} holds data without a filesystem signature (its first MiB is not zeros): "
            "refusing to treat it as blank"
        )
    return None


def format_device(
    device: str | os.PathLike[str],
    fstype: str,
    label: str | None = None,
    *,
    timeout: float = MKFS_TIMEOUT,
) -> bool:
    """Make a ``fstype`` filesystem on a blank ``device``; True if it formatted.

    Already that filesystem: nothing is done (False).  Another filesystem, or
    data that is not blank: FilesystemError, and the device is untouched.
    """
    dev = _validate_device(device)
    fs = _validate_fs(fstype)
    if label is not None and (not _LABEL.fullmatch(label) or len(label.encode()) > _LABEL_MAX[fs]):
        raise MountOptionError(
            f"{fs} label must be at most {_LABEL_MAX[fs]} of [A-Za-z0-9_.-]: {label!r}"
        )
    existing = detect_filesystem(dev)
    if existing == fs:
        return False
    if existing is not None:
        raise FilesystemError(f"{dev} already holds a {existing} filesystem, not {fs}")
    _refuse_if_mounted(dev, "formatting it")
    labelled = ["-L", label] if label is not None else []
    if fs == "ext4":
        argv = ["mkfs.ext4", "-q", "-m", "0", "-E", "nodiscard", *labelled, dev]
    else:
        argv = ["mkfs.xfs", "-q", "-K", *labelled, dev]
    _run(argv, timeout)
    made = detect_filesystem(dev)
    if made != fs:
        raise FilesystemError(f"{shlex.join(argv)} succeeded but blkid finds {made!r} on {dev}")
    return True


def _resolve_grow_target(target: str) -> tuple[str, MountEntry | None]:
    """(device, its mount or None) for a device path or a mount point."""
    try:
        is_block = stat.S_ISBLK(os.stat(target).st_mode)
    except OSError as e:
        raise FilesystemError(f"{target}: {e.strerror}") from e
    if is_block:
        mounts = mounts_of_device(target)
        return target, (mounts[0] if mounts else None)
    entry = mount_entry(target)
    if entry is None:
        raise FilesystemError(f"{target} is neither a block device nor a mount point")
    return entry.source, entry


def grow_filesystem(
    target_mount_or_device: str | os.PathLike[str], fstype: str, *, timeout: float = GROW_TIMEOUT
) -> None:
    """Grow the filesystem to fill its (already grown) device.

    xfs: ``xfs_growfs -d MOUNTPOINT``, online only (a device is looked up in
    the mount table).  ext4: ``resize2fs DEVICE``: online when mounted (the
    kernel may refuse: OnlineGrowUnsupported), offline when not
    (:func:`grow_filesystem_offline`).  Already full size: nothing changes.
    """
    fs = _validate_fs(fstype)
    target = _validate_path(target_mount_or_device, "filesystem")
    device, entry = _resolve_grow_target(target)
    if entry is not None and entry.fstype != fs:
        raise FilesystemError(f"{target} holds {entry.fstype}, not {fs}")
    if fs == "xfs":
        if entry is None:
            raise FilesystemError(f"xfs grows only while mounted, and {device} is not mounted")
        _run(["xfs_growfs", "-d", entry.mount_point], timeout)
        return
    if entry is None:
        grow_filesystem_offline(device, fs, timeout=timeout)
        return
    try:
        _run(["resize2fs", device], timeout)
    except MountError as e:
        if any(words in e.stderr for words in _ONLINE_REFUSED):
            raise OnlineGrowUnsupported(
                f"the kernel refused to grow the mounted ext4 on {device} "
                f"({entry.mount_point}) online: {e.stderr.splitlines()[-1]}; the filesystem "
                "must be unmounted and grown offline (grow_filesystem_offline)"
            ) from e
        raise


def grow_filesystem_offline(
    device: str | os.PathLike[str], fstype: str, *, timeout: float = GROW_TIMEOUT
) -> None:
    """Grow an unmounted ext4: ``e2fsck -f -p`` then ``resize2fs``."""
    dev = _validate_device(device)
    fs = _validate_fs(fstype)
    if fs == "xfs":
        raise FilesystemError(f"xfs cannot grow offline: mount {dev} and grow it online")
    _refuse_if_mounted(dev, "growing it offline")
    found = detect_filesystem(dev)
    if found != fs:
        raise FilesystemError(f"{dev} holds {found or 'no filesystem'}, not {fs}")
    # 0: clean, 1: errors corrected; anything else needs a person
    _run(["e2fsck", "-f", "-p", dev], FSCK_TIMEOUT, ok=(0, 1))
    _run(["resize2fs", dev], timeout)


@dataclass(frozen=True, slots=True)
class FsckResult:
    """A check-only fsck: whether the filesystem is clean, and what the tool said."""

    clean: bool
    output: str


def fsck(
    device: str | os.PathLike[str], fstype: str, *, timeout: float = FSCK_TIMEOUT
) -> FsckResult:
    """Check an unmounted filesystem without changing it (``e2fsck -f -n``, ``xfs_repair -n``)."""
    dev = _validate_device(device)
    fs = _validate_fs(fstype)
    _refuse_if_mounted(dev, "checking it")
    if fs == "ext4":
        # 0: clean, 4: errors left uncorrected (-n corrects nothing)
        result = _run(["e2fsck", "-f", "-n", dev], timeout, ok=(0, 4))
        clean = result.returncode == 0
    else:
        # 0: clean, 1: corruption found
        result = _run(["xfs_repair", "-n", dev], timeout, ok=(0, 1))
        clean = result.returncode == 0
    return FsckResult(clean, (result.stdout + result.stderr).strip())


__all__ = [
    "FSTYPES",
    "FilesystemError",
    "FsckResult",
    "Fstype",
    "MountEntry",
    "MountError",
    "MountInfo",
    "MountOptionError",
    "OnlineGrowUnsupported",
    "bind_mount",
    "detect_filesystem",
    "format_device",
    "fsck",
    "grow_filesystem",
    "grow_filesystem_offline",
    "is_mount_point",
    "mount",
    "mount_entries",
    "mount_entry",
    "mount_info",
    "mounts_of_device",
    "parse_mountinfo",
    "set_read_only",
    "unmount",
    "validate_options",
]
