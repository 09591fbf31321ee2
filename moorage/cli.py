"""The ``moorage`` command line.

Each command group lives in its own module and is imported only when it is
used (or when the whole command list is shown): ``moorage nbd serve`` must
not carry the storage node's gRPC, SQLAlchemy and Alembic in its memory.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import typer

from moorage.output import tidy_help

# name → (module, attribute, kind): "group" is a Typer sub-app, "command" a function.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "nbd": ("moorage.nbd_cmd", "app", "group"),
    "backend": ("moorage.backend_cmd", "app", "group"),
    "volume": ("moorage.admin_cmd", "volume_app", "group"),
    "snapshot": ("moorage.admin_cmd", "snapshot_app", "group"),
    "pool": ("moorage.admin_cmd", "pool_app", "group"),
    "demo": ("moorage.demo", "demo", "command"),
    "attach": ("moorage.attach_cmd", "attach_app", "group"),
    "detach": ("moorage.attach_cmd", "detach", "command"),
    "mount": ("moorage.attach_cmd", "mount_app", "group"),
    "unmount": ("moorage.attach_cmd", "unmount", "command"),
    "csi": ("moorage.csi_cmd", "app", "group"),
    "dev": ("moorage.dev_cmd", "app", "group"),
}


def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at debug level."),
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def build_app(only: str | None = None) -> typer.Typer:
    """The CLI with every command, or with just ``only`` when it names one."""
    app = typer.Typer(
        help="moorage: a self-hosted storage node (NFS and NBD) with a Kubernetes CSI driver.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    names = [only] if only in COMMANDS else list(COMMANDS)
    for name in names:
        assert name is not None
        module, attribute, kind = COMMANDS[name]
        target = getattr(importlib.import_module(module), attribute)
        if kind == "group":
            app.add_typer(target, name=name)
        else:
            app.command(name=name)(target)
    return app


def _command_word(argv: list[str]) -> str | None:
    """The first word that is not an option of the root command."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def command(only: str | None = None) -> Any:
    """The click command tree ``moorage`` runs, its help tidied (``moorage.output``)."""
    return tidy_help(typer.main.get_command(build_app(only)))


def main() -> None:
    command(_command_word(sys.argv[1:]))(prog_name="moorage")
