"""``moorage csi serve``: the CSI plugin (csi.moorage.dev) on a unix socket.

    moorage csi serve --endpoint unix:///csi/csi.sock --mode controller --config FILE
    moorage csi serve --endpoint unix:///csi/csi.sock --mode node --node-id NAME \\
        --node-address IP [--config FILE]

``controller`` serves Identity and Controller (beside csi-provisioner,
csi-attacher, csi-resizer, csi-snapshotter); ``node`` serves Identity and
Node (beside node-driver-registrar, or registering itself with kubelet given
``--registration-dir``); ``all`` serves the three (development and
csi-sanity).  ``--health-address`` serves the ``/healthz`` the livenessprobe
sidecar would.  The configuration file is described in ``csi/config.py`` and
docs/csi.md.  The node plugin starts only if its mounts under ``--kubelet-dir``
reach the host (a shared mount: Bidirectional propagation in a pod).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import typer

from moorage.output import CANNOT_START, fail

app = typer.Typer(help="The CSI plugin (csi.moorage.dev).", no_args_is_help=True)
log = logging.getLogger("moorage.csi")


def _fail(message: str) -> typer.Exit:
    """The plugin cannot start: one line on stderr, exit 2 (docs/cli.md)."""
    return fail("csi", message, CANNOT_START)


@app.command("serve")
def serve(
    endpoint: str = typer.Option(
        ..., "--endpoint", envvar="CSI_ENDPOINT", help="unix:///PATH/csi.sock"
    ),
    mode: str = typer.Option("all", "--mode", help="controller, node or all."),
    node_id: str | None = typer.Option(
        None, "--node-id", envvar="NODE_ID", help="This node's name (node and all modes)."
    ),
    node_address: str | None = typer.Option(
        None,
        "--node-address",
        envvar="NODE_ADDRESS",
        help="The IP storage nodes see this node as [the configuration's node.address].",
    ),
    config_file: Path | None = typer.Option(
        None, "--config", envvar="MOORAGE_CSI_CONFIG", help="The plugin's TOML configuration."
    ),
    metrics_address: str | None = typer.Option(
        None, "--metrics-address", help="Serve Prometheus metrics on HOST:PORT."
    ),
    state_dir: Path = typer.Option(
        Path("/var/lib/moorage-csi"),
        "--state-dir",
        envvar="MOORAGE_CSI_STATE_DIR",
        help="Node mode: what is staged and attached, kept across restarts.",
    ),
    kubelet_dir: Path = typer.Option(
        Path("/var/lib/kubelet"),
        "--kubelet-dir",
        envvar="KUBELET_DIR",
        help="Node mode: kubelet's root directory (its --root-dir); every staging and "
        "target path must lie under it.",
    ),
    allow_private_mounts: bool = typer.Option(
        False,
        "--allow-private-mounts",
        help="Node mode: start even if mounts under --kubelet-dir do not propagate (only "
        "for a plugin in kubelet's own mount namespace: development, never in a pod).",
    ),
    registration_dir: Path | None = typer.Option(
        None,
        "--registration-dir",
        help="Node mode: register with kubelet through a socket in this directory "
        "(kubelet's plugins_registry), instead of node-driver-registrar.",
    ),
    kubelet_registration_path: str | None = typer.Option(
        None,
        "--kubelet-registration-path",
        help="With --registration-dir: the CSI socket's path on the host, as kubelet dials it.",
    ),
    health_address: str | None = typer.Option(
        None,
        "--health-address",
        help="Serve GET /healthz (the CSI Probe) on HOST:PORT, instead of livenessprobe.",
    ),
    check_interval: float = typer.Option(
        15.0,
        "--storage-node-check-interval",
        min=0.1,
        max=3600,
        help="Controller mode: seconds between storage-node health checks (metrics and logs).",
    ),
) -> None:
    """Serve the CSI plugin until SIGTERM or SIGINT."""
    from csi.config import ConfigError, PluginConfig, load_config
    from csi.config import node_address as check_address
    from csi.server import MODES, EndpointError, host_port, start_metrics, start_server

    if mode not in MODES:
        raise _fail(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
    kubelet_path = _registration_args(mode, registration_dir, kubelet_registration_path)
    if health_address:
        try:
            host_port(health_address, "--health-address")
        except EndpointError as e:
            raise _fail(str(e)) from None
    try:
        config = load_config(config_file) if config_file else PluginConfig(storage_nodes=())
        address = check_address(node_address, "--node-address") if node_address else None
    except ConfigError as e:
        raise _fail(str(e)) from None
    if mode in ("controller", "all") and not config.storage_nodes:
        raise _fail(f"--mode {mode} needs a --config naming at least one storage node")
    services: list[Any] = []
    from csi.identity import IdentityService, ReadinessCheck, directory_usable
    from csi.proto import csi_pb2_grpc as pb_grpc

    storage_nodes = None
    if mode in ("controller", "all"):
        from csi.controller import ControllerService
        from csi.storagenodes import StorageNodes

        storage_nodes = StorageNodes(config)
        services.append(
            (pb_grpc.add_ControllerServicer_to_server, ControllerService(storage_nodes))
        )
    # Probe answers for this process only, never for a storage node (csi/identity.py)
    checks: list[ReadinessCheck] = []
    if mode in ("node", "all"):
        checks.append(directory_usable(state_dir, "state directory"))
    identity = IdentityService(controller=storage_nodes is not None, checks=checks)
    services.append((pb_grpc.add_IdentityServicer_to_server, identity))
    kernel_nbd_dir: Path | None = None  # the node's kernel nbd devices are watched
    if mode in ("node", "all"):
        from csi.node import NodeService

        address = address or config.node.address
        from fuse.cgroup import ENV as FUSE_CGROUP_ENV
        from fuse.cgroup import CgroupError, check_name

        try:
            if os.environ.get(FUSE_CGROUP_ENV):
                check_name(os.environ[FUSE_CGROUP_ENV])
        except CgroupError as e:
            raise _fail(str(e)) from None
        if not node_id or not address:
            raise _fail(f"--mode {mode} needs --node-id and --node-address (or node.address)")
        # before anything is mounted: a restart must not strand what it cannot reach
        _check_propagation(kubelet_dir, allow_private_mounts)
        try:
            ephemeral_nodes = storage_nodes
            if ephemeral_nodes is None and config.storage_nodes:
                from csi.storagenodes import StorageNodes

                ephemeral_nodes = StorageNodes(config)
            node = NodeService(
                node_id,
                address,
                config.node,
                state_dir,
                storage_nodes=ephemeral_nodes,
                kubelet_dir=kubelet_dir,
            )
            services.append((pb_grpc.add_NodeServicer_to_server, node))
            if node.plan.block == "kernel-nbd":
                kernel_nbd_dir = node.state.attach_dir
        except (ValueError, OSError) as e:
            raise _fail(str(e)) from None

    def add(server: grpc.Server) -> None:
        for register, service in services:
            register(service, server)

    stop = threading.Event()
    refusals: list[str] = []

    def on_refused(reason: str) -> None:
        refusals.append(reason)
        stop.set()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    # set before anything serves, so that a signal meanwhile still cleans up
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # what is started is stopped in reverse: kubelet's registration first
    running = ExitStack()
    try:
        if metrics_address:
            start_metrics(metrics_address)
        running.callback(start_server(endpoint, add).stop)
        if storage_nodes is not None:
            from csi.storagenodehealth import StorageNodeHealth

            watch = StorageNodeHealth(storage_nodes, check_interval)
            watch.start()
            running.callback(watch.stop)
        if kernel_nbd_dir is not None:
            running.callback(_watch_kernel_nbd(kernel_nbd_dir))
        if health_address:
            from csi.health import start_health

            running.callback(start_health(health_address, endpoint).stop)
        if registration_dir is not None and kubelet_path is not None:
            from csi.registration import RegistrationService, serve_registration

            registration = RegistrationService(kubelet_path, on_refused)
            running.callback(serve_registration(registration_dir, registration).stop)
    except (EndpointError, OSError) as e:
        running.close()
        raise _fail(str(e)) from None

    log.info("csi plugin in %s mode", mode)
    stop.wait()
    running.close()
    if storage_nodes is not None:
        storage_nodes.close()
    if refusals:
        # as node-driver-registrar does: the container restarts and kubelet retries
        log.error("stopping: kubelet refused the registration (%s)", refusals[0])
        raise typer.Exit(1)


def _watch_kernel_nbd(attach_dir: Path) -> Callable[[], None]:
    """Reconnect this node's kernel nbd devices when their storage node comes back
    (csi.attach.reconnect); the function that stops it."""
    from csi import attach

    try:
        reconnector = attach.Reconnector(attach_dir)
    except attach.AttachError as e:
        log.warning("kernel nbd devices will not be reconnected: %s", e)
        return lambda: None
    thread = reconnector.start_thread()

    def stop() -> None:
        reconnector.stop()
        thread.join(10)
        reconnector.close()

    return stop


def _check_propagation(kubelet_dir: Path, allow_private: bool) -> None:
    """Refuse to start when mounts under ``kubelet_dir`` would not reach kubelet."""
    from csi.mounts import PropagationError, check_propagation

    if not kubelet_dir.is_absolute():
        raise _fail(f"--kubelet-dir {str(kubelet_dir)[:80]!r} is not an absolute path")
    if allow_private:
        log.warning("--allow-private-mounts: mount propagation of %s is not checked", kubelet_dir)
        return
    try:
        entry = check_propagation(kubelet_dir)
    except PropagationError as e:
        raise _fail(str(e)) from None
    log.info(
        "mounts under %s propagate (mount %s, peer group %s)",
        kubelet_dir,
        entry.mount_point,
        entry.peer_group,
    )


def _registration_args(mode: str, directory: Path | None, kubelet_path: str | None) -> str | None:
    """The checked ``--kubelet-registration-path``, or None without ``--registration-dir``."""
    from csi.registration import kubelet_endpoint
    from csi.server import EndpointError

    if directory is None and kubelet_path is None:
        return None
    if mode == "controller":
        raise _fail("--registration-dir is for the node plugin (--mode node or all)")
    if directory is None:
        raise _fail("--kubelet-registration-path is used only with --registration-dir")
    if kubelet_path is None:
        raise _fail("--registration-dir needs --kubelet-registration-path (CSI socket on the host)")
    if not directory.is_absolute():
        raise _fail(f"--registration-dir {str(directory)[:80]!r} is not an absolute path")
    try:
        return kubelet_endpoint(kubelet_path)
    except EndpointError as e:
        raise _fail(str(e)) from None
