"""CreateVolume's decisions: where a new volume goes, and whether an existing one answers.

The content source a request names, the one storage node when a request
leaves no choice, the order to try storage nodes in (topology, then free
capacity), the check that a volume already of that name is the one asked
for, and the storage node's create call itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from backend.api.proto import backend_pb2 as bpb
from csi import messages, parameters, topology
from csi.config import PluginConfig
from csi.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from csi.ids import ObjectRef, parse_object_id
from csi.proto import csi_pb2 as pb
from csi.storagenodes import StorageNodes


def sole_storage_node(
    config: PluginConfig,
    request: pb.CreateVolumeRequest,
    params: parameters.VolumeParameters,
    source: ObjectRef | None,
) -> str | None:
    """The storage node, when only one is configured and the request allows it."""
    if len(config.storage_nodes) != 1:
        return None
    requirement = (
        request.accessibility_requirements
        if request.HasField("accessibility_requirements")
        else None
    )
    allowed = topology.candidates(config.storage_nodes, requirement)
    if len(allowed) != 1:
        return None
    name = allowed[0].name
    wanted = {params.storage_node, source.storage_node if source else None} - {None}
    return name if wanted <= {name} else None


def content_source(
    config: PluginConfig, request: pb.CreateVolumeRequest
) -> tuple[ObjectRef | None, str]:
    if not request.HasField("volume_content_source"):
        return None, ""
    src = request.volume_content_source
    which = src.WhichOneof("type")
    if which == "snapshot":
        sid = src.snapshot.snapshot_id
        ref = parse_object_id(sid)
        if ref is None or config.storage_node(ref.storage_node) is None:
            raise NotFound(f"snapshot {sid[:140]!r} does not exist")
        return ref, "snapshot"
    if which == "volume":
        vid = src.volume.volume_id
        ref = parse_object_id(vid)
        if ref is None or config.storage_node(ref.storage_node) is None:
            raise NotFound(f"volume {vid[:140]!r} does not exist")
        return ref, "volume"
    raise InvalidArgument("volume_content_source has neither a snapshot nor a volume")


def check_same(
    v: bpb.Volume,
    kind: str,
    size: int,
    limit: int,
    params: Mapping[str, str],
    source: ObjectRef | None,
    source_kind: str,
) -> None:
    problems = []
    if messages.VOLUME_TYPES[v.type] != kind:
        problems.append(f"it is an {messages.VOLUME_TYPES[v.type]} volume")
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


def placement(
    nodes: StorageNodes,
    request: pb.CreateVolumeRequest,
    params: parameters.VolumeParameters,
    source: ObjectRef | None,
    size: int,
    secrets: Mapping[str, str],
    failures: list[str],
) -> list[str]:
    requirement = (
        request.accessibility_requirements
        if request.HasField("accessibility_requirements")
        else None
    )
    if params.storage_node is not None:
        nodes.get(params.storage_node)  # NOT_FOUND when not configured
    pinned = source.storage_node if source is not None else params.storage_node
    if source is not None and params.storage_node not in (None, source.storage_node):
        raise ResourceExhausted(
            f"storageNode {params.storage_node} is not {source.storage_node}, where the "
            "content source is"
        )

    def available(node: str) -> int:
        return int(nodes.call(node, lambda c: c.capacity(), secrets).available_bytes)

    return topology.place(
        nodes.config.storage_nodes, requirement, pinned, size, available, failures
    )


def create_on(
    nodes: StorageNodes,
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
        name=name,
        type=messages.BACKEND_TYPES[kind],
        size_bytes=size,
        parameters=params,
        labels=labels,
    )
    if source is not None:
        if source_kind == "snapshot":
            req.snapshot_id = source.backend_id
        else:
            req.volume_id = source.backend_id
    v: bpb.Volume = nodes.call(node, lambda c: c.create_volume(req), secrets)
    return v
