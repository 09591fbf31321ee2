"""The ``moorage`` command line.

Each command group lives in its own module and is imported only when it is
used (or when the whole command list is shown): ``moorage nbd serve`` must
not carry the storage node's gRPC, SQLAlchemy and Alembic in its memory.
"""

from __future__ import annotations

import importlib
import importlib.util
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
    "attach": ("moorage.attach_cmd", "attach_app", "group"),
    "detach": ("moorage.attach_cmd", "detach", "command"),
    "mount": ("moorage.attach_cmd", "mount_app", "group"),
    "unmount": ("moorage.attach_cmd", "unmount", "command"),
    "csi": ("moorage.csi_cmd", "app", "group"),
}
# The developer's commands live in ``moorage_dev``: a source checkout has them,
# the container image does not (deploy/image/build.sh leaves the package out).
DEV_PACKAGE = "moorage_dev"
DEV_COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("moorage_dev.demo", "demo", "command"),
    "dev": ("moorage_dev.dev_cmd", "app", "group"),
}


def available_commands() -> dict[str, tuple[str, str, str]]:
    """Every command this installation has: the developer's ones only where
    their package is installed."""
    if importlib.util.find_spec(DEV_PACKAGE) is None:
        return dict(COMMANDS)
    return {**COMMANDS, **DEV_COMMANDS}


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
    commands = available_commands()
    names = [only] if only in commands else list(commands)
    for name in names:
        assert name is not None
        module, attribute, kind = commands[name]
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
