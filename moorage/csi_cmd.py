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
docs/csi.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
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
    from csi.identity import IdentityService
    from csi.proto import csi_pb2_grpc as pb_grpc

    storage_nodes = None
    if mode in ("controller", "all"):
        from csi.controller import ControllerService
        from csi.storagenodes import StorageNodes

        storage_nodes = StorageNodes(config)
        services.append(
            (pb_grpc.add_ControllerServicer_to_server, ControllerService(storage_nodes))
        )
    services.append((pb_grpc.add_IdentityServicer_to_server, IdentityService(storage_nodes)))
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
        try:
            ephemeral_nodes = storage_nodes
            if ephemeral_nodes is None and config.storage_nodes:
                from csi.storagenodes import StorageNodes

                ephemeral_nodes = StorageNodes(config)
            node = NodeService(
                node_id, address, config.node, state_dir, storage_nodes=ephemeral_nodes
            )
            services.append((pb_grpc.add_NodeServicer_to_server, node))
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
