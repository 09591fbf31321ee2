"""A full pool on a real storage node (issue 17): no silent loss, clear refusals, a warning.

One daemon for the module, on a 1 GiB loop pool (room for two xfs volumes),
``--overcommit 4`` (block volumes may promise far more than the pool holds)
and ``--low-space-percent 20``.  nfs volume images must be fully allocated
(created, cloned, grown), so filling the pool through a thin block volume
over NBD cannot take the blocks an nfs volume's filesystem writes to: a file
written over NFS then either fails at the client or reads back equal after a
sync (read with O_DIRECT, past the page cache), never different.  An nfs
volume the pool has no real room for is RESOURCE_EXHAUSTED and recorded
nowhere; health and ``moorage_pool_low_space`` say the pool is low.
Each test leaves the node as it found it (no volumes).
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from backend import pool as pool_module
from backend.api.client import BackendClient
from backend.api.errors import ResourceExhausted
from backend.api.proto import backend_pb2 as pb
from backend.pool import Pool
from backend.poolinit import init_loop_pool, release_loop_pool
from nbd.libnbd import NBDClient
from tests.backend_calls import (
    big_random_file,
    expect,
    nbd_uri,
    nbd_volume,
    nfs_volume,
    pool_images,
    tool,
)
from tests.backend_node import BackendNode, make_node
from tests.conftest import free_port
from tests.prometheus_text import scrape, value

MiB = 1 << 20
POOL_SIZE = 1024 * MiB
LOW_SPACE_PERCENT = 20
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def node_and_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BackendNode, int]]:
    port = free_port()
    extra = ["--overcommit", "4", "--low-space-percent", str(LOW_SPACE_PERCENT)]
    extra += ["--metrics-listen", f"127.0.0.1:{port}"]
    node = make_node(tmp_path_factory.mktemp("full-pool") / "node", extra, pool_size=POOL_SIZE)
    try:
        node.start()
        yield node, port
    finally:
        node.teardown()


@pytest.fixture
def node(node_and_metrics: tuple[BackendNode, int]) -> Iterator[BackendNode]:
    node = node_and_metrics[0]
    yield node
    with node.client() as c:  # what a failed test left
        for v in c.list_volumes(max_entries=100).volumes:
            for n in v.published_nodes:
                c.unpublish(v.id, n)
            c.delete_volume(v.id)
        for snap in c.list_snapshots(max_entries=100).snapshots:
            c.delete_snapshot(snap.id)


def image_of(node: BackendNode, vol: pb.Volume) -> Path:
    return node.pool_dir / "volumes" / f"{vol.id}.img"


def assert_fully_allocated(node: BackendNode, vol: pb.Volume) -> None:
    st = image_of(node, vol).stat()
    assert st.st_size >= vol.size_bytes
    assert st.st_blocks * 512 >= st.st_size, (
        f"volume {vol.name}: {st.st_blocks * 512} of {st.st_size} image bytes allocated"
    )


def direct_sha256(path: Path) -> str:
    """sha256 of ``path`` read with O_DIRECT: what reached the loop device, not the cache."""
    out = subprocess.run(
        ["dd", f"if={path}", "iflag=direct", "bs=1M", "status=none"],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    return hashlib.sha256(out).hexdigest()


def fill_until_enospc(uri: str, size: int) -> int:
    """Write distinct 4 MiB chunks over NBD until the server answers ENOSPC; bytes written."""
    chunk = bytearray(os.urandom(4 * MiB))
    with NBDClient() as client:
        client.connect_uri(uri)
        for offset in range(0, size, len(chunk)):
            chunk[:8] = offset.to_bytes(8, "little")
            try:
                client.pwrite(bytes(chunk), offset)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return offset
        try:
            client.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            return size
    raise AssertionError(f"{size} bytes written over NBD and the pool is not full")


def wait_health(c: BackendClient, ok: bool, timeout: float = 60) -> pb.HealthResponse:
    """Health once its ok is ``ok`` (space freed by a delete shows up a little later)."""
    deadline = time.monotonic() + timeout
    while True:
        h = c.health()
        if h.ok == ok or time.monotonic() > deadline:
            return h
        time.sleep(0.2)


# ---------------------------------------------------------------------------------


def test_nfs_images_are_fully_allocated_after_create_clone_and_expand(node: BackendNode) -> None:
    with node.client() as c:
        share = nfs_volume(c, "share", 64 * MiB)
        assert_fully_allocated(node, share)
        # a clone shares the source's written extents, the rest is allocated
        from_vol = nfs_volume(c, "from-vol", 64 * MiB, volume_id=share.id)
        assert_fully_allocated(node, from_vol)
        c.delete_volume(from_vol.id)
        snap = c.create_snapshot("share-snap", share.id)
        from_snap = nfs_volume(c, "from-snap", 200 * MiB, snapshot_id=snap.id)
        assert_fully_allocated(node, from_snap)
        grown = c.expand_volume(from_snap.id, 220 * MiB)
        assert grown.size_bytes == 220 * MiB
        assert_fully_allocated(node, grown)
        for v in (from_snap, share):
            c.delete_volume(v.id)
        c.delete_snapshot(snap.id)

        # ext4: mke2fs would discard (punch) the whole image unless told not to
        small = nfs_volume(c, "small", 32 * MiB, fs_type="ext4")
        assert_fully_allocated(node, small)
        grown = c.expand_volume(small.id, 64 * MiB)
        assert_fully_allocated(node, grown)
        copy = nfs_volume(c, "small-copy", 96 * MiB, fs_type="ext4", volume_id=small.id)
        assert_fully_allocated(node, copy)
        for v in (copy, small):
            c.delete_volume(v.id)


def test_an_nfs_volume_larger_than_the_free_space_is_refused_and_recorded_nowhere(
    node: BackendNode,
) -> None:
    with node.client() as c:
        cap = c.capacity()
        assert cap.available_bytes > 2048 * MiB  # the overcommit would allow it
        assert cap.free_bytes < 1024 * MiB
        details = expect(Code.RESOURCE_EXHAUSTED, lambda: nfs_volume(c, "too-big", 1024 * MiB))
        assert "bytes needed" in details and "bytes free" in details, details
        assert list(c.list_volumes(max_entries=100).volumes) == []
        expect(Code.NOT_FOUND, lambda: c.get_volume(name="too-big"))
    assert pool_images(node) == set()  # not even a temporary file
    assert list((node.pool_dir / "mnt").iterdir()) == []


@pytest.mark.parametrize("online", [True, False], ids=["online", "offline"])
def test_the_pool_undoes_an_nfs_allocation_it_has_no_room_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, online: bool
) -> None:
    """Past the service's decision (another writer took the space): ENOSPC from
    fallocate is ResourceExhausted, and image, mount and data stay as they were."""
    if not online:  # ext4 grown offline: unmounted, and mounted again after the refusal
        monkeypatch.setattr(pool_module, "can_resize_ext4_online", lambda: False)
    pool_dir = tmp_path / "pool"
    init_loop_pool(pool_dir, 512 * MiB)
    try:
        pool = Pool(pool_dir)
        pool.ensure_layout()
        vid = uuid.uuid4().hex
        export = pool.create_fs_volume(vid, 64 * MiB, "ext4")
        (export / "data").write_bytes(b"kept")
        image = pool.image_path(vid)
        size, allocated = image.stat().st_size, pool.allocated_bytes(image)
        hog = os.open(pool_dir / "hog", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(hog, 0, pool.capacity()[1] - 32 * MiB)
        finally:
            os.close(hog)

        with pytest.raises(ResourceExhausted, match="bytes needed"):
            pool.create_fs_volume(uuid.uuid4().hex, 128 * MiB, "ext4")
        with pytest.raises(ResourceExhausted):
            pool.expand_fs_volume(vid, 256 * MiB, "ext4")
        with pytest.raises(ResourceExhausted):
            pool.clone_from_volume(vid, uuid.uuid4().hex, 128 * MiB, "nfs", "ext4")
        assert sorted(p.name for p in pool.volumes_dir.iterdir()) == [image.name]
        assert image.stat().st_size == size
        # nothing kept past the end (the clone's reflink may leave xfs a CoW extent or two)
        assert allocated <= pool.allocated_bytes(image) < allocated + MiB
        assert pool.is_mounted(vid) and (export / "data").read_bytes() == b"kept"

        (pool_dir / "hog").unlink()  # room again: the same expansion goes through
        pool.expand_fs_volume(vid, 256 * MiB, "ext4")
        assert pool.allocated_bytes(image) >= image.stat().st_size > size
        assert (export / "data").read_bytes() == b"kept"
        pool.delete_volume(vid)
    finally:
        release_loop_pool(pool_dir)


def test_a_full_pool_never_silently_changes_nfs_data(
    node_and_metrics: tuple[BackendNode, int], node: BackendNode, tmp_path: Path
) -> None:
    port = node_and_metrics[1]
    with node.client() as c:
        share = nfs_volume(c, "share", 64 * MiB)
        nfs = c.publish(share.id, "n1", "127.0.0.1").nfs
        h = c.health()
        assert (h.ok, h.serving, h.low_space) == (True, True, False), h.message
        assert value(scrape(port), "moorage_pool_low_space") == 0

        # a thin block volume bigger than what is free, written until the pool is full
        filler = nbd_volume(c, "filler", 2048 * MiB)
        free = c.capacity().free_bytes
        assert filler.size_bytes > free
        written = fill_until_enospc(nbd_uri(c.publish(filler.id, "n1", "127.0.0.1")), 2048 * MiB)
        assert 0 < written < filler.size_bytes
        cap = c.capacity()
        assert cap.free_bytes < cap.total_bytes * LOW_SPACE_PERCENT // 100

        # health: not ok, low on space, still serving; the metric says so too
        h = c.health()
        assert (h.ok, h.serving, h.low_space, h.ganesha_running) == (False, True, True, True)
        assert "pool low on space" in h.message and f"< {LOW_SPACE_PERCENT}%" in h.message
        assert value(scrape(port), "moorage_pool_low_space") == 1

        # no real room for an nfs volume or for growing one: refused, nothing recorded
        names = sorted(v.name for v in c.list_volumes(max_entries=100).volumes)
        images = pool_images(node)
        details = expect(Code.RESOURCE_EXHAUSTED, lambda: nfs_volume(c, "late", 64 * MiB))
        assert "bytes needed" in details and "bytes free" in details, details
        expect(Code.RESOURCE_EXHAUSTED, lambda: c.expand_volume(share.id, 200 * MiB))
        assert sorted(v.name for v in c.list_volumes(max_entries=100).volumes) == names
        assert pool_images(node) == images
        kept = c.get_volume(volume_id=share.id)
        assert (kept.state, kept.size_bytes) == ("ready", 64 * MiB)

        # 4 MiB written over NFS into the existing volume: an error, or the same bytes
        source = tmp_path / "four.bin"
        digest = big_random_file(source, 4 * MiB)
        url = node.nfs_url(nfs.export_path, "four.bin")
        copied = tool("nfs-cp", str(source), url, check=False)
        if copied.returncode == 0:
            os.sync()
            on_server = node.pool_dir / "mnt" / share.id / "export" / "four.bin"
            assert direct_sha256(on_server) == digest, "the written file changed on disk"
            assert hashlib.sha256(tool("nfs-cat", url).stdout).hexdigest() == digest
        else:  # the client was told
            assert copied.stderr or copied.stdout

        # space back: health recovers, the nfs data is still there
        c.unpublish(filler.id, "n1")
        c.delete_volume(filler.id)
        h = wait_health(c, ok=True)
        assert (h.ok, h.low_space, h.message) == (True, False, "ok")
        assert value(scrape(port), "moorage_pool_low_space") == 0
        if copied.returncode == 0:
            assert hashlib.sha256(tool("nfs-cat", url).stdout).hexdigest() == digest
        c.unpublish(share.id, "n1")
        c.delete_volume(share.id)
