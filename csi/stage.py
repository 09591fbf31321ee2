"""Staging and publishing on a node: attach, format once, one global mount, binds.

- **nbd, mount access**: attach the export (kernel nbd or FUSE block file +
  loop device, ``csi.attach``), make a filesystem only on a blank device
  (``csi.mounts.format_device``: a device holding anything is never
  formatted), mount it at the staging path.
- **nbd, block access**: attach, and bind the device node onto the file
  ``STAGING/device``: the staging path records the device.
- **nfs**: mount the export at the staging path once (kernel NFS client, or
  the FUSE NFS mount).
- **publish**: always a bind mount of the staging path (or of
  ``STAGING/device``) onto the pod's target, read-only when asked.

Each step is idempotent: it checks what is there before acting.
"""

from __future__ import annotations

import grp
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

from csi import attach, mounts, parameters
from csi.errors import FailedPrecondition, Internal, InvalidArgument
from csi.kubeletpaths import same_mount
from hostio.addresses import HostPort
from hostio.ownership import give_to_group

log = logging.getLogger("moorage.csi.node")

DEVICE_FILE = "device"  # under a raw block volume's staging path
DEFAULT_FS = "ext4"
# Mount options the FUSE NFS mount (NFSv3 through libnfs) honours, or that
# change nothing for it.  nfsvers/vers 4.x is accepted: the FUSE path always
# speaks NFSv3 to the storage node, whose exports serve both.
FUSE_NFS_OPTIONS = frozenset(
    {"hard", "tcp", "proto=tcp", "ro", "rw", "noatime", "nodiratime", "relatime", "strictatime",
     "nosuid", "nodev", "noexec", "nfsvers=3", "vers=3", "nfsvers=4", "vers=4",
     "nfsvers=4.0", "vers=4.0", "nfsvers=4.1", "vers=4.1", "nfsvers=4.2", "vers=4.2",
     "sync", "async"}
)  # fmt: skip


def nbd_uri(context: Mapping[str, str]) -> str:
    """The export's URI from ControllerPublishVolume's publish_context."""
    try:
        host, port, name = context["host"], int(context["port"]), context["exportName"]
    except (KeyError, ValueError) as e:
        raise InvalidArgument(
            f"publish_context of an nbd volume lacks host/port/exportName: {e}"
        ) from e
    if not host or not 0 < port < 65536 or not name:
        raise InvalidArgument("publish_context of an nbd volume has an empty host or export")
    scheme = "nbds" if context.get("tls") == "true" else "nbd"
    return f"{scheme}://{HostPort(host, port)}/{quote(name, safe='@:+.-_')}"


def check_options(flags: Sequence[str]) -> tuple[str, ...]:
    try:
        return mounts.validate_options(flags)
    except mounts.MountOptionError as e:
        raise InvalidArgument(f"mount flags: {e}") from e


def _attach_error(e: Exception) -> Exception:
    if isinstance(e, attach.PathUnavailable):
        return FailedPrecondition(str(e))
    return Internal(str(e))


def io_timeout(volume_context: Mapping[str, str], default: float) -> float:
    """The volume's ioTimeout (its StorageClass's), else the plugin's ``default``."""
    value = volume_context.get("ioTimeout", "")
    return float(parameters.io_timeout(value)) if value else default


def attach_device(uri: str, state_dir: Path, plan: attach.Plan, io_timeout: float) -> str:
    try:
        return attach.attach_block(uri, state_dir, plan, io_timeout=io_timeout)
    except attach.AttachError as e:
        raise _attach_error(e) from e


def detach_device(uri_or_device: str, state_dir: Path) -> None:
    try:
        attach.detach_block(uri_or_device, state_dir)
    except attach.AttachError as e:
        raise Internal(str(e)) from e


def mount_filesystem(
    device: str, staging: Path, fs_type: str, flags: Sequence[str], read_only: bool
) -> str:
    """Format ``device`` if blank, mount it on ``staging``; the filesystem type."""
    wanted = fs_type or DEFAULT_FS
    try:
        found = mounts.detect_filesystem(device)
        if found is None:
            mounts.format_device(device, wanted)
            log.info("formatted %s as %s", device, wanted)
            found = wanted
        elif fs_type and found != fs_type:
            raise FailedPrecondition(
                f"{device} holds a {found} filesystem, not the {fs_type} asked for: "
                "it is never reformatted"
            )
        if found not in mounts.FSTYPES:
            raise FailedPrecondition(f"{device} holds {found}, which this plugin does not mount")
        staging.mkdir(parents=True, exist_ok=True)
        if found == "ext4" and not read_only and _smaller_than_device(device, found):
            # a volume restored from a snapshot (or cloned) into a larger one
            mounts.grow_filesystem_offline(device, found)
            log.info("grew the ext4 on %s to its device", device)
        options = [*flags, *(["ro"] if read_only else [])]
        if found == "xfs" and "nouuid" not in options:
            # a restored or cloned volume carries its source's UUID, and both may be
            # mounted on one node: xfs refuses a duplicate UUID unless told not to look
            options.append("nouuid")
        mounts.mount(device, staging, found, options)
        if found == "xfs" and not read_only and _smaller_than_device(device, found, staging):
            mounts.grow_filesystem(staging, found)  # xfs grows mounted only
            log.info("grew the xfs on %s to its device", device)
    except mounts.FilesystemError as e:
        raise FailedPrecondition(str(e)) from e
    except mounts.MountError as e:
        raise Internal(str(e)) from e
    return found


def _smaller_than_device(device: str, fstype: str, mount_point: Path | None = None) -> bool:
    """Whether the filesystem leaves a whole block of its device or more unused."""
    return mounts.filesystem_bytes(device, fstype, mount_point) + 4096 <= mounts.device_bytes(
        device
    )


def bind_device(device: str, staging: Path) -> Path:
    """Bind the device node onto ``STAGING/device``."""
    staging.mkdir(parents=True, exist_ok=True)
    node = staging / DEVICE_FILE
    if not node.exists():
        node.touch(mode=0o600)
    try:
        mounts.bind_mount(device, node)
    except (mounts.FilesystemError, mounts.MountError) as e:
        raise Internal(str(e)) from e
    return node


def check_nfs(
    context: Mapping[str, str], plan: attach.Plan, flags: Sequence[str]
) -> tuple[str, int, int | None, str]:
    """The NFS export of ``context`` (server, port, MOUNT port, path), checked
    with the mount flags, before anything is recorded; else INVALID_ARGUMENT."""
    try:
        server, port, path = (
            context["server"],
            int(context.get("port", "2049")),
            context["exportPath"],
        )
        mount_port = int(context["mountPort"]) if context.get("mountPort") else None
        attach.validate_export(server, port, mount_port, path)
    except (KeyError, ValueError) as e:
        raise InvalidArgument(
            f"publish_context of an nfs volume lacks server/exportPath: {e}"
        ) from e
    except attach.AttachError as e:
        raise InvalidArgument(f"publish_context of an nfs volume: {e}") from e
    if plan.nfs == "fuse-nfs":
        refused = sorted(set(flags) - FUSE_NFS_OPTIONS)
        if refused:
            raise InvalidArgument(
                f"mount flags {refused} cannot be honoured by the FUSE NFS mount this node "
                f"uses ({plan.nfs_reason}); it honours {sorted(FUSE_NFS_OPTIONS)}"
            )
    return server, port, mount_port, path


def mount_nfs(
    context: Mapping[str, str],
    staging: Path,
    plan: attach.Plan,
    flags: Sequence[str],
    read_only: bool,
    log_file: Path,
    io_timeout: float,
) -> str:
    """Mount the NFS export of ``context`` on ``staging``; its ``SERVER:PATH``."""
    server, port, mount_port, path = check_nfs(context, plan, flags)
    if plan.nfs == "fuse-nfs":
        read_only = read_only or "ro" in flags
    staging.mkdir(parents=True, exist_ok=True)
    try:
        attach.mount_nfs_export(
            server, port, mount_port, path, staging, plan, read_only=read_only,
            log_file=log_file, options=flags, io_timeout=io_timeout,
        )  # fmt: skip
    except attach.AttachError as e:
        raise _attach_error(e) from e
    except mounts.MountError as e:
        raise Internal(str(e)) from e
    return f"{server}:{path}"


def unmount(path: Path) -> None:
    try:
        mounts.unmount(path)
    except mounts.MountError as e:
        raise Internal(f"cannot unmount {path}: {e}") from e


def remove_path(path: Path) -> None:
    """Remove a target or staging path left empty (a directory or a file)."""
    try:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        return
    except OSError as e:
        raise FailedPrecondition(f"cannot remove {path}: {e.strerror}") from e


def bind(source: Path, target: Path, read_only: bool, is_file: bool) -> None:
    """Bind ``source`` onto the pod's ``target`` (made if missing)."""
    try:
        if is_file:
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.touch(mode=0o600)
        else:
            target.mkdir(parents=True, exist_ok=True)
        mounts.bind_mount(source, target, read_only)
    except mounts.FilesystemError as e:
        raise FailedPrecondition(str(e)) from e
    except mounts.MountError as e:
        raise Internal(str(e)) from e
    except OSError as e:
        raise FailedPrecondition(f"cannot make {target}: {e.strerror}") from e


def mount_group_id(group: str) -> int:
    """VOLUME_MOUNT_GROUP (the pod's fsGroup, a number or a group's name) as a gid."""
    try:
        gid = int(group)
    except ValueError:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError as e:
            raise InvalidArgument(f"volume_mount_group {group[:40]!r} is not a group") from e
    if gid < 0:
        raise InvalidArgument("volume_mount_group cannot be negative")
    return gid


def apply_mount_group(root: Path, gid: int) -> None:
    """Give the volume's files to group ``gid`` (VOLUME_MOUNT_GROUP, the pod's fsGroup):
    group owner, group read/write, setgid directories, no link followed
    (``hostio.ownership``).  Skipped when the root already belongs to the group
    (as Kubernetes' OnRootMismatch)."""
    try:
        give_to_group(root, gid)
    except OSError as e:
        raise FailedPrecondition(
            f"cannot give {root} to group {gid}: {e.strerror} (an NFS export that squashes "
            "root refuses it: use no_root_squash or set ownership on the server)"
        ) from e


def revalidate(path: Path) -> None:
    """Open and close a directory on a network filesystem: its client then asks the
    server for its attributes again (close-to-open) instead of trusting its cache,
    so what the server just changed (the group of a volume's files) is seen at once."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as e:
        raise FailedPrecondition(f"cannot open {path}: {e.strerror}") from e


def is_bind_of(target: Path, staging: Path, access: str) -> bool:
    """Whether ``target`` (not the staging path itself) holds a bind of what is
    staged at ``staging``: the same filesystem and root as its mount."""
    staged = staging / DEVICE_FILE if access == "block" else staging
    if target in (staging, staged):
        return False
    return same_mount(target, staged)
