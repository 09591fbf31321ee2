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
    from moorage_dev.devcluster.tools import Tools

    try:
        return Tools.from_env()
    except LookupError as e:
        raise fail("dev cluster", str(e), CANNOT_START) from None


@cluster_app.command("up")
def up(
    install: bool = typer.Option(True, help="Install moorage's Helm chart once the node is Ready."),
) -> None:
    """Start the cluster (or what of it is not running) and install moorage."""
    from moorage_dev.devcluster import cluster, procs
    from moorage_dev.devcluster.layout import Layout

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
    from moorage_dev.devcluster import cluster
    from moorage_dev.devcluster.layout import Layout
    from moorage_dev.devcluster.tools import Tools

    try:
        tools: Tools | None = Tools.from_env()
    except LookupError:
        tools = None
    typer.echo(json.dumps(cluster.status(Layout(), tools), indent=2))


@cluster_app.command("down")
def down() -> None:
    """Remove the cluster: workloads and volumes through the API, then every
    process, mount and namespace it made."""
    from moorage_dev.devcluster import cluster
    from moorage_dev.devcluster.layout import Layout
    from moorage_dev.devcluster.tools import Tools

    try:
        tools: Tools | None = Tools.from_env()
    except LookupError:
        tools = None
    cluster.down(Layout(), tools)


@app.command("conformance")
def conformance(
    classes: list[str] = typer.Option(
        ["block", "nfs"], "--class", help="Which of the chart's classes (block, nfs); repeatable."
    ),
    procs: int = typer.Option(4, min=1, max=16, help="ginkgo's parallel processes."),
    focus: str = typer.Option("External.Storage", help="ginkgo --focus (a regular expression)."),
    skip: str = typer.Option(
        r"\[Disruptive\]|\[Serial\]|\[Slow\]|\[Flaky\]",
        help="ginkgo --skip (a regular expression).",
    ),
) -> None:
    """Kubernetes' External Storage suite against the chart's classes (docs/e2e.md).

    Uses the cluster `moorage dev cluster up` left running (and leaves it up),
    or brings one up for the run and takes it down after it.  Exits 1 when a
    spec failed."""
    from moorage_dev.devcluster import cluster
    from moorage_dev.devcluster import conformance as suite_run
    from moorage_dev.devcluster import procs as daemons
    from moorage_dev.devcluster.layout import Layout

    for which in classes:
        if which not in suite_run.CLASSES:
            raise fail("dev conformance", f"no class {which!r}; the chart's: block, nfs")
    try:
        suite = suite_run.Suite.from_env()
    except LookupError as e:
        raise fail("dev conformance", str(e), CANNOT_START) from None
    tools = _tools()
    layout = Layout()
    already_up = daemons.running(layout, "kube-apiserver")
    try:
        kube = cluster.up(layout, tools)  # type: ignore[arg-type]
        results = suite_run.run(layout, kube, suite, classes, procs, focus, skip, typer.echo)
    except (daemons.ClusterError, TimeoutError, RuntimeError) as e:
        raise fail("dev conformance", str(e)) from None
    finally:
        if not already_up:
            cluster.down(layout, tools)  # type: ignore[arg-type]
    if any(c.failed for c in results.values()):
        raise typer.Exit(1)
