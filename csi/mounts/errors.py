"""The errors of the node's mount and filesystem mechanics.

A tool that fails raises :class:`MountError` carrying the argv, the exit
status and the tool's stderr.  A device or mount found in a state an
operation must not touch raises :class:`FilesystemError` before anything is
changed; mount options that could smuggle in others raise
:class:`MountOptionError`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence


class MountError(Exception):
    """A tool failed: its argv, its exit status (None: it did not finish) and its stderr."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        status = "did not finish" if returncode is None else f"exited {returncode}"
        super().__init__(f"{shlex.join(self.argv)} {status}: {self.stderr or '(no output)'}")


class FilesystemError(Exception):
    """A device or mount is not in a state the operation may touch; nothing was changed."""


class OnlineGrowUnsupported(FilesystemError):
    """The kernel refused to grow the mounted filesystem: unmount it and grow it offline."""


class MountOptionError(ValueError):
    """A mount option, filesystem type, label or path that is not allowed."""
