"""Attaching NBD exports as block devices and mounting NFS exports on this node.

Each has a kernel path and a FUSE fallback; one module a job:

- ``paths``: which block path (kernel-nbd or fuse-loop) and NFS path
  (kernel-nfs or fuse-nfs) this host uses, and why (:func:`probe`, a
  :class:`Plan`), or the one configuration forces;
- ``block``: attach, detach, refresh and check block devices, remembered
  under a state directory;
- ``nfs``: mount and unmount NFS exports;
- ``errors``: :class:`AttachError`, and :class:`PathUnavailable` for a path
  this host cannot use.

This package's names are the API the node plugin, the stage steps and
``moorage attach|mount`` use, so they are gathered here; each is defined in
the module above that holds its job.
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
from csi.attach.nfs import (
    FUSE_NFS_FSTYPE,
    NFS_PORT,
    mount_nfs_export,
    unmount_nfs,
    validate_export,
)
from csi.attach.paths import (
    BLOCK_PATH_ENV,
    BLOCK_PATHS,
    NFS_PATH_ENV,
    NFS_PATHS,
    BlockPath,
    NFSPath,
    Plan,
    max_volumes,
    probe,
)
from csi.attach.reconnect import Reconnector

__all__ = [
    "BLOCK_PATHS",
    "BLOCK_PATH_ENV",
    "FUSE_NFS_FSTYPE",
    "NFS_PATHS",
    "NFS_PATH_ENV",
    "NFS_PORT",
    "AttachError",
    "BlockAttachment",
    "BlockPath",
    "NFSPath",
    "PathUnavailable",
    "Plan",
    "Reconnector",
    "attach_block",
    "block_attachment_problem",
    "detach_block",
    "list_block_attachments",
    "max_volumes",
    "mount_nfs_export",
    "probe",
    "reconcile_block_attachments",
    "refresh_block",
    "unmount_nfs",
    "validate_export",
]
