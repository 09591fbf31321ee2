"""The CSI GroupController service: volume group snapshots on the storage nodes.

A group snapshot is taken by the storage node that holds every member, at
one point in time (its barrier: docs/csi.md, "Volume group snapshots").
There is no barrier across storage nodes: members on more than one are
FAILED_PRECONDITION, with the nodes named.  A group snapshot's id is
``STORAGE-NODE:ID`` like a volume's (``csi.ids``); its members are ordinary
snapshots that name it in ``group_snapshot_id``, usable as a volume's source,
deleted only with their group.

Like the Controller service, the service keeps no state and holds the name
(or the id) of what it changes for the duration of the call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import grpc
from google.protobuf import timestamp_pb2

from backend.api.proto import backend_pb2 as bpb
from csi import messages
from csi.errors import FailedPrecondition, InvalidArgument, NotFound
from csi.ids import ObjectRef, parse_object_id
from csi.locks import OperationLocks
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.requests import backend_name, require
from csi.storagenodes import StorageNodes

log = logging.getLogger("moorage.csi.groupcontroller")

RPC = pb.GroupControllerServiceCapability.RPC
CAPABILITIES = (RPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,)
# The storage node's own bound (backend.group_snapshot_ops.MAX_MEMBERS).
MAX_MEMBERS = 64


def group_snapshot_message(node: str, g: bpb.GroupSnapshot) -> pb.VolumeGroupSnapshot:
    snapshots = [messages.snapshot(node, s) for s in g.snapshots]
    return pb.VolumeGroupSnapshot(
        group_snapshot_id=f"{node}:{g.id}",
        snapshots=snapshots,
        creation_time=timestamp_pb2.Timestamp(seconds=g.created_unix),
        ready_to_use=g.ready_to_use and all(s.ready_to_use for s in snapshots),
    )


def check_members(node: str, g: bpb.GroupSnapshot, snapshot_ids: Sequence[str]) -> None:
    """INVALID_ARGUMENT when the caller's list of member snapshots is not the group's
    (an empty list is not checked: csi-sanity and some COs send none)."""
    if not snapshot_ids:
        return
    ours = {f"{node}:{s.id}" for s in g.snapshots}
    if set(snapshot_ids) != ours:
        raise InvalidArgument(
            f"snapshot_ids do not match the members of group snapshot {node}:{g.id} "
            f"({len(ours)} snapshots)"
        )


class GroupControllerService(pb_grpc.GroupControllerServicer):
    def __init__(self, storage_nodes: StorageNodes) -> None:
        self.nodes = storage_nodes
        self.locks = OperationLocks()

    def GroupControllerGetCapabilities(
        self, request: pb.GroupControllerGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GroupControllerGetCapabilitiesResponse:
        return pb.GroupControllerGetCapabilitiesResponse(
            capabilities=[
                pb.GroupControllerServiceCapability(rpc=RPC(type=t)) for t in CAPABILITIES
            ]
        )

    def CreateVolumeGroupSnapshot(
        self, request: pb.CreateVolumeGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.CreateVolumeGroupSnapshotResponse:
        name = backend_name(request.name, "group snapshot name")
        if request.parameters:
            raise InvalidArgument(
                f"unknown group snapshot parameter {sorted(request.parameters)[0][:80]!r}: "
                "group snapshots take none"
            )
        node, members = self._members(request.source_volume_ids)
        with self.locks.hold(f"group-snapshot:{name}"):
            g: bpb.GroupSnapshot = self.nodes.call(
                node, lambda c: c.create_group_snapshot(name, members), request.secrets
            )
        log.info("group snapshot %s:%s of %d volumes for %s", node, g.id, len(members), name)
        return pb.CreateVolumeGroupSnapshotResponse(group_snapshot=group_snapshot_message(node, g))

    def DeleteVolumeGroupSnapshot(
        self, request: pb.DeleteVolumeGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteVolumeGroupSnapshotResponse:
        group_id = require(request.group_snapshot_id, "group_snapshot_id")
        ref = parse_object_id(group_id)
        if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
            return pb.DeleteVolumeGroupSnapshotResponse()  # not ours: no such group
        with self.locks.hold(f"group-snapshot-id:{ref}"):
            g = self._find(ref, request.secrets)
            if g is None:
                return pb.DeleteVolumeGroupSnapshotResponse()
            check_members(ref.storage_node, g, request.snapshot_ids)
            self.nodes.call(
                ref.storage_node,
                lambda c: c.delete_group_snapshot(ref.backend_id),
                request.secrets,
            )
        return pb.DeleteVolumeGroupSnapshotResponse()

    def GetVolumeGroupSnapshot(
        self, request: pb.GetVolumeGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.GetVolumeGroupSnapshotResponse:
        group_id = require(request.group_snapshot_id, "group_snapshot_id")
        ref = parse_object_id(group_id)
        if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
            raise NotFound(f"group snapshot {group_id[:140]!r} does not exist")
        g = self._find(ref, request.secrets)
        if g is None:
            raise NotFound(f"group snapshot {ref} does not exist")
        check_members(ref.storage_node, g, request.snapshot_ids)
        return pb.GetVolumeGroupSnapshotResponse(
            group_snapshot=group_snapshot_message(ref.storage_node, g)
        )

    # -- pieces

    def _members(self, source_volume_ids: Sequence[str]) -> tuple[str, list[str]]:
        """The storage node of every source volume and their ids there; FAILED_PRECONDITION
        when they are on more than one (no barrier spans storage nodes)."""
        if not source_volume_ids:
            raise InvalidArgument("source_volume_ids is empty")
        if len(source_volume_ids) > MAX_MEMBERS:
            raise InvalidArgument(f"a group snapshot takes at most {MAX_MEMBERS} volumes")
        if len(set(source_volume_ids)) != len(source_volume_ids):
            raise InvalidArgument("source_volume_ids names a volume twice")
        refs: list[ObjectRef] = []
        for value in source_volume_ids:
            ref = parse_object_id(require(value, "source volume id"))
            if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
                raise NotFound(f"source volume {value[:140]!r} does not exist")
            refs.append(ref)
        nodes = sorted({r.storage_node for r in refs})
        if len(nodes) > 1:
            raise FailedPrecondition(
                f"the volumes are on {len(nodes)} storage nodes ({', '.join(nodes)}): a group "
                "snapshot is taken by one storage node, so all its volumes must be on one "
                "(give their StorageClass a storageNode, or a topology that keeps them together)"
            )
        return nodes[0], [r.backend_id for r in refs]

    def _find(self, ref: ObjectRef, secrets: Mapping[str, str]) -> bpb.GroupSnapshot | None:
        try:
            g: bpb.GroupSnapshot = self.nodes.call(
                ref.storage_node, lambda c: c.get_group_snapshot(ref.backend_id), secrets
            )
        except NotFound:
            return None
        return g
