"""Attaching NBD exports as block devices and mounting NFS exports on this node.

Each has a kernel path (kernel nbd, the kernel's NFS client) and a FUSE
fallback for hosts without the module; which one this host uses, and why,
is a :class:`Plan`.  Block attachments are recorded under a state
directory, so that a restarted node plugin or ``moorage attach`` finds,
reconnects and detaches what it attached.  Everything that fails raises
:class:`AttachError` (:class:`PathUnavailable` for a path this host cannot
use).

The names here are what the node plugin, the stage steps and ``moorage
attach|mount`` use; the package's modules are its inside.
"""

from __future__ import annotations

from csi.attach.block import (
    BlockAttachment,
    attach_block,
    block_attachment_problem,
    detach_block,
    list_block_attachments,
    reconcile_block_attachments,
    refresh_block,
)
from csi.attach.errors import AttachError, PathUnavailable
from csi.attach.limits import VolumeLimit, volume_limit
from csi.attach.nfs import (
    NFS_PORT,
    mount_nfs_export,
    unmount_nfs,
    validate_export,
)
from csi.attach.paths import (
    Plan,
    probe,
)
from csi.attach.reconnect import Reconnector

__all__ = [
    "NFS_PORT",
    "AttachError",
    "BlockAttachment",
    "PathUnavailable",
    "Plan",
    "Reconnector",
    "VolumeLimit",
    "attach_block",
    "block_attachment_problem",
    "detach_block",
    "list_block_attachments",
    "mount_nfs_export",
    "probe",
    "reconcile_block_attachments",
    "refresh_block",
    "unmount_nfs",
    "validate_export",
    "volume_limit",
]
