"""``pool init --loop-size``: the pool as a sparse xfs image loop-mounted on its directory.

For hosts whose pool directory is not on a reflink filesystem: a sparse
image ``<pool>.img`` beside the pool directory, formatted xfs with reflink,
loop-mounted on ``<pool>``.  A record ``<pool>.pool.json`` says the pool is
loop-backed; it is written before the image, so the daemon's start
(``ensure_pool_mounted``) remounts the image after a reboot and refuses to run
on the bare directory when the image has gone missing.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from backend.api.errors import FailedPrecondition, InvalidArgument, Unavailable
from backend.commands import run
from backend.filesystems import XFS_MIN_IMAGE, fs_type_of
from backend.loopdevices import detach_loops, loop_devices
from backend.mounts import mount_table, mounts_under, unmount
from hostio.atomicfile import fsync_directory, write_atomically

log = logging.getLogger("moorage.backend.poolinit")

POOL_MOUNT_OPTIONS = "loop,noatime"
_TIMEOUT = 600.0


@dataclass(frozen=True)
class LoopPoolRecord:
    """What ``<pool>.pool.json`` holds."""

    image: str
    size: int
    fs_type: str = "xfs"
    version: int = 1


def pool_image_path(pool_dir: Path) -> Path:
    pool_dir = Path(pool_dir).absolute()
    return pool_dir.with_name(pool_dir.name + ".img")


def pool_record_path(pool_dir: Path) -> Path:
    pool_dir = Path(pool_dir).absolute()
    return pool_dir.with_name(pool_dir.name + ".pool.json")


def read_pool_record(pool_dir: Path) -> LoopPoolRecord | None:
    """The loop-pool record of ``pool_dir``, or None for a plain directory pool."""
    path = pool_record_path(pool_dir)
    try:
        data = json.loads(path.read_text())
        return LoopPoolRecord(
            image=str(data["image"]), size=int(data["size"]), fs_type=str(data["fs_type"])
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise FailedPrecondition(f"unreadable pool record {path}: {e}") from e


def init_loop_pool(pool_dir: Path, size: int) -> Path:
    """Make (or grow) the loop-backed pool and mount it; returns the image path.

    Idempotent: a re-run mounts what exists, finishes what a crash left, and
    grows the pool when ``size`` is larger than before (never shrinks it).
    """
    if not isinstance(size, int) or size < XFS_MIN_IMAGE:
        raise InvalidArgument(f"a loop pool needs at least {XFS_MIN_IMAGE} bytes, got {size!r}")
    pool_dir = Path(pool_dir).resolve()
    image = pool_image_path(pool_dir)
    record = read_pool_record(pool_dir)
    if record is not None and size < record.size:
        raise InvalidArgument(f"pool {pool_dir} is {record.size} bytes; cannot shrink to {size}")
    _refuse_foreign_mount(pool_dir, image)
    _write_record(pool_dir, LoopPoolRecord(image=str(image), size=size))
    if not image.exists():
        _make_pool_image(image, size)
    else:
        found = fs_type_of(image)
        if found != "xfs":
            raise FailedPrecondition(f"{image} exists and holds {found}, not an xfs pool")
    ensure_pool_mounted(pool_dir)
    if image.stat().st_size < size:
        os.truncate(image, size)
    # both are no-ops when nothing changed, and finish a grow a crash interrupted
    run(["losetup", "-c", mount_table()[pool_dir]], timeout=_TIMEOUT)
    run(["xfs_growfs", str(pool_dir)], timeout=_TIMEOUT)
    log.info("loop pool %s on %s (%d bytes)", pool_dir, image, size)
    return image


def ensure_pool_mounted(pool_dir: Path) -> Path | None:
    """Mount a recorded loop pool if it is not; None for a plain directory pool."""
    pool_dir = Path(pool_dir).resolve()
    record = read_pool_record(pool_dir)
    if record is None:
        return None
    image = Path(record.image)
    if not image.exists():
        raise Unavailable(f"pool image {image} of {pool_dir} is missing")
    if pool_dir in mount_table():
        _refuse_foreign_mount(pool_dir, image)
        return image
    pool_dir.mkdir(parents=True, exist_ok=True)
    if any(pool_dir.iterdir()):
        raise FailedPrecondition(f"{pool_dir} is not empty; refusing to mount the pool over it")
    run(
        ["mount", "-t", record.fs_type, "-o", POOL_MOUNT_OPTIONS, str(image), str(pool_dir)],
        timeout=_TIMEOUT,
    )
    log.info("mounted pool image %s on %s", image, pool_dir)
    return image


def release_loop_pool(pool_dir: Path) -> None:
    """Unmount the pool and everything mounted in it, detach its loops; keeps the image.

    Whatever exports the volumes (ganesha) must have stopped first.
    """
    pool_dir = Path(pool_dir).resolve()
    for mount_point in mounts_under(pool_dir):  # deepest first: the volumes
        if mount_point != pool_dir:
            unmount(mount_point)
    detach_loops(pool_dir)  # loops of images inside the pool would keep it busy
    unmount(pool_dir)
    detach_loops(pool_image_path(pool_dir))


def _refuse_foreign_mount(pool_dir: Path, image: Path) -> None:
    source = mount_table().get(pool_dir)
    if source is not None and source not in loop_devices(image):
        raise FailedPrecondition(f"{pool_dir} is mounted from {source}, not from {image}")


def _make_pool_image(image: Path, size: int) -> None:
    for stale in image.parent.glob(f".{image.name}.tmp-*"):  # left by a crash
        stale.unlink()
    temp = image.with_name(f".{image.name}.tmp-{os.getpid()}")
    try:
        with temp.open("xb") as f:
            f.truncate(size)
        run(["mkfs.xfs", "-q", "-m", "reflink=1", str(temp)], timeout=_TIMEOUT)
        os.replace(temp, image)
    finally:
        temp.unlink(missing_ok=True)
    fsync_directory(image.parent)


def _write_record(pool_dir: Path, record: LoopPoolRecord) -> None:
    path = pool_record_path(pool_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(asdict(record), indent=2) + "\n", mode=0o644)
