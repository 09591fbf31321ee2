"""The CSI Identity service: who the plugin is, what it offers, whether it is ready."""

from __future__ import annotations

import logging
from importlib import metadata

import grpc
from google.protobuf import wrappers_pb2

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.server import DRIVER_NAME
from csi.storagenodes import StorageNodes

PluginCap = pb.PluginCapability
# Trailing metadata of a Probe that is not ready: one entry per reason.
NOT_READY_METADATA = "moorage-not-ready"
log = logging.getLogger("moorage.csi.identity")


def plugin_version() -> str:
    try:
        return metadata.version("moorage")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare tree
        return "0.0.0"


class IdentityService(pb_grpc.IdentityServicer):
    def __init__(self, storage_nodes: StorageNodes | None) -> None:
        """``storage_nodes`` is None where this plugin drives none (node mode)."""
        self.storage_nodes = storage_nodes

    def GetPluginInfo(
        self, request: pb.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=plugin_version())

    def GetPluginCapabilities(
        self, request: pb.GetPluginCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GetPluginCapabilitiesResponse:
        caps = [
            PluginCap(
                volume_expansion=PluginCap.VolumeExpansion(type=PluginCap.VolumeExpansion.ONLINE)
            )
        ]
        if self.storage_nodes is not None:
            caps = [
                PluginCap(service=PluginCap.Service(type=PluginCap.Service.CONTROLLER_SERVICE)),
                PluginCap(
                    service=PluginCap.Service(
                        type=PluginCap.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS
                    )
                ),
                *caps,
            ]
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        """Ready when every configured storage node answers its Health call.

        The spec's Probe has no message field: a storage node that does not
        answer is named in the response's trailing metadata and in the log.
        """
        if self.storage_nodes is None:
            return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))
        down = [
            h for h in (self.storage_nodes.health(n) for n in self.storage_nodes.names) if not h.ok
        ]
        for h in down:
            log.warning("not ready: %s", h.message)
        if down:
            context.set_trailing_metadata(
                tuple((NOT_READY_METADATA, h.message[:500]) for h in down)
            )
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=not down))
