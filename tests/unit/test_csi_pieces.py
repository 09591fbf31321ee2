"""The CSI plugin's pure pieces: configuration, ids, parameters, capabilities,
sizes, topology, locks, and the backend error mapping."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import TypeAlias

import grpc
import pytest

from csi import capabilities, parameters, topology
from csi.config import ConfigError, StorageNodeConfig, load_config, parse_config
from csi.errors import (
    Aborted,
    CsiError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    Unavailable,
    from_backend,
)
from csi.ids import ObjectRef, node_id, parse_node_id, parse_object_id
from csi.locks import OperationLocks
from csi.proto import csi_pb2 as pb
from csi.requests import MIB, backend_name, requested_size
from tests.fake_rpc import FakeRpcError

ZONE = "topology.csi.moorage.dev/zone"
Mode = pb.VolumeCapability.AccessMode
ModeValue: TypeAlias = pb.VolumeCapability.AccessMode.Mode


# ------------------------------------------------------------ configuration


GOOD = {
    "storage_nodes": [
        {"name": "sn-a", "address": "10.0.0.1:7443", "topology": {ZONE: "a"}},
        {"name": "sn-b", "address": "unix:///run/moorage/backend.sock", "timeout": 30},
    ],
    "node": {"address": "10.0.0.9", "topology": {ZONE: "a"}},
}


def test_config_accepts_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "csi.toml"
    path.write_text(
        '[[storage_nodes]]\nname = "sn-a"\naddress = "127.0.0.1:7443"\n'
        'token_file = "/etc/moorage/token"\n[storage_nodes.topology]\n'
        f'"{ZONE}" = "a"\n[node]\naddress = "127.0.0.1"\n'
    )
    config = load_config(path)
    (sn,) = config.storage_nodes
    assert sn.name == "sn-a" and sn.token_file == Path("/etc/moorage/token")
    assert dict(sn.topology) == {ZONE: "a"} and config.node.address == "127.0.0.1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["storage_nodes"][0].update(name="SN_A"), "DNS label"),
        (lambda c: c["storage_nodes"][0].update(address="nowhere"), "HOST:PORT"),
        (lambda c: c["storage_nodes"][0].update(address="host:99999"), "HOST:PORT"),
        (lambda c: c["storage_nodes"][0].update(token_file="relative"), "absolute"),
        (lambda c: c["storage_nodes"][0].update(tls_cert="/c"), "go together"),
        (lambda c: c["storage_nodes"][0].update(timeout=0), "timeout"),
        (lambda c: c["storage_nodes"][0].update(colour="blue"), "unknown field"),
        (lambda c: c["storage_nodes"][0].update(topology={"zone": "a"}), "PREFIX/NAME"),
        (lambda c: c["storage_nodes"][0].update(topology={ZONE: "a b"}), "label value"),
        (
            lambda c: c["storage_nodes"][0].update(topology={"topology.csi.moorage.dev/node": "x"}),
            "set by the plugin",
        ),
        (lambda c: c["storage_nodes"][1].update(name="sn-a"), "unique"),
        (lambda c: c["node"].update(address="not-an-ip"), "not an IP"),
        (lambda c: c.update(extra=1), "unknown field"),
        (lambda c: c.update(storage_nodes={"name": "x"}), "array of tables"),
        (lambda c: c["storage_nodes"][0].pop("address"), "address is required"),
    ],
)
def test_config_names_every_bad_field(change: object, message: str) -> None:
    import copy

    config = copy.deepcopy(GOOD)
    change(config)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


def test_config_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[storage_nodes]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


# --------------------------------------------------------------------- ids


def test_object_ids_round_trip_and_refuse_what_is_not_ours() -> None:
    ref = ObjectRef("sn-a", "0" * 32)
    assert parse_object_id(str(ref)) == ref
    for bad in ("", "sn-a", "sn-a:xyz", "SN:" + "0" * 32, "a:" + "0" * 31, "reallyfakevolumeid"):
        assert parse_object_id(bad) is None, bad


def test_node_ids_carry_the_address() -> None:
    assert node_id("worker-1", "10.0.0.5") == "worker-1@10.0.0.5"
    assert parse_node_id("worker-1@fd00::1") is not None
    assert parse_node_id("worker-1@fd00::1").address == "fd00::1"  # type: ignore[union-attr]
    for bad in ("worker-1", "fake-node-id", "@10.0.0.1", "a b@10.0.0.1", "w@not-ip", "..@1.2.3.4"):
        assert parse_node_id(bad) is None, bad
    with pytest.raises(ValueError):
        node_id("bad name", "10.0.0.1")


# -------------------------------------------------------------- parameters


def test_parameters_checked_and_metadata_kept_as_labels() -> None:
    p = parameters.parse(
        {
            "type": "nfs",
            "nfsFsType": "ext4",
            "squash": "all_squash",
            "csi.storage.k8s.io/pvc/name": "data",
            "csi.storage.k8s.io/pvc/namespace": "default",
        },
        {},
    )
    assert p.type == "nfs" and p.nfs_fs_type == "ext4"
    assert dict(p.labels) == {
        "csi.storage.k8s.io/pvc-name": "data",
        "csi.storage.k8s.io/pvc-namespace": "default",
    }
    assert parameters.backend_parameters("nfs", p) == {"fs_type": "ext4", "squash": "all_squash"}


def test_kubernetes_reserved_keys_are_left_to_the_sidecars() -> None:
    # csi-provisioner hands GetCapacity the StorageClass's parameters unfiltered
    p = parameters.parse(
        {
            "type": "nbd",
            "csi.storage.k8s.io/fstype": "ext4",
            "csi.storage.k8s.io/provisioner-secret-name": "s",
        },
        {},
    )
    assert p.type == "nbd" and not dict(p.labels)
    with pytest.raises(InvalidArgument, match=re.escape("parameter 'csi.storage.k8s.io.fstype'")):
        parameters.parse({"csi.storage.k8s.io.fstype": "ext4"}, {})


@pytest.mark.parametrize(
    ("params", "mutable", "message"),
    [
        ({"colour": "blue"}, {}, "unknown parameter 'colour'"),
        ({"type": "iscsi"}, {}, "type"),
        ({"nfsFsType": "btrfs"}, {}, "nfsFsType"),
        ({"squash": "some"}, {}, "squash"),
        ({"iopsLimit": "-1"}, {}, "whole number"),
        ({"bandwidthLimit": "1Zi"}, {}, "whole number"),
        ({"bandwidthLimit": "1Pi"}, {}, "maximum"),  # a Kubernetes quantity, 2^50
        ({"iopsLimit": str(10**13)}, {}, "maximum"),
        ({}, {"fsType": "xfs"}, "cannot change"),
        ({"squash": "root_squash"}, {"squash": "all_squash"}, "mutable parameters"),
    ],
)
def test_bad_parameters_are_invalid_argument_naming_them(
    params: dict[str, str], mutable: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parameters.parse(params, mutable)


def test_mutable_parameters_by_volume_type() -> None:
    p = parameters.parse({"type": "nbd", "bandwidthLimit": "100Mi"}, {"iopsLimit": "500"})
    assert parameters.backend_parameters("nbd", p) == {
        "bandwidth_limit": str(100 << 20),
        "iops_limit": "500",
    }
    with pytest.raises(InvalidArgument, match="do not apply to an nfs volume"):
        parameters.backend_parameters("nfs", p)
    assert parameters.backend_mutable("nfs", {"squash": "no_root_squash"}) == {
        "squash": "no_root_squash"
    }
    with pytest.raises(InvalidArgument, match="cannot be set on an nbd volume"):
        parameters.backend_mutable("nbd", {"squash": "no_root_squash"})
    with pytest.raises(InvalidArgument, match="XXX_FakeKey"):
        parameters.backend_mutable("nbd", {"XXX_FakeKey": "x"})
    assert parameters.backend_mutable("nbd", {}) == {}


# ------------------------------------------------------------ capabilities


def cap(mode: ModeValue, block: bool = False, fs: str = "") -> pb.VolumeCapability:
    if block:
        return pb.VolumeCapability(
            block=pb.VolumeCapability.BlockVolume(), access_mode=Mode(mode=mode)
        )
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type=fs), access_mode=Mode(mode=mode)
    )


@pytest.mark.parametrize(
    ("kind", "capability", "ok"),
    [
        ("nfs", cap(Mode.MULTI_NODE_MULTI_WRITER), True),
        ("nfs", cap(Mode.SINGLE_NODE_WRITER), True),
        ("nfs", cap(Mode.SINGLE_NODE_WRITER, block=True), False),
        ("nfs", cap(Mode.SINGLE_NODE_WRITER, fs="ext4"), False),
        ("nbd", cap(Mode.SINGLE_NODE_WRITER, fs="xfs"), True),
        ("nbd", cap(Mode.SINGLE_NODE_MULTI_WRITER), True),
        ("nbd", cap(Mode.MULTI_NODE_READER_ONLY), True),
        ("nbd", cap(Mode.MULTI_NODE_MULTI_WRITER), False),
        ("nbd", cap(Mode.MULTI_NODE_SINGLE_WRITER), False),
        ("nbd", cap(Mode.MULTI_NODE_MULTI_WRITER, block=True), True),
        ("nbd", cap(Mode.SINGLE_NODE_WRITER, fs="btrfs"), False),
    ],
)
def test_access_modes_by_type(kind: str, capability: pb.VolumeCapability, ok: bool) -> None:
    assert (capabilities.unsupported(kind, [capability]) is None) == ok


def test_default_type_follows_the_access() -> None:
    assert capabilities.default_type([cap(Mode.SINGLE_NODE_WRITER, block=True)]) == "nbd"
    assert capabilities.default_type([cap(Mode.MULTI_NODE_MULTI_WRITER)]) == "nfs"
    assert capabilities.default_type([cap(Mode.SINGLE_NODE_WRITER)]) == "nbd"


def test_malformed_capabilities_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        capabilities.check_present([])
    with pytest.raises(InvalidArgument, match="neither block nor mount"):
        capabilities.check_present(
            [pb.VolumeCapability(access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER))]
        )
    with pytest.raises(InvalidArgument, match="no access mode"):
        capabilities.check_present([pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume())])
    flags = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(mount_flags=["x"] * 65),
        access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER),
    )
    with pytest.raises(InvalidArgument, match="mount_flags"):
        capabilities.check_present([flags])


# ------------------------------------------------------------------- sizes


def cr(required: int = 0, limit: int = 0) -> pb.CapacityRange:
    return pb.CapacityRange(required_bytes=required, limit_bytes=limit)


def test_capacity_ranges_honoured_exactly() -> None:
    assert requested_size(None) == (1 << 30, 0)
    assert requested_size(cr(1)) == (MIB, 0)
    assert requested_size(cr(MIB + 1)) == (2 * MIB, 0)
    assert requested_size(cr(0, 10 * MIB)) == (10 * MIB, 10 * MIB)
    assert requested_size(cr(5 * MIB + 1, 6 * MIB)) == (6 * MIB, 6 * MIB)
    with pytest.raises(OutOfRange):
        requested_size(cr(5 * MIB + 1, 5 * MIB + 100))  # no whole MiB fits
    with pytest.raises(OutOfRange):
        requested_size(cr(65 << 40))
    with pytest.raises(InvalidArgument):
        requested_size(cr(-1))
    with pytest.raises(InvalidArgument):
        requested_size(cr(10 * MIB, 5 * MIB))


def test_backend_names_for_csi_names() -> None:
    assert backend_name("pvc-1234") == "pvc-1234"
    long = "x" * 200
    assert backend_name(long) == backend_name(long) != long
    assert len(backend_name("name with spaces")) <= 128
    with pytest.raises(InvalidArgument):
        backend_name("")
    with pytest.raises(InvalidArgument):
        backend_name("x" * 300)


# ---------------------------------------------------------------- topology


def sn(name: str, **segment: str) -> StorageNodeConfig:
    return StorageNodeConfig(name=name, address="127.0.0.1:1", topology=segment)


def topo(**segment: str) -> pb.Topology:
    return pb.Topology(segments=segment)


def test_topology_allows_and_orders_storage_nodes() -> None:
    a, b, anywhere = sn("a", zone="a"), sn("b", zone="b"), sn("c")
    nodes = [a, b, anywhere]
    assert topology.candidates(nodes, None) == nodes
    req = pb.TopologyRequirement(requisite=[topo(zone="a", node="n1")])
    assert topology.candidates(nodes, req) == [a, anywhere]
    req = pb.TopologyRequirement(
        requisite=[topo(zone="a"), topo(zone="b")], preferred=[topo(zone="b")]
    )
    # a storage node without a segment is reachable from the preferred zone too
    assert topology.candidates(nodes, req) == [b, anywhere, a]
    assert topology.accessible(anywhere) == []


# ------------------------------------------------------------------- locks


def test_a_second_call_on_a_busy_key_is_aborted() -> None:
    locks = OperationLocks()
    inside, release = threading.Event(), threading.Event()

    def first() -> None:
        with locks.hold("vol-1"):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=first)
    t.start()
    inside.wait(10)
    with pytest.raises(Aborted), locks.hold("vol-1"):
        pass
    with locks.hold("vol-2"):  # other keys are free
        pass
    release.set()
    t.join()
    with locks.hold("vol-1"):  # free again once the first call ended
        pass


# ------------------------------------------------------------ error mapping


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.UNKNOWN, Unavailable),
    ],
)
def test_backend_errors_keep_their_code_and_name_the_storage_node(
    code: grpc.StatusCode, kind: type[CsiError]
) -> None:
    err = from_backend(FakeRpcError(code, "why"), "sn-a")
    assert isinstance(err, kind) and err.message == "storage node sn-a: why"
