"""The CSI Node service: what this node is, and (next) attach, stage and publish.

This part answers NodeGetInfo, NodeGetCapabilities and NodeUnpublishVolume.
Stage, publish, stats and expand are not built yet: they answer
UNIMPLEMENTED, and NodeGetCapabilities claims none of them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from csi import mounts
from csi.config import NODE_TOPOLOGY_KEY, NodeConfig
from csi.errors import FailedPrecondition, Internal, InvalidArgument
from csi.ids import node_id
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc

log = logging.getLogger("moorage.csi.node")


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, name: str, address: str, config: NodeConfig) -> None:
        self.node_id = node_id(name, address)  # ValueError for a bad name or address
        self.name = name
        self.topology = {**config.topology, NODE_TOPOLOGY_KEY: name}

    def NodeGetInfo(
        self, request: pb.NodeGetInfoRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(
            node_id=self.node_id,
            accessible_topology=pb.Topology(segments=self.topology),
        )

    def NodeGetCapabilities(
        self, request: pb.NodeGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetCapabilitiesResponse:
        return pb.NodeGetCapabilitiesResponse(capabilities=[])

    def NodeUnpublishVolume(
        self, request: pb.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnpublishVolumeResponse:
        """Undo a publish: unmount the pod's target and remove it.  A target that
        is not mounted (never published, or already unpublished) is success."""
        if not request.volume_id:
            raise InvalidArgument("volume_id is missing")
        target = _absolute(request.target_path, "target_path")
        try:
            mounts.unmount(target)
        except mounts.MountError as e:
            raise Internal(f"cannot unmount {target}: {e}") from e
        try:
            if target.is_dir() and not target.is_symlink():
                target.rmdir()
            else:
                target.unlink(missing_ok=True)
        except OSError as e:
            raise FailedPrecondition(f"cannot remove {target}: {e.strerror}") from e
        log.info("volume %s unpublished from %s", request.volume_id, target)
        return pb.NodeUnpublishVolumeResponse()


def _absolute(value: str, what: str) -> Path:
    if not value:
        raise InvalidArgument(f"{what} is missing")
    path = Path(value)
    if not path.is_absolute() or "\0" in value or len(value.encode()) > 4096:
        raise InvalidArgument(f"{what} {value[:140]!r} is not an absolute path")
    return path
