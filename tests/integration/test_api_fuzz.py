"""Arbitrary strings through the storage node's API and the CSI controller (issue 17).

Hypothesis sends generated volume names, node ids, node addresses, parameters
and labels to one real ``moorage backend serve``: each call either succeeds
and what it recorded reads back the same, or is refused with
INVALID_ARGUMENT; never another code, never a trace that blocks a later call.
At the end the node stops and starts again cleanly, holding none of the
volumes the examples made.  The CSI part does the same for node ids and
volume names through a controller plugin in front of that node.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from backend.api.proto import backend_pb2 as pb
from backend.ganesha.config import client_address
from csi.proto import csi_pb2 as cpb
from csi.proto import csi_pb2_grpc as cpb_grpc
from tests.backend_node import BackendNode, make_node
from tests.csi_plugin import CsiPlugin, write_config

MiB = 1 << 20
Code = grpc.StatusCode
PREFIX = "fz"  # every valid name an example makes starts so

FUZZ = settings(
    derandomize=True,
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)

# Strings that look like what the field wants (drawn more often, so that
# most examples get as far as a publication), and anything at all.
valid_name = st.from_regex(r"fz[A-Za-z0-9._-]{0,20}", fullmatch=True)
names = st.one_of(
    valid_name, valid_name, valid_name, st.text(max_size=200).map(lambda s: PREFIX + s)
)
valid_node_id = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}", fullmatch=True)
node_ids = st.one_of(valid_node_id, valid_node_id, valid_node_id, st.text(max_size=200))
BAD_ADDRESSES = [
    "0.0.0.0",
    "::",
    "fe80::1%eth0",
    "::ffff:10.77.0.12",
    "255.255.255.255",
    "224.0.0.1",
    '10.0.0.1"',
    "10.0.0.1;",
    "10.0.0.1}",
    "10.0.0.1\n",
]
# unicast addresses of a node network (ip_addresses() alone mostly draws 0.0.0.0)
node_v4 = st.tuples(
    st.sampled_from([10, 100, 127, 172, 192]),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(1, 254),
).map(lambda t: ".".join(map(str, t)))
node_v6 = st.integers(1, 2**64).map(lambda n: ipaddress.IPv6Address((0xFD00 << 112) + n))
addresses = st.one_of(
    node_v4,
    node_v4,
    node_v6.map(str),
    node_v6.map(lambda a: a.exploded.upper()),
    st.ip_addresses().map(str),
    st.sampled_from(BAD_ADDRESSES),
    st.text(max_size=100),
)
limits = st.integers(min_value=0, max_value=10**13).map(str)
parameter_keys = st.one_of(
    st.sampled_from(["iops_limit", "bandwidth_limit", "fs_type", "squash"]), st.text(max_size=300)
)
parameter_values = st.one_of(
    limits, st.sampled_from(["xfs", "ext4", "btrfs", "root_squash"]), st.text(max_size=100)
)
parameter_sets: st.SearchStrategy[dict[str, str]] = st.one_of(
    st.just({}),
    st.fixed_dictionaries({}, optional={"iops_limit": limits, "bandwidth_limit": limits}),
    st.fixed_dictionaries({}, optional={"iops_limit": limits, "bandwidth_limit": limits}),
    st.dictionaries(parameter_keys, parameter_values, max_size=3),
)
valid_label_key = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,40}", fullmatch=True)
printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
label_sets = st.one_of(
    st.dictionaries(valid_label_key, printable, max_size=3),
    st.dictionaries(valid_label_key, printable, max_size=3),
    st.dictionaries(st.one_of(valid_label_key, st.text(max_size=300)), st.text(), max_size=3),
)


@dataclass
class Fuzzed:
    node: BackendNode
    csi: CsiPlugin
    channel: grpc.Channel


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    """One storage node and one controller plugin in front of it, for the module."""
    root = tmp_path_factory.mktemp("api-fuzz")
    node = make_node(root / "sn")
    csi: CsiPlugin | None = None
    channel: grpc.Channel | None = None
    try:
        node.start()
        config = write_config(root / "csi.toml", [{"name": "sn-a", "address": node.address}])
        csi = CsiPlugin(root, "controller", config).start()
        channel = csi.channel()
        yield Fuzzed(node, csi, channel)
    finally:
        if channel is not None:
            channel.close()
        if csi is not None:
            csi.stop()
        node.teardown()


def refused(e: grpc.RpcError, *allowed: grpc.StatusCode) -> None:
    """A refusal must be one of ``allowed`` (INVALID_ARGUMENT by default), in one line."""
    call = cast(grpc.Call, e)
    assert call.code() in (allowed or (Code.INVALID_ARGUMENT,)), (call.code(), call.details())
    details = call.details() or ""
    assert len(details) <= 1000 and "\n" not in details, details


def canonical(address: str) -> str:
    return str(ipaddress.ip_address(address))


def ours(node: BackendNode) -> list[str]:
    with node.client() as c:
        return [v.name for v in c.list_volumes().volumes if v.name.startswith(PREFIX)]


def test_backend_strings_round_trip_or_are_invalid(fuzzed: Fuzzed) -> None:
    node = fuzzed.node

    @FUZZ
    @given(
        name=names,
        kind=st.sampled_from([pb.NBD, pb.NBD, pb.NBD, pb.NFS]),
        parameters=parameter_sets,
        labels=label_sets,
        node_id=node_ids,
        address=addresses,
    )
    def example(
        name: str,
        kind: pb.VolumeType,
        parameters: dict[str, str],
        labels: dict[str, str],
        node_id: str,
        address: str,
    ) -> None:
        size = 64 * MiB if kind == pb.NFS else 16 * MiB
        request = pb.CreateVolumeRequest(
            name=name, type=kind, size_bytes=size, parameters=parameters, labels=labels
        )
        with node.client(timeout=120) as c:
            try:
                v = c.create_volume(request)
            except grpc.RpcError as e:
                event("create refused")
                refused(e)
                with pytest.raises(grpc.RpcError) as info:
                    c.get_volume(name=name)
                refused(info.value, Code.INVALID_ARGUMENT, Code.NOT_FOUND)
                return
            try:
                assert v.name == name
                got = c.get_volume(name=name)
                assert (got.id, got.name, dict(got.labels)) == (v.id, name, labels)
                assert set(got.parameters) >= set(parameters)
                try:
                    c.publish(v.id, node_id, address)
                except grpc.RpcError as e:
                    event("publish refused")
                    refused(e)
                    assert list(c.get_volume(volume_id=v.id).publications) == []
                else:
                    event(f"published {'nfs' if kind == pb.NFS else 'nbd'}")
                    # what was accepted, ganesha's model renders too
                    client_address(address)
                    pubs = c.get_volume(volume_id=v.id).publications
                    assert [(p.node_id, p.node_address) for p in pubs] == [
                        (node_id, canonical(address))
                    ]
                    c.unpublish(v.id, node_id)
                    assert list(c.get_volume(volume_id=v.id).publications) == []
            finally:
                c.delete_volume(v.id)

    example()
    assert ours(node) == []
    assert node.stop() == 0, node.log_tail()
    node.start()
    assert ours(node) == []
    with node.client() as c:
        assert c.health().ok


def test_csi_strings_are_answered_by_the_spec_codes(fuzzed: Fuzzed) -> None:
    """Volume names and node ids through the controller: OK, or the code the
    CSI spec gives for a bad argument or an unknown node, never INTERNAL."""
    stub = cpb_grpc.ControllerStub(fuzzed.channel)  # type: ignore[no-untyped-call]
    identity = cpb_grpc.IdentityStub(fuzzed.channel)  # type: ignore[no-untyped-call]
    # the storage node may just have restarted: the plugin reconnects within seconds
    deadline = time.monotonic() + 30
    while not identity.Probe(cpb.ProbeRequest(), timeout=30).ready.value:
        assert time.monotonic() < deadline, "the plugin never reached the storage node"
        time.sleep(0.2)
    cap = cpb.VolumeCapability(
        mount=cpb.VolumeCapability.MountVolume(),
        access_mode=cpb.VolumeCapability.AccessMode(
            mode=cpb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        ),
    )
    volume = stub.CreateVolume(
        cpb.CreateVolumeRequest(
            name="fz-csi-target",
            capacity_range=cpb.CapacityRange(required_bytes=16 * MiB),
            volume_capabilities=[cap],
            parameters={"type": "nbd"},
        ),
        timeout=120,
    ).volume

    @FUZZ
    @given(
        name=st.one_of(
            printable.filter(bool), printable.filter(bool), st.text(min_size=1, max_size=300)
        ),
        node_name=node_ids,
        address=addresses,
    )
    def example(name: str, node_name: str, address: str) -> None:
        try:
            made = stub.CreateVolume(
                cpb.CreateVolumeRequest(
                    name=name,
                    capacity_range=cpb.CapacityRange(required_bytes=16 * MiB),
                    volume_capabilities=[cap],
                    parameters={"type": "nbd"},
                ),
                timeout=120,
            ).volume
        except grpc.RpcError as e:
            event("csi create refused")
            refused(e)
        else:
            event("csi created")
            stub.DeleteVolume(cpb.DeleteVolumeRequest(volume_id=made.volume_id), timeout=120)
        node_id = f"{node_name}@{address}"
        publish = cpb.ControllerPublishVolumeRequest(
            volume_id=volume.volume_id, node_id=node_id, volume_capability=cap
        )
        try:
            stub.ControllerPublishVolume(publish, timeout=120)
        except grpc.RpcError as e:
            event(f"csi publish {cast(grpc.Call, e).code().name}")
            refused(e, Code.INVALID_ARGUMENT, Code.NOT_FOUND)
        else:
            event("csi published")
            stub.ControllerUnpublishVolume(
                cpb.ControllerUnpublishVolumeRequest(volume_id=volume.volume_id, node_id=node_id),
                timeout=120,
            )
        with fuzzed.node.client() as c:
            backend = c.get_volume(volume_id=volume.volume_id.split(":")[1])
            assert list(backend.publications) == []

    example()
    stub.DeleteVolume(cpb.DeleteVolumeRequest(volume_id=volume.volume_id), timeout=120)
    with fuzzed.node.client() as c:
        assert [v.name for v in c.list_volumes().volumes] == []
