"""The ``moorage`` command line."""

from __future__ import annotations

import logging

import typer

from moorage import admin_cmd, attach_cmd, backend_cmd, demo, nbd_cmd

app = typer.Typer(
    help="moorage: a self-hosted storage node (NFS and NBD) with a Kubernetes CSI driver.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(nbd_cmd.app, name="nbd")
app.add_typer(backend_cmd.app, name="backend")
app.add_typer(admin_cmd.volume_app, name="volume")
app.add_typer(admin_cmd.snapshot_app, name="snapshot")
app.add_typer(admin_cmd.pool_app, name="pool")
app.command(name="demo")(demo.demo)
app.add_typer(attach_cmd.attach_app, name="attach")
app.command(name="detach")(attach_cmd.detach)
app.add_typer(attach_cmd.mount_app, name="mount")
app.command(name="unmount")(attach_cmd.unmount)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at debug level."),
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main() -> None:
    app()
