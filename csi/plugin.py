"""The CSI plugin as one object: the services of a mode, and every listener and
background job they need, started together and stopped together.

:class:`Plugin` is built from a :class:`ServeConfig` (what ``moorage csi
serve`` was told) and checks it, touching nothing on the host.
:meth:`Plugin.start` then, in this order: refuses to start a node plugin
whose mounts under kubelet's directory would not reach the host (before
anything is made, so a restart never strands what it cannot reach); makes
the node state directory, learns the host's attach paths and reconciles the
node state with what exists; serves metrics, the CSI socket, ``/healthz``
and kubelet's registration socket as asked (the metrics with the count of
volumes last reported abnormal, node), and starts the storage-node
health checks (controller) and the kernel nbd reconnect thread (node, on the
kernel nbd path).  It logs ``csi plugin in MODE mode`` once every listener
answers.  A start that fails undoes what it did and raises
:class:`StartError`.

:meth:`Plugin.stop` undoes all of it in reverse, each step bounded:
kubelet's registration first (kubelet forgets the driver), the CSI socket
last with a grace period for calls under way; sockets are removed and
threads joined.  kubelet refusing the registration ends :meth:`Plugin.wait`
as :meth:`Plugin.request_stop` does, and is kept in :attr:`Plugin.refusal`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from prometheus_client import REGISTRY, CollectorRegistry

from csi import attach, mounts
from csi.config import PluginConfig
from csi.controller import ControllerService
from csi.groupcontroller import GroupControllerService
from csi.health import start_health
from csi.identity import IdentityService, ReadinessCheck, directory_usable
from csi.kubeletpaths import DEFAULT_ROOT
from csi.node import NodeService
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.registration import RegistrationService, serve_registration
from csi.server import MODES, EndpointError, Mode, start_metrics, start_server
from csi.storagenodehealth import CHECK_INTERVAL, StorageNodeHealth
from csi.storagenodes import StorageNodes
from csi.volumeconditions import VolumeConditionsCollector

log = logging.getLogger("moorage.csi")

DEFAULT_STATE_DIR = Path("/var/lib/moorage-csi")
GRACE = 5.0  # seconds the CSI calls under way get when the plugin stops
RECONNECT_JOIN = 10.0  # the reconnect thread's current try ends within its handshake timeout


class StartError(Exception):
    """The plugin cannot start: one line saying why."""


@dataclass(frozen=True)
class ServeConfig:
    """What the plugin serves and where: the configuration file and the
    command's options (``moorage csi serve --help`` says what each is)."""

    endpoint: str
    file: PluginConfig = field(default_factory=lambda: PluginConfig(storage_nodes=()))
    node_id: str | None = None
    node_address: str | None = None  # None: the file's node.address
    state_dir: Path = DEFAULT_STATE_DIR
    kubelet_dir: Path = DEFAULT_ROOT
    allow_private_mounts: bool = False
    registration_dir: Path | None = None
    kubelet_registration_path: str | None = None  # checked: csi.registration.kubelet_endpoint
    health_address: str | None = None
    metrics_address: str | None = None
    storage_node_check_interval: float = CHECK_INTERVAL


class Plugin:
    """One ``moorage csi serve``: :meth:`start`, :meth:`wait`, :meth:`stop`."""

    def __init__(
        self, config: ServeConfig, mode: str, registry: CollectorRegistry | None = None
    ) -> None:
        """Check ``config`` for ``mode`` and build the services; :class:`StartError`
        names what is wrong.  ``registry``: where the plugin's metrics go (None:
        prometheus-client's default, which one process can fill only once)."""
        if mode not in MODES:
            raise StartError(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode: Mode = mode
        self.config = config
        self.registry = registry
        self.refusal: str | None = None
        self._stop_requested = threading.Event()
        self._running: ExitStack | None = None
        serves_node = mode in ("node", "all")
        if config.registration_dir is not None and not serves_node:
            raise StartError("--registration-dir is for the node plugin (--mode node or all)")
        # the controller's, and the node's for ephemeral volumes
        self.storage_nodes = StorageNodes(config.file) if config.file.storage_nodes else None
        self.controller: ControllerService | None = None
        self.group_controller: GroupControllerService | None = None
        if mode in ("controller", "all"):
            if self.storage_nodes is None:
                raise StartError(f"--mode {mode} needs a --config naming at least one storage node")
            self.controller = ControllerService(self.storage_nodes)
            self.group_controller = GroupControllerService(self.storage_nodes)
        self.node = self._node_service(mode) if serves_node else None
        # Probe answers for this process only, never for a storage node (csi/identity.py)
        checks: list[ReadinessCheck] = []
        if self.node is not None:
            checks.append(directory_usable(config.state_dir, "state directory"))
        self.identity = IdentityService(controller=self.controller is not None, checks=checks)

    def _node_service(self, mode: str) -> NodeService:
        config = self.config
        address = config.node_address or config.file.node.address
        if not config.node_id or not address:
            raise StartError(f"--mode {mode} needs --node-id and --node-address (or node.address)")
        if not config.kubelet_dir.is_absolute():
            shown = str(config.kubelet_dir)[:80]
            raise StartError(f"--kubelet-dir {shown!r} is not an absolute path")
        try:
            return NodeService(
                config.node_id,
                address,
                config.file.node,
                config.state_dir,
                storage_nodes=self.storage_nodes,
                kubelet_dir=config.kubelet_dir,
            )
        except ValueError as e:
            raise StartError(str(e)) from None

    # -- start and stop

    def start(self) -> None:
        """Start everything (the module docstring says what, in which order);
        :class:`StartError` after undoing what was started."""
        if self._running is not None:
            raise RuntimeError("the plugin is running already")
        running = ExitStack()
        try:
            self._start(running)
        except BaseException:
            running.close()
            raise
        self._running = running
        log.info("csi plugin in %s mode", self.mode)

    def _start(self, running: ExitStack) -> None:
        config = self.config
        if self.storage_nodes is not None:
            running.callback(self.storage_nodes.close)  # last: nothing calls them then
        if self.node is not None:
            self._check_propagation()
            try:
                self.node.recover()
            except (ValueError, OSError, attach.AttachError) as e:
                raise StartError(str(e)) from None
        try:
            if config.metrics_address:
                if self.node is not None:
                    self._count_abnormal_volumes(running, self.node)
                running.callback(start_metrics(config.metrics_address, self.registry))
            server = start_server(config.endpoint, self._add_services, self.registry)
            running.callback(server.stop, GRACE)
            if self.controller is not None and self.storage_nodes is not None:
                watch = StorageNodeHealth(
                    self.storage_nodes, config.storage_node_check_interval, self.registry
                )
                watch.start()
                running.callback(watch.stop)
            if self.node is not None and self.node.plan.block == "kernel-nbd":
                running.callback(_watch_kernel_nbd(self.node.state.attach_dir))
            if config.health_address:
                running.callback(start_health(config.health_address, config.endpoint).stop)
            kubelet_path = config.kubelet_registration_path
            if config.registration_dir is not None and kubelet_path is not None:
                registration = RegistrationService(kubelet_path, self._refused)
                running.callback(serve_registration(config.registration_dir, registration).stop)
        except (EndpointError, OSError) as e:
            raise StartError(str(e)) from None

    def _count_abnormal_volumes(self, running: ExitStack, node: NodeService) -> None:
        registry = REGISTRY if self.registry is None else self.registry
        collector = VolumeConditionsCollector(node.conditions, node.state.has)
        registry.register(collector)
        running.callback(registry.unregister, collector)

    def _add_services(self, server: grpc.Server) -> None:
        services: list[tuple[Callable[..., None], object]] = [
            (pb_grpc.add_IdentityServicer_to_server, self.identity)
        ]
        if self.controller is not None:
            services.append((pb_grpc.add_ControllerServicer_to_server, self.controller))
        if self.group_controller is not None:
            services.append((pb_grpc.add_GroupControllerServicer_to_server, self.group_controller))
        if self.node is not None:
            services.append((pb_grpc.add_NodeServicer_to_server, self.node))
        for register, service in services:
            register(service, server)

    def _check_propagation(self) -> None:
        """Refuse to start when mounts under kubelet's directory would not reach kubelet."""
        kubelet_dir = self.config.kubelet_dir
        if self.config.allow_private_mounts:
            log.warning(
                "--allow-private-mounts: mount propagation of %s is not checked", kubelet_dir
            )
            return
        try:
            entry = mounts.check_propagation(kubelet_dir)
        except mounts.PropagationError as e:
            raise StartError(str(e)) from None
        log.info(
            "mounts under %s propagate (mount %s, peer group %s)",
            kubelet_dir,
            entry.mount_point,
            entry.peer_group,
        )

    def _refused(self, reason: str) -> None:
        """kubelet refused to register the plugin: the plugin stops, as
        node-driver-registrar does (its container restarts, kubelet retries)."""
        if self.refusal is None:
            self.refusal = reason
        self._stop_requested.set()

    def request_stop(self) -> None:
        """End :meth:`wait` (from a signal handler, say); nothing is stopped yet."""
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until :meth:`request_stop`, or kubelet refuses the registration; False
        if ``timeout`` seconds passed first."""
        return self._stop_requested.wait(timeout)

    def stop(self) -> None:
        """Stop everything :meth:`start` started, in reverse; again: nothing."""
        running, self._running = self._running, None
        self._stop_requested.set()
        if running is not None:
            running.close()
            log.info("csi plugin stopped")

    def __enter__(self) -> Plugin:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _watch_kernel_nbd(attach_dir: Path) -> Callable[[], None]:
    """Reconnect this node's kernel nbd devices when their storage node comes back
    (csi.attach.Reconnector, in a thread); the function that stops it."""
    reconnector = attach.Reconnector(attach_dir)
    try:
        reconnector.open()
    except attach.AttachError as e:
        log.warning("kernel nbd devices will not be reconnected: %s", e)
        return lambda: None
    thread = reconnector.start_thread()

    def stop() -> None:
        reconnector.stop()
        thread.join(RECONNECT_JOIN)
        reconnector.close()

    return stop
