"""The backend gRPC API: request validation at the edge, errors mapped once."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from backend import errors
from backend.metrics import OPERATION_SECONDS
from backend.proto import backend_pb2 as pb
from backend.proto import backend_pb2_grpc as pb_grpc
from backend.quarantine import Orphan
from backend.service import StorageService
from backend.views import CapacityInfo, NbdTargetInfo, NfsTargetInfo, SnapshotInfo, VolumeInfo

log = logging.getLogger("moorage.backend.api")

R = TypeVar("R")

_STATUS: list[tuple[type[errors.BackendError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
]

_TYPES: dict[int, str] = {int(pb.NBD): "nbd", int(pb.NFS): "nfs"}
_TYPE_PB: dict[str, pb.VolumeType] = {"nbd": pb.NBD, "nfs": pb.NFS}


# The most of a status message a caller gets: grpc carries it in the trailing
# metadata, and one over its limit turns the answer into RESOURCE_EXHAUSTED.
MAX_DETAILS = 1000


def status_for(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def details(message: str) -> str:
    """A status message cut to :data:`MAX_DETAILS` characters."""
    if len(message) <= MAX_DETAILS:
        return message
    return message[: MAX_DETAILS - 3] + "..."


class _Undecodable:
    """Stands for a request whose bytes are not the method's request message."""

    def __init__(self, size: int, error: Exception) -> None:
        self.size = size
        self.error = error


class RequestDecoding(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Bytes that do not parse as the request message get INVALID_ARGUMENT and one
    log line (grpc itself answers INTERNAL and logs a traceback per request)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        inner = handler.unary_unary
        method = handler_call_details.method

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:
                return _Undecodable(len(data), e)

        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                log.warning(
                    "%s: undecodable request (%d bytes): %s",
                    method,
                    request.size,
                    str(request.error)[:200],
                )
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request is not a valid message for {method}",
                )
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )


def _rpc(method: Callable[[Any, Any, grpc.ServicerContext], R]) -> Callable[..., R]:
    """Turn backend errors into gRPC statuses; log what was not expected."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> R:
        started = time.monotonic()
        code = grpc.StatusCode.OK
        try:
            return method(self, request, context)
        except errors.BackendError as e:
            code = status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                log.error("%s failed: %s", method.__name__, e)
            context.abort(code, details(str(e)))
        except Exception as e:
            if code == grpc.StatusCode.OK:  # not the abort above
                code = grpc.StatusCode.INTERNAL
                log.exception("%s failed unexpectedly", method.__name__)
                context.abort(code, details(f"internal error: {e}"))
            raise
        finally:
            OPERATION_SECONDS.labels(method.__name__, code.name).observe(time.monotonic() - started)

    return wrapper


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

    @_rpc
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

    @_rpc
    def DeleteVolume(
        self, request: pb.DeleteVolumeRequest, context: grpc.ServicerContext
    ) -> pb.DeleteVolumeResponse:
        self.service.delete_volume(request.volume_id)
        return pb.DeleteVolumeResponse()

    @_rpc
    def ExpandVolume(
        self, request: pb.ExpandVolumeRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        return volume_pb(self.service.expand_volume(request.volume_id, request.size_bytes))

    @_rpc
    def SetVolumeGroup(
        self, request: pb.SetVolumeGroupRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        return volume_pb(self.service.set_volume_group(request.volume_id, request.gid))

    @_rpc
    def ModifyVolume(
        self, request: pb.ModifyVolumeRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        return volume_pb(self.service.modify_volume(request.volume_id, dict(request.parameters)))

    @_rpc
    def GetVolume(self, request: pb.GetVolumeRequest, context: grpc.ServicerContext) -> pb.Volume:
        key = request.WhichOneof("key")
        if key == "volume_id":
            return volume_pb(self.service.get_volume(volume_id=request.volume_id))
        if key == "name":
            return volume_pb(self.service.get_volume(name=request.name))
        raise errors.InvalidArgument("give a volume_id or a name")

    @_rpc
    def ListVolumes(
        self, request: pb.ListVolumesRequest, context: grpc.ServicerContext
    ) -> pb.ListVolumesResponse:
        volumes, token = self.service.list_volumes(request.max_entries, request.starting_token)
        return pb.ListVolumesResponse(volumes=[volume_pb(v) for v in volumes], next_token=token)

    @_rpc
    def CreateSnapshot(
        self, request: pb.CreateSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.Snapshot:
        return snapshot_pb(self.service.create_snapshot(request.name, request.source_volume_id))

    @_rpc
    def DeleteSnapshot(
        self, request: pb.DeleteSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteSnapshotResponse:
        self.service.delete_snapshot(request.snapshot_id)
        return pb.DeleteSnapshotResponse()

    @_rpc
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

    @_rpc
    def GetCapacity(
        self, request: pb.GetCapacityRequest, context: grpc.ServicerContext
    ) -> pb.Capacity:
        return capacity_pb(self.service.capacity())

    @_rpc
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

    @_rpc
    def UnpublishVolume(
        self, request: pb.UnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.UnpublishVolumeResponse:
        self.service.unpublish_volume(request.volume_id, request.node_id)
        return pb.UnpublishVolumeResponse()

    @_rpc
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

    @_rpc
    def ListOrphans(
        self, request: pb.ListOrphansRequest, context: grpc.ServicerContext
    ) -> pb.ListOrphansResponse:
        return pb.ListOrphansResponse(orphans=[orphan_pb(o) for o in self.service.list_orphans()])

    @_rpc
    def AdoptVolume(
        self, request: pb.AdoptVolumeRequest, context: grpc.ServicerContext
    ) -> pb.Volume:
        kind = _volume_type(request.type) if request.type else ""
        return volume_pb(self.service.adopt_volume(request.orphan, request.name, kind))

    @_rpc
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
