"""Mounts, bind mounts and filesystems on a node: the tools, run safely.

What is mounted where (the mount table), mounting, bind-mounting and
unmounting, idempotently; whether mounts made under kubelet's directory
reach the host; making a filesystem only on a blank device, and growing
one.  Every tool runs from an argv list with a timeout, in the C locale,
with mount options from an allowlist; a tool that fails is a
:class:`MountError` (argv, exit status, stderr), a device or mount in a
state the operation must not touch a :class:`FilesystemError` (nothing
changed).

The names here are what the node plugin, the stage steps and ``moorage
attach|mount`` use; the package's modules are its inside.
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
    detect_filesystem,
    device_bytes,
    filesystem_bytes,
    format_device,
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
    mount_entries,
    mount_entry,
    mounts_of_device,
    resolve_to_mount_point,
)
from csi.mounts.validation import validate_options
from hostio.mountinfo import MountEntry

__all__ = [
    "FSTYPES",
    "MOUNT_FLAGS",
    "FilesystemError",
    "MountEntry",
    "MountError",
    "MountOptionError",
    "OnlineGrowUnsupported",
    "PropagationError",
    "bind_mount",
    "check_propagation",
    "detect_filesystem",
    "device_bytes",
    "filesystem_bytes",
    "format_device",
    "grow_filesystem",
    "grow_filesystem_offline",
    "mount",
    "mount_entries",
    "mount_entry",
    "mounts_of_device",
    "resolve_to_mount_point",
    "set_mount_flags",
    "set_read_only",
    "unmount",
    "validate_options",
]
