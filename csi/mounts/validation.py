"""What may go into a mount tool's argv: options, filesystem types, paths, devices.

Mount options come from an allowlist of characters, one option at a time,
so that none can smuggle in others; anything else raises
:class:`~csi.mounts.errors.MountOptionError` before a tool runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from csi.mounts.errors import MountOptionError

# One mount option: no comma (it would add options), no whitespace, quotes or
# backslashes (mount(8) and the kernel parse those), nothing to start a flag.
_OPTION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/=+@-]*")
_MAX_OPTION = 256
_FSTYPE = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")


def validate_options(options: Iterable[str]) -> tuple[str, ...]:
    """Each option alone, from an allowlist of characters; a comma-joined string is refused."""
    if isinstance(options, str):
        raise MountOptionError(
            f"mount options must be a list of options, not a string: {options!r}"
        )
    checked: list[str] = []
    for option in options:
        if (
            not isinstance(option, str)
            or len(option) > _MAX_OPTION
            or not _OPTION.fullmatch(option)
        ):
            raise MountOptionError(f"mount option not allowed: {option!r}")
        checked.append(option)
    return tuple(checked)


def validate_fstype(fstype: str) -> str:
    if not _FSTYPE.fullmatch(fstype):
        raise MountOptionError(f"filesystem type not allowed: {fstype!r}")
    return fstype


def validate_path(path: str | os.PathLike[str], what: str) -> str:
    text = os.fspath(path)
    if not text or "\0" in text or "\n" in text:
        raise MountOptionError(f"{what} not allowed: {text!r}")
    return os.path.abspath(text)


def validate_device(device: str | os.PathLike[str]) -> str:
    text = os.fspath(device)
    # absolute, so a tool never takes it for an option
    if not os.path.isabs(text) or "\0" in text or "\n" in text:
        raise MountOptionError(f"a device must be an absolute path: {text!r}")
    return text


def validate_source(source: str) -> str:
    if not source or source.startswith("-") or any(c in source for c in "\0\n"):
        raise MountOptionError(f"mount source not allowed: {source!r}")
    return source
