"""The CSI Identity service: who the plugin is, what it offers, whether it is ready.

Probe answers for this process only: it is ready once the gRPC server
answers and each of its readiness checks passes (the node plugin's state
directory is usable).  It never calls a storage node: kubelet restarts a
container whose liveness probe fails, and one storage node that is down
must not restart every controller replica.  Storage-node health is
checked in the background instead, and goes to metrics and volume
conditions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import grpc
from google.protobuf import wrappers_pb2

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.server import DRIVER_NAME

PluginCap = pb.PluginCapability
# Trailing metadata of a Probe that is not ready: one entry per reason.
NOT_READY_METADATA = "moorage-not-ready"
log = logging.getLogger("moorage.csi.identity")

# A check of this process's own readiness: why it is not ready, or None.
ReadinessCheck = Callable[[], str | None]


def directory_usable(path: Path, what: str) -> ReadinessCheck:
    """Ready while ``path`` is a directory this process can write in.

    ``os.access`` asks the kernel, which answers EROFS on a read-only mount
    even to root; nothing is written.
    """

    def check() -> str | None:
        if not path.is_dir():
            return f"{what} {path} is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{what} {path} is not writable"
        return None

    return check


def plugin_version() -> str:
    try:
        return metadata.version("moorage")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare tree
        return "0.0.0"


class IdentityService(pb_grpc.IdentityServicer):
    def __init__(self, controller: bool, checks: Sequence[ReadinessCheck] = ()) -> None:
        """``controller``: this process serves the Controller and GroupController services."""
        self.controller = controller
        self.checks = tuple(checks)

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
        if self.controller:
            caps = [
                PluginCap(service=PluginCap.Service(type=PluginCap.Service.CONTROLLER_SERVICE)),
                PluginCap(
                    service=PluginCap.Service(
                        type=PluginCap.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS
                    )
                ),
                PluginCap(
                    service=PluginCap.Service(type=PluginCap.Service.GROUP_CONTROLLER_SERVICE)
                ),
                *caps,
            ]
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        """Ready when every readiness check of this process passes.

        The spec's Probe has no message field: a failed check's reason is in
        the response's trailing metadata and in the log.
        """
        problems = [p for p in (check() for check in self.checks) if p is not None]
        for problem in problems:
            log.warning("not ready: %s", problem)
        if problems:
            context.set_trailing_metadata(tuple((NOT_READY_METADATA, p[:500]) for p in problems))
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=not problems))
