"""NFS exports mounted on this node: the kernel's NFS client, or the FUSE NFS mount.

The same export already mounted on a target is success (its read-only-ness
brought to what is asked); anything else mounted there is an error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from csi import mounts
from csi.attach.errors import AttachError, PathUnavailable
from csi.attach.paths import KERNEL_NFS_FSTYPES, Plan
from csi.config import DEFAULT_IO_TIMEOUT

# The FUSE NFS mount's type in the mount table (fuse.nfsmount.FSTYPE, without importing pyfuse3)
FUSE_NFS_FSTYPE: Final = "fuse.moorage-nfs"
NFS_PORT: Final = 2049

_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_EXPORT_PATH = re.compile(r"/[A-Za-z0-9._/-]*")


def validate_export(server: str, port: int, mount_port: int | None, path: str) -> None:
    """AttachError unless the export is one this plugin would mount."""
    if not _HOST.fullmatch(server):
        raise AttachError(f"NFS server must be a host name or address: {server!r}")
    if not _EXPORT_PATH.fullmatch(path) or "/../" in f"{path}/":
        raise AttachError(f"NFS export path must be an absolute path: {path!r}")
    for p in (port, mount_port):
        if p is not None and not 0 < p < 65536:
            raise AttachError(f"port out of range: {p}")


def _same_export(entry: mounts.MountEntry, server: str, path: str) -> bool:
    if entry.fstype == FUSE_NFS_FSTYPE:
        return entry.source == f"moorage-nfs:{server}:{path}"
    return entry.fstype in KERNEL_NFS_FSTYPES and entry.source == f"{server}:{path}"


def mount_nfs_export(
    server: str,
    port: int,
    mount_port: int | None,
    path: str,
    target: str | os.PathLike[str],
    plan: Plan,
    read_only: bool = False,
    log_file: Path | None = None,
    options: Sequence[str] = (),
    io_timeout: float = DEFAULT_IO_TIMEOUT,
) -> None:
    """Mount ``server:path`` on ``target`` by the plan's NFS path.

    kernel-nfs: ``mount -t nfs4 -o port=PORT,vers=4.1,soft,timeo=T,retrans=2[,ro],OPTIONS
    SERVER:PATH TARGET`` (``mount_port`` is not used by NFSv4; an
    ``nfsvers``/``vers`` in ``options`` replaces the 4.1; ``hard``, ``soft``,
    ``softerr``, ``timeo`` or ``retrans`` there replace ours; see
    :func:`kernel_timeout_options`).  The FUSE path applies only the
    per-mount flags among ``options`` (nosuid, nodev, noexec, the atime
    ones): the caller decides which others it can honour.  fuse-nfs:
    ``fuse.nfsmount`` in a process of its own (NFSv3; ``mount_port`` None
    asks the portmapper), made read-only per mount when asked, then given
    those flags by a bind remount; that process inherits this one's
    stderr (its log) and working directory.  The same export already mounted
    there: its read-only-ness is brought to what is asked; another mount
    there is an error.
    """
    if plan.nfs is None:
        raise PathUnavailable(f"no NFS path on this host: {plan.nfs_reason}")
    validate_export(server, port, mount_port, path)
    target_path = os.path.abspath(target)
    existing = mounts.mount_entry(target_path)
    if existing is not None:
        if not _same_export(existing, server, path):
            raise AttachError(
                f"{target_path} already has {existing.source} ({existing.fstype}) mounted"
            )
        if existing.read_only != read_only:
            mounts.set_read_only(target_path, read_only)
        return
    if plan.nfs == "kernel-nfs":
        extra = [o for o in mounts.validate_options(options) if o not in ("ro", "rw")]
        versioned = any(o.startswith(("vers=", "nfsvers=")) for o in extra)
        kernel_options = [
            f"port={port}",
            *([] if versioned else ["vers=4.1"]),
            *kernel_timeout_options(io_timeout, extra),
            *extra,
            *(["ro"] if read_only else []),
        ]
        mounts.mount(f"{server}:{path}", target_path, "nfs4", kernel_options)
        return
    from fuse import nfsmount

    try:
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
        nfsmount.mount_nfs(
            server,
            port,
            mount_port,
            path,
            target_path,
            foreground=False,
            log_file=log_file,
            timeout=io_timeout,
        )
    except (nfsmount.MountError, OSError, ValueError) as e:
        raise AttachError(str(e)) from e
    # the per-mount flags asked for (nosuid, noexec, noatime, ...) on the FUSE
    # mount itself: the pods' binds copy them, and the mount table shows them
    flags = [o for o in options if o in mounts.MOUNT_FLAGS]
    try:
        if read_only:
            mounts.set_read_only(target_path, True)
        mounts.set_mount_flags(target_path, flags)
    except BaseException:
        # never leave it writable when read-only was asked, nor without the flags asked for
        mounts.unmount(target_path)
        raise


def kernel_timeout_options(io_timeout: float, options: Sequence[str]) -> list[str]:
    """The kernel NFS client's options for failing I/O after about ``io_timeout`` s.

    ``soft``: a request the server has not answered after its retransmissions
    fails with EIO instead of being retried for ever (``hard``, the kernel's
    default, is what hangs a node when a storage node is gone for good).  Over
    TCP each retransmission waits ``timeo`` (tenths of a second) longer than
    the one before, so with ``retrans=2`` a request fails after about
    ``timeo * (1 + 2 + 3)``.  An operator who prefers ``hard`` (or other
    values) says so in the StorageClass's ``mountOptions``: then none of
    ours is added.
    """
    keys = {o.split("=", 1)[0] for o in options}
    if keys & {"hard", "soft", "softerr", "timeo", "retrans"}:
        return []
    deciseconds = max(1, round(io_timeout * 10 / 6))
    return ["soft", f"timeo={deciseconds}", "retrans=2"]


def unmount_nfs(target: str | os.PathLike[str]) -> None:
    """Unmount the NFS mount (kernel or FUSE) on ``target``; nothing mounted: nothing to do.

    Anything but an NFS mount there is refused.
    """
    target_path = os.path.abspath(target)
    entry = mounts.mount_entry(target_path)
    if entry is None:
        return
    if entry.fstype != FUSE_NFS_FSTYPE and entry.fstype not in KERNEL_NFS_FSTYPES:
        raise AttachError(f"{target_path} is not an NFS mount ({entry.fstype}, {entry.source})")
    # as root, umount ends a FUSE mount too; its process then exits
    mounts.unmount(target_path)
