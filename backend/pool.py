"""The pool directory: volume images, their loop-mounted filesystems, snapshots.

Layout (docs/backend.md)::

    POOL/volumes/<id>.img   POOL/snapshots/<id>.img   POOL/mnt/<id>/export/

A file only ever appears under its final name complete: images, copies and
snapshots are built under a hidden ``.<name>.tmp-<token>`` and linked into
place (never replacing what is there), so a crash leaves at most temporary
files, which ``remove_partial_files`` clears on start.  Every method is
synchronous (the service calls them from worker threads); the ones a
crash-recovery caller re-runs are idempotent.

Block (nbd) images are sparse: a write the pool has no room for fails back
to the NBD client.  Filesystem (nfs) images never are: they are fully
allocated when made, cloned and grown, and their loop devices refuse
discard, because a loop device that cannot write back to a full pool loses
the filesystem's data without telling anyone (docs/backend.md, "A full pool").
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from backend.api.errors import (
    AlreadyExists,
    CommandFailed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from backend.commands import run
from backend.failpoints import failpoint
from backend.filesystems import (
    can_resize_ext4_online,
    check_fs_type,
    check_size,
    ext4_fills,
    fs_image_size,
    fs_type_of,
    give_ext4_new_uuid,
    give_xfs_new_uuid,
    grow_mounted_fs,
    mkfs,
    resize_ext4_offline,
)
from backend.imagefiles import (
    FICLONE,
    NO_REFLINK,
    TEMP_MARK,
    allocate,
    copy_into,
    data_bytes,
    make_sparse_file,
    publish,
    temp_for,
)
from backend.loopdevices import detach_loops, loop_devices
from backend.mounts import mount_loop, mount_table, mounts_under, unmount
from hostio.atomicfile import fsync_directory, fsync_path
from hostio.ownership import give_to_group

log = logging.getLogger("moorage.backend.pool")

VOLUME_KINDS = ("nfs", "nbd")
EXPORT_DIR_MODE = 0o777  # clients are squashed or run as arbitrary uids
# No "discard": it punches holes in the image, thin again (see _refuse_discard).
VOLUME_MOUNT_OPTIONS = "loop,nodev,nosuid"

_ID = re.compile(r"[0-9a-f]{32}")
_IMAGE_NAME = re.compile(r"([0-9a-f]{32})\.img")
_TIMEOUT = 120.0


# --- checks ------------------------------------------------------------------


def _check_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidArgument(f"{what} must be 32 lowercase hex characters, got {value!r}")
    return value


def _check_kind(kind: str) -> None:
    if kind not in VOLUME_KINDS:
        raise InvalidArgument(f"volume kind must be one of {VOLUME_KINDS}, got {kind!r}")


# --- real space promised ---------------------------------------------------------


class SpaceReservations:
    """Pool space promised to nfs images decided on and not allocated yet.

    A decision checks what it needs against the pool's free space less what
    the others hold, then holds its bytes (a ticket) until its image is
    allocated.  Checks and allocations take the same lock and an allocation
    ends its volume's reservations, so no check counts bytes twice (already
    allocated and still held) or not at all.  Writes to nbd volumes take space
    meanwhile: an allocation can still find the pool full (ResourceExhausted).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[object, tuple[str, int]] = {}  # ticket -> (volume id, bytes)

    def held(self) -> int:
        with self._lock:
            return sum(n for _, n in self._held.values())

    def reserve(self, vol_id: str, needed: int, free: Callable[[], int], what: str) -> object:
        """Hold ``needed`` bytes for ``vol_id``; ResourceExhausted if the pool lacks them."""
        with self._lock:
            available = free()
            others = sum(n for _, n in self._held.values())
            if needed > available - others:
                promised = f" ({others} of them promised to volumes being made)" if others else ""
                raise ResourceExhausted(
                    f"not enough free space in the pool for {what}: {needed} bytes needed, "
                    f"{available} bytes free{promised}"
                )
            ticket = object()
            self._held[ticket] = (vol_id, needed)
            return ticket

    def release(self, ticket: object) -> None:
        with self._lock:
            self._held.pop(ticket, None)

    @contextlib.contextmanager
    def allocating(self, vol_id: str) -> Iterator[None]:
        """Around an allocation for ``vol_id``: no check meanwhile; its reservations end."""
        with self._lock:
            try:
                yield
            finally:
                for ticket in [t for t, (v, _) in self._held.items() if v == vol_id]:
                    del self._held[ticket]


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
        self.space = SpaceReservations()

    # paths

    def image_path(self, vol_id: str) -> Path:
        return self.volumes_dir / f"{_check_id(vol_id, 'volume id')}.img"

    def snapshot_path(self, snap_id: str) -> Path:
        return self.snapshots_dir / f"{_check_id(snap_id, 'snapshot id')}.img"

    def mount_dir(self, vol_id: str) -> Path:
        return self.mounts_dir / _check_id(vol_id, "volume id")

    def export_dir(self, vol_id: str) -> Path:
        return self.mount_dir(vol_id) / "export"

    def give_export_to_group(self, vol_id: str, gid: int) -> bool:
        """Give an nfs volume's files to group ``gid`` (as kubelet does for a
        pod's fsGroup); nothing is done when the export's root already belongs
        to the group; whether anything was done.  The export's contents are
        its clients': ``hostio.ownership`` never follows a link in it."""
        return give_to_group(self.export_dir(vol_id), gid)

    # layout and probes

    def ensure_layout(self) -> None:
        for d in (self.volumes_dir, self.snapshots_dir, self.mounts_dir):
            d.mkdir(parents=True, exist_ok=True)

    def supports_reflink(self) -> bool:
        """Whether FICLONE works in this pool (probed once with two temp files)."""
        with self._reflink_lock:
            if self._reflink is None:
                self.ensure_layout()
                a, b = temp_for(self.root / ".reflink-probe"), temp_for(self.root / ".probe")
                try:
                    a.write_bytes(b"\0" * 4096)
                    with a.open("rb") as src, b.open("wb") as dst:
                        fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
                    self._reflink = True
                except OSError as e:
                    if e.errno not in NO_REFLINK:
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
            for d in self.mounts_dir.glob(f".*{TEMP_MARK}*"):
                for mp in mounts_under(d):
                    unmount(mp)
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        for folder in (self.root, self.volumes_dir, self.snapshots_dir):
            if folder.is_dir():
                for f in folder.glob(f".*{TEMP_MARK}*"):
                    detach_loops(f)
                    f.unlink(missing_ok=True)
                    removed.append(f)
        for path in removed:
            log.info("removed partial %s", path)
        return removed

    # block volumes

    def create_block_image(self, vol_id: str, size: int) -> Path:
        """A sparse raw image; a no-op if one of that size exists."""
        check_size(size)
        image = self.image_path(vol_id)
        if image.exists():
            existing = image.stat().st_size
            if existing != size:
                raise AlreadyExists(f"volume {vol_id} exists with size {existing}, not {size}")
            return image
        self.ensure_layout()
        temp = temp_for(image)
        try:
            make_sparse_file(temp, size, 0o600)
            publish(temp, image)
        finally:
            temp.unlink(missing_ok=True)
        return image

    def expand_block_image(self, vol_id: str, new_size: int) -> None:
        check_size(new_size)
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
        The image is fully allocated first; a pool without room for it is
        ResourceExhausted, with nothing left behind.
        """
        check_size(size)
        check_fs_type(fs_type)
        image = self.image_path(vol_id)
        image_size = fs_image_size(size, fs_type)
        fresh = not image.exists()
        if fresh:
            self.ensure_layout()
            temp = temp_for(image)
            try:
                make_sparse_file(temp, image_size, 0o600)
                self._allocate(vol_id, temp, 0, image_size)  # before mkfs: fail fast
                mkfs(temp, fs_type)
                publish(temp, image)
            finally:
                temp.unlink(missing_ok=True)
        else:
            existing = image.stat().st_size
            if existing < image_size:
                raise AlreadyExists(f"volume {vol_id} exists with a smaller image ({existing})")
            found = fs_type_of(image)
            if found is None and self.allocated_bytes(image) == 0:
                mkfs(image, fs_type)  # a blank image: nothing to lose
            elif found != fs_type:
                holds = found or "data but no filesystem"
                raise FailedPrecondition(f"volume {vol_id} image holds {holds}, not {fs_type}")
            self._allocate(vol_id, image, 0, existing)  # a no-op once allocated
        failpoint("pool.formatted")
        self.mount_fs_volume(vol_id, fs_type)
        export = self.ensure_export_dir(vol_id)
        if fresh:
            usable = self._usable_bytes(vol_id)
            if usable < size:
                log.warning("volume %s: %d bytes usable, %d asked for", vol_id, usable, size)
        return export

    def mount_fs_volume(self, vol_id: str, fs_type: str) -> Path:
        """Loop-mount the volume's filesystem on its mount dir; a no-op if mounted.

        Either way its loop device is left refusing discard (``_refuse_discard``).
        """
        check_fs_type(fs_type)
        image = self._existing_image(vol_id)
        mount_point = self.mount_dir(vol_id)
        if not self.is_mounted(vol_id):
            mount_point.mkdir(parents=True, exist_ok=True)
            mount_loop(image, mount_point, fs_type, VOLUME_MOUNT_OPTIONS)
            log.info("mounted volume %s on %s", vol_id, mount_point)
        _refuse_discard(mount_table().get(mount_point))
        return mount_point

    def ensure_export_dir(self, vol_id: str) -> Path:
        """The export dir at the root of a mounted volume's filesystem, made
        (open to every client, see EXPORT_DIR_MODE) if missing."""
        export = self.export_dir(vol_id)
        if not export.is_dir():
            export.mkdir()
            os.chmod(export, EXPORT_DIR_MODE)  # mkdir's mode is cut by the umask
            fsync_directory(export.parent)
        return export

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
        The grown range is allocated first; a pool without room for it is
        ResourceExhausted and leaves image and filesystem as they were.
        """
        check_fs_type(fs_type)
        target = fs_image_size(new_size, fs_type)
        image = self._existing_image(vol_id)
        current = image.stat().st_size
        if target < current:
            raise InvalidArgument(f"volume {vol_id} image is {current} bytes; cannot shrink")
        if fs_type == "ext4" and not can_resize_ext4_online():
            if target > current or not ext4_fills(image):
                self.unmount_fs_volume(vol_id)
                try:
                    self._allocate(vol_id, image, current, target - current)
                except ResourceExhausted:
                    self.mount_fs_volume(vol_id, fs_type)
                    raise
                resize_ext4_offline(image)
            self.mount_fs_volume(vol_id, fs_type)
            return
        self.mount_fs_volume(vol_id, fs_type)
        if target > current:
            self._allocate(vol_id, image, current, target - current)
            fsync_path(image)
        grow_mounted_fs(self.mount_dir(vol_id), fs_type)

    @staticmethod
    def grows_online(fs_type: str) -> bool:
        """Whether a filesystem of this type can grow while exported (mounted and held)."""
        return fs_type != "ext4" or can_resize_ext4_online()

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
        temp = temp_for(final)
        try:
            with self._frozen(vol_id, fs_type):
                reflinked = copy_into(source, temp)
            os.chmod(temp, 0o444)
            publish(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        log.info("snapshot %s of volume %s (%s)", snap_id, vol_id, _how(reflinked))
        return final

    def delete_snapshot(self, snap_id: str) -> None:
        self.snapshot_path(snap_id).unlink(missing_ok=True)

    @contextlib.contextmanager
    def frozen_together(self, volumes: Sequence[tuple[str, str]]) -> Iterator[None]:
        """Freeze the mounted filesystems of these nfs volumes ((id, fs type) each),
        all of them before the block runs; thaw every one after (even if a freeze
        or the block fails).  Each freeze is bounded (``fsfreeze`` is killed after
        its timeout)."""
        with contextlib.ExitStack() as frozen:
            for vol_id, fs_type in volumes:
                frozen.enter_context(self._frozen(vol_id, fs_type))
            yield

    def flush_image(self, vol_id: str) -> None:
        """Make what was written to a volume's image durable (fdatasync)."""
        fsync_path(self._existing_image(vol_id))

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
            fsync_directory(self.volumes_dir)

    def remove_mount_dir(self, vol_id: str) -> None:
        """Remove a volume's (unmounted) mount dir; a no-op when gone.

        Only ever removes empty directories: what an unmounted mount dir
        holds was written beside the filesystem, not into it, and is kept.
        """
        mount_point = self.mount_dir(vol_id)
        if mounts_under(mount_point):
            raise FailedPrecondition(f"something is still mounted under {mount_point}")
        for d in (mount_point / "export", mount_point):
            with contextlib.suppress(FileNotFoundError, OSError):
                d.rmdir()

    # accounting

    def capacity(self) -> tuple[int, int]:
        """(total, free) bytes of the pool filesystem."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def fs_volume_needs(self, size: int, fs_type: str, source: Path | None = None) -> int:
        """Pool bytes that making an nfs volume of ``size`` allocates.

        Its whole image; for a clone of ``source`` (an image or snapshot) on a
        pool that reflinks, less what the clone shares with the source: its
        written extents only (preallocated blocks never written are not shared).
        """
        target = fs_image_size(size, fs_type)
        if source is None or not self.supports_reflink():
            return target
        try:
            return max(0, target - data_bytes(source))
        except FileNotFoundError as e:
            raise NotFound(f"{source} not found") from e

    def fs_growth_needs(self, vol_id: str, new_size: int, fs_type: str) -> int:
        """Pool bytes that growing an nfs volume to ``new_size`` allocates."""
        current = self._existing_image(vol_id).stat().st_size
        return max(0, fs_image_size(new_size, fs_type) - current)

    def reserve_space(self, vol_id: str, needed: int, what: str) -> object:
        """Hold ``needed`` bytes of real free space for ``vol_id``'s allocation, or
        ResourceExhausted; returns the ticket to release (``SpaceReservations``)."""
        return self.space.reserve(vol_id, needed, lambda: self.capacity()[1], what)

    def release_space(self, ticket: object) -> None:
        self.space.release(ticket)

    def _allocate(self, vol_id: str, path: Path, offset: int, length: int) -> None:
        with self.space.allocating(vol_id):
            allocate(path, offset, length)

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
        check_size(size)
        if kind == "nfs":
            if fs_type is None:
                raise InvalidArgument("an nfs volume needs an fs type")
            check_fs_type(fs_type)
        image = self.image_path(vol_id)
        if not image.exists():
            source_size = source.stat().st_size
            target = size if kind == "nbd" else fs_image_size(size, str(fs_type))
            if target < source_size:
                raise InvalidArgument(f"{size} bytes is smaller than the source ({source_size})")
            self.ensure_layout()
            temp = temp_for(image)
            try:
                with self._frozen(src_vol_id, fs_type if kind == "nfs" else None):
                    reflinked = copy_into(source, temp)
                if kind == "nfs" and fs_type_of(temp) != fs_type:
                    raise InvalidArgument(f"the source does not hold an {fs_type} filesystem")
                if kind == "nfs":
                    # The whole image, grown to target: the holes of the copy get
                    # blocks (a reflink shares written extents only, so it has
                    # holes too).  Extents a reflink shares with the source stay
                    # shared (fallocate does not unshare them): overwriting them
                    # needs pool space for the copy-on-write later.
                    self._allocate(vol_id, temp, 0, target)
                elif target > source_size:
                    os.truncate(temp, target)
                # a filesystem of its own: ganesha keys file handles on the UUID
                if fs_type == "xfs" and kind == "nfs":
                    give_xfs_new_uuid(temp, temp_for(self.mounts_dir / vol_id))
                elif fs_type == "ext4" and kind == "nfs":
                    give_ext4_new_uuid(temp)  # checks it first
                    if target > source_size:
                        resize_ext4_offline(temp, checked=True)
                publish(temp, image)
            finally:
                temp.unlink(missing_ok=True)
            log.info("volume %s cloned from %s (%s)", vol_id, source, _how(reflinked))
        if kind == "nbd":
            return image
        assert fs_type is not None
        self.mount_fs_volume(vol_id, fs_type)
        if fs_type == "xfs":
            grow_mounted_fs(self.mount_dir(vol_id), fs_type)  # xfs only grows mounted
        return self.ensure_export_dir(vol_id)

    def _usable_bytes(self, vol_id: str) -> int:
        st = os.statvfs(self.mount_dir(vol_id))
        return st.f_bavail * st.f_frsize


def _ids_in(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    return {m.group(1) for p in folder.iterdir() if (m := _IMAGE_NAME.fullmatch(p.name))}


def _refuse_discard(device: str | None) -> None:
    """Make a volume's loop device refuse discard, so nothing punches its image.

    Mounting without ``discard`` is not enough: ``fstrim`` (a weekly timer on
    many hosts) trims every mounted filesystem whose device takes discards,
    and a loop device turns them into holes in its backing file.  With the
    device's discard limit at 0 the kernel reports discard unsupported.
    Best effort: a read-only /sys is logged and left.
    """
    if device is None or not device.startswith("/dev/loop"):
        return
    limit = Path("/sys/block") / Path(device).name / "queue" / "discard_max_bytes"
    try:
        if limit.read_text().strip() != "0":
            limit.write_text("0")
    except OSError as e:
        log.warning("cannot turn discard off on %s (fstrim could thin its image): %s", device, e)


def _how(reflinked: bool) -> str:
    return "reflink" if reflinked else "sparse copy"
