"""kubelet plugin registration, served by the node plugin itself.

kubelet watches its ``plugins_registry`` directory for unix sockets. On
``csi.moorage.dev-reg.sock`` it calls GetInfo (Kubernetes' pluginregistration
v1 API, ``csi/proto/pluginregistration.proto``), learns the driver's name and
the CSI socket's path on the host, and answers with NotifyRegistrationStatus.
node-driver-registrar does this beside other CSI drivers; ``moorage csi serve
--registration-dir`` does it in the plugin, for nodes that cannot run that
image.

The socket is bound inside a fresh 0700 directory whose name starts with a
dot (kubelet ignores those), made 0600, served, and only then renamed into
place: kubelet never sees a socket that does not answer yet, and no one else
can reach it meanwhile. A refusal from kubelet is logged as an error and
stops the plugin with a non-zero status, as the registrar does: the
container restarts, its new socket appears, and kubelet tries again.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from csi.proto import pluginregistration_pb2 as reg
from csi.proto import pluginregistration_pb2_grpc as reg_grpc
from csi.server import DRIVER_NAME, EndpointError, claim_socket, stop_grpc

log = logging.getLogger("moorage.csi.registration")

PLUGIN_TYPE = "CSIPlugin"
# The CSI versions kubelet may speak to us; it needs a 1.x among them.
SUPPORTED_VERSIONS = ("1.0.0",)
_STAGING_PREFIX = ".moorage-reg-"
_MAX_SOCKET_PATH = 107  # bytes in a unix socket address, less the NUL


def registration_socket(directory: Path) -> Path:
    """Where kubelet looks for this driver's registration socket."""
    return directory / f"{DRIVER_NAME}-reg.sock"


def kubelet_endpoint(path: str) -> str:
    """The CSI socket's path on the host, as kubelet will dial it: an absolute path."""
    if not path.startswith("/") or path == "/":
        raise EndpointError(f"--kubelet-registration-path {path[:80]!r} is not an absolute path")
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise EndpointError(f"--kubelet-registration-path {path[:80]!r}... is too long")
    return path


class RegistrationService(reg_grpc.RegistrationServicer):
    """Tells kubelet who the plugin is; ``on_refused`` hears kubelet's refusal."""

    def __init__(self, kubelet_path: str, on_refused: Callable[[str], None]) -> None:
        self.kubelet_path = kubelet_path
        self.on_refused = on_refused

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        log.info("kubelet asked who we are: %s at %s", DRIVER_NAME, self.kubelet_path)
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER_NAME,
            endpoint=self.kubelet_path,
            supported_versions=SUPPORTED_VERSIONS,
        )

    def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("kubelet registered %s", DRIVER_NAME)
        else:
            reason = request.error or "(kubelet gave no reason)"
            log.error("kubelet refused to register %s: %s", DRIVER_NAME, reason)
            self.on_refused(reason)
        return reg.RegistrationStatusResponse()


@dataclass
class RunningRegistration:
    server: grpc.Server
    workers: futures.ThreadPoolExecutor
    path: Path

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving and remove the socket: kubelet then forgets the driver."""
        stop_grpc(self.server, self.workers, grace)
        self.path.unlink(missing_ok=True)


def serve_registration(directory: Path, service: RegistrationService) -> RunningRegistration:
    """Serve ``service`` on ``DIRECTORY/csi.moorage.dev-reg.sock``.

    A stale socket there is replaced; one another process still serves is
    refused (EndpointError), as is any other file.
    """
    path = registration_socket(directory)
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise EndpointError(f"socket path {path} is longer than a unix socket address allows")
    claim_socket(path)
    for leftover in directory.glob(_STAGING_PREFIX + "*"):  # a start killed half way
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=directory))
    workers = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="registration")
    server = grpc.server(workers)
    reg_grpc.add_RegistrationServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    try:
        bound = staging / "s"
        if server.add_insecure_port(f"unix://{bound}") == 0:
            raise EndpointError(f"cannot listen on {bound}")
        bound.chmod(0o600)
        server.start()
        bound.rename(path)
    except BaseException:
        stop_grpc(server, workers, 0)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rmdir()
    log.info("kubelet registration socket %s", path)
    return RunningRegistration(server, workers, path)
