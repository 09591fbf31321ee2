"""What every ``moorage`` command does the same way: exit codes, errors, ``--json``, help.

docs/cli.md is the user's page for these conventions; this module is where
the commands get them from.

Exit codes:

- ``OK`` (0): done.
- ``FAILED`` (1): the command ran and what it asked for failed or was refused
  (by the storage node, the kernel, a mount), or a daemon stopped on an error.
- ``CANNOT_START`` (2): nothing was done: the arguments or a configuration
  file are wrong (click's own code for usage errors), or what the command
  needs is missing or taken (a port in use, a live socket, a pool image gone).
- ``UNREACHABLE`` (3): no storage node answered at the address tried.

Errors are one line on stderr, ``moorage COMMAND: message``; stdout carries
only results, and with ``--json`` exactly one JSON document.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio
import typer
from rich.markup import escape
from typer.core import TyperArgument, TyperGroup, TyperOption

OK = 0
FAILED = 1
CANNOT_START = 2
UNREACHABLE = 3


def fail(command: str, message: str, code: int = FAILED) -> typer.Exit:
    """Print ``moorage COMMAND: message`` on stderr; the Exit to raise with ``code``."""
    typer.echo(f"moorage {command}: {message}", err=True)
    return typer.Exit(code)


def print_json(data: Any) -> None:
    """The one JSON document a ``--json`` command prints (keys sorted, indented)."""
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def leaves(error: BaseException) -> Iterator[BaseException]:
    """The exceptions inside (possibly nested) exception groups, or ``error`` itself."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from leaves(inner)
    else:
        yield error


def first_line(error: BaseException) -> str:
    """An error's message on one line (longer details, such as a child's output, are logged)."""
    if isinstance(error, OSError) and error.strerror and not error.filename:
        text = error.strerror
    else:
        text = str(error) or type(error).__name__
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def run_service(
    command: str,
    main: Callable[..., Awaitable[object]],
    *args: object,
    expected: tuple[type[BaseException], ...],
    started: Callable[[], bool],
) -> None:
    """``trio.run(main, *args)`` for a daemon, with its failures as the conventions say.

    An ``expected`` error (a port taken, a pool missing), bare or inside trio's
    exception groups, is printed as one line per error and exits
    ``CANNOT_START`` if ``started()`` was still false, else ``FAILED``; anything
    else is a bug and keeps its traceback.
    """
    try:
        trio.run(main, *args)
    except BaseException as error:
        found = list(leaves(error))
        if not found or not all(isinstance(e, expected) for e in found):
            raise
        messages = list(dict.fromkeys(first_line(e) for e in found))
        for message in messages[:-1]:
            typer.echo(f"moorage {command}: {message}", err=True)
        raise fail(command, messages[-1], FAILED if started() else CANNOT_START) from None


# ------------------------------------------------------------------ help


class _Argument(TyperArgument):
    """An argument shown by its name (``NAME``), without its Python type."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    def get_help_record(self, ctx: Any) -> tuple[str, str] | None:
        if self.hidden:
            return None
        return self._rich_display_name(), self.help or ""


def _metavar(option: TyperOption) -> str:
    longest = max(option.opts, key=len)
    return longest.lstrip("-").replace("-", "_").upper()


def tidy_help(command: Any) -> Any:
    """Help as people read it elsewhere: ``--size SIZE``, a flag alone, ``NAME`` for an
    argument, instead of Typer's ``<str>``/``<bool>`` beside every parameter; and
    brackets in help texts shown as written, not taken for rich's markup.

    Applied to the whole command tree once it is built; returns ``command``.
    """
    if command.help:
        command.help = escape(command.help)
    for param in command.params:
        if getattr(param, "help", None):
            param.help = escape(param.help)  # "[default: ...]" in a help is text, not markup
        if isinstance(param, TyperOption) and param.metavar is None:
            param.metavar = "" if param.is_flag else _metavar(param)
        elif isinstance(param, TyperArgument) and not isinstance(param, _Argument):
            if param.metavar is None:
                param.metavar = (param.name or "arg").upper()
            param.__class__ = _Argument  # same attributes: only how it is displayed changes
    made = command.get_help_option  # --help is made when first asked for

    def help_option(ctx: Any) -> Any:
        option = made(ctx)
        if option is not None:
            option.metavar = ""
        return option

    command.get_help_option = help_option
    if isinstance(command, TyperGroup):
        for sub in command.commands.values():
            tidy_help(sub)
    return command
