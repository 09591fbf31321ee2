"""Volume capabilities: which access types and modes each volume type serves.

- ``nfs`` volumes are filesystems shared over NFS: mount access only, every
  access mode.
- ``nbd`` volumes are block devices: with a filesystem on them (mount access)
  only one node may write, so the single-node modes and
  MULTI_NODE_READER_ONLY; as raw block devices the multi-node writer modes
  too (a cluster filesystem or database arbitrates).

An impossible combination is refused at CreateVolume, not found at mount time.
"""

from __future__ import annotations

from collections.abc import Sequence

from csi.errors import InvalidArgument
from csi.proto import csi_pb2 as pb

Mode = pb.VolumeCapability.AccessMode
SINGLE_NODE = frozenset(
    {
        Mode.SINGLE_NODE_WRITER,
        Mode.SINGLE_NODE_READER_ONLY,
        Mode.SINGLE_NODE_SINGLE_WRITER,
        Mode.SINGLE_NODE_MULTI_WRITER,
    }
)
READ_ONLY = frozenset({Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY})
MULTI_WRITER = frozenset({Mode.MULTI_NODE_SINGLE_WRITER, Mode.MULTI_NODE_MULTI_WRITER})
ALL_MODES = frozenset(SINGLE_NODE | READ_ONLY | MULTI_WRITER)

MODES = {
    ("nfs", "mount"): ALL_MODES,
    ("nbd", "mount"): frozenset(SINGLE_NODE | {Mode.MULTI_NODE_READER_ONLY}),
    ("nbd", "block"): ALL_MODES,
}
BLOCK_FS_TYPES = ("", "ext4", "xfs")
NFS_FS_TYPES = ("", "nfs", "nfs4")
MAX_MOUNT_FLAGS = 64


def access_type(cap: pb.VolumeCapability) -> str:
    kind = cap.WhichOneof("access_type")
    if kind is None:
        raise InvalidArgument("volume capability has neither block nor mount access type")
    return str(kind)


def _mode_name(mode: int) -> str:
    return str(Mode.Mode.Name(mode)) if mode in Mode.Mode.values() else str(mode)


def check_present(caps: Sequence[pb.VolumeCapability]) -> None:
    """The checks that need no volume: every capability well formed."""
    if not caps:
        raise InvalidArgument("volume_capabilities is empty")
    for cap in caps:
        access_type(cap)
        if not cap.HasField("access_mode") or cap.access_mode.mode == Mode.UNKNOWN:
            raise InvalidArgument("volume capability has no access mode")
        if cap.access_mode.mode not in ALL_MODES:
            raise InvalidArgument(f"unknown access mode {cap.access_mode.mode}")
        if cap.WhichOneof("access_type") == "mount":
            flags = cap.mount.mount_flags
            if len(flags) > MAX_MOUNT_FLAGS or any(
                not f or len(f) > 256 or not f.isprintable() for f in flags
            ):
                raise InvalidArgument("mount_flags must be at most 64 printable, non-empty flags")


def default_type(caps: Sequence[pb.VolumeCapability]) -> str:
    """The volume type when the StorageClass does not say."""
    if any(access_type(c) == "block" for c in caps):
        return "nbd"
    if any(c.access_mode.mode in MULTI_WRITER for c in caps):
        return "nfs"
    return "nbd"


def unsupported(kind: str, caps: Sequence[pb.VolumeCapability]) -> str | None:
    """Why a volume of ``kind`` cannot serve these capabilities, or None."""
    for cap in caps:
        access = access_type(cap)
        modes = MODES.get((kind, access))
        if modes is None:
            return f"an {kind} volume has no {access} access type"
        if cap.access_mode.mode not in modes:
            return (
                f"an {kind} volume with {access} access cannot be "
                f"{_mode_name(cap.access_mode.mode)}"
            )
        if access == "mount":
            fs = cap.mount.fs_type
            allowed = NFS_FS_TYPES if kind == "nfs" else BLOCK_FS_TYPES
            if fs not in allowed:
                return (
                    f"fs_type {fs[:20]!r} does not apply to an {kind} volume "
                    f"(allowed: {', '.join(a or 'none' for a in allowed)})"
                )
    return None


def check(kind: str, caps: Sequence[pb.VolumeCapability]) -> None:
    check_present(caps)
    reason = unsupported(kind, caps)
    if reason is not None:
        raise InvalidArgument(reason)


def is_single_node(cap: pb.VolumeCapability) -> bool:
    return cap.access_mode.mode in SINGLE_NODE


def is_multi_writer(cap: pb.VolumeCapability) -> bool:
    return cap.access_mode.mode == Mode.MULTI_NODE_MULTI_WRITER
