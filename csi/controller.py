"""The CSI Controller service: volumes, snapshots and publications on the storage nodes.

The controller keeps no state: every id names its storage node
(``csi/ids.py``), so any replica answers any call.  Each call that changes
something holds its volume, snapshot or name for its duration; a concurrent
call for the same one is ABORTED (``csi/locks.py``).  Backend errors keep
their status code (``csi/errors.py``).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import grpc
from google.protobuf import timestamp_pb2, wrappers_pb2

from backend.proto import backend_pb2 as bpb
from csi import capabilities, parameters, topology
from csi.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)
from csi.ids import MAX_ID_BYTES, ObjectRef, parse_node_id, parse_object_id
from csi.locks import OperationLocks
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.storagenodes import StorageNodes

log = logging.getLogger("moorage.csi.controller")

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_SIZE = GIB
MIN_SIZE = MIB
MAX_SIZE = 64 << 40  # the storage node's own maximum
MAX_NAME_BYTES = 256
MAX_PAGE = 1000
_BACKEND_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
NAME_LABEL = "csi.moorage.dev/name"
_TYPE = {bpb.NBD: "nbd", bpb.NFS: "nfs"}
_TYPE_PB = {"nbd": bpb.NBD, "nfs": bpb.NFS}

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


# ------------------------------------------------------------- helpers


def backend_name(name: str, what: str = "name") -> str:
    """The storage node's name for a CSI name: itself when it fits the storage
    node's alphabet, else a digest of it (the same for every replica)."""
    if not name:
        raise InvalidArgument(f"{what} is empty")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidArgument(f"{what} is longer than {MAX_NAME_BYTES} bytes")
    if _BACKEND_NAME.match(name) and ".." not in name:
        return name
    return "csi-" + hashlib.sha256(name.encode()).hexdigest()[:60]


def requested_size(cr: pb.CapacityRange | None) -> tuple[int, int]:
    """(size to give, limit) for a capacity range; limit 0 is none."""
    required = cr.required_bytes if cr is not None else 0
    limit = cr.limit_bytes if cr is not None else 0
    if required < 0 or limit < 0:
        raise InvalidArgument("capacity_range bytes cannot be negative")
    if limit and required > limit:
        raise InvalidArgument(f"required_bytes {required} is above limit_bytes {limit}")
    size = required or min(DEFAULT_SIZE, limit or DEFAULT_SIZE)
    size = max(MIN_SIZE, -(-size // MIB) * MIB)  # the storage node's whole MiB
    if limit and size > limit:
        size = limit // MIB * MIB
        if size < max(required, MIN_SIZE):
            raise OutOfRange(
                f"no whole-MiB size of at least {max(required, MIN_SIZE)} bytes fits under "
                f"limit_bytes {limit}"
            )
    if size > MAX_SIZE:
        raise OutOfRange(f"{size} bytes is above the maximum volume size {MAX_SIZE}")
    return size, limit


def _require(value: str, what: str) -> str:
    if not value:
        raise InvalidArgument(f"{what} is missing")
    if len(value.encode()) > MAX_ID_BYTES * 2:
        raise InvalidArgument(f"{what} is longer than {MAX_ID_BYTES * 2} bytes")
    return value


def _timestamp(unix: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=unix)


class _Page:
    """A listing token: the storage node to go on with and its own token there."""

    @staticmethod
    def parse(token: str, names: Sequence[str]) -> tuple[int, str]:
        if not token:
            return 0, ""
        node, sep, rest = token.partition("/")
        if not sep or node not in names or (rest and not re.fullmatch(r"[0-9a-f]{32}", rest)):
            raise Aborted(f"starting_token {token[:80]!r} is not one this plugin gave out")
        return names.index(node), rest

    @staticmethod
    def make(node: str, backend_token: str) -> str:
        return f"{node}/{backend_token}"


# ------------------------------------------------------------ the service


class ControllerService(pb_grpc.ControllerServicer):
    def __init__(self, storage_nodes: StorageNodes) -> None:
        self.nodes = storage_nodes
        self.locks = OperationLocks()

    # -- shared pieces

    def _ref(self, value: str, what: str = "volume") -> ObjectRef:
        ref = parse_object_id(value)
        if ref is None:
            raise NotFound(f"{what} {value[:140]!r} is not a moorage {what} id")
        self.nodes.get(ref.storage_node)  # NOT_FOUND when not configured
        return ref

    def _call(self, node: str, fn: Callable[..., T], secrets: Mapping[str, str] | None = None) -> T:
        return self.nodes.call(node, fn, secrets)

    def _find_volume(
        self, ref: ObjectRef, secrets: Mapping[str, str] | None = None
    ) -> bpb.Volume | None:
        try:
            v: bpb.Volume = self._call(
                ref.storage_node, lambda c: c.get_volume(volume_id=ref.backend_id), secrets
            )
            return v
        except NotFound:
            return None

    def _volume(self, ref: ObjectRef, secrets: Mapping[str, str] | None = None) -> bpb.Volume:
        v = self._find_volume(ref, secrets)
        if v is None:
            raise NotFound(f"volume {ref} does not exist")
        return v

    def _csi_volume(self, node: str, v: bpb.Volume) -> pb.Volume:
        kind = _TYPE[v.type]
        context = {"type": kind, "storageNode": node}
        if kind == "nfs":
            context["nfsFsType"] = v.fs_type
        source = None
        if v.source_snapshot_id:
            source = pb.VolumeContentSource(
                snapshot=pb.VolumeContentSource.SnapshotSource(
                    snapshot_id=f"{node}:{v.source_snapshot_id}"
                )
            )
        elif v.source_volume_id:
            source = pb.VolumeContentSource(
                volume=pb.VolumeContentSource.VolumeSource(volume_id=f"{node}:{v.source_volume_id}")
            )
        return pb.Volume(
            volume_id=f"{node}:{v.id}",
            capacity_bytes=v.size_bytes,
            volume_context=context,
            content_source=source,
            accessible_topology=topology.accessible(self.nodes.get(node)),
        )

    @staticmethod
    def _condition(v: bpb.Volume) -> pb.VolumeCondition:
        if v.state in ("ready", "expanding"):
            return pb.VolumeCondition(abnormal=False, message=f"volume is {v.state}")
        return pb.VolumeCondition(
            abnormal=True, message=f"volume is {v.state} on its storage node, not ready"
        )

    @staticmethod
    def _published_node_ids(v: bpb.Volume) -> list[str]:
        return [f"{p.node_id}@{p.node_address}" for p in v.publications]

    def _csi_snapshot(self, node: str, s: bpb.Snapshot) -> pb.Snapshot:
        return pb.Snapshot(
            size_bytes=s.size_bytes,
            snapshot_id=f"{node}:{s.id}",
            source_volume_id=f"{node}:{s.source_volume_id}",
            creation_time=_timestamp(s.created_unix),
            ready_to_use=s.ready_to_use,
        )

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
        source_ref, source_kind = self._content_source(request)
        secrets = request.secrets
        labels = dict(params.labels)
        if name != request.name:
            labels[NAME_LABEL] = request.name[:512]
        with self.locks.hold(f"name:{name}"):
            found = self._existing(name, secrets)
            if found is not None:
                node, v = found
                self._check_same(v, kind, size, limit, create_params, source_ref, source_kind)
                if v.state != "ready":  # a create a crash interrupted: finish it
                    v = self._create_on(
                        node, name, kind, v.size_bytes, create_params, source_ref,
                        source_kind, labels, secrets,
                    )  # fmt: skip
                return pb.CreateVolumeResponse(volume=self._csi_volume(node, v))
            failures: list[str] = []
            order = self._placement(request, params, source_ref, size, secrets, failures)
            for node in order:
                try:
                    v = self._create_on(
                        node, name, kind, size, create_params, source_ref, source_kind,
                        labels, secrets,
                    )  # fmt: skip
                except (Unavailable, ResourceExhausted) as e:
                    failures.append(e.message)
                    continue
                log.info("volume %s:%s (%s) created for %s", node, v.id, kind, request.name)
                return pb.CreateVolumeResponse(volume=self._csi_volume(node, v))
            raise ResourceExhausted(
                f"no storage node could create a {size}-byte {kind} volume: " + "; ".join(failures)
            )

    def _content_source(self, request: pb.CreateVolumeRequest) -> tuple[ObjectRef | None, str]:
        if not request.HasField("volume_content_source"):
            return None, ""
        src = request.volume_content_source
        which = src.WhichOneof("type")
        if which == "snapshot":
            sid = src.snapshot.snapshot_id
            ref = parse_object_id(sid)
            if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
                raise NotFound(f"snapshot {sid[:140]!r} does not exist")
            return ref, "snapshot"
        if which == "volume":
            vid = src.volume.volume_id
            ref = parse_object_id(vid)
            if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
                raise NotFound(f"volume {vid[:140]!r} does not exist")
            return ref, "volume"
        raise InvalidArgument("volume_content_source has neither a snapshot nor a volume")

    def _existing(self, name: str, secrets: Mapping[str, str]) -> tuple[str, bpb.Volume] | None:
        """The volume of that name on any storage node.  Every storage node is
        asked: one that cannot answer might hold it, so that is UNAVAILABLE
        rather than a risk of two volumes for one name."""
        for node in self.nodes.names:
            try:
                v = self._call(node, lambda c: c.get_volume(name=name), secrets)
            except NotFound:
                continue
            return node, v
        return None

    @staticmethod
    def _check_same(
        v: bpb.Volume,
        kind: str,
        size: int,
        limit: int,
        params: Mapping[str, str],
        source: ObjectRef | None,
        source_kind: str,
    ) -> None:
        problems = []
        if _TYPE[v.type] != kind:
            problems.append(f"it is an {_TYPE[v.type]} volume")
        if v.size_bytes < size or (limit and v.size_bytes > limit):
            problems.append(f"its size is {v.size_bytes} bytes")
        if dict(v.parameters) != dict(params):
            problems.append("its parameters differ")
        want_snap = source.backend_id if source and source_kind == "snapshot" else ""
        want_vol = source.backend_id if source and source_kind == "volume" else ""
        if v.source_snapshot_id != want_snap or v.source_volume_id != want_vol:
            problems.append("its content source differs")
        if problems:
            raise AlreadyExists(f"a volume named {v.name!r} exists but " + ", ".join(problems))

    def _placement(
        self,
        request: pb.CreateVolumeRequest,
        params: parameters.VolumeParameters,
        source: ObjectRef | None,
        size: int,
        secrets: Mapping[str, str],
        failures: list[str],
    ) -> list[str]:
        """Storage nodes to try, best first: allowed by the topology, the
        ``storageNode`` parameter and the content source; preferred segments
        first, then the most available capacity."""
        requirement = (
            request.accessibility_requirements
            if request.HasField("accessibility_requirements")
            else None
        )
        allowed = topology.candidates(self.nodes.config.storage_nodes, requirement)
        if params.storage_node is not None:
            self.nodes.get(params.storage_node)
            allowed = [n for n in allowed if n.name == params.storage_node]
        if source is not None:  # a clone lives beside its source
            allowed = [n for n in allowed if n.name == source.storage_node]
        if not allowed:
            raise ResourceExhausted(
                "no configured storage node satisfies the topology requirement"
                + (f", storageNode {params.storage_node}" if params.storage_node else "")
                + (f" and the content source on {source.storage_node}" if source else "")
            )
        preferred = [dict(t.segments) for t in (requirement.preferred if requirement else [])]
        scored: list[tuple[int, int, int, str]] = []
        for index, node in enumerate(allowed):
            rank = next(
                (i for i, seg in enumerate(preferred) if topology.allows(seg, node)),
                len(preferred),
            )
            try:
                available = self._call(node.name, lambda c: c.capacity(), secrets).available_bytes
            except Unavailable as e:
                failures.append(e.message)
                continue
            if available < size:
                failures.append(f"storage node {node.name} has {available} bytes available")
                continue
            scored.append((rank, -available, index, node.name))
        return [name for *_, name in sorted(scored)]

    def _create_on(
        self,
        node: str,
        name: str,
        kind: str,
        size: int,
        params: Mapping[str, str],
        source: ObjectRef | None,
        source_kind: str,
        labels: Mapping[str, str],
        secrets: Mapping[str, str],
    ) -> bpb.Volume:
        req = bpb.CreateVolumeRequest(
            name=name, type=_TYPE_PB[kind], size_bytes=size, parameters=params, labels=labels
        )
        if source is not None:
            if source_kind == "snapshot":
                req.snapshot_id = source.backend_id
            else:
                req.volume_id = source.backend_id
        v: bpb.Volume = self._call(node, lambda c: c.create_volume(req), secrets)
        return v

    def DeleteVolume(
        self, request: pb.DeleteVolumeRequest, context: grpc.ServicerContext
    ) -> pb.DeleteVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
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
        ref = self._ref(_require(request.volume_id, "volume_id"))
        capabilities.check_present(request.volume_capabilities)
        v = self._volume(ref, request.secrets)
        kind = _TYPE[v.type]
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
        entries: list[pb.ListVolumesResponse.Entry] = []

        def page(node: str, limit: int, token: str) -> tuple[list[bpb.Volume], str]:
            r = self._call(node, lambda c: c.list_volumes(limit, token))
            return list(r.volumes), r.next_token

        def entry(node: str, v: bpb.Volume) -> pb.ListVolumesResponse.Entry:
            return pb.ListVolumesResponse.Entry(
                volume=self._csi_volume(node, v),
                status=pb.ListVolumesResponse.VolumeStatus(
                    published_node_ids=self._published_node_ids(v),
                    volume_condition=self._condition(v),
                ),
            )

        next_token = self._paginate(
            request.max_entries, request.starting_token, page, entry, entries
        )
        return pb.ListVolumesResponse(entries=entries, next_token=next_token)

    def _paginate(
        self,
        max_entries: int,
        starting_token: str,
        page: Callable[[str, int, str], tuple[list[T], str]],
        convert: Callable[[str, T], object],
        out: list,  # type: ignore[type-arg]
    ) -> str:
        """Walk the storage nodes in configuration order from the token's place."""
        names = self.nodes.names
        index, token = _Page.parse(starting_token, names)
        want = max_entries or None
        while index < len(names):
            node = names[index]
            limit = MAX_PAGE if want is None else min(MAX_PAGE, want - len(out))
            items, token = page(node, limit, token)
            out.extend(convert(node, item) for item in items)
            if token:
                if want is not None and len(out) >= want:
                    return _Page.make(node, token)
                continue
            index += 1
            if want is not None and len(out) >= want and index < len(names):
                return _Page.make(names[index], "")
        return ""

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
            maximum_volume_size=_wrap(min(largest, MAX_SIZE)),
            minimum_volume_size=_wrap(MIN_SIZE),
        )

    # -- publications

    def ControllerPublishVolume(
        self, request: pb.ControllerPublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerPublishVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
        node_id = _require(request.node_id, "node_id")
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is missing")
        cap = request.volume_capability
        capabilities.check_present([cap])
        external = _external_share(request.volume_context)
        if external is not None:
            return pb.ControllerPublishVolumeResponse(publish_context=external)
        ref = self._ref(volume_id)
        node = parse_node_id(node_id)
        if node is None:
            raise NotFound(
                f"node {node_id[:140]!r} is unknown: a moorage node id is NAME@ADDRESS, as the "
                "node plugin reports it in NodeGetInfo"
            )
        with self.locks.hold(str(ref)):
            v = self._volume(ref, request.secrets)
            kind = _TYPE[v.type]
            reason = capabilities.unsupported(kind, [cap])
            if reason is not None:
                raise InvalidArgument(reason)
            others = [p.node_id for p in v.publications if p.node_id != node.name]
            if others and capabilities.is_single_node(cap):
                raise FailedPrecondition(
                    f"volume {ref} is single-node and already published to {others[0]}"
                )
            read_only = request.readonly or cap.access_mode.mode in capabilities.READ_ONLY
            target = self._call(
                ref.storage_node,
                lambda c: c.publish(
                    ref.backend_id,
                    node.name,
                    node.address,
                    read_only,
                    multi_writer=capabilities.is_multi_writer(cap),
                ),
                request.secrets,
            )
        return pb.ControllerPublishVolumeResponse(publish_context=_publish_context(target))

    def ControllerUnpublishVolume(
        self, request: pb.ControllerUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerUnpublishVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
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
            v = self._find_volume(ref, request.secrets)
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
        ref = self._ref(_require(request.volume_id, "volume_id"))
        if not request.HasField("capacity_range"):
            raise InvalidArgument("capacity_range is missing")
        size, limit = requested_size(request.capacity_range)
        with self.locks.hold(str(ref)):
            v = self._volume(ref, request.secrets)
            kind = _TYPE[v.type]
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
        ref = self._ref(_require(request.volume_id, "volume_id"))
        v = self._volume(ref)
        return pb.ControllerGetVolumeResponse(
            volume=self._csi_volume(ref.storage_node, v),
            status=pb.ControllerGetVolumeResponse.VolumeStatus(
                published_node_ids=self._published_node_ids(v),
                volume_condition=self._condition(v),
            ),
        )

    def ControllerModifyVolume(
        self, request: pb.ControllerModifyVolumeRequest, context: grpc.ServicerContext
    ) -> pb.ControllerModifyVolumeResponse:
        ref = self._ref(_require(request.volume_id, "volume_id"))
        with self.locks.hold(str(ref)):
            v = self._volume(ref, request.secrets)
            changes = parameters.backend_mutable(_TYPE[v.type], request.mutable_parameters)
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
        source_id = _require(request.source_volume_id, "source_volume_id")
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
        return pb.CreateSnapshotResponse(snapshot=self._csi_snapshot(ref.storage_node, snap))

    def DeleteSnapshot(
        self, request: pb.DeleteSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteSnapshotResponse:
        snapshot_id = _require(request.snapshot_id, "snapshot_id")
        ref = parse_object_id(snapshot_id)
        if ref is None:
            return pb.DeleteSnapshotResponse()
        self._ref(snapshot_id, "snapshot")
        with self.locks.hold(f"snapshot-id:{ref}"):
            self._call(
                ref.storage_node, lambda c: c.delete_snapshot(ref.backend_id), request.secrets
            )
        return pb.DeleteSnapshotResponse()

    def _snapshots_page(
        self, node: str, limit: int, token: str, source: str = ""
    ) -> tuple[list[bpb.Snapshot], str]:
        r = self._call(node, lambda c: c.list_snapshots(limit, token, source_volume_id=source))
        return list(r.snapshots), r.next_token

    def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        if request.max_entries < 0:
            raise InvalidArgument("max_entries cannot be negative")

        def entry(node: str, s: bpb.Snapshot) -> pb.ListSnapshotsResponse.Entry:
            return pb.ListSnapshotsResponse.Entry(snapshot=self._csi_snapshot(node, s))

        if request.snapshot_id:
            ref = parse_object_id(request.snapshot_id)
            if ref is None or self.nodes.config.storage_node(ref.storage_node) is None:
                return pb.ListSnapshotsResponse()
            found = self._find_snapshot(ref, request.secrets)
            if found is None or (
                request.source_volume_id
                and f"{ref.storage_node}:{found.source_volume_id}" != request.source_volume_id
            ):
                return pb.ListSnapshotsResponse()
            return pb.ListSnapshotsResponse(entries=[entry(ref.storage_node, found)])
        entries: list[pb.ListSnapshotsResponse.Entry] = []
        if request.source_volume_id:
            src = parse_object_id(request.source_volume_id)
            if src is None or self.nodes.config.storage_node(src.storage_node) is None:
                return pb.ListSnapshotsResponse()
            _, token = _Page.parse(request.starting_token, [src.storage_node])
            snaps, next_backend = self._snapshots_page(
                src.storage_node, request.max_entries or MAX_PAGE, token, src.backend_id
            )
            entries = [entry(src.storage_node, s) for s in snaps]
            next_token = _Page.make(src.storage_node, next_backend) if next_backend else ""
            return pb.ListSnapshotsResponse(entries=entries, next_token=next_token)
        next_token = self._paginate(
            request.max_entries,
            request.starting_token,
            lambda node, limit, token: self._snapshots_page(node, limit, token),
            entry,
            entries,
        )
        return pb.ListSnapshotsResponse(entries=entries, next_token=next_token)

    def _find_snapshot(
        self, ref: ObjectRef, secrets: Mapping[str, str] | None = None
    ) -> bpb.Snapshot | None:
        r = self._call(
            ref.storage_node, lambda c: c.list_snapshots(snapshot_id=ref.backend_id), secrets
        )
        return r.snapshots[0] if r.snapshots else None

    def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.GetSnapshotResponse:
        ref = self._ref(_require(request.snapshot_id, "snapshot_id"), "snapshot")
        found = self._find_snapshot(ref, request.secrets)
        if found is None:
            raise NotFound(f"snapshot {ref} does not exist")
        return pb.GetSnapshotResponse(snapshot=self._csi_snapshot(ref.storage_node, found))


# ---------------------------------------------------------------- contexts


def _wrap(value: int) -> wrappers_pb2.Int64Value:
    return wrappers_pb2.Int64Value(value=value)


def _external_share(context: Mapping[str, str]) -> dict[str, str] | None:
    """A static PV naming an NFS share outside moorage (``server`` and ``share``
    in its volumeAttributes, as for nfs.csi.k8s.io): nothing to publish."""
    if "server" not in context and "share" not in context:
        return None
    server, share = context.get("server", ""), context.get("share", "")
    if not server or not share.startswith("/"):
        raise InvalidArgument(
            "an external NFS share needs volumeAttributes server and share (an absolute path)"
        )
    return {"type": "nfs-external", "server": server, "exportPath": share}


def _publish_context(target: bpb.PublishVolumeResponse) -> dict[str, str]:
    if target.WhichOneof("target") == "nbd":
        t = target.nbd
        return {
            "type": "nbd",
            "host": t.host,
            "port": str(t.port),
            "exportName": t.export_name,
            "tls": "true" if t.tls else "false",
        }
    n = target.nfs
    return {
        "type": "nfs",
        "server": n.server,
        "port": str(n.port),
        "exportPath": n.export_path,
        "mountPort": str(n.mount_port),
    }
