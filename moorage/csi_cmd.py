"""``moorage csi serve``: the CSI plugin (csi.moorage.dev) on a unix socket.

    moorage csi serve --endpoint unix:///csi/csi.sock --mode controller --config FILE
    moorage csi serve --endpoint unix:///csi/csi.sock --mode node --node-id NAME \\
        --node-address IP [--config FILE]

``controller`` serves Identity and Controller (beside csi-provisioner,
csi-attacher, csi-resizer, csi-snapshotter); ``node`` serves Identity and
Node (beside node-driver-registrar, or registering itself with kubelet given
``--registration-dir``); ``all`` serves the three (development and
csi-sanity).  The configuration file is described in docs/csi.md.

This module owns the options: it checks those that go together, reads the
configuration file and builds the plugin's configuration from both; the
plugin itself (``csi.plugin``) starts and stops what the mode serves.  A
plugin that cannot start is one line on stderr and exit status 2; it runs
until SIGTERM or SIGINT, and a registration kubelet refused ends it with
status 1.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

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
    from csi.plugin import Plugin, ServeConfig, StartError
    from csi.server import EndpointError, host_port

    kubelet_path = _registration_args(registration_dir, kubelet_registration_path)
    if health_address:
        try:
            host_port(health_address, "--health-address")
        except EndpointError as e:
            raise _fail(str(e)) from None
    try:
        file = load_config(config_file) if config_file else PluginConfig(storage_nodes=())
        address = check_address(node_address, "--node-address") if node_address else None
    except ConfigError as e:
        raise _fail(str(e)) from None
    if mode in ("node", "all"):
        _check_fuse_cgroup()
    config = ServeConfig(
        endpoint=endpoint,
        file=file,
        node_id=node_id,
        node_address=address,
        state_dir=state_dir,
        kubelet_dir=kubelet_dir,
        allow_private_mounts=allow_private_mounts,
        registration_dir=registration_dir,
        kubelet_registration_path=kubelet_path,
        health_address=health_address,
        metrics_address=metrics_address,
        storage_node_check_interval=check_interval,
    )
    try:
        plugin = Plugin(config, mode)
    except StartError as e:
        raise _fail(str(e)) from None

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        plugin.request_stop()

    # set before anything serves, so that a signal meanwhile still cleans up
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        plugin.start()
    except StartError as e:
        raise _fail(str(e)) from None
    try:
        plugin.wait()
    finally:
        plugin.stop()
    if plugin.refusal is not None:
        # as node-driver-registrar does: the container restarts and kubelet retries
        log.error("stopping: kubelet refused the registration (%s)", plugin.refusal)
        raise typer.Exit(1)


def _check_fuse_cgroup() -> None:
    """A bad ``MOORAGE_FUSE_CGROUP`` stops the node plugin before it starts."""
    from fuse.cgroup import ENV, CgroupError, check_name

    try:
        if os.environ.get(ENV):
            check_name(os.environ[ENV])
    except CgroupError as e:
        raise _fail(str(e)) from None


def _registration_args(directory: Path | None, kubelet_path: str | None) -> str | None:
    """The checked ``--kubelet-registration-path``, or None without ``--registration-dir``."""
    from csi.registration import kubelet_endpoint
    from csi.server import EndpointError

    if directory is None and kubelet_path is None:
        return None
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
