"""The CSI Controller service: volumes, snapshots and publications on the storage nodes.

The RPC handlers check the request, hold what they change, and call the
storage node the id names; building messages, placement and lookups live
beside them, not inside the handlers.

The controller keeps no state: every id names its storage node, so any
replica answers any call.  Each call that changes something holds its
volume, snapshot or name for its duration; a concurrent call for the same
one is ABORTED.  A failed backend call answers the CSI status its code maps
to (:data:`csi.errors.FROM_BACKEND`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

import grpc

from backend.api.proto import backend_pb2 as bpb
from csi import capabilities, lookups, messages, parameters, provisioning, topology
from csi.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)
from csi.ids import ObjectRef, address_problem, parse_node_id, parse_object_id
from csi.locks import OperationLocks
from csi.paging import paginate
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.requests import MAX_SIZE, MIN_SIZE, backend_name, requested_size, require
from csi.storagenodes import StorageNodes
from csi.volumekinds import VolumeKinds

log = logging.getLogger("moorage.csi.controller")

NAME_LABEL = "csi.moorage.dev/name"

RPC = pb.ControllerServiceCapability.RPC
CAPABILITIES = (
    RPC.CREATE_DELETE_VOLUME,
    RPC.PUBLISH_UNPUBLISH_VOLUME,
    RPC.LIST_VOLUMES,
    RPC.LIST_VOLUMES_PUBLISHED_NODES,
    RPC.GET_CAPACITY,
    RPC.CREATE_DELETE_SNAPSHOT,
    RPC.LIST_SNAPSHOTS,
    RPC.CLONE_VOLUME,
    RPC.PUBLISH_READONLY,
    RPC.EXPAND_VOLUME,
    RPC.GET_VOLUME,
    RPC.VOLUME_CONDITION,
    RPC.SINGLE_NODE_MULTI_WRITER,
    RPC.MODIFY_VOLUME,
)

T = TypeVar("T")


# ------------------------------------------------------------ the service


class ControllerService(pb_grpc.ControllerServicer):
    def __init__(self, storage_nodes: StorageNodes) -> None:
        self.nodes = storage_nodes
        self.locks = OperationLocks()
        self._kinds = VolumeKinds()

    # -- shared pieces

    def _ref(self, value: str, what: str = "volume") -> ObjectRef:
        ref = parse_object_id(value)
        if ref is None:
            raise NotFound(f"{what} {value[:140]!r} is not a moorage {what} id")
        self.nodes.get(ref.storage_node)  # NOT_FOUND when not configured
        return ref

    def _call(self, node: str, fn: Callable[..., T], secrets: Mapping[str, str] | None = None) -> T:
        return self.nodes.call(node, fn, secrets)

    def _volume(self, ref: ObjectRef, secrets: Mapping[str, str] | None = None) -> bpb.Volume:
        v = lookups.find_volume(self.nodes, ref, secrets)
        if v is None:
            raise NotFound(f"volume {ref} does not exist")
        self._kinds.remember(str(ref), v)
        return v

    def _kind(self, ref: ObjectRef, secrets: Mapping[str, str] | None = None) -> str:
        kind = self._kinds.get(str(ref))
        return kind or messages.VOLUME_TYPES[self._volume(ref, secrets).type]

    def _volume_message(self, node: str, v: bpb.Volume) -> pb.Volume:
        return messages.volume(node, v, topology.accessible(self.nodes.get(node)))

    # -- capabilities

    def ControllerGetCapabilities(
        self, request: pb.ControllerGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.ControllerGetCapabilitiesResponse:
        return pb.ControllerGetCapabilitiesResponse(
            capabilities=[
                pb.ControllerServiceCapability(rpc=pb.ControllerServiceCapability.RPC(type=t))
                for t in CAPABILITIES
            ]
        )

    # -- volumes

    def CreateVolume(
        self, request: pb.CreateVolumeRequest, context: grpc.ServicerContext
    ) -> pb.CreateVolumeResponse:
        name = backend_name(request.name)
        caps = request.volume_capabilities
        capabilities.check_present(caps)
        params = parameters.parse(request.parameters, request.mutable_parameters)
        kind = params.type or capabilities.default_type(caps)
        capabilities.check(kind, caps)
        size, limit = requested_size(
            request.capacity_range if request.HasField("capacity_range") else None
        )
        create_params = parameters.backend_parameters(kind, params)
        source_ref, source_kind = provisioning.content_source(self.nodes.config, request)
        secrets = request.secrets
        labels = dict(params.labels)
        if params.fs_type:
            if kind != "nbd":
                raise InvalidArgument("fsType is for nbd volumes; an nfs volume takes nfsFsType")
            named = {c.mount.fs_type for c in caps if c.WhichOneof("access_type") == "mount"}
            if named - {"", params.fs_type}:
                raise InvalidArgument(
                    f"fsType {params.fs_type} differs from the capability's {sorted(named)}"
                )
            labels[messages.FS_TYPE_LABEL] = params.fs_type
        if params.io_timeout:
            labels[messages.IO_TIMEOUT_LABEL] = params.io_timeout
        if name != request.name:
            labels[NAME_LABEL] = request.name[:512]
        with self.locks.hold(f"name:{name}"):
            sole = provisioning.sole_storage_node(self.nodes.config, request, params, source_ref)
            if sole is not None:
                # One storage node: its own create is idempotent by name, so the
                # lookup is needed only when it reports the name taken.
                try:
                    v = provisioning.create_on(
                        self.nodes, sole, name, kind, size, create_params, source_ref, source_kind,
                        labels, secrets,
                    )  # fmt: skip
                    self._kinds.remember(f"{sole}:{v.id}", v)
                    return pb.CreateVolumeResponse(volume=self._volume_message(sole, v))
                except AlreadyExists:
                    pass  # another size or parameters: compared below as the spec says
            found = lookups.volume_named(self.nodes, name, secrets)
            if found is not None:
                node, v = found
                provisioning.check_same(
                    v, kind, size, limit, create_params, source_ref, source_kind
                )
                if v.state != "ready":  # a create a crash interrupted: finish it
                    v = provisioning.create_on(
                        self.nodes, node, name, kind, v.size_bytes, create_params, source_ref,
                        source_kind, labels, secrets,
                    )  # fmt: skip
                return pb.CreateVolumeResponse(volume=self._volume_message(node, v))
            failures: list[str] = []
            order = provisioning.placement(
                self.nodes, request, params, source_ref, size, secrets, failures
            )
            for node in order:
                try:
                    v = provisioning.create_on(
                        self.nodes, node, name, kind, size, create_params, source_ref, source_kind,
                        labels, secrets,
                    )  # fmt: skip
                except (Unavailable, ResourceExhausted) as e:
                    failures.append(e.message)
                    continue
                log.info("volume %s:%s (%s) created for %s", node, v.id, kind, request.name)
                self._kinds.remember(f"{node}:{v.id}", v)
                return pb.CreateVolumeResponse(volume=self._volume_message(node, v))
            raise ResourceExhausted(
                f"no storage node could create a {size}-byte {kind} volume: " + "; ".join(failures)
            )

    def DeleteVolume(
        self, request: pb.DeleteVolumeRequest, context: grpc.ServicerContext
    ) -> pb.DeleteVolumeResponse:
        volume_id = require(request.volume_id, "volume_id")
        ref = parse_object_id(volume_id)
        if ref is None:
            return pb.DeleteVolumeResponse()  # not an id of ours: no such volume
        self._ref(volume_id)
        with self.locks.hold(str(ref)):
            self._call(ref.storage_node, lambda c: c.delete_volume(ref.backend_id), request.secrets)
        return pb.DeleteVolumeResponse()

    def ValidateVolumeCapabilities(
        self, request: pb.ValidateVolumeCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.ValidateVolumeCapabilitiesResponse:
        ref = self._ref(require(request.volume_id, "volume_id"))
        capabilities.check_present(request.volume_capabilities)
        v = self._volume(ref, request.secrets)
        kind = messages.VOLUME_TYPES[v.type]
        reason = capabilities.unsupported(kind, request.volume_capabilities)
        if reason is None and request.parameters:
            try:
                p = parameters.parse(request.parameters, request.mutable_parameters)
                if p.type not in (None, kind):
                    reason = f"the volume is {kind}, not {p.type}"
            except InvalidArgument as e:
                reason = e.message
        if reason is not None:
            return pb.ValidateVolumeCapabilitiesResponse(message=reason)
        return pb.ValidateVolumeCapabilitiesResponse(
            confirmed=pb.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_context=request.volume_context,
                volume_capabilities=request.volume_capabilities,
                parameters=request.parameters,
                mutable_parameters=request.mutable_parameters,
            )
        )

    def ListVolumes(
        self, request: pb.ListVolumesRequest, context: grpc.ServicerContext
    ) -> pb.ListVolumesResponse:
        if request.max_entries < 0:
            raise InvalidArgument("max_entries cannot be negative")

        def page(node: str, limit: int, token: str) -> tuple[list[bpb.Volume], str]:
            r = self._call(node, lambda c: c.list_volumes(limit, token))
            return list(r.volumes), r.next_token

        def entry(node: str, v: bpb.Volume) -> pb.ListVolumesResponse.Entry:
            return pb.ListVolumesResponse.Entry(
                volume=self._volume_message(node, v),
                status=pb.ListVolumesResponse.VolumeStatus(
                    published_node_ids=messages.published_node_ids(v),
                    volume_condition=messages.condition(v, self.nodes.problem(node)),
                ),
            )

        entries, next_token = paginate(
            self.nodes.names, request.max_entries, request.starting_token, page, entry
        )
        return pb.ListVolumesResponse(entries=entries, next_token=next_token)

    def GetCapacity(
        self, request: pb.GetCapacityRequest, context: grpc.ServicerContext
    ) -> pb.GetCapacityResponse:
        if request.volume_capabilities:
            capabilities.check_present(request.volume_capabilities)
        params = parameters.parse(request.parameters, {})
        segment = (
            dict(request.accessible_topology.segments)
            if request.HasField("accessible_topology")
            else None
        )
        nodes = [
            n
            for n in self.nodes.config.storage_nodes
            if (segment is None or topology.allows(segment, n))
            and (params.storage_node is None or n.name == params.storage_node)
        ]
        total = largest = 0
        for node in nodes:
            try:
                available = self._call(node.name, lambda c: c.capacity()).available_bytes
            except Unavailable as e:
                log.warning("capacity: %s counts as 0: %s", node.name, e.message)
                continue
            total += available
            largest = max(largest, available)
        return pb.GetCapacityResponse(
            available_capacity=total,
            maximum_volume_size=messages.int64(min(largest, MAX_SIZE)),
            minimum_volume_size=messages.int64(MIN_SIZE),
        )

    # -- publications

    def ControllerPublishVolume(
        self, request: pb.ControllerPublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerPublishVolumeResponse:
        volume_id = require(request.volume_id, "volume_id")
        node_id = require(request.node_id, "node_id")
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is missing")
        cap = request.volume_capability
        capabilities.check_present([cap])
        external = messages.external_share(request.volume_context)
        if external is not None:
            return pb.ControllerPublishVolumeResponse(publish_context=external)
        ref = self._ref(volume_id)
        node = parse_node_id(node_id)
        if node is None:
            raise NotFound(
                f"node {node_id[:140]!r} is unknown: a moorage node id is NAME@ADDRESS, as the "
                "node plugin reports it in NodeGetInfo"
            )
        problem = address_problem(node)
        if problem is not None:
            raise InvalidArgument(f"node {node_id[:140]!r} cannot be published to: {problem}")
        with self.locks.hold(str(ref)):
            reason = capabilities.unsupported(self._kind(ref, request.secrets), [cap])
            if reason is not None:
                raise InvalidArgument(reason)
            read_only = request.readonly or cap.access_mode.mode in capabilities.READ_ONLY
            target = self._call(
                ref.storage_node,
                lambda c: c.publish(
                    ref.backend_id,
                    node.name,
                    node.address,
                    read_only,
                    multi_writer=capabilities.is_multi_writer(cap),
                    single_node=capabilities.is_single_node(cap),
                ),
                request.secrets,
            )
        return pb.ControllerPublishVolumeResponse(publish_context=messages.publish_context(target))

    def ControllerUnpublishVolume(
        self, request: pb.ControllerUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerUnpublishVolumeResponse:
        volume_id = require(request.volume_id, "volume_id")
        ref = parse_object_id(volume_id)
        if ref is None:  # not ours (or an external share): nothing was published
            return pb.ControllerUnpublishVolumeResponse()
        self._ref(volume_id)
        if request.node_id:
            node = parse_node_id(request.node_id)
            if node is None:  # never published to a node with such an id
                return pb.ControllerUnpublishVolumeResponse()
            names = [node.name]
        else:
            v = lookups.find_volume(self.nodes, ref, request.secrets)
            names = [p.node_id for p in v.publications] if v else []
        with self.locks.hold(str(ref)):
            for name in names:
                try:
                    self._call(
                        ref.storage_node,
                        lambda c, n=name: c.unpublish(ref.backend_id, n),
                        request.secrets,
                    )
                except NotFound:
                    break  # the volume is gone: unpublished everywhere
        return pb.ControllerUnpublishVolumeResponse()

    # -- expansion, state, modification

    def ControllerExpandVolume(
        self, request: pb.ControllerExpandVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerExpandVolumeResponse:
        ref = self._ref(require(request.volume_id, "volume_id"))
        if not request.HasField("capacity_range"):
            raise InvalidArgument("capacity_range is missing")
        size, limit = requested_size(request.capacity_range)
        with self.locks.hold(str(ref)):
            v = self._volume(ref, request.secrets)
            kind = messages.VOLUME_TYPES[v.type]
            if request.HasField("volume_capability"):
                reason = capabilities.unsupported(kind, [request.volume_capability])
                if reason is not None:
                    raise InvalidArgument(reason)
            if limit and v.size_bytes > limit:
                raise OutOfRange(f"volume {ref} is already {v.size_bytes} bytes, above the limit")
            if v.size_bytes < size:
                v = self._call(
                    ref.storage_node,
                    lambda c: c.expand_volume(ref.backend_id, size),
                    request.secrets,
                )
        # A block device's size is refreshed, and its filesystem grown, on the
        # node; an NFS volume's filesystem is grown by the storage node.
        return pb.ControllerExpandVolumeResponse(
            capacity_bytes=v.size_bytes, node_expansion_required=kind == "nbd"
        )

    def ControllerGetVolume(
        self, request: pb.ControllerGetVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerGetVolumeResponse:
        ref = self._ref(require(request.volume_id, "volume_id"))
        v = self._volume(ref)
        return pb.ControllerGetVolumeResponse(
            volume=self._volume_message(ref.storage_node, v),
            status=pb.ControllerGetVolumeResponse.VolumeStatus(
                published_node_ids=messages.published_node_ids(v),
                volume_condition=messages.condition(v, self.nodes.problem(ref.storage_node)),
            ),
        )

    def ControllerModifyVolume(
        self, request: pb.ControllerModifyVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerModifyVolumeResponse:
        ref = self._ref(require(request.volume_id, "volume_id"))
        with self.locks.hold(str(ref)):
            v = self._volume(ref, request.secrets)
            changes = parameters.backend_mutable(
                messages.VOLUME_TYPES[v.type], request.mutable_parameters
            )
            if not changes:  # nothing asked to change
                return pb.ControllerModifyVolumeResponse()
            self._call(
                ref.storage_node,
                lambda c: c.modify_volume(ref.backend_id, changes),
                request.secrets,
            )
        log.info("volume %s modified: %s", ref, changes)
        return pb.ControllerModifyVolumeResponse()

    # -- snapshots

    def CreateSnapshot(
        self, request: pb.CreateSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.CreateSnapshotResponse:
        source_id = require(request.source_volume_id, "source_volume_id")
        name = backend_name(request.name, "snapshot name")
        if request.parameters:
            raise InvalidArgument(
                f"unknown snapshot parameter {sorted(request.parameters)[0][:80]!r}: "
                "snapshots take none"
            )
        ref = parse_object_id(source_id)
        if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
            raise NotFound(f"source volume {source_id[:140]!r} does not exist")
        with self.locks.hold(f"snapshot:{name}"):
            snap = self._call(
                ref.storage_node,
                lambda c: c.create_snapshot(name, ref.backend_id),
                request.secrets,
            )
        return pb.CreateSnapshotResponse(snapshot=messages.snapshot(ref.storage_node, snap))

    def DeleteSnapshot(
        self, request: pb.DeleteSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteSnapshotResponse:
        snapshot_id = require(request.snapshot_id, "snapshot_id")
        ref = parse_object_id(snapshot_id)
        if ref is None:
            return pb.DeleteSnapshotResponse()
        self._ref(snapshot_id, "snapshot")
        with self.locks.hold(f"snapshot-id:{ref}"):
            self._call(
                ref.storage_node, lambda c: c.delete_snapshot(ref.backend_id), request.secrets
            )
        return pb.DeleteSnapshotResponse()

    def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        if request.max_entries < 0:
            raise InvalidArgument("max_entries cannot be negative")

        def entry(node: str, s: bpb.Snapshot) -> pb.ListSnapshotsResponse.Entry:
            return pb.ListSnapshotsResponse.Entry(snapshot=messages.snapshot(node, s))

        if request.snapshot_id:
            ref = parse_object_id(request.snapshot_id)
            if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
                return pb.ListSnapshotsResponse()
            found = lookups.find_snapshot(self.nodes, ref, request.secrets)
            if found is None or (
                request.source_volume_id
                and f"{ref.storage_node}:{found.source_volume_id}" != request.source_volume_id
            ):
                return pb.ListSnapshotsResponse()
            return pb.ListSnapshotsResponse(entries=[entry(ref.storage_node, found)])
        if request.source_volume_id:
            src = parse_object_id(request.source_volume_id)
            if src is None or self.nodes.config.storage_node(src.storage_node) is None:
                return pb.ListSnapshotsResponse()
            names = [src.storage_node]  # a volume's snapshots live beside it

            def page(node: str, limit: int, token: str) -> tuple[list[bpb.Snapshot], str]:
                return lookups.snapshots_page(self.nodes, node, limit, token, src.backend_id)

        else:
            names = self.nodes.names

            def page(node: str, limit: int, token: str) -> tuple[list[bpb.Snapshot], str]:
                return lookups.snapshots_page(self.nodes, node, limit, token)

        entries, next_token = paginate(
            names, request.max_entries, request.starting_token, page, entry
        )
        return pb.ListSnapshotsResponse(entries=entries, next_token=next_token)

    def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.GetSnapshotResponse:
        ref = self._ref(require(request.snapshot_id, "snapshot_id"), "snapshot")
        found = lookups.find_snapshot(self.nodes, ref, request.secrets)
        if found is None:
            raise NotFound(f"snapshot {ref} does not exist")
        return pb.GetSnapshotResponse(snapshot=messages.snapshot(ref.storage_node, found))
