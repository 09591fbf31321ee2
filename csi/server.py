"""The CSI plugin's gRPC server: its unix socket, and what every call passes.

Every call goes through :class:`CallObserver`: it maps the services' typed
errors (``csi/errors.py``) to gRPC statuses, writes one log line per call
(method, the volume or snapshot it is about, duration, status code) and
records the call in the ``csi_plugin_operations_seconds`` histogram.
Requests are never logged whole: they carry secrets.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, start_http_server

from csi.errors import CsiError
from hostio.addresses import HostPortError, parse_host_port

log = logging.getLogger("moorage.csi")

DRIVER_NAME = "csi.moorage.dev"
Mode = Literal["controller", "node", "all"]
MODES: tuple[Mode, ...] = ("controller", "node", "all")
WORKERS = 32  # above the provisioner's and attacher's default worker counts
_UNIX = "unix://"
_SUBJECT_FIELDS = ("volume_id", "snapshot_id", "source_volume_id", "name")


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


class _Undecodable:
    """Stands for a request whose bytes are not the method's request message."""

    def __init__(self, size: int) -> None:
        self.size = size


def _tolerant(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The handler's deserializer, answering :class:`_Undecodable` instead of
    raising (grpc would answer INTERNAL and log a traceback per request)."""
    if parse is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception:
            return _Undecodable(len(data))

    return deserialize


# The most of a status message a caller gets (grpc carries it in metadata).
MAX_DETAILS = 1000


class CallObserver(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Errors to statuses, one log line and one histogram sample per call.

    Request bytes that do not parse as the method's message answer
    INVALID_ARGUMENT, with one log line.
    """

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = details.method
        short = method.rsplit("/", 1)[-1]

        def observed(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.monotonic()
            code = grpc.StatusCode.OK
            message = ""
            try:
                if isinstance(request, _Undecodable):  # logged below, once
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    message = f"the request ({request.size} bytes) is not a valid {short} message"
                else:
                    return inner(request, context)
            except CsiError as e:
                code, message = e.code, e.message
            except NotImplementedError:  # a generated servicer's method we did not build
                code, message = grpc.StatusCode.UNIMPLEMENTED, f"{short} is not implemented"
            except Exception as e:
                log.exception("%s failed unexpectedly", short)
                code, message = grpc.StatusCode.INTERNAL, f"internal error: {e}"
            finally:
                if len(message) > MAX_DETAILS:
                    message = message[: MAX_DETAILS - 3] + "..."
                elapsed = time.monotonic() - start
                self.histogram.labels(DRIVER_NAME, method, code.name).observe(elapsed)
                level = logging.INFO if code == grpc.StatusCode.OK else logging.WARNING
                log.log(
                    level,
                    "%s %s %.3fs %s%s",
                    short,
                    _subject(request),
                    elapsed,
                    code.name,
                    f": {message}" if message else "",
                )
            context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(
            observed,
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


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
    server = grpc.server(workers, interceptors=[CallObserver(operations_histogram(registry))])
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
