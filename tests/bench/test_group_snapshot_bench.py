"""What a group snapshot costs the writers of its volumes.

Run with ``make bench`` (or this file alone, under the heavy-run lock).  One
storage node (``moorage backend serve`` on a 4 GiB loop xfs pool with
reflinks, its NBD server with worker processes) and one plugin in
controller mode in front of it.  Four block volumes of 256 MiB, each with
64 MiB written, each written by its own NBD client (libnbd, 4 KiB writes
at random offsets, one at a time) from its own thread, while 20 group
snapshots of the four are taken one after the other through the plugin's
socket.

Printed: the CreateVolumeGroupSnapshot call's p50/p99/max, the writers'
write latency p50/p99 outside and the longest single write (the hold is
in it), writes per second with and without snapshots going on, and how
long the writes were held (the storage node logs it for each group).
Nothing is asserted about speed.
"""

from __future__ import annotations

import random
import re
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from nbd.libnbd import NBDClient
from tests.backend_node import BackendNode, make_node
from tests.bench.harness import percentile
from tests.csi_plugin import CsiPlugin, write_config

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]

MiB = 1 << 20
VOLUMES = 4
SIZE = 256 * MiB
WRITTEN = 64 * MiB
GROUPS = 20
QUIET = 3.0  # seconds of writing without snapshots, before and after
NODE = "node-a@127.0.0.1"
HELD = re.compile(r"NBD I/O of \d+ volumes held ([0-9.]+) ms")
CAP = pb.VolumeCapability(
    block=pb.VolumeCapability.BlockVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
    ),
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BackendNode, grpc.Channel]]:
    root = tmp_path_factory.mktemp("group-bench")
    node = make_node(root / "sn")
    plugin = None
    channel = None
    try:
        node.start()
        config = write_config(root / "csi.toml", [{"name": "sn-a", "address": node.address}])
        plugin = CsiPlugin(root, "controller", config).start()
        channel = grpc.insecure_channel(plugin.endpoint)
        yield node, channel
    finally:
        if channel is not None:
            channel.close()
        if plugin is not None:
            plugin.stop()
        node.teardown()


class Writer(threading.Thread):
    def __init__(self, uri: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.uri, self.stop = uri, stop
        self.samples: list[tuple[float, float]] = []  # (start, seconds)
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(self.uri)
        block = rng.randbytes(4096)
        try:
            with NBDClient() as c:
                c.connect_uri(self.uri)
                while not self.stop.is_set():
                    offset = rng.randrange(WRITTEN // 4096) * 4096
                    t0 = time.perf_counter()
                    c.pwrite(block, offset)
                    self.samples.append((t0, time.perf_counter() - t0))
        except BaseException as e:
            self.error = e


def test_group_snapshot_cost_to_writers(stack: tuple[BackendNode, grpc.Channel]) -> None:
    node, channel = stack
    controller = pb_grpc.ControllerStub(channel)  # type: ignore[no-untyped-call]
    groups = pb_grpc.GroupControllerStub(channel)  # type: ignore[no-untyped-call]
    vols, uris = [], []
    for _ in range(VOLUMES):
        vol = controller.CreateVolume(
            pb.CreateVolumeRequest(
                name=f"bench-{uuid.uuid4()}",
                capacity_range=pb.CapacityRange(required_bytes=SIZE),
                volume_capabilities=[CAP],
                parameters={"type": "nbd"},
            )
        ).volume
        ctx = controller.ControllerPublishVolume(
            pb.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id=NODE, volume_capability=CAP
            )
        ).publish_context
        uri = f"nbd://{ctx['host']}:{ctx['port']}/{ctx['exportName']}"
        with NBDClient() as c:
            c.connect_uri(uri)
            for off in range(0, WRITTEN, 4 * MiB):
                c.pwrite(random.randbytes(4 * MiB), off)
            c.flush()
        vols.append(vol)
        uris.append(uri)

    stop = threading.Event()
    writers = [Writer(u, stop) for u in uris]
    for w in writers:
        w.start()
    time.sleep(QUIET)
    calls: list[float] = []
    made = []
    t_start = time.perf_counter()
    for i in range(GROUPS):
        t0 = time.perf_counter()
        g = groups.CreateVolumeGroupSnapshot(
            pb.CreateVolumeGroupSnapshotRequest(
                name=f"bench-group-{i}", source_volume_ids=[v.volume_id for v in vols]
            ),
            timeout=120,
        ).group_snapshot
        calls.append(time.perf_counter() - t0)
        made.append(g)
    t_end = time.perf_counter()
    time.sleep(QUIET)
    stop.set()
    for w in writers:
        w.join(60)
        assert w.error is None, w.error

    during = [s for w in writers for (t, s) in w.samples if t_start <= t < t_end]
    outside = [s for w in writers for (t, s) in w.samples if not t_start <= t < t_end]
    first = min(t for w in writers for (t, _) in w.samples)
    last = max(t for w in writers for (t, _) in w.samples)
    outside_span = (t_start - first) + (last - t_end)
    ms = 1000.0
    print(
        f"\ngroup snapshots of {VOLUMES} nbd volumes ({SIZE // MiB} MiB, {WRITTEN // MiB} MiB "
        f"written each), {GROUPS} taken while {VOLUMES} writers write:\n"
        f"  CreateVolumeGroupSnapshot p50 {percentile(calls, 50) * ms:.1f} ms, "
        f"p99 {percentile(calls, 99) * ms:.1f} ms, max {max(calls) * ms:.1f} ms\n"
        f"  4 KiB write latency without snapshots: p50 {percentile(outside, 50) * ms:.2f} ms, "
        f"p99 {percentile(outside, 99) * ms:.2f} ms\n"
        f"  while snapshots are taken: p50 {percentile(during, 50) * ms:.2f} ms, "
        f"p99 {percentile(during, 99) * ms:.2f} ms, longest {max(during) * ms:.1f} ms\n"
        f"  writes/s without snapshots {len(outside) / outside_span:.0f}, "
        f"while snapshots are taken {len(during) / (t_end - t_start):.0f}"
    )
    held = [float(m) for m in HELD.findall(node.log.read_text(errors="replace"))][-GROUPS:]
    print(
        f"  NBD I/O held (the storage node's log): p50 {percentile(held, 50):.1f} ms, "
        f"max {max(held):.1f} ms"
    )
    for g in made:
        groups.DeleteVolumeGroupSnapshot(
            pb.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=g.group_snapshot_id)
        )
    for vol in vols:
        controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id)
        )
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
