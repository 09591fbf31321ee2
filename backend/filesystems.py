"""The filesystems of NFS volumes (xfs, ext4) inside their images.

How big an image must be for a filesystem that leaves a size usable, making
one, recognising one, and growing one (online where the kernel allows it,
offline otherwise).  A filesystem here is always a file's content; the pool
says which file.
"""

from __future__ import annotations

from pathlib import Path

from backend.api.errors import CommandFailed, FailedPrecondition, InvalidArgument
from backend.commands import run
from backend.loopdevices import detach_loops
from backend.mounts import mount_loop, mount_table, unmount

MiB = 1 << 20
FS_TYPES = ("xfs", "ext4")
XFS_MIN_IMAGE = 300 * MiB  # mkfs.xfs (xfsprogs >= 5.19) refuses anything smaller
EXT4_MIN_IMAGE = 32 * MiB

_TIMEOUT = 120.0
_LONG_TIMEOUT = 1800.0  # mkfs, fsck, resize of big images
_CAP_SYS_RESOURCE = 24


# --- sizes -------------------------------------------------------------------


def fs_image_size(size: int, fs_type: str) -> int:
    """Image size whose fresh filesystem leaves at least ``size`` bytes usable.

    Usable is what ``statvfs`` reports as ``f_bavail * f_frsize``.  Measured
    overhead (xfsprogs 6.1, ``-m reflink=0``): a fixed ~80-100 MiB (mostly
    the log) plus 0.15-0.19% (per-AG metadata and reservations, also after
    growing).  ext4 (e2fsprogs 1.47, 4 KiB blocks, ``-m 0``): the journal,
    which we size ourselves, plus ~1.6% inode tables, plus the kernel's
    reservation of min(2%, 16 MiB), plus group metadata.  The margins below
    cover both with room to spare.
    """
    check_size(size)
    check_fs_type(fs_type)
    if fs_type == "xfs":
        image = -(-(size + 128 * MiB) * 400 // 399)  # overhead 128 MiB + image/400
        return _round_up(max(image, XFS_MIN_IMAGE), MiB)
    image = max(size, EXT4_MIN_IMAGE)
    for _ in range(20):  # the journal size steps with the image; a few rounds settle it
        need = size + _ext4_overhead(image)
        if need <= image:
            break
        image = need
    return _round_up(image, MiB)


def ext4_journal_bytes(image_size: int) -> int:
    """The journal size we give mkfs.ext4 (e2fsprogs' own default table)."""
    blocks = image_size // 4096
    for limit, journal_blocks in (
        (32768, 1024),
        (256 * 1024, 4096),
        (512 * 1024, 8192),
        (4096 * 1024, 16384),
        (8192 * 1024, 32768),
        (16384 * 1024, 65536),
        (32768 * 1024, 131072),
    ):
        if blocks < limit:
            return journal_blocks * 4096
    return 262144 * 4096


def _ext4_overhead(image: int) -> int:
    return ext4_journal_bytes(image) + image // 40 + min(image // 50, 16 * MiB) + 4 * MiB


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


# --- checks ------------------------------------------------------------------


def check_size(size: int) -> None:
    """A volume size is a positive number of bytes (InvalidArgument otherwise)."""
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise InvalidArgument(f"size must be a positive number of bytes, got {size!r}")


def check_fs_type(fs_type: str) -> None:
    """A filesystem type is one of :data:`FS_TYPES` (InvalidArgument otherwise)."""
    if fs_type not in FS_TYPES:
        raise InvalidArgument(f"fs type must be one of {FS_TYPES}, got {fs_type!r}")


# --- making, recognising, growing ------------------------------------------------


def mkfs(image: Path, fs_type: str) -> None:
    """Make a filesystem of ``fs_type`` filling the file ``image``.

    Without discarding: on a file, mke2fs's discard punches holes in the whole
    image (and mkfs.xfs would on a block device), undoing its preallocation.
    """
    if fs_type == "xfs":
        argv = ["mkfs.xfs", "-q", "-K", "-m", "reflink=0", str(image)]
    else:
        journal_mib = ext4_journal_bytes(image.stat().st_size) // MiB
        argv = ["mkfs.ext4", "-q", "-F", "-T", "default", "-m", "0", "-J"]
        argv += [f"size={journal_mib}", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard"]
        argv.append(str(image))
    run(argv, timeout=_LONG_TIMEOUT)


def fs_type_of(image: Path) -> str | None:
    """The filesystem type ``blkid`` finds in ``image``; None when it finds nothing."""
    try:
        out = run(["blkid", "-p", "-o", "value", "-s", "TYPE", str(image)], timeout=_TIMEOUT)
    except CommandFailed as e:
        if e.returncode == 2:  # nothing recognised
            return None
        raise
    return out.strip() or None


def can_resize_ext4_online() -> bool:
    """EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE, which containers often drop."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    return False


def grow_mounted_fs(mount_point: Path, fs_type: str) -> None:
    """Grow the filesystem loop-mounted on ``mount_point`` to fill its (grown) image."""
    device = mount_table()[mount_point]
    run(["losetup", "-c", device], timeout=_TIMEOUT)
    if fs_type == "xfs":
        run(["xfs_growfs", str(mount_point)], timeout=_LONG_TIMEOUT)
    else:
        run(["resize2fs", device], timeout=_LONG_TIMEOUT)


def check_ext4(image: Path) -> None:
    """Check (and repair what ``-p`` may) the unmounted ext4 in ``image``."""
    try:
        run(["e2fsck", "-f", "-p", str(image)], timeout=_LONG_TIMEOUT)
    except CommandFailed as e:
        if e.returncode != 1:  # 1: errors were corrected
            raise


def resize_ext4_offline(image: Path, checked: bool = False) -> None:
    """Check the unmounted ext4 in ``image`` (unless ``checked``) and resize it to fill the file."""
    if not checked:
        check_ext4(image)
    run(["resize2fs", str(image)], timeout=_LONG_TIMEOUT)


def give_ext4_new_uuid(image: Path) -> None:
    """A clone must not share its source's UUID: ganesha tells the filesystems it
    exports apart by UUID, drops the second of two alike, and fails its export.

    The ext4 in ``image`` is checked first: tune2fs rewrites every metadata
    checksum with the new UUID, and wants a checked filesystem for that.
    """
    before = ext4_uuid(image)
    check_ext4(image)
    run(["tune2fs", "-U", "random", str(image)], timeout=_LONG_TIMEOUT)
    if ext4_uuid(image) == before:
        raise FailedPrecondition(f"could not give {image} a new ext4 UUID")


def ext4_uuid(image: Path) -> str:
    """The UUID of the ext4 in ``image``, from its superblock."""
    for line in run(["dumpe2fs", "-h", str(image)], timeout=_TIMEOUT).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Filesystem UUID":
            return value.strip()
    raise FailedPrecondition(f"dumpe2fs shows no UUID for {image}")


def ext4_fills(image: Path) -> bool:
    """Whether the ext4 filesystem already spans its image (a short last group is dropped)."""
    fields = {}
    for line in run(["dumpe2fs", "-h", str(image)], timeout=_TIMEOUT).splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    block = int(fields["Block size"])
    return int(fields["Block count"]) * block >= image.stat().st_size - 8 * MiB


def give_xfs_new_uuid(image: Path, replay: Path) -> None:
    """A clone must not share its source's UUID (xfs refuses to mount both).

    A copy of a frozen xfs has a log to replay first; xfs_admin then
    refuses (and exits 0), so the UUID is compared, and the log replayed
    by a mount with ``nouuid`` on ``replay`` (a directory made and removed here).
    """
    before = xfs_uuid(image)
    run(["xfs_admin", "-U", "generate", str(image)], timeout=_TIMEOUT)
    if xfs_uuid(image) != before:
        return
    replay.mkdir()
    try:
        mount_loop(image, replay, "xfs", "loop,nouuid")
    finally:
        unmount(replay)
        detach_loops(image)
        replay.rmdir()
    run(["xfs_admin", "-U", "generate", str(image)], timeout=_TIMEOUT)
    if xfs_uuid(image) == before:
        raise FailedPrecondition(f"could not give {image} a new xfs UUID")


def xfs_uuid(image: Path) -> str:
    """The UUID of the xfs in ``image``, as ``xfs_admin -u`` prints it."""
    return run(["xfs_admin", "-u", str(image)], timeout=_TIMEOUT).strip()
