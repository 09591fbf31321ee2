"""Mounts, bind mounts and filesystems on a node: the tools, run safely.

The node's disk mechanics, one job a module:

- ``tools``: running mount, umount, blkid, mkfs, e2fsck, resize2fs and
  xfs_growfs from argv lists, with a timeout, in the C locale;
- ``validation``: what may go into their argv (mount options from an
  allowlist, filesystem types, paths, devices);
- ``table``: what is mounted where (``/proc/self/mountinfo``);
- ``mounting``: mount, bind mount, read-only remount, unmount;
- ``propagation``: whether mounts made under a directory reach the host
  (kubelet's directory, checked when the node plugin starts);
- ``filesystems``: detect, format (only a blank device), grow, check;
- ``errors``: :class:`MountError` (a tool failed: argv, exit status,
  stderr), :class:`FilesystemError` (a device or mount in a state the
  operation must not touch; nothing changed), :class:`MountOptionError`.

This package's names are the API the node plugin, the stage steps and
``moorage attach|mount`` use, so they are gathered here; each is defined in
the module above that holds its job.
"""

from __future__ import annotations

from csi.mounts.errors import (
    FilesystemError,
    MountError,
    MountOptionError,
    OnlineGrowUnsupported,
)
from csi.mounts.filesystems import (
    FSTYPES,
    FsckResult,
    Fstype,
    detect_filesystem,
    device_bytes,
    filesystem_bytes,
    format_device,
    fsck,
    grow_filesystem,
    grow_filesystem_offline,
)
from csi.mounts.mounting import (
    MOUNT_FLAGS,
    bind_mount,
    mount,
    set_mount_flags,
    set_read_only,
    unmount,
)
from csi.mounts.propagation import PropagationError, check_propagation
from csi.mounts.table import (
    MountInfo,
    is_mount_point,
    mount_containing,
    mount_entries,
    mount_entry,
    mount_info,
    mounts_of_device,
    resolve_to_mount_point,
)
from csi.mounts.validation import validate_options
from hostio.mountinfo import MountEntry, parse_mountinfo

__all__ = [
    "FSTYPES",
    "MOUNT_FLAGS",
    "FilesystemError",
    "FsckResult",
    "Fstype",
    "MountEntry",
    "MountError",
    "MountInfo",
    "MountOptionError",
    "OnlineGrowUnsupported",
    "PropagationError",
    "bind_mount",
    "check_propagation",
    "detect_filesystem",
    "device_bytes",
    "filesystem_bytes",
    "format_device",
    "fsck",
    "grow_filesystem",
    "grow_filesystem_offline",
    "is_mount_point",
    "mount",
    "mount_containing",
    "mount_entries",
    "mount_entry",
    "mount_info",
    "mounts_of_device",
    "parse_mountinfo",
    "resolve_to_mount_point",
    "set_mount_flags",
    "set_read_only",
    "unmount",
    "validate_options",
]
