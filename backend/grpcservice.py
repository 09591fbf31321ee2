"""The storage node's gRPC service: the API's calls served by the StorageService.

:class:`BackendServicer` turns each request into a service call and its
result into the API's messages (errors become statuses in the API's one
interceptor, whose observer here times every call).
:class:`BearerTokenInterceptor` refuses calls without the node's token.  The
local default is a unix socket with mode 0600, where the file system decides
who may connect; over TCP the daemon refuses to start without a token or
client-certificate verification.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import grpc

from backend.api import errors
from backend.api.interceptor import Outcome
from backend.api.proto import backend_pb2 as pb
from backend.api.proto import backend_pb2_grpc as pb_grpc
from backend.metrics import OPERATION_SECONDS
from backend.quarantine import Orphan
from backend.service import StorageService
from backend.views import (
    CapacityInfo,
    GroupSnapshotInfo,
    NbdTargetInfo,
    NfsTargetInfo,
    SnapshotInfo,
    VolumeInfo,
)

log = logging.getLogger("moorage.backend.api")

_TYPES: dict[int, str] = {int(pb.NBD): "nbd", int(pb.NFS): "nfs"}
_TYPE_PB: dict[str, pb.VolumeType] = {"nbd": pb.NBD, "nfs": pb.NFS}


def record_call(call: Outcome) -> None:
    """The API's observer: every call timed, by method and status code; a request
    that was no request message logged (a client out of step with the API)."""
    OPERATION_SECONDS.labels(call.name, call.code.name).observe(call.seconds)
    if call.request is None:
        log.warning("%s: %s", call.name, call.message)


def _abort_unauthenticated(message: str) -> grpc.RpcMethodHandler[Any, Any]:
    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
        if not presented:
            return _abort_unauthenticated("missing bearer token")
        if not hmac.compare_digest(presented, self._expected):
            return _abort_unauthenticated("invalid bearer token")
        return continuation(handler_call_details)


def volume_pb(v: VolumeInfo) -> pb.Volume:
    return pb.Volume(
        id=v.id,
        name=v.name,
        type=_TYPE_PB[v.type],
        size_bytes=v.size_bytes,
        used_bytes=v.used_bytes,
        fs_type=v.fs_type or "",
        source_snapshot_id=v.source_snapshot_id or "",
        source_volume_id=v.source_volume_id or "",
        state=v.state,
        published_nodes=list(v.published_nodes),
        parameters=dict(v.parameters),
        created_unix=v.created_unix,
        squash=v.squash or "",
        labels=dict(v.labels),
        publications=[
            pb.PublishedNode(node_id=p.node_id, node_address=p.node_address, read_only=p.read_only)
            for p in v.publications
        ],
    )


def snapshot_pb(s: SnapshotInfo) -> pb.Snapshot:
    return pb.Snapshot(
        id=s.id,
        name=s.name,
        source_volume_id=s.source_volume_id,
        type=_TYPE_PB[s.type],
        size_bytes=s.size_bytes,
        fs_type=s.fs_type or "",
        state=s.state,
        ready_to_use=s.ready_to_use,
        created_unix=s.created_unix,
        group_snapshot_id=s.group_snapshot_id or "",
    )


def group_snapshot_pb(g: GroupSnapshotInfo) -> pb.GroupSnapshot:
    return pb.GroupSnapshot(
        id=g.id,
        name=g.name,
        source_volume_ids=list(g.source_volume_ids),
        snapshots=[snapshot_pb(s) for s in g.snapshots],
        state=g.state,
        ready_to_use=g.ready_to_use,
        created_unix=g.created_unix,
    )


def capacity_pb(c: CapacityInfo) -> pb.Capacity:
    return pb.Capacity(
        total_bytes=c.total_bytes,
        free_bytes=c.free_bytes,
        provisioned_bytes=c.provisioned_bytes,
        overcommit_ratio=c.overcommit_ratio,
        available_bytes=c.available_bytes,
    )


def _volume_type(value: int) -> str:
    kind = _TYPES.get(value)
    if kind is None:
        raise errors.InvalidArgument("volume type must be NBD or NFS")
    return kind


class BackendServicer(pb_grpc.BackendServicer):
    def __init__(self, service: StorageService) -> None:
        self.service = service

    def CreateVolume(
        self, request: pb.CreateVolumeRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        source = request.WhichOneof("source")
        volume = self.service.create_volume(
            name=request.name,
            kind=_volume_type(request.type),
            size=request.size_bytes,
            parameters=dict(request.parameters),
            source_snapshot_id=request.snapshot_id if source == "snapshot_id" else None,
            source_volume_id=request.volume_id if source == "volume_id" else None,
            labels=dict(request.labels),
        )
        return volume_pb(volume)

    def DeleteVolume(
        self, request: pb.DeleteVolumeRequest, context: grpc.ServicerContext
    ) -> pb.DeleteVolumeResponse:
        self.service.delete_volume(request.volume_id)
        return pb.DeleteVolumeResponse()

    def ExpandVolume(
        self, request: pb.ExpandVolumeRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        return volume_pb(self.service.expand_volume(request.volume_id, request.size_bytes))

    def SetVolumeGroup(
        self, request: pb.SetVolumeGroupRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        return volume_pb(self.service.set_volume_group(request.volume_id, request.gid))

    def ModifyVolume(
        self, request: pb.ModifyVolumeRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        return volume_pb(self.service.modify_volume(request.volume_id, dict(request.parameters)))

    def GetVolume(self, request: pb.GetVolumeRequest, context: grpc.ServicerContext) -> pb.Volume:
        key = request.WhichOneof("key")
        if key == "volume_id":
            return volume_pb(self.service.get_volume(volume_id=request.volume_id))
        if key == "name":
            return volume_pb(self.service.get_volume(name=request.name))
        raise errors.InvalidArgument("give a volume_id or a name")

    def ListVolumes(
        self, request: pb.ListVolumesRequest, context: grpc.ServicerContext
    ) -> pb.ListVolumesResponse:
        volumes, token = self.service.list_volumes(request.max_entries, request.starting_token)
        return pb.ListVolumesResponse(volumes=[volume_pb(v) for v in volumes], next_token=token)

    def CreateSnapshot(
        self, request: pb.CreateSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.Snapshot:
        return snapshot_pb(self.service.create_snapshot(request.name, request.source_volume_id))

    def DeleteSnapshot(
        self, request: pb.DeleteSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteSnapshotResponse:
        self.service.delete_snapshot(request.snapshot_id)
        return pb.DeleteSnapshotResponse()

    def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        snaps, token = self.service.list_snapshots(
            request.max_entries,
            request.starting_token,
            source_volume_id=request.source_volume_id or None,
            snapshot_id=request.snapshot_id or None,
        )
        return pb.ListSnapshotsResponse(snapshots=[snapshot_pb(s) for s in snaps], next_token=token)

    def CreateGroupSnapshot(
        self, request: pb.CreateGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.GroupSnapshot:
        group = self.service.create_group_snapshot(request.name, list(request.source_volume_ids))
        return group_snapshot_pb(group)

    def DeleteGroupSnapshot(
        self, request: pb.DeleteGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteGroupSnapshotResponse:
        self.service.delete_group_snapshot(request.group_snapshot_id)
        return pb.DeleteGroupSnapshotResponse()

    def GetGroupSnapshot(
        self, request: pb.GetGroupSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.GroupSnapshot:
        return group_snapshot_pb(self.service.get_group_snapshot(request.group_snapshot_id))

    def GetCapacity(
        self, request: pb.GetCapacityRequest, context: grpc.ServicerContext
    ) -> pb.Capacity:
        return capacity_pb(self.service.capacity())

    def PublishVolume(
        self, request: pb.PublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.PublishVolumeResponse:
        target = self.service.publish_volume(
            request.volume_id,
            request.node_id,
            request.node_address,
            request.read_only,
            request.multi_writer,
            request.single_node,
        )
        if isinstance(target, NfsTargetInfo):
            return pb.PublishVolumeResponse(
                nfs=pb.NfsTarget(
                    server=target.server,
                    port=target.port,
                    export_path=target.path,
                    mount_port=target.mount_port,
                )
            )
        assert isinstance(target, NbdTargetInfo)
        return pb.PublishVolumeResponse(
            nbd=pb.NbdTarget(
                host=target.host, port=target.port, export_name=target.export_name, tls=target.tls
            )
        )

    def UnpublishVolume(
        self, request: pb.UnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.UnpublishVolumeResponse:
        self.service.unpublish_volume(request.volume_id, request.node_id)
        return pb.UnpublishVolumeResponse()

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        h = self.service.health()
        return pb.HealthResponse(
            ok=h.ok,
            version=h.version,
            ganesha_running=h.ganesha_running,
            nbd_exports=h.nbd_exports,
            nbd_connections=h.nbd_connections,
            message=h.message,
            serving=h.serving,
            low_space=h.low_space,
        )

    def ListOrphans(
        self, request: pb.ListOrphansRequest, context: grpc.ServicerContext
    ) -> pb.ListOrphansResponse:
        return pb.ListOrphansResponse(orphans=[orphan_pb(o) for o in self.service.list_orphans()])

    def AdoptVolume(
        self, request: pb.AdoptVolumeRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        kind = _volume_type(request.type) if request.type else ""
        return volume_pb(self.service.adopt_volume(request.orphan, request.name, kind))

    def PurgeOrphan(
        self, request: pb.PurgeOrphanRequest, context: grpc.ServicerContext
    ) -> pb.Orphan:
        return orphan_pb(self.service.purge_orphan(request.orphan))


def orphan_pb(o: Orphan) -> pb.Orphan:
    return pb.Orphan(
        name=o.name,
        kind=o.kind,
        original_id=o.original_id,
        size_bytes=o.size_bytes,
        allocated_bytes=o.allocated_bytes,
        fs_type=o.fs_type or "",
        quarantined_unix=int(o.quarantined_at),
    )
