"""Filesystems on a node's block devices: detect, format, grow.

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
import stat
from typing import Final, Literal, get_args

from csi.mounts import tools
from csi.mounts.errors import (
    FilesystemError,
    MountError,
    MountOptionError,
    OnlineGrowUnsupported,
)
from csi.mounts.table import mount_entry, mounts_of_device
from csi.mounts.tools import TIMEOUT
from csi.mounts.validation import validate_device, validate_path
from hostio.mountinfo import MountEntry

Fstype = Literal["ext4", "xfs"]
FSTYPES: Final[tuple[str, ...]] = get_args(Fstype)

MKFS_TIMEOUT: Final = 600.0
GROW_TIMEOUT: Final = 600.0
FSCK_TIMEOUT: Final = 3600.0

BLANK_PROBE_BYTES: Final = 1 << 20  # what must be zeros for a device without signature

_LABEL = re.compile(r"[A-Za-z0-9_.-]+")
_LABEL_MAX = {"ext4": 16, "xfs": 12}
# resize2fs's words when the kernel refuses an online resize it could do offline
_ONLINE_REFUSED = ("Permission denied", "Operation not permitted", "not supported")


def _validate_fs(fstype: str) -> Fstype:
    if fstype == "ext4":
        return "ext4"
    if fstype == "xfs":
        return "xfs"
    raise MountOptionError(f"unsupported filesystem {fstype!r}: expected one of {FSTYPES}")


def _refuse_if_mounted(device: str, doing: str) -> None:
    mounts = mounts_of_device(device)
    if mounts:
        where = ", ".join(m.mount_point for m in mounts)
        raise FilesystemError(f"{device} is mounted on {where}: unmount it before {doing}")


def _blkid(device: str) -> tuple[int, dict[str, str], str]:
    argv = ["blkid", "-p", "-o", "export", "--", device]
    # 0: found, 2: nothing found, 8: ambivalent (several signatures)
    result = tools.run(argv, TIMEOUT, ok=(0, 2, 8))
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
    dev = validate_device(device)
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
    dev = validate_device(device)
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
    tools.run(argv, timeout)
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
    target = validate_path(target_mount_or_device, "filesystem")
    device, entry = _resolve_grow_target(target)
    if entry is not None and entry.fstype != fs:
        raise FilesystemError(f"{target} holds {entry.fstype}, not {fs}")
    if fs == "xfs":
        if entry is None:
            raise FilesystemError(f"xfs grows only while mounted, and {device} is not mounted")
        tools.run(["xfs_growfs", "-d", entry.mount_point], timeout)
        return
    if entry is None:
        grow_filesystem_offline(device, fs, timeout=timeout)
        return
    try:
        tools.run(["resize2fs", device], timeout)
    except MountError as e:
        if any(words in e.stderr for words in _ONLINE_REFUSED):
            raise OnlineGrowUnsupported(
                f"the kernel refused to grow the mounted ext4 on {device} "
                f"({entry.mount_point}) online: {e.stderr.splitlines()[-1]}; the filesystem "
                "must be unmounted and grown offline (grow_filesystem_offline)"
            ) from e
        raise


_EXT4_FIELD = r"^{}:\s+(\d+)\s*$"
_XFS_DATA = re.compile(r"^data\s*=\s*bsize=(\d+)\s+blocks=(\d+)", re.M)


def filesystem_bytes(
    device: str | os.PathLike[str], fstype: str, mount_point: str | os.PathLike[str] | None = None
) -> int:
    """How much of ``device`` its filesystem spans (not what is free in it): ext4
    from its superblock (``dumpe2fs -h``, mounted or not), xfs from its geometry
    (``xfs_info MOUNT_POINT``: xfs is read mounted)."""
    dev = validate_device(device)
    fs = _validate_fs(fstype)
    if fs == "ext4":
        out = tools.run(["dumpe2fs", "-h", dev], TIMEOUT).stdout
        count = re.search(_EXT4_FIELD.format("Block count"), out, re.M)
        size = re.search(_EXT4_FIELD.format("Block size"), out, re.M)
        if count and size:
            return int(count[1]) * int(size[1])
    else:
        if mount_point is None:
            raise FilesystemError(f"the size of the xfs on {dev} is read while it is mounted")
        out = tools.run(["xfs_info", validate_path(mount_point, "mount point")], TIMEOUT).stdout
        data = _XFS_DATA.search(out)
        if data:
            return int(data[1]) * int(data[2])
    raise FilesystemError(f"cannot read the size of the {fs} on {dev} from: {out[-300:]!r}")


def device_bytes(device: str | os.PathLike[str]) -> int:
    """A block device's size."""
    fd = os.open(validate_device(device), os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def grow_filesystem_offline(
    device: str | os.PathLike[str], fstype: str, *, timeout: float = GROW_TIMEOUT
) -> None:
    """Grow an unmounted ext4: ``e2fsck -f -p`` then ``resize2fs``."""
    dev = validate_device(device)
    fs = _validate_fs(fstype)
    if fs == "xfs":
        raise FilesystemError(f"xfs cannot grow offline: mount {dev} and grow it online")
    _refuse_if_mounted(dev, "growing it offline")
    found = detect_filesystem(dev)
    if found != fs:
        raise FilesystemError(f"{dev} holds {found or 'no filesystem'}, not {fs}")
    # 0: clean, 1: errors corrected; anything else needs a person
    tools.run(["e2fsck", "-f", "-p", dev], FSCK_TIMEOUT, ok=(0, 1))
    tools.run(["resize2fs", dev], timeout)
