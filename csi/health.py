"""``GET /healthz`` over HTTP: the plugin's own liveness endpoint.

The livenessprobe sidecar answers kubelet's livenessProbe by calling the CSI
Probe on the plugin's socket. ``moorage csi serve --health-address`` does the
same from inside the plugin, for pods that run without that image: each
request makes a real Probe call on the plugin's own socket, so it proves the
gRPC server answers, and reports what Identity.Probe decides. 200 ``ok``
when ready; 500 and the reason when not ready or when the call fails; 404
for any other path.

Its own server rather than a path on the metrics server: the chart keeps
probe and metrics ports apart (as the sidecars have them), and
prometheus-client's server answers metrics on every path.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc

from csi.identity import NOT_READY_METADATA
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.server import host_port

log = logging.getLogger("moorage.csi.health")

HEALTH_PATH = "/healthz"
# A Probe answers from this process alone (csi/identity.py), at once; the
# bound stays under the chart's livenessProbe timeoutSeconds (5), so that a
# plugin too busy to answer gets a 500 with the reason, not a kubelet timeout.
PROBE_TIMEOUT = 4.0


@dataclass(frozen=True)
class ProbeResult:
    ready: bool
    reason: str


def probe(channel: grpc.Channel, timeout: float = PROBE_TIMEOUT) -> ProbeResult:
    """The CSI Probe on ``channel``: ready, or why not."""
    stub = pb_grpc.IdentityStub(channel)  # type: ignore[no-untyped-call]
    try:
        response, call = stub.Probe.with_call(pb.ProbeRequest(), timeout=timeout)
    except grpc.RpcError as e:
        return ProbeResult(False, f"Probe failed: {e.code().name}: {e.details()}")
    # the spec: a response without `ready` means ready
    if not response.HasField("ready") or response.ready.value:
        return ProbeResult(True, "ok")
    reasons = [str(v) for k, v in call.trailing_metadata() or () if k == NOT_READY_METADATA]
    return ProbeResult(False, "not ready: " + ("; ".join(reasons) or "Probe said so"))


class _HealthHTTPServer(ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], channel: grpc.Channel) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.channel = channel
        super().__init__(address, _HealthHandler)


class _HealthHandler(BaseHTTPRequestHandler):
    server: _HealthHTTPServer

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != HEALTH_PATH:
            self._reply(404, "not found")
            return
        result = probe(self.server.channel)
        if not result.ready:
            log.warning("healthz: %s", result.reason)
        self._reply(200 if result.ready else 500, result.reason)

    def _reply(self, status: int, text: str) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("healthz %s: " + format, self.client_address[0], *args)


@dataclass
class HealthServer:
    http: _HealthHTTPServer
    thread: threading.Thread

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(5)
        self.http.channel.close()


def start_health(address: str, endpoint: str) -> HealthServer:
    """Serve ``/healthz`` on ``address`` (HOST:PORT), probing the plugin at ``endpoint``."""
    host, port = host_port(address, "health address")
    channel = grpc.insecure_channel(endpoint)
    try:
        http = _HealthHTTPServer((host, port), channel)
    except BaseException:
        channel.close()
        raise
    thread = threading.Thread(target=http.serve_forever, name="healthz", daemon=True)
    thread.start()
    log.info("liveness on http://%s%s", address, HEALTH_PATH)
    return HealthServer(http, thread)
