"""The storage node's control plane: concurrent creates and deletes, and what a snapshot costs.

Run with ``make bench``.  Each test starts a real ``moorage backend serve``
(tests/backend_node.py) on a loop pool of its own and drives it through the
gRPC API, as the CSI controller does.

- ``test_concurrent_volumes``: 200 block (nbd) volumes of 64 MiB, then 50
  filesystem (nfs, xfs, smallest size: a 300 MiB image each, fully allocated,
  mkfs and loop mount) volumes, each batch created by 16 client threads at once, each
  thread with its own ``BackendClient`` (own channel); then every volume is
  deleted the same way.  Printed per batch: volumes/s over the batch's wall
  time, and the p50/p99/max latency of one call.  The node runs with
  ``--overcommit 10``: 200 x 64 MiB is more than 4 GiB, thinly; the pool is
  4 GiB or, with more nfs volumes than that holds, large enough for their images.
- ``test_snapshot_cost``: a 10 GiB block volume holding 1 GiB of random data
  (written straight into its image); ``CreateSnapshot`` through the API
  timed next to ``cp`` of the same image into the same pool filesystem, on
  the usual xfs loop pool (FICLONE reflink) and on an ext4 loop pool (the
  SEEK_DATA/SEEK_HOLE sparse-copy fallback).  coreutils >= 9 ``cp``
  reflinks by default, even with ``--sparse=always``, so both
  ``cp --sparse=always`` and ``cp --reflink=never --sparse=always`` (a real
  data copy) are timed; the file and the page cache are warm for all.

Nothing here asserts a speed: the tests fail only if an operation fails or
its result is wrong (volumes not ready, snapshot content differing, a mount
or loop device left behind).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from backend.api.client import BackendClient
from backend.api.proto import backend_pb2 as pb
from backend.loopdevices import loop_devices
from backend.mounts import mount_table
from hostio.atomicfile import fsync_path
from tests.backend_node import BackendNode, make_node
from tests.bench.harness import percentile
from tests.conftest import REPO, run

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

MiB = 1 << 20
GiB = 1 << 30
CLIENTS = 16
# The published figures use the defaults; the overrides are for trying the harness out.
NBD_VOLUMES = int(os.environ.get("MOORAGE_BENCH_NBD_VOLUMES", "200"))
NFS_VOLUMES = int(os.environ.get("MOORAGE_BENCH_NFS_VOLUMES", "50"))
NBD_VOLUME_SIZE = 64 * MiB
NFS_VOLUME_SIZE = MiB  # the smallest size; the xfs image is XFS_MIN_IMAGE (300 MiB)
OVERCOMMIT = "10"
# nfs images are fully allocated (docs/backend.md, "A full pool"): room for all of them
CONCURRENT_POOL_SIZE = max(4 * GiB, NFS_VOLUMES * 320 * MiB + GiB)

SNAP_VOLUME_SIZE = 10 * GiB
SNAP_DATA = int(os.environ.get("MOORAGE_BENCH_SNAP_DATA_MIB", "1024")) * MiB
SNAP_POOL_SIZE = 24 * GiB  # sparse: the volume, its data and a full copy fit without overcommit
EXT4_POOL_SIZE = 16 * GiB
SNAP_RUNS = 3
SNAP_TARGET = 0.2  # seconds, CreateSnapshot on a reflink pool
CHUNK = 8 * MiB

T = TypeVar("T")
R = TypeVar("R")


# ------------------------------------------------------------ measurements


@dataclass(frozen=True)
class Batch:
    label: str
    wall: float
    latencies: list[float]
    errors: list[str]

    @property
    def count(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        return self.count / self.wall if self.wall else 0.0

    def row(self) -> str:
        ms = [x * 1000 for x in self.latencies]
        return (
            f"| {self.label} | {self.count} | {CLIENTS} | {self.wall:.2f} | {self.rate:.1f} "
            f"| {percentile(ms, 50):.0f} | {percentile(ms, 99):.0f} | {max(ms):.0f} "
            f"| {len(self.errors)} |"
        )


BATCH_HEADER = (
    "| operation | volumes | clients | wall (s) | volumes/s | p50 (ms) | p99 (ms) | max (ms) "
    "| errors |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|"
)


def concurrently(
    node: BackendNode,
    label: str,
    items: Sequence[T],
    call: Callable[[BackendClient, T], R],
) -> tuple[Batch, list[R]]:
    """``call`` on every item from CLIENTS threads, each with its own client (and channel).

    The threads take the next item from a shared cursor, so a slow call does
    not leave the others idle; the wall time runs from the moment all the
    threads (connected already) are released to the end of the last call.
    """
    results: list[R | None] = [None] * len(items)
    latencies: list[float] = [0.0] * len(items)
    errors: list[str] = []
    cursor = iter(range(len(items)))
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS + 1)

    def worker() -> None:
        with node.client() as client:
            try:
                client.health()  # connect before the clock starts
            finally:
                start.wait(timeout=60)
            while True:
                with lock:
                    i = next(cursor, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    results[i] = call(client, items[i])
                except Exception as e:
                    with lock:
                        errors.append(f"{items[i]!r}: {describe(e)}")
                latencies[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker, name=f"bench-client-{n}") for n in range(CLIENTS)]
    for t in threads:
        t.start()
    start.wait(timeout=60)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    return Batch(label, wall, latencies, errors), done


def describe(error: Exception) -> str:
    if isinstance(error, grpc.Call):
        return f"{error.code()} {error.details()}"
    return f"{type(error).__name__}: {error}"


# ------------------------------------------------------------ leftovers


def leftovers(root: Path) -> list[str]:
    """Mounts and loop devices at or below ``root`` (there must be none after teardown)."""
    root = root.resolve()
    found = [f"mount {p}" for p in mount_table() if p == root or root in p.parents]
    found += [f"loop device {d}" for d in loop_devices(root)]
    return found


def check_clean(root: Path) -> None:
    left = leftovers(root)
    assert not left, f"left behind under {root}: {left}"


@contextmanager
def running(root: Path, make: Callable[[], BackendNode]) -> Iterator[BackendNode]:
    """A started node made by ``make`` under ``root``, torn down whatever happens.

    The teardown also runs when ``make`` fails after mounting the pool.
    """
    node: BackendNode | None = None
    try:
        node = make()
        node.start()
        yield node
    finally:
        (node or BackendNode(root=root)).teardown()


# ------------------------------------------------------- concurrent volumes


def create_nbd(client: BackendClient, name: str) -> pb.Volume:
    return client.create_volume(
        pb.CreateVolumeRequest(name=name, type=pb.NBD, size_bytes=NBD_VOLUME_SIZE)
    )


def create_nfs(client: BackendClient, name: str) -> pb.Volume:
    return client.create_volume(
        pb.CreateVolumeRequest(
            name=name, type=pb.NFS, size_bytes=NFS_VOLUME_SIZE, parameters={"fs_type": "xfs"}
        )
    )


def delete(client: BackendClient, volume_id: str) -> str:
    client.delete_volume(volume_id)
    return volume_id


def all_volumes(client: BackendClient) -> list[pb.Volume]:
    found: list[pb.Volume] = []
    token = ""
    while True:
        page = client.list_volumes(max_entries=1000, token=token)
        found.extend(page.volumes)
        token = page.next_token
        if not token:
            return found


def test_concurrent_volumes(tmp_path: Path) -> None:
    root = tmp_path / "node"
    batches: list[Batch] = []
    load_before = loadavg()
    try:
        with running(
            root,
            lambda: make_node(root, ["--overcommit", OVERCOMMIT], pool_size=CONCURRENT_POOL_SIZE),
        ) as node:
            nbd_names = [f"bench-nbd-{i:04d}" for i in range(NBD_VOLUMES)]
            batch, nbd = concurrently(
                node, f"create nbd, {NBD_VOLUME_SIZE // MiB} MiB", nbd_names, create_nbd
            )
            batches.append(batch)
            assert not batch.errors, batch.errors[:5]
            assert sorted(v.name for v in nbd) == nbd_names
            assert all(v.state == "ready" and v.type == pb.NBD for v in nbd)

            nfs_names = [f"bench-nfs-{i:04d}" for i in range(NFS_VOLUMES)]
            batch, nfs = concurrently(node, "create nfs, xfs, 1 MiB", nfs_names, create_nfs)
            batches.append(batch)
            assert not batch.errors, batch.errors[:5]
            assert sorted(v.name for v in nfs) == nfs_names
            assert all(v.state == "ready" and v.fs_type == "xfs" for v in nfs)

            pool = node.pool_dir.resolve()
            with node.client() as c:
                assert len(all_volumes(c)) == NBD_VOLUMES + NFS_VOLUMES
            images = {p.name for p in (pool / "volumes").iterdir()}
            assert images == {f"{v.id}.img" for v in [*nbd, *nfs]}
            mounted = {p.name for p in mount_table() if p.parent == pool / "mnt"}
            assert mounted == {v.id for v in nfs}

            batch, _ = concurrently(node, "delete nbd", [v.id for v in nbd], delete)
            batches.append(batch)
            assert not batch.errors, batch.errors[:5]
            batch, _ = concurrently(node, "delete nfs", [v.id for v in nfs], delete)
            batches.append(batch)
            assert not batch.errors, batch.errors[:5]

            with node.client() as c:
                assert all_volumes(c) == []
            assert list((pool / "volumes").iterdir()) == []
            assert not [p for p in mount_table() if pool / "mnt" in p.parents]
            assert loop_devices(pool) == []
    finally:
        print("\n" + "=" * 100)
        print(
            f"backend control plane, {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, "
            f"{CLIENTS} gRPC clients (one channel each) over the unix socket"
        )
        print(f"  moorage {revision()}, Python {sys.version.split()[0]}")
        print(f"  load average before: {load_before}, after: {loadavg()}")
        print()
        print(BATCH_HEADER)
        for b in batches:
            print(b.row())
        print("=" * 100)
    check_clean(root)


# ------------------------------------------------------------- snapshots


@dataclass(frozen=True)
class Timing:
    label: str
    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)


def fill_random(path: Path, size: int) -> None:
    with path.open("wb") as f:
        for _ in range(size // CHUNK):
            f.write(os.urandom(CHUNK))
        f.flush()
        os.fsync(f.fileno())


def same_prefix(a: Path, b: Path, size: int) -> bool:
    """The first ``size`` bytes of ``a`` and ``b`` are equal."""
    with a.open("rb") as fa, b.open("rb") as fb:
        left = size
        while left:
            n = min(CHUNK, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def snapshot_runs(node: BackendNode, data: Path, pool_label: str) -> list[Timing]:
    """A 10 GiB volume with SNAP_DATA of ``data``: CreateSnapshot vs cp, SNAP_RUNS each."""
    pool = node.pool_dir.resolve()
    with node.client() as client:
        vol = client.create_volume(
            pb.CreateVolumeRequest(name="bench-snap-src", type=pb.NBD, size_bytes=SNAP_VOLUME_SIZE)
        )
        image = pool / "volumes" / f"{vol.id}.img"
        run(
            [
                "dd",
                f"if={data}",
                f"of={image}",
                f"bs={CHUNK}",
                f"count={SNAP_DATA // CHUNK}",
                "conv=notrunc,fsync",
                "status=none",
            ],
            timeout=600,
        )
        assert image.stat().st_size == SNAP_VOLUME_SIZE
        assert allocated(image) >= SNAP_DATA

        snap_times: list[float] = []
        snaps: list[pb.Snapshot] = []
        for r in range(SNAP_RUNS):
            t0 = time.perf_counter()
            snap = client.create_snapshot(f"bench-snap-{r}", vol.id)
            snap_times.append(time.perf_counter() - t0)
            assert snap.ready_to_use and snap.size_bytes == SNAP_VOLUME_SIZE
            snaps.append(snap)
        first = pool / "snapshots" / f"{snaps[0].id}.img"
        assert first.stat().st_size == SNAP_VOLUME_SIZE
        assert same_prefix(first, data, SNAP_DATA), "the snapshot does not hold the data"

        timings = [Timing(f"{pool_label}: CreateSnapshot (API)", snap_times)]
        for label, argv in (
            ("cp --sparse=always", ["cp", "--sparse=always"]),
            ("cp --reflink=never --sparse=always", ["cp", "--reflink=never", "--sparse=always"]),
        ):
            copy_times, synced_times = [], []
            for r in range(SNAP_RUNS):
                dst = pool / f"bench-cp-{r}.img"
                t0 = time.perf_counter()
                run([*argv, str(image), str(dst)], timeout=600)
                t1 = time.perf_counter()
                fsync_path(dst)
                t2 = time.perf_counter()
                copy_times.append(t1 - t0)
                synced_times.append(t2 - t0)
                assert dst.stat().st_size == SNAP_VOLUME_SIZE
                dst.unlink()
            timings.append(Timing(f"{pool_label}: {label}", copy_times))
            timings.append(Timing(f"{pool_label}: {label}, then fsync", synced_times))

        for snap in snaps:
            client.delete_snapshot(snap.id)
        client.delete_volume(vol.id)
    how = "reflink" if pool_label.startswith("xfs") else "sparse copy"
    logged = node.log.read_text(errors="replace").count(f"of volume {vol.id} ({how})")
    assert logged == SNAP_RUNS, f"expected {SNAP_RUNS} snapshots by {how}, the log has {logged}"
    return timings


def ext4_node(root: Path) -> BackendNode:
    """A node whose pool is a loop-mounted ext4 image (no reflink), with no pool record.

    The image sits where a loop pool's would (``<pool>.img``), so the node's
    teardown unmounts it and detaches its loop device the same way.
    """
    root.mkdir(parents=True)
    image = root / "pool.img"
    with image.open("xb") as f:
        f.truncate(EXT4_POOL_SIZE)
    run(["mkfs.ext4", "-q", "-F", str(image)], timeout=600)
    (root / "pool").mkdir()
    run(["mount", "-t", "ext4", "-o", "loop,noatime", str(image), str(root / "pool")])
    return BackendNode(root=root)


def test_snapshot_cost(tmp_path: Path) -> None:
    data = tmp_path / "random.bin"
    fill_random(data, SNAP_DATA)
    timings: list[Timing] = []
    load_before = loadavg()
    try:
        xfs_root = tmp_path / "xfs"
        try:
            with running(xfs_root, lambda: make_node(xfs_root, pool_size=SNAP_POOL_SIZE)) as node:
                timings += snapshot_runs(node, data, "xfs pool (reflink)")
        finally:
            check_clean(xfs_root)
        ext4_root = tmp_path / "ext4"
        try:
            with running(ext4_root, lambda: ext4_node(ext4_root)) as node:
                timings += snapshot_runs(node, data, "ext4 pool (sparse copy)")
        finally:
            check_clean(ext4_root)
    finally:
        print("\n" + "=" * 100)
        print(
            f"snapshot of a {SNAP_VOLUME_SIZE // GiB} GiB nbd volume holding "
            f"{SNAP_DATA // MiB} MiB of random data, {SNAP_RUNS} runs each, "
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs"
        )
        print(f"  moorage {revision()}, Python {sys.version.split()[0]}, {cp_version()}")
        print(f"  load average before: {load_before}, after: {loadavg()}")
        print()
        print(snapshot_table(timings))
        print("=" * 100)


def snapshot_table(timings: list[Timing]) -> str:
    lines = [
        "| pool: operation | min (s) | median (s) | max (s) | median / CreateSnapshot | target |",
        "|---|--:|--:|--:|--:|---|",
    ]
    base = 0.0
    for t in timings:
        if "CreateSnapshot" in t.label:
            base = t.median
        target = ""
        if t.label.startswith("xfs") and "CreateSnapshot" in t.label:
            target = f"< {SNAP_TARGET} s: " + ("yes" if t.median < SNAP_TARGET else "**no**")
        ratio = f"{t.median / base:.1f}x" if base else "n/a"
        lines.append(
            f"| {t.label} | {min(t.runs):.3f} | {t.median:.3f} | {max(t.runs):.3f} "
            f"| {ratio} | {target} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------ the setting


def revision() -> str:
    head = run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "--", "backend"])
    return head.stdout.strip() + (" + uncommitted changes in backend/" * bool(dirty.stdout))


def cp_version() -> str:
    out = subprocess.run(["cp", "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "cp (unknown version)"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
