"""The CSI controller over its unix socket, against real storage nodes.

What csi-sanity does not cover: labels from the provisioner's metadata,
bad input that must create nothing, ids of unknown storage nodes,
concurrency, limits changed live (proven with fio and an open libnbd
connection), placement and capacity across two storage nodes with
different topology segments, a storage node that dies and comes back,
metrics, and the socket's own life.

Why this file is long: most tests run against one module-scoped storage node and
controller plugin (``one``), started once for them all, and the two-node tests share
``two`` the same way.  Each test makes the volumes it needs under names of its own and
counts only what it did itself (the metrics test reads its counters before and after), so
the tests pass alone and in any order; the test that kills the storage node starts it
again before it ends.
"""

from __future__ import annotations

import functools
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import grpc
import pytest

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from nbd.libnbd import NBDClient
from tests.backend_node import BackendNode, make_node
from tests.conftest import free_port
from tests.csi_plugin import CsiPlugin, write_config

ZONE = "topology.csi.moorage.dev/zone"
NODE_KEY = "topology.csi.moorage.dev/node"
Mode = pb.VolumeCapability.AccessMode
ModeValue: TypeAlias = pb.VolumeCapability.AccessMode.Mode
NODE_A = "node-a@127.0.0.1"
NODE_B = "node-b@127.0.0.2"
MIB = 1 << 20


def mount_cap(mode: ModeValue = Mode.SINGLE_NODE_WRITER, fs: str = "") -> pb.VolumeCapability:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type=fs), access_mode=Mode(mode=mode)
    )


def block_cap(mode: ModeValue = Mode.SINGLE_NODE_WRITER) -> pb.VolumeCapability:
    return pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(), access_mode=Mode(mode=mode))


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    code: grpc.StatusCode = info.value.code()
    return code


@dataclass
class Controller:
    plugin: CsiPlugin
    channel: grpc.Channel

    @property
    def stub(self) -> pb_grpc.ControllerStub:
        return pb_grpc.ControllerStub(self.channel)  # type: ignore[no-untyped-call]

    @property
    def identity(self) -> pb_grpc.IdentityStub:
        return pb_grpc.IdentityStub(self.channel)  # type: ignore[no-untyped-call]

    def create(
        self,
        name: str,
        params: dict[str, str] | None = None,
        size: int = 16 * MIB,
        cap: pb.VolumeCapability | None = None,
        **extra: object,
    ) -> pb.Volume:
        req = pb.CreateVolumeRequest(
            name=name,
            capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[cap or mount_cap()],
            parameters=params or {"type": "nbd"},
            **extra,  # type: ignore[arg-type]
        )
        response: pb.CreateVolumeResponse = self.stub.CreateVolume(req, timeout=120)
        return response.volume

    def volume_ids(self) -> set[str]:
        r = self.stub.ListVolumes(pb.ListVolumesRequest(), timeout=60)
        return {e.volume.volume_id for e in r.entries}


def start_controller(
    root: Path, storage: Sequence[Mapping[str, object]], extra: list[str]
) -> Controller:
    config = write_config(root / "csi.toml", storage)
    plugin = CsiPlugin(root, "controller", config, extra_args=extra).start()
    return Controller(plugin, grpc.insecure_channel(plugin.endpoint))


@dataclass
class OneNode:
    node: BackendNode
    csi: Controller
    metrics_port: int


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneNode]:
    root = tmp_path_factory.mktemp("csi-one")
    node = make_node(root / "sn")
    csi = None
    try:
        node.start()
        port = free_port()
        storage = [{"name": "sn-a", "address": node.address, "topology": {ZONE: "a"}}]
        extra = ["--metrics-address", f"127.0.0.1:{port}", "--storage-node-check-interval", "0.5"]
        csi = start_controller(root, storage, extra)
        yield OneNode(node, csi, port)
    finally:
        if csi is not None:
            csi.channel.close()
            csi.plugin.stop()
        node.teardown()


# ------------------------------------------------------------------ volumes


def test_create_keeps_the_pvc_as_labels_and_says_where_the_volume_is(one: OneNode) -> None:
    params = {
        "type": "nfs",
        "nfsFsType": "xfs",
        "csi.storage.k8s.io/pvc/name": "data",
        "csi.storage.k8s.io/pvc/namespace": "shop",
        "csi.storage.k8s.io/pv/name": "pvc-1",
    }
    vol = one.csi.create("pvc-labels", params, 64 * MIB, mount_cap(Mode.MULTI_NODE_MULTI_WRITER))
    assert vol.volume_id.startswith("sn-a:") and vol.capacity_bytes == 64 * MIB
    assert dict(vol.volume_context) == {"type": "nfs", "storageNode": "sn-a", "nfsFsType": "xfs"}
    assert [dict(t.segments) for t in vol.accessible_topology] == [{ZONE: "a"}]
    with one.node.client() as c:
        backend = c.get_volume(volume_id=vol.volume_id.split(":")[1])
    assert dict(backend.labels) == {
        "csi.storage.k8s.io/pvc-name": "data",
        "csi.storage.k8s.io/pvc-namespace": "shop",
        "csi.storage.k8s.io/pv-name": "pvc-1",
    }


def test_same_name_same_request_is_the_same_volume_else_already_exists(one: OneNode) -> None:
    first = one.csi.create("idem", {"type": "nbd"}, 16 * MIB)
    assert one.csi.create("idem", {"type": "nbd"}, 16 * MIB).volume_id == first.volume_id
    for params, size in (({"type": "nbd"}, 32 * MIB), ({"type": "nfs"}, 16 * MIB)):
        assert (
            code_of(lambda p=params, s=size: one.csi.create("idem", p, s))  # type: ignore[misc]
            == grpc.StatusCode.ALREADY_EXISTS
        )
    limited = {"type": "nbd", "iopsLimit": "100"}
    assert code_of(lambda: one.csi.create("idem", limited)) == grpc.StatusCode.ALREADY_EXISTS


BAD_CREATES: dict[str, tuple[Callable[[Controller], object], grpc.StatusCode]] = {
    "empty name": (lambda c: c.create(""), grpc.StatusCode.INVALID_ARGUMENT),
    "oversized name": (lambda c: c.create("x" * 300), grpc.StatusCode.INVALID_ARGUMENT),
    "unknown parameter": (
        lambda c: c.create("bad-param", {"type": "nbd", "speed": "fast"}),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "absurd size": (
        lambda c: c.create("bad-size", size=1 << 60),
        grpc.StatusCode.OUT_OF_RANGE,
    ),
    "bigger than the pool": (
        lambda c: c.create("bad-big", size=1 << 40),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
    "multi-writer filesystem on a block volume": (
        lambda c: c.create("bad-mode", cap=mount_cap(Mode.MULTI_NODE_MULTI_WRITER, "ext4")),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "raw block nfs": (
        lambda c: c.create("bad-nfs-block", {"type": "nfs"}, cap=block_cap()),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "no capabilities": (
        lambda c: c.stub.CreateVolume(pb.CreateVolumeRequest(name="bad-nocap"), timeout=30),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "missing snapshot": (
        lambda c: c.create(
            "bad-src",
            volume_content_source=pb.VolumeContentSource(
                snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id="sn-a:" + "0" * 32)
            ),
        ),
        grpc.StatusCode.NOT_FOUND,
    ),
    "malformed snapshot id": (
        lambda c: c.create(
            "bad-src2",
            volume_content_source=pb.VolumeContentSource(
                snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id="../../etc")
            ),
        ),
        grpc.StatusCode.NOT_FOUND,
    ),
    "unknown storage node": (
        lambda c: c.create("bad-node", {"type": "nbd", "storageNode": "sn-zz"}),
        grpc.StatusCode.NOT_FOUND,
    ),
}


@pytest.mark.parametrize("case", list(BAD_CREATES))
def test_bad_create_gets_the_spec_code_and_creates_nothing(one: OneNode, case: str) -> None:
    call, code = BAD_CREATES[case]
    before = one.csi.volume_ids()
    assert code_of(lambda: call(one.csi)) == code
    assert one.csi.volume_ids() == before


def test_ids_that_are_not_ours_are_not_found_never_a_crash(one: OneNode) -> None:
    stub = one.csi.stub
    unknown_node = "sn-zz:" + "0" * 32
    missing = "sn-a:" + "1" * 32
    for vid in (unknown_node, missing, "garbage", "sn-a:" + "0" * 31 + "g"):
        get = pb.ControllerGetVolumeRequest(volume_id=vid)
        assert code_of(lambda r=get: stub.ControllerGetVolume(r)) == grpc.StatusCode.NOT_FOUND  # type: ignore[misc]
        req = pb.ControllerPublishVolumeRequest(
            volume_id=vid, node_id=NODE_A, volume_capability=mount_cap()
        )
        assert code_of(lambda r=req: stub.ControllerPublishVolume(r)) == grpc.StatusCode.NOT_FOUND  # type: ignore[misc]
        expand = pb.ControllerExpandVolumeRequest(
            volume_id=vid, capacity_range=pb.CapacityRange(required_bytes=MIB)
        )
        assert code_of(lambda r=expand: stub.ControllerExpandVolume(r)) == grpc.StatusCode.NOT_FOUND  # type: ignore[misc]
    # deleting what does not exist is success; an unknown storage node cannot be asked
    stub.DeleteVolume(pb.DeleteVolumeRequest(volume_id="garbage"))
    stub.DeleteVolume(pb.DeleteVolumeRequest(volume_id=missing))
    assert (
        code_of(lambda: stub.DeleteVolume(pb.DeleteVolumeRequest(volume_id=unknown_node)))
        == grpc.StatusCode.NOT_FOUND
    )
    # the plugin still serves
    assert stub.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest()).capabilities


def test_eight_concurrent_creates_of_one_name_make_one_volume(one: OneNode) -> None:
    before = one.csi.volume_ids()
    results: list[str] = []
    codes: list[grpc.StatusCode] = []
    start = threading.Barrier(8)

    def create() -> None:
        start.wait()
        try:
            results.append(one.csi.create("raced", {"type": "nbd"}).volume_id)
        except grpc.RpcError as e:
            codes.append(e.code())

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results and len(set(results)) == 1, (results, codes)
    assert set(codes) <= {grpc.StatusCode.ABORTED}, codes
    assert one.csi.volume_ids() - before == set(results)
    # a retry after the race returns the same volume
    assert one.csi.create("raced", {"type": "nbd"}).volume_id == results[0]


# ------------------------------------------------------------- publications


def test_publish_gives_the_target_and_single_node_volumes_stay_on_one_node(one: OneNode) -> None:
    stub = one.csi.stub
    vol = one.csi.create("pub-nbd")
    req = pb.ControllerPublishVolumeRequest(
        volume_id=vol.volume_id, node_id=NODE_A, volume_capability=mount_cap()
    )
    ctx = dict(stub.ControllerPublishVolume(req).publish_context)
    assert ctx["type"] == "nbd" and ctx["exportName"].endswith("@node-a"), ctx
    assert int(ctx["port"]) == one.node.nbd_port and ctx["tls"] == "false"
    assert dict(stub.ControllerPublishVolume(req).publish_context) == ctx  # idempotent
    other = pb.ControllerPublishVolumeRequest(
        volume_id=vol.volume_id, node_id=NODE_B, volume_capability=mount_cap()
    )
    assert (
        code_of(lambda: stub.ControllerPublishVolume(other)) == grpc.StatusCode.FAILED_PRECONDITION
    )
    got = stub.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert list(got.status.published_node_ids) == [NODE_A]
    assert not got.status.volume_condition.abnormal
    unpub = pb.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id, node_id=NODE_A)
    stub.ControllerUnpublishVolume(unpub)
    stub.ControllerUnpublishVolume(unpub)  # not published any more: still OK
    # a deleted volume is not published anywhere: OK
    stub.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    stub.ControllerUnpublishVolume(unpub)


def test_nfs_multi_node_and_raw_block_multi_writer(one: OneNode) -> None:
    stub = one.csi.stub
    shared = one.csi.create(
        "rwx", {"type": "nfs"}, 64 * MIB, mount_cap(Mode.MULTI_NODE_MULTI_WRITER)
    )
    raw = one.csi.create(
        "raw-mw", {"type": "nbd"}, 16 * MIB, block_cap(Mode.MULTI_NODE_MULTI_WRITER)
    )
    for vol, cap in (
        (shared, mount_cap(Mode.MULTI_NODE_MULTI_WRITER)),
        (raw, block_cap(Mode.MULTI_NODE_MULTI_WRITER)),
    ):
        for node in (NODE_A, NODE_B):
            stub.ControllerPublishVolume(
                pb.ControllerPublishVolumeRequest(
                    volume_id=vol.volume_id, node_id=node, volume_capability=cap
                )
            )
        got = stub.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vol.volume_id))
        assert sorted(got.status.published_node_ids) == [NODE_A, NODE_B]
        # no node_id: unpublished from every node
        stub.ControllerUnpublishVolume(pb.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id))
        got = stub.ControllerGetVolume(pb.ControllerGetVolumeRequest(volume_id=vol.volume_id))
        assert list(got.status.published_node_ids) == []


def test_external_nfs_share_needs_no_publication(one: OneNode) -> None:
    req = pb.ControllerPublishVolumeRequest(
        volume_id="nfs-share-static-1",
        node_id=NODE_A,
        volume_capability=mount_cap(Mode.MULTI_NODE_MULTI_WRITER),
        volume_context={"server": "nfs.example.internal", "share": "/exports/data"},
    )
    ctx = dict(one.csi.stub.ControllerPublishVolume(req).publish_context)
    assert ctx == {
        "type": "nfs-external",
        "server": "nfs.example.internal",
        "exportPath": "/exports/data",
    }


# ----------------------------------------------------------- modify (limits)


def fio_iops(uri: str, seconds: int = 2) -> float:
    argv = [
        "fio", "--name=limit", "--ioengine=nbd", f"--uri={uri}", "--rw=randread",
        "--bs=4k", "--iodepth=8", "--time_based", f"--runtime={seconds}",
        "--size=16M", "--output-format=json",
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = result.stdout[result.stdout.index("{") :]  # fio's engine says hello first
    return float(json.loads(report)["jobs"][0]["read"]["iops"])


def ops_in(client: NBDClient, seconds: float) -> int:
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.pread(4096, (done * 4096) % (8 * MIB))
        done += 1
    return done


def test_modify_volume_limits_iops_live_on_open_connections(one: OneNode) -> None:
    stub = one.csi.stub
    vol = one.csi.create(
        "limited", {"type": "nbd"}, 16 * MIB, mutable_parameters={"iopsLimit": "50"}
    )
    ctx = dict(
        stub.ControllerPublishVolume(
            pb.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id=NODE_A, volume_capability=mount_cap()
            )
        ).publish_context
    )
    uri = f"nbd://{ctx['host']}:{ctx['port']}/{ctx['exportName']}"
    # fio, 8 requests in flight: held to the limit (the bucket holds 100 ms of burst)
    assert fio_iops(uri) <= 50 * 1.2 + 10
    with NBDClient() as client:
        client.connect_uri(uri)
        limited = ops_in(client, 1.0)
        stub.ControllerModifyVolume(
            pb.ControllerModifyVolumeRequest(
                volume_id=vol.volume_id, mutable_parameters={"iopsLimit": "0"}
            )
        )
        unlimited = ops_in(client, 1.0)  # the same connection, now without a limit
        stub.ControllerModifyVolume(
            pb.ControllerModifyVolumeRequest(
                volume_id=vol.volume_id, mutable_parameters={"iopsLimit": "20"}
            )
        )
        relimited = ops_in(client, 1.0)
    assert limited <= 50 * 1.2 + 10, limited
    assert unlimited > 4 * limited, (limited, unlimited)
    assert relimited <= 20 * 1.2 + 10, relimited
    with one.node.client() as c:
        assert c.get_volume(volume_id=vol.volume_id.split(":")[1]).parameters["iops_limit"] == "20"
    bad = pb.ControllerModifyVolumeRequest(
        volume_id=vol.volume_id, mutable_parameters={"squash": "all_squash"}
    )
    assert code_of(lambda: stub.ControllerModifyVolume(bad)) == grpc.StatusCode.INVALID_ARGUMENT


# -------------------------------------------------------------- observability


def calls_counted(one: OneNode, method: str, code: str) -> float:
    """The controller's count of ``method`` calls answered with ``code`` (0 before the first)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{one.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    labels = (f'method_name="/csi.v1.Controller/{method}"', f'grpc_status_code="{code}"')
    samples = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("csi_plugin_operations_seconds_count{")
        and all(label in line for label in labels)
    ]
    assert len(samples) <= 1, samples
    return samples[0] if samples else 0.0


def test_metrics_count_every_call_by_method_and_code(one: OneNode) -> None:
    stub = one.csi.stub
    before = {
        (method, code): calls_counted(one, method, code)
        for method, code in (
            ("ControllerGetCapabilities", "OK"),
            ("ControllerGetVolume", "NOT_FOUND"),
            ("CreateVolume", "OK"),
            ("CreateVolume", "ALREADY_EXISTS"),
        )
    }
    stub.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
    missing = pb.ControllerGetVolumeRequest(volume_id="sn-a:" + "2" * 32)
    assert code_of(lambda: stub.ControllerGetVolume(missing)) == grpc.StatusCode.NOT_FOUND
    one.csi.create("metered", size=16 * MIB)
    one.csi.create("metered", size=16 * MIB)
    assert code_of(lambda: one.csi.create("metered", size=32 * MIB)) == (
        grpc.StatusCode.ALREADY_EXISTS
    )
    after = {key: calls_counted(one, *key) for key in before}
    assert {key: after[key] - before[key] for key in before} == {
        ("ControllerGetCapabilities", "OK"): 1,
        ("ControllerGetVolume", "NOT_FOUND"): 1,
        ("CreateVolume", "OK"): 2,
        ("CreateVolume", "ALREADY_EXISTS"): 1,
    }
    lines = one.csi.plugin.log_text().splitlines()
    assert any("CreateVolume name=metered" in line and "ALREADY_EXISTS" in line for line in lines)


def test_a_live_socket_is_refused_a_stale_one_replaced(one: OneNode, tmp_path: Path) -> None:
    clash = CsiPlugin(one.csi.plugin.root, "controller", one.csi.plugin.config)
    refused = subprocess.run(clash.argv(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "another process is serving" in refused.stderr, refused
    assert one.csi.identity.GetPluginInfo(pb.GetPluginInfoRequest()).name == "csi.moorage.dev"
    stale = CsiPlugin(tmp_path, "controller", one.csi.plugin.config)
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale.socket))
    s.close()  # a socket file nobody listens on, as a killed plugin leaves
    stale.start()
    try:
        with grpc.insecure_channel(stale.endpoint) as ch:
            pb_grpc.IdentityStub(ch).GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10)  # type: ignore[no-untyped-call]
    finally:
        stale.stop()


# --------------------------------------------------- a storage node that dies


def storage_node_up(one: OneNode) -> str:
    """The controller's ``moorage_csi_storage_node_up`` sample for sn-a ("" before the first)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{one.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    prefix = 'moorage_csi_storage_node_up{storage_node="sn-a"} '
    return next((line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)), "")


def wait_for_up(one: OneNode, value: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while storage_node_up(one) != value:
        assert time.monotonic() < deadline, f"storage_node_up never became {value}"
        time.sleep(0.1)


def test_a_killed_storage_node_is_unavailable_and_recovers(one: OneNode) -> None:
    wait_for_up(one, "1.0")
    ups = one.csi.plugin.log_text().count("up: storage node sn-a")
    one.node.kill()
    try:
        assert code_of(lambda: one.csi.create("while-down")) == grpc.StatusCode.UNAVAILABLE
        assert (
            code_of(lambda: one.csi.stub.ListVolumes(pb.ListVolumesRequest(), timeout=30))
            == grpc.StatusCode.UNAVAILABLE
        )
        # Probe answers for the plugin alone: ready, at once, with no reason attached
        response, call = one.csi.identity.Probe.with_call(pb.ProbeRequest(), timeout=1)
        assert response.ready.value
        assert not [v for k, v in call.trailing_metadata() if k == "moorage-not-ready"]
        # the storage node's state is in the metrics and the log instead
        wait_for_up(one, "0.0")
        assert "down: storage node sn-a" in one.csi.plugin.log_text()
    finally:
        one.node.start()
    # up again once the channel has reconnected (its backoff is at most 2 s)
    wait_for_up(one, "1.0")
    assert one.csi.plugin.log_text().count("up: storage node sn-a") == ups + 1
    assert one.csi.create("after-restart").volume_id.startswith("sn-a:")


# ------------------------------------------------------- two storage nodes


@dataclass
class TwoNodes:
    a: BackendNode
    b: BackendNode
    csi: Controller


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    root = tmp_path_factory.mktemp("csi-two")
    a = make_node(root / "sn-a", pool_size=2 << 30)
    b = make_node(root / "sn-b", pool_size=3 << 30)
    csi = None
    try:
        a.start()
        b.start()
        storage = [
            {"name": "sn-a", "address": a.address, "topology": {ZONE: "a"}},
            {"name": "sn-b", "address": b.address, "topology": {ZONE: "b"}},
        ]
        csi = start_controller(root, storage, [])
        yield TwoNodes(a, b, csi)
    finally:
        if csi is not None:
            csi.channel.close()
            csi.plugin.stop()
        a.teardown()
        b.teardown()


def seg(zone: str, node: str = "n1") -> pb.Topology:
    return pb.Topology(segments={ZONE: zone, NODE_KEY: node})


def test_placement_follows_topology_then_capacity(two: TwoNodes) -> None:
    def placed(name: str, req: pb.TopologyRequirement | None) -> str:
        vol = (
            two.csi.create(name, accessibility_requirements=req)
            if req is not None
            else two.csi.create(name)
        )
        assert [dict(t.segments) for t in vol.accessible_topology] == [
            {ZONE: vol.volume_id.split(":")[0].removeprefix("sn-")}
        ]
        return vol.volume_id.split(":")[0]

    assert placed("only-a", pb.TopologyRequirement(requisite=[seg("a")])) == "sn-a"
    assert placed("only-b", pb.TopologyRequirement(requisite=[seg("b")])) == "sn-b"
    both = [seg("a"), seg("b")]
    assert placed("pref-a", pb.TopologyRequirement(requisite=both, preferred=[seg("a")])) == "sn-a"
    # no preference: the storage node with the most available capacity (sn-b's pool is larger)
    assert placed("roomiest", pb.TopologyRequirement(requisite=both)) == "sn-b"
    assert placed("anywhere", None) == "sn-b"
    nowhere = pb.TopologyRequirement(requisite=[seg("c")])
    assert code_of(lambda: two.csi.create("nowhere", accessibility_requirements=nowhere)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    # the same name is found on whichever storage node holds it
    assert two.csi.create("only-a").volume_id.startswith("sn-a:")


def test_capacity_is_answered_per_segment(two: TwoNodes) -> None:
    def capacity(topology: pb.Topology | None) -> int:
        req = (
            pb.GetCapacityRequest(accessible_topology=topology)
            if topology
            else pb.GetCapacityRequest()
        )
        return int(two.csi.stub.GetCapacity(req).available_capacity)

    with two.a.client() as c:
        in_a = c.capacity().available_bytes
    with two.b.client() as c:
        in_b = c.capacity().available_bytes
    assert capacity(seg("a")) == in_a
    assert capacity(seg("b")) == in_b
    assert capacity(None) == in_a + in_b
    assert capacity(seg("c")) == 0
    r = two.csi.stub.GetCapacity(pb.GetCapacityRequest(accessible_topology=seg("b")))
    assert r.maximum_volume_size.value == in_b and r.minimum_volume_size.value == MIB


def test_listing_pages_across_storage_nodes(two: TwoNodes) -> None:
    for name in ("listed-a1", "listed-a2", "listed-b1", "listed-b2"):
        where = pb.TopologyRequirement(requisite=[seg(name[-2])])
        two.csi.create(name, accessibility_requirements=where)
    everything = two.csi.volume_ids()
    assert {v.split(":")[0] for v in everything} == {"sn-a", "sn-b"}
    seen: list[str] = []
    token = ""
    while True:
        r = two.csi.stub.ListVolumes(pb.ListVolumesRequest(max_entries=2, starting_token=token))
        assert len(r.entries) <= 2
        seen += [e.volume.volume_id for e in r.entries]
        token = r.next_token
        if not token:
            break
    assert sorted(seen) == sorted(everything)
    bad = pb.ListVolumesRequest(starting_token="sn-q/" + "0" * 32)
    assert code_of(lambda: two.csi.stub.ListVolumes(bad)) == grpc.StatusCode.ABORTED


# ------------------------------------------------------------------ secrets


def test_credentials_in_request_secrets_win_and_are_never_logged(tmp_path: Path) -> None:
    token = "s3cret-token-" + "x" * 20
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    node = make_node(tmp_path / "sn")
    node.listen = f"127.0.0.1:{free_port()}"
    node.token_file = token_file
    csi = None
    try:
        node.start()
        # the configuration names no credentials: only the request's secrets carry them
        csi = start_controller(tmp_path, [{"name": "sn-a", "address": node.listen}], [])
        assert code_of(lambda: csi.create("no-secret")) == grpc.StatusCode.UNAUTHENTICATED
        wrong = {"token": "w" * 32}
        assert (
            code_of(lambda: csi.create("wrong-secret", secrets=wrong))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        vol = csi.create("with-secret", secrets={"token": token})
        assert vol.volume_id.startswith("sn-a:")
        bad = {"token": "short"}
        assert (
            code_of(lambda: csi.create("bad-secret", secrets=bad))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        log = csi.plugin.log_text()
        assert "with-secret" in log and token not in log and "w" * 32 not in log
    finally:
        if csi is not None:
            csi.channel.close()
            csi.plugin.stop()
        node.teardown()


# ------------------------------------------------------- bad input (issue 17)


def test_a_node_id_with_a_refused_address_is_invalid_and_records_nothing(one: OneNode) -> None:
    """``n@0.0.0.0`` and the other addresses no storage node accepts: refused
    before the storage node is asked, nothing recorded; bytes that are no
    request message are INVALID_ARGUMENT too, in one log line."""
    stub = one.csi.stub
    volumes = [
        one.csi.create("bad-node-nbd"),
        one.csi.create("bad-node-nfs", {"type": "nfs"}, size=64 * MIB),
    ]
    for vol in volumes:
        for address in ("0.0.0.0", "::", "::ffff:10.77.0.12", "255.255.255.255", "224.0.0.1"):
            req = pb.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id=f"n@{address}", volume_capability=mount_cap()
            )
            code = code_of(functools.partial(stub.ControllerPublishVolume, req, timeout=60))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, address
        with one.node.client() as c:
            assert list(c.get_volume(volume_id=vol.volume_id.split(":")[1]).publications) == []
        # the volume is free: published to a good node, unpublished, deleted
        good = pb.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id=NODE_A, volume_capability=mount_cap()
        )
        stub.ControllerPublishVolume(good, timeout=60)
        stub.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id, node_id=NODE_A)
        )
        stub.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))

    garbage = one.csi.channel.unary_unary(
        "/csi.v1.Controller/CreateVolume", request_serializer=bytes, response_deserializer=bytes
    )
    assert code_of(lambda: garbage(b"\xff" * 5555, timeout=60)) == grpc.StatusCode.INVALID_ARGUMENT
    log = one.csi.plugin.log_text()
    assert sum("(5555 bytes)" in line for line in log.splitlines()) == 1, log[-3000:]
    assert "Exception deserializing request" not in log
