"""The CSI GroupController service against a fake storage-node client: the spec's
error table, members across storage nodes, the member lists, and the messages.

The group snapshot itself (its barrier) is proven against a real storage node
in tests/integration/test_csi_group_snapshots.py.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from backend.api.proto import backend_pb2 as bpb
from csi.config import PluginConfig, StorageNodeConfig
from csi.errors import CsiError
from csi.groupcontroller import GroupControllerService
from csi.identity import IdentityService
from csi.proto import csi_pb2 as pb
from csi.storagenodes import StorageNodes
from tests.fake_rpc import FakeRpcError

A = "a" * 32
B = "b" * 32
G = "c" * 32


class FakeClient:
    """The backend client calls the service makes, answered from a dict."""

    def __init__(self) -> None:
        self.groups: dict[str, bpb.GroupSnapshot] = {}
        self.calls: list[tuple[str, object]] = []

    def create_group_snapshot(self, name: str, sources: list[str]) -> bpb.GroupSnapshot:
        self.calls.append(("create", (name, list(sources))))
        g = bpb.GroupSnapshot(
            id=G,
            name=name,
            source_volume_ids=sources,
            state="ready",
            ready_to_use=True,
            created_unix=1700000000,
            snapshots=[
                bpb.Snapshot(
                    id=f"{i:032x}",
                    source_volume_id=v,
                    size_bytes=1 << 20,
                    ready_to_use=True,
                    created_unix=1700000000,
                    group_snapshot_id=G,
                )
                for i, v in enumerate(sources, start=1)
            ],
        )
        self.groups[G] = g
        return g

    def get_group_snapshot(self, group_id: str) -> bpb.GroupSnapshot:
        if group_id not in self.groups:
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND, f"group snapshot {group_id} not found")
        return self.groups[group_id]

    def delete_group_snapshot(self, group_id: str) -> None:
        self.calls.append(("delete", group_id))
        self.groups.pop(group_id, None)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> tuple[GroupControllerService, FakeClient]:
    config = PluginConfig(
        storage_nodes=(
            StorageNodeConfig(name="sn-a", address="unix:///nowhere-a"),
            StorageNodeConfig(name="sn-b", address="unix:///nowhere-b"),
        )
    )
    nodes = StorageNodes(config)
    client = FakeClient()
    monkeypatch.setattr(nodes, "client", lambda name, secrets=None: client)
    return GroupControllerService(nodes), client


def code(call: Any) -> grpc.StatusCode:
    with pytest.raises(CsiError) as info:
        call()
    result: grpc.StatusCode = info.value.code
    return result


def create(service: GroupControllerService, name: str, *sources: str, **params: str) -> Any:
    req = pb.CreateVolumeGroupSnapshotRequest(
        name=name, source_volume_ids=list(sources), parameters=params
    )
    return service.CreateVolumeGroupSnapshot(req, None)  # type: ignore[arg-type]


def test_capabilities_claim_the_group_service_and_its_rpcs() -> None:
    identity = IdentityService(controller=True)
    caps = identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), None)  # type: ignore[arg-type]
    services = {c.service.type for c in caps.capabilities if c.HasField("service")}
    assert pb.PluginCapability.Service.GROUP_CONTROLLER_SERVICE in services
    node_only = IdentityService(controller=False)
    caps = node_only.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), None)  # type: ignore[arg-type]
    assert not [c for c in caps.capabilities if c.HasField("service")]


def test_group_capabilities(fake: tuple[GroupControllerService, FakeClient]) -> None:
    service, _ = fake
    r = service.GroupControllerGetCapabilities(pb.GroupControllerGetCapabilitiesRequest(), None)  # type: ignore[arg-type]
    assert [c.rpc.type for c in r.capabilities] == [
        pb.GroupControllerServiceCapability.RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT
    ]


def test_create_names_every_member_with_the_group_id(
    fake: tuple[GroupControllerService, FakeClient],
) -> None:
    service, client = fake
    r = create(service, "group-1", f"sn-a:{A}", f"sn-a:{B}").group_snapshot
    assert r.group_snapshot_id == f"sn-a:{G}" and r.ready_to_use
    assert [s.source_volume_id for s in r.snapshots] == [f"sn-a:{A}", f"sn-a:{B}"]
    assert {s.group_snapshot_id for s in r.snapshots} == {f"sn-a:{G}"}
    assert all(s.snapshot_id.startswith("sn-a:") for s in r.snapshots)
    assert client.calls == [("create", ("group-1", [A, B]))]


def test_bad_create_requests_reach_no_storage_node(
    fake: tuple[GroupControllerService, FakeClient],
) -> None:
    service, client = fake
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    assert code(lambda: create(service, "", f"sn-a:{A}")) == INVALID
    assert code(lambda: create(service, "g")) == INVALID
    assert code(lambda: create(service, "g", f"sn-a:{A}", f"sn-a:{A}")) == INVALID
    assert code(lambda: create(service, "g", f"sn-a:{A}", flavour="x")) == INVALID
    assert code(lambda: create(service, "g", "not-ours")) == grpc.StatusCode.NOT_FOUND
    assert code(lambda: create(service, "g", f"sn-z:{A}")) == grpc.StatusCode.NOT_FOUND
    assert client.calls == []


def test_members_on_two_storage_nodes_are_a_failed_precondition_naming_them(
    fake: tuple[GroupControllerService, FakeClient],
) -> None:
    service, client = fake
    with pytest.raises(CsiError) as info:
        create(service, "g", f"sn-a:{A}", f"sn-b:{B}")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "sn-a, sn-b" in str(info.value)
    assert client.calls == []


def test_get_and_delete_check_the_member_list(
    fake: tuple[GroupControllerService, FakeClient],
) -> None:
    service, client = fake
    made = create(service, "g", f"sn-a:{A}", f"sn-a:{B}").group_snapshot
    members = [s.snapshot_id for s in made.snapshots]
    get = service.GetVolumeGroupSnapshot
    got = get(pb.GetVolumeGroupSnapshotRequest(group_snapshot_id=made.group_snapshot_id), None)  # type: ignore[arg-type]
    assert got.group_snapshot == made
    same = pb.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=made.group_snapshot_id, snapshot_ids=list(reversed(members))
    )
    assert get(same, None).group_snapshot == made  # type: ignore[arg-type]
    wrong = [members[0], f"sn-a:{'d' * 32}"]
    bad_get = pb.GetVolumeGroupSnapshotRequest(
        group_snapshot_id=made.group_snapshot_id, snapshot_ids=wrong
    )
    assert code(lambda: get(bad_get, None)) == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[arg-type]
    delete = service.DeleteVolumeGroupSnapshot
    bad_delete = pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=made.group_snapshot_id, snapshot_ids=members[:1]
    )
    assert code(lambda: delete(bad_delete, None)) == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[arg-type]
    assert ("delete", G) not in client.calls
    ok = pb.DeleteVolumeGroupSnapshotRequest(
        group_snapshot_id=made.group_snapshot_id, snapshot_ids=members
    )
    delete(ok, None)  # type: ignore[arg-type]
    assert ("delete", G) in client.calls
    # Gone: delete is OK again, get is NOT_FOUND.
    delete(ok, None)  # type: ignore[arg-type]
    missing = pb.GetVolumeGroupSnapshotRequest(group_snapshot_id=made.group_snapshot_id)
    assert code(lambda: get(missing, None)) == grpc.StatusCode.NOT_FOUND  # type: ignore[arg-type]


def test_ids_that_are_not_ours(fake: tuple[GroupControllerService, FakeClient]) -> None:
    service, client = fake
    for group_id in ("fake-group", f"sn-z:{G}"):
        service.DeleteVolumeGroupSnapshot(
            pb.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=group_id),
            None,  # type: ignore[arg-type]
        )
        req = pb.GetVolumeGroupSnapshotRequest(group_snapshot_id=group_id)
        assert code(lambda r=req: service.GetVolumeGroupSnapshot(r, None)) == (  # type: ignore[arg-type]
            grpc.StatusCode.NOT_FOUND
        )
    for empty in (
        lambda: service.DeleteVolumeGroupSnapshot(pb.DeleteVolumeGroupSnapshotRequest(), None),  # type: ignore[arg-type]
        lambda: service.GetVolumeGroupSnapshot(pb.GetVolumeGroupSnapshotRequest(), None),  # type: ignore[arg-type]
    ):
        assert code(empty) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.calls == []
