"""The CSI controller's overhead: create + publish through the plugin vs the backend API.

Run with ``make bench``.  One storage node (``moorage backend serve`` on a
4 GiB loop pool, ``--overcommit 10``) and one plugin in controller mode
(``moorage csi serve``) in front of it.  100 block volumes of 64 MiB, each
created and then published to a node, from 16 client threads at once (the
default worker counts of csi-provisioner and csi-attacher), each thread
with its own channel:

- **direct**: ``CreateVolume`` + ``PublishVolume`` on the backend API;
- **csi**: ``CreateVolume`` + ``ControllerPublishVolume`` on the plugin's
  unix socket (the plugin looks the name up, places the volume, creates it,
  checks the volume and publishes it: four backend calls for the two).

Two rounds of each, alternating; between rounds every volume is unpublished
and deleted (not timed).  Printed: volumes/s, p50/p99 of one volume's two
calls, and csi/direct throughput per round.  Nothing is asserted about speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from backend.api.client import BackendClient
from backend.api.proto import backend_pb2 as bpb
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from tests.backend_node import BackendNode, make_node
from tests.bench.harness import percentile
from tests.csi_plugin import CsiPlugin, write_config

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]

MiB = 1 << 20
VOLUMES = 100
CLIENTS = 16
SIZE = 64 * MiB
ROUNDS = 2
CAP = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(),
    access_mode=pb.VolumeCapability.AccessMode(
        mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
    ),
)


def run_threads(
    make_client: Callable[[], object], work: Callable[[object, int], None]
) -> tuple[float, list[float]]:
    """``work(client, i)`` for i in range(VOLUMES) from CLIENTS threads; (wall, latencies)."""
    latencies = [0.0] * VOLUMES
    errors: list[str] = []
    cursor = iter(range(VOLUMES))
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS + 1)

    def worker() -> None:
        client = make_client()
        start.wait(timeout=60)
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                work(client, i)
            except Exception as e:
                errors.append(f"{i}: {e}")
            latencies[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    start.wait(timeout=60)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert not errors, errors[:5]
    return wall, latencies


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[BackendNode, CsiPlugin]]:
    node = make_node(tmp_path / "sn", extra_args=["--overcommit", "10"])
    plugin = None
    try:
        node.start()
        config = write_config(tmp_path / "csi.toml", [{"name": "sn-a", "address": node.address}])
        plugin = CsiPlugin(tmp_path, "controller", config).start()
        yield node, plugin
    finally:
        if plugin is not None:
            plugin.stop()
        node.teardown()


def clear(node: BackendNode) -> None:
    with node.client() as c:
        for v in c.list_volumes(1000).volumes:
            for p in v.published_nodes:
                c.unpublish(v.id, p)
            c.delete_volume(v.id)


def test_create_and_publish_through_csi_vs_backend(
    site: tuple[BackendNode, CsiPlugin],
) -> None:
    node, plugin = site
    rows: list[tuple[str, int, float, list[float]]] = []

    def direct(round_: int) -> tuple[float, list[float]]:
        def work(client: object, i: int) -> None:
            assert isinstance(client, BackendClient)
            v = client.create_volume(
                bpb.CreateVolumeRequest(name=f"d{round_}-{i}", type=bpb.NBD, size_bytes=SIZE)
            )
            client.publish(v.id, f"node-{i % 4}", "127.0.0.1")

        return run_threads(lambda: node.client(), work)

    def through_csi(round_: int) -> tuple[float, list[float]]:
        def work(stub: object, i: int) -> None:
            assert isinstance(stub, pb_grpc.ControllerStub)
            vol = stub.CreateVolume(
                pb.CreateVolumeRequest(
                    name=f"c{round_}-{i}",
                    capacity_range=pb.CapacityRange(required_bytes=SIZE),
                    volume_capabilities=[CAP],
                    parameters={"type": "nbd"},
                ),
                timeout=120,
            ).volume
            stub.ControllerPublishVolume(
                pb.ControllerPublishVolumeRequest(
                    volume_id=vol.volume_id,
                    node_id=f"node-{i % 4}@127.0.0.1",
                    volume_capability=CAP,
                ),
                timeout=120,
            )

        return run_threads(
            lambda: pb_grpc.ControllerStub(grpc.insecure_channel(plugin.endpoint)),  # type: ignore[no-untyped-call]
            work,
        )

    for r in range(ROUNDS):
        for label, fn in (("direct", direct), ("csi", through_csi)):
            wall, lat = fn(r)
            rows.append((label, r, wall, lat))
            clear(node)

    print(f"\n### CSI create + publish, {VOLUMES} nbd volumes, {CLIENTS} threads\n")
    print(
        "| path | round | wall (s) | volumes/s | p50 (ms) | p99 (ms) |\n|---|--:|--:|--:|--:|--:|"
    )
    for label, r, wall, lat in rows:
        ms = [x * 1000 for x in lat]
        print(
            f"| {label} | {r} | {wall:.2f} | {VOLUMES / wall:.1f} | {percentile(ms, 50):.0f} "
            f"| {percentile(ms, 99):.0f} |"
        )
    for r in range(ROUNDS):
        d = next(w for label, rr, w, _ in rows if label == "direct" and rr == r)
        c = next(w for label, rr, w, _ in rows if label == "csi" and rr == r)
        print(f"\nround {r}: csi / direct throughput = {d / c:.2f}x")
