"""``moorage dev cluster up|status|down``: a real Kubernetes on this machine (docs/e2e.md)."""

from __future__ import annotations

import json

import typer

from moorage.output import CANNOT_START, fail

app = typer.Typer(help="Development tools.", no_args_is_help=True)
cluster_app = typer.Typer(
    help="A single-machine Kubernetes cluster running moorage (docs/e2e.md).",
    no_args_is_help=True,
)
app.add_typer(cluster_app, name="cluster")


def _tools() -> object:
    from moorage.devcluster.tools import Tools

    try:
        return Tools.from_env()
    except LookupError as e:
        raise fail("dev cluster", str(e), CANNOT_START) from None


@cluster_app.command("up")
def up(
    install: bool = typer.Option(True, help="Install moorage's Helm chart once the node is Ready."),
) -> None:
    """Start the cluster (or what of it is not running) and install moorage."""
    from moorage.devcluster import cluster, procs
    from moorage.devcluster.layout import Layout

    layout = Layout()
    tools = _tools()
    try:
        cluster.up(layout, tools, install=install)  # type: ignore[arg-type]
    except (procs.ClusterError, TimeoutError, RuntimeError) as e:
        raise fail(
            "dev cluster up",
            f"{e}; the parts that came up keep running, `moorage dev cluster down` removes them",
        ) from None
    typer.echo(
        f"cluster up; kubectl: nsenter --net=/run/netns/moorage-e2e-cp kubectl "
        f"--kubeconfig={layout.admin_kubeconfig} get pods -A"
    )


@cluster_app.command("status")
def status() -> None:
    """What runs, and what the API server says about nodes and pods (JSON)."""
    from moorage.devcluster import cluster
    from moorage.devcluster.layout import Layout
    from moorage.devcluster.tools import Tools

    try:
        tools: Tools | None = Tools.from_env()
    except LookupError:
        tools = None
    typer.echo(json.dumps(cluster.status(Layout(), tools), indent=2))


@cluster_app.command("down")
def down() -> None:
    """Remove the cluster: workloads and volumes through the API, then every
    process, mount and namespace it made."""
    from moorage.devcluster import cluster
    from moorage.devcluster.layout import Layout
    from moorage.devcluster.tools import Tools

    try:
        tools: Tools | None = Tools.from_env()
    except LookupError:
        tools = None
    cluster.down(Layout(), tools)
