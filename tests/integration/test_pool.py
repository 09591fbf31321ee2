"""The pool on real loop devices, xfs and ext4.

Two pools: a loop-mounted xfs made by ``init_loop_pool`` (reflink) and a
loop-mounted ext4 made here (no reflink, so the sparse copy is exercised
whatever filesystem /tmp is on).  Every fixture unmounts everything under
its directory, thaws what a failed test left frozen and detaches the loop
devices, also when the test fails; the checks for leftovers read
/proc/self/mountinfo and ``losetup`` directly, not through the code under test.

Why this file is long: it tests every operation of ``backend.pool`` on real loop devices
(block images, filesystem volumes, snapshots, clones, deletion, accounting, the
loop-backed pool), many cases on both the xfs and the ext4 pool, most of them on the
same two pool fixtures and with the same readers of mountinfo and losetup that find
leftovers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.api.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from backend.filesystems import XFS_MIN_IMAGE, fs_image_size
from backend.imagefiles import copy_into, publish, temp_for
from backend.pool import Pool
from backend.poolinit import (
    ensure_pool_mounted,
    init_loop_pool,
    pool_image_path,
    pool_record_path,
    release_loop_pool,
)

MiB = 1 << 20
GiB = 1 << 30
POOL_SIZE = 8 * GiB  # nfs images are fully allocated: room for a 5 GiB volume


# --- independent views of the kernel's state, and teardown ---------------------


def sh(argv: list[str], timeout: float = 60, check: bool = True) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{argv} exited {result.returncode}: {result.stderr}")
    return result.stdout


def mount_points_under(root: Path) -> list[Path]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = Path(line.split()[4].replace("\\040", " "))
            if point == root or root in point.parents:
                points.append(point)
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def loops_under(root: Path) -> list[str]:
    """Loop devices (``losetup -a``) whose backing file lies under ``root``."""
    found = []
    for line in sh(["losetup", "-a"]).splitlines():
        device, _, rest = line.partition(":")
        backing = rest[rest.rfind("(") + 1 : rest.rfind(")")].removesuffix(" (deleted)")
        if backing.startswith(str(root) + "/"):
            found.append(device)
    return found


def force_cleanup(root: Path) -> None:
    for point in mount_points_under(root):
        sh(["fsfreeze", "-u", str(point)], check=False)
        if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode:
            sh(["umount", "-l", str(point)], check=False)
    for device in loops_under(root):
        sh(["losetup", "-d", device], check=False)


def can_resize_ext4_online() -> bool:
    """EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE (bit 24)."""
    status = Path("/proc/self/status").read_text()
    cap_eff = next(line for line in status.splitlines() if line.startswith("CapEff:"))
    return bool(int(cap_eff.split()[1], 16) >> 24 & 1)


def new_id() -> str:
    return uuid.uuid4().hex


def usable(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fs_uuid(image: Path) -> str:
    return sh(["blkid", "-p", "-o", "value", "-s", "UUID", str(image)]).strip()


def mount_id(point: Path) -> str:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if Path(fields[4]) == point:
                return fields[0]
    raise AssertionError(f"{point} is not mounted")


def write_at(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)
        os.fsync(f.fileno())


def read_at(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(length)


# --- fixtures -----------------------------------------------------------------


@pytest.fixture
def xfs_pool(tmp_path: Path) -> Iterator[Pool]:
    pool_dir = tmp_path / "xfs-pool"
    try:
        init_loop_pool(pool_dir, POOL_SIZE)
        pool = Pool(pool_dir)
        pool.ensure_layout()
        yield pool
    finally:
        with contextlib.suppress(Exception):
            release_loop_pool(pool_dir)
        force_cleanup(tmp_path)


@pytest.fixture
def ext4_pool(tmp_path: Path) -> Iterator[Pool]:
    pool_dir = tmp_path / "ext4-pool"
    image = tmp_path / "ext4-pool.img"
    try:
        with image.open("wb") as f:
            f.truncate(POOL_SIZE)
        sh(["mkfs.ext4", "-q", "-F", str(image)])
        pool_dir.mkdir()
        sh(["mount", "-o", "loop", str(image), str(pool_dir)])
        pool = Pool(pool_dir)
        pool.ensure_layout()
        yield pool
    finally:
        force_cleanup(tmp_path)


def assert_nothing_left(pool: Pool) -> None:
    assert mount_points_under(pool.mounts_dir) == []
    assert loops_under(pool.volumes_dir) == []
    assert loops_under(pool.snapshots_dir) == []
    assert list(pool.mounts_dir.iterdir()) == []


# --- layout, sizes, probes --------------------------------------------------------


def test_layout_paths_and_id_validation(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "pool")
    pool.ensure_layout()
    pool.ensure_layout()
    for name in ("volumes", "snapshots", "mnt"):
        assert (pool.root / name).is_dir()
    vid = new_id()
    assert pool.image_path(vid) == pool.root / "volumes" / f"{vid}.img"
    assert pool.snapshot_path(vid) == pool.root / "snapshots" / f"{vid}.img"
    assert pool.export_dir(vid) == pool.root / "mnt" / vid / "export"
    for bad in ("../../etc", "ABCDEF" * 6, "a" * 31, ""):
        with pytest.raises(InvalidArgument):
            pool.image_path(bad)
    with pytest.raises(InvalidArgument):
        pool.create_block_image(vid, 0)
    with pytest.raises(InvalidArgument):
        fs_image_size(GiB, "btrfs")


def test_reflink_probe_is_true_on_xfs_and_false_on_ext4(xfs_pool: Pool, ext4_pool: Pool) -> None:
    assert xfs_pool.supports_reflink() is True
    assert ext4_pool.supports_reflink() is False
    assert xfs_pool.supports_reflink() is True  # cached, and no probe files left behind
    assert [p for p in xfs_pool.root.iterdir() if p.name.startswith(".")] == []


# --- block volumes ------------------------------------------------------------------


def test_block_image_is_sparse_and_create_and_delete_are_idempotent(xfs_pool: Pool) -> None:
    vid = new_id()
    image = xfs_pool.create_block_image(vid, GiB)
    assert image.stat().st_size == GiB
    assert xfs_pool.allocated_bytes(image) == 0
    assert xfs_pool.create_block_image(vid, GiB) == image
    with pytest.raises(AlreadyExists):
        xfs_pool.create_block_image(vid, 2 * GiB)
    assert xfs_pool.list_volume_images() == {vid}
    xfs_pool.delete_volume(vid)
    xfs_pool.delete_volume(vid)
    assert not image.exists()
    assert xfs_pool.list_volume_images() == set()
    with pytest.raises(NotFound):
        xfs_pool.expand_block_image(vid, 2 * GiB)


def test_expand_block_image_grows_keeps_data_and_refuses_to_shrink(xfs_pool: Pool) -> None:
    vid = new_id()
    image = xfs_pool.create_block_image(vid, 64 * MiB)
    write_at(image, 0, b"head")
    xfs_pool.expand_block_image(vid, 256 * MiB)
    xfs_pool.expand_block_image(vid, 256 * MiB)
    assert image.stat().st_size == 256 * MiB
    assert read_at(image, 0, 4) == b"head"
    with pytest.raises(InvalidArgument):
        xfs_pool.expand_block_image(vid, 128 * MiB)
    xfs_pool.delete_volume(vid)


# --- filesystem volumes ---------------------------------------------------------------


@pytest.mark.parametrize("fs_type", ["xfs", "ext4"])
@pytest.mark.parametrize(
    "size", [64 * MiB, 300 * MiB, GiB, 5 * GiB], ids=["64M", "300M", "1G", "5G"]
)
def test_fs_volume_leaves_at_least_the_requested_space_usable(
    xfs_pool: Pool, fs_type: str, size: int
) -> None:
    vid = new_id()
    export = xfs_pool.create_fs_volume(vid, size, fs_type)
    assert export == xfs_pool.export_dir(vid)
    assert usable(export) >= size
    assert export.stat().st_mode & 0o7777 == 0o777
    assert sh(
        ["blkid", "-p", "-o", "value", "-s", "TYPE", str(xfs_pool.image_path(vid))]
    ).strip() == (fs_type)
    assert xfs_pool.is_mounted(vid)
    assert xfs_pool.list_mounts() == {vid}
    # never thin: a full pool cannot take the blocks its filesystem writes to
    image = xfs_pool.image_path(vid)
    assert xfs_pool.allocated_bytes(image) >= image.stat().st_size
    xfs_pool.delete_volume(vid)
    assert_nothing_left(xfs_pool)


@pytest.mark.parametrize("fs_type", ["xfs", "ext4"])
def test_writing_past_the_volume_size_fails_with_enospc_and_spares_the_neighbour(
    xfs_pool: Pool, fs_type: str
) -> None:
    full, neighbour = new_id(), new_id()
    size = 64 * MiB
    full_export = xfs_pool.create_fs_volume(full, size, fs_type)
    neighbour_export = xfs_pool.create_fs_volume(neighbour, size, fs_type)
    precious = os.urandom(MiB)
    (neighbour_export / "precious").write_bytes(precious)
    os.sync()
    neighbour_free = usable(neighbour_export)
    _, pool_free_before = xfs_pool.capacity()

    chunk = os.urandom(MiB)
    written = 0
    with pytest.raises(OSError) as raised, (full_export / "filler").open("wb") as f:
        while written <= xfs_pool.image_path(full).stat().st_size:
            f.write(chunk)
            written += len(chunk)
        os.fsync(f.fileno())
    assert raised.value.errno == errno.ENOSPC
    assert written >= size - MiB  # the volume took at least what was asked for

    assert (neighbour_export / "precious").read_bytes() == precious
    assert abs(usable(neighbour_export) - neighbour_free) < MiB
    _, pool_free_after = xfs_pool.capacity()
    assert pool_free_after > pool_free_before - xfs_pool.image_path(full).stat().st_size
    assert pool_free_after > 0
    xfs_pool.delete_volume(full)
    xfs_pool.delete_volume(neighbour)
    assert_nothing_left(xfs_pool)


def test_expand_xfs_volume_grows_online_while_a_file_is_open(xfs_pool: Pool) -> None:
    vid = new_id()
    export = xfs_pool.create_fs_volume(vid, 64 * MiB, "xfs")
    before = mount_id(xfs_pool.mount_dir(vid))
    with (export / "open-file").open("w+b") as f:
        f.write(b"kept")
        xfs_pool.expand_fs_volume(vid, GiB, "xfs")
        assert usable(export) >= GiB
        f.seek(0)
        assert f.read() == b"kept"
    assert mount_id(xfs_pool.mount_dir(vid)) == before  # never unmounted
    xfs_pool.expand_fs_volume(vid, GiB, "xfs")  # a re-run is harmless
    xfs_pool.expand_fs_volume(vid, 5 * GiB, "xfs")
    assert usable(export) >= 5 * GiB
    with pytest.raises(InvalidArgument):
        xfs_pool.expand_fs_volume(vid, GiB, "xfs")
    xfs_pool.delete_volume(vid)


def test_expand_ext4_volume_grows_and_keeps_its_data(xfs_pool: Pool) -> None:
    """Online where CAP_SYS_RESOURCE allows; otherwise offline, refused while busy."""
    vid = new_id()
    export = xfs_pool.create_fs_volume(vid, 64 * MiB, "ext4")
    (export / "data").write_bytes(b"kept")
    with (export / "data").open("rb"):
        if can_resize_ext4_online():
            xfs_pool.expand_fs_volume(vid, GiB, "ext4")
        else:
            with pytest.raises(FailedPrecondition):
                xfs_pool.expand_fs_volume(vid, GiB, "ext4")
            assert xfs_pool.is_mounted(vid)
    xfs_pool.expand_fs_volume(vid, GiB, "ext4")
    assert xfs_pool.is_mounted(vid)
    assert usable(export) >= GiB
    assert (export / "data").read_bytes() == b"kept"
    xfs_pool.expand_fs_volume(vid, GiB, "ext4")  # a re-run is harmless
    xfs_pool.expand_fs_volume(vid, 5 * GiB, "ext4")
    assert usable(export) >= 5 * GiB
    with pytest.raises(InvalidArgument):
        xfs_pool.expand_fs_volume(vid, GiB, "ext4")
    xfs_pool.delete_volume(vid)
    assert_nothing_left(xfs_pool)


def test_fs_volume_create_finishes_after_a_crash(xfs_pool: Pool) -> None:
    vid = new_id()
    export = xfs_pool.create_fs_volume(vid, 64 * MiB, "xfs")
    (export / "data").write_bytes(b"kept")
    os.chmod(export, 0o750)  # a client's choice, not reset by a re-run
    assert xfs_pool.create_fs_volume(vid, 64 * MiB, "xfs") == export

    sh(["umount", str(xfs_pool.mount_dir(vid))])  # crash: the image exists, the mount is gone
    assert not xfs_pool.is_mounted(vid)
    assert xfs_pool.create_fs_volume(vid, 64 * MiB, "xfs") == export
    assert (export / "data").read_bytes() == b"kept"
    assert export.stat().st_mode & 0o7777 == 0o750
    assert loops_under(xfs_pool.volumes_dir) == [
        sh(["findmnt", "-no", "SOURCE", str(export.parent)]).strip()
    ]

    # crash in the middle of an older create: a blank image under the final name,
    # a temp file beside it; the blank image is formatted, the temp removed
    blank = new_id()
    with xfs_pool.image_path(blank).open("wb") as f:
        f.truncate(fs_image_size(64 * MiB, "ext4"))
    partial = xfs_pool.volumes_dir / f".{blank}.img.tmp-0badc0de"
    partial.write_bytes(b"half")
    assert xfs_pool.remove_partial_files() == [partial]
    assert usable(xfs_pool.create_fs_volume(blank, 64 * MiB, "ext4")) >= 64 * MiB

    # an image holding data that is no filesystem is never formatted
    junk = new_id()
    write_at(xfs_pool.create_block_image(junk, 400 * MiB), 0, b"not a filesystem" * 64)
    with pytest.raises(FailedPrecondition):
        xfs_pool.create_fs_volume(junk, 64 * MiB, "xfs")
    with pytest.raises(FailedPrecondition):
        xfs_pool.create_fs_volume(vid, 64 * MiB, "ext4")  # it holds xfs

    for v in (vid, blank, junk):
        xfs_pool.delete_volume(v)
        xfs_pool.delete_volume(v)
    assert_nothing_left(xfs_pool)
    assert xfs_pool.list_volume_images() == set()


def test_mount_and_unmount_are_idempotent_and_detach_the_loop(xfs_pool: Pool) -> None:
    vid = new_id()
    xfs_pool.create_fs_volume(vid, 64 * MiB, "ext4")
    xfs_pool.mount_fs_volume(vid, "ext4")
    assert len(loops_under(xfs_pool.volumes_dir)) == 1
    xfs_pool.unmount_fs_volume(vid)
    xfs_pool.unmount_fs_volume(vid)
    assert not xfs_pool.is_mounted(vid)
    assert loops_under(xfs_pool.volumes_dir) == []
    xfs_pool.mount_fs_volume(vid, "ext4")
    xfs_pool.mount_fs_volume(vid, "ext4")
    assert xfs_pool.list_mounts() == {vid}
    assert len(loops_under(xfs_pool.volumes_dir)) == 1
    with pytest.raises(NotFound):
        xfs_pool.mount_fs_volume(new_id(), "ext4")
    xfs_pool.delete_volume(vid)
    assert_nothing_left(xfs_pool)


def test_a_freeze_left_by_a_crash_is_thawed_and_does_not_pin_the_loop(xfs_pool: Pool) -> None:
    vid = new_id()
    export = xfs_pool.create_fs_volume(vid, 64 * MiB, "xfs")
    sh(["fsfreeze", "-f", str(xfs_pool.mount_dir(vid))])
    xfs_pool.thaw_fs_volume(vid)
    xfs_pool.thaw_fs_volume(vid)
    (export / "after-thaw").write_bytes(b"ok")
    sh(["fsfreeze", "-f", str(xfs_pool.mount_dir(vid))])
    xfs_pool.delete_volume(vid)  # a frozen filesystem would keep its loop device
    assert_nothing_left(xfs_pool)


# --- snapshots and clones -----------------------------------------------------------


def pool_for(request: pytest.FixtureRequest, name: str) -> Pool:
    pool = request.getfixturevalue(name)
    assert isinstance(pool, Pool)
    return pool


@pytest.mark.parametrize(
    ("pool_name", "fs_type"), [("xfs_pool", "xfs"), ("ext4_pool", "ext4"), ("ext4_pool", "xfs")]
)
def test_snapshot_of_a_mounted_fs_volume_holds_its_content_at_that_time(
    request: pytest.FixtureRequest, pool_name: str, fs_type: str
) -> None:
    pool = pool_for(request, pool_name)
    vid, sid, clone = new_id(), new_id(), new_id()
    export = pool.create_fs_volume(vid, 64 * MiB, fs_type)
    (export / "a").write_bytes(b"before")
    snapshot = pool.snapshot(vid, sid, fs_type)
    (export / "a").write_bytes(b"after")
    (export / "b").write_bytes(b"new")

    assert snapshot.stat().st_mode & 0o777 == 0o444
    assert pool.snapshot(vid, sid, fs_type) == snapshot  # idempotent
    assert pool.list_snapshot_images() == {sid}
    clone_export = pool.clone_from_snapshot(sid, clone, 64 * MiB, "nfs", fs_type)
    assert (clone_export / "a").read_bytes() == b"before"
    assert not (clone_export / "b").exists()
    assert (export / "a").read_bytes() == b"after"
    assert fs_uuid(pool.image_path(clone)) != fs_uuid(pool.image_path(vid))  # ganesha keys on it
    if pool.supports_reflink():
        assert "shared" in sh(["filefrag", "-v", str(snapshot)])

    for v in (vid, clone):
        pool.delete_volume(v)
    pool.delete_snapshot(sid)
    pool.delete_snapshot(sid)
    assert pool.list_snapshot_images() == set()
    assert_nothing_left(pool)


@pytest.mark.parametrize("pool_name", ["xfs_pool", "ext4_pool"])
def test_snapshot_of_a_block_volume_is_point_in_time_and_keeps_holes(
    request: pytest.FixtureRequest, pool_name: str
) -> None:
    pool = pool_for(request, pool_name)
    vid, sid = new_id(), new_id()
    image = pool.create_block_image(vid, GiB)
    offsets = [0, 300 * MiB, 700 * MiB, GiB - 2 * MiB]
    data = {off: os.urandom(2 * MiB) for off in offsets}  # 8 MiB in all
    for off, chunk in data.items():
        write_at(image, off, chunk)
    _, free_before = pool.capacity()

    snapshot = pool.snapshot(vid, sid, None)
    for off in offsets:
        write_at(image, off, b"\xff" * 4096)

    assert snapshot.stat().st_size == GiB
    assert pool.allocated_bytes(snapshot) <= 9 * MiB  # the holes stayed holes
    for off, chunk in data.items():
        assert read_at(snapshot, off, len(chunk)) == chunk
    assert read_at(snapshot, 100 * MiB, MiB) == bytes(MiB)
    _, free_after = pool.capacity()
    if pool.supports_reflink():
        assert "shared" in sh(["filefrag", "-v", str(snapshot)])
        assert free_before - free_after < 4 * MiB  # shared extents, not copies
    else:
        assert "shared" not in sh(["filefrag", "-v", str(snapshot)])
    pool.delete_volume(vid)
    pool.delete_snapshot(sid)


def test_snapshot_survives_deleting_its_source(xfs_pool: Pool) -> None:
    vid, sid, clone = new_id(), new_id(), new_id()
    export = xfs_pool.create_fs_volume(vid, 64 * MiB, "xfs")
    (export / "a").write_bytes(b"survivor")
    xfs_pool.snapshot(vid, sid, "xfs")
    xfs_pool.delete_volume(vid)
    assert xfs_pool.list_snapshot_images() == {sid}
    with pytest.raises(NotFound):
        xfs_pool.snapshot(vid, new_id(), "xfs")
    clone_export = xfs_pool.clone_from_snapshot(sid, clone, GiB, "nfs", "xfs")
    assert (clone_export / "a").read_bytes() == b"survivor"
    assert usable(clone_export) >= GiB
    xfs_pool.delete_volume(clone)
    xfs_pool.delete_snapshot(sid)
    assert_nothing_left(xfs_pool)


@pytest.mark.parametrize(("pool_name", "fs_type"), [("xfs_pool", "xfs"), ("ext4_pool", "ext4")])
def test_clone_from_a_mounted_fs_volume_is_independent_and_grown(
    request: pytest.FixtureRequest, pool_name: str, fs_type: str
) -> None:
    pool = pool_for(request, pool_name)
    src, clone = new_id(), new_id()
    export = pool.create_fs_volume(src, 64 * MiB, fs_type)
    (export / "a").write_bytes(b"original")
    clone_export = pool.clone_from_volume(src, clone, GiB, "nfs", fs_type)
    assert pool.clone_from_volume(src, clone, GiB, "nfs", fs_type) == clone_export  # idempotent
    (export / "a").write_bytes(b"changed in source")
    (clone_export / "c").write_bytes(b"only in clone")

    assert pool.list_mounts() == {src, clone}
    assert (clone_export / "a").read_bytes() == b"original"
    assert not (export / "c").exists()
    assert usable(clone_export) >= GiB
    assert fs_uuid(pool.image_path(clone)) != fs_uuid(pool.image_path(src))  # ganesha keys on it
    with pytest.raises(InvalidArgument):  # smaller than its source
        pool.clone_from_volume(clone, new_id(), 64 * MiB, "nfs", fs_type)
    with pytest.raises(NotFound):
        pool.clone_from_volume(new_id(), new_id(), GiB, "nfs", fs_type)
    pool.delete_volume(src)
    pool.delete_volume(clone)
    assert_nothing_left(pool)


@pytest.mark.parametrize("pool_name", ["xfs_pool", "ext4_pool"])
def test_clone_of_a_block_volume_copies_data_and_grows(
    request: pytest.FixtureRequest, pool_name: str
) -> None:
    pool = pool_for(request, pool_name)
    src, sid, from_volume, from_snapshot = new_id(), new_id(), new_id(), new_id()
    image = pool.create_block_image(src, 256 * MiB)
    write_at(image, 128 * MiB, b"block data")
    pool.snapshot(src, sid, None)

    def clone_both() -> list[Path]:
        return [
            pool.clone_from_volume(src, from_volume, GiB, "nbd", None),
            pool.clone_from_snapshot(sid, from_snapshot, GiB, "nbd", None),
        ]

    clones = clone_both()
    assert clone_both() == clones == [pool.image_path(from_volume), pool.image_path(from_snapshot)]
    for clone_image in clones:
        assert clone_image.stat().st_size == GiB
        assert read_at(clone_image, 128 * MiB, 10) == b"block data"
        assert pool.allocated_bytes(clone_image) < 8 * MiB
        assert clone_image.stat().st_mode & 0o777 == 0o600  # writable, unlike the snapshot
    with pytest.raises(InvalidArgument):
        pool.clone_from_snapshot(sid, new_id(), 128 * MiB, "nbd", None)
    with pytest.raises(InvalidArgument):
        pool.clone_from_snapshot(sid, new_id(), GiB, "iscsi", None)
    for v in (src, from_volume, from_snapshot):
        pool.delete_volume(v)
    pool.delete_snapshot(sid)
    assert pool.list_volume_images() == set()


def test_a_copy_reflinks_on_xfs_keeps_holes_on_ext4_and_never_replaces(
    xfs_pool: Pool, ext4_pool: Pool
) -> None:
    for pool, reflinks in ((xfs_pool, True), (ext4_pool, False)):
        src = pool.root / "src"
        with src.open("wb") as f:
            f.truncate(64 * MiB)
            f.seek(32 * MiB)
            f.write(b"x" * MiB)
        dst = pool.root / "dst"
        temp = temp_for(dst)
        assert copy_into(src, temp) is reflinks
        publish(temp, dst)
        assert dst.read_bytes() == src.read_bytes()
        assert pool.allocated_bytes(dst) <= 2 * MiB
        again = temp_for(dst)
        copy_into(src, again)
        with pytest.raises(AlreadyExists):
            publish(again, dst)
        assert [p.name for p in pool.root.iterdir() if ".tmp-" in p.name] == []


# --- deletion, inventory, accounting ---------------------------------------------------


def test_delete_leaves_no_mount_no_loop_device_and_no_files(xfs_pool: Pool) -> None:
    vids = [new_id() for _ in range(4)]
    xfs_pool.create_fs_volume(vids[0], 64 * MiB, "xfs")
    xfs_pool.create_fs_volume(vids[1], 64 * MiB, "ext4")
    xfs_pool.create_block_image(vids[2], GiB)
    xfs_pool.clone_from_volume(vids[0], vids[3], 64 * MiB, "nfs", "xfs")
    assert len(loops_under(xfs_pool.volumes_dir)) == 3
    assert xfs_pool.list_mounts() == {vids[0], vids[1], vids[3]}
    for vid in vids:
        xfs_pool.delete_volume(vid)
        xfs_pool.delete_volume(vid)
    assert_nothing_left(xfs_pool)
    assert list(xfs_pool.volumes_dir.iterdir()) == []
    losetup = sh(["losetup", "-a"])
    assert str(xfs_pool.root / "volumes") not in losetup


def test_inventory_lists_images_snapshots_and_mounts(xfs_pool: Pool) -> None:
    fs_vol, block_vol, sid = new_id(), new_id(), new_id()
    xfs_pool.create_fs_volume(fs_vol, 64 * MiB, "xfs")
    xfs_pool.create_block_image(block_vol, MiB)
    xfs_pool.snapshot(block_vol, sid, None)
    (xfs_pool.volumes_dir / f".{new_id()}.img.tmp-12345678").write_bytes(b"")
    (xfs_pool.volumes_dir / "stray.txt").write_bytes(b"")
    assert xfs_pool.list_volume_images() == {fs_vol, block_vol}
    assert xfs_pool.list_snapshot_images() == {sid}
    assert xfs_pool.list_mounts() == {fs_vol}
    assert xfs_pool.is_mounted(fs_vol) and not xfs_pool.is_mounted(block_vol)
    xfs_pool.unmount_fs_volume(fs_vol)
    assert xfs_pool.list_mounts() == set()
    for vid in (fs_vol, block_vol):
        xfs_pool.delete_volume(vid)
    xfs_pool.delete_snapshot(sid)


def test_capacity_and_used_bytes(xfs_pool: Pool) -> None:
    total, free = xfs_pool.capacity()
    assert POOL_SIZE * 0.95 < total <= POOL_SIZE
    assert 0 < free <= total
    block_vol, fs_vol = new_id(), new_id()
    image = xfs_pool.create_block_image(block_vol, GiB)
    assert xfs_pool.used_bytes(block_vol, "nbd") == 0
    write_at(image, 0, os.urandom(16 * MiB))
    assert xfs_pool.used_bytes(block_vol, "nbd") == 16 * MiB
    assert xfs_pool.capacity()[1] <= free - 16 * MiB

    export = xfs_pool.create_fs_volume(fs_vol, 256 * MiB, "xfs")
    empty = xfs_pool.used_bytes(fs_vol, "nfs")
    with (export / "f").open("wb") as f:
        f.write(os.urandom(32 * MiB))
        os.fsync(f.fileno())
    assert xfs_pool.used_bytes(fs_vol, "nfs") - empty >= 32 * MiB
    fs_image = xfs_pool.image_path(fs_vol)
    (export / "f").unlink()  # no discard: the image keeps its blocks, nothing punches it
    os.sync()
    trim = subprocess.run(["fstrim", str(export.parent)], capture_output=True, text=True)
    assert trim.returncode != 0 and "not supported" in trim.stderr, trim
    assert xfs_pool.allocated_bytes(fs_image) >= fs_image.stat().st_size
    with pytest.raises(InvalidArgument):
        xfs_pool.used_bytes(fs_vol, "iscsi")
    for vid in (block_vol, fs_vol):
        xfs_pool.delete_volume(vid)


# --- the loop-backed pool --------------------------------------------------------------


def test_loop_pool_is_remounted_after_release_and_grows(tmp_path: Path) -> None:
    pool_dir = tmp_path / "pool"
    try:
        image = init_loop_pool(pool_dir, GiB)
        assert image == pool_image_path(pool_dir) == tmp_path / "pool.img"
        assert json.loads(pool_record_path(pool_dir).read_text())["image"] == str(image)
        assert init_loop_pool(pool_dir, GiB) == image  # idempotent
        assert mount_points_under(pool_dir) == [pool_dir]
        pool = Pool(pool_dir)
        assert pool.supports_reflink()
        vid = new_id()
        (pool.create_fs_volume(vid, 64 * MiB, "xfs") / "f").write_bytes(b"kept")

        release_loop_pool(pool_dir)  # unmounts the volume inside too
        release_loop_pool(pool_dir)
        assert mount_points_under(pool_dir) == []
        assert loops_under(tmp_path) == []

        assert ensure_pool_mounted(pool_dir) == image  # the daemon's start
        assert ensure_pool_mounted(pool_dir) == image
        assert pool.list_volume_images() == {vid}
        pool.mount_fs_volume(vid, "xfs")
        assert (pool.export_dir(vid) / "f").read_bytes() == b"kept"

        init_loop_pool(pool_dir, 2 * GiB)  # grows, online
        assert pool.capacity()[0] > 1.9 * GiB
        with pytest.raises(InvalidArgument):
            init_loop_pool(pool_dir, GiB)
        assert (pool.export_dir(vid) / "f").read_bytes() == b"kept"
        pool.delete_volume(vid)
    finally:
        with contextlib.suppress(Exception):
            release_loop_pool(pool_dir)
        force_cleanup(tmp_path)


def test_ensure_pool_mounted_refuses_what_it_cannot_trust(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    assert ensure_pool_mounted(plain) is None  # no record: a plain directory pool

    pool_dir = tmp_path / "pool"
    try:
        image = init_loop_pool(pool_dir, XFS_MIN_IMAGE)
        release_loop_pool(pool_dir)
        (pool_dir / "stray").write_bytes(b"")  # would be hidden under the mount
        with pytest.raises(FailedPrecondition):
            ensure_pool_mounted(pool_dir)
        (pool_dir / "stray").unlink()
        image.rename(tmp_path / "moved.img")
        with pytest.raises(Unavailable):
            ensure_pool_mounted(pool_dir)
        with pytest.raises(InvalidArgument):
            init_loop_pool(tmp_path / "tiny", 64 * MiB)
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        sh(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(foreign)])
        with pytest.raises(FailedPrecondition):  # something else is mounted there
            init_loop_pool(foreign, GiB)
        assert not pool_record_path(foreign).exists()
    finally:
        with contextlib.suppress(Exception):
            release_loop_pool(pool_dir)
        force_cleanup(tmp_path)
