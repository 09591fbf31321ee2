"""Volume group snapshots over the plugin's unix socket, against a real storage node.

The consistency test: a writer keeps a counter in each of two volumes, always
writing A's new value, then (once A's write is acknowledged) B's.  At any one
instant A's counter is therefore B's or B's plus one.  Group snapshots are
taken while it writes; each member restored (CreateVolume from it) must
show such a pair.  Snapshots taken one after the other, even a millisecond
apart, show B ahead of A or A more than one ahead, and fail it.

- nbd: the writer is an NBD client (libnbd) of the storage node's NBD server,
  one connection per volume, as a node's attachment is; the server has
  worker processes, so the barrier spans them.
- nfs: the writer writes each counter into a file of the volume's filesystem
  through the storage node's own mount of it (the mount ganesha exports;
  this host has no NFS client, and the freeze acts on the filesystem
  whoever writes to it), and the restored volumes are read the same way.

Then what the CSI spec asks around it: idempotency by name, ALREADY_EXISTS
for another set of volumes, NOT_FOUND for a volume that does not exist (with
nothing recorded), FAILED_PRECONDITION for volumes on two storage nodes,
members that cannot be deleted alone, and a group deleted whole.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from nbd.libnbd import NBDClient
from tests.backend_node import BackendNode, make_node
from tests.csi_plugin import CsiPlugin, write_config

MIB = 1 << 20
NODE = "node-a@127.0.0.1"
Mode = pb.VolumeCapability.AccessMode
ROUNDS = 4  # group snapshots taken while the writer writes
PROGRESS_TIMEOUT = 60.0  # every wait for the writer is bounded by this
COUNTER = struct.Struct(">Q")


def block_cap() -> pb.VolumeCapability:
    return pb.VolumeCapability(
        block=pb.VolumeCapability.BlockVolume(), access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER)
    )


def mount_cap() -> pb.VolumeCapability:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(),
        access_mode=Mode(mode=Mode.MULTI_NODE_MULTI_WRITER),
    )


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    code: grpc.StatusCode = info.value.code()
    return code


@dataclass
class Site:
    node: BackendNode
    plugin: CsiPlugin
    channel: grpc.Channel
    made: list[str] = field(default_factory=list)  # volume ids, deleted at the end

    @property
    def controller(self) -> pb_grpc.ControllerStub:
        return pb_grpc.ControllerStub(self.channel)  # type: ignore[no-untyped-call]

    @property
    def groups(self) -> pb_grpc.GroupControllerStub:
        return pb_grpc.GroupControllerStub(self.channel)  # type: ignore[no-untyped-call]

    def create(
        self,
        kind: str,
        size: int,
        storage_node: str = "sn-a",
        source: pb.VolumeContentSource | None = None,
    ) -> pb.Volume:
        params = {"type": kind, "storageNode": storage_node}
        if kind == "nfs":
            params["nfsFsType"] = "ext4"
        req = pb.CreateVolumeRequest(
            name=f"pvc-{uuid.uuid4()}",
            capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[block_cap() if kind == "nbd" else mount_cap()],
            parameters=params,
            volume_content_source=source,
        )
        vol: pb.Volume = self.controller.CreateVolume(req, timeout=120).volume
        self.made.append(vol.volume_id)
        return vol

    def restore(self, kind: str, size: int, snapshot_id: str) -> pb.Volume:
        source = pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id)
        )
        return self.create(kind, size, source=source)

    def nbd_uri(self, vol: pb.Volume) -> str:
        ctx = self.controller.ControllerPublishVolume(
            pb.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id=NODE, volume_capability=block_cap()
            ),
            timeout=60,
        ).publish_context
        return f"nbd://{ctx['host']}:{ctx['port']}/{ctx['exportName']}"

    def export_dir(self, vol: pb.Volume) -> Path:
        """The storage node's mount of an nfs volume's filesystem (what ganesha exports)."""
        return self.node.pool_dir / "mnt" / vol.volume_id.split(":")[1] / "export"

    def group(self, name: str, *vols: pb.Volume) -> pb.VolumeGroupSnapshot:
        req = pb.CreateVolumeGroupSnapshotRequest(
            name=name, source_volume_ids=[v.volume_id for v in vols]
        )
        group: pb.VolumeGroupSnapshot = self.groups.CreateVolumeGroupSnapshot(
            req, timeout=120
        ).group_snapshot
        return group

    def delete_group(self, group: pb.VolumeGroupSnapshot) -> None:
        self.groups.DeleteVolumeGroupSnapshot(
            pb.DeleteVolumeGroupSnapshotRequest(
                group_snapshot_id=group.group_snapshot_id,
                snapshot_ids=[s.snapshot_id for s in group.snapshots],
            ),
            timeout=60,
        )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("csi-groups")
    node = make_node(root / "sn")
    plugin = None
    channel = None
    try:
        node.start()
        # sn-b is the same storage node under another name: to the controller, a
        # second storage node (what it knows of a volume is the id's node name).
        storage = [
            {"name": "sn-a", "address": node.address},
            {"name": "sn-b", "address": node.address},
        ]
        config = write_config(root / "csi.toml", storage)
        plugin = CsiPlugin(root, "controller", config).start()
        channel = grpc.insecure_channel(plugin.endpoint)
        s = Site(node, plugin, channel)
        yield s
        for vol_id in reversed(s.made):
            unpublish = pb.ControllerUnpublishVolumeRequest(volume_id=vol_id)
            with_retries(lambda r=unpublish: s.controller.ControllerUnpublishVolume(r, timeout=60))
            delete = pb.DeleteVolumeRequest(volume_id=vol_id)
            with_retries(lambda r=delete: s.controller.DeleteVolume(r, timeout=60))
    finally:
        if channel is not None:
            channel.close()
        if plugin is not None:
            plugin.stop()
        node.teardown()


def with_retries(call: Callable[..., object]) -> None:
    for _ in range(3):
        try:
            call()
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.ABORTED:
                raise
            time.sleep(0.5)


class Writer:
    """A thread that writes counter n to A, then n to B, for n = 1, 2, ... until stopped."""

    def __init__(self, write_a: Callable[[int], None], write_b: Callable[[int], None]) -> None:
        self.write_a, self.write_b = write_a, write_b
        self.count = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="counter-writer", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                n = self.count + 1
                self.write_a(n)
                self.write_b(n)
                self.count = n
        except BaseException as e:  # reported by wait_past/stop
            self.error = e

    def start(self) -> None:
        self._thread.start()

    def wait_past(self, count: int) -> None:
        """Until the writer has written more than ``count`` pairs (bounded)."""
        deadline = time.monotonic() + PROGRESS_TIMEOUT
        while self.count <= count + 50:
            assert self.error is None, f"the writer failed: {self.error!r}"
            assert time.monotonic() < deadline, f"the writer is stuck at {self.count}"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(PROGRESS_TIMEOUT)
        assert not self._thread.is_alive(), "the writer did not stop"
        assert self.error is None, f"the writer failed: {self.error!r}"


def assert_one_instant(a: int, b: int, writer: Writer, what: str) -> None:
    assert a > 0, f"{what}: no write captured"
    assert a in (b, b + 1), (
        f"{what}: A's counter is {a} and B's {b}: not one instant (A is written before B, "
        f"so A must be B or B+1); the writer reached {writer.count}"
    )


def test_nbd_group_snapshots_taken_while_writing_are_crash_consistent(site: Site) -> None:
    size = 16 * MIB
    a, b = site.create("nbd", size), site.create("nbd", size)
    clients = []
    for vol in (a, b):
        client = NBDClient()
        client.connect_uri(site.nbd_uri(vol))
        clients.append(client)
    on_a, on_b = clients
    writer = Writer(
        lambda n: on_a.pwrite(COUNTER.pack(n) * 512, 0),
        lambda n: on_b.pwrite(COUNTER.pack(n) * 512, 0),
    )
    groups = []
    try:
        writer.start()
        for i in range(ROUNDS):
            writer.wait_past(writer.count)
            groups.append(site.group(f"nbd-group-{i}", a, b))
        writer.wait_past(writer.count)
    finally:
        writer.stop()
        for client in clients:
            client.close()
    for i, group in enumerate(groups):
        assert group.ready_to_use and len(group.snapshots) == 2
        by_source = {s.source_volume_id: s for s in group.snapshots}
        counters = []
        for vol in (a, b):
            member = by_source[vol.volume_id]
            assert member.group_snapshot_id == group.group_snapshot_id and member.ready_to_use
            restored = site.restore("nbd", size, member.snapshot_id)
            with NBDClient() as reader:
                reader.connect_uri(site.nbd_uri(restored))
                block = reader.pread(4096, 0)
            assert block == block[:8] * 512, "a counter block torn"
            counters.append(COUNTER.unpack(block[:8])[0])
        assert_one_instant(counters[0], counters[1], writer, f"group snapshot {i}")
    # Taken while writing: the rounds captured different instants.
    assert len({g.group_snapshot_id for g in groups}) == ROUNDS
    for group in groups:
        site.delete_group(group)


def test_nfs_group_snapshots_freeze_every_filesystem_together(site: Site) -> None:
    size = 32 * MIB
    a, b = site.create("nfs", size), site.create("nfs", size)
    files = [site.export_dir(v) / "counter" for v in (a, b)]
    fds = [os.open(f, os.O_RDWR | os.O_CREAT, 0o644) for f in files]
    for fd in fds:  # counters at 0, on disk: what a copy holds without the freeze
        os.pwrite(fd, COUNTER.pack(0), 0)
        os.fsync(fd)

    def writes(fd: int) -> Callable[[int], None]:
        return lambda n: (os.pwrite(fd, COUNTER.pack(n), 0), None)[1]

    writer = Writer(writes(fds[0]), writes(fds[1]))
    groups = []
    try:
        writer.start()
        for i in range(ROUNDS):
            writer.wait_past(writer.count)
            groups.append(site.group(f"nfs-group-{i}", a, b))
        writer.wait_past(writer.count)
    finally:
        writer.stop()
        for fd in fds:
            os.close(fd)
    for i, group in enumerate(groups):
        by_source = {s.source_volume_id: s for s in group.snapshots}
        counters = []
        for vol in (a, b):
            restored = site.restore("nfs", size, by_source[vol.volume_id].snapshot_id)
            data = (site.export_dir(restored) / "counter").read_bytes()
            counters.append(COUNTER.unpack(data[:8])[0])
        assert_one_instant(counters[0], counters[1], writer, f"nfs group snapshot {i}")
    for group in groups:
        site.delete_group(group)


def test_a_group_snapshot_is_idempotent_by_name(site: Site) -> None:
    a, b, c = (site.create("nbd", 8 * MIB) for _ in range(3))
    first = site.group("same-name", a, b)
    again = site.group("same-name", b, a)
    assert again.group_snapshot_id == first.group_snapshot_id
    assert {s.snapshot_id for s in again.snapshots} == {s.snapshot_id for s in first.snapshots}
    assert code_of(lambda: site.group("same-name", a, c)) == grpc.StatusCode.ALREADY_EXISTS
    got = site.groups.GetVolumeGroupSnapshot(
        pb.GetVolumeGroupSnapshotRequest(group_snapshot_id=first.group_snapshot_id), timeout=60
    ).group_snapshot
    assert got == first
    site.delete_group(first)


def test_refused_group_snapshots_leave_nothing(site: Site) -> None:
    a = site.create("nbd", 8 * MIB)
    on_b = site.create("nbd", 8 * MIB, storage_node="sn-b")

    def snapshot_count() -> int:
        r = site.controller.ListSnapshots(pb.ListSnapshotsRequest(), timeout=60)
        return len(r.entries)

    before = snapshot_count()
    missing = f"sn-a:{uuid.uuid4().hex}"
    ghost = pb.Volume(volume_id=missing)
    assert code_of(lambda: site.group("refused", a, ghost)) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        site.group("refused", a, on_b)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sn-a, sn-b" in str(info.value.details())
    assert code_of(lambda: site.group("refused", a, a)) == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot_count() == before
    # The name is free: nothing was recorded under it.
    made = site.group("refused", a)
    assert made.ready_to_use
    site.delete_group(made)


def test_members_are_deleted_with_their_group_only(site: Site) -> None:
    a, b = site.create("nbd", 8 * MIB), site.create("nbd", 8 * MIB)
    group = site.group("delete-me", a, b)
    member = group.snapshots[0].snapshot_id
    listed = site.controller.ListSnapshots(
        pb.ListSnapshotsRequest(snapshot_id=member), timeout=60
    ).entries
    assert [e.snapshot.group_snapshot_id for e in listed] == [group.group_snapshot_id]
    assert (
        code_of(
            lambda: site.controller.DeleteSnapshot(
                pb.DeleteSnapshotRequest(snapshot_id=member), timeout=60
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    wrong = pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=group.group_snapshot_id, snapshot_ids=[member]
    )
    assert (
        code_of(lambda: site.groups.DeleteVolumeGroupSnapshot(wrong, timeout=60))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    site.delete_group(group)
    site.delete_group(group)  # gone: OK again
    for s in group.snapshots:
        r = site.controller.ListSnapshots(
            pb.ListSnapshotsRequest(snapshot_id=s.snapshot_id), timeout=60
        )
        assert list(r.entries) == []
    get = pb.GetVolumeGroupSnapshotRequest(group_snapshot_id=group.group_snapshot_id)
    assert (
        code_of(lambda: site.groups.GetVolumeGroupSnapshot(get, timeout=60))
        == grpc.StatusCode.NOT_FOUND
    )
