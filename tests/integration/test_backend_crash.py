"""Crash safety of the storage node: SIGKILL at every failpoint, restart, check.

One daemon on one loop pool serves the whole module.  Each case creates its
own volumes on the healthy daemon (writing known data into them), restarts
the daemon with one failpoint armed (``MOORAGE_FAILPOINTS``), runs the
operation that reaches it, sees the daemon die, restarts it without
failpoints, and checks:

- no orphan: the images in ``volumes/`` and ``snapshots/``, the mount dirs
  and mounts under ``mnt/`` and the loop devices backed by pool files are
  exactly those of the volumes and snapshots the API lists; no hidden
  temporary file is left; no loop device is backed by a deleted file;
- no dangling record: every volume is ``ready``, every snapshot ready to use,
  every publication ``published``, no journal entry ``pending``; and the
  interrupted operation was finished, not undone (its journal entry is
  ``done``: finishing is possible in every case here);
- no volume lost: the volumes that existed before the crash (two "keepers"
  for the whole module, and the case's own) hold their data, and nfs ones
  take writes (are not left frozen);
- exports match the catalog: one ganesha export file per nfs volume with
  publications, with its Export_Id and Path; ganesha runs; every NBD
  publication is served;
- the interrupted call, retried as a CSI sidecar would, succeeds and gives a
  working result.

Each case then cleans up (unpublish, delete) on the restarted daemon, so the
next one starts from a consistent node.

Why this file is long: it is one scenario table for crash tests: a Scenario class per
operation (create and clone, delete, snapshot, expand, publish, unpublish, modify) says
what to make, where to crash, and how to check and retry, and every case goes through
the same invariant checks on the one module-scoped daemon.
test_every_failpoint_is_crashed_at compares the table with every failpoint in the code,
so the table stays whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import grpc
import pytest

from backend.api.client import BackendClient
from backend.api.proto import backend_pb2 as pb
from backend.ganesha.config import ExportConfig, render_export
from tests.backend_node import BackendNode, make_node
from tests.conftest import REPO, run

MiB = 1 << 20
NODE_ID = "n1"
NODE_ADDRESS = "127.0.0.1"
NBD_SIZE = 8 * MiB
NFS_SIZE = 64 * MiB
EXPANDED = {"nbd": 16 * MiB, "nfs": 256 * MiB}
# Where nbd volumes get their pattern (the rest stays zero).
NBD_SPANS = ((0, 64 * 1024), (5 * MiB, 64 * 1024))
DATA_FILE = "data.txt"
TOOL_TIMEOUT = 60
CATALOG_FILE = "catalog.sqlite3"
_EXPORT_FILE = re.compile(r"export-([0-9]+)\.conf")

pytestmark = pytest.mark.timeout(900)


# ------------------------------------------------------------------ the node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendNode]:
    """One storage node for the module; each case leaves it running and consistent."""
    n = make_node(tmp_path_factory.mktemp("crash") / "node")
    try:
        n.start()
        yield n
    finally:
        try:
            n.teardown()
        except Exception:
            # A ganesha still stuck on a filesystem that was frozen keeps its
            # mount busy for a moment: once more, then let the error through.
            time.sleep(5)
            n.teardown()


@dataclass(frozen=True)
class Vol:
    """A volume the test wrote into: ``pattern`` is its nbd byte, or seeds its nfs file."""

    id: str
    name: str
    kind: str
    pattern: int


@pytest.fixture(scope="module")
def keepers(node: BackendNode) -> list[Vol]:
    """An nbd and an nfs volume, published and holding data, for the whole module."""
    made = [
        create(node, "keeper-nbd", "nbd", pattern=0x5A),
        create(node, "keeper-nfs", "nfs", pattern=0x3C),
    ]
    for vol in made:
        write_data(node, vol)
        check_data(node, vol)
    return made


# ------------------------------------------------------------ client helpers


def create_request(
    name: str, kind: str, source_snapshot: str = "", source_volume: str = ""
) -> pb.CreateVolumeRequest:
    req = pb.CreateVolumeRequest(
        name=name,
        type=pb.NBD if kind == "nbd" else pb.NFS,
        size_bytes=NBD_SIZE if kind == "nbd" else NFS_SIZE,
    )
    if kind == "nfs":
        req.parameters["fs_type"] = "xfs"
    if source_snapshot:
        req.snapshot_id = source_snapshot
    if source_volume:
        req.volume_id = source_volume
    return req


def create(node: BackendNode, name: str, kind: str, pattern: int) -> Vol:
    with node.client() as c:
        v = c.create_volume(create_request(name, kind))
    assert v.state == "ready", v
    return Vol(v.id, name, kind, pattern)


def status_of(error: grpc.RpcError) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.Call) else None


def find_volume(c: BackendClient, *, volume_id: str = "", name: str = "") -> pb.Volume | None:
    try:
        return c.get_volume(volume_id=volume_id, name=name)
    except grpc.RpcError as e:
        if status_of(e) == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def all_volumes(c: BackendClient) -> list[pb.Volume]:
    found: list[pb.Volume] = []
    token = ""
    while True:
        page = c.list_volumes(token=token)
        found.extend(page.volumes)
        token = page.next_token
        if not token:
            return found


def all_snapshots(c: BackendClient) -> list[pb.Snapshot]:
    found: list[pb.Snapshot] = []
    token = ""
    while True:
        page = c.list_snapshots(token=token)
        found.extend(page.snapshots)
        token = page.next_token
        if not token:
            return found


def find_snapshot(c: BackendClient, snapshot_id: str) -> pb.Snapshot | None:
    return next((s for s in all_snapshots(c) if s.id == snapshot_id), None)


def publish(node: BackendNode, volume_id: str) -> pb.PublishVolumeResponse:
    """Publish to the test's node n1 (idempotent: republishes what a crash lost)."""
    with node.client() as c:
        return c.publish(volume_id, NODE_ID, NODE_ADDRESS)


def nbd_uri(target: pb.NbdTarget) -> str:
    assert target.host == "127.0.0.1", target
    return f"nbd://127.0.0.1:{target.port}/{target.export_name}"


def qemu_io(uri: str, *commands: str) -> None:
    """Run qemu-io commands on an NBD export; a failed command or pattern mismatch fails."""
    argv = ["qemu-io", "-f", "raw"]
    for command in commands:
        argv += ["-c", command]
    result = run([*argv, uri], timeout=TOOL_TIMEOUT)
    assert "verification failed" not in result.stdout + result.stderr, result


def nfs_text(name: str, pattern: int) -> str:
    return f"moorage crash test: volume {name}, pattern {pattern:#x}\n" * 300


def write_data(node: BackendNode, vol: Vol) -> None:
    """Publish the volume to n1 and write its pattern (nbd) or its file (nfs)."""
    target = publish(node, vol.id)
    if vol.kind == "nbd":
        writes = [f"write -P {vol.pattern:#x} {off} {length}" for off, length in NBD_SPANS]
        qemu_io(nbd_uri(target.nbd), *writes, "flush")
        return
    local = node.root / f"upload-{vol.id}"
    local.write_text(nfs_text(vol.name, vol.pattern))
    run(["nfs-cp", str(local), node.nfs_url(target.nfs.export_path, DATA_FILE)])
    local.unlink()


def check_data(node: BackendNode, vol: Vol, like: Vol | None = None) -> None:
    """The volume holds its data (or ``like``'s, for a clone) and takes writes.

    Publishes to n1 first (idempotent), so a publication lost or rolled back
    by a crash is simply made again, as the CO would.  The nfs write also
    proves the filesystem was not left frozen by a snapshot or clone killed
    mid-copy (nfs-cp would hang until the timeout).
    """
    source = like or vol
    target = publish(node, vol.id)
    if vol.kind == "nbd":
        uri = nbd_uri(target.nbd)
        reads = [f"read -P {source.pattern:#x} {off} {length}" for off, length in NBD_SPANS]
        qemu_io(uri, *reads, f"read -P 0 {MiB} 65536")
        qemu_io(uri, f"write -P 0x11 {2 * MiB} 4096", f"read -P 0x11 {2 * MiB} 4096", "flush")
        return
    got = run(["nfs-cat", node.nfs_url(target.nfs.export_path, DATA_FILE)]).stdout
    assert got == nfs_text(source.name, source.pattern), f"{vol.name}: data differs"
    probe = node.root / f"probe-{vol.id}"
    probe.write_text(f"probe {time.monotonic_ns()}\n")
    url = node.nfs_url(target.nfs.export_path, f"probe-{time.monotonic_ns()}")
    run(["nfs-cp", str(probe), url], timeout=TOOL_TIMEOUT)
    assert run(["nfs-cat", url], timeout=TOOL_TIMEOUT).stdout == probe.read_text()
    probe.unlink()


def remove_all(node: BackendNode, prefix: str) -> None:
    """Unpublish and delete the volumes and snapshots named ``prefix...``."""
    with node.client() as c:
        for snap in all_snapshots(c):
            if snap.name.startswith(prefix):
                c.delete_snapshot(snap.id)
        for v in all_volumes(c):
            if v.name.startswith(prefix):
                for published_to in v.published_nodes:
                    c.unpublish(v.id, published_to)
                c.delete_volume(v.id)
        assert not [v.name for v in all_volumes(c) if v.name.startswith(prefix)]
        assert not [s.name for s in all_snapshots(c) if s.name.startswith(prefix)]


# ------------------------------------------------------------------ invariants


def mount_points() -> list[Path]:
    """Every mount point in /proc/self/mountinfo (a stacked mount appears twice)."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            field_ = line.split()[4]
            found.append(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field_)))
    return found


def loop_backing_files() -> list[tuple[str, str]]:
    """(device, backing file) of every loop device; deleted files end in ' (deleted)'."""
    out = run(["losetup", "--list", "--json", "-O", "NAME,BACK-FILE"]).stdout
    if not out.strip():
        return []
    devices = json.loads(out).get("loopdevices", [])
    return [(str(d["name"]), str(d.get("back-file") or "")) for d in devices]


def read_catalog(node: BackendNode, sql: str) -> list[tuple[object, ...]]:
    """Query the daemon's SQLite catalog read-only (WAL: never blocks the daemon)."""
    path = node.data_dir / CATALOG_FILE
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def export_files(node: BackendNode) -> dict[int, Path]:
    """Export_Id -> Path of each ganesha export file; every file must be a whole export."""
    export_dir = node.data_dir / "ganesha" / "exports.d"
    found: dict[int, Path] = {}
    for entry in sorted(os.listdir(export_dir)):
        match = _EXPORT_FILE.fullmatch(entry)
        assert match, f"unexpected file {entry} in {export_dir}"
        text = (export_dir / entry).read_text()
        ids = re.findall(r"^\s*Export_Id\s*=\s*(\d+)\s*;", text, re.M)
        paths = re.findall(r'^\s*Path\s*=\s*"([^"]*)"\s*;', text, re.M)
        assert ids == [match[1]] and len(paths) == 1, f"{entry}:\n{text}"
        found[int(ids[0])] = Path(paths[0])
    return found


def last_operation(node: BackendNode) -> int:
    rows = read_catalog(node, "SELECT coalesce(max(id), 0) FROM operations")
    return int(str(rows[0][0]))


def check_journal_since(node: BackendNode, after: int) -> None:
    """Every operation journaled after ``after`` is done: none pending, none rolled back.

    The daemon finishes an interrupted operation and undoes one only where
    finishing is impossible (docs/backend.md), which no case here makes so.
    """
    unfinished = read_catalog(
        node,
        f"SELECT kind, target_id, state, error FROM operations WHERE id > {after} "
        "AND state != 'done' ORDER BY id",
    )
    assert unfinished == [], f"operations not finished: {unfinished}"


def check_node(node: BackendNode) -> None:
    """Every invariant a crash must not break (see the module docstring)."""
    pool = node.pool_dir.resolve()
    with node.client() as c:
        health = c.health()
        volumes = all_volumes(c)
        snapshots = all_snapshots(c)
    assert health.ok and health.ganesha_running, health

    # no dangling record
    assert [(v.name, v.state) for v in volumes if v.state != "ready"] == []
    assert [
        (s.name, s.state) for s in snapshots if not (s.ready_to_use and s.state == "ready")
    ] == []
    assert read_catalog(node, "SELECT kind, target_id FROM operations WHERE state='pending'") == []
    publications = read_catalog(node, "SELECT volume_id, node_id, state FROM publications")
    assert sorted(publications) == sorted(
        (v.id, n, "published") for v in volumes for n in v.published_nodes
    )

    # no orphan image, no lost image, no temporary file
    volume_ids = {v.id for v in volumes}
    nfs_ids = {v.id for v in volumes if v.type == pb.NFS}
    assert sorted(os.listdir(pool / "volumes")) == sorted(f"{i}.img" for i in volume_ids)
    assert sorted(os.listdir(pool / "snapshots")) == sorted(f"{s.id}.img" for s in snapshots)
    assert sorted(os.listdir(pool / "mnt")) == sorted(nfs_ids), "orphan or missing mount dir"
    # the pool's id marker and (once something was quarantined) the quarantine folder
    stray = set(os.listdir(pool)) - {"quarantine", "moorage-pool.json"}
    assert sorted(stray) == ["mnt", "snapshots", "volumes"], "stray file in pool"

    # mounts: exactly one per nfs volume, on its mount dir
    under_mnt = sorted(str(p) for p in mount_points() if pool / "mnt" in p.parents)
    assert under_mnt == sorted(str(pool / "mnt" / i) for i in nfs_ids)

    # loop devices: one per mounted nfs image, none on a deleted or unknown file
    backed = []
    for device, back in loop_backing_files():
        assert not (back.endswith(" (deleted)") and str(node.root) in back), (device, back)
        if Path(back) == pool or pool in Path(back).parents:
            backed.append(back)
    assert sorted(backed) == sorted(str(pool / "volumes" / f"{i}.img") for i in nfs_ids)

    # ganesha's export files match the catalog
    published_nfs = {v.id for v in volumes if v.type == pb.NFS and v.published_nodes}
    files = export_files(node)
    assert sorted(map(str, files.values())) == sorted(
        str(pool / "mnt" / i / "export") for i in published_nfs
    )
    catalog_ids = {
        str(vol_id): export_id
        for vol_id, export_id in read_catalog(
            node, "SELECT id, nfs_export_id FROM volumes WHERE type='nfs'"
        )
    }
    for export_id, path in files.items():
        assert catalog_ids[path.parent.name] == export_id, (export_id, path)

    # every NBD publication is served again
    nbd_pubs = [(v.id, n) for v in volumes if v.type == pb.NBD for n in v.published_nodes]
    assert health.nbd_exports == len(nbd_pubs), health
    for vol_id, node_id in nbd_pubs:
        run(["nbdinfo", "--size", f"nbd://127.0.0.1:{node.nbd_port}/{vol_id}@{node_id}"])


# ------------------------------------------------------------------ scenarios


@dataclass
class Ctx:
    """What a case made before the crash."""

    tag: str
    source: Vol | None = None
    snapshot_id: str = ""
    survivors: list[Vol] = field(default_factory=list)

    @property
    def new_name(self) -> str:
        return f"{self.tag}-new"


class Scenario:
    """One operation: what to make first, the call that crashes, the checks and the retry."""

    kind = "nbd"
    failpoints: tuple[str, ...] = ()

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        ctx.source = create(node, f"{ctx.tag}-src", self.kind, pattern=0xC5)
        write_data(node, ctx.source)
        ctx.survivors.append(ctx.source)

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        raise NotImplementedError

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        """Checks specific to the operation, right after the restart."""

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        raise NotImplementedError


class CreateScenario(Scenario):
    def __init__(self, kind: str, source: str = "") -> None:
        self.kind = kind
        self.source_kind = source  # "", "snapshot" or "volume"
        self.failpoints = ("create.intent", "create.files")
        if kind == "nfs" and not source:
            self.failpoints = ("create.intent", "pool.formatted", "create.files")
        if kind == "nfs" and source == "volume":  # the mounted source is frozen for the copy
            self.failpoints = ("create.intent", "pool.frozen", "create.files")

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        if not self.source_kind:
            return
        super().setup(node, ctx)
        assert ctx.source is not None
        if self.source_kind == "snapshot":
            with node.client() as c:
                snap = c.create_snapshot(f"{ctx.tag}-snap", ctx.source.id)
            assert snap.ready_to_use, snap
            ctx.snapshot_id = snap.id

    def request(self, ctx: Ctx) -> pb.CreateVolumeRequest:
        source_volume = ctx.source.id if ctx.source and self.source_kind == "volume" else ""
        return create_request(ctx.new_name, self.kind, ctx.snapshot_id, source_volume)

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        c.create_volume(self.request(ctx))

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            v = find_volume(c, name=ctx.new_name)
        # Every failpoint comes after the intent was recorded, and finishing is
        # possible (the source is there): the restart finishes it.
        assert v is not None and v.state == "ready", f"interrupted create not finished: {v}"

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            v = c.create_volume(self.request(ctx))
            assert v.state == "ready", v
            assert c.get_volume(name=ctx.new_name).id == v.id
        made = Vol(v.id, ctx.new_name, self.kind, pattern=0x96)
        if ctx.source is not None:
            check_data(node, made, like=ctx.source)  # a clone holds its source's data
        else:
            write_data(node, made)
            check_data(node, made)


class DeleteScenario(Scenario):
    failpoints = ("delete.intent", "delete.files")

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        super().setup(node, ctx)
        assert ctx.source is not None
        ctx.survivors.clear()  # this one goes
        with node.client() as c:
            c.unpublish(ctx.source.id, NODE_ID)

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        assert ctx.source is not None
        c.delete_volume(ctx.source.id)

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c:  # the intent was recorded: the delete is finished
            assert find_volume(c, volume_id=ctx.source.id) is None

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c:
            c.delete_volume(ctx.source.id)
            assert find_volume(c, volume_id=ctx.source.id) is None


class SnapshotScenario(Scenario):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.failpoints = ("snapshot.intent", "snapshot.files")
        if kind == "nfs":  # the mounted filesystem is frozen for the copy
            self.failpoints = ("snapshot.intent", "pool.frozen", "snapshot.files")

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        assert ctx.source is not None
        c.create_snapshot(f"{ctx.tag}-snap", ctx.source.id)

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            snap = next((x for x in all_snapshots(c) if x.name == f"{ctx.tag}-snap"), None)
        # recorded intent, source still there: the restart finishes the snapshot
        assert snap is not None and snap.ready_to_use, f"interrupted snapshot not finished: {snap}"

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c:
            snap = c.create_snapshot(f"{ctx.tag}-snap", ctx.source.id)
            assert snap.ready_to_use and snap.state == "ready", snap
            clone = c.create_volume(create_request(f"{ctx.tag}-clone", self.kind, snap.id))
        assert clone.state == "ready", clone
        check_data(node, Vol(clone.id, clone.name, self.kind, 0), like=ctx.source)


class DeleteSnapshotScenario(Scenario):
    failpoints = ("delete_snapshot.intent", "delete_snapshot.files")

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        super().setup(node, ctx)
        assert ctx.source is not None
        with node.client() as c:
            ctx.snapshot_id = c.create_snapshot(f"{ctx.tag}-snap", ctx.source.id).id

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        c.delete_snapshot(ctx.snapshot_id)

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            assert find_snapshot(c, ctx.snapshot_id) is None

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            c.delete_snapshot(ctx.snapshot_id)
            assert find_snapshot(c, ctx.snapshot_id) is None


class GroupSnapshotScenario(Scenario):
    """An nbd and an nfs volume in one group: a crash at every step of the barrier
    (intent, the nfs member frozen, the nbd member's I/O held, the copies made)."""

    failpoints = (
        "group_snapshot.intent",
        "pool.frozen",
        "group_snapshot.held",
        "group_snapshot.files",
    )

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        for kind, pattern in (("nbd", 0xC5), ("nfs", 0xC6)):
            vol = create(node, f"{ctx.tag}-{kind}", kind, pattern=pattern)
            write_data(node, vol)
            ctx.survivors.append(vol)

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        c.create_group_snapshot(f"{ctx.tag}-group", [v.id for v in ctx.survivors])

    def members(self, c: BackendClient, ctx: Ctx) -> list[pb.Snapshot]:
        ours = {v.id for v in ctx.survivors}
        return [s for s in all_snapshots(c) if s.group_snapshot_id and s.source_volume_id in ours]

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            members = self.members(c, ctx)
            # recorded intent, sources still there: the restart takes the group
            assert len(members) == 2 and all(m.ready_to_use for m in members), members
            group = c.get_group_snapshot(members[0].group_snapshot_id)
        assert group.ready_to_use and group.name == f"{ctx.tag}-group", group

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            group = c.create_group_snapshot(f"{ctx.tag}-group", [v.id for v in ctx.survivors])
            assert group.ready_to_use and len(group.snapshots) == 2, group
            clones = [
                c.create_volume(create_request(f"{ctx.tag}-clone-{v.kind}", v.kind, snap.id))
                for snap, v in zip(group.snapshots, ctx.survivors, strict=True)
            ]
        for clone, vol in zip(clones, ctx.survivors, strict=True):
            check_data(node, Vol(clone.id, clone.name, vol.kind, 0), like=vol)
        with node.client() as c:
            c.delete_group_snapshot(group.id)
            assert self.members(c, ctx) == []


class DeleteGroupSnapshotScenario(Scenario):
    failpoints = ("delete_group_snapshot.intent",)

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        super().setup(node, ctx)
        assert ctx.source is not None
        with node.client() as c:
            ctx.snapshot_id = c.create_group_snapshot(f"{ctx.tag}-group", [ctx.source.id]).id

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        c.delete_group_snapshot(ctx.snapshot_id)

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c, pytest.raises(grpc.RpcError) as gone:
            c.get_group_snapshot(ctx.snapshot_id)
        assert status_of(gone.value) == grpc.StatusCode.NOT_FOUND, gone.value
        with node.client() as c:
            assert [s for s in all_snapshots(c) if s.group_snapshot_id == ctx.snapshot_id] == []

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        with node.client() as c:
            c.delete_group_snapshot(ctx.snapshot_id)


class ExpandScenario(Scenario):
    failpoints = ("expand.intent", "expand.files")

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        assert ctx.source is not None
        c.expand_volume(ctx.source.id, EXPANDED[self.kind])

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        size = EXPANDED[self.kind]
        with node.client() as c:
            v = c.expand_volume(ctx.source.id, size)
        assert v.state == "ready" and v.size_bytes == size, v
        target = publish(node, v.id)
        if self.kind == "nbd":
            uri = nbd_uri(target.nbd)
            assert int(run(["nbdinfo", "--size", uri]).stdout) == size
            end = size - 65536
            qemu_io(uri, f"write -P 0x77 {end} 65536", f"read -P 0x77 {end} 65536", "flush")
        else:
            st = os.statvfs(node.pool_dir / "mnt" / v.id / "export")
            assert st.f_bavail * st.f_frsize >= size, st
        check_data(node, ctx.source)


class PublishScenario(Scenario):
    failpoints = ("publish.intent", "publish.exported")

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        super().setup(node, ctx)
        assert ctx.source is not None
        with node.client() as c:
            c.unpublish(ctx.source.id, NODE_ID)

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        assert ctx.source is not None
        c.publish(ctx.source.id, NODE_ID, NODE_ADDRESS)

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        target = publish(node, ctx.source.id)
        if self.kind == "nbd":
            run(["nbdinfo", nbd_uri(target.nbd)])
        else:
            listing = run(["nfs-ls", node.nfs_url(target.nfs.export_path)]).stdout
            assert DATA_FILE in listing, listing
        check_data(node, ctx.source)


class UnpublishScenario(Scenario):
    failpoints = ("unpublish.intent", "unpublish.exported")

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        assert ctx.source is not None
        c.unpublish(ctx.source.id, NODE_ID)

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c:
            c.unpublish(ctx.source.id, NODE_ID)
            v = c.get_volume(volume_id=ctx.source.id)
        assert list(v.published_nodes) == [], v
        if self.kind == "nbd":
            uri = f"nbd://127.0.0.1:{node.nbd_port}/{v.id}@{NODE_ID}"
            gone = run(["nbdinfo", "--size", uri], check=False)
            assert gone.returncode != 0, f"{uri} still served after unpublish"
        else:
            gone = run(["nfs-ls", node.nfs_url(f"/volumes/{v.name}")], check=False)
            assert gone.returncode != 0, f"{v.name} still exported after unpublish"
        check_data(node, ctx.source)  # republishes: the data is still there


class ModifyScenario(Scenario):
    """One catalog transaction records the change; the exports follow at start."""

    failpoints = ("modify.recorded",)
    CHANGE: ClassVar[dict[str, dict[str, str]]] = {
        "nbd": {"iops_limit": "5000", "bandwidth_limit": "104857600"},
        "nfs": {"squash": "no_root_squash"},
    }

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        assert ctx.source is not None
        c.modify_volume(ctx.source.id, self.CHANGE[self.kind])

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c:
            v = c.get_volume(volume_id=ctx.source.id)
        for key, value in self.CHANGE[self.kind].items():
            assert v.parameters[key] == value, v
        if self.kind == "nfs":
            texts = [p.read_text() for p in (node.data_dir / "ganesha" / "exports.d").iterdir()]
            mine = [t for t in texts if f"/volumes/{v.name}" in t]
            assert len(mine) == 1 and "Squash = no_root_squash;" in mine[0], mine

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c:
            v = c.modify_volume(ctx.source.id, self.CHANGE[self.kind])
        assert v.state == "ready", v
        check_data(node, ctx.source)


class AdoptScenario(Scenario):
    """A volume the catalog lost (its row removed while the node was down) is
    quarantined at start, then adopted back; the crash comes after the intent."""

    failpoints = ("adopt.intent",)

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def setup(self, node: BackendNode, ctx: Ctx) -> None:
        super().setup(node, ctx)
        assert ctx.source is not None
        assert node.stop() == 0
        db = sqlite3.connect(node.data_dir / CATALOG_FILE, timeout=10)
        try:
            with db:
                db.execute("DELETE FROM publications WHERE volume_id = ?", (ctx.source.id,))
                db.execute("DELETE FROM volumes WHERE id = ?", (ctx.source.id,))
        finally:
            db.close()
        node.start()
        assert (node.pool_dir / "quarantine" / self.orphan(ctx)).is_file()

    @staticmethod
    def orphan(ctx: Ctx) -> str:
        assert ctx.source is not None
        return f"volume-{ctx.source.id}.img"

    def act(self, c: BackendClient, ctx: Ctx) -> None:
        assert ctx.source is not None
        c.adopt_volume(self.orphan(ctx), ctx.source.name)

    def after_crash(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c:
            v = find_volume(c, name=ctx.source.name)
        assert v is not None and v.state == "ready" and v.id == ctx.source.id, v
        assert not (node.pool_dir / "quarantine" / self.orphan(ctx)).exists()

    def retry(self, node: BackendNode, ctx: Ctx) -> None:
        assert ctx.source is not None
        with node.client() as c, pytest.raises(grpc.RpcError) as gone:
            c.adopt_volume(self.orphan(ctx), ctx.source.name)
        assert status_of(gone.value) == grpc.StatusCode.NOT_FOUND, gone.value
        check_data(node, ctx.source)


SCENARIOS: dict[str, Scenario] = {
    "create_nbd": CreateScenario("nbd"),
    "create_nfs": CreateScenario("nfs"),
    "clone_snapshot_nbd": CreateScenario("nbd", source="snapshot"),
    "clone_snapshot_nfs": CreateScenario("nfs", source="snapshot"),
    "clone_volume_nbd": CreateScenario("nbd", source="volume"),
    "clone_volume_nfs": CreateScenario("nfs", source="volume"),
    "delete_nbd": DeleteScenario("nbd"),
    "delete_nfs": DeleteScenario("nfs"),
    "snapshot_nbd": SnapshotScenario("nbd"),
    "snapshot_nfs": SnapshotScenario("nfs"),
    "delete_snapshot": DeleteSnapshotScenario(),
    "group_snapshot": GroupSnapshotScenario(),
    "delete_group_snapshot": DeleteGroupSnapshotScenario(),
    "expand_nbd": ExpandScenario("nbd"),
    "expand_nfs": ExpandScenario("nfs"),
    "publish_nbd": PublishScenario("nbd"),
    "publish_nfs": PublishScenario("nfs"),
    "unpublish_nbd": UnpublishScenario("nbd"),
    "unpublish_nfs": UnpublishScenario("nfs"),
    "modify_nbd": ModifyScenario("nbd"),
    "modify_nfs": ModifyScenario("nfs"),
    "adopt_nbd": AdoptScenario("nbd"),
    "adopt_nfs": AdoptScenario("nfs"),
}
CASES = [(op, fp) for op, scenario in SCENARIOS.items() for fp in scenario.failpoints]


def test_every_failpoint_is_crashed_at() -> None:
    """A failpoint added to the service or the pool needs a case here."""
    names: set[str] = set()
    for module in sorted((REPO / "backend").rglob("*.py")):
        names |= set(re.findall(r'failpoint(?:\(|_at=)"([^"]+)"', module.read_text()))
    assert names, "no failpoints found"
    assert names == {fp for _, fp in CASES}


def daemon_log_excerpt(node: BackendNode, lines: int = 120) -> str:
    """The end of the daemon's log without ganesha's own chatter."""
    text = node.log.read_text(errors="replace").splitlines()
    ours = [line for line in text if "moorage.ganesha: ganesha.nfsd[" not in line]
    return "\n".join(ours[-lines:])


@contextlib.contextmanager
def log_on_failure(node: BackendNode) -> Iterator[None]:
    """On failure, print the daemon's log (pytest shows it with the failure)."""
    try:
        yield
    except BaseException:
        print(daemon_log_excerpt(node))
        raise


def daemon_log_since_start(node: BackendNode) -> str:
    return node.log.read_text(errors="replace").rsplit("\n==== start ", 1)[-1]


def crash_at(node: BackendNode, failpoint: str, ctx: Ctx, scenario: Scenario) -> None:
    """Restart armed, make the call, see the daemon kill itself at the failpoint, restart.

    The armed restart is a graceful one: the daemon unmounts the nfs volumes
    when it stops, so their remount at start is checked by every case too.
    """
    assert node.stop() == 0
    node.start(failpoints=[failpoint])
    with node.client(timeout=120) as c, pytest.raises(grpc.RpcError) as died:
        scenario.act(c, ctx)
    assert status_of(died.value) == grpc.StatusCode.UNAVAILABLE, died.value
    assert node.wait_exit() == -signal.SIGKILL
    assert f"failpoint {failpoint} reached" in daemon_log_since_start(node)
    node.start()


@pytest.mark.parametrize(("op", "failpoint"), CASES, ids=[f"{op}@{fp}" for op, fp in CASES])
def test_crash_at_failpoint(node: BackendNode, keepers: list[Vol], op: str, failpoint: str) -> None:
    scenario = SCENARIOS[op]
    ctx = Ctx(tag=f"{op.replace('_', '-')}-{failpoint.replace('.', '-').replace('_', '-')}")
    with log_on_failure(node):
        scenario.setup(node, ctx)
        before = last_operation(node)

        crash_at(node, failpoint, ctx, scenario)

        check_node(node)
        check_journal_since(node, before)
        for vol in [*keepers, *ctx.survivors]:
            check_data(node, vol)
        scenario.after_crash(node, ctx)

        scenario.retry(node, ctx)
        check_node(node)

        remove_all(node, ctx.tag)
        check_node(node)
        check_journal_since(node, before)


def test_kill_during_concurrent_creates(node: BackendNode, keepers: list[Vol]) -> None:
    """SIGKILL while 8 creates (nbd and nfs) run at once; retried, all end ready."""
    kinds = {f"burst-{i}": ("nfs" if i % 2 else "nbd") for i in range(8)}
    results: dict[str, pb.Volume | grpc.RpcError] = {}
    go = threading.Barrier(len(kinds) + 1)

    def create_one(name: str) -> None:
        with node.client(timeout=120) as c:
            go.wait()
            try:
                results[name] = c.create_volume(create_request(name, kinds[name]))
            except grpc.RpcError as e:
                results[name] = e

    with log_on_failure(node):
        before = last_operation(node)
        threads = [threading.Thread(target=create_one, args=(name,)) for name in kinds]
        for t in threads:
            t.start()
        go.wait()
        # kill as soon as one create has recorded its intent: the others are in flight
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if read_catalog(node, "SELECT id FROM volumes WHERE state='creating'"):
                break
            time.sleep(0.002)
        node.kill()
        for t in threads:
            t.join(120)
        interrupted = sorted(n for n, r in results.items() if isinstance(r, grpc.RpcError))
        assert interrupted, "the kill landed after every create had finished"

        node.start()
        check_node(node)
        check_journal_since(node, before)  # every recorded create was finished
        for vol in keepers:
            check_data(node, vol)
        with node.client() as c:
            for name, result in results.items():
                if isinstance(result, pb.Volume):  # answered before the kill: must not be lost
                    v = find_volume(c, volume_id=result.id)
                    assert v is not None and v.state == "ready", (name, v)
            made = {n: c.create_volume(create_request(n, kind)) for n, kind in kinds.items()}
        assert {n: v.state for n, v in made.items()} == {n: "ready" for n in kinds}
        for name, v in made.items():
            vol = Vol(v.id, name, kinds[name], pattern=0x42)
            write_data(node, vol)
            check_data(node, vol)
        check_node(node)

        remove_all(node, "burst-")
        check_node(node)


def test_unknown_images_are_quarantined(node: BackendNode, keepers: list[Vol]) -> None:
    """What the catalog does not know is moved to POOL/quarantine at the next start,
    whole; half-written temporary files and stale export files are removed.

    The journal records each intent before any file is made, so no failpoint
    leaves such orphans; a catalog restored from a backup, or an older
    version, does.  Planted while the daemon is down: images of unknown nbd
    and nfs volumes (the nfs one loop-mounted on its mount dir), an unknown
    snapshot, half-written temporary files and a stale ganesha export file.
    """
    pool = node.pool_dir.resolve()
    nbd_id, nfs_id, snap_id = (os.urandom(16).hex() for _ in range(3))
    with log_on_failure(node):
        node.kill()
        (pool / "volumes" / f"{nbd_id}.img").write_bytes(b"\xab" * 4096)
        nfs_image = pool / "volumes" / f"{nfs_id}.img"
        with nfs_image.open("wb") as f:
            f.truncate(300 * MiB)
        run(["mkfs.xfs", "-q", "-m", "reflink=0", str(nfs_image)])
        (pool / "mnt" / nfs_id).mkdir()
        run(["mount", "-t", "xfs", "-o", "loop", str(nfs_image), str(pool / "mnt" / nfs_id)])
        (pool / "snapshots" / f"{snap_id}.img").write_bytes(b"\xcd" * 4096)
        (pool / "volumes" / f".{nbd_id}.img.tmp-0badf00d").write_bytes(b"half")
        (pool / "snapshots" / f".{snap_id}.img.tmp-0badf00d").write_bytes(b"half")
        (pool / "mnt" / f".{nfs_id}.tmp-0badf00d").mkdir()
        stale = ExportConfig(
            export_id=60000,
            path=pool / "mnt" / nfs_id / "export",
            pseudo="/volumes/orphan",
            clients=(NODE_ADDRESS,),
        )
        (node.data_dir / "ganesha" / "exports.d" / "export-60000.conf").write_text(
            render_export(stale)
        )

        node.start()
        check_node(node)
        for vol in keepers:
            check_data(node, vol)
        quarantined = pool / "quarantine"
        assert sorted(os.listdir(quarantined)) == sorted(
            [f"volume-{nbd_id}.img", f"volume-{nfs_id}.img", f"snapshot-{snap_id}.img"]
        )
        assert (quarantined / f"volume-{nbd_id}.img").read_bytes() == b"\xab" * 4096
        assert (quarantined / f"snapshot-{snap_id}.img").read_bytes() == b"\xcd" * 4096
        assert (quarantined / f"volume-{nfs_id}.img").stat().st_size == 300 * MiB
        listed = node.cli("pool", "orphans", "--json")
        assert {o["name"] for o in json.loads(listed.stdout)} == set(os.listdir(quarantined))
        for name in os.listdir(quarantined):
            node.cli("pool", "purge-orphan", name, "--yes")
        assert os.listdir(quarantined) == []
