"""The pool directory: volume images, their loop-mounted filesystems, snapshots.

Layout (docs/backend.md)::

    POOL/volumes/<id>.img   POOL/snapshots/<id>.img   POOL/mnt/<id>/export/

A file only ever appears under its final name complete: images, copies and
snapshots are built under a hidden ``.<name>.tmp-<token>`` and linked into
place (never replacing what is there), so a crash leaves at most temporary
files, which ``remove_partial_files`` clears on start.  Every method is
synchronous (the service calls them from worker threads); the ones a
crash-recovery caller re-runs are idempotent.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from backend.commands import run
from backend.errors import (
    AlreadyExists,
    CommandFailed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from backend.failpoints import failpoint

log = logging.getLogger("moorage.backend.pool")

MiB = 1 << 20
FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
VOLUME_KINDS = ("nfs", "nbd")
FS_TYPES = ("xfs", "ext4")
XFS_MIN_IMAGE = 300 * MiB  # mkfs.xfs (xfsprogs >= 5.19) refuses anything smaller
EXT4_MIN_IMAGE = 32 * MiB
EXPORT_DIR_MODE = 0o777  # clients are squashed or run as arbitrary uids
VOLUME_MOUNT_OPTIONS = "loop,nodev,nosuid,discard"  # discard punches holes: thin again

_ID = re.compile(r"[0-9a-f]{32}")
_IMAGE_NAME = re.compile(r"([0-9a-f]{32})\.img")
_TEMP_MARK = ".tmp-"
_NO_REFLINK = {errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS}
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
    _check_size(size)
    _check_fs_type(fs_type)
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


def _check_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidArgument(f"{what} must be 32 lowercase hex characters, got {value!r}")
    return value


def _check_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise InvalidArgument(f"size must be a positive number of bytes, got {size!r}")


def _check_fs_type(fs_type: str) -> None:
    if fs_type not in FS_TYPES:
        raise InvalidArgument(f"fs type must be one of {FS_TYPES}, got {fs_type!r}")


def _check_kind(kind: str) -> None:
    if kind not in VOLUME_KINDS:
        raise InvalidArgument(f"volume kind must be one of {VOLUME_KINDS}, got {kind!r}")


# --- mounts and loop devices --------------------------------------------------


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_table() -> dict[Path, str]:
    """Mount point -> mount source, from /proc/self/mountinfo (the topmost mount wins)."""
    table: dict[Path, str] = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            source = fields[fields.index("-", 6) + 2]
            table[Path(_unescape(fields[4]))] = _unescape(source)
    return table


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path``, deepest first (the order to unmount them)."""
    found = [p for p in mount_table() if p == path or path in p.parents]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def unmount(mount_point: Path) -> None:
    """Unmount everything stacked on ``mount_point``; a busy one is FailedPrecondition.

    Each is thawed first: unmounting a frozen filesystem succeeds but keeps its
    superblock, and so its loop device, alive until someone thaws it.
    """
    while mount_point in mount_table():
        with contextlib.suppress(CommandFailed):  # EINVAL when it is not frozen
            run(["fsfreeze", "-u", str(mount_point)], timeout=_TIMEOUT)
        try:
            run(["umount", str(mount_point)], timeout=_TIMEOUT)
        except CommandFailed as e:
            if "busy" in e.stderr:
                raise FailedPrecondition(f"{mount_point} is busy: {e.stderr.strip()}") from e
            raise


_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64_SIZE = 232  # struct loop_info64


def loop_backing_id(device: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a loop device's backing file, from LOOP_GET_STATUS64."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = fcntl.ioctl(fd, _LOOP_GET_STATUS64, bytes(_LOOP_INFO64_SIZE))
    except OSError:
        return None
    finally:
        os.close(fd)
    encoded, inode = struct.unpack_from("=QQ", info)
    # the kernel's new_encode_dev: minor's low byte, major, then minor's high bits
    major = (encoded >> 8) & 0xFFF
    minor = (encoded & 0xFF) | ((encoded >> 12) & 0xFFF00)
    return os.makedev(major, minor), inode


def _file_ids(backing: Path) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of ``backing`` and of every file below it."""
    ids = set()
    paths = [backing]
    if backing.is_dir():
        for top, dirs, files in os.walk(backing):
            # not into the volumes' own filesystems mounted in the pool
            dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(top, d))]
            paths += [Path(top, f) for f in files]
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return ids


def loop_devices(backing: Path) -> list[str]:
    """Loop devices whose backing file is ``backing`` or lies below it (deleted ones too).

    Read from sysfs (what ``losetup --list`` reads too), without a process
    per call: deletes ask this several times each.  sysfs gives the path as
    the kernel can name it from here: a loop set up in another mount
    namespace (a pod's init container, an earlier container of this one)
    shows a path relative to a mount this namespace lacks, so such a loop
    is recognised by its backing file's device and inode instead.
    """
    found = []
    ids: set[tuple[int, int]] | None = None
    for entry in Path("/sys/block").glob("loop*"):
        try:
            back = (entry / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue  # not attached
        back = back.removesuffix(" (deleted)")
        if not back:
            continue
        if Path(back) == backing or backing in Path(back).parents:
            found.append(f"/dev/{entry.name}")
            continue
        if ids is None:
            ids = _file_ids(backing)
        if ids and loop_backing_id(f"/dev/{entry.name}") in ids:
            found.append(f"/dev/{entry.name}")
    return sorted(found)


def detach_loops(backing: Path, wait: float = 5.0) -> None:
    """Detach loop devices of ``backing``; autoclear ones get ``wait`` seconds to go alone."""
    devices = loop_devices(backing)
    if not devices:
        return
    deadline = time.monotonic() + wait
    while devices and time.monotonic() < deadline:
        time.sleep(0.05)
        devices = loop_devices(backing)
    for dev in devices:
        log.info("detaching %s (backed by %s)", dev, backing)
        with contextlib.suppress(CommandFailed):  # it may have gone by itself meanwhile
            run(["losetup", "-d", dev], timeout=_TIMEOUT)
    left = loop_devices(backing)
    if left:
        raise FailedPrecondition(f"loop devices {left} of {backing} could not be detached")


def _mount_loop(image: Path, mount_point: Path, fs_type: str, options: str) -> None:
    run(["mount", "-t", fs_type, "-o", options, str(image), str(mount_point)], timeout=_TIMEOUT)


def fs_type_of(image: Path) -> str | None:
    try:
        out = run(["blkid", "-p", "-o", "value", "-s", "TYPE", str(image)], timeout=_TIMEOUT)
    except CommandFailed as e:
        if e.returncode == 2:  # nothing recognised
            return None
        raise
    return out.strip() or None


def _can_resize_ext4_online() -> bool:
    """EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE, which containers often drop."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    return False


# --- copies --------------------------------------------------------------------


def _clone_or_copy(src_fd: int, dst_fd: int) -> bool:
    """Reflink ``src`` into ``dst`` (True) or copy its data extents only (False)."""
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError as e:
        if e.errno not in _NO_REFLINK:
            raise
    size = os.fstat(src_fd).st_size
    pos = 0
    while pos < size:
        try:
            data = os.lseek(src_fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        hole = os.lseek(src_fd, data, os.SEEK_HOLE)
        _copy_range(src_fd, dst_fd, data, hole - data)
        pos = hole
    os.ftruncate(dst_fd, size)
    return False


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    end = offset + length
    while offset < end:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(end - offset, 1 << 30), offset, offset)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            n = os.pwrite(dst_fd, os.pread(src_fd, min(end - offset, 4 * MiB), offset), offset)
        if n == 0:  # the source shrank under us
            return
        offset += n


def _temp_for(final: Path) -> Path:
    return final.with_name(f".{final.name}{_TEMP_MARK}{secrets.token_hex(4)}")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(temp: Path, final: Path) -> None:
    """Give a complete temp file its final name, never replacing an existing file."""
    fsync_path(temp)
    try:
        os.link(temp, final)
    except FileExistsError as e:
        raise AlreadyExists(f"{final} already exists") from e
    finally:
        temp.unlink(missing_ok=True)
    fsync_path(final.parent)


def _make_sparse_file(path: Path, size: int, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


# --- the pool ------------------------------------------------------------------


class Pool:
    """One pool directory; paths are derived from volume and snapshot ids only."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()  # resolved, to compare with mountinfo
        self.volumes_dir = self.root / "volumes"
        self.snapshots_dir = self.root / "snapshots"
        self.mounts_dir = self.root / "mnt"
        self._reflink: bool | None = None
        self._reflink_lock = threading.Lock()

    # paths

    def image_path(self, vol_id: str) -> Path:
        return self.volumes_dir / f"{_check_id(vol_id, 'volume id')}.img"

    def snapshot_path(self, snap_id: str) -> Path:
        return self.snapshots_dir / f"{_check_id(snap_id, 'snapshot id')}.img"

    def mount_dir(self, vol_id: str) -> Path:
        return self.mounts_dir / _check_id(vol_id, "volume id")

    def export_dir(self, vol_id: str) -> Path:
        return self.mount_dir(vol_id) / "export"

    # layout and probes

    def ensure_layout(self) -> None:
        for d in (self.volumes_dir, self.snapshots_dir, self.mounts_dir):
            d.mkdir(parents=True, exist_ok=True)

    def supports_reflink(self) -> bool:
        """Whether FICLONE works in this pool (probed once with two temp files)."""
        with self._reflink_lock:
            if self._reflink is None:
                self.ensure_layout()
                a, b = _temp_for(self.root / ".reflink-probe"), _temp_for(self.root / ".probe")
                try:
                    a.write_bytes(b"\0" * 4096)
                    with a.open("rb") as src, b.open("wb") as dst:
                        fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
                    self._reflink = True
                except OSError as e:
                    if e.errno not in _NO_REFLINK:
                        raise
                    self._reflink = False
                finally:
                    a.unlink(missing_ok=True)
                    b.unlink(missing_ok=True)
                log.info("pool %s reflink support: %s", self.root, self._reflink)
            return self._reflink

    def remove_partial_files(self) -> list[Path]:
        """Remove what a crash left half-made; call on start, before any operation runs."""
        removed = []
        if self.mounts_dir.is_dir():
            for d in self.mounts_dir.glob(f".*{_TEMP_MARK}*"):
                for mp in mounts_under(d):
                    unmount(mp)
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        for folder in (self.root, self.volumes_dir, self.snapshots_dir):
            if folder.is_dir():
                for f in folder.glob(f".*{_TEMP_MARK}*"):
                    detach_loops(f)
                    f.unlink(missing_ok=True)
                    removed.append(f)
        for path in removed:
            log.info("removed partial %s", path)
        return removed

    # block volumes

    def create_block_image(self, vol_id: str, size: int) -> Path:
        """A sparse raw image; a no-op if one of that size exists."""
        _check_size(size)
        image = self.image_path(vol_id)
        if image.exists():
            existing = image.stat().st_size
            if existing != size:
                raise AlreadyExists(f"volume {vol_id} exists with size {existing}, not {size}")
            return image
        self.ensure_layout()
        temp = _temp_for(image)
        try:
            _make_sparse_file(temp, size, 0o600)
            _publish(temp, image)
        finally:
            temp.unlink(missing_ok=True)
        return image

    def expand_block_image(self, vol_id: str, new_size: int) -> None:
        _check_size(new_size)
        image = self._existing_image(vol_id)
        current = image.stat().st_size
        if new_size < current:
            raise InvalidArgument(
                f"volume {vol_id} is {current} bytes; cannot shrink to {new_size}"
            )
        if new_size > current:
            os.truncate(image, new_size)
            fsync_path(image)
        for dev in loop_devices(image):  # attached on this host: show the new size
            run(["losetup", "-c", dev], timeout=_TIMEOUT)

    # filesystem volumes

    fs_image_size = staticmethod(fs_image_size)

    def create_fs_volume(self, vol_id: str, size: int, fs_type: str) -> Path:
        """Image, mkfs, loop mount, export dir; returns the export dir.

        A re-run after a crash at any step finishes the job: the image is only
        ever published formatted, and mounting and the export dir are checked.
        """
        _check_size(size)
        _check_fs_type(fs_type)
        image = self.image_path(vol_id)
        image_size = fs_image_size(size, fs_type)
        fresh = not image.exists()
        if fresh:
            self.ensure_layout()
            temp = _temp_for(image)
            try:
                _make_sparse_file(temp, image_size, 0o600)
                self._mkfs(temp, fs_type)
                _publish(temp, image)
            finally:
                temp.unlink(missing_ok=True)
        else:
            existing = image.stat().st_size
            if existing < image_size:
                raise AlreadyExists(f"volume {vol_id} exists with a smaller image ({existing})")
            found = fs_type_of(image)
            if found is None and self.allocated_bytes(image) == 0:
                self._mkfs(image, fs_type)  # a blank image: nothing to lose
            elif found != fs_type:
                holds = found or "data but no filesystem"
                raise FailedPrecondition(f"volume {vol_id} image holds {holds}, not {fs_type}")
        failpoint("pool.formatted")
        self.mount_fs_volume(vol_id, fs_type)
        export = self._ensure_export_dir(vol_id)
        if fresh:
            usable = self._usable_bytes(vol_id)
            if usable < size:
                log.warning("volume %s: %d bytes usable, %d asked for", vol_id, usable, size)
        return export

    def mount_fs_volume(self, vol_id: str, fs_type: str) -> Path:
        """Loop-mount the volume's filesystem on its mount dir; a no-op if mounted."""
        _check_fs_type(fs_type)
        image = self._existing_image(vol_id)
        mount_point = self.mount_dir(vol_id)
        if not self.is_mounted(vol_id):
            mount_point.mkdir(parents=True, exist_ok=True)
            _mount_loop(image, mount_point, fs_type, VOLUME_MOUNT_OPTIONS)
            log.info("mounted volume %s on %s", vol_id, mount_point)
        return mount_point

    def unmount_fs_volume(self, vol_id: str) -> None:
        """Unmount and make sure no loop device is left on the image; a no-op if done."""
        unmount(self.mount_dir(vol_id))
        detach_loops(self.image_path(vol_id))

    def thaw_fs_volume(self, vol_id: str) -> None:
        """Thaw a volume a crash left frozen mid-snapshot (reconcile); harmless otherwise."""
        if self.is_mounted(vol_id):
            with contextlib.suppress(CommandFailed):  # EINVAL when it is not frozen
                run(["fsfreeze", "-u", str(self.mount_dir(vol_id))], timeout=_TIMEOUT)

    def expand_fs_volume(self, vol_id: str, new_size: int, fs_type: str) -> None:
        """Grow image, loop device and filesystem so ``new_size`` is usable; ends mounted.

        Online (xfs_growfs, or resize2fs on the loop device) where the kernel
        lets us.  ext4 online resize needs CAP_SYS_RESOURCE; without it the
        volume is unmounted, resized offline and remounted, which fails with
        FailedPrecondition while anything holds it (ganesha exporting it).
        """
        _check_fs_type(fs_type)
        target = fs_image_size(new_size, fs_type)
        image = self._existing_image(vol_id)
        current = image.stat().st_size
        if target < current:
            raise InvalidArgument(f"volume {vol_id} image is {current} bytes; cannot shrink")
        if fs_type == "ext4" and not _can_resize_ext4_online():
            if target > current or not _ext4_fills(image):
                self.unmount_fs_volume(vol_id)
                if target > current:
                    os.truncate(image, target)
                self._resize_ext4_offline(image)
            self.mount_fs_volume(vol_id, fs_type)
            return
        self.mount_fs_volume(vol_id, fs_type)
        if target > current:
            os.truncate(image, target)
            fsync_path(image)
        self._grow_mounted_fs(vol_id, fs_type)

    @staticmethod
    def grows_online(fs_type: str) -> bool:
        """Whether a filesystem of this type can grow while exported (mounted and held)."""
        return fs_type != "ext4" or _can_resize_ext4_online()

    # snapshots and clones

    def snapshot(self, vol_id: str, snap_id: str, fs_type: str | None) -> Path:
        """A read-only point-in-time copy of the volume image; a no-op if it exists.

        A mounted filesystem volume (``fs_type`` given) is frozen for the copy,
        so the snapshot holds a consistent filesystem; a block volume is copied
        as is (FICLONE is atomic against writes; the sparse copy is not).
        """
        source = self._existing_image(vol_id)
        final = self.snapshot_path(snap_id)
        if final.exists():
            return final
        self.ensure_layout()
        temp = _temp_for(final)
        try:
            with self._frozen(vol_id, fs_type):
                reflinked = self._copy_into(source, temp)
            os.chmod(temp, 0o444)
            _publish(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        log.info("snapshot %s of volume %s (%s)", snap_id, vol_id, _how(reflinked))
        return final

    def delete_snapshot(self, snap_id: str) -> None:
        self.snapshot_path(snap_id).unlink(missing_ok=True)

    def clone_from_snapshot(
        self, snap_id: str, vol_id: str, size: int, kind: str, fs_type: str | None
    ) -> Path:
        """A new volume from a snapshot; returns its export dir (nfs) or image (nbd)."""
        source = self.snapshot_path(snap_id)
        if not source.exists():
            raise NotFound(f"snapshot {snap_id} not found")
        return self._clone(source, None, vol_id, size, kind, fs_type)

    def clone_from_volume(
        self, src_vol_id: str, vol_id: str, size: int, kind: str, fs_type: str | None
    ) -> Path:
        """A new volume from another (frozen during the copy if mounted)."""
        source = self._existing_image(src_vol_id)
        return self._clone(source, src_vol_id, vol_id, size, kind, fs_type)

    def copy_file(self, src: Path, dst: Path) -> bool:
        """Reflink or sparse-copy ``src`` to a new ``dst``; True if reflinked.

        Written to a temp name and linked into place, so ``dst`` never exists
        half-written; an existing ``dst`` is AlreadyExists.
        """
        temp = _temp_for(dst)
        try:
            reflinked = self._copy_into(src, temp)
            _publish(temp, dst)
        finally:
            temp.unlink(missing_ok=True)
        return reflinked

    # deletion

    def delete_volume(self, vol_id: str) -> None:
        """Unmount, detach, remove image and mount dir; a no-op when already gone."""
        mount_point = self.mount_dir(vol_id)
        self.unmount_fs_volume(vol_id)
        self.image_path(vol_id).unlink(missing_ok=True)
        if mounts_under(mount_point):  # never rmtree into a mounted filesystem
            raise FailedPrecondition(f"something is still mounted under {mount_point}")
        shutil.rmtree(mount_point, ignore_errors=True)
        if self.volumes_dir.is_dir():
            fsync_path(self.volumes_dir)

    # accounting

    def capacity(self) -> tuple[int, int]:
        """(total, free) bytes of the pool filesystem."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def allocated_bytes(self, path: Path) -> int:
        try:
            return os.stat(path).st_blocks * 512
        except FileNotFoundError as e:
            raise NotFound(f"{path} not found") from e

    def used_bytes(self, vol_id: str, kind: str) -> int:
        """Bytes in use: the mounted filesystem's for nfs, allocated image bytes otherwise."""
        _check_kind(kind)
        if kind == "nfs" and self.is_mounted(vol_id):
            st = os.statvfs(self.mount_dir(vol_id))
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        return self.allocated_bytes(self.image_path(vol_id))

    # inventory, for reconcile

    def list_volume_images(self) -> set[str]:
        return _ids_in(self.volumes_dir)

    def list_snapshot_images(self) -> set[str]:
        return _ids_in(self.snapshots_dir)

    def list_mounts(self) -> set[str]:
        """Volume ids whose mount dir is a mount point."""
        return {
            p.name for p in mount_table() if p.parent == self.mounts_dir and _ID.fullmatch(p.name)
        }

    def is_mounted(self, vol_id: str) -> bool:
        return self.mount_dir(vol_id) in mount_table()

    # internals

    def _existing_image(self, vol_id: str) -> Path:
        image = self.image_path(vol_id)
        if not image.exists():
            raise NotFound(f"volume {vol_id} not found")
        return image

    def _copy_into(self, src: Path, temp: Path) -> bool:
        src_fd = os.open(src, os.O_RDONLY)
        try:
            dst_fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                return _clone_or_copy(src_fd, dst_fd)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)

    @contextlib.contextmanager
    def _frozen(self, vol_id: str | None, fs_type: str | None) -> Iterator[None]:
        if vol_id is None or fs_type is None or not self.is_mounted(vol_id):
            yield
            return
        mount_point = str(self.mount_dir(vol_id))
        run(["fsfreeze", "-f", mount_point], timeout=_TIMEOUT)
        try:
            failpoint("pool.frozen")
            yield
        finally:
            run(["fsfreeze", "-u", mount_point], timeout=_TIMEOUT)

    def _clone(
        self,
        source: Path,
        src_vol_id: str | None,
        vol_id: str,
        size: int,
        kind: str,
        fs_type: str | None,
    ) -> Path:
        _check_kind(kind)
        _check_size(size)
        if kind == "nfs":
            if fs_type is None:
                raise InvalidArgument("an nfs volume needs an fs type")
            _check_fs_type(fs_type)
        image = self.image_path(vol_id)
        if not image.exists():
            source_size = source.stat().st_size
            target = size if kind == "nbd" else fs_image_size(size, str(fs_type))
            if target < source_size:
                raise InvalidArgument(f"{size} bytes is smaller than the source ({source_size})")
            self.ensure_layout()
            temp = _temp_for(image)
            try:
                with self._frozen(src_vol_id, fs_type if kind == "nfs" else None):
                    reflinked = self._copy_into(source, temp)
                if kind == "nfs" and fs_type_of(temp) != fs_type:
                    raise InvalidArgument(f"the source does not hold an {fs_type} filesystem")
                if target > source_size:
                    os.truncate(temp, target)
                if fs_type == "xfs" and kind == "nfs":
                    self._give_xfs_new_uuid(temp, vol_id)
                elif fs_type == "ext4" and kind == "nfs" and target > source_size:
                    self._resize_ext4_offline(temp)
                _publish(temp, image)
            finally:
                temp.unlink(missing_ok=True)
            log.info("volume %s cloned from %s (%s)", vol_id, source, _how(reflinked))
        if kind == "nbd":
            return image
        assert fs_type is not None
        self.mount_fs_volume(vol_id, fs_type)
        if fs_type == "xfs":
            self._grow_mounted_fs(vol_id, fs_type)  # xfs only grows mounted
        return self._ensure_export_dir(vol_id)

    def _mkfs(self, image: Path, fs_type: str) -> None:
        if fs_type == "xfs":
            argv = ["mkfs.xfs", "-q", "-m", "reflink=0", str(image)]
        else:
            journal_mib = ext4_journal_bytes(image.stat().st_size) // MiB
            argv = ["mkfs.ext4", "-q", "-F", "-T", "default", "-m", "0", "-J"]
            argv += [f"size={journal_mib}", "-E", "lazy_itable_init=0,lazy_journal_init=0"]
            argv.append(str(image))
        run(argv, timeout=_LONG_TIMEOUT)

    def _ensure_export_dir(self, vol_id: str) -> Path:
        export = self.export_dir(vol_id)
        if not export.is_dir():
            export.mkdir()
            os.chmod(export, EXPORT_DIR_MODE)  # mkdir's mode is cut by the umask
            fsync_path(export.parent)
        return export

    def _usable_bytes(self, vol_id: str) -> int:
        st = os.statvfs(self.mount_dir(vol_id))
        return st.f_bavail * st.f_frsize

    def _grow_mounted_fs(self, vol_id: str, fs_type: str) -> None:
        mount_point = self.mount_dir(vol_id)
        device = mount_table()[mount_point]
        run(["losetup", "-c", device], timeout=_TIMEOUT)
        if fs_type == "xfs":
            run(["xfs_growfs", str(mount_point)], timeout=_LONG_TIMEOUT)
        else:
            run(["resize2fs", device], timeout=_LONG_TIMEOUT)

    def _resize_ext4_offline(self, image: Path) -> None:
        try:
            run(["e2fsck", "-f", "-p", str(image)], timeout=_LONG_TIMEOUT)
        except CommandFailed as e:
            if e.returncode != 1:  # 1: errors were corrected
                raise
        run(["resize2fs", str(image)], timeout=_LONG_TIMEOUT)

    def _give_xfs_new_uuid(self, image: Path, vol_id: str) -> None:
        """A clone must not share its source's UUID (xfs refuses to mount both).

        A copy of a frozen xfs has a log to replay first; xfs_admin then
        refuses (and exits 0), so the UUID is compared, and the log replayed
        by a mount with ``nouuid``.
        """
        before = _xfs_uuid(image)
        run(["xfs_admin", "-U", "generate", str(image)], timeout=_TIMEOUT)
        if _xfs_uuid(image) != before:
            return
        replay = _temp_for(self.mounts_dir / vol_id)
        replay.mkdir()
        try:
            _mount_loop(image, replay, "xfs", "loop,nouuid")
        finally:
            unmount(replay)
            detach_loops(image)
            replay.rmdir()
        run(["xfs_admin", "-U", "generate", str(image)], timeout=_TIMEOUT)
        if _xfs_uuid(image) == before:
            raise FailedPrecondition(f"could not give {image} a new xfs UUID")


def _ext4_fills(image: Path) -> bool:
    """Whether the ext4 filesystem already spans its image (a short last group is dropped)."""
    fields = {}
    for line in run(["dumpe2fs", "-h", str(image)], timeout=_TIMEOUT).splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    block = int(fields["Block size"])
    return int(fields["Block count"]) * block >= image.stat().st_size - 8 * MiB


def _xfs_uuid(image: Path) -> str:
    return run(["xfs_admin", "-u", str(image)], timeout=_TIMEOUT).strip()


def _ids_in(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    return {m.group(1) for p in folder.iterdir() if (m := _IMAGE_NAME.fullmatch(p.name))}


def _how(reflinked: bool) -> str:
    return "reflink" if reflinked else "sparse copy"
