"""The CSI plugin's gRPC server: its unix socket, and what every call passes.

Every call goes through the one error interceptor of moorage's gRPC servers,
which answers the services' typed errors with their status codes; its
observer here writes one log line per call (method, the volume or snapshot
it is about, duration, status code) and records the call in the
``csi_plugin_operations_seconds`` histogram.  Requests are never logged
whole: they carry secrets.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, start_http_server

from backend.api.interceptor import ErrorInterceptor, Observer, Outcome
from hostio.addresses import HostPortError, parse_host_port

log = logging.getLogger("moorage.csi")

DRIVER_NAME = "csi.moorage.dev"
Mode = Literal["controller", "node", "all"]
MODES: tuple[Mode, ...] = ("controller", "node", "all")
WORKERS = 32  # above the provisioner's and attacher's default worker counts
_UNIX = "unix://"
_SUBJECT_FIELDS = ("volume_id", "snapshot_id", "group_snapshot_id", "source_volume_id", "name")


class EndpointError(ValueError):
    """The endpoint is malformed, or another plugin is serving on it."""


def socket_path(endpoint: str) -> Path:
    """The path of a ``unix:///abs/path`` endpoint, as the sidecars write it."""
    if not endpoint.startswith(_UNIX):
        raise EndpointError(f"endpoint {endpoint[:80]!r} is not unix:///ABSOLUTE/PATH")
    path = Path(endpoint[len(_UNIX) :])
    if not path.is_absolute() or path == Path("/"):
        raise EndpointError(f"endpoint {endpoint[:80]!r} does not name an absolute socket path")
    if len(os.fsencode(path)) > 107:
        raise EndpointError(f"socket path {path} is longer than a unix socket address allows")
    return path


def claim_socket(path: Path) -> None:
    """Make ``path`` free for a new socket: a stale socket file is removed, a live
    one (a plugin still serving) or any other file is refused."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s", path)
            path.unlink(missing_ok=True)
            return
        except OSError as e:
            raise EndpointError(f"cannot tell whether {path} is in use: {e.strerror}") from e
    raise EndpointError(f"another process is serving on {path}")


def _subject(request: Any) -> str:
    for name in _SUBJECT_FIELDS:
        value = getattr(request, name, "")
        if isinstance(value, str) and value:
            return f"{name}={value[:140]}"
    return ""


def call_observer(histogram: Histogram) -> Observer:
    """One log line and one histogram sample per call."""

    def observe(call: Outcome) -> None:
        histogram.labels(DRIVER_NAME, call.method, call.code.name).observe(call.seconds)
        level = logging.INFO if call.code == grpc.StatusCode.OK else logging.WARNING
        log.log(
            level,
            "%s %s %.3fs %s%s",
            call.name,
            _subject(call.request),
            call.seconds,
            call.code.name,
            f": {call.message}" if call.message else "",
        )

    return observe


def operations_histogram(registry: CollectorRegistry | None = None) -> Histogram:
    return Histogram(
        "csi_plugin_operations_seconds",
        "Duration of the CSI calls this plugin served, by method and status code.",
        ["driver_name", "method_name", "grpc_status_code"],
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        registry=REGISTRY if registry is None else registry,
    )


def stop_grpc(server: grpc.Server, workers: futures.ThreadPoolExecutor, grace: float) -> None:
    """Stop ``server``: calls under way get ``grace`` seconds, then are cancelled;
    its worker threads are waited for as long again, at most (a handler stuck in
    a mount is left to end on its own)."""
    server.stop(grace).wait(grace + 1)
    shutdown = threading.Thread(
        target=workers.shutdown, kwargs={"cancel_futures": True}, name="grpc-stop", daemon=True
    )
    shutdown.start()
    shutdown.join(grace + 1)
    if shutdown.is_alive():
        log.warning("calls still running %.0fs after the server stopped: left to end", grace)


@dataclass
class RunningServer:
    server: grpc.Server
    workers: futures.ThreadPoolExecutor
    path: Path

    def stop(self, grace: float = 5.0) -> None:
        stop_grpc(self.server, self.workers, grace)
        self.path.unlink(missing_ok=True)


def start_server(
    endpoint: str,
    add_services: Callable[[grpc.Server], None],
    registry: CollectorRegistry | None = None,
) -> RunningServer:
    """Serve the services ``add_services`` registers on the endpoint's unix socket."""
    path = socket_path(endpoint)
    claim_socket(path)
    workers = futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="csi")
    server = grpc.server(
        workers,
        interceptors=[ErrorInterceptor(log, call_observer(operations_histogram(registry)))],
    )
    add_services(server)
    old_umask = os.umask(0o077)  # the socket is for the sidecars and kubelet (root) only
    try:
        if server.add_insecure_port(f"unix://{path}") == 0:
            raise EndpointError(f"cannot listen on {path}")
    finally:
        os.umask(old_umask)
    server.start()
    log.info("serving %s on %s", DRIVER_NAME, path)
    return RunningServer(server, workers, path)


def host_port(address: str, what: str) -> tuple[str, int]:
    """A listening ``HOST:PORT`` (``hostio.addresses``; no host: every address)."""
    try:
        host, port = parse_host_port(address, what, allow_empty_host=True)
    except HostPortError as e:
        raise EndpointError(str(e)) from None
    return host or "0.0.0.0", port


def start_metrics(address: str, registry: CollectorRegistry | None = None) -> Callable[[], None]:
    """Prometheus metrics over HTTP on HOST:PORT, in a thread; the function that stops it."""
    host, port = host_port(address, "metrics address")
    kwargs: dict[str, Any] = {"addr": host}
    if registry is not None:
        kwargs["registry"] = registry
    http, thread = start_http_server(port, **kwargs)
    log.info("metrics on http://%s/metrics", address)

    def stop() -> None:
        http.shutdown()
        http.server_close()
        thread.join(5)

    return stop
